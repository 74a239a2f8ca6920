//! What transfers move between: opened resources (`gpuio_handle_t`: files, remote exports) and
//! memory gpuio holds (`gpuio_mem_t`: host memory it allocated, GPU memory it allocated, or a
//! caller's GPU memory it borrows).

use crate::context::gpuio_context_t;
use crate::error::{call, invalid};
use crate::ptr;
use gpuio_api::{Access, DeviceBuffer, Endpoint, HostMemory, HostPlacement, Resource, Uri};
use std::ffi::{c_char, c_int, c_void};

/// An opened resource: a file or block device, or another node's export.
pub struct gpuio_handle_t {
    pub(crate) resource: Resource,
}

/// Memory gpuio holds: host memory or GPU memory. A transfer holds its own reference, so
/// `gpuio_mem_free` while a request uses it is safe (the memory goes when the request does).
pub struct gpuio_mem_t {
    pub(crate) kind: Mem,
}

pub(crate) enum Mem {
    Host { mem: HostMemory, ptr: usize },
    Device(DeviceBuffer),
}

impl gpuio_mem_t {
    pub(crate) fn endpoint(&self, offset: u64) -> Result<Endpoint, crate::error::Failure> {
        let offset =
            usize::try_from(offset).map_err(|_| invalid(format!("offset {offset} too large")))?;
        Ok(match &self.kind {
            Mem::Host { mem, .. } => Endpoint::host(mem, offset),
            Mem::Device(buf) => Endpoint::device(buf, offset),
        })
    }
}

/// Host memory as a `gpuio_mem_t` kind, its address kept for `gpuio_mem_host_ptr`.
pub(crate) fn host(mem: HostMemory) -> Mem {
    let ptr = mem.read().as_slice().as_ptr() as usize;
    Mem::Host { mem, ptr }
}

/// Hands `kind` to the caller as a new `gpuio_mem_t` in `*out`.
///
/// # Safety
/// `out` is writable (checked non-null by the caller).
pub(crate) unsafe fn give(
    out: *mut *mut gpuio_mem_t,
    kind: Mem,
) -> Result<(), crate::error::Failure> {
    // SAFETY: the caller's contract.
    unsafe { ptr::put(out, ptr::handle(gpuio_mem_t { kind }), "out") }
}

/// Opens the resource `uri` names (a path, `localio://..`, `remoteio://..`): for reading, or
/// with `GPUIO_OPEN_WRITE` for writing (a file is created or truncated). Close with
/// `gpuio_close`.
///
/// # Safety
/// `ctx` came from `gpuio_init`; `uri` is NUL-terminated; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_open(
    ctx: *const gpuio_context_t,
    uri: *const c_char,
    flags: u32,
    out: *mut *mut gpuio_handle_t,
) -> c_int {
    call(|| {
        ptr::out(out, "out")?;
        // SAFETY: the caller's contract.
        let (ctx, uri) = unsafe { (ptr::object(ctx, "ctx")?, ptr::text(uri, "uri")?) };
        let access = match flags {
            crate::GPUIO_OPEN_READ => Access::Read,
            crate::GPUIO_OPEN_WRITE => Access::Write,
            other => return Err(invalid(format!("open flags {other:#x}"))),
        };
        let parsed = Uri::parse(uri)?;
        if matches!(parsed, Uri::Gpu(_) | Uri::Dram { .. } | Uri::Cxl { .. }) {
            return Err(invalid(format!(
                "{uri} names memory: allocate it with gpuio_mem_alloc_host or _device"
            )));
        }
        let resource = ctx.session.open(&parsed, 0, access)?;
        // SAFETY: the caller's contract.
        unsafe { ptr::put(out, ptr::handle(gpuio_handle_t { resource }), "out") }
    })
}

/// The resource's size in bytes now, into `*size`.
///
/// # Safety
/// `handle` came from `gpuio_open`; `size` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_handle_size(handle: *const gpuio_handle_t, size: *mut u64) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let n = unsafe { ptr::object(handle, "handle") }?.resource.len()?;
        // SAFETY: the caller's contract.
        unsafe { ptr::put(size, n, "size") }
    })
}

/// Closes a resource (NULL: nothing). Requests that use it keep it open until they finish.
///
/// # Safety
/// `handle` is NULL or came from `gpuio_open`, and nothing uses it during or after the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_close(handle: *mut gpuio_handle_t) -> c_int {
    call(|| {
        // SAFETY: the caller's contract: gpuio_open's pointer, given back once.
        drop(unsafe { ptr::release(handle) });
        Ok(())
    })
}

/// `len` bytes of host memory, page-locked for DMA if `pinned` is non-zero, into `*out`;
/// `gpuio_mem_host_ptr` gives its address.
///
/// # Safety
/// `ctx` came from `gpuio_init`; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_mem_alloc_host(
    ctx: *const gpuio_context_t,
    len: usize,
    pinned: c_int,
    out: *mut *mut gpuio_mem_t,
) -> c_int {
    call(|| {
        ptr::out(out, "out")?;
        // SAFETY: the caller's contract.
        let ctx = unsafe { ptr::object(ctx, "ctx") }?;
        let dram = HostPlacement::Dram { numa: None };
        let mem = ctx.session.alloc_host(dram, len, pinned != 0)?;
        // SAFETY: the caller's contract: out is writable.
        unsafe { give(out, host(mem)) }
    })
}

/// `len` bytes of memory on GPU `device_id`, into `*out`.
///
/// # Safety
/// `ctx` came from `gpuio_init`; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_mem_alloc_device(
    ctx: *const gpuio_context_t,
    device_id: c_int,
    len: usize,
    out: *mut *mut gpuio_mem_t,
) -> c_int {
    call(|| {
        ptr::out(out, "out")?;
        // SAFETY: the caller's contract.
        let ctx = unsafe { ptr::object(ctx, "ctx") }?;
        let id = u32::try_from(device_id).map_err(|_| invalid(format!("device {device_id}")))?;
        let buf = ctx.session.alloc_device(id, len)?;
        // SAFETY: the caller's contract: out is writable.
        unsafe { give(out, Mem::Device(buf)) }
    })
}

/// Borrows `len` bytes of the caller's GPU memory at device address `addr` on GPU
/// `device_id` (from `cudaMalloc`, a framework's tensor), into `*out`: checked with the driver
/// to lie in one live allocation of that GPU. gpuio waits for the GPU's queued work first, and
/// never frees it; keep it allocated until every transfer using it has finished. The host
/// backend refuses it (`GPUIO_ERROR_UNSUPPORTED`).
///
/// # Safety
/// `ctx` came from `gpuio_init`; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_mem_register_device(
    ctx: *const gpuio_context_t,
    device_id: c_int,
    addr: u64,
    len: usize,
    out: *mut *mut gpuio_mem_t,
) -> c_int {
    call(|| {
        ptr::out(out, "out")?;
        // SAFETY: the caller's contract.
        let ctx = unsafe { ptr::object(ctx, "ctx") }?;
        let id = u32::try_from(device_id).map_err(|_| invalid(format!("device {device_id}")))?;
        let gpu = ctx.session.gpu(id)?;
        let buf = gpu
            .borrow_device(addr, len, ())
            .map_err(gpuio_api::Error::from)?;
        gpu.synchronize().map_err(gpuio_api::Error::from)?;
        // SAFETY: the caller's contract: out is writable.
        unsafe { give(out, Mem::Device(buf)) }
    })
}

/// The host address of host memory (NULL for GPU memory or a null `mem`). Do not read or
/// write it while a request that uses the memory runs.
///
/// # Safety
/// `mem` is NULL or came from a `gpuio_mem_*` function and is not freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_mem_host_ptr(mem: *const gpuio_mem_t) -> *mut c_void {
    // SAFETY: the caller's contract.
    match unsafe { mem.as_ref() }.map(|m| &m.kind) {
        Some(Mem::Host { ptr, .. }) => *ptr as *mut c_void,
        _ => std::ptr::null_mut(),
    }
}

/// The device address of GPU memory (0 for host memory or a null `mem`).
///
/// # Safety
/// As for `gpuio_mem_host_ptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_mem_device_addr(mem: *const gpuio_mem_t) -> u64 {
    // SAFETY: the caller's contract.
    match unsafe { mem.as_ref() }.map(|m| &m.kind) {
        Some(Mem::Device(buf)) => buf.device_addr(),
        _ => 0,
    }
}

/// The size in bytes (0 for a null `mem`).
///
/// # Safety
/// As for `gpuio_mem_host_ptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_mem_len(mem: *const gpuio_mem_t) -> usize {
    // SAFETY: the caller's contract.
    match unsafe { mem.as_ref() }.map(|m| &m.kind) {
        Some(Mem::Host { mem, .. }) => mem.len(),
        Some(Mem::Device(buf)) => buf.len(),
        None => 0,
    }
}

/// Frees memory (NULL: nothing). A request still using it keeps it until it finishes.
///
/// # Safety
/// `mem` is NULL or came from a `gpuio_mem_*` function, and nothing uses it after the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_mem_free(mem: *mut gpuio_mem_t) -> c_int {
    call(|| {
        // SAFETY: the caller's contract: a gpuio_mem_* pointer, given back once.
        drop(unsafe { ptr::release(mem) });
        Ok(())
    })
}
