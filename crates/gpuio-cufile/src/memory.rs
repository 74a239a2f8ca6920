//! Buffers: what a `bufPtr_base` (plus `bufPtr_offset`) points at. GPU memory the CUDA driver
//! knows is borrowed in place (checked to lie inside one allocation); anything else is host
//! memory, which cuFile takes too (`ALLOW_SYSTEM_MEMORY`). `cuFileBufRegister` checks a buffer
//! once, and IO into it then skips the driver's lookup.

use crate::abi;
use crate::driver::DRIVER;
use crate::fault::{Fault, Result};
use crate::params::ALLOW_SYSTEM_MEMORY;
use gpuio_api::{DeviceBuffer, Session};

/// A registered buffer.
pub struct Registered {
    pub len: usize,
    /// Its GPU memory, borrowed; None for host memory.
    pub device: Option<DeviceBuffer>,
}

/// Where one IO's bytes are.
pub enum Memory {
    /// GPU memory, `offset` bytes into `buf`.
    Device { buf: DeviceBuffer, offset: usize },
    /// Host memory at this address (the caller's: cuFile's contract is that it is mapped).
    Host(*mut u8),
}

impl Memory {
    /// The GPU it is on (None: host memory).
    pub fn gpu(&self) -> Option<u32> {
        match self {
            Memory::Device { buf, .. } => Some(buf.gpu().ordinal()),
            Memory::Host(_) => None,
        }
    }
}

/// The GPU memory at `addr..addr + len`, if the driver knows it as such.
fn device_at(session: &Session, addr: u64, len: usize) -> Result<Option<DeviceBuffer>> {
    for gpu in session.gpus() {
        if let Some(buf) = gpu
            .borrow_device_if_held(addr, len.max(1), ())
            .map_err(|e| {
                let e = gpuio_api::Error::from(e);
                let code = match e.code() {
                    gpuio_api::ErrorCode::InvalidArg => abi::CU_FILE_CUDA_POINTER_RANGE_ERROR,
                    _ => abi::CU_FILE_CUDA_DRIVER_ERROR,
                };
                Fault::new(code, format!("{addr:#x}: {e}"))
            })?
        {
            return Ok(Some(buf));
        }
    }
    Ok(None)
}

/// Registers `len` bytes at `base`.
pub fn register(session: &Session, base: u64, len: usize) -> Result<Registered> {
    if base == 0 || len == 0 {
        return Err(Fault::invalid("a buffer needs an address and a length"));
    }
    let device = device_at(session, base, len)?;
    if device.is_none() && !DRIVER.params().flag(ALLOW_SYSTEM_MEMORY) {
        return Err(Fault::new(
            abi::CU_FILE_CUDA_POINTER_INVALID,
            "host memory, and ALLOW_SYSTEM_MEMORY is off",
        ));
    }
    Ok(Registered { len, device })
}

/// The memory of an IO of `len` bytes at `base + offset`.
pub fn resolve(session: &Session, base: u64, offset: i64, len: usize) -> Result<Memory> {
    let offset = u64::try_from(offset)
        .map_err(|_| Fault::invalid(format!("negative buffer offset {offset}")))?;
    if base == 0 {
        return Err(Fault::invalid("the buffer is NULL"));
    }
    let end = base
        .checked_add(offset)
        .and_then(|a| a.checked_add(len as u64))
        .ok_or_else(|| Fault::invalid("buffer address overflows"))?;
    let addr = base + offset;
    let found = {
        let reg = DRIVER.registry();
        reg.buffers
            .range(..=base)
            .next_back()
            .filter(|(b, r)| base < *b + r.len as u64)
            .map(|(b, r)| (*b, r.len, r.device.clone()))
    };
    if let Some((b, reg_len, device)) = found {
        if end > b + reg_len as u64 {
            return Err(Fault::new(
                abi::CU_FILE_INVALID_MAPPING_RANGE,
                format!("{len} bytes at {addr:#x} run past the buffer registered at {b:#x}"),
            ));
        }
        return Ok(match device {
            Some(buf) => Memory::Device {
                buf,
                offset: (addr - b) as usize,
            },
            None => Memory::Host(addr as *mut u8),
        });
    }
    match device_at(session, addr, len)? {
        Some(buf) => Ok(Memory::Device { buf, offset: 0 }),
        None if DRIVER.params().flag(ALLOW_SYSTEM_MEMORY) => Ok(Memory::Host(addr as *mut u8)),
        None => Err(Fault::new(
            abi::CU_FILE_CUDA_POINTER_INVALID,
            format!("{addr:#x} is not GPU memory, and ALLOW_SYSTEM_MEMORY is off"),
        )),
    }
}
