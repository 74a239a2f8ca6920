//! Every kernel source of this crate compiles with NVRTC for every architecture gpuio supports
//! (Ampere, Hopper, Blackwell), strictly: no fallback to another target, and every kernel the
//! source promises is in the PTX. No GPU is needed, only libnvrtc on the loader's path: CI gets
//! it from PyPI (`cargo xtask ptx --wheels`), the GPU machine from its toolkit. Without
//! libnvrtc the test says so and passes, unless `GPUIO_REQUIRE_NVRTC=1` or
//! `GPUIO_REQUIRE_CUDA=1` makes that a failure.

#![cfg(feature = "cuda")]

use gpuio_hal::gpu::cuda::nvrtc_problems;
use gpuio_hal::kernels::MODULES;
use gpuio_testkit::Requirement;

#[test]
fn every_kernel_compiles_for_every_architecture() {
    match nvrtc_problems(MODULES) {
        Ok(failed) => assert!(failed.is_empty(), "{}", failed.join("\n")),
        Err(missing) => Requirement::Nvrtc.missing(missing),
    }
}
