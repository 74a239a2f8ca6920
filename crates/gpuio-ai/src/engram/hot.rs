//! An Engram table's hot tier: copies of its most-read rows in device memory (the HAL's
//! [`HotRows`]), so that a lookup reads those rows there and only the others over the bus,
//! in one kernel. N-gram ids are Zipf-distributed: a few million rows of a 384 M-row table
//! take most of the reads, and which ones is known ahead from a corpus's n-gram counts.
//!
//! The copies are taken when the tier is made; the table's `store` re-copies the kept rows
//! it writes, under the same lock as the write, so a lookup never reads an old copy.

use crate::Result;
use gpuio_api::{DeviceBuffer, Session};
use gpuio_hal::{HostAllocOptions, HostBuffer, HotRows, RowIndices, Stream};
use std::sync::{Mutex, PoisonError};

/// Ids a lookup's stage holds at first (it grows to the largest lookup).
const FIRST_STAGE_IDS: usize = 4096;

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

/// The tier: the kept rows, the device they are on, and the lookups' stage.
#[derive(Debug)]
pub(super) struct HotTier {
    rows: HotRows,
    gpu: u32,
    stage: Mutex<Stage>,
}

/// Where a lookup's ids go on their way to the device: pinned host memory, then device
/// memory, piece after piece while the device already moves rows.
#[derive(Debug)]
struct Stage {
    stream: Stream,
    host: HostBuffer,
    device: DeviceBuffer,
}

impl Stage {
    fn new(session: &Session, gpu: u32, ids: usize) -> Result<Self> {
        let device = session.gpu(gpu)?;
        Ok(Self {
            stream: device.stream()?,
            host: HostBuffer::alloc_pinned(ids * 8, &HostAllocOptions::default(), device)?,
            device: device.alloc(ids * 8)?,
        })
    }

    /// Room for `ids` ids: the buffers grown to the next power of two where smaller.
    fn reserve(&mut self, ids: usize) -> Result<()> {
        if self.host.len() >= ids * 8 {
            return Ok(());
        }
        let len = ids.next_power_of_two() * 8;
        let device = self.stream.gpu();
        self.host = HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), device)?;
        self.device = device.alloc(len)?;
        Ok(())
    }
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
        let stage = Stage::new(session, gpu, FIRST_STAGE_IDS)?;
        let rows = stage.stream.keep_hot(table, row_bytes, ids)?;
        Ok(Self {
            rows,
            gpu,
            stage: Mutex::new(stage),
        })
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
    /// from their copies. The ids are checked against the table by the caller.
    pub(super) fn lookup(
        &self,
        table: &HostBuffer,
        ids: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        let mut stage = self.stage.lock().unwrap_or_else(PoisonError::into_inner);
        stage.reserve(ids.len())?;
        let Stage {
            stream,
            host,
            device,
        } = &mut *stage;
        let mut encode = |range: std::ops::Range<usize>, bytes: &mut [u8]| {
            for (id, word) in ids[range].iter().zip(bytes.chunks_exact_mut(8)) {
                word.copy_from_slice(&id.to_le_bytes());
            }
        };
        let indices = RowIndices::Streamed {
            stage: host,
            encode: &mut encode,
            device: Some(device),
        };
        stream.gather_hot(table, &self.rows, indices, ids.len(), dst, dst_offset)?;
        Ok(())
    }

    /// Copies again the kept rows among `ids`, just written in `table`; how many there were.
    pub(super) fn refresh(&self, table: &HostBuffer, ids: &[u64]) -> Result<usize> {
        let stage = self.stage.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(stage.stream.refresh_hot(table, &self.rows, ids)?)
    }
}
