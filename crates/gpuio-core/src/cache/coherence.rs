//! The block cache's coherence protocol (docs/REFERENCE.md#coherence-states), run under the
//! directory's lock: reads and writes of blocks (a miss loads the block into the top level),
//! promotion of a hit to the top level, eviction (a level's LRU victim moves down, the lowest
//! level's is written back if dirty), and the prefetcher's loads. Flushing is in
//! `writeback.rs`.

use super::dir::{Dir, Src};
use super::{BackingStore, BlockState, WriteMode};
use crate::{CoreError, Result};
use metrics::Counter;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Whether a step could run or must wait for a flush to finish.
#[must_use]
enum Progress {
    Done,
    Blocked,
}

/// What a [`BlockCache`](super::BlockCache) shares with its prefetcher thread.
pub(super) struct Shared {
    pub(super) backing: Arc<dyn BackingStore>,
    pub(super) len: u64,
    pub(super) block_size: usize,
    pub(super) nblocks: u64,
    pub(super) mode: WriteMode,
    /// Where prefetched blocks go: L2, or the top level where there is no L2.
    pub(super) prefetch_tier: usize,
    pub(super) dir: Mutex<Dir>,
    /// Signalled whenever a flush of a block finishes (a busy block became movable).
    pub(super) idle: Condvar,
    pub(super) writebacks: Counter,
}

impl Shared {
    pub(super) fn lock(&self) -> Result<MutexGuard<'_, Dir>> {
        self.dir
            .lock()
            .map_err(|_| CoreError::Internal("the cache directory is poisoned".into()))
    }

    pub(super) fn wait<'a>(&self, g: MutexGuard<'a, Dir>) -> Result<MutexGuard<'a, Dir>> {
        self.idle
            .wait(g)
            .map_err(|_| CoreError::Internal("the cache directory is poisoned".into()))
    }

    /// Checks `off..off+len` against the store and returns the blocks it touches.
    pub(super) fn check(&self, off: u64, len: usize) -> Result<std::ops::Range<u64>> {
        match off.checked_add(len as u64) {
            Some(end) if end <= self.len => {
                let bs = self.block_size as u64;
                Ok(off / bs..end.div_ceil(bs))
            }
            _ => Err(CoreError::InvalidRequest(format!(
                "range {off}+{len} lies outside the {}-byte cached store",
                self.len
            ))),
        }
    }

    /// `off..off+len` cut at block boundaries: (block, offset in it, length).
    pub(super) fn pieces(
        &self,
        off: u64,
        len: usize,
    ) -> impl Iterator<Item = (u64, usize, usize)> + use<> {
        let bs = self.block_size as u64;
        let end = off + len as u64;
        let mut at = off;
        std::iter::from_fn(move || {
            (at < end).then(|| {
                let b = at / bs;
                let n = ((b + 1) * bs).min(end) - at;
                let piece = (b, (at - b * bs) as usize, n as usize);
                at += n;
                piece
            })
        })
    }

    pub(super) fn block_len(&self, b: u64) -> usize {
        let start = b * self.block_size as u64;
        (self.len - start).min(self.block_size as u64) as usize
    }

    pub(super) fn block_off(&self, b: u64) -> u64 {
        b * self.block_size as u64
    }

    pub(super) fn count_writeback(&self, d: &mut Dir) {
        d.writebacks += 1;
        self.writebacks.increment(1);
    }

    pub(super) fn read_block(
        &self,
        b: u64,
        at: usize,
        n: usize,
        sink: &mut dyn FnMut(Src<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut g = self.lock()?;
        loop {
            match self.try_read(&mut g, b, at, n, sink)? {
                Progress::Done => return Ok(()),
                Progress::Blocked => g = self.wait(g)?,
            }
        }
    }

    fn try_read(
        &self,
        d: &mut Dir,
        b: u64,
        at: usize,
        n: usize,
        sink: &mut dyn FnMut(Src<'_>) -> Result<()>,
    ) -> Result<Progress> {
        if let Some(&e) = d.entries.get(&b) {
            d.count_hit(e.tier);
            self.promote(d, b)?;
            let e = d.entries.get_mut(&b).ok_or_else(|| lost(b))?;
            if std::mem::take(&mut e.prefetched) {
                d.prefetch_useful += 1;
            }
            let e = *e;
            d.touch(b);
            sink(Src::Store(
                &d.tiers[e.tier].store,
                e.slot * self.block_size + at,
            ))?;
            return Ok(Progress::Done);
        }
        if let Progress::Blocked = self.make_room(d, 0)? {
            return Ok(Progress::Blocked);
        }
        d.count_miss();
        let mut block = vec![0; self.block_len(b)];
        self.backing.read_at(self.block_off(b), &mut block)?;
        let slot = d.store_into(0, &block, self.block_size)?;
        d.link(b, 0, slot, BlockState::Valid, false);
        sink(Src::Mem(&block[at..at + n]))?;
        Ok(Progress::Done)
    }

    pub(super) fn write_block(&self, b: u64, at: usize, data: &[u8]) -> Result<()> {
        let mut g = self.lock()?;
        loop {
            match self.try_write(&mut g, b, at, data)? {
                Progress::Done => return Ok(()),
                Progress::Blocked => g = self.wait(g)?,
            }
        }
    }

    fn try_write(&self, d: &mut Dir, b: u64, at: usize, data: &[u8]) -> Result<Progress> {
        let bs = self.block_size;
        let pos = self.block_off(b) + at as u64;
        if let Some(&e) = d.entries.get(&b) {
            d.count_hit(e.tier);
            self.promote(d, b)?;
            let e = *d.entries.get(&b).ok_or_else(|| lost(b))?;
            if self.mode == WriteMode::WriteThrough {
                d.epoch += 1;
                if let Err(err) = self.backing.write_at(pos, data) {
                    // The store may hold part of the write now; a Valid copy may not differ.
                    d.unlink(b);
                    return Err(err);
                }
            }
            if let Err(err) = d.tiers[e.tier].store.write(e.slot * bs + at, data) {
                if e.state == BlockState::Valid {
                    d.unlink(b);
                }
                return Err(err);
            }
            if self.mode == WriteMode::WriteBack {
                // Also when Flushing: the flush in flight has an older copy.
                d.entries.get_mut(&b).ok_or_else(|| lost(b))?.state = BlockState::Dirty;
            }
            d.touch(b);
            return Ok(Progress::Done);
        }
        if let Progress::Blocked = self.make_room(d, 0)? {
            return Ok(Progress::Blocked);
        }
        d.count_miss();
        let mut block = vec![0; self.block_len(b)];
        if data.len() < block.len() {
            self.backing.read_at(self.block_off(b), &mut block)?;
        }
        block[at..at + data.len()].copy_from_slice(data);
        let state = match self.mode {
            WriteMode::WriteThrough => {
                d.epoch += 1;
                self.backing.write_at(pos, data)?;
                BlockState::Valid
            }
            WriteMode::WriteBack => BlockState::Dirty,
        };
        let slot = d.store_into(0, &block, bs)?;
        d.link(b, 0, slot, state, false);
        Ok(Progress::Done)
    }

    /// Moves cached block `b` to the top level. Best effort: a block being flushed stays put,
    /// and so does one for which no room can be made without waiting.
    fn promote(&self, d: &mut Dir, b: u64) -> Result<()> {
        let e = *d.entries.get(&b).ok_or_else(|| lost(b))?;
        if e.tier == 0 || e.busy {
            return Ok(());
        }
        let data = d.read_slot(&e, self.block_len(b), self.block_size)?;
        // Out of the directory while room is made, so the cascade of demotions ends in its
        // slot instead of evicting from the lowest level.
        d.unlink(b);
        let made = self.make_room(d, 0);
        let target = match made {
            Ok(Progress::Done) => Some(0),
            // A demotion failed or had to wait: one slot between the top and `b`'s old level
            // is free, the one the cascade had reached.
            _ => (0..=e.tier).find(|&t| !d.tiers[t].free.is_empty()),
        };
        let placed = match target {
            Some(t) => d
                .store_into(t, &data, self.block_size)
                .map(|slot| (t, slot)),
            None => Err(CoreError::Internal(
                "no free cache slot after a promotion".into(),
            )),
        };
        match placed {
            Ok((t, slot)) => d.link(b, t, slot, e.state, e.prefetched),
            Err(err) => {
                // Nowhere to keep it: never lose a dirty block.
                if e.state == BlockState::Dirty {
                    d.epoch += 1;
                    self.backing.write_at(self.block_off(b), &data)?;
                    self.count_writeback(d);
                }
                return Err(err);
            }
        }
        made.map(|_| ())
    }

    /// Makes a slot free in `tier`, moving its LRU victim down a level (recursively) or, at
    /// the lowest level, writing it back if dirty and dropping it. `Blocked` where every
    /// candidate is being flushed; nothing has changed for the caller then.
    fn make_room(&self, d: &mut Dir, tier: usize) -> Result<Progress> {
        if !d.tiers[tier].free.is_empty() {
            return Ok(Progress::Done);
        }
        let victim = d.tiers[tier]
            .lru
            .values()
            .copied()
            .find(|v| d.entries.get(v).is_some_and(|e| !e.busy));
        let Some(v) = victim else {
            return Ok(Progress::Blocked);
        };
        let e = *d.entries.get(&v).ok_or_else(|| lost(v))?;
        let len = self.block_len(v);
        if tier + 1 == d.tiers.len() {
            if e.state == BlockState::Dirty {
                let data = d.read_slot(&e, len, self.block_size)?;
                d.epoch += 1;
                self.backing.write_at(self.block_off(v), &data)?;
                self.count_writeback(d);
            }
            d.unlink(v);
        } else {
            // Lower levels only: `v` stays this level's victim meanwhile.
            if let Progress::Blocked = self.make_room(d, tier + 1)? {
                return Ok(Progress::Blocked);
            }
            let data = d.read_slot(&e, len, self.block_size)?;
            let slot = d.store_into(tier + 1, &data, self.block_size)?;
            d.unlink(v);
            d.link(v, tier + 1, slot, e.state, e.prefetched);
        }
        let t = &mut d.tiers[tier];
        t.evictions += 1;
        t.m_evict.increment(1);
        Ok(Progress::Done)
    }

    /// Loads block `b` for the prefetcher, unless it is cached. The store is read unlocked;
    /// the block is entered only if no write to the store began meanwhile.
    pub(super) fn prefetch(&self, b: u64) {
        let epoch = match self.dir.lock() {
            Ok(d) if !d.entries.contains_key(&b) => d.epoch,
            _ => return,
        };
        let mut data = vec![0; self.block_len(b)];
        if let Err(e) = self.backing.read_at(self.block_off(b), &mut data) {
            tracing::debug!(block = b, error = %e, "cache prefetch read failed");
            return;
        }
        let Ok(mut g) = self.dir.lock() else { return };
        let d = &mut *g;
        if d.entries.contains_key(&b) || d.epoch != epoch {
            return;
        }
        let tier = self.prefetch_tier;
        match self.make_room(d, tier) {
            Ok(Progress::Done) => {}
            Ok(Progress::Blocked) => return,
            Err(e) => {
                tracing::debug!(block = b, error = %e, "cache prefetch found no room");
                return;
            }
        }
        match d.store_into(tier, &data, self.block_size) {
            Ok(slot) => {
                d.link(b, tier, slot, BlockState::Valid, true);
                d.prefetch_issued += 1;
            }
            Err(e) => tracing::debug!(block = b, error = %e, "cache prefetch store failed"),
        }
    }
}

pub(super) fn lost(b: u64) -> CoreError {
    CoreError::Internal(format!("cache block {b} vanished from the directory"))
}
