//! Memory registered with a NIXL agent: [`NixlRegion`] (a range of a `HostBuffer` or a
//! `DeviceBuffer`, holding it), what a peer needs to reach it ([`NixlRemote`]), and the range
//! checks a transfer makes before anything is posted.

use gpuio_hal::{Backend, DeviceBuffer, HalError, HostBuffer, MappingHold, Result};
use nixl_sys::{MemType, MemoryRegion, NixlDescriptor, RegistrationHandle};
use std::ops::Range;

/// Where registered memory lies, as NIXL describes it (and UCX picks transports by).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NixlMem {
    /// Host memory.
    Host,
    /// Memory of the CUDA device with this ordinal (UCX moves it with `cuda_ipc` within a
    /// host, GPUDirect RDMA between hosts).
    Gpu(u32),
}

impl NixlMem {
    /// Where `buf`'s memory lies: on its GPU, or in host memory for the host backend's
    /// stand-in devices.
    pub fn of_device(buf: &DeviceBuffer) -> Self {
        match buf.gpu().backend() {
            Backend::Cuda => Self::Gpu(buf.gpu().ordinal()),
            Backend::Host => Self::Host,
        }
    }

    pub(crate) fn mem_type(self) -> MemType {
        match self {
            Self::Host => MemType::Dram,
            Self::Gpu(_) => MemType::Vram,
        }
    }

    pub(crate) fn device_id(self) -> u64 {
        match self {
            Self::Host => 0,
            Self::Gpu(n) => u64::from(n),
        }
    }
}

/// A range of memory as NIXL describes it: address, length, memory kind and device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) mem: NixlMem,
}

impl Span {
    /// The span of `bytes` (host memory).
    pub(crate) fn of(bytes: &[u8]) -> Self {
        Self {
            addr: bytes.as_ptr() as usize,
            len: bytes.len(),
            mem: NixlMem::Host,
        }
    }

    /// The span of `range` of `buf`, after checking it lies inside.
    pub(crate) fn of_device(buf: &DeviceBuffer, range: Range<usize>) -> Result<Self> {
        gpuio_hal::check_range("NIXL device range", range.start, range.len(), buf.len())?;
        let addr = usize::try_from(buf.device_addr())
            .map_err(|_| HalError::InvalidArgument("a device address past usize".into()))?;
        Ok(Self {
            addr: addr + range.start,
            len: range.len(),
            mem: NixlMem::of_device(buf),
        })
    }
}

impl MemoryRegion for Span {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Span {
    fn mem_type(&self) -> MemType {
        self.mem.mem_type()
    }

    fn device_id(&self) -> u64 {
        self.mem.device_id()
    }
}

/// What keeps a region's memory at its registered addresses.
enum Hold {
    /// A host buffer's mapping (its pages leak if the buffer drops first).
    Host { _mapping: MappingHold },
    /// A device buffer (a clone: the memory is freed after the last one drops).
    Device { _buffer: DeviceBuffer },
    /// Nothing: a cached registration of a device allocation or a host buffer, checked by
    /// its id before each use; the caller's buffer keeps the memory while a transfer runs.
    Checked,
}

/// A range of a [`HostBuffer`] or a [`DeviceBuffer`] registered with an agent: exposed to the
/// peers that hold this agent's metadata, and the local end of transfers inside it.
///
/// NIXL (UCX) exposes a registration to every peer that loaded the agent's metadata, for reads
/// and writes alike: no per-peer or read-only rights exist at this level. A peer's writes can
/// change its bytes under a reader; gpuio only copies them, never interprets them. The region
/// keeps the memory alive (a host buffer's mapping, a device buffer), so the registered
/// addresses never belong to another allocation.
pub struct NixlRegion {
    // Declared first: deregistered before the hold is released.
    _reg: RegistrationHandle,
    _hold: Hold,
    span: Span,
}

impl std::fmt::Debug for NixlRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlRegion")
            .field("addr", &self.span.addr)
            .field("len", &self.span.len)
            .finish()
    }
}

impl NixlRegion {
    /// Registers `range` of `buf` with `agent` (crate-internal: [`crate::NixlAgent::register`]).
    pub(crate) fn new(
        agent: &nixl_sys::Agent,
        buf: &HostBuffer,
        range: Range<usize>,
    ) -> Result<Self> {
        gpuio_hal::check_range("NIXL region", range.start, range.len(), buf.len())?;
        if range.is_empty() {
            return Err(HalError::InvalidArgument(
                "a NIXL region needs at least one byte".into(),
            ));
        }
        let hold = Hold::Host {
            _mapping: buf.hold_mapping(),
        };
        let span = Span {
            addr: buf.base_ptr() as usize + range.start,
            len: range.len(),
            mem: NixlMem::Host,
        };
        Self::register(agent, span, hold)
    }

    /// Registers `range` of the device buffer `buf` (crate-internal:
    /// [`crate::NixlAgent::register_device`]).
    pub(crate) fn device(
        agent: &nixl_sys::Agent,
        buf: &DeviceBuffer,
        range: Range<usize>,
    ) -> Result<Self> {
        if range.is_empty() {
            return Err(HalError::InvalidArgument(
                "a NIXL region needs at least one byte".into(),
            ));
        }
        let span = Span::of_device(buf, range)?;
        // UCX's CUDA transports act in the calling thread's context.
        buf.gpu().bind_thread()?;
        let hold = Hold::Device {
            _buffer: buf.clone(),
        };
        Self::register(agent, span, hold)
    }

    /// Registers `span`, holding nothing (crate-internal: the registration caches', which
    /// check before each use that the memory is still the same).
    pub(crate) fn checked(agent: &nixl_sys::Agent, span: Span) -> Result<Self> {
        Self::register(agent, span, Hold::Checked)
    }

    fn register(agent: &nixl_sys::Agent, span: Span, hold: Hold) -> Result<Self> {
        let reg = register_span(agent, span)?;
        Ok(Self {
            _reg: reg,
            _hold: hold,
            span,
        })
    }

    /// What a peer needs to reach it (with this agent's metadata).
    pub fn remote(&self) -> NixlRemote {
        NixlRemote {
            addr: self.span.addr as u64,
            len: self.span.len as u64,
            mem: self.span.mem,
        }
    }

    /// The span of `range` (offsets into the region), after checking it lies inside.
    pub(crate) fn span_in(&self, range: Range<usize>) -> Result<Span> {
        gpuio_hal::check_range("NIXL region", range.start, range.len(), self.span.len)?;
        Ok(Span {
            addr: self.span.addr + range.start,
            len: range.len(),
            mem: self.span.mem,
        })
    }

    /// The span of `bytes`, after checking they lie inside the registered range (of host
    /// memory).
    pub(crate) fn span_of(&self, bytes: &[u8]) -> Result<Span> {
        let (addr, len) = (bytes.as_ptr() as usize, bytes.len());
        if self.span.mem != NixlMem::Host {
            return Err(HalError::InvalidArgument(
                "host bytes named in a region of GPU memory".into(),
            ));
        }
        if addr < self.span.addr || addr + len > self.span.addr + self.span.len {
            return Err(HalError::InvalidArgument(format!(
                "{len} bytes at {addr:#x} are outside the registered region {:#x}+{}",
                self.span.addr, self.span.len
            )));
        }
        Ok(Span {
            addr,
            len,
            mem: NixlMem::Host,
        })
    }
}

/// Registers `span` with `agent`. Host memory is registered with no CUDA context current on
/// the thread: under one, UCX pins every host range it registers (`cuMemHostRegister`, ~0.3 ms
/// a MiB, more than moving it on loopback), which host memory transfers do not need.
pub(crate) fn register_span(agent: &nixl_sys::Agent, span: Span) -> Result<RegistrationHandle> {
    let register = || agent.register_memory(&span, None);
    let reg = match span.mem {
        NixlMem::Host => gpuio_hal::without_cuda_context(register),
        NixlMem::Gpu(_) => register(),
    };
    reg.map_err(|e| crate::nixl_err("registering memory", e))
}

/// A peer's registered memory: its address and length in the peer's address space, and
/// where it lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NixlRemote {
    /// Virtual address of its first byte, in the peer's process.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Host or GPU memory (as the peer registered it).
    pub mem: NixlMem,
}

impl NixlRemote {
    /// The span of `len` bytes at `offset`, after checking they lie inside.
    pub(crate) fn span_at(&self, offset: u64, len: usize) -> Result<Span> {
        let addr = self.addr.checked_add(offset).map(usize::try_from);
        match (offset.checked_add(len as u64), addr) {
            (Some(end), Some(Ok(addr))) if end <= self.len => Ok(Span {
                addr,
                len,
                mem: self.mem,
            }),
            _ => Err(HalError::InvalidArgument(format!(
                "{offset}+{len} is outside the peer's region ({} bytes)",
                self.len
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuio_hal::ErrorCode;

    #[test]
    fn a_remote_range_must_lie_inside_the_peers_region() {
        let r = NixlRemote {
            addr: 0x1000,
            len: 100,
            mem: NixlMem::Gpu(1),
        };
        let s = r.span_at(90, 10).unwrap();
        assert_eq!((s.addr, s.len, s.mem), (0x1000 + 90, 10, NixlMem::Gpu(1)));
        assert_eq!((s.mem_type(), s.device_id()), (MemType::Vram, 1));
        for (off, len) in [(91, 10), (u64::MAX, 1), (100, 1)] {
            let e = r.span_at(off, len).unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
        }
        assert!(r.span_at(100, 0).is_ok());
    }
}
