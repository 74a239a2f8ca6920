//! Row gathers and scatters between host pools (DRAM, CXL) and GPU memory: rows of `row_bytes`
//! picked by an index list, the access pattern of embedding tables, sparse-attention KV blocks
//! and graph features.
//!
//! Two ways to move the rows, and neither wins everywhere:
//! - [`GatherStrategy::ZeroCopy`]: the GPU's own threads load the rows from pinned host memory
//!   over PCIe (`kernels/gather.cu`). Fast while the device's address translation keeps up —
//!   large rows, or pools small enough that their pages stay cached in its TLBs.
//! - [`GatherStrategy::Sorted`]: the same kernels over the rows in pool address order — the
//!   index list goes to the device, which sorts it first (a counting sort). Loads in flight
//!   together then fall on few pages and neighbouring rows share read requests: 2–10× the
//!   random order for rows under 1 KiB from pools of gigabytes (H200), and rows picked twice
//!   are read once. It costs the sort and waits for the whole index list before the first
//!   row moves.
//! - [`GatherStrategy::CpuStaged`]: all cores gather rows into pinned staging buffers (with
//!   prefetching a few rows ahead) and each full buffer goes over as one DMA, overlapped with
//!   the next buffer's gather. The CPU pays no per-page device translation, so this wins for
//!   small rows from large pools.
//! - [`GatherStrategy::Hybrid`]: the GPU (in the faster of the two kernel orders) and the CPU
//!   share one call's rows.
//!
//! [`GatherStrategy::Auto`] learns which is fastest per (device, row size, pool size, row
//! count, index list place) class from the calls themselves: it tries each, keeps the
//! fastest, and re-checks the others now and then.
//!
//! The index list may be in host memory or already in device memory ([`GatherIndices`]): the
//! output of a top-k or hashing kernel need not come back to the host for the GPU's paths.
//!
//! This file holds the public types and the entry points ([`MemIo::gather`],
//! [`MemIo::scatter`], [`MemIo::gather_plan`]). `planner.rs` is `Auto`: the shape classes and
//! what it measured of each path; `indices.rs` puts an index list where its readers need it
//! (pinned memory, device memory, or back in host memory for the CPU); `paths.rs` holds the
//! paths that move the rows.

mod indices;
mod jobs;
mod paths;
mod planner;

pub(crate) use indices::IndexStage;
pub use jobs::HotLookup;
pub(crate) use planner::Planner;

use crate::{MemIo, Result};
use gpuio_hal::{DeviceBuffer, Gpu, HalError, HostBuffer, HotRows, RowKernel};
use indices::IndexPath;
use paths::{GpuRows, HybridSplit};
use std::time::Instant;

/// How a gather moves its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
pub enum GatherStrategy {
    /// Pick per call from what earlier calls of the same shape measured.
    #[default]
    Auto,
    /// GPU threads load the rows from pinned host memory (the pool must be pinned).
    ZeroCopy,
    /// Zero-copy in pool address order: the device sorts the index list first.
    Sorted,
    /// CPU threads gather into pinned staging; one DMA per staging buffer.
    CpuStaged,
    /// Both at once on one call's rows: the GPU's threads take a share, the CPU the rest,
    /// the share balanced from call to call so that both sides finish together. Where the
    /// device's address translation limits zero-copy and the cores limit staging, each adds
    /// to the other.
    Hybrid,
}

/// Options of a gather.
#[derive(Debug, Clone, Copy, Default)]
pub struct GatherOptions {
    /// Which path moves the rows.
    pub strategy: GatherStrategy,
    /// Fetch each distinct row once, in address order, and expand on the device: for index
    /// lists with many repeats.
    pub dedup: bool,
    /// For hybrid calls (forced, or chosen by `Auto`): the GPU's share of the rows (0 to 1),
    /// fixed by the caller — to leave cores free, or to measure one split; a value outside
    /// 0 to 1 fails any call. `None`: `Auto`'s balancing picks it.
    pub gpu_share: Option<f64>,
}

/// A gather's index list: output row `i` is pool row `list[i]`.
#[derive(Debug, Clone, Copy)]
pub enum GatherIndices<'a> {
    /// In host memory.
    Host(&'a [u64]),
    /// In device memory of the destination's GPU: the first `count` little-endian u64s of
    /// `list`. The GPU's paths read it there; the CPU's (CPU-staged, a hybrid's CPU share,
    /// `dedup`) first copy their part of it back, 8 bytes a row.
    Device {
        /// The list's buffer.
        list: &'a DeviceBuffer,
        /// Indices in it (rows to gather).
        count: usize,
    },
}

impl GatherIndices<'_> {
    /// Rows to gather.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(list) => list.len(),
            Self::Device { count, .. } => *count,
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the list lives.
    pub fn place(&self) -> IndexPlace {
        match self {
            Self::Host(_) => IndexPlace::Host,
            Self::Device { .. } => IndexPlace::Device,
        }
    }
}

impl<'a> From<&'a [u64]> for GatherIndices<'a> {
    fn from(list: &'a [u64]) -> Self {
        Self::Host(list)
    }
}

impl<'a> From<&'a Vec<u64>> for GatherIndices<'a> {
    fn from(list: &'a Vec<u64>) -> Self {
        Self::Host(list)
    }
}

impl<'a, const N: usize> From<&'a [u64; N]> for GatherIndices<'a> {
    fn from(list: &'a [u64; N]) -> Self {
        Self::Host(list)
    }
}

/// Where a gather's index list lives. Part of `Auto`'s shape classes: a list in host memory
/// must cross PCIe before the device can sort it, one on the device need not, so the same
/// rows can want different paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum IndexPlace {
    /// Host memory.
    Host,
    /// Device memory.
    Device,
}

/// What a gather did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct GatherReport {
    /// The path that moved the rows (never `Auto`).
    pub strategy: GatherStrategy,
    /// Rows written to the destination.
    pub rows: usize,
    /// Rows read from the pool (fewer than `rows` with `dedup` and repeats).
    pub rows_fetched: usize,
}

/// What [`GatherStrategy::Auto`] has learned about one shape of gather (device, row size and
/// pool size class).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GatherPlan {
    /// The path `Auto` exploits now.
    pub strategy: GatherStrategy,
    /// The bytes/s estimated of zero-copy, sorted, CPU-staged and hybrid calls (the median
    /// of each one's last three).
    pub rates: [Option<f64>; 4],
    /// The GPU's share of a hybrid call's rows.
    pub gpu_share: f64,
}

impl MemIo {
    /// Gathers rows of `row_bytes` from `pool` into `dst` at `dst_offset`: output row `i` is
    /// pool row `indices[i]`, the list in host memory (a `&[u64]`) or device memory
    /// ([`GatherIndices::Device`]). Rows are opaque bytes of any size and alignment. The pool
    /// may be pinned (every path open) or not (CPU-staged only). An index past the pool's last
    /// row fails the call with [`HalError::IndexOutOfRange`]; the destination is then partly
    /// written.
    pub fn gather<'a>(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: impl Into<GatherIndices<'a>>,
        dst: &DeviceBuffer,
        dst_offset: usize,
        opts: &GatherOptions,
    ) -> Result<GatherReport> {
        self.gather_through(pool, row_bytes, indices.into(), dst, dst_offset, opts, None)
    }

    /// [`gather`](Self::gather) through `hot` rows (copies of some of `pool`'s rows in
    /// device memory, [`Stream::keep_hot`](gpuio_hal::Stream::keep_hot)): the GPU's paths
    /// read each kept row from its copy and only the others over the bus; the CPU's read the
    /// pool, as does a `dedup` call. There is no sorted path (`Sorted` is refused; `Auto`
    /// learns among the others for hot shapes apart). `hot` must be copies of `pool`'s rows
    /// on the destination's GPU (both checked before any path runs).
    pub fn gather_hot<'a>(
        &self,
        pool: &HostBuffer,
        hot: &HotRows,
        indices: impl Into<GatherIndices<'a>>,
        dst: &DeviceBuffer,
        dst_offset: usize,
        opts: &GatherOptions,
    ) -> Result<GatherReport> {
        let refuse = |why: &str| Err(HalError::InvalidArgument(why.into()).into());
        if opts.strategy == GatherStrategy::Sorted {
            return refuse("a sorted gather does not read hot rows");
        }
        if !hot.copies_of(pool) {
            return refuse("hot rows are copies of another pool's rows");
        }
        if !hot.gpu().same_device(dst.gpu()) {
            return refuse("hot rows must be on the destination's GPU");
        }
        let row_bytes = hot.row_bytes();
        self.gather_through(
            pool,
            row_bytes,
            indices.into(),
            dst,
            dst_offset,
            opts,
            Some(hot),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn gather_through(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: GatherIndices<'_>,
        dst: &DeviceBuffer,
        dst_offset: usize,
        opts: &GatherOptions,
        hot: Option<&HotRows>,
    ) -> Result<GatherReport> {
        if row_bytes == 0 {
            return Err(
                HalError::InvalidArgument("row size must be at least 1 byte".into()).into(),
            );
        }
        let out_len = indices
            .len()
            .checked_mul(row_bytes)
            .ok_or_else(|| HalError::InvalidArgument("gather size overflows".into()))?;
        gpuio_hal::check_range("gather destination", dst_offset, out_len, dst.len())?;
        if let GatherIndices::Device { list, count } = indices {
            if list.gpu() != dst.gpu() {
                return Err(HalError::InvalidArgument(
                    "a device index list must be on the destination's GPU".into(),
                )
                .into());
            }
            let bytes = count
                .checked_mul(8)
                .ok_or_else(|| HalError::InvalidArgument("index list size overflows".into()))?;
            gpuio_hal::check_range("gather index list", 0, bytes, list.len())?;
        }
        self.device(dst.gpu())?;
        if let Some(s) = opts.gpu_share
            && !(0.0..=1.0).contains(&s)
        {
            return Err(HalError::InvalidArgument(format!(
                "a hybrid gather's GPU share must be between 0 and 1, not {s}"
            ))
            .into());
        }
        let rows = indices.len();
        let place = indices.place();
        let key = self.shape(pool, dst.gpu(), row_bytes, rows, place, hot.is_some());
        if indices.is_empty() {
            return Ok(GatherReport {
                strategy: self.resolve(opts.strategy, pool, key),
                rows: 0,
                rows_fetched: 0,
            });
        }
        if opts.dedup {
            let list = self.host_indices(indices, 0..rows)?;
            return self.gather_dedup(pool, row_bytes, &list, dst, dst_offset, opts);
        }
        let strategy = self.resolve(opts.strategy, pool, key);
        let tuned = hot.map_or(GpuRows::Kernel(RowKernel::Tuned), GpuRows::Hot);
        let t = Instant::now();
        match strategy {
            GatherStrategy::ZeroCopy => {
                self.gather_zero_copy(pool, row_bytes, indices, dst, dst_offset, tuned)?
            }
            GatherStrategy::Sorted => {
                let sorted = GpuRows::Kernel(RowKernel::Sorted);
                self.gather_zero_copy(pool, row_bytes, indices, dst, dst_offset, sorted)?
            }
            GatherStrategy::Hybrid => {
                let split = HybridSplit {
                    key,
                    fixed: opts.gpu_share,
                    hot,
                };
                self.gather_hybrid(pool, row_bytes, indices, dst, dst_offset, split)?
            }
            _ => {
                let list = self.host_indices(indices, 0..rows)?;
                self.gather_staged(pool, row_bytes, &list, dst, dst_offset)?
            }
        }
        // A call with the caller's own hybrid share measures that split, not the hybrid's.
        if opts.gpu_share.is_none() || strategy != GatherStrategy::Hybrid {
            self.planner
                .record(key, strategy, out_len, t.elapsed().as_secs_f64());
        }
        self.count_h2d(out_len);
        Ok(GatherReport {
            strategy,
            rows,
            rows_fetched: rows,
        })
    }

    /// Scatters rows of `row_bytes` from `src` at `src_offset` into the pinned `pool`: pool
    /// row `indices[i]` becomes source row `i` (the GPU's threads store them over PCIe). With
    /// duplicate indices, one of their rows lands, unspecified which.
    pub fn scatter(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        row_bytes: usize,
        indices: &[u64],
        pool: &mut HostBuffer,
    ) -> Result<()> {
        if indices.is_empty() {
            return Ok(());
        }
        let gpu = src.gpu().clone();
        self.device(&gpu)?;
        let path = IndexPath::of(RowKernel::Tuned, row_bytes);
        self.with_indices(&gpu, indices, path, |stream, idx| {
            Ok(stream.scatter(src, src_offset, row_bytes, idx, indices.len(), pool)?)
        })?;
        self.count_d2h(indices.len().saturating_mul(row_bytes));
        Ok(())
    }

    /// What `Auto` has learned so far about gathers of `rows` rows of `row_bytes` from
    /// `pool` into `gpu` by an index list in `indices` memory (None before the first call of
    /// that shape).
    pub fn gather_plan(
        &self,
        pool: &HostBuffer,
        gpu: &Gpu,
        row_bytes: usize,
        rows: usize,
        indices: IndexPlace,
    ) -> Option<GatherPlan> {
        self.planner
            .plan(self.shape(pool, gpu, row_bytes, rows, indices, false))
    }
}
