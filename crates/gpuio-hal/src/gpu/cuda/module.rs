//! Loading a module of `kernels/` into a device's context, the first way that serves:
//! - the embedded machine code for the device's architecture (`KernelSource::cubin_for`),
//!   which the driver loads as it is (`cuModuleLoadData`): nothing is compiled;
//! - the newest embedded PTX whose architecture the device reaches (`KernelSource::ptx_for`),
//!   which the driver JIT-compiles: no compiler runs in the process;
//! - NVRTC compiling the source, where no embedded PTX fits the device (older than
//!   `compute_80`) or the driver refuses it (an ISA newer than the driver knows, a JIT that
//!   fails or is disabled).
//!
//! The log says which way a module took where it is not the first, once per module and
//! device.

use super::driver::cuda_err;
use crate::error::{HalError, Result};
use crate::kernels::{
    EmbeddedCubin, EmbeddedPtx, KernelLoad, KernelOrigin, KernelPath, KernelSource,
};
use cudarc::driver::{CudaContext, CudaFunction, DriverError, sys};
use cudarc::nvrtc::Ptx;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A module loaded for use: its functions in the source's order, and where its code came from.
#[derive(Debug)]
pub(super) struct Loaded {
    pub(super) functions: Vec<CudaFunction>,
    pub(super) origin: KernelOrigin,
}

/// Why loading embedded code failed.
enum Failure {
    /// The driver will not take this image (why, and the error), where the next way may
    /// still serve.
    Refused(&'static str, HalError),
    /// Anything else (out of memory, a lost context), which NVRTC's build would meet too.
    Failed(HalError),
}

/// Why the driver refused an image with `code`, where that leaves the next way a chance;
/// `None` for errors that any image would meet (out of memory, a lost context).
fn refusal(code: sys::CUresult) -> Option<&'static str> {
    use sys::cudaError_enum as E;
    Some(match code {
        E::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
            "its PTX ISA is newer than this driver knows (PTX from CUDA 13.0 needs a CUDA 13.0 \
             driver, r580, or newer)"
        }
        E::CUDA_ERROR_INVALID_PTX | E::CUDA_ERROR_INVALID_IMAGE => {
            "the driver's JIT compiler rejected it"
        }
        E::CUDA_ERROR_NO_BINARY_FOR_GPU => "the driver found no code in it for this device",
        E::CUDA_ERROR_JIT_COMPILER_NOT_FOUND | E::CUDA_ERROR_JIT_COMPILATION_DISABLED => {
            "the driver cannot JIT-compile PTX here"
        }
        E::CUDA_ERROR_NOT_FOUND => "it lacks a function the source defines (is it stale?)",
        _ => return None,
    })
}

impl Failure {
    fn from_driver(op: &'static str, e: DriverError) -> Self {
        match refusal(e.0) {
            Some(why) => Self::Refused(why, cuda_err(op)(e)),
            None => Self::Failed(cuda_err(op)(e)),
        }
    }

    /// As the HAL's error, for callers that do not fall back.
    fn into_error(self, src: &KernelSource, what: &str) -> HalError {
        match self {
            Self::Refused(why, error) => HalError::KernelLoad {
                kernel: src.name.into(),
                reason: format!("the driver refused the embedded {what} ({why}): {error}"),
            },
            Self::Failed(error) => error,
        }
    }
}

/// Loads an image (PTX text or a cubin; cudarc's `Ptx` carries either) and looks up every
/// function of `src`, timing both.
fn load_image(
    ctx: &Arc<CudaContext>,
    src: &KernelSource,
    image: Ptx,
) -> std::result::Result<(Vec<CudaFunction>, Duration), Failure> {
    let start = Instant::now();
    let module = ctx
        .load_module(image)
        .map_err(|e| Failure::from_driver("cuModuleLoadData", e))?;
    let functions = src
        .functions
        .iter()
        .map(|name| module.load_function(name))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Failure::from_driver("cuModuleGetFunction", e))?;
    Ok((functions, start.elapsed()))
}

/// The driver loading an embedded PTX.
fn load_embedded(
    ctx: &Arc<CudaContext>,
    src: &KernelSource,
    ptx: &EmbeddedPtx,
) -> std::result::Result<(Vec<CudaFunction>, Duration), Failure> {
    if ptx.text.as_bytes().contains(&0) {
        // The driver reads a C string (gpuio-hal's tests keep NULs out of the embedded PTX).
        return Err(Failure::Refused(
            "it contains a NUL byte",
            HalError::InvalidArgument(format!("{}'s compute_{} PTX", src.name, ptx.arch)),
        ));
    }
    load_image(ctx, src, Ptx::from_src(ptx.text))
}

/// The driver loading an embedded cubin.
fn load_cubin(
    ctx: &Arc<CudaContext>,
    src: &KernelSource,
    cubin: &EmbeddedCubin,
) -> std::result::Result<(Vec<CudaFunction>, Duration), Failure> {
    load_image(ctx, src, Ptx::from_binary(cubin.image.to_vec()))
}

/// NVRTC compiling the source for `cc`, then the driver loading its PTX; the compile's and the
/// load's times.
fn load_nvrtc(
    ctx: &Arc<CudaContext>,
    cc: (u32, u32),
    src: &KernelSource,
) -> Result<(Vec<CudaFunction>, Duration, Duration)> {
    let start = Instant::now();
    let ptx = super::compile_ptx(src, Some(cc))?;
    let compile = start.elapsed();
    let (functions, load) = load_image(ctx, src, ptx).map_err(|f| match f {
        Failure::Refused(_, e) | Failure::Failed(e) => e,
    })?;
    Ok((functions, compile, load))
}

/// Loads `src` for use, the first way that serves (the module's comment): its embedded machine
/// code, its embedded PTX, NVRTC. The error is a message (the device keeps it for later
/// callers) naming what each way tried met.
pub(super) fn load(
    ctx: &Arc<CudaContext>,
    cc: (u32, u32),
    src: &KernelSource,
) -> std::result::Result<Loaded, String> {
    let gpu = ctx.ordinal();
    let kernel = src.name;
    // Whatever the driver says of the cubin, the PTX is tried next: a cubin it cannot take for
    // a reason not listed (a toolkit newer than it knows) must not cost the kernel, and an
    // error any image would meet (out of memory) meets the PTX too and is reported from there.
    let mut tried = String::new();
    if let Some(cubin) = src.cubin_for(cc) {
        let (why, error) = match load_cubin(ctx, src, cubin) {
            Ok((functions, load)) => {
                let origin = KernelOrigin::EmbeddedCubin { arch: cubin.arch };
                tracing::debug!(gpu, kernel, %origin, load_ms = ms(load), "kernel module loaded");
                return Ok(Loaded { functions, origin });
            }
            Err(Failure::Refused(why, error)) => (why, error),
            Err(Failure::Failed(error)) => ("it failed", error),
        };
        tracing::warn!(gpu, kernel, arch = cubin.arch, %error,
            "the driver did not load the embedded machine code ({why}); loading the PTX");
        tried = format!(
            "the driver did not load the embedded sm_{} machine code ({why}: {error}); ",
            cubin.arch
        );
    }
    let refused = match src.ptx_for(cc) {
        Some(ptx) => match load_embedded(ctx, src, ptx) {
            Ok((functions, load)) => {
                let origin = KernelOrigin::EmbeddedPtx { arch: ptx.arch };
                tracing::debug!(gpu, kernel, %origin, load_ms = ms(load), "kernel module loaded");
                return Ok(Loaded { functions, origin });
            }
            Err(Failure::Refused(why, error)) => {
                tracing::warn!(gpu, kernel, arch = ptx.arch, %error,
                    "the driver refused the embedded PTX ({why}); compiling with NVRTC");
                format!(
                    "the driver refused the embedded compute_{} PTX ({why}: {error})",
                    ptx.arch
                )
            }
            Err(Failure::Failed(error)) => return Err(format!("{tried}{error}")),
        },
        None => {
            tracing::info!(gpu, kernel, compute_capability = %format!("{}.{}", cc.0, cc.1),
                "no embedded PTX is old enough for this device; compiling with NVRTC");
            format!(
                "no embedded PTX fits compute capability {}.{} (the oldest is compute_{})",
                cc.0,
                cc.1,
                src.ptx.first().map_or(0, |p| p.arch)
            )
        }
    };
    match load_nvrtc(ctx, cc, src) {
        Ok((functions, compile, load)) => {
            tracing::debug!(gpu, kernel, origin = %KernelOrigin::Nvrtc, compile_ms = ms(compile),
                load_ms = ms(load), "kernel module loaded");
            Ok(Loaded {
                functions,
                origin: KernelOrigin::Nvrtc,
            })
        }
        Err(e) => Err(format!("{tried}{refused}; and NVRTC's way failed: {e}")),
    }
}

/// Loads a fresh copy of `src` by `path` alone (no fallback) and drops it again, timing it:
/// what first use costs each way (`Gpu::time_kernel_load`).
pub(super) fn time_load(
    ctx: &Arc<CudaContext>,
    cc: (u32, u32),
    src: &KernelSource,
    path: KernelPath,
) -> Result<KernelLoad> {
    match path {
        KernelPath::EmbeddedCubin => {
            let cubin = src.cubin_for(cc).ok_or_else(|| HalError::Unsupported {
                what: "embedded machine code",
                reason: format!(
                    "none of {}'s runs on compute capability {}.{}",
                    src.name, cc.0, cc.1
                ),
            })?;
            let (_, load) =
                load_cubin(ctx, src, cubin).map_err(|f| f.into_error(src, "machine code"))?;
            Ok(KernelLoad {
                origin: KernelOrigin::EmbeddedCubin { arch: cubin.arch },
                compile: Duration::ZERO,
                load,
            })
        }
        KernelPath::EmbeddedPtx => {
            let ptx = src.ptx_for(cc).ok_or_else(|| HalError::Unsupported {
                what: "embedded PTX",
                reason: format!(
                    "none of {}'s fits compute capability {}.{}",
                    src.name, cc.0, cc.1
                ),
            })?;
            let (_, load) = load_embedded(ctx, src, ptx).map_err(|f| f.into_error(src, "PTX"))?;
            Ok(KernelLoad {
                origin: KernelOrigin::EmbeddedPtx { arch: ptx.arch },
                compile: Duration::ZERO,
                load,
            })
        }
        KernelPath::Nvrtc => {
            let (_, compile, load) = load_nvrtc(ctx, cc, src)?;
            Ok(KernelLoad {
                origin: KernelOrigin::Nvrtc,
                compile,
                load,
            })
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::cudaError_enum as E;

    #[test]
    fn nvrtc_serves_where_the_driver_refuses_the_ptx_itself() {
        for code in [
            E::CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
            E::CUDA_ERROR_INVALID_PTX,
            E::CUDA_ERROR_NO_BINARY_FOR_GPU,
            E::CUDA_ERROR_JIT_COMPILER_NOT_FOUND,
            E::CUDA_ERROR_NOT_FOUND,
        ] {
            assert!(refusal(code).is_some(), "{code:?}");
        }
        for code in [
            E::CUDA_ERROR_OUT_OF_MEMORY,
            E::CUDA_ERROR_INVALID_CONTEXT,
            E::CUDA_ERROR_LAUNCH_FAILED,
        ] {
            assert!(refusal(code).is_none(), "{code:?}");
        }
    }
}
