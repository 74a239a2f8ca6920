//! NVRTC: compiling `kernels/` sources at run time for the device found.

use crate::error::{HalError, Result};
use crate::kernels::KernelSource;
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

/// Compiles a kernel source to PTX with NVRTC, for compute capability `cc` where given
/// (falling back to NVRTC's default target if that one is too new for this NVRTC).
pub fn compile_ptx(src: &KernelSource, cc: Option<(u32, u32)>) -> Result<Ptx> {
    let Some((major, minor)) = cc else {
        return compile(src, None);
    };
    compile(src, Some(&format!("compute_{major}{minor}"))).or_else(|_| compile(src, None))
}

/// Compiles a kernel source to PTX with NVRTC for exactly `arch` (`compute_90`, `sm_100`, ...):
/// no fallback, so a source that this target rejects is an error (`cargo xtask ptx`).
pub fn compile_ptx_for(src: &KernelSource, arch: &str) -> Result<Ptx> {
    compile(src, Some(arch))
}

/// The virtual architectures every module must compile for with NVRTC: Ampere, Hopper,
/// Blackwell.
pub const NVRTC_ARCHS: &[&str] = &["compute_80", "compute_90", "compute_100"];

/// What fails when NVRTC compiles each of `modules` for each of [`NVRTC_ARCHS`] strictly (no
/// fallback): a compile error, or PTX lacking a function the module promises. `Err` with
/// NVRTC's message where libnvrtc is missing. For each crate's tests of its kernels.
pub fn nvrtc_problems(modules: &[&KernelSource]) -> std::result::Result<Vec<String>, String> {
    let mut failed = Vec::new();
    for arch in NVRTC_ARCHS {
        for src in modules {
            match compile_ptx_for(src, arch) {
                Ok(ptx) => {
                    let text = ptx.to_src();
                    let missing: Vec<_> = src
                        .functions
                        .iter()
                        .filter(|f| !text.contains(*f))
                        .collect();
                    if missing.is_empty() {
                        tracing::info!(arch, kernel = src.name, bytes = text.len(), "NVRTC PTX");
                    } else {
                        failed.push(format!("{arch} {}: PTX lacks {missing:?}", src.name));
                    }
                }
                Err(HalError::Compile { log, .. }) if log.contains("libnvrtc not found") => {
                    return Err(log);
                }
                Err(e) => failed.push(format!("{arch} {}: {e}", src.name)),
            }
        }
    }
    Ok(failed)
}

/// Everything a crate's tests check of its kernels: what is wrong with their embedded PTX
/// (in `ptx_dir`, [`crate::kernels::embedded_ptx_problems`]) and with NVRTC's compile of
/// their sources ([`nvrtc_problems`]), and, where libnvrtc is missing, why NVRTC's part did
/// not run (a skip the caller reports, or fails under `GPUIO_REQUIRE_NVRTC`).
pub fn kernel_problems(modules: &[&KernelSource], ptx_dir: &str) -> (Vec<String>, Option<String>) {
    let mut problems = crate::kernels::embedded_ptx_problems(modules, ptx_dir);
    match nvrtc_problems(modules) {
        Ok(failed) => {
            problems.extend(failed);
            (problems, None)
        }
        Err(missing) => (problems, Some(missing)),
    }
}

fn compile(src: &KernelSource, arch: Option<&str>) -> Result<Ptx> {
    // SAFETY: only tries to dlopen libnvrtc by its usual names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(HalError::Compile {
            kernel: src.name.into(),
            log: "libnvrtc not found (install the CUDA toolkit's NVRTC)".into(),
        });
    }
    if src.source.as_bytes().contains(&0) {
        return Err(HalError::Compile {
            kernel: src.name.into(),
            log: "source contains a NUL byte".into(),
        });
    }
    let opts = CompileOptions {
        name: Some(src.name.into()),
        options: arch
            .map(|a| format!("--gpu-architecture={a}"))
            .into_iter()
            .collect(),
        ..Default::default()
    };
    compile_ptx_with_opts(src.source, opts).map_err(|e| HalError::Compile {
        kernel: src.name.into(),
        log: format!("{e:?}"),
    })
}
