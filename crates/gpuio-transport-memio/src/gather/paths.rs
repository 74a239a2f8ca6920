//! The paths that move a gather's rows: zero-copy and sorted (the GPU's threads, in list or
//! pool address order), CPU-staged (all cores gather into the lanes' staging, one DMA per
//! buffer), hybrid (both on one call's rows), and dedup (each distinct row once, expanded on
//! the device).

use super::indices::IndexPath;
use super::planner::ShapeKey;
use super::{GatherIndices, GatherOptions, GatherReport};
use crate::pipeline::{ChunkLen, Schedule};
use crate::{MemIo, MemIoError, Result};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::workers::run_workers;
use gpuio_hal::{
    DeviceBuffer, Gpu, HalError, HostBuffer, HotRows, RESIDENT_MAX_BYTES, RESIDENT_MAX_ROWS,
    ResidentJob, ResidentRows, RowKernel,
};
use rayon::prelude::*;
use std::ops::Range;
use std::sync::Mutex;
use std::time::Instant;

/// How a hybrid call splits its rows: the share the caller fixed, or else the one `Auto`
/// balances for the shape; and the hot rows its GPU side reads, if any.
pub(super) struct HybridSplit<'h> {
    pub(super) key: ShapeKey,
    pub(super) fixed: Option<f64>,
    pub(super) hot: Option<&'h HotRows>,
}

/// How the GPU's threads move rows: a row kernel (in list or pool address order), or the
/// gather through hot rows.
#[derive(Clone, Copy)]
pub(super) enum GpuRows<'h> {
    Kernel(RowKernel),
    Hot(&'h HotRows),
}

impl GpuRows<'_> {
    /// The row kernel whose index path the rows' indices take (the hot gather reads its list
    /// as the tuned kernel does).
    fn kernel(self) -> RowKernel {
        match self {
            Self::Kernel(k) => k,
            Self::Hot(_) => RowKernel::Tuned,
        }
    }
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
    /// The device's resident row server, where the engine keeps one and a call of `rows` rows
    /// of `row_bytes` fits it (made on its first call).
    pub(super) fn resident_for(
        &self,
        gpu: &Gpu,
        rows: usize,
        row_bytes: usize,
    ) -> Result<Option<&ResidentRows>> {
        let Some(linger) = self.config.resident_linger else {
            return Ok(None);
        };
        if rows > RESIDENT_MAX_ROWS || rows.saturating_mul(row_bytes) > RESIDENT_MAX_BYTES {
            return Ok(None);
        }
        let slot = &self.device(gpu)?.resident;
        if let Some(server) = slot.get() {
            return Ok(Some(server));
        }
        // Two first calls at once may each make one: one is kept.
        let server = gpu.resident_rows(linger)?;
        Ok(Some(slot.get_or_init(|| server)))
    }

    /// The GPU's threads load the rows, with `kernel` `Tuned` (in list order) or `Sorted`,
    /// or through hot rows: a small call with a host list through the resident server where
    /// the engine keeps one.
    pub(super) fn gather_zero_copy(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: GatherIndices<'_>,
        dst: &DeviceBuffer,
        dst_offset: usize,
        rows: GpuRows<'_>,
    ) -> Result<()> {
        let n = indices.len();
        let hot = match rows {
            GpuRows::Kernel(RowKernel::Tuned) => Some(None),
            GpuRows::Hot(h) => Some(Some(h)),
            GpuRows::Kernel(_) => None,
        };
        if let (GatherIndices::Host(list), Some(hot)) = (indices, hot)
            && let Some(server) = self.resident_for(dst.gpu(), n, row_bytes)?
        {
            let job = ResidentJob {
                pool,
                hot,
                indices: list,
                dst,
                dst_offset,
            };
            return Ok(server.gather(&[job], row_bytes)?);
        }
        let path = IndexPath::of(rows.kernel(), row_bytes);
        self.with_gpu_indices(dst.gpu(), indices, n, path, |s, idx| {
            match rows {
                GpuRows::Kernel(k) => s.gather(pool, row_bytes, idx, n, dst, dst_offset, k)?,
                GpuRows::Hot(h) => s.gather_hot(pool, h, idx, n, dst, dst_offset)?,
            }
            Ok(())
        })
    }

    /// The GPU's share of the rows (first) by its threads, the rest by the CPU while the
    /// kernel runs; the share follows the rates both sides reach together.
    pub(super) fn gather_hybrid(
        &self,
        pool: &HostBuffer,
        row_bytes: usize,
        indices: GatherIndices<'_>,
        dst: &DeviceBuffer,
        dst_offset: usize,
        HybridSplit { key, fixed, hot }: HybridSplit<'_>,
    ) -> Result<()> {
        let share = fixed.unwrap_or_else(|| self.planner.gpu_share(key));
        let rows = hot.map_or_else(
            || GpuRows::Kernel(self.planner.gpu_kernel(key)),
            GpuRows::Hot,
        );
        let path = IndexPath::of(rows.kernel(), row_bytes);
        let n = indices.len();
        let split = ((n as f64 * share).round() as usize).min(n);
        // A caller's share of 0 or 1 leaves one side alone.
        if split == 0 {
            let list = self.host_indices(indices, 0..n)?;
            return self.gather_staged(pool, row_bytes, &list, dst, dst_offset);
        }
        if split == n {
            return self.gather_zero_copy(pool, row_bytes, indices, dst, dst_offset, rows);
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
                Ok(match rows {
                    GpuRows::Kernel(k) => {
                        s.gather_timed(pool, row_bytes, idx, split, dst, dst_offset, k)?
                    }
                    GpuRows::Hot(h) => s.gather_hot_timed(pool, h, idx, split, dst, dst_offset)?,
                })
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

    pub(super) fn gather_staged(
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
        let res = run_workers(self.gather_pool()?, &mut taken, |lane, abort| {
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
    pub(super) fn gather_dedup(
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
