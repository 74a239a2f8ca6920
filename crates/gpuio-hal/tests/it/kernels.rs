//! Every kernel source gpuio embeds compiles with NVRTC for every architecture gpuio supports
//! (Ampere, Hopper, Blackwell), strictly: no fallback to another target, and every kernel the
//! source promises is in the PTX. No GPU is needed, only libnvrtc on the loader's path: CI gets
//! it from PyPI (`cargo xtask ptx --wheels`), the GPU machine from its toolkit. Without
//! libnvrtc the test says so and passes, unless `GPUIO_REQUIRE_NVRTC=1` or
//! `GPUIO_REQUIRE_CUDA=1` makes that a failure.

#![cfg(feature = "cuda")]

use gpuio_hal::HalError;
use gpuio_hal::gpu::cuda::compile_ptx_for;
use gpuio_hal::kernels::MODULES;
use gpuio_testkit::Requirement;

/// The virtual architectures the PTX is built for.
const ARCHS: &[&str] = &["compute_80", "compute_90", "compute_100"];

#[test]
fn every_kernel_compiles_for_every_architecture() {
    let mut failed = Vec::new();
    for arch in ARCHS {
        for src in MODULES {
            match compile_ptx_for(src, arch) {
                Ok(ptx) => {
                    let text = ptx.to_src();
                    let missing: Vec<_> = src
                        .functions
                        .iter()
                        .filter(|f| !text.contains(*f))
                        .collect();
                    if missing.is_empty() {
                        eprintln!("NVRTC {arch} {}: {} bytes of PTX", src.name, text.len());
                    } else {
                        failed.push(format!("{arch} {}: PTX lacks {missing:?}", src.name));
                    }
                }
                Err(HalError::Compile { log, .. }) if log.contains("libnvrtc not found") => {
                    Requirement::Nvrtc.missing(log);
                    return;
                }
                Err(e) => failed.push(format!("{arch} {}: {e}", src.name)),
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
