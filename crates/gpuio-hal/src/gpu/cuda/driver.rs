//! Every raw CUDA driver call the backend makes, each a thin function that returns the HAL's
//! error: the one place in the backend where its calls cross into libcuda (as cudarc's
//! `driver/result.rs` is for cudarc). The modules above it (`device`, `memory`, `stream`,
//! `rows`, `event`) hold the logic and call only these and cudarc's safe API; kernel launches
//! stay next to their argument lists there, because their contract is the kernel's signature.
//!
//! A function is `unsafe` where the call has a precondition the driver cannot check (live
//! allocations, mapped host memory, memory no queued work still uses); its `# Safety` section
//! says which, and each call site says why it holds. Every call works in the context current on
//! the calling thread: callers bind their device's context first.
//!
//! The probe's calls (`probe.rs`: library and symbol checks, the driver version, pointer
//! attributes) and cuFile's (`cufile.rs`, a separately `dlopen`ed library) stay with them.

use crate::error::{ErrorCode, HalError, Result};
use cudarc::driver::{DriverError, result, sys};
use std::ffi::c_void;
use std::os::fd::{FromRawFd, OwnedFd};

/// Converts a driver error into the HAL's error, naming the operation.
pub(crate) fn cuda_err(op: &'static str) -> impl FnOnce(DriverError) -> HalError {
    move |e: DriverError| {
        use sys::cudaError_enum as E;
        let code = match e.0 {
            E::CUDA_ERROR_OUT_OF_MEMORY => ErrorCode::NoMem,
            E::CUDA_ERROR_INVALID_VALUE
            | E::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
            | E::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
            | E::CUDA_ERROR_INVALID_DEVICE => ErrorCode::InvalidArg,
            E::CUDA_ERROR_NOT_SUPPORTED => ErrorCode::Unsupported,
            E::CUDA_ERROR_NOT_READY => ErrorCode::Busy,
            E::CUDA_ERROR_NO_DEVICE | E::CUDA_ERROR_NOT_FOUND => ErrorCode::NotFound,
            _ => ErrorCode::General,
        };
        HalError::Cuda {
            op,
            name: e.error_name().map_or_else(
                |_| format!("{:?}", e.0),
                |s| s.to_string_lossy().into_owned(),
            ),
            message: e
                .error_string()
                .map_or_else(|_| String::new(), |s| s.to_string_lossy().into_owned()),
            code,
        }
    }
}

/// Renames the operation of a driver error (e.g. a sequence of calls reported as one), leaving
/// any other error as it is.
pub(super) fn renamed(op: &'static str) -> impl FnOnce(HalError) -> HalError {
    move |e| match e {
        HalError::Cuda {
            name,
            message,
            code,
            ..
        } => HalError::Cuda {
            op,
            name,
            message,
            code,
        },
        other => other,
    }
}

/// The result of a driver call as the HAL's, naming the call.
fn check(rc: sys::CUresult, op: &'static str) -> Result<()> {
    rc.result().map_err(cuda_err(op))
}

/// `cuCtxEnablePeerAccess`: lets the current context reach `peer`'s memory. Access that is
/// already enabled counts as done.
///
/// # Safety
/// `peer` is a live context (a device's retained primary context).
pub(super) unsafe fn ctx_enable_peer_access(peer: sys::CUcontext) -> Result<()> {
    // SAFETY: the caller's contract; the call changes only the driver's mapping state.
    match unsafe { sys::cuCtxEnablePeerAccess(peer, 0) } {
        sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        rc => check(rc, "cuCtxEnablePeerAccess"),
    }
}

/// `cuCtxGetCurrent`: the context current on this thread (null for none).
pub(super) fn ctx_current() -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one handle; the driver is loaded (callers probe first).
    let rc = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
    check(rc, "cuCtxGetCurrent")?;
    Ok(ctx)
}

/// `cuCtxSetCurrent`: makes `ctx` current on this thread (null: none).
///
/// # Safety
/// `ctx` is null or a context that is alive for the call.
pub(super) unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: the caller vouches that ctx is null or alive.
    let rc = unsafe { sys::cuCtxSetCurrent(ctx) };
    check(rc, "cuCtxSetCurrent")
}

/// `cuCtxSynchronize`: waits for all work of the current context.
pub(super) fn ctx_synchronize() -> Result<()> {
    // SAFETY: no arguments; the driver only waits (or reports that no context is current).
    let rc = unsafe { sys::cuCtxSynchronize() };
    check(rc, "cuCtxSynchronize")
}

/// `cuStreamSynchronize`: waits for the work queued on `stream` (null: the legacy default
/// stream).
///
/// # Safety
/// A non-null `stream` is a live stream of the current context.
pub(super) unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuStreamSynchronize(stream) };
    check(rc, "cuStreamSynchronize")
}

/// `cuStreamQuery`: whether the work queued on `stream` is done (`false`: still running), or
/// the error it ran into.
///
/// # Safety
/// `stream` is a live stream of the current context.
pub(super) unsafe fn stream_query(stream: sys::CUstream) -> Result<bool> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuStreamQuery(stream) };
    if rc == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check(rc, "cuStreamQuery").map(|()| true)
}

/// `cuDeviceGet`: the handle of device `ordinal`. Like the queries below, it needs no
/// context.
pub(super) fn device_get(ordinal: usize) -> Result<sys::CUdevice> {
    let ordinal = i32::try_from(ordinal)
        .map_err(|_| HalError::InvalidArgument(format!("no CUDA device {ordinal}")))?;
    result::device::get(ordinal).map_err(cuda_err("cuDeviceGet"))
}

/// `cuDeviceGetAttribute` of device `dev`.
pub(super) fn device_attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: `dev` came from `device_get`; the call writes one int.
    unsafe { result::device::get_attribute(dev, attr) }.map_err(cuda_err("cuDeviceGetAttribute"))
}

/// `cuDeviceGetName` and `cuDeviceTotalMem` of device `dev`.
pub(super) fn device_name_and_memory(dev: sys::CUdevice) -> Result<(String, usize)> {
    let name = result::device::get_name(dev).map_err(cuda_err("cuDeviceGetName"))?;
    // SAFETY: `dev` came from `device_get`; the call writes one size.
    let total = unsafe { result::device::total_mem(dev) }.map_err(cuda_err("cuDeviceTotalMem"))?;
    Ok((name, total))
}

/// `cuDeviceCanAccessPeer`: whether `dev` can reach `peer`'s memory directly.
pub(super) fn device_can_access_peer(dev: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
    let mut can = 0;
    // SAFETY: device handles are ordinals the driver checks; the call writes one int, `can`.
    let rc = unsafe { sys::cuDeviceCanAccessPeer(&mut can, dev, peer) };
    check(rc, "cuDeviceCanAccessPeer")?;
    Ok(can != 0)
}

/// `cuMemAlloc`: `len` bytes of device memory in the current context, uninitialised. The
/// caller owns the allocation (and frees it with [`mem_free`], or leaks it).
pub(super) fn mem_alloc(len: usize) -> Result<sys::CUdeviceptr> {
    // SAFETY: the call only writes the new pointer; no memory of ours is read or written, and
    // the bytes behind the pointer are reached only through later driver calls and kernels.
    unsafe { result::malloc_sync(len) }.map_err(cuda_err("cuMemAlloc"))
}

/// `cuMemAllocManaged` (`CU_MEM_ATTACH_GLOBAL`): `len` bytes the host and every device reach
/// at one address, each page migrating to whichever touches it.
pub(super) fn mem_alloc_managed(len: usize) -> Result<sys::CUdeviceptr> {
    let mut ptr: sys::CUdeviceptr = 0;
    let attach = sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as std::ffi::c_uint;
    // SAFETY: the call writes one pointer, `ptr`; nothing else of ours is touched.
    let rc = unsafe { sys::cuMemAllocManaged(&mut ptr, len, attach) };
    check(rc, "cuMemAllocManaged")?;
    Ok(ptr)
}

/// `cuMemGetHandleForAddressRange` with `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`: a new dma-buf
/// file descriptor for `len` bytes of device memory at `addr` (both multiples of the host page
/// size).
///
/// # Safety
/// `addr..addr + len` lies in a live allocation of the current context.
pub(super) unsafe fn mem_dmabuf_fd(addr: sys::CUdeviceptr, len: usize) -> Result<OwnedFd> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: the caller's contract for the range; the call writes one int, `fd`.
    let rc = unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&raw mut fd).cast(),
            addr,
            len,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    check(rc, "cuMemGetHandleForAddressRange")?;
    // SAFETY: on success the driver returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemFree`.
///
/// # Safety
/// `ptr` came from [`mem_alloc`] in the current context, is freed once, and no queued or
/// running work uses it any more.
pub(super) unsafe fn mem_free(ptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::free_sync(ptr) }.map_err(cuda_err("cuMemFree"))
}

/// `cuMemHostRegister`: pins `len` bytes of host memory at `ptr` (and, with
/// `CU_MEMHOSTREGISTER_DEVICEMAP` in `flags`, maps them for the device).
///
/// # Safety
/// `ptr..ptr + len` is mapped host memory and stays mapped until [`mem_host_unregister`]
/// unregisters it: the device may read and write it until then.
pub(super) unsafe fn mem_host_register(ptr: *mut u8, len: usize, flags: u32) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) };
    check(rc, "cuMemHostRegister")
}

/// `cuMemHostUnregister`.
///
/// # Safety
/// `ptr` is the start of a range registered by [`mem_host_register`], still mapped, and
/// unregistered once.
pub(super) unsafe fn mem_host_unregister(ptr: *mut u8) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
    check(rc, "cuMemHostUnregister")
}

/// `cuMemHostAlloc` (`DEVICEMAP | PORTABLE`): `len` bytes of page-locked host memory that
/// kernels reach at [`mem_host_get_device_pointer`]; freed by [`mem_free_host`].
pub(super) fn mem_host_alloc_mapped(len: usize) -> Result<*mut u8> {
    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: the call writes only the new pointer; the memory is ours until mem_free_host.
    unsafe { result::malloc_host(len, flags) }
        .map(|p| p.cast())
        .map_err(cuda_err("cuMemHostAlloc"))
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `ptr` came from [`mem_host_alloc_mapped`], is freed once, and no work uses it any more.
pub(super) unsafe fn mem_free_host(ptr: *mut u8) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::free_host(ptr.cast()) }.map_err(cuda_err("cuMemFreeHost"))
}

/// `cuMemHostGetDevicePointer`: the device address of registered host memory at `ptr`.
///
/// # Safety
/// `ptr` lies in host memory registered with `CU_MEMHOSTREGISTER_DEVICEMAP`.
pub(super) unsafe fn mem_host_get_device_pointer(ptr: *mut u8) -> Result<sys::CUdeviceptr> {
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: the caller's contract; the call writes one device pointer, `dptr`.
    let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr.cast(), 0) };
    check(rc, "cuMemHostGetDevicePointer")?;
    Ok(dptr)
}

/// What the driver knows of the allocation holding the device address `ptr`.
#[derive(Debug, Clone, Copy)]
pub(super) struct PointerRange {
    /// `CU_MEMORYTYPE_*` (0 when the driver does not know the address).
    pub mem_type: u32,
    /// The allocation's first address and length.
    pub start: u64,
    pub size: usize,
    /// The ordinal of the device that owns it.
    pub ordinal: i32,
    /// The allocation's process-wide unique id (never reused for another allocation).
    pub buffer_id: u64,
}

/// The device allocation holding `ptr`, as [`pointer_range`] finds it.
pub(super) fn allocation(ptr: u64) -> Result<crate::gpu::Allocation> {
    let r = pointer_range(ptr)?;
    if r.mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Err(crate::HalError::InvalidArgument(format!(
            "{ptr:#x} is not device memory the CUDA driver knows"
        )));
    }
    Ok(crate::gpu::Allocation {
        base: r.start,
        len: r.size,
        id: r.buffer_id,
    })
}

/// `cuPointerGetAttributes`: the type, extent, device and id of the allocation holding `ptr`.
/// An address the driver does not know gives memory type 0, not an error.
pub(super) fn pointer_range(ptr: u64) -> Result<PointerRange> {
    use sys::CUpointer_attribute as A;
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        A::CU_POINTER_ATTRIBUTE_BUFFER_ID,
    ];
    let mut r = PointerRange {
        mem_type: 0,
        start: 0,
        size: 0,
        ordinal: -1,
        buffer_id: 0,
    };
    let mut data: [*mut c_void; 5] = [
        (&mut r.mem_type as *mut u32).cast(),
        (&mut r.start as *mut u64).cast(),
        (&mut r.size as *mut usize).cast(),
        (&mut r.ordinal as *mut i32).cast(),
        (&mut r.buffer_id as *mut u64).cast(),
    ];
    // SAFETY: attrs and data have 5 entries each, pointing at fields of the sizes the
    // attributes write; the address is only a value the driver looks up.
    let rc = unsafe { sys::cuPointerGetAttributes(5, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
    check(rc, "cuPointerGetAttributes")?;
    Ok(r)
}

/// Whether the device allocation holding `ptr` is ordinary device memory (`cuMemAlloc`,
/// `cudaMalloc`): the kind peer access maps into a peer's kernels. Memory of the virtual
/// memory API or a stream-ordered pool (`cuMemCreate`, `cudaMallocAsync`) says no: a peer
/// reaches it only where its owner granted access.
pub(super) fn is_ordinary_allocation(ptr: u64) -> Result<bool> {
    let mut attrs = [sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE];
    // The attribute is a boolean; a zeroed word read as nonzero holds whatever width the
    // driver writes it in.
    let mut legacy = 0u64;
    let mut data: [*mut c_void; 1] = [(&mut legacy as *mut u64).cast()];
    // SAFETY: one attribute and one 8-byte destination; the address is only a value the
    // driver looks up.
    let rc = unsafe { sys::cuPointerGetAttributes(1, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
    check(rc, "cuPointerGetAttributes")?;
    Ok(legacy != 0)
}

/// `cuDevicePrimaryCtxGetState`: whether `dev`'s primary context is active (made by anyone
/// in this process and not yet released).
pub(super) fn primary_context_active(dev: sys::CUdevice) -> Result<bool> {
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: `dev` came from `device_get`; the call writes one unsigned and one int.
    let rc = unsafe { sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) };
    check(rc, "cuDevicePrimaryCtxGetState")?;
    Ok(active != 0)
}

/// `cuMemcpyHtoD` (synchronous for pageable memory).
///
/// # Safety
/// `dst..dst + len` is live device memory of the current context; `src` is readable for `len`
/// bytes for the call.
pub(super) unsafe fn memcpy_htod(dst: sys::CUdeviceptr, src: *const u8, len: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuMemcpyHtoD_v2(dst, src.cast::<c_void>(), len) };
    check(rc, "cuMemcpyHtoD")
}

/// `cuMemcpyDtoH`.
///
/// # Safety
/// `src..src + len` is live device memory of the current context; `dst` is writable for `len`
/// bytes for the call.
pub(super) unsafe fn memcpy_dtoh(dst: *mut u8, src: sys::CUdeviceptr, len: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuMemcpyDtoH_v2(dst.cast::<c_void>(), src, len) };
    check(rc, "cuMemcpyDtoH")
}

/// `cuMemcpyDtoD`: queued on the legacy stream; it may return before the copy ends.
///
/// # Safety
/// Both ranges of `len` bytes are live device memory of the current context, and stay so
/// until the copy ends.
pub(super) unsafe fn memcpy_dtod(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuMemcpyDtoD_v2(dst, src, len) };
    check(rc, "cuMemcpyDtoD")
}

/// `cuMemcpyHtoDAsync`, queued on `stream`.
///
/// # Safety
/// `stream` is a live stream of the current context; `src` stays readable and
/// `dst..dst + len` live device memory until the copy completes.
pub(super) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), len, stream) };
    check(rc, "cuMemcpyHtoDAsync")
}

/// `cuMemcpyDtoHAsync`, queued on `stream`.
///
/// # Safety
/// `stream` is a live stream of the current context; `dst` stays writable (and untouched by
/// anything else) for `len` bytes and `src..src + len` live device memory until the copy
/// completes.
pub(super) unsafe fn memcpy_dtoh_async(
    dst: *mut u8,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, len, stream) };
    check(rc, "cuMemcpyDtoHAsync")
}

/// `cuMemcpyDtoDAsync` within one context, queued on `stream`.
///
/// # Safety
/// `stream` is a live stream of the current context; both ranges of `len` bytes are live,
/// non-overlapping device memory of that context until the copy completes.
pub(super) unsafe fn memcpy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream) };
    check(rc, "cuMemcpyDtoDAsync")
}

/// `cuMemcpyPeerAsync` between two contexts, queued on `stream`.
///
/// # Safety
/// `stream` is a live stream of the current context; `dst_ctx` and `src_ctx` are live
/// contexts, and `dst` and `src` ranges of `len` bytes live device memory of each until the
/// copy completes.
pub(super) unsafe fn memcpy_peer_async(
    dst: sys::CUdeviceptr,
    dst_ctx: sys::CUcontext,
    src: sys::CUdeviceptr,
    src_ctx: sys::CUcontext,
    len: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, len, stream) };
    check(rc, "cuMemcpyPeerAsync")
}

/// `cuMemsetD32Async`: sets `count` 4-byte words at `dst` to `value`, queued on `stream`.
///
/// # Safety
/// `stream` is a live stream of the current context; `dst` is 4-byte aligned and
/// `dst..dst + 4 * count` live device memory of that context, which no other work uses
/// concurrently, until the set completes.
pub(super) unsafe fn memset_d32_async(
    dst: sys::CUdeviceptr,
    value: u32,
    count: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let rc = unsafe { sys::cuMemsetD32Async(dst, value, count, stream) };
    check(rc, "cuMemsetD32Async")
}
