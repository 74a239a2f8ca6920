//! The block cache's directory and the levels' storage: which level holds each cached block,
//! in which slot, in which coherence state, in LRU order; where each level keeps its blocks
//! (device memory, host memory, L3's unlinked file); and the per-level counters.

use super::{BlockState, Level};
use crate::{CoreError, Result};
use gpuio_hal::{DeviceBuffer, HostBuffer, Stream};
use gpuio_transport_localio::{FileHandle, LocalIoError};
use metrics::{Counter, counter};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Creates L3's file in `dir`, `len` bytes long, and unlinks it: the open handle keeps it.
pub(super) fn l3_file(dir: &Path, len: u64) -> Result<FileHandle> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut tries = 0;
    let (file, path) = loop {
        let path = dir.join(format!(
            ".gpuio-cache-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(f) => break (f, path),
            // A stale file of an earlier process with our pid: take the next name.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 64 => tries += 1,
            Err(source) => return Err(LocalIoError::Open { path, source }.into()),
        }
    };
    std::fs::remove_file(&path).map_err(|source| LocalIoError::Io {
        op: "unlink",
        path: path.clone(),
        offset: 0,
        source,
    })?;
    let handle = FileHandle::from_file(file, path, true);
    handle.set_len(len)?;
    Ok(handle)
}

/// Where a level keeps its blocks; slot `i` is at byte `i * block_size`.
pub(super) enum Store {
    Device { buf: DeviceBuffer, stream: Stream },
    Host(HostBuffer),
    File(FileHandle),
}

impl Store {
    pub(super) fn read(&self, at: usize, out: &mut [u8]) -> Result<()> {
        match self {
            Self::Device { buf, stream } => Ok(stream.download(buf, at, out)?),
            Self::Host(h) => {
                out.copy_from_slice(&h[at..at + out.len()]);
                Ok(())
            }
            Self::File(f) => Ok(f.read_exact_at(at as u64, out)?),
        }
    }

    pub(super) fn write(&mut self, at: usize, data: &[u8]) -> Result<()> {
        match self {
            Self::Device { buf, stream } => Ok(stream.upload(data, buf, at)?),
            Self::Host(h) => {
                h[at..at + data.len()].copy_from_slice(data);
                Ok(())
            }
            Self::File(f) => Ok(f.write_all_at(at as u64, data)?),
        }
    }
}

/// Where a read's bytes come from: a level's storage at a byte offset, or a block just loaded.
pub(super) enum Src<'a> {
    Store(&'a Store, usize),
    Mem(&'a [u8]),
}

/// One level: its storage, its free slots, its blocks in LRU order and its counters.
pub(super) struct Tier {
    pub(super) level: Level,
    pub(super) capacity: usize,
    pub(super) store: Store,
    pub(super) free: Vec<usize>,
    /// LRU order: access stamp → block; the first entry is the least recently used.
    pub(super) lru: BTreeMap<u64, u64>,
    pub(super) hits: u64,
    pub(super) misses: u64,
    pub(super) evictions: u64,
    pub(super) m_hit: Counter,
    pub(super) m_miss: Counter,
    pub(super) m_evict: Counter,
}

impl Tier {
    pub(super) fn new(level: Level, capacity: usize, store: Store) -> Self {
        let l = level.label();
        Self {
            level,
            capacity,
            store,
            free: (0..capacity).rev().collect(),
            lru: BTreeMap::new(),
            hits: 0,
            misses: 0,
            evictions: 0,
            m_hit: counter!(crate::metrics::CACHE_LOOKUPS, "level" => l, "result" => "hit"),
            m_miss: counter!(crate::metrics::CACHE_LOOKUPS, "level" => l, "result" => "miss"),
            m_evict: counter!(crate::metrics::CACHE_EVICTIONS, "level" => l),
        }
    }
}

/// A cached block's place (level and slot), recency and coherence state.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    pub(super) tier: usize,
    pub(super) slot: usize,
    pub(super) stamp: u64,
    pub(super) state: BlockState,
    /// A flush is writing this block with the directory unlocked: it must not move.
    pub(super) busy: bool,
    /// Brought in by the prefetcher and not hit since.
    pub(super) prefetched: bool,
}

/// The directory and the levels' storage, under one mutex.
pub(super) struct Dir {
    pub(super) tiers: Vec<Tier>,
    pub(super) entries: HashMap<u64, Entry>,
    pub(super) clock: u64,
    /// Bumped whenever a write to the backing store begins, so a prefetch that read the store
    /// unlocked can tell whether what it read may be stale.
    pub(super) epoch: u64,
    pub(super) writebacks: u64,
    pub(super) prefetch_issued: u64,
    pub(super) prefetch_useful: u64,
}

impl Dir {
    pub(super) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Marks `b` most recently used in its level.
    pub(super) fn touch(&mut self, b: u64) {
        let stamp = self.tick();
        if let Some(e) = self.entries.get_mut(&b) {
            let tier = &mut self.tiers[e.tier];
            tier.lru.remove(&e.stamp);
            tier.lru.insert(stamp, b);
            e.stamp = stamp;
        }
    }

    /// Writes `data` into a free slot of `tier` and returns the slot (the directory is
    /// unchanged if the write fails).
    pub(super) fn store_into(&mut self, tier: usize, data: &[u8], bs: usize) -> Result<usize> {
        let t = &mut self.tiers[tier];
        let slot = t.free.pop().ok_or_else(|| {
            CoreError::Internal(format!("cache level {:?} has no free slot", t.level))
        })?;
        if let Err(e) = t.store.write(slot * bs, data) {
            t.free.push(slot);
            return Err(e);
        }
        Ok(slot)
    }

    /// Enters `b` as held in `slot` of `tier`, most recently used.
    pub(super) fn link(
        &mut self,
        b: u64,
        tier: usize,
        slot: usize,
        state: BlockState,
        prefetched: bool,
    ) {
        let stamp = self.tick();
        self.tiers[tier].lru.insert(stamp, b);
        self.entries.insert(
            b,
            Entry {
                tier,
                slot,
                stamp,
                state,
                busy: false,
                prefetched,
            },
        );
    }

    /// Removes `b` from the directory and frees its slot.
    pub(super) fn unlink(&mut self, b: u64) -> Option<Entry> {
        let e = self.entries.remove(&b)?;
        let t = &mut self.tiers[e.tier];
        t.lru.remove(&e.stamp);
        t.free.push(e.slot);
        Some(e)
    }

    pub(super) fn read_slot(&self, e: &Entry, len: usize, bs: usize) -> Result<Vec<u8>> {
        let mut data = vec![0; len];
        self.tiers[e.tier].store.read(e.slot * bs, &mut data)?;
        Ok(data)
    }

    /// Counts a lookup that found its block in `tier` (and missed every level above).
    pub(super) fn count_hit(&mut self, tier: usize) {
        for t in &mut self.tiers[..tier] {
            t.misses += 1;
            t.m_miss.increment(1);
        }
        let t = &mut self.tiers[tier];
        t.hits += 1;
        t.m_hit.increment(1);
    }

    /// Counts a lookup that missed every level.
    pub(super) fn count_miss(&mut self) {
        for t in &mut self.tiers {
            t.misses += 1;
            t.m_miss.increment(1);
        }
    }
}
