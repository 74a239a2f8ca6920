//! Memory registered with a NIXL agent: [`NixlRegion`] (a range of a `HostBuffer`, holding its
//! mapping), what a peer needs to reach it ([`NixlRemote`]), and the range checks a transfer
//! makes before anything is posted.

use gpuio_hal::{HalError, HostBuffer, MappingHold, Result};
use nixl_sys::{MemType, MemoryRegion, NixlDescriptor, RegistrationHandle};
use std::ops::Range;

/// A range of memory as NIXL describes it: address, length, memory kind and device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

impl Span {
    /// The span of `bytes`.
    pub(crate) fn of(bytes: &[u8]) -> Self {
        Self {
            addr: bytes.as_ptr() as usize,
            len: bytes.len(),
        }
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
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// A range of a [`HostBuffer`] registered with an agent: exposed to the peers that hold this
/// agent's metadata, and the local end of transfers on slices inside it.
///
/// NIXL (UCX) exposes a registration to every peer that loaded the agent's metadata, for reads
/// and writes alike: no per-peer or read-only rights exist at this level. A peer's writes can
/// change its bytes under a reader; gpuio only copies them, never interprets them. The region
/// keeps the buffer's mapping alive (its pages leak if the buffer drops first), so the
/// registered addresses never belong to another mapping.
pub struct NixlRegion {
    // Declared first: deregistered before the mapping hold is released.
    _reg: RegistrationHandle,
    _hold: MappingHold,
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
        let hold = buf.hold_mapping();
        let span = Span {
            addr: buf.base_ptr() as usize + range.start,
            len: range.len(),
        };
        let reg = agent
            .register_memory(&span, None)
            .map_err(|e| crate::nixl_err("registering memory", e))?;
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
        }
    }

    /// The span of `bytes`, after checking they lie inside the registered range.
    pub(crate) fn span_of(&self, bytes: &[u8]) -> Result<Span> {
        let (addr, len) = (bytes.as_ptr() as usize, bytes.len());
        if addr < self.span.addr || addr + len > self.span.addr + self.span.len {
            return Err(HalError::InvalidArgument(format!(
                "{len} bytes at {addr:#x} are outside the registered region {:#x}+{}",
                self.span.addr, self.span.len
            )));
        }
        Ok(Span { addr, len })
    }
}

/// A peer's registered host memory: its address and length in the peer's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NixlRemote {
    /// Virtual address of its first byte, in the peer's process.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

impl NixlRemote {
    /// The span of `len` bytes at `offset`, after checking they lie inside.
    pub(crate) fn span_at(&self, offset: u64, len: usize) -> Result<Span> {
        let addr = self.addr.checked_add(offset).map(usize::try_from);
        match (offset.checked_add(len as u64), addr) {
            (Some(end), Some(Ok(addr))) if end <= self.len => Ok(Span { addr, len }),
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
        };
        let s = r.span_at(90, 10).unwrap();
        assert_eq!((s.addr, s.len), (0x1000 + 90, 10));
        for (off, len) in [(91, 10), (u64::MAX, 1), (100, 1)] {
            let e = r.span_at(off, len).unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
        }
        assert!(r.span_at(100, 0).is_ok());
    }
}
