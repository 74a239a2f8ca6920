//! The memory an agent keeps registered, so that repeated transfers in or out of the same
//! buffers cost no registration: device allocations (registering costs more than moving
//! 64 KiB GPU to GPU, measured ~65 µs a call) and shared host buffers (~10–30 µs a MiB, a
//! tenth of a 1 MiB transfer on loopback).
//!
//! Each kind registers a whole allocation or buffer once, and later transfers anywhere in it
//! find it. Entries are keyed by an id that is never reused — the driver's allocation id, a
//! `HostBuffer`'s id — so a freed buffer's entry never serves a new one at the same
//! addresses. An entry holds no memory: the caller's buffer keeps it while a transfer runs.
//! Each device miss drops the entries whose allocation the driver no longer knows, and any
//! the new one overlaps (live allocations never overlap; the host backend, which keeps no
//! table the driver could be asked, relies on this and on the least recently used going when
//! full). Host entries whose buffer's mapping is gone are dropped before every host transfer
//! and registration of the agent, since NIXL looks registrations up by address.

use crate::memory::{NixlMem, NixlRegion, Span};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{Allocation, BufferInfo, DeviceBuffer, ErrorCode, Gpu, HalError, Result};
use std::sync::{Arc, Mutex};

/// Allocations, and host buffers, kept registered per agent.
const KEPT: usize = 8;

/// Host bytes kept registered per agent at most (where UCX registers for RDMA, registering
/// pins the pages), and the largest buffer kept: a larger one is registered for each call.
const KEPT_HOST_BYTES: usize = 4 << 30;
const KEPT_HOST_LARGEST: usize = 1 << 30;

/// Entries and their registrations (`R`), least recently used first out.
struct Kept<E, R = Arc<NixlRegion>> {
    entries: Vec<(E, R)>,
    /// When each entry last served (a count of lookups).
    used: Vec<u64>,
    clock: u64,
}

impl<E, R> Default for Kept<E, R> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            used: Vec::new(),
            clock: 0,
        }
    }
}

impl<E, R: Clone> Kept<E, R> {
    /// The registration of the entry `hit` picks, now the most recently used.
    fn find(&mut self, hit: impl Fn(&E) -> bool) -> Option<R> {
        self.clock += 1;
        let i = self.entries.iter().position(|(e, _)| hit(e))?;
        self.used[i] = self.clock;
        Some(self.entries[i].1.clone())
    }

    /// Keeps only the entries `keep` accepts.
    fn retain(&mut self, keep: impl Fn(&E) -> bool) {
        let mut i = 0;
        while i < self.entries.len() {
            if keep(&self.entries[i].0) {
                i += 1;
            } else {
                self.entries.swap_remove(i);
                self.used.swap_remove(i);
            }
        }
    }

    /// Drops the least recently used entry.
    fn evict(&mut self) {
        if let Some(oldest) = (0..self.used.len()).min_by_key(|&i| self.used[i]) {
            self.entries.swap_remove(oldest);
            self.used.swap_remove(oldest);
        }
    }

    fn push(&mut self, e: E, region: R) -> R {
        self.entries.push((e, region.clone()));
        self.used.push(self.clock);
        region
    }
}

/// An agent's registered device allocations.
#[derive(Default)]
pub(crate) struct DeviceRegistrations {
    kept: Mutex<Kept<(Gpu, Allocation, NixlMem)>>,
}

impl DeviceRegistrations {
    /// A registration covering the allocation `buf` lies in, made now if none is kept. The
    /// caller holds it for the transfer (an eviction meanwhile deregisters only after).
    pub(crate) fn covering(
        &self,
        agent: &nixl_sys::Agent,
        buf: &DeviceBuffer,
    ) -> Result<Arc<NixlRegion>> {
        let alloc = buf.allocation()?;
        let mem = NixlMem::of_device(buf);
        let mut kept = self.kept.lock_unpoisoned();
        if let Some(r) = kept.find(|(_, a, m)| *a == alloc && *m == mem) {
            return Ok(r);
        }
        // Freed allocations' entries go: the driver no longer knows them, or this live
        // allocation overlaps them.
        kept.retain(|(gpu, a, _)| {
            let known = match gpu.allocation_at(a.base) {
                Ok(now) => now == *a,
                Err(err) => err.code() == ErrorCode::Unsupported,
            };
            known && !overlap((a.base, a.len), (alloc.base, alloc.len))
        });
        if kept.entries.len() >= KEPT {
            kept.evict();
        }
        let span = Span {
            addr: usize::try_from(alloc.base)
                .map_err(|_| HalError::InvalidArgument("a device address past usize".into()))?,
            len: alloc.len,
            mem,
        };
        let region = Arc::new(NixlRegion::checked(agent, span)?);
        Ok(kept.push((buf.gpu().clone(), alloc, mem), region))
    }

    /// How many allocations are kept registered.
    pub(crate) fn len(&self) -> usize {
        self.kept.lock_unpoisoned().entries.len()
    }
}

/// An agent's registered host buffers.
#[derive(Default)]
pub(crate) struct HostRegistrations {
    kept: Mutex<Kept<BufferInfo>>,
}

impl HostRegistrations {
    /// A registration of the whole buffer `buf` (which the caller's guard keeps in place),
    /// made now if none is kept; `None` where it is not kept: too large, or registering it
    /// failed (a memlock or NIC limit), and the caller registers its range alone.
    pub(crate) fn covering(
        &self,
        agent: &nixl_sys::Agent,
        buf: &BufferInfo,
    ) -> Result<Option<Arc<NixlRegion>>> {
        if buf.is_empty() || buf.len() > KEPT_HOST_LARGEST {
            return Ok(None);
        }
        let mut kept = self.kept.lock_unpoisoned();
        if let Some(r) = kept.find(|e| e.id() == buf.id()) {
            return Ok(Some(r));
        }
        // Live buffers never overlap: an entry this one overlaps is of a buffer gone.
        let at = (buf.addr() as u64, buf.len());
        kept.retain(|e| e.is_mapped() && !overlap((e.addr() as u64, e.len()), at));
        while kept.entries.len() >= KEPT
            || kept.entries.iter().map(|(e, _)| e.len()).sum::<usize>() + buf.len()
                > KEPT_HOST_BYTES
        {
            kept.evict();
        }
        let span = Span {
            addr: buf.addr(),
            len: buf.len(),
            mem: NixlMem::Host,
        };
        match NixlRegion::checked(agent, span) {
            Ok(region) => Ok(Some(kept.push(buf.clone(), Arc::new(region)))),
            Err(e) => {
                tracing::debug!(error = %e, len = buf.len(), "a host buffer not kept registered");
                Ok(None)
            }
        }
    }

    /// Drops the entries of buffers whose mapping is gone. NIXL finds a transfer's local
    /// registration by address, the oldest first: a gone buffer's entry must not be there
    /// when another buffer at its addresses is registered or moved (over RDMA, it would
    /// reach the gone buffer's pinned pages).
    pub(crate) fn purge(&self) {
        let mut kept = self.kept.lock_unpoisoned();
        if kept.entries.iter().any(|(e, _)| !e.is_mapped()) {
            kept.retain(BufferInfo::is_mapped);
        }
    }

    /// How many host buffers are kept registered.
    pub(crate) fn len(&self) -> usize {
        self.kept.lock_unpoisoned().entries.len()
    }
}

/// Whether two ranges (start, length) share a byte.
fn overlap(a: (u64, usize), b: (u64, usize)) -> bool {
    a.0 < b.0.saturating_add(b.1 as u64) && b.0 < a.0.saturating_add(a.1 as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_overlap_only_where_their_bytes_do() {
        assert!(overlap((100, 10), (109, 1)));
        assert!(overlap((100, 10), (0, 101)));
        assert!(!overlap((100, 10), (110, 5)));
        assert!(!overlap((100, 10), (90, 10)));
        assert!(!overlap((u64::MAX - 1, 10), (0, 10)));
    }

    #[test]
    fn the_least_recently_used_entry_goes_first() {
        let mut kept = Kept::<u32, u32>::default();
        for e in 0..3 {
            kept.find(|_| false);
            kept.push(e, e * 10);
        }
        assert_eq!(kept.find(|&e| e == 2), Some(20));
        assert!(kept.find(|&e| e == 0).is_some());
        kept.evict();
        let left: Vec<u32> = kept.entries.iter().map(|(e, _)| *e).collect();
        assert!(
            left.contains(&0) && left.contains(&2) && !left.contains(&1),
            "{left:?}"
        );
        kept.retain(|&e| e != 0);
        assert_eq!(kept.entries.len(), 1);
        assert_eq!(kept.used.len(), 1);
    }
}
