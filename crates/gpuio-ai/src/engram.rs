//! Engram tables: rows of conditional memory (DeepSeek V4-class: ~384 M rows of 256 B per
//! table, FP8) that a model reads by id — ids its n-gram hashing computed, so a lookup is an
//! exact row index — about 48 rows per token. The table lives in pinned host memory (DRAM, or
//! a CXL expander), where the GPU's gather paths reach it. Updates are scattered back from
//! device memory.
//!
//! A lookup is a row gather (MemIO's `gather`: zero-copy, sorted, CPU-staged or hybrid, picked
//! per shape by what earlier calls measured), so the table is read in place: nothing is
//! cached on the device behind the caller's back, and a row written by [`EngramTable::store`]
//! is what the next lookup reads. A caller who knows which rows are read most (n-gram ids are
//! Zipf-distributed, and a corpus's counts name the hot ones) keeps copies of them in device
//! memory with [`EngramTable::keep_hot`]: lookups into that device then go through MemIO's
//! gather through hot rows — its GPU side reads those rows there and only the others over the
//! bus, in one kernel — and `store` re-copies the kept rows it writes.
//!
//! [`EngramTable::prefetch`] and [`EngramTable::store_async`] run a lookup or a write-back on
//! a side thread (and its own stream), so a model gathers the next layer's rows or writes
//! updated ones while it computes; [`EngramTable::similar`] scores every row against a query
//! on the GPU (brute force) for similarity lookups. Repeated ids (Zipf-distributed n-grams
//! repeat a lot) are not deduplicated on the host — sorting a prefill's 1.5 M ids costs more
//! than the reads it saves: the device's cache serves a row read again, and the sorted path
//! reads it once.

mod hot;
mod together;

use crate::context::AiWork;
use crate::{AiError, Result};
use gpuio_ai_device::{ScoreRows, dot_scores};
use gpuio_api::{Backend, DeviceBuffer, HostMemory, HostPlacement, Session};
use gpuio_hal::HostBuffer;
use gpuio_transport_memio::GatherOptions;
/// The gather path a [`Lookup`] took.
pub use gpuio_transport_memio::GatherStrategy;
use hot::HotTier;
pub use hot::HotTierStats;
use std::sync::{Arc, PoisonError, RwLock};
use std::thread::JoinHandle;
pub use together::TableLookup;

/// An Engram table in pinned host memory. Clones share the table and its hot tier.
#[derive(Debug, Clone)]
pub struct EngramTable {
    mem: HostMemory,
    rows: u64,
    row_bytes: usize,
    /// Copies of hot rows in device memory, if kept. Taken before the table's memory (every
    /// call that takes both), and held for a whole lookup or store, so a lookup never reads
    /// a copy older than a store it comes after.
    hot: Arc<RwLock<Option<HotTier>>>,
    /// What this handle's lookups are for (their scheduler class and deadline).
    work: AiWork,
}

/// Bytes a prefetch or write-back moves under one lease (whole rows, one at least): a lookup
/// of more urgent work that starts while a piece runs shares the bus with at most this much
/// (some microseconds over PCIe), at a per-piece cost (a launch and a wait) the background
/// work can afford.
const SIDE_PIECE_BYTES: usize = 256 << 10;

/// What a lookup did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// Rows written to the destination (one per id).
    pub rows: usize,
    /// Distinct rows read from the table.
    pub rows_fetched: usize,
    /// The gather path that moved them.
    pub strategy: GatherStrategy,
    /// Whether the lookup went through the hot tier ([`EngramTable::keep_hot`]): the rows
    /// the GPU moved that are kept were read from their copies.
    pub hot: bool,
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
            hot: Arc::default(),
            work: AiWork::Decode,
        })
    }

    /// The work this handle's lookups (and similarity searches) are for: a decode step's
    /// ([`AiWork::Decode`]) unless set. Each holds a scheduler lease of its class while it
    /// moves data; stores hold one of [`AiWork::EngramSync`]'s, prefetches of
    /// [`AiWork::Prefetch`]'s.
    pub fn set_work(&mut self, work: AiWork) -> Result<()> {
        self.work = work.checked()?;
        Ok(())
    }

    /// Rows in the table.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The table's memory (for loading it, or for kernels that read it in place). Rows
    /// written here after [`keep_hot`](Self::keep_hot) are not seen by their copies: write
    /// through [`store`](Self::store), or keep the hot rows again. Let its guards go before
    /// calling this table's other methods: they take the hot tier's lock, then this one.
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
        self.lookup_as(session, ids, dst, dst_offset, self.work)
    }

    /// [`lookup`](Self::lookup) under a lease of `work`.
    fn lookup_as(
        &self,
        session: &Session,
        ids: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
        work: AiWork,
    ) -> Result<Lookup> {
        self.check_ids(ids)?;
        let _lease = work.lease_in(session)?;
        let hot = self.hot.read().unwrap_or_else(PoisonError::into_inner);
        let table = self.mem.read();
        self.gather_held(session, hot.as_ref(), &table, ids, dst, dst_offset)
    }

    /// The lookup with the table's locks held: through the hot tier where it serves `dst`'s
    /// device.
    fn gather_held(
        &self,
        session: &Session,
        hot: Option<&HotTier>,
        table: &HostBuffer,
        ids: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<Lookup> {
        if let Some(tier) = hot.filter(|t| t.serves(dst.gpu())) {
            let r = tier.lookup(session, table, ids, dst, dst_offset)?;
            return Ok(Lookup {
                rows: r.rows,
                rows_fetched: r.rows_fetched,
                strategy: r.strategy,
                hot: true,
            });
        }
        let opts = GatherOptions::default();
        let r = session
            .memio()
            .gather(table, self.row_bytes, ids, dst, dst_offset, &opts)
            .map_err(gpuio_api::Error::from)?;
        Ok(Lookup {
            rows: r.rows,
            rows_fetched: r.rows_fetched,
            strategy: r.strategy,
            hot: false,
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
        let _lease = AiWork::EngramSync.lease_in(session)?;
        let bytes = ids
            .len()
            .checked_mul(self.row_bytes)
            .ok_or_else(|| AiError::InvalidArgument("Engram store size overflows".into()))?;
        gpuio_hal::check_range("Engram store source", src_offset, bytes, src.len())
            .map_err(gpuio_api::Error::from)?;
        let hot = self.hot.read().unwrap_or_else(PoisonError::into_inner);
        let mut table = self.mem.write();
        let stored = session
            .memio()
            .scatter(src, src_offset, self.row_bytes, ids, &mut table)
            .map_err(|e| gpuio_api::Error::from(e).into());
        let Some(tier) = hot.as_ref() else {
            return stored;
        };
        // A scatter that failed part way, or a refresh that failed, may leave copies older
        // than their rows: the tier is then not read again (marked while the table is still
        // locked, so no lookup reads it in between).
        let refreshed = stored.and_then(|()| tier.refresh(&table, ids).map(drop));
        if refreshed.is_err() {
            tier.forsake();
        }
        refreshed
    }

    /// Keeps copies of rows `ids` (repeats once) in device memory of `gpu`, replacing any
    /// kept before: lookups into that device read them there, and only the other rows over
    /// the bus (one kernel). Pick the rows read most (a corpus's most frequent n-grams);
    /// 2^23 - 1 at most ([`gpuio_hal::HOT_MAX_ROWS`]), taking their bytes plus 32 to 64 bytes
    /// each (the index) of device memory. Ids past the table are refused, keeping what was
    /// kept. Waits for lookups and stores under way.
    pub fn keep_hot(&self, session: &Session, gpu: u32, ids: &[u64]) -> Result<HotTierStats> {
        self.check_ids(ids)?;
        let mut hot = self.hot.write().unwrap_or_else(PoisonError::into_inner);
        let table = self.mem.read();
        let tier = HotTier::new(session, gpu, &table, self.row_bytes, ids)?;
        let stats = tier.stats();
        *hot = Some(tier);
        Ok(stats)
    }

    /// Lets the kept copies go (their device memory is freed); lookups read the table again.
    pub fn drop_hot(&self) {
        *self.hot.write().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// What the hot tier keeps, if any (none either once a failed store left it
    /// possibly stale: lookups no longer read it).
    pub fn hot_stats(&self) -> Option<HotTierStats> {
        let hot = self.hot.read().unwrap_or_else(PoisonError::into_inner);
        hot.as_ref().filter(|t| t.is_current()).map(HotTier::stats)
    }
}

/// How a table's rows read as vectors, for similarity queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowValues {
    /// Little-endian f32s (`row_bytes / 4` of them).
    F32,
    /// FP8 E4M3 bytes, unscaled (`row_bytes` of them).
    Fp8,
}

/// Work running on a side thread: a prefetch or a write-back. Dropping it waits for it (the
/// buffers it moves must outlive it) — so do not drop one while holding the table's memory
/// locked for writing: the work waits for that lock.
#[derive(Debug)]
pub struct Pending<T: Send + 'static> {
    work: AiWork,
    thread: Option<JoinHandle<Result<T>>>,
    /// The process that started the thread, in its line of forks: a forked child has no
    /// such thread to join.
    generation: u64,
}

impl<T: Send + 'static> Pending<T> {
    fn spawn(work: AiWork, f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<Self> {
        let thread = std::thread::Builder::new()
            .name(
                match work {
                    AiWork::Prefetch => "gpuio-prefetch",
                    _ => "gpuio-engram-wb",
                }
                .into(),
            )
            .spawn(f)
            .map_err(|e| AiError::Internal(format!("starting an Engram side thread: {e}")))?;
        Ok(Self {
            work,
            thread: Some(thread),
            generation: gpuio_hal::sys::fork_generation(),
        })
    }

    /// The work it does: the scheduler class each of its pieces holds a lease of
    /// ([`AiWork::priority`]).
    pub fn work(&self) -> AiWork {
        self.work
    }

    /// Whether it has finished.
    pub fn is_done(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits for it: its result.
    pub fn wait(mut self) -> Result<T> {
        self.join()
    }

    fn join(&mut self) -> Result<T> {
        let thread = self
            .thread
            .take()
            .ok_or_else(|| AiError::Internal("Engram side work waited for twice".into()))?;
        if gpuio_hal::sys::fork_generation() != self.generation {
            std::mem::forget(thread);
            return Err(AiError::InvalidArgument(
                "this side work was started before fork(): its thread stayed in the parent \
                 process"
                    .into(),
            ));
        }
        thread
            .join()
            .map_err(|_| AiError::Internal("an Engram side thread panicked".into()))?
    }
}

impl<T: Send + 'static> Drop for Pending<T> {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.join();
        }
    }
}

impl EngramTable {
    /// Rows of one piece of side work.
    fn piece_rows(&self) -> usize {
        (SIDE_PIECE_BYTES / self.row_bytes.max(1)).max(1)
    }

    /// Side work's whole range checked before it starts (its pieces are checked again).
    fn check_side_range(
        &self,
        what: &'static str,
        rows: usize,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        let bytes = rows
            .checked_mul(self.row_bytes)
            .ok_or_else(|| AiError::InvalidArgument(format!("Engram {what} size overflows")))?;
        gpuio_hal::check_range(what, offset, bytes, len).map_err(gpuio_api::Error::from)?;
        Ok(())
    }

    /// Starts [`lookup`](Self::lookup) of `ids` into `dst` on a side thread, with its own
    /// stream, and returns at once: the upcoming layer's rows arrive while the caller
    /// computes. It runs in [`AiWork::Prefetch`]'s class (`Background`), a lease per piece of
    /// about 256 KiB, so lookups of more urgent work go between its pieces; its report sums
    /// the pieces'. A destination too small is refused before anything moves.
    pub fn prefetch(
        &self,
        session: &Arc<Session>,
        ids: Vec<u64>,
        dst: DeviceBuffer,
        dst_offset: usize,
    ) -> Result<Pending<Lookup>> {
        self.check_ids(&ids)?;
        self.check_side_range("prefetch destination", ids.len(), dst_offset, dst.len())?;
        let (table, session) = (self.clone(), Arc::clone(session));
        let piece = self.piece_rows();
        Pending::spawn(AiWork::Prefetch, move || {
            // A lease per piece: a decode step's lookup waits for one piece, not the whole.
            let mut total: Option<Lookup> = None;
            for (k, part) in ids.chunks(piece).enumerate() {
                let at = dst_offset + k * piece * table.row_bytes;
                let r = table.lookup_as(&session, part, &dst, at, AiWork::Prefetch)?;
                total = Some(match total {
                    None => r,
                    Some(t) => Lookup {
                        rows: t.rows + r.rows,
                        rows_fetched: t.rows_fetched + r.rows_fetched,
                        strategy: r.strategy,
                        hot: t.hot || r.hot,
                    },
                });
            }
            match total {
                Some(t) => Ok(t),
                // No ids: the lookup of nothing reports as a lookup does.
                None => table.lookup_as(&session, &ids, &dst, dst_offset, AiWork::Prefetch),
            }
        })
    }

    /// Starts [`store`](Self::store) of `src`'s rows at `ids` on a side thread and returns
    /// at once. It runs in [`AiWork::EngramSync`]'s class, a lease per piece of about 256 KiB:
    /// each piece is one store, so a lookup running beside it may see some pieces written and
    /// not others. A source too small is refused before anything moves.
    pub fn store_async(
        &self,
        session: &Arc<Session>,
        ids: Vec<u64>,
        src: DeviceBuffer,
        src_offset: usize,
    ) -> Result<Pending<()>> {
        self.check_ids(&ids)?;
        self.check_side_range("write-back source", ids.len(), src_offset, src.len())?;
        let (table, session) = (self.clone(), Arc::clone(session));
        let piece = self.piece_rows();
        Pending::spawn(AiWork::EngramSync, move || {
            // A lease per piece (each store takes its own), as for a prefetch.
            for (k, part) in ids.chunks(piece).enumerate() {
                let at = src_offset + k * piece * table.row_bytes;
                table.store(&session, part, &src, at)?;
            }
            Ok(())
        })
    }

    /// The `k` rows most similar to `query` (the largest dot products), best first (ties to
    /// the lower row, NaN scores never), with their scores. Brute force: the GPU of `gpu`
    /// reads every row of the table over the bus (nothing copied first) and scores it, and
    /// the top `k` are chosen on the host from the scores; on the host backend the CPU scores
    /// the rows. The query has one value per row value ([`RowValues`]).
    pub fn similar(
        &self,
        session: &Session,
        gpu: u32,
        query: &[f32],
        values: RowValues,
        k: usize,
    ) -> Result<Vec<(u64, f32)>> {
        let size = match values {
            RowValues::F32 => 4,
            RowValues::Fp8 => 1,
        };
        let dim = self.row_bytes / size;
        if dim == 0 || !self.row_bytes.is_multiple_of(size) || query.len() != dim {
            return Err(AiError::InvalidArgument(format!(
                "a query of {} values for rows of {} bytes read as {values:?}",
                query.len(),
                self.row_bytes
            )));
        }
        let rows = self.rows as usize;
        let device = session.gpu(gpu)?;
        let _lease = self.work.lease_in(session)?;
        let scores = if device.backend() == Backend::Host {
            let table = self.mem.read();
            table
                .chunks_exact(self.row_bytes)
                .map(|row| dot(row, query, values))
                .collect()
        } else {
            let stream = device.stream()?;
            let q = session.alloc_device(gpu, 4 * dim)?;
            let qb: Vec<u8> = query.iter().flat_map(|v| v.to_le_bytes()).collect();
            stream.upload(&qb, &q, 0)?;
            let out = session.alloc_device(gpu, 4 * rows)?;
            {
                let table = self.mem.read();
                let fp8 = values == RowValues::Fp8;
                dot_scores(&stream, ScoreRows::Pinned(&table), rows, dim, fp8, &q, &out)?;
            }
            let mut raw = vec![0u8; 4 * rows];
            stream.download(&out, 0, &mut raw)?;
            raw.chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect::<Vec<f32>>()
        };
        let best = crate::graph::graph_scatter(&scores, k);
        Ok(best.into_iter().map(|i| (i, scores[i as usize])).collect())
    }
}

/// A row's dot product with the query (the host's scoring).
fn dot(row: &[u8], query: &[f32], values: RowValues) -> f32 {
    match values {
        RowValues::F32 => row
            .chunks_exact(4)
            .zip(query)
            .map(|(b, q)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * q)
            .sum(),
        RowValues::Fp8 => row
            .iter()
            .zip(query)
            .map(|(&b, q)| float8::F8E4M3::from_bits(b).to_f32() * q)
            .sum(),
    }
}
