//! This crate's kernels: the embedded PTX was built from the sources embedded now (no
//! compiler needed), and NVRTC compiles each source for every architecture gpuio supports
//! (skipped without libnvrtc unless `GPUIO_REQUIRE_NVRTC=1`).

use gpuio_ai_device::kernels::MODULES;
use gpuio_hal::gpu::cuda::nvrtc_problems;
use gpuio_hal::kernels::embedded_ptx_problems;
use gpuio_testkit::Requirement;

#[test]
fn the_embedded_ptx_is_built_from_the_embedded_sources() {
    let problems = embedded_ptx_problems(MODULES, "crates/gpuio-ai-device/ptx");
    assert!(
        problems.is_empty(),
        "{}\nafter changing a kernel, run `cargo xtask ptx --wheels --write` and commit what it \
         writes",
        problems.join("\n")
    );
}

#[test]
fn every_kernel_compiles_for_every_architecture() {
    match nvrtc_problems(MODULES) {
        Ok(failed) => assert!(failed.is_empty(), "{}", failed.join("\n")),
        Err(missing) => Requirement::Nvrtc.missing(missing),
    }
}
