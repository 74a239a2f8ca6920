//! gpuio-hal's integration tests: one test binary, a module per area, so that the crate's
//! dependencies are linked once and `cargo test -p gpuio-hal --test it <module>::` runs one
//! area. Each module's docs say what it covers. Tests that need a device or a privilege this
//! machine may lack skip with a printed reason, unless `GPUIO_REQUIRE_<X>=1` makes that a
//! failure (`gpuio_testkit::Requirement`).

use gpuio_hal::{BackendPreference, Gpu, Probe, probe};
use gpuio_testkit::Requirement;

mod gpu;
mod hot_rows;
#[cfg(feature = "cuda")]
mod kernels;
mod ptx;
mod resident;
mod rows;
mod tiered;

/// The probed devices: CUDA's where it is available, else the host backend's (saying why, or
/// failing where `GPUIO_REQUIRE_CUDA=1`).
fn devices() -> Probe {
    let p = probe(BackendPreference::Auto).expect("probe never fails with Auto");
    if !p.cuda.available {
        Requirement::Cuda.missing(format_args!(
            "CUDA is unavailable: {} (running on the host backend)",
            p.cuda.detail
        ));
    }
    p
}

/// The first of [`devices`].
fn first_gpu() -> Gpu {
    devices().gpus.remove(0)
}
