//! The driver: open, close, properties, knobs, version, P2P flags, BAR size, topology.

use super::{put, status};
use crate::abi::{self, CUfileDrvProps_t, CUfileError_t};
use crate::driver::DRIVER;
use crate::fault::{Fault, Result};
use crate::params::{self, Params};
use std::ffi::{CStr, c_char, c_int, c_long};

#[unsafe(no_mangle)]
pub extern "C" fn cuFileDriverOpen() -> CUfileError_t {
    status(|| DRIVER.open())
}

/// The unversioned close, for programs built before cufile.h renamed it.
#[unsafe(no_mangle)]
pub extern "C" fn cuFileDriverClose() -> CUfileError_t {
    status(|| DRIVER.close())
}

/// What `cuFileDriverClose` names in programs built with cufile.h 1.x's macro.
#[unsafe(no_mangle)]
pub extern "C" fn cuFileDriverClose_v2() -> CUfileError_t {
    status(|| DRIVER.close())
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileUseCount() -> c_long {
    DRIVER.use_count().min(c_long::MAX as u64) as c_long
}

fn uint(v: usize) -> u32 {
    v.min(u32::MAX as usize) as u32
}

/// What the driver is: no nvidia-fs (its version 0.0, no file systems of its own), compat
/// mode (POSIX IO on gpuio's lanes) allowed, batch, stream and parallel IO supported.
fn properties(p: &Params) -> CUfileDrvProps_t {
    CUfileDrvProps_t {
        nvfs: abi::CUfileDrvPropsNvfs {
            major_version: 0,
            minor_version: 0,
            poll_thresh_size: p.size(params::POLLTHRESHOLD_SIZE_KB),
            max_direct_io_size: p.size(params::MAX_DIRECT_IO_SIZE_KB),
            dstatusflags: 0,
            dcontrolflags: (u32::from(p.flag(params::USE_POLL_MODE)))
                | (1 << abi::CU_FILE_ALLOW_COMPAT_MODE),
        },
        fflags: (1 << abi::CU_FILE_BATCH_IO_SUPPORTED)
            | (1 << abi::CU_FILE_STREAMS_SUPPORTED)
            | (1 << abi::CU_FILE_PARALLEL_IO_SUPPORTED),
        max_device_cache_size: uint(p.size(params::MAX_DEVICE_CACHE_SIZE_KB)),
        per_buffer_cache_size: uint(p.size(params::PER_BUFFER_CACHE_SIZE_KB)),
        max_device_pinned_mem_size: uint(p.size(params::MAX_DEVICE_PINNED_MEM_SIZE_KB)),
        max_batch_io_size: uint(p.size(params::IO_BATCHSIZE)),
        max_batch_io_timeout_msecs: uint(p.size(params::BATCH_IO_TIMEOUT_MS)),
    }
}

/// # Safety
/// `props` is NULL or writable for a `CUfileDrvProps_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileDriverGetProperties(props: *mut CUfileDrvProps_t) -> CUfileError_t {
    status(|| {
        let p = properties(&DRIVER.params());
        // SAFETY: the caller's contract.
        unsafe { put(props, p, "props") }
    })
}

/// Sets a `size_t` property, in KiB as cuFile's knobs take it.
fn set_kib(param: usize, kib: usize) -> CUfileError_t {
    status(|| DRIVER.set_property(|p| p.set_size(param as c_int, kib)))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileDriverSetPollMode(poll: bool, poll_threshold_size: usize) -> CUfileError_t {
    status(|| {
        DRIVER.set_property(|p| {
            p.set_size(params::POLLTHRESHOLD_SIZE_KB as c_int, poll_threshold_size)?;
            p.set_bool(params::USE_POLL_MODE as c_int, poll)
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileDriverSetMaxDirectIOSize(max_direct_io_size: usize) -> CUfileError_t {
    set_kib(params::MAX_DIRECT_IO_SIZE_KB, max_direct_io_size)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileDriverSetMaxCacheSize(max_cache_size: usize) -> CUfileError_t {
    set_kib(params::MAX_DEVICE_CACHE_SIZE_KB, max_cache_size)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileDriverSetMaxPinnedMemSize(max_pinned_size: usize) -> CUfileError_t {
    set_kib(params::MAX_DEVICE_PINNED_MEM_SIZE_KB, max_pinned_size)
}

/// # Safety
/// `version` is NULL or writable for an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetVersion(version: *mut c_int) -> CUfileError_t {
    // SAFETY: the caller's contract.
    status(|| unsafe { put(version, crate::CUFILE_VERSION, "version") })
}

fn target(flag: c_int) -> Result<()> {
    if !(0..abi::CU_FILE_MAX_TARGET_TYPES).contains(&flag) {
        return Err(Fault::invalid(format!("no file system type {flag}")));
    }
    Ok(())
}

/// No P2P DMA for any file system: the bytes always cross host memory.
///
/// # Safety
/// `p2p_flags` is NULL or writable for an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileDriverGetP2PFlags(
    status_flag: c_int,
    p2p_flags: *mut c_int,
) -> CUfileError_t {
    status(|| {
        target(status_flag)?;
        // SAFETY: the caller's contract.
        unsafe { put(p2p_flags, 0, "p2p_flags") }
    })
}

/// Only "none" can be set: there is no P2P path to turn on.
#[unsafe(no_mangle)]
pub extern "C" fn cuFileDriverSetP2PFlags(status_flag: c_int, p2p_flags: c_int) -> CUfileError_t {
    status(|| {
        target(status_flag)?;
        if p2p_flags != 0 {
            return Err(Fault::new(
                abi::CU_FILE_PLATFORM_NOT_SUPPORTED,
                "no P2P DMA between storage and GPUs here",
            ));
        }
        Ok(())
    })
}

/// BAR1 of GPU `index` (its PCI resource 1), from sysfs.
fn bar_kib(index: c_int) -> Result<usize> {
    let session = DRIVER.active()?;
    let gpu = usize::try_from(index)
        .ok()
        .and_then(|i| session.gpus().get(i))
        .ok_or_else(|| Fault::new(abi::CU_FILE_DEVICE_NOT_FOUND, format!("no GPU {index}")))?;
    let bus = gpu.info().pci_bus_id.clone().ok_or_else(|| {
        Fault::new(
            abi::CU_FILE_DEVICE_NOT_SUPPORTED,
            format!("GPU {index} has no PCI address"),
        )
    })?;
    let path = format!("/sys/bus/pci/devices/{}/resource", bus.to_lowercase());
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Fault::new(abi::CU_FILE_PLATFORM_NOT_SUPPORTED, format!("{path}: {e}")))?;
    let bar = text.lines().nth(1).unwrap_or_default();
    let mut f = bar
        .split_whitespace()
        .map(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16));
    match (f.next(), f.next()) {
        (Some(Ok(start)), Some(Ok(end))) if end > start => Ok(((end - start + 1) / 1024) as usize),
        _ => Err(Fault::new(
            abi::CU_FILE_PLATFORM_NOT_SUPPORTED,
            format!("{path}: no BAR1 range"),
        )),
    }
}

/// # Safety
/// `bar_size` is NULL or writable for a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileGetBARSizeInKB(
    gpu_index: c_int,
    bar_size: *mut usize,
) -> CUfileError_t {
    status(|| {
        if bar_size.is_null() {
            return Err(Fault::invalid("barSize is NULL"));
        }
        let kib = bar_kib(gpu_index)?;
        // SAFETY: the caller's contract.
        unsafe { put(bar_size, kib, "barSize") }
    })
}

/// Writes what gpuio sees of the GPUs (ordinal, name, PCI address, NUMA node) as JSON.
///
/// # Safety
/// `filename` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileExportPCIeTopology(filename: *const c_char) -> CUfileError_t {
    status(|| {
        // SAFETY: the caller's contract.
        let name = unsafe { text(filename, "filename")? };
        let session = DRIVER.active()?;
        let gpus: Vec<String> = session
            .gpus()
            .iter()
            .map(|g| {
                let i = g.info();
                format!(
                    "{{\"ordinal\": {}, \"name\": {:?}, \"pci_bus_id\": {:?}, \"numa_node\": {}}}",
                    i.ordinal,
                    i.name,
                    i.pci_bus_id.as_deref().unwrap_or(""),
                    i.numa_node.map_or("null".into(), |n| n.to_string())
                )
            })
            .collect();
        let json = format!(
            "{{\"gpus\": [{}], \"nvidia_fs\": false}}\n",
            gpus.join(", ")
        );
        std::fs::write(name, json)
            .map_err(|e| Fault::new(abi::CU_FILE_PERMISSION_DENIED, format!("{name}: {e}")))
    })
}

/// The NUL-terminated UTF-8 text at `p`.
///
/// # Safety
/// A non-null `p` points to a NUL-terminated string.
pub(super) unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Fault::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null and NUL-terminated (the caller's contract).
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Fault::invalid(format!("{what} is not UTF-8")))
}
