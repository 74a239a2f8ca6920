//! A context (a gpuio session): `gpuio_init` from a `gpuio_config_t`, `gpuio_finalize`, and
//! what the devices are (`gpuio_device_info_t`).

use crate::error::{Failure, call, invalid};
use crate::ptr;
use gpuio_api::{Backend, Config, PoolSize, Session};
use std::ffi::{c_char, c_int};
use std::path::Path;

/// A gpuio context: devices, engines and the scheduler. Thread-safe: one context may be used
/// from any number of threads at once.
pub struct gpuio_context_t {
    pub(crate) session: Session,
}

/// What `gpuio_init` starts from; zero-initialise it, set `api_version`, change what you need.
#[repr(C)]
pub struct gpuio_config_t {
    /// `GPUIO_API_VERSION`.
    pub api_version: u32,
    /// Reserved: 0.
    pub flags: u32,
    /// Use at most this many GPUs (0: the configuration's choice, all by default).
    pub max_gpus: i32,
    /// The most pinned staging memory the lanes may hold, in bytes (0: the configuration's).
    pub memory_pool_size: usize,
    /// A log filter (`tracing` syntax, e.g. "info" or "gpuio_core=debug"); NULL: the
    /// configuration's.
    pub log_level: *const c_char,
    /// A TOML configuration file; NULL: `$GPUIO_CONFIG` if set, else the defaults. The
    /// `GPUIO_*` environment variables override it either way.
    pub config_file: *const c_char,
}

/// One device, as `gpuio info` describes it.
#[repr(C)]
pub struct gpuio_device_info_t {
    /// The ordinal.
    pub device_id: i32,
    /// 1: an NVIDIA GPU through CUDA; 0: the host backend (the CPU standing in for one).
    pub is_cuda: i32,
    /// The device's name, NUL-terminated (cut to fit).
    pub name: [c_char; 256],
    /// Memory in bytes.
    pub total_memory: u64,
    /// The compute capability's major number (0 on the host backend).
    pub compute_capability_major: i32,
    /// The compute capability's minor number.
    pub compute_capability_minor: i32,
    /// Streaming multiprocessors.
    pub multiprocessors: i32,
    /// Copy engines.
    pub copy_engines: i32,
    /// 1 where GPUDirect Storage is available.
    pub supports_gds: i32,
    /// 1 where GPUDirect RDMA is available.
    pub supports_gdr: i32,
    /// 1 where CXL memory is reachable.
    pub supports_cxl: i32,
    /// 1 where DMA straight from page-cache pages is available.
    pub supports_page_cache_dma: i32,
}

fn config_from(c: &gpuio_config_t) -> Result<Config, Failure> {
    if c.api_version != crate::GPUIO_API_VERSION {
        return Err(invalid(format!(
            "api_version {} (this library speaks {})",
            c.api_version,
            crate::GPUIO_API_VERSION
        )));
    }
    if c.flags != 0 {
        return Err(invalid(format!("flags {:#x}: none are defined", c.flags)));
    }
    // SAFETY: the caller's contract for gpuio_init: the strings are NULL or NUL-terminated.
    let file = (!c.config_file.is_null())
        .then(|| unsafe { ptr::text(c.config_file, "config_file") })
        .transpose()?;
    let mut config = Config::load(file.map(Path::new))?;
    if c.max_gpus < 0 {
        return Err(invalid(format!("max_gpus {}", c.max_gpus)));
    }
    if c.max_gpus > 0 {
        config.max_gpus = c.max_gpus as u32;
    }
    if c.memory_pool_size > 0 {
        config.memory_pool_size = PoolSize::Bytes(bytesize::ByteSize::b(c.memory_pool_size as u64));
    }
    if !c.log_level.is_null() {
        // SAFETY: as above.
        config.log_level = unsafe { ptr::text(c.log_level, "log_level") }?.to_string();
    }
    Ok(config)
}

/// Starts a context from `config` (NULL: the defaults, `$GPUIO_CONFIG`, `GPUIO_*`) into
/// `*ctx`. Release it with `gpuio_finalize`.
///
/// # Safety
/// `config` is NULL or a valid `gpuio_config_t` whose strings are NULL or NUL-terminated;
/// `ctx` is valid for writing a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_init(
    config: *const gpuio_config_t,
    ctx: *mut *mut gpuio_context_t,
) -> c_int {
    call(|| {
        ptr::out(ctx, "ctx")?;
        let config = if config.is_null() {
            Config::load(None)?
        } else {
            // SAFETY: the caller's contract: a valid gpuio_config_t.
            config_from(unsafe { ptr::object(config, "config") }?)?
        };
        let session = Session::new(config)?;
        // SAFETY: the caller's contract: ctx is writable.
        unsafe { ptr::put(ctx, ptr::handle(gpuio_context_t { session }), "ctx") }
    })
}

/// Ends a context (NULL: nothing). Requests still queued run to their end first, and their
/// callbacks have run when this returns. Not from inside a request's callback.
///
/// # Safety
/// `ctx` is NULL or came from `gpuio_init`, and nothing uses it during or after the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_finalize(ctx: *mut gpuio_context_t) -> c_int {
    call(|| {
        // SAFETY: the caller's contract: gpuio_init's pointer, given back once.
        drop(unsafe { ptr::release(ctx) });
        Ok(())
    })
}

/// How many devices the context uses, into `*count`.
///
/// # Safety
/// `ctx` came from `gpuio_init`; `count` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_get_device_count(
    ctx: *const gpuio_context_t,
    count: *mut c_int,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let ctx = unsafe { ptr::object(ctx, "ctx") }?;
        let n = ctx.session.gpus().len() as c_int;
        // SAFETY: the caller's contract.
        unsafe { ptr::put(count, n, "count") }
    })
}

/// Device `device_id`'s description, into `*info`.
///
/// # Safety
/// `ctx` came from `gpuio_init`; `info` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_get_device_info(
    ctx: *const gpuio_context_t,
    device_id: c_int,
    info: *mut gpuio_device_info_t,
) -> c_int {
    call(|| {
        // SAFETY: the caller's contract.
        let ctx = unsafe { ptr::object(ctx, "ctx") }?;
        let id = u32::try_from(device_id).map_err(|_| invalid(format!("device {device_id}")))?;
        let d = ctx.session.gpu(id)?.info();
        let mut name = [0 as c_char; 256];
        for (dst, b) in name.iter_mut().zip(d.name.bytes().take(255)) {
            *dst = b as c_char;
        }
        let (major, minor) = d.compute_capability.unwrap_or((0, 0));
        let out = gpuio_device_info_t {
            device_id,
            is_cuda: (d.backend == Backend::Cuda) as i32,
            name,
            total_memory: d.total_memory,
            compute_capability_major: major as i32,
            compute_capability_minor: minor as i32,
            multiprocessors: d.multiprocessors as i32,
            copy_engines: d.copy_engines as i32,
            supports_gds: d.gds.available as i32,
            supports_gdr: d.gdr.available as i32,
            supports_cxl: d.cxl.available as i32,
            supports_page_cache_dma: d.page_cache_dma.available as i32,
        };
        // SAFETY: the caller's contract.
        unsafe { ptr::put(info, out, "info") }
    })
}
