//! Engram tables: rows of conditional memory (DeepSeek V4-class: ~384 M rows of 256 B per
//! table, FP8) that a model reads by id — ids its n-gram hashing computed, so a lookup is an
//! exact row index — about 48 rows per token. The table lives in pinned host memory (DRAM, or
//! a CXL expander), where the GPU's gather paths reach it. Updates are scattered back from
//! device memory.
//!
//! A lookup is a row gather (MemIO's `gather`: zero-copy, sorted, CPU-staged or hybrid, picked
//! per shape by what earlier calls measured), so the table is read in place: nothing is
//! cached on the device behind the caller's back, and a row written by [`EngramTable::store`]
//! is what the next lookup reads. Repeated ids (Zipf-distributed n-grams repeat a lot) are
//! not deduplicated on the host — sorting a prefill's 1.5 M ids costs more than the reads it
//! saves: the device's cache serves a row read again, and the sorted path reads it once.

use crate::{AiError, Result};
use gpuio_api::{DeviceBuffer, HostMemory, HostPlacement, Session};
use gpuio_transport_memio::{GatherOptions, GatherStrategy};

/// An Engram table in pinned host memory.
#[derive(Debug, Clone)]
pub struct EngramTable {
    mem: HostMemory,
    rows: u64,
    row_bytes: usize,
}

/// What a lookup did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// Rows written to the destination (one per id).
    pub rows: usize,
    /// Distinct rows read from the table.
    pub rows_fetched: usize,
    /// The gather path that moved them.
    pub strategy: GatherStrategy,
}

impl EngramTable {
    /// A zeroed table of `rows` rows of `row_bytes`, pinned, in `placement` (DRAM on a node,
    /// or CXL memory). A size the machine cannot back is refused before any page is touched.
    pub fn new(
        session: &Session,
        rows: u64,
        row_bytes: usize,
        placement: HostPlacement,
    ) -> Result<Self> {
        let len = usize::try_from(rows)
            .ok()
            .and_then(|r| r.checked_mul(row_bytes))
            .filter(|&l| l > 0)
            .ok_or_else(|| {
                AiError::InvalidArgument(format!(
                    "an Engram table of {rows} rows of {row_bytes} bytes"
                ))
            })?;
        let mem = session.alloc_host(placement, len, true)?;
        Ok(Self {
            mem,
            rows,
            row_bytes,
        })
    }

    /// Rows in the table.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The table's memory (for loading it, or for kernels that read it in place).
    pub fn memory(&self) -> &HostMemory {
        &self.mem
    }

    fn check_ids(&self, ids: &[u64]) -> Result<()> {
        match ids.iter().position(|&i| i >= self.rows) {
            Some(k) => Err(AiError::InvalidArgument(format!(
                "Engram id {} (position {k}) is past the table's {} rows",
                ids[k], self.rows
            ))),
            None => Ok(()),
        }
    }

    /// Reads row `ids[i]` into `dst` at `dst_offset + i * row_bytes`, for every `i`. Ids past
    /// the table are refused before anything moves.
    pub fn lookup(
        &self,
        session: &Session,
        ids: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<Lookup> {
        self.check_ids(ids)?;
        let opts = GatherOptions::default();
        let table = self.mem.read();
        let r = session
            .memio()
            .gather(&table, self.row_bytes, ids, dst, dst_offset, &opts)
            .map_err(gpuio_api::Error::from)?;
        Ok(Lookup {
            rows: r.rows,
            rows_fetched: r.rows_fetched,
            strategy: r.strategy,
        })
    }

    /// Writes source row `i` (at `src_offset + i * row_bytes` of `src`) to table row
    /// `ids[i]`, for every `i`. With an id given twice, one of its rows lands, unspecified
    /// which. Lookups wait while a store runs (the table is locked for it).
    pub fn store(
        &self,
        session: &Session,
        ids: &[u64],
        src: &DeviceBuffer,
        src_offset: usize,
    ) -> Result<()> {
        self.check_ids(ids)?;
        let bytes = ids
            .len()
            .checked_mul(self.row_bytes)
            .ok_or_else(|| AiError::InvalidArgument("Engram store size overflows".into()))?;
        gpuio_hal::check_range("Engram store source", src_offset, bytes, src.len())
            .map_err(gpuio_api::Error::from)?;
        let mut table = self.mem.write();
        session
            .memio()
            .scatter(src, src_offset, self.row_bytes, ids, &mut table)
            .map_err(gpuio_api::Error::from)?;
        Ok(())
    }
}
