//! An Engram table's hot tier: copies of its most-read rows in device memory (the HAL's
//! [`HotRows`]), so that a lookup's GPU side reads those rows there and only the others over
//! the bus, in one kernel. N-gram ids are Zipf-distributed: a few million rows of a 384 M-row
//! table take most of the reads, and which ones is known ahead from a corpus's n-gram counts.
//! Lookups go through MemIO's [`gather_hot`](gpuio_transport_memio::MemIo::gather_hot), whose
//! planner still picks per shape among the GPU's path, the CPU's and both at once.
//!
//! The copies are taken when the tier is made; the table's `store` re-copies the kept rows
//! it writes, under the same lock as the write, so a lookup never reads an old copy.

use crate::Result;
use gpuio_api::{DeviceBuffer, Session};
use gpuio_hal::{Gpu, HostBuffer, HotRows};
use gpuio_transport_memio::{GatherOptions, GatherReport};
use std::sync::atomic::{AtomicBool, Ordering};

/// What a hot tier keeps ([`super::EngramTable::keep_hot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotTierStats {
    /// Rows kept (repeated ids once).
    pub rows: usize,
    /// Device memory taken: the rows and their index.
    pub device_bytes: usize,
    /// The longest run of index words a lookup probes.
    pub probes: u32,
}

/// The tier: the kept rows (on their device), and whether they are current.
#[derive(Debug)]
pub(super) struct HotTier {
    rows: HotRows,
    /// Cleared when a store wrote the table but may not have refreshed every copy: the tier
    /// is then never read again (lookups gather from the table until `keep_hot` runs).
    current: AtomicBool,
}

impl HotTier {
    /// Copies rows `ids` of `table` (rows of `row_bytes`) into device memory of `gpu`.
    pub(super) fn new(
        session: &Session,
        gpu: u32,
        table: &HostBuffer,
        row_bytes: usize,
        ids: &[u64],
    ) -> Result<Self> {
        let stream = session.gpu(gpu)?.stream()?;
        Ok(Self {
            rows: stream.keep_hot(table, row_bytes, ids)?,
            current: AtomicBool::new(true),
        })
    }

    /// The kept copies.
    pub(super) fn rows(&self) -> &HotRows {
        &self.rows
    }

    pub(super) fn is_current(&self) -> bool {
        self.current.load(Ordering::Acquire)
    }

    /// Whether lookups into `gpu` may read these copies: they are on it, and current.
    pub(super) fn serves(&self, gpu: &Gpu) -> bool {
        self.rows.gpu().same_device(gpu) && self.is_current()
    }

    /// Marks the copies as possibly stale (see `current`).
    pub(super) fn forsake(&self) {
        self.current.store(false, Ordering::Release);
    }

    pub(super) fn stats(&self) -> HotTierStats {
        HotTierStats {
            rows: self.rows.len(),
            device_bytes: self.rows.device_bytes(),
            probes: self.rows.probes(),
        }
    }

    /// Reads row `ids[i]` of `table` into `dst` at `dst_offset + i * row_bytes`, kept rows
    /// from their copies where the GPU moves them. The ids are checked by the caller.
    pub(super) fn lookup(
        &self,
        session: &Session,
        table: &HostBuffer,
        ids: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<GatherReport> {
        let opts = GatherOptions::default();
        let memio = session.memio();
        Ok(memio
            .gather_hot(table, &self.rows, ids, dst, dst_offset, &opts)
            .map_err(gpuio_api::Error::from)?)
    }

    /// Copies again the kept rows among `ids`, just written in `table`; how many there were.
    pub(super) fn refresh(&self, table: &HostBuffer, ids: &[u64]) -> Result<usize> {
        let stream = self.rows.gpu().stream()?;
        Ok(stream.refresh_hot(table, &self.rows, ids)?)
    }
}
