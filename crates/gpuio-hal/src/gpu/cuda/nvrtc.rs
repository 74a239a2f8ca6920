//! NVRTC: compiling `kernels/` sources at run time for the device found.

use crate::error::{HalError, Result};
use crate::kernels::KernelSource;
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};

/// Compiles a kernel source to PTX with NVRTC, for compute capability `cc` where given
/// (falling back to NVRTC's default target if that one is too new for this NVRTC).
pub fn compile_ptx(src: &KernelSource, cc: Option<(u32, u32)>) -> Result<Ptx> {
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
    let compile = |arch: Option<String>| {
        let opts = CompileOptions {
            name: Some(src.name.into()),
            options: arch.into_iter().collect(),
            ..Default::default()
        };
        compile_ptx_with_opts(src.source, opts)
    };
    let first = compile(cc.map(|(ma, mi)| format!("--gpu-architecture=compute_{ma}{mi}")));
    match first {
        Ok(ptx) => Ok(ptx),
        Err(_) if cc.is_some() => compile(None).map_err(|e| HalError::Compile {
            kernel: src.name.into(),
            log: format!("{e:?}"),
        }),
        Err(e) => Err(HalError::Compile {
            kernel: src.name.into(),
            log: format!("{e:?}"),
        }),
    }
}
