//! The memory an agent keeps registered, so that repeated transfers in or out of the same
//! buffers cost no registration: device allocations (registering costs more than moving
//! 64 KiB GPU to GPU, measured ~65 µs a call) and shared host buffers (~10–30 µs a MiB, a
//! tenth of a 1 MiB transfer on loopback).
//!
//! Each kind registers a whole allocation or buffer once, and later transfers anywhere in it
//! find it. Entries are keyed by an id that is never reused — the driver's allocation id, a
//! `HostBuffer`'s id — so a freed buffer's entry never serves a new one at the same
//! addresses. An entry holds no memory: the caller's buffer keeps it while a transfer runs.
//! Each miss drops the entries whose memory is gone (the driver no longer knows the
//! allocation; no one holds the host buffer, or it was swapped for another) and any the new
//! one overlaps (live allocations never overlap; the host backend, which keeps no table the
//! driver could be asked, relies on this and on the least recently used going when full).

use crate::memory::{NixlMem, NixlRegion, Span};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{
    Allocation, DeviceBuffer, ErrorCode, Gpu, HalError, HeldMapping, Result, SharedHostBuffer,
};
use std::sync::{Arc, Mutex, Weak};

/// Allocations, and host buffers, kept registered per agent.
const KEPT: usize = 8;

/// Host bytes kept registered per agent at most (where UCX registers for RDMA, registering
/// pins the pages): a larger buffer is registered for each call instead.
const KEPT_HOST_BYTES: usize = 4 << 30;

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

/// A kept host buffer: its id, its owner (alive or not), its addresses.
struct HostEntry {
    id: u64,
    owner: Weak<SharedHostBuffer>,
    addr: usize,
    len: usize,
}

/// An agent's registered host buffers.
#[derive(Default)]
pub(crate) struct HostRegistrations {
    kept: Mutex<Kept<HostEntry>>,
}

impl HostRegistrations {
    /// A registration of the whole buffer `held` describes (`owner`'s, held mapped by the
    /// caller), made now if none is kept; `None` where the buffer is too large to keep.
    pub(crate) fn covering(
        &self,
        agent: &nixl_sys::Agent,
        owner: &Arc<SharedHostBuffer>,
        held: &HeldMapping,
    ) -> Result<Option<Arc<NixlRegion>>> {
        if held.len == 0 || held.len > KEPT_HOST_BYTES {
            return Ok(None);
        }
        let mut kept = self.kept.lock_unpoisoned();
        if let Some(r) = kept.find(|e| e.id == held.id) {
            return Ok(Some(r));
        }
        // Gone: buffers no one holds (their addresses may be another's now) or that their
        // owner swapped for another (this one), and any this live buffer overlaps.
        let owner_now = Arc::downgrade(owner);
        kept.retain(|e| {
            e.owner.strong_count() > 0
                && !e.owner.ptr_eq(&owner_now)
                && !overlap((e.addr as u64, e.len), (held.addr as u64, held.len))
        });
        while kept.entries.len() >= KEPT
            || kept.entries.iter().map(|(e, _)| e.len).sum::<usize>() + held.len > KEPT_HOST_BYTES
        {
            kept.evict();
        }
        let span = Span {
            addr: held.addr,
            len: held.len,
            mem: NixlMem::Host,
        };
        let region = Arc::new(NixlRegion::checked(agent, span)?);
        let entry = HostEntry {
            id: held.id,
            owner: owner_now,
            addr: held.addr,
            len: held.len,
        };
        Ok(Some(kept.push(entry, region)))
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
