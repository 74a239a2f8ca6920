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

use crate::pipeline::{ChunkLen, Schedule};
use crate::{MemIo, MemIoError, Result};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{
    DeviceBuffer, Gpu, HalError, HostAllocOptions, HostBuffer, RowIndices, RowKernel, Stream,
};
use rayon::prelude::*;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;
use std::time::{Duration, Instant};

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

/// Shape class of a gather, for the strategy choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ShapeKey {
    gpu: u32,
    row_bytes_log2: u32,
    pool_log2: u32,
    /// A 2048-row call and a million-row one from the same pool can want different paths:
    /// the hybrid's second side costs more than it brings on a small call.
    rows_log2: u32,
    indices: IndexPlace,
}

/// Measured rates per shape class.
#[derive(Debug, Default)]
pub(crate) struct Planner {
    shapes: Mutex<HashMap<ShapeKey, Shape>>,
}

#[derive(Debug, Default)]
struct Shape {
    calls: u64,
    /// Recent bytes/s of each of [`STRATEGIES`].
    rate: [Recent; 4],
    /// The path being exploited.
    current: usize,
    /// The GPU's share of a hybrid call's rows, from the rates the two sides reached while
    /// sharing the link in earlier hybrid calls.
    gpu_share: Option<f64>,
    /// Hybrid calls so far, and whether the last one left the share where it was.
    hybrid_calls: u32,
    share_settled: bool,
}

/// The last three rates measured of one path. Its estimate is their median, so that one
/// slow call (a burst of page faults, a descheduled thread) does not move the choice. A
/// path's first call is not counted: it pays one-time costs (scratch and staging memory
/// allocated, pages of device memory first touched) that would make one sample an outlier
/// the choice then never revisits.
#[derive(Debug, Default, Clone, Copy)]
struct Recent {
    last: [f64; 3],
    count: usize,
    warmed: bool,
}

impl Recent {
    fn push(&mut self, rate: f64) {
        if !std::mem::replace(&mut self.warmed, true) {
            return;
        }
        self.last[self.count % 3] = rate;
        self.count += 1;
    }

    fn estimate(&self) -> Option<f64> {
        let [a, b, c] = self.last;
        match self.count {
            0 => None,
            1 => Some(a),
            2 => Some((a + b) / 2.0),
            _ => Some(a.max(b).min(a.min(b).max(c))),
        }
    }
}

/// How much faster another path must measure before the choice moves to it.
const SWITCH_MARGIN: f64 = 1.1;

/// The paths `Auto` chooses from, in the order it first tries them: the GPU's two orders
/// before the hybrid, which uses the faster of them.
const STRATEGIES: [GatherStrategy; 4] = [
    GatherStrategy::ZeroCopy,
    GatherStrategy::Sorted,
    GatherStrategy::CpuStaged,
    GatherStrategy::Hybrid,
];
const ZERO_COPY: usize = 0;
const SORTED: usize = 1;
const CPU_STAGED: usize = 2;

/// The least share of a hybrid call's rows either side gets, so both rates stay measured.
const MIN_SHARE: f64 = 0.02;

/// A hybrid share is balanced once its two sides finish within this part of the call's
/// time of each other.
const SETTLED_IMBALANCE: f64 = 0.1;

/// Most hybrid calls spent balancing the share before the paths are compared.
const MAX_BALANCING_CALLS: u32 = 8;

/// Re-measure the slower path once every this many calls of a shape.
const RECHECK_EVERY: u64 = 32;

impl Planner {
    /// The path for the next call of this shape: each one twice (a warm-up, then a measured
    /// call), then the fastest, with a slower one re-measured every [`RECHECK_EVERY`] calls.
    fn choose(&self, key: ShapeKey) -> GatherStrategy {
        let mut shapes = self.shapes.lock_unpoisoned();
        let s = shapes.entry(key).or_default();
        s.calls += 1;
        if let Some(i) = s.rate.iter().position(|r| r.count == 0) {
            return STRATEGIES[i];
        }
        // A hybrid call with an unbalanced share understates the hybrid: balance it first.
        if !s.share_settled && s.hybrid_calls < MAX_BALANCING_CALLS {
            return GatherStrategy::Hybrid;
        }
        let rate = |i: usize| s.rate[i].estimate().unwrap_or(0.0);
        let mut best = (0..STRATEGIES.len())
            .max_by(|&a, &b| rate(a).total_cmp(&rate(b)))
            .unwrap_or(0);
        // Stay with the current path unless another is clearly faster: noise is not a reason
        // to switch.
        if rate(s.current) * SWITCH_MARGIN >= rate(best) {
            best = s.current;
        }
        s.current = best;
        if s.calls.is_multiple_of(RECHECK_EVERY) {
            let others = STRATEGIES.len() - 1;
            let other = (best + 1 + (s.calls / RECHECK_EVERY) as usize % others) % STRATEGIES.len();
            STRATEGIES[other]
        } else {
            STRATEGIES[best]
        }
    }

    fn plan(&self, key: ShapeKey) -> Option<GatherPlan> {
        let gpu_share = self.gpu_share(key);
        let shapes = self.shapes.lock_unpoisoned();
        let s = shapes.get(&key)?;
        Some(GatherPlan {
            strategy: STRATEGIES[s.current],
            rates: s.rate.map(|r| r.estimate()),
            gpu_share,
        })
    }

    /// The share of rows a hybrid call gives the GPU: what balanced the two sides in earlier
    /// hybrid calls, or at first the GPU's part of the two paths' total rate alone.
    fn gpu_share(&self, key: ShapeKey) -> f64 {
        let shapes = self.shapes.lock_unpoisoned();
        let Some(s) = shapes.get(&key) else {
            return 0.5;
        };
        let gpu = s.rate[ZERO_COPY]
            .estimate()
            .into_iter()
            .chain(s.rate[SORTED].estimate())
            .reduce(f64::max);
        match (s.gpu_share, gpu, s.rate[CPU_STAGED].estimate()) {
            (Some(share), _, _) => share,
            (None, Some(z), Some(c)) if z + c > 0.0 => z / (z + c),
            _ => 0.5,
        }
    }

    /// The kernel order of a hybrid call's GPU side: sorted where sorted calls measured
    /// faster than zero-copy ones.
    fn gpu_kernel(&self, key: ShapeKey) -> RowKernel {
        let shapes = self.shapes.lock_unpoisoned();
        let sorted_faster = shapes.get(&key).is_some_and(|s| {
            match (s.rate[ZERO_COPY].estimate(), s.rate[SORTED].estimate()) {
                (Some(z), Some(o)) => o > z,
                _ => false,
            }
        });
        if sorted_faster {
            RowKernel::Sorted
        } else {
            RowKernel::Tuned
        }
    }

    /// Moves the hybrid share most of the way to what would have had both sides of a hybrid
    /// call with share `old` finish together, given the time each side took; not all the way, so one call's noise does not swing it. The share is
    /// settled once the sides finish within [`SETTLED_IMBALANCE`] of each other.
    fn balance(&self, key: ShapeKey, old: f64, gpu: Duration, cpu: Duration) {
        let (g, c) = (gpu.as_secs_f64(), cpu.as_secs_f64());
        if !(g > 0.0 && c > 0.0) {
            return;
        }
        // Rates per unit share; their ratio is the balanced split.
        let (gpu_rate, cpu_rate) = (old / g, (1.0 - old) / c);
        let balanced = gpu_rate / (gpu_rate + cpu_rate);
        if let Some(s) = self.shapes.lock_unpoisoned().get_mut(&key) {
            let share = old + 0.75 * (balanced - old);
            s.gpu_share = Some(share.clamp(MIN_SHARE, 1.0 - MIN_SHARE));
            s.hybrid_calls += 1;
            s.share_settled = (g - c).abs() / g.max(c) < SETTLED_IMBALANCE;
        }
    }

    fn record(&self, key: ShapeKey, strategy: GatherStrategy, bytes: usize, secs: f64) {
        let Some(i) = STRATEGIES.iter().position(|s| *s == strategy) else {
            return;
        };
        if let Some(s) = self.shapes.lock_unpoisoned().get_mut(&key) {
            s.rate[i].push(bytes as f64 / secs.max(1e-9));
        }
    }
}

/// Pinned host memory for an index list, written piece by piece while the kernels read it
/// over PCIe. (Copying it to the device first, even in stream order with no wait between,
/// measured slower for small rows on the H200: the copy runs before the kernel instead of
/// alongside.)
pub(crate) struct IndexStage {
    host: HostBuffer,
    /// Device memory of the same size, for lists copied to the device piece by piece
    /// (allocated on first use).
    device: Option<DeviceBuffer>,
}

/// An index list the CPU reads: the caller's, or a device list's part copied back into a
/// pinned stage, which goes back to the device's pool when this is dropped.
enum HostList<'a> {
    Borrowed(&'a [u64]),
    Staged {
        io: &'a MemIo,
        gpu: &'a Gpu,
        stage: Option<IndexStage>,
        len: usize,
    },
}

impl std::ops::Deref for HostList<'_> {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        match self {
            Self::Borrowed(list) => list,
            Self::Staged { stage, len, .. } => stage
                .as_ref()
                .map_or(&[][..], |s| &s.host.as_u64s()[..*len]),
        }
    }
}

impl Drop for HostList<'_> {
    fn drop(&mut self) {
        if let Self::Staged { io, gpu, stage, .. } = self
            && let Some(stage) = stage.take()
        {
            io.give_stage(gpu, stage);
        }
    }
}

/// From this row size on, each piece of an index list is copied to the device before its
/// rows move (the copy is under 1% of the rows' bytes, and the kernel's index loads stop
/// waiting on PCIe round trips); below it the kernel reads the list from pinned memory as
/// it goes, because the copy would be 3–12% of the bytes, in series with the kernel.
const DEVICE_INDICES_FROM: usize = 1024;

/// Where a call's index list goes and who writes it into pinned memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IndexPath {
    /// Read by the kernels from pinned memory as they go, written piece by piece on the
    /// calling thread while the kernels move the pieces before.
    Pinned,
    /// Copied to device memory piece by piece, written on the calling thread.
    Device,
    /// Written whole by the engine's copy threads together (not the gather threads, which
    /// may be running a hybrid's CPU share), then copied to device memory: for sorted
    /// gathers, whose rows wait for the whole list anyway (one thread writes ~1 index/ns:
    /// 0.7 ms for a million, a quarter of the time their rows take at 160 B).
    DeviceParallel,
}

impl IndexPath {
    /// The path of a gather of rows of `row_bytes` by `kernel`.
    fn of(kernel: RowKernel, row_bytes: usize) -> Self {
        match kernel {
            RowKernel::Sorted => Self::DeviceParallel,
            _ if row_bytes >= DEVICE_INDICES_FROM => Self::Device,
            _ => Self::Pinned,
        }
    }
}

/// Indices per task of a parallel index write.
const ENCODE_TASK: usize = 8 << 10;

/// Writes `indices` as little-endian u64s into `out`, with stores that bypass the CPU caches:
/// the device reads the list next (by DMA or its kernels' loads), and lines still dirty in the
/// cores' caches would have to be snooped out of them first. On the H200 machine an 8 MiB list
/// written by 8 threads then copied took 0.60 ms with plain stores, 0.29 ms with these (the
/// copy alone: 0.16 ms). Staged row copies measured no such gain (CPU-staged gathers of 160 and
/// 656 B rows lost 10–30%): their DMAs overlap the next chunks' gathers.
fn encode_indices(indices: &[u64], out: &mut [u8]) {
    gpuio_hal::write_u64s_streaming(out, indices);
}

/// How a hybrid call splits its rows: the share the caller fixed, or else the one `Auto`
/// balances for the shape.
struct HybridSplit {
    key: ShapeKey,
    fixed: Option<f64>,
}

/// A range of output rows, as one staged chunk.
struct RowChunk {
    rows: Range<usize>,
    row_bytes: usize,
}

impl ChunkLen for RowChunk {
    fn chunk_len(&self) -> usize {
        self.rows.len() * self.row_bytes
    }
}

/// Rows ahead of the one being copied whose first line is prefetched.
const PREFETCH_AHEAD: usize = 8;

fn log2(x: usize) -> u32 {
    usize::BITS - x.max(1).leading_zeros()
}

/// Index `ix` (at `position` in its list) as a row of a pool of `rows` rows.
fn row_of(ix: u64, rows: usize, position: usize) -> Result<usize> {
    usize::try_from(ix)
        .ok()
        .filter(|&r| r < rows)
        .ok_or_else(|| bad_index(position, rows))
}

fn bad_index(position: usize, rows: usize) -> MemIoError {
    HalError::IndexOutOfRange {
        position: position as u64,
        rows: rows as u64,
    }
    .into()
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
        let indices = indices.into();
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
        let key = self.shape(pool, dst.gpu(), row_bytes, rows, indices.place());
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
        let t = Instant::now();
        match strategy {
            GatherStrategy::ZeroCopy => {
                self.gather_zero_copy(pool, row_bytes, indices, dst, dst_offset, RowKernel::Tuned)?
            }
            GatherStrategy::Sorted => {
                self.gather_zero_copy(pool, row_bytes, indices, dst, dst_offset, RowKernel::Sorted)?
            }
            GatherStrategy::Hybrid => {
                let split = HybridSplit {
                    key,
                    fixed: opts.gpu_share,
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
            .plan(self.shape(pool, gpu, row_bytes, rows, indices))
    }

    fn shape(
        &self,
        pool: &HostBuffer,
        gpu: &Gpu,
        row_bytes: usize,
        rows: usize,
        indices: IndexPlace,
    ) -> ShapeKey {
        ShapeKey {
            gpu: gpu.ordinal(),
            row_bytes_log2: log2(row_bytes),
            pool_log2: log2(pool.len()),
            rows_log2: log2(rows),
            indices,
        }
    }

    fn resolve(&self, asked: GatherStrategy, pool: &HostBuffer, key: ShapeKey) -> GatherStrategy {
        if !pool.is_pinned() {
            // The device cannot reach pageable memory; only the CPU can gather it.
            return GatherStrategy::CpuStaged;
        }
        match asked {
            GatherStrategy::Auto => self.planner.choose(key),
            other => other,
        }
    }

    /// Indices `range` of a list in host memory: borrowed from a host list; from a device
    /// list, copied back by DMA into a pinned index stage (resident memory: a fresh vector
    /// would fault in every page as the copy lands).
    fn host_indices<'a>(
        &'a self,
        indices: GatherIndices<'a>,
        range: Range<usize>,
    ) -> Result<HostList<'a>> {
        let list = match indices {
            GatherIndices::Host(list) => return Ok(HostList::Borrowed(&list[range])),
            GatherIndices::Device { list, .. } => list,
        };
        let gpu = list.gpu();
        let len = range.len();
        let mut stage = self.take_stage(gpu, len * 8)?;
        let copied = self.with_stream(gpu, |s| {
            Ok(s.download(
                list,
                range.start * 8,
                &mut stage.host.as_mut_slice()[..len * 8],
            )?)
        });
        if let Err(e) = copied {
            self.give_stage(gpu, stage);
            return Err(e);
        }
        for w in &mut stage.host.as_u64s_mut()[..len] {
            *w = u64::from_le(*w);
        }
        Ok(HostList::Staged {
            io: self,
            gpu,
            stage: Some(stage),
            len,
        })
    }

    /// Runs `f` with a stream and the first `count` indices where the device reads them: a
    /// device list as it is, a host list staged by `path`.
    fn with_gpu_indices<T>(
        &self,
        gpu: &Gpu,
        indices: GatherIndices<'_>,
        count: usize,
        path: IndexPath,
        f: impl FnOnce(&Stream, RowIndices<'_>) -> Result<T>,
    ) -> Result<T> {
        match indices {
            GatherIndices::Host(list) => self.with_indices(gpu, &list[..count], path, f),
            GatherIndices::Device { list, .. } => {
                self.with_stream(gpu, |s| f(s, RowIndices::Device(list)))
            }
        }
    }

    /// Stages `indices` in pinned memory the device reads (copied on to device memory piece
    /// by piece unless `path` is `Pinned`) and runs `f` with a stream and them.
    fn with_indices<T>(
        &self,
        gpu: &Gpu,
        indices: &[u64],
        path: IndexPath,
        f: impl FnOnce(&Stream, RowIndices<'_>) -> Result<T>,
    ) -> Result<T> {
        let on_device = path != IndexPath::Pinned;
        let mut stage = self.take_stage(gpu, indices.len() * 8)?;
        if on_device && stage.device.is_none() {
            stage.device = Some(gpu.alloc(stage.host.len())?);
        }
        let out = match (path, stage.device.as_ref()) {
            (IndexPath::DeviceParallel, Some(device)) => {
                // Written all at once by the copy threads (one wake-up: each costs ~50 µs,
                // so not one per piece), then copied to the device in one DMA.
                let host = &mut stage.host;
                self.pool.install(|| {
                    host[..indices.len() * 8]
                        .par_chunks_mut(ENCODE_TASK * 8)
                        .zip(indices.par_chunks(ENCODE_TASK))
                        .for_each(|(o, i)| encode_indices(i, o));
                });
                self.with_stream(gpu, |s| f(s, RowIndices::Staged { host, device }))
            }
            _ => {
                // Written piece by piece on this thread while the device moves the pieces
                // before: the device starts after the first 4 Ki indices, and no pool threads
                // are woken.
                let mut encode =
                    |range: Range<usize>, out: &mut [u8]| encode_indices(&indices[range], out);
                self.with_stream(gpu, |s| {
                    f(
                        s,
                        RowIndices::Streamed {
                            stage: &mut stage.host,
                            encode: &mut encode,
                            device: stage.device.as_ref().filter(|_| on_device),
                        },
                    )
                })
            }
        };
        self.give_stage(gpu, stage);
        out
    }

    /// A pinned index stage of at least `bytes` from the device's pool (or a new one).
    fn take_stage(&self, gpu: &Gpu, bytes: usize) -> Result<IndexStage> {
        let dev = self.device(gpu)?;
        let pooled = {
            let mut stages = dev.index_stages.lock_unpoisoned();
            let at = stages.iter().position(|s| s.host.len() >= bytes);
            at.map(|i| stages.swap_remove(i))
        };
        if let Some(s) = pooled {
            return Ok(s);
        }
        let cap = bytes.next_power_of_two().max(64 << 10);
        let opts = HostAllocOptions {
            numa: gpu.info().numa_node,
            ..HostAllocOptions::default()
        };
        Ok(IndexStage {
            host: HostBuffer::alloc_pinned(cap, &opts, gpu)?,
            device: None,
        })
    }

    fn give_stage(&self, gpu: &Gpu, stage: IndexStage) {
        if let Ok(dev) = self.device(gpu) {
            dev.index_stages.lock_unpoisoned().push(stage);
        }
    }

    /// The GPU's threads load the rows, with `kernel` `Tuned` (in list order) or `Sorted`.
    fn gather_zero_copy(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: GatherIndices<'_>,
        dst: &DeviceBuffer,
        dst_offset: usize,
        kernel: RowKernel,
    ) -> Result<()> {
        let path = IndexPath::of(kernel, row_bytes);
        let n = indices.len();
        self.with_gpu_indices(dst.gpu(), indices, n, path, |s, idx| {
            Ok(s.gather(pool, row_bytes, idx, n, dst, dst_offset, kernel)?)
        })
    }

    /// The GPU's share of the rows (first) by its threads, the rest by the CPU while the
    /// kernel runs; the share follows the rates both sides reach together.
    fn gather_hybrid(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: GatherIndices<'_>,
        dst: &DeviceBuffer,
        dst_offset: usize,
        HybridSplit { key, fixed }: HybridSplit,
    ) -> Result<()> {
        let share = fixed.unwrap_or_else(|| self.planner.gpu_share(key));
        let kernel = self.planner.gpu_kernel(key);
        let path = IndexPath::of(kernel, row_bytes);
        let n = indices.len();
        let split = ((n as f64 * share).round() as usize).min(n);
        // A caller's share of 0 or 1 leaves one side alone.
        if split == 0 {
            let list = self.host_indices(indices, 0..n)?;
            return self.gather_staged(pool, row_bytes, &list, dst, dst_offset);
        }
        if split == n {
            return self.gather_zero_copy(pool, row_bytes, indices, dst, dst_offset, kernel);
        }
        // The GPU's rows come first; the CPU's part of a device list is copied back first.
        let cpu_rows = self.host_indices(indices, split..n)?;
        let cpu_rows: &[u64] = &cpu_rows;
        let cpu_offset = dst_offset + split * row_bytes;
        // The CPU's share starts on the gather threads as soon as the GPU's index list is
        // handed over: after it is written whole by the copy threads for a sorted GPU share
        // (before the cores get busy), before any of it for a streamed one (which this
        // thread writes piece by piece as its kernels go), so that waking the gather threads
        // (~0.3 ms when they have gone to sleep between calls) overlaps the GPU side's start.
        let mut cpu = None;
        let gpu = self.with_gpu_indices(dst.gpu(), indices, split, path, |s, idx| {
            self.gather_pool()?.in_place_scope(|scope| {
                scope.spawn(|_| {
                    let t = Instant::now();
                    let done = self.gather_staged(pool, row_bytes, cpu_rows, dst, cpu_offset);
                    cpu = Some((done, t.elapsed()));
                });
                Ok(s.gather_timed(pool, row_bytes, idx, split, dst, dst_offset, kernel)?)
            })
        });
        let gpu_time = gpu?;
        let (cpu_done, cpu_time) = cpu.ok_or_else(|| {
            MemIoError::Internal("the CPU share of a hybrid gather did not run".into())
        })?;
        // The CPU's positions count from the split.
        cpu_done.map_err(|e| match e {
            MemIoError::Hal(HalError::IndexOutOfRange { position, rows }) => {
                bad_index(position as usize + split, rows as usize)
            }
            other => other,
        })?;
        if fixed.is_none() {
            let used = split as f64 / n as f64;
            self.planner.balance(key, used, gpu_time, cpu_time);
        }
        Ok(())
    }

    fn gather_staged(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        let rows = pool.len() / row_bytes;
        let total = indices.len() * row_bytes;
        let threads = self.gather_threads();
        let max = self.config.chunk_size;
        if row_bytes > max {
            // A row larger than a staging buffer: copy it on its own.
            return self.gather_rows_one_by_one(pool, row_bytes, indices, dst, dst_offset);
        }
        // In rows: one small chunk per lane at each end — the first DMAs start soon, and the
        // DMA still queued when every lane has gathered its last chunk is short — and between
        // them several chunks per lane, so each lane's gathers overlap its earlier chunks'
        // DMA, of at least 1 MiB to keep the copy engine efficient.
        let small = (256 << 10).min(max);
        let large = (total / (threads * 4)).clamp((1 << 20).min(max), max);
        let schedule = Schedule {
            small: (small / row_bytes).max(1),
            large: (large / row_bytes).max(1),
            ramp: threads,
        };
        let lanes_wanted = schedule.count(indices.len()).min(threads);
        let lanes = &self.device(dst.gpu())?.lanes;
        let mut taken = lanes.take(lanes_wanted)?;
        let chunks = Mutex::new(schedule.ranges(indices.len()));
        let data = pool.as_slice();
        let res = self.run_lanes_on(self.gather_pool()?, &mut taken, |lane, abort| {
            let next = || {
                let range = chunks.lock_unpoisoned().next()?;
                Some((
                    range.start * row_bytes,
                    RowChunk {
                        rows: range,
                        row_bytes,
                    },
                ))
            };
            lane.upload_filled(next, abort, dst, dst_offset, |chunk, buf| {
                gather_into(data, rows, indices, chunk, buf)
            })
        });
        lanes.give_back(taken);
        res
    }

    /// Rows too large for a staging buffer (beyond the 64 KiB rows gathers are made for):
    /// one upload per row.
    fn gather_rows_one_by_one(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        let rows = pool.len() / row_bytes;
        for (i, &ix) in indices.iter().enumerate() {
            let r = row_of(ix, rows, i)?;
            let src = &pool[r * row_bytes..(r + 1) * row_bytes];
            self.upload(src, dst, dst_offset + i * row_bytes)?;
        }
        Ok(())
    }

    /// Gathers each distinct row once (in address order) into device scratch, then expands
    /// on the device.
    fn gather_dedup(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
        opts: &GatherOptions,
    ) -> Result<GatherReport> {
        let mut unique: Vec<u64> = indices.to_vec();
        self.pool.install(|| unique.par_sort_unstable());
        unique.dedup();
        let inverse: Vec<u64> = self.pool.install(|| {
            indices
                .par_iter()
                .map(|i| unique.binary_search(i).unwrap_or(0) as u64)
                .collect()
        });
        let gpu = dst.gpu().clone();
        let scratch = gpu.alloc(unique.len() * row_bytes)?;
        let inner = GatherOptions {
            dedup: false,
            ..*opts
        };
        let report = self.gather(pool, row_bytes, &unique, &scratch, 0, &inner)?;
        let path = IndexPath::of(RowKernel::Tuned, row_bytes);
        self.with_indices(&gpu, &inverse, path, |s, idx| {
            Ok(s.gather_device(&scratch, row_bytes, idx, indices.len(), dst, dst_offset)?)
        })?;
        Ok(GatherReport {
            strategy: report.strategy,
            rows: indices.len(),
            rows_fetched: unique.len(),
        })
    }
}

/// Copies the rows of `chunk` into `buf`, prefetching a few rows ahead.
fn gather_into(
    pool: &[u8],
    rows: usize,
    indices: &[u64],
    chunk: RowChunk,
    buf: &mut [u8],
) -> Result<()> {
    let rb = chunk.row_bytes;
    let ix = &indices[chunk.rows.clone()];
    let row = |k: usize| row_of(ix[k], rows, chunk.rows.start + k);
    for k in 0..ix.len().min(PREFETCH_AHEAD) {
        let r = row(k)?;
        gpuio_hal::prefetch(&pool[r * rb..(r + 1) * rb]);
    }
    for (k, out) in buf.chunks_exact_mut(rb).enumerate() {
        if k + PREFETCH_AHEAD < ix.len() {
            let r = row(k + PREFETCH_AHEAD)?;
            gpuio_hal::prefetch(&pool[r * rb..(r + 1) * rb]);
        }
        let r = row(k)?;
        out.copy_from_slice(&pool[r * rb..(r + 1) * rb]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: ShapeKey = ShapeKey {
        gpu: 0,
        row_bytes_log2: 7,
        pool_log2: 32,
        rows_log2: 20,
        indices: IndexPlace::Host,
    };

    /// One `Auto` call: choose, then report what the chosen path reached; a hybrid call
    /// also reports how long each side took at the rates (rows' bytes/s) of `sides`.
    fn call(p: &Planner, rates: [f64; 4], sides: (f64, f64)) -> GatherStrategy {
        let s = p.choose(KEY);
        if s == GatherStrategy::Hybrid {
            let share = p.gpu_share(KEY);
            let secs = |part: f64, rate: f64| Duration::from_secs_f64(part / rate);
            p.balance(KEY, share, secs(share, sides.0), secs(1.0 - share, sides.1));
        }
        let i = STRATEGIES.iter().position(|x| *x == s).unwrap();
        p.record(KEY, s, 1000, 1000.0 / rates[i]);
        s
    }

    #[test]
    fn the_median_of_three_ignores_one_outlier() {
        let mut r = Recent::default();
        assert_eq!(r.estimate(), None);
        // The first call warms the path up and is not counted.
        r.push(1.0);
        assert_eq!(r.estimate(), None);
        r.push(30.0);
        assert_eq!(r.estimate(), Some(30.0));
        r.push(10.0);
        assert_eq!(r.estimate(), Some(20.0));
        r.push(31.0);
        assert_eq!(r.estimate(), Some(30.0));
        r.push(29.0);
        assert_eq!(r.estimate(), Some(29.0));
    }

    #[test]
    fn auto_explores_balances_the_hybrid_then_keeps_the_fastest() {
        let p = Planner::default();
        // [zero-copy, sorted, CPU-staged, hybrid]
        let rates = [3.0, 4.0, 23.0, 31.0];
        // Each path twice (warm-up, measured), then hybrid calls until the share stops moving.
        for path in [
            GatherStrategy::ZeroCopy,
            GatherStrategy::Sorted,
            GatherStrategy::CpuStaged,
        ] {
            assert_eq!(call(&p, rates, (0.0, 0.0)), path);
            assert_eq!(call(&p, rates, (0.0, 0.0)), path);
        }
        // The hybrid starts from the faster GPU order's rate, and uses that order.
        let first = p.gpu_share(KEY);
        assert!((first - 4.0 / 27.0).abs() < 1e-9, "{first}");
        assert_eq!(p.gpu_kernel(KEY), RowKernel::Sorted);
        for _ in 0..7 {
            assert_eq!(call(&p, rates, (3.0, 28.0)), GatherStrategy::Hybrid);
        }
        let share = p.gpu_share(KEY);
        assert!((share - 3.0 / 31.0).abs() < 0.01, "{share}");
        // Hybrid is the fastest: exploited, with a slower path re-measured now and then.
        let used: Vec<_> = (0..64).map(|_| call(&p, rates, (3.0, 28.0))).collect();
        let hybrid = used
            .iter()
            .filter(|s| **s == GatherStrategy::Hybrid)
            .count();
        assert!(hybrid >= 60, "{used:?}");
        // One slow hybrid call does not hand the choice to the CPU path.
        let slow = [3.0, 4.0, 23.0, 15.0];
        call(&p, slow, (1.0, 10.0));
        assert_eq!(call(&p, rates, (3.0, 28.0)), GatherStrategy::Hybrid);
        assert_eq!(p.plan(KEY).unwrap().strategy, GatherStrategy::Hybrid);
    }

    #[test]
    fn a_slower_hybrid_is_balanced_a_few_calls_then_left() {
        let p = Planner::default();
        let rates = [49.0, 40.0, 33.0, 47.0];
        for _ in 0..6 {
            call(&p, rates, (0.0, 0.0));
        }
        assert_eq!(p.gpu_kernel(KEY), RowKernel::Tuned);
        // The sides' rates swing between calls, so the share never settles.
        let hybrid = (0..40)
            .map(|i| call(&p, rates, (40.0, if i % 2 == 0 { 2.0 } else { 20.0 })))
            .filter(|s| *s == GatherStrategy::Hybrid)
            .count();
        assert!(hybrid <= MAX_BALANCING_CALLS as usize + 2, "{hybrid}");
        assert_eq!(p.plan(KEY).unwrap().strategy, GatherStrategy::ZeroCopy);
    }
}
