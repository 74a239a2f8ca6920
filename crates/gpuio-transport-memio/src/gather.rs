//! Row gathers and scatters between host pools (DRAM, CXL) and GPU memory: rows of `row_bytes`
//! picked by an index list, the access pattern of embedding tables, sparse-attention KV blocks
//! and graph features.
//!
//! Two ways to move the rows, and neither wins everywhere (DESIGN.md §6):
//! - [`GatherStrategy::ZeroCopy`]: the GPU's own threads load the rows from pinned host memory
//!   over PCIe (`kernels/gather.cu`). Fast while the device's address translation keeps up —
//!   large rows, or pools small enough that their pages stay cached in its TLBs.
//! - [`GatherStrategy::CpuStaged`]: all cores gather rows into pinned staging buffers (with
//!   prefetching a few rows ahead) and each full buffer goes over as one DMA, overlapped with
//!   the next buffer's gather. The CPU pays no per-page device translation, so this wins for
//!   small rows from large pools.
//!
//! [`GatherStrategy::Auto`] learns which is faster per (device, row size, pool size) class from
//! the calls themselves: it tries both, keeps the faster, and re-checks the other now and then.

use crate::pipeline::ChunkLen;
use crate::{MemIo, MemIoError, Result, lock};
use gpuio_hal::{
    DeviceBuffer, Gpu, HalError, HostAllocOptions, HostBuffer, RowIndices, RowKernel, Stream,
};
use rayon::prelude::*;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;
use std::time::Instant;

/// How a gather moves its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
pub enum GatherStrategy {
    /// Pick per call from what earlier calls of the same shape measured.
    #[default]
    Auto,
    /// GPU threads load the rows from pinned host memory (the pool must be pinned).
    ZeroCopy,
    /// CPU threads gather into pinned staging; one DMA per staging buffer.
    CpuStaged,
    /// Both at once on one call's rows: the GPU's threads take a share in proportion to the
    /// two paths' measured rates, the CPU the rest. Where the device's address translation
    /// limits zero-copy and the cores limit staging, neither limit is the link's.
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

/// Shape class of a gather, for the strategy choice: device, log2 row size, log2 pool size.
type ShapeKey = (u32, u32, u32);

/// Measured rates per shape class.
#[derive(Debug, Default)]
pub(crate) struct Planner {
    shapes: Mutex<HashMap<ShapeKey, Shape>>,
}

#[derive(Debug, Default)]
struct Shape {
    calls: u64,
    /// Latest bytes/s of [zero-copy, CPU-staged, hybrid].
    rate: [Option<f64>; 3],
    /// The path being exploited.
    current: usize,
}

/// How much faster another path must measure before the choice moves to it.
const SWITCH_MARGIN: f64 = 1.1;

const STRATEGIES: [GatherStrategy; 3] = [
    GatherStrategy::ZeroCopy,
    GatherStrategy::CpuStaged,
    GatherStrategy::Hybrid,
];

/// Re-measure the slower path once every this many calls of a shape.
const RECHECK_EVERY: u64 = 32;

impl Planner {
    /// The path for the next call of this shape: each one once, then the fastest, with a
    /// slower one re-measured every [`RECHECK_EVERY`] calls.
    fn choose(&self, key: ShapeKey) -> GatherStrategy {
        let mut shapes = lock(&self.shapes);
        let s = shapes.entry(key).or_default();
        s.calls += 1;
        if let Some(i) = s.rate.iter().position(Option::is_none) {
            return STRATEGIES[i];
        }
        let rate = |i: usize| s.rate[i].unwrap_or(0.0);
        let mut best = (0..3)
            .max_by(|&a, &b| rate(a).total_cmp(&rate(b)))
            .unwrap_or(0);
        // Stay with the current path unless another is clearly faster: noise is not a reason
        // to switch.
        if rate(s.current) * SWITCH_MARGIN >= rate(best) {
            best = s.current;
        }
        s.current = best;
        if s.calls % RECHECK_EVERY == 0 {
            let other = (best + 1 + (s.calls / RECHECK_EVERY) as usize % 2) % 3;
            STRATEGIES[other]
        } else {
            STRATEGIES[best]
        }
    }

    /// The share of rows a hybrid call gives the GPU: its part of the two paths' total rate.
    fn gpu_share(&self, key: ShapeKey) -> f64 {
        match lock(&self.shapes).get(&key).map(|s| (s.rate[0], s.rate[1])) {
            Some((Some(z), Some(c))) if z + c > 0.0 => z / (z + c),
            _ => 0.5,
        }
    }

    fn record(&self, key: ShapeKey, strategy: GatherStrategy, bytes: usize, secs: f64) {
        let Some(i) = STRATEGIES.iter().position(|s| *s == strategy) else {
            return;
        };
        if let Some(s) = lock(&self.shapes).get_mut(&key) {
            s.rate[i] = Some(bytes as f64 / secs.max(1e-9));
        }
    }
}

/// Pinned host memory for an index list, which the kernels read over PCIe as they go.
/// (Copying it to the device first, even in stream order with no wait between, measured
/// slower for small rows on the H200: the copy runs before the kernel instead of alongside.)
pub(crate) struct IndexStage {
    host: HostBuffer,
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
    /// pool row `indices[i]`. Rows are opaque bytes of any size and alignment. The pool may be
    /// pinned (both paths open) or not (CPU-staged only). An index past the pool's last row
    /// fails the call with [`HalError::IndexOutOfRange`]; the destination is then partly
    /// written.
    pub fn gather(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
        opts: &GatherOptions,
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
        self.device(dst.gpu())?;
        if indices.is_empty() {
            return Ok(GatherReport {
                strategy: self.resolve(opts.strategy, pool, dst.gpu(), row_bytes),
                rows: 0,
                rows_fetched: 0,
            });
        }
        if opts.dedup {
            return self.gather_dedup(pool, row_bytes, indices, dst, dst_offset, opts.strategy);
        }
        let strategy = self.resolve(opts.strategy, pool, dst.gpu(), row_bytes);
        let key = self.shape(pool, dst.gpu(), row_bytes);
        let t = Instant::now();
        match strategy {
            GatherStrategy::ZeroCopy => {
                self.gather_zero_copy(pool, row_bytes, indices, dst, dst_offset)?
            }
            GatherStrategy::Hybrid => {
                let share = self.planner.gpu_share(key);
                self.gather_hybrid(pool, row_bytes, indices, dst, dst_offset, share)?
            }
            _ => self.gather_staged(pool, row_bytes, indices, dst, dst_offset)?,
        }
        self.planner
            .record(key, strategy, out_len, t.elapsed().as_secs_f64());
        self.count_h2d(out_len);
        Ok(GatherReport {
            strategy,
            rows: indices.len(),
            rows_fetched: indices.len(),
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
        self.with_indices(&gpu, indices, |stream, idx| {
            Ok(stream.scatter(src, src_offset, row_bytes, idx, indices.len(), pool)?)
        })?;
        self.count_d2h(indices.len().saturating_mul(row_bytes));
        Ok(())
    }

    fn shape(&self, pool: &HostBuffer, gpu: &Gpu, row_bytes: usize) -> ShapeKey {
        (gpu.ordinal(), log2(row_bytes), log2(pool.len()))
    }

    fn resolve(
        &self,
        asked: GatherStrategy,
        pool: &HostBuffer,
        gpu: &Gpu,
        row_bytes: usize,
    ) -> GatherStrategy {
        if !pool.is_pinned() {
            // The device cannot reach pageable memory; only the CPU can gather it.
            return GatherStrategy::CpuStaged;
        }
        match asked {
            GatherStrategy::Auto => self.planner.choose(self.shape(pool, gpu, row_bytes)),
            other => other,
        }
    }

    /// Stages `indices` in pinned memory the device reads and runs `f` with a stream and
    /// them.
    fn with_indices<T>(
        &self,
        gpu: &Gpu,
        indices: &[u64],
        f: impl FnOnce(&Stream, RowIndices<'_>) -> Result<T>,
    ) -> Result<T> {
        let dev = self.device(gpu)?;
        let bytes = indices.len() * 8;
        let pooled = {
            let mut stages = lock(&dev.index_stages);
            let at = stages.iter().position(|s| s.host.len() >= bytes);
            at.map(|i| stages.swap_remove(i))
        };
        let mut stage = match pooled {
            Some(s) => s,
            None => {
                let cap = bytes.next_power_of_two().max(64 << 10);
                let opts = HostAllocOptions {
                    numa: gpu.info().numa_node,
                    ..HostAllocOptions::default()
                };
                IndexStage {
                    host: HostBuffer::alloc_pinned(cap, &opts, gpu)?,
                }
            }
        };
        let staged = &mut stage.host[..bytes];
        let encode = |(out, ix): (&mut [u8], &[u64])| {
            for (o, i) in out.chunks_exact_mut(8).zip(ix) {
                o.copy_from_slice(&i.to_le_bytes());
            }
        };
        // Up to 64 Ki indices are encoded on this core: splitting them over the pool measured
        // 2% slower for 4 KiB rows from a 256 MiB pool (waking the pool costs more).
        const PER_TASK: usize = 64 << 10;
        if indices.len() > PER_TASK {
            self.pool.install(|| {
                staged
                    .par_chunks_mut(PER_TASK * 8)
                    .zip(indices.par_chunks(PER_TASK))
                    .for_each(encode)
            });
        } else {
            encode((staged, indices));
        }
        let out = self.with_stream(gpu, |s| f(s, RowIndices::Pinned(&stage.host)));
        lock(&dev.index_stages).push(stage);
        out
    }

    fn gather_zero_copy(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        self.with_indices(dst.gpu(), indices, |s, idx| {
            let n = indices.len();
            Ok(s.gather(pool, row_bytes, idx, n, dst, dst_offset, RowKernel::Tuned)?)
        })
    }

    /// The first `share` of the rows by GPU threads, the rest by the CPU while the kernel
    /// runs.
    fn gather_hybrid(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
        share: f64,
    ) -> Result<()> {
        let split = ((indices.len() as f64 * share).round() as usize).min(indices.len());
        let (gpu_rows, cpu_rows) = indices.split_at(split);
        let cpu_offset = dst_offset + split * row_bytes;
        let cpu_done = self.with_indices(dst.gpu(), gpu_rows, |s, idx| {
            Ok(
                s.gather_while(pool, row_bytes, idx, split, dst, dst_offset, || {
                    self.gather_staged(pool, row_bytes, cpu_rows, dst, cpu_offset)
                })?,
            )
        })?;
        // The CPU's positions count from the split.
        cpu_done.map_err(|e| match e {
            MemIoError::Hal(HalError::IndexOutOfRange { position, rows }) => {
                bad_index(position as usize + split, rows as usize)
            }
            other => other,
        })
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
        // Several chunks per lane, so each lane's gathers overlap its earlier chunks' DMA;
        // chunks of at least 256 KiB keep the copy engine efficient.
        let max = self.config.chunk_size;
        let chunk = (total / (threads * 4)).clamp((256 << 10).min(max), max);
        let chunk_rows = (chunk / row_bytes).max(1);
        let chunks = indices.len().div_ceil(chunk_rows);
        let lanes_wanted = chunks.min(threads);
        let lanes = &self.device(dst.gpu())?.lanes;
        if chunk_rows * row_bytes > self.config.chunk_size {
            // A row larger than a staging buffer: copy it on its own.
            return self.gather_rows_one_by_one(pool, row_bytes, indices, dst, dst_offset);
        }
        let mut taken = lanes.take(lanes_wanted)?;
        let next_chunk = Mutex::new(0..chunks);
        let data = pool.as_slice();
        let res = self.run_lanes_on(self.gather_pool()?, &mut taken, |lane, abort| {
            let next = || {
                let c = lock(&next_chunk).next()?;
                let first = c * chunk_rows;
                let range = first..(first + chunk_rows).min(indices.len());
                Some((
                    first * row_bytes,
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
        strategy: GatherStrategy,
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
            strategy,
            dedup: false,
        };
        let report = self.gather(pool, row_bytes, &unique, &scratch, 0, &inner)?;
        self.with_indices(&gpu, &inverse, |s, idx| {
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
