//! This crate's kernels: the embedded PTX was built from the sources embedded now (no
//! compiler needed), and NVRTC compiles each source for every architecture gpuio supports
//! (skipped without libnvrtc unless `GPUIO_REQUIRE_NVRTC=1`).

#[test]
fn the_kernels_match_their_sources_and_compile() {
    let (problems, missing) = gpuio_hal::gpu::cuda::kernel_problems(
        gpuio_ring::kernels::MODULES,
        "crates/gpuio-ring/ptx",
    );
    assert!(
        problems.is_empty(),
        "{}\n(run `cargo xtask ptx --wheels --write`)",
        problems.join("\n")
    );
    if let Some(why) = missing {
        gpuio_testkit::Requirement::Nvrtc.missing(why);
    }
}
