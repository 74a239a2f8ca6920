//! Memory registered with an RDMA device, and the checks a verb makes on it before anything is
//! posted: [`RdmaBuffer`] (host memory it owns, registered), [`HostRegion`] (a registered range
//! of a `HostBuffer` that holds its mapping: exposed to peers, and the local end of verbs on
//! slices inside it), [`RemoteRegion`] (a peer's region: address, length, key), and
//! [`RdmaAccess`] (what a peer's NIC may do). A local range must lie inside its registration and
//! a remote one inside the peer's region, and one work request moves at most 4 GiB (the
//! scatter-gather entry's length is 32 bits).

use super::device::RdmaDevice;
use super::rdma_err;
use gpuio_hal::{HalError, Result};
use gpuio_hal::{HostAllocOptions, HostBuffer, MappingHold};
use rdma_sys::*;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

/// How a peer's NIC may use a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RdmaAccess {
    /// One-sided reads.
    pub remote_read: bool,
    /// One-sided writes.
    pub remote_write: bool,
    /// Atomic compare-and-swap and fetch-and-add.
    pub remote_atomic: bool,
}

impl RdmaAccess {
    /// The verbs library's access flags: local write always, the rest as permitted.
    pub(super) fn flags(self) -> u32 {
        let mut f = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if self.remote_read {
            f |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        if self.remote_write {
            f |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if self.remote_atomic {
            f |= ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        }
        f
    }
}

/// A memory registration; deregistered on drop.
struct MemoryRegistration {
    mr: NonNull<ibv_mr>,
    _dev: Arc<RdmaDevice>,
}

// SAFETY: a memory region is a handle the NIC uses; deregistering it from any thread is allowed.
unsafe impl Send for MemoryRegistration {}
// SAFETY: no method mutates it.
unsafe impl Sync for MemoryRegistration {}

impl MemoryRegistration {
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    /// The range must stay mapped until the registration drops.
    unsafe fn new(
        dev: &Arc<RdmaDevice>,
        addr: *mut u8,
        len: usize,
        access: RdmaAccess,
    ) -> Result<Self> {
        // SAFETY: the PD is alive (dev), and the caller keeps the range mapped.
        let mr = unsafe { __ibv_reg_mr(dev.pd.as_ptr(), addr.cast(), len, access.flags(), 0) };
        let mr = NonNull::new(mr).ok_or_else(|| rdma_err("registering memory"))?;
        Ok(Self {
            mr,
            _dev: dev.clone(),
        })
    }

    fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered until drop.
        unsafe { self.mr.as_ref().lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { self.mr.as_ref().rkey }
    }
}

impl Drop for MemoryRegistration {
    fn drop(&mut self) {
        // SAFETY: registered in `new`, deregistered once; the memory is still mapped (the
        // owners drop their memory or mapping hold after this).
        unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

/// The scatter-gather entry of `len` bytes at `addr` under `lkey`.
fn sge_at(addr: u64, len: usize, lkey: u32) -> Result<ibv_sge> {
    let length = u32::try_from(len).map_err(|_| {
        HalError::InvalidArgument(format!("an RDMA work request of {len} bytes (limit 4 GiB)"))
    })?;
    Ok(ibv_sge { addr, length, lkey })
}

/// Host memory of its own, registered with a device: the local end of verbs.
pub struct RdmaBuffer {
    // Declared first: deregistered before the memory goes.
    reg: MemoryRegistration,
    buf: HostBuffer,
}

impl std::fmt::Debug for RdmaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaBuffer")
            .field("len", &self.buf.len())
            .finish()
    }
}

impl RdmaBuffer {
    /// `len` bytes of host memory registered with `dev` for local use.
    pub fn new(dev: &Arc<RdmaDevice>, len: usize) -> Result<Self> {
        let buf = HostBuffer::alloc(len.max(8), &HostAllocOptions::default())?;
        // SAFETY: the registration is dropped before `buf` (field order), which keeps the
        // memory mapped until then.
        let reg = unsafe {
            MemoryRegistration::new(dev, buf.base_ptr(), buf.len(), RdmaAccess::default())?
        };
        Ok(Self { reg, buf })
    }

    /// Its bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// Its bytes, to fill before a write or send.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether it is empty (never: at least 8 bytes).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The entry for `len` bytes at `offset`, after checking they lie inside.
    pub(super) fn sge(&self, offset: usize, len: usize) -> Result<ibv_sge> {
        gpuio_hal::check_range("RDMA local buffer", offset, len, self.buf.len())?;
        sge_at(
            self.buf.base_ptr() as u64 + offset as u64,
            len,
            self.reg.lkey(),
        )
    }
}

/// A range of a [`HostBuffer`] registered with a device: exposed to peers' one-sided verbs
/// (an agent's memory export), and the local end of verbs on slices that lie inside it (the
/// core's registration cache hands these out for callers' memory, so transfers land in place
/// with no staging copy).
///
/// The region keeps the buffer's mapping alive (its pages leak if the buffer drops first), so
/// the registered addresses can never belong to another mapping: a slice inside the range is
/// memory this registration covers.
pub struct HostRegion {
    // Declared first: deregistered before the mapping hold is released.
    reg: MemoryRegistration,
    _hold: MappingHold,
    addr: u64,
    len: usize,
}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .finish()
    }
}

impl HostRegion {
    /// Registers `range` of `buf` with `dev`, permitting peers `access` (none: local use
    /// only).
    pub fn new(
        dev: &Arc<RdmaDevice>,
        buf: &HostBuffer,
        range: Range<usize>,
        access: RdmaAccess,
    ) -> Result<Self> {
        gpuio_hal::check_range("RDMA region", range.start, range.len(), buf.len())?;
        if range.is_empty() {
            return Err(HalError::InvalidArgument(
                "an RDMA region needs at least one byte".into(),
            ));
        }
        let hold = buf.hold_mapping();
        let start = buf.base_ptr().wrapping_add(range.start);
        // SAFETY: `hold` keeps the mapping until after the registration drops (field order).
        // Remote writes race local readers of the bytes of an exposed region; the module docs
        // say why that is accepted (plain bytes, only copied, as with GPU-written mapped
        // memory).
        let reg = unsafe { MemoryRegistration::new(dev, start, range.len(), access)? };
        Ok(Self {
            reg,
            _hold: hold,
            addr: start as u64,
            len: range.len(),
        })
    }

    /// What a peer needs to reach it.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr,
            len: self.len as u64,
            rkey: self.reg.rkey(),
        }
    }

    /// Whether `bytes` lie inside the registered range.
    pub fn contains(&self, bytes: &[u8]) -> bool {
        inside(self.addr, self.len, bytes.as_ptr() as u64, bytes.len())
    }

    /// The entry for `len` bytes of a slice at `addr`, after checking they lie inside.
    pub(super) fn sge(&self, bytes: &[u8]) -> Result<ibv_sge> {
        if !self.contains(bytes) {
            return Err(HalError::InvalidArgument(format!(
                "{} bytes at {:#x} are outside the registered region {:#x}+{}",
                bytes.len(),
                bytes.as_ptr() as u64,
                self.addr,
                self.len
            )));
        }
        sge_at(bytes.as_ptr() as u64, bytes.len(), self.reg.lkey())
    }
}

/// Whether `n` bytes at `start` lie inside the `len` bytes at `addr` (of one address space:
/// no sum overflows).
fn inside(addr: u64, len: usize, start: u64, n: usize) -> bool {
    start >= addr && start + n as u64 <= addr + len as u64
}

/// A region of a peer: its virtual address, length and remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Virtual address of its first byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// The key its owner's NIC checks.
    pub rkey: u32,
}

impl RemoteRegion {
    /// The address of `len` bytes at `offset`, after checking they lie inside.
    pub(super) fn at(&self, offset: u64, len: usize) -> Result<u64> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(self.addr + offset),
            _ => Err(HalError::InvalidArgument(format!(
                "{offset}+{len} is outside the remote region ({} bytes)",
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
    fn access_flags_always_allow_local_writes() {
        let local = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        let read = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        let write = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        let atomic = ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        assert_eq!(RdmaAccess::default().flags(), local);
        let only_read = RdmaAccess {
            remote_read: true,
            ..RdmaAccess::default()
        };
        assert_eq!(only_read.flags(), local | read);
        let all = RdmaAccess {
            remote_read: true,
            remote_write: true,
            remote_atomic: true,
        };
        assert_eq!(all.flags(), local | read | write | atomic);
    }

    #[test]
    fn a_scatter_gather_entry_holds_less_than_4_gib() {
        let sge = sge_at(0x1000, 4096, 7).unwrap();
        assert_eq!((sge.addr, sge.length, sge.lkey), (0x1000, 4096, 7));
        assert_eq!(sge_at(0, u32::MAX as usize, 7).unwrap().length, u32::MAX);
        let Err(err) = sge_at(0, u32::MAX as usize + 1, 7) else {
            panic!("4 GiB in one entry")
        };
        assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    }

    #[test]
    fn remote_ranges_are_checked_against_the_region() {
        let r = RemoteRegion {
            addr: 0x10_0000,
            len: 4096,
            rkey: 3,
        };
        assert_eq!(r.at(0, 4096).unwrap(), 0x10_0000);
        assert_eq!(r.at(4000, 96).unwrap(), 0x10_0000 + 4000);
        assert_eq!(r.at(4096, 0).unwrap(), 0x10_0000 + 4096);
        for (offset, len) in [(4096, 1), (1, 4096), (0, 4097), (u64::MAX, 1)] {
            let err = r.at(offset, len).unwrap_err();
            assert_eq!(err.code(), ErrorCode::InvalidArg, "{offset}+{len}: {err}");
        }
    }

    #[test]
    fn local_slices_must_lie_inside_the_registration() {
        let (addr, len) = (0x20_0000u64, 8192usize);
        assert!(inside(addr, len, addr, len));
        assert!(inside(addr, len, addr + 100, 8092));
        assert!(inside(addr, len, addr + 8192, 0));
        assert!(!inside(addr, len, addr - 1, 1), "starts before");
        assert!(!inside(addr, len, addr + 100, 8093), "ends past");
        assert!(!inside(addr, len, addr + 8192, 1), "starts at the end");
    }
}
