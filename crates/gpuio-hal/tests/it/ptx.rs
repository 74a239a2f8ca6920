//! The embedded PTX covers every kernel module of this crate, for every architecture it is
//! built for, and was built from the sources embedded now: no GPU and no compiler are needed
//! (`gpuio_hal::kernels::embedded_ptx_problems`; `cargo xtask ptx --check` compares the whole
//! text with a fresh build).

use gpuio_hal::kernels::{MODULES, embedded_ptx_problems};

#[test]
fn the_embedded_ptx_is_built_from_the_embedded_sources() {
    let problems = embedded_ptx_problems(MODULES, "crates/gpuio-hal/ptx");
    assert!(
        problems.is_empty(),
        "{}\nafter changing a kernel, run `cargo xtask ptx --wheels --write` and commit what it \
         writes",
        problems.join("\n")
    );
}
