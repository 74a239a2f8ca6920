//! Finding out what the CUDA installation can do without ever letting cudarc panic: library
//! presence, driver symbols, GDS (libcufile + nvidia-fs), GPUDirect RDMA, pinned-memory queries.

use super::driver::cuda_err;
use crate::error::{HalError, Result};
use crate::gpu::info::Capability;
use cudarc::driver::{result, sys};
use std::ffi::{CString, c_void};

/// Every driver entry point gpuio (and the parts of cudarc it uses) calls. cudarc resolves each
/// lazily and panics if one is missing, so all are checked before the first call.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxGetState",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuCtxEnablePeerAccess",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventSynchronize",
    "cuEventQuery",
    "cuEventElapsedTime_v2",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocManaged",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostGetDevicePointer_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoD_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuMemsetD32Async",
    "cuPointerGetAttributes",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// Whether [`check_driver`] has passed in this process (driver calls are safe to make).
static DRIVER_READY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the driver was checked and initialised in this process.
pub(crate) fn driver_ready() -> bool {
    DRIVER_READY.load(std::sync::atomic::Ordering::Acquire)
}

/// Checks that libcuda loads and exports everything gpuio calls.
pub(crate) fn check_driver() -> Result<()> {
    if driver_forked() {
        // No driver call in a forked child, not even cuInit (see `driver_forked`).
        return Err(HalError::CudaUnavailable {
            reason: "CUDA was set up before fork(): a forked child cannot use it".into(),
        });
    }
    // SAFETY: is_culib_present only tries to dlopen the library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(HalError::CudaUnavailable {
            reason: "libcuda.so not found (no NVIDIA driver on this machine)".into(),
        });
    }
    // SAFETY: the library is present (checked above), so culib() returns it without panicking.
    let lib = unsafe { sys::culib() };
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        // SAFETY: looking a symbol up does not call it; the pointer type is never used.
        .filter(|name| unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(HalError::CudaUnavailable {
            reason: format!(
                "the NVIDIA driver is too old for gpuio (needs CUDA 12.8+; missing {})",
                missing.join(", ")
            ),
        });
    }
    result::init().map_err(|e| HalError::CudaUnavailable {
        reason: format!("cuInit failed: {}", cuda_err("cuInit")(e)),
    })?;
    DRIVER_GENERATION.store(
        crate::sys::fork_generation(),
        std::sync::atomic::Ordering::Relaxed,
    );
    DRIVER_READY.store(true, std::sync::atomic::Ordering::Release);
    Ok(())
}

/// The process that set the driver up, in its line of forks.
static DRIVER_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Whether this process was forked from the one that set the driver up. CUDA does not
/// cross a fork: the child may make no driver call, not even to free what the parent made
/// (a child's exit crashed in one), so what the HAL made there is left as it is.
pub(crate) fn driver_forked() -> bool {
    driver_ready()
        && crate::sys::fork_generation()
            != DRIVER_GENERATION.load(std::sync::atomic::Ordering::Relaxed)
}

/// The driver's CUDA version, e.g. (13, 0).
pub(crate) fn driver_version() -> Option<(u32, u32)> {
    let mut v = 0;
    // SAFETY: writes one int; the driver is loaded (callers probe first).
    let rc = unsafe { sys::cuDriverGetVersion(&mut v) };
    (rc == sys::CUresult::CUDA_SUCCESS).then_some((v as u32 / 1000, (v as u32 % 1000) / 10))
}

/// Whether `ptr..ptr+len` lies in page-locked host memory the driver knows (pinned or
/// registered), so that a copy can run as direct DMA. Needs a bound context.
pub(crate) fn host_range_is_pinned(ptr: *const u8, len: usize) -> bool {
    let is_host = |p: *const u8| -> Option<(u64, usize)> {
        use sys::CUpointer_attribute as A;
        let mut attrs = [
            A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ];
        let mut mem_type: u32 = 0;
        let mut start: u64 = 0;
        let mut size: usize = 0;
        let mut data: [*mut c_void; 3] = [
            (&mut mem_type as *mut u32).cast(),
            (&mut start as *mut u64).cast(),
            (&mut size as *mut usize).cast(),
        ];
        // SAFETY: attrs and data have 3 entries each, pointing at locals of the right sizes;
        // cuPointerGetAttributes writes defaults (not errors) for pointers it does not know.
        let rc = unsafe {
            sys::cuPointerGetAttributes(3, attrs.as_mut_ptr(), data.as_mut_ptr(), p as u64)
        };
        (rc == sys::CUresult::CUDA_SUCCESS
            && mem_type == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32)
            .then_some((start, size))
    };
    let (Some(first), Some(_)) = (is_host(ptr), is_host(ptr.wrapping_add(len - 1))) else {
        return false;
    };
    // Where the driver reports the allocation's extent, the whole range must lie inside it.
    let (start, size) = first;
    size == 0 || (start <= ptr as u64 && ptr as u64 + len as u64 <= start + size as u64)
}

/// The first of `names` that loads, and whether it is gpuio's own libcufile.so.0 (it exports
/// [`super::cufile::GPUIO_MARKER`]).
fn library_loads(names: &[String]) -> Option<(String, bool)> {
    names.iter().find_map(|name| {
        let c = CString::new(name.as_str()).ok()?;
        // SAFETY: dlopen of a vendor library by name; we only test that it loads and close it
        // at once. RTLD_LAZY resolves nothing until called, and nothing is called.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return None;
        }
        let marker = CString::new(super::cufile::GPUIO_MARKER).ok()?;
        // SAFETY: looks a symbol up in the live handle; nothing is called.
        let ours = !unsafe { libc::dlsym(handle, marker.as_ptr()) }.is_null();
        // SAFETY: handle came from dlopen above and is closed once.
        unsafe { libc::dlclose(handle) };
        Some((name.clone(), ours))
    })
}

/// GPUDirect Storage: libcufile plus the nvidia-fs kernel driver. Without nvidia-fs cuFile
/// still works, in compat mode (POSIX reads through a bounce buffer), which is not GDS.
pub(crate) fn gds_capability() -> Capability {
    let lib = library_loads(&super::cufile::candidates());
    match (lib, nvidia_fs_loaded()) {
        (Some((lib, true)), _) => Capability::no(format!(
            "{lib} is gpuio's own (gpuio-cufile): cuFile programs here run on gpuio"
        )),
        (Some((lib, false)), true) => Capability::yes(format!("{lib} with nvidia-fs")),
        (Some((lib, false)), false) => Capability::no(format!(
            "{lib} present but the nvidia-fs driver is not loaded: cuFile runs in compat mode"
        )),
        (None, _) => Capability::no("libcufile not found"),
    }
}

/// Whether the nvidia-fs kernel driver (real GPUDirect Storage) is loaded.
pub(crate) fn nvidia_fs_loaded() -> bool {
    std::path::Path::new("/proc/driver/nvidia-fs").exists()
        || std::path::Path::new("/sys/module/nvidia_fs").exists()
}

/// GPUDirect RDMA: device support, the nvidia-peermem module, and an RDMA NIC.
pub(crate) fn gdr_capability(device_supports: bool) -> Capability {
    if !device_supports {
        return Capability::no("the device does not support GPUDirect RDMA");
    }
    let peermem = std::path::Path::new("/sys/module/nvidia_peermem").exists();
    let nics: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    match (peermem, nics.is_empty()) {
        (true, false) => Capability::yes(format!("nvidia-peermem with {}", nics.join(","))),
        (false, _) => Capability::no("nvidia-peermem module not loaded"),
        (true, true) => Capability::no("no RDMA NIC (/sys/class/infiniband is empty)"),
    }
}
