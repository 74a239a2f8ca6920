//! Write-back: flushing dirty blocks to the backing store. A block being flushed is marked
//! `Flushing` and busy (it never moves, so the flush always finds it), copied out, and written
//! with the directory unlocked; a write landing meanwhile leaves it `Dirty` again.

use super::BlockState;
use super::coherence::Shared;
use crate::Result;
use gpuio_hal::sync::MutexExt;

impl Shared {
    pub(super) fn flush(&self) -> Result<()> {
        let mut targets: Vec<u64> = {
            let d = self.lock()?;
            d.entries
                .iter()
                .filter(|(_, e)| e.state == BlockState::Dirty || e.busy)
                .map(|(&b, _)| b)
                .collect()
        };
        targets.sort_unstable();
        let mut first = None;
        for b in targets {
            if let Err(e) = self.flush_block(b) {
                first.get_or_insert(e);
            }
        }
        let synced = self.backing.sync();
        match first {
            Some(e) => Err(e),
            None => synced,
        }
    }

    /// Writes block `b` back if it is dirty, after any flush of it already in flight.
    fn flush_block(&self, b: u64) -> Result<()> {
        let mut g = self.lock()?;
        let e = loop {
            match g.entries.get(&b) {
                // Evicted meanwhile, which wrote it back if it was dirty.
                None => return Ok(()),
                // Its data may predate what we must flush: wait, then look again.
                Some(e) if e.busy => g = self.wait(g)?,
                Some(e) if e.state != BlockState::Dirty => return Ok(()),
                Some(&e) => break e,
            }
        };
        let data = g.read_slot(&e, self.block_len(b), self.block_size)?;
        g.epoch += 1;
        if let Some(e) = g.entries.get_mut(&b) {
            e.state = BlockState::Flushing;
            e.busy = true;
        }
        drop(g);
        let res = self.backing.write_at(self.block_off(b), &data);
        // Poisoned or not, the block must be released, or it could never move again.
        let mut g = self.dir.lock_unpoisoned();
        if let Some(e) = g.entries.get_mut(&b) {
            e.busy = false;
            if e.state == BlockState::Flushing {
                e.state = if res.is_ok() {
                    BlockState::Valid
                } else {
                    BlockState::Dirty
                };
            }
        }
        if res.is_ok() {
            self.count_writeback(&mut g);
        }
        drop(g);
        self.idle.notify_all();
        res
    }
}
