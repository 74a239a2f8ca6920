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
use gpuio_hal::{HostBuffer, HotRows};
use gpuio_transport_memio::{GatherOptions, GatherReport};

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

/// The tier: the kept rows and the device they are on.
#[derive(Debug)]
pub(super) struct HotTier {
    rows: HotRows,
    gpu: u32,
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
        let rows = session
            .gpu(gpu)?
            .stream()?
            .keep_hot(table, row_bytes, ids)?;
        Ok(Self { rows, gpu })
    }

    pub(super) fn gpu(&self) -> u32 {
        self.gpu
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
    pub(super) fn refresh(
        &self,
        session: &Session,
        table: &HostBuffer,
        ids: &[u64],
    ) -> Result<usize> {
        let stream = session.gpu(self.gpu)?.stream()?;
        Ok(stream.refresh_hot(table, &self.rows, ids)?)
    }
}
