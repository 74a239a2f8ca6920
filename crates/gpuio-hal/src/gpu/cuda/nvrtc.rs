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
