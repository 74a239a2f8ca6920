//! Row gathers and scatters on a CUDA stream (`StreamBackend::rows`): choosing the kernel and
//! piece width, one launch per piece of the index list (after its indices are staged), the
//! counting sort of a sorted gather (count, two-level scan, place, then the ordered move, dealt
//! out by pool line where rows allow), and the kernels' report of the first bad index (in
//! the stream's report words: `report.rs`). Also the sorting scratch a stream keeps between
//! calls. Driver
//! calls go through [`driver`].

use super::device::Shared;
use super::driver::{self, cuda_err};
use super::report::{EndSignal, ReportWords};
use super::stream::CudaStreamBackend;
use crate::error::Result;
use crate::gpu::RowKernel;
use crate::gpu::backend::{EventBackend, RowHooks, RowJob, RowMem, RowsDone, StreamBackend};
use crate::gpu::widest_piece;
use crate::kernels::GatherKernel::{self, self as G};
use crate::sync::MutexExt;
use cudarc::driver::{LaunchConfig, PushKernelArg, sys};
use std::time::Duration;

/// The row kernels by piece width slot (16, 8, 4, 1 bytes): [`widest_piece`]'s first value.
const GATHER: [GatherKernel; 4] = [G::Gather16, G::Gather8, G::Gather4, G::Gather1];
const SCATTER: [GatherKernel; 4] = [G::Scatter16, G::Scatter8, G::Scatter4, G::Scatter1];
const ORDERED: [GatherKernel; 4] = [
    G::GatherOrdered16,
    G::GatherOrdered8,
    G::GatherOrdered4,
    G::GatherOrdered1,
];
const HOT: [GatherKernel; 4] = [G::GatherHot16, G::GatherHot8, G::GatherHot4, G::GatherHot1];

/// How a sorted gather orders its index list: a counting sort over buckets of `2^shift`
/// pool bytes. Buckets of at least 128 B (a read request's span: a finer order buys
/// nothing), about two per row, at most 2 Mi of them (8 MiB of counts).
struct Ordering {
    shift: u32,
    buckets: u32,
    /// Blocks of `gpuio_order_scan_blocks` (4096 counts each).
    scan_blocks: u32,
    count: usize,
    /// Scratch bytes: pairs (16 B per row), ranks (4 B per row), counts, block sums.
    bytes: usize,
}

/// Line slots per row for an ordered gather dealt out by pool line (gather.cu's
/// `gpuio_rows_by_line`): how many 128-byte lines a row of `row_bytes` can touch in a pool at
/// `pool`, or 0 to deal the pieces out densely, where that would idle more than half the
/// lanes (short rows, rows in narrow pieces: measured only for 16-byte pieces).
fn line_slots(pool: u64, row_bytes: u64, width: u64) -> u32 {
    if width != 16 || row_bytes == 0 {
        return 0;
    }
    // Rows start at pool + k * row_bytes: 128-byte offsets step by gcd(row_bytes, 128) from
    // the pool's own, so the furthest a row starts into a line is 128 - step + the pool's
    // offset within a step.
    let step = 1u64 << row_bytes.trailing_zeros().min(7);
    let furthest = 128 - step + (pool % 128) % step;
    let lines = (row_bytes + furthest).div_ceil(128);
    match u32::try_from(lines) {
        Ok(l) if lines * 128 <= 2 * row_bytes => l,
        _ => 0,
    }
}

/// Where an [`Ordering`]'s arrays lie in the sorting scratch.
struct OrderAt {
    pairs: u64,
    rank: u64,
    counts: u64,
    sums: u64,
}

impl Ordering {
    fn new(job: &RowJob<'_>) -> Self {
        const MAX_BUCKETS: u64 = 1 << 21;
        let pool = job.pool.len() as u64;
        let target = (2 * job.count as u64).clamp(1, MAX_BUCKETS);
        let mut shift = 7;
        while pool >> shift > target {
            shift += 1;
        }
        let buckets = pool.div_ceil(1 << shift).max(1);
        let scan_blocks = buckets.div_ceil(4096);
        Self {
            shift,
            buckets: buckets as u32,
            scan_blocks: scan_blocks as u32,
            count: job.count,
            bytes: job.count * 20 + (buckets + scan_blocks) as usize * 4,
        }
    }

    fn layout(&self, base: u64) -> OrderAt {
        let n = self.count as u64;
        let counts = base + n * 20;
        OrderAt {
            pairs: base,
            rank: base + n * 16,
            counts,
            sums: counts + u64::from(self.buckets) * 4,
        }
    }
}

/// A stream's sorting scratch: grown to the largest sorted gather so far, never shrunk (a
/// free synchronizes the device).
#[derive(Default)]
pub(super) struct OrderScratch {
    mem: Option<(sys::CUdeviceptr, usize)>,
}

impl OrderScratch {
    /// At least `bytes` of scratch (its device address), reallocated if smaller.
    fn reserve(&mut self, shared: &Shared, bytes: usize) -> Result<u64> {
        if let Some((ptr, len)) = self.mem
            && len >= bytes
        {
            return Ok(ptr);
        }
        self.release(shared);
        let len = bytes.next_power_of_two();
        // A fresh allocation owned by this scratch, freed in `release`.
        let ptr = driver::mem_alloc(len)?;
        self.mem = Some((ptr, len));
        Ok(ptr)
    }

    /// Frees the scratch (no work may use it any more: every user waited for its kernels).
    pub(super) fn release(&mut self, shared: &Shared) {
        if let Some((ptr, _)) = self.mem.take() {
            // A free waits for the device: a resident kernel would hold it for its linger.
            let _waiting = super::resident::send_home(shared.device);
            let freed = shared.bind().and_then(|()| {
                // SAFETY: allocated by cuMemAlloc in this context, freed once; the jobs that
                // used it waited for their kernels before returning.
                unsafe { driver::mem_free(ptr) }
            });
            if let Err(e) = freed {
                tracing::error!(error = %e, "freeing a stream's sorting scratch failed");
            }
        }
    }
}

/// Waits for a stream's work on every path out of a scope (errors and panics included)
/// unless [`WaitOnDrop::wait`] already did.
pub(super) struct WaitOnDrop<'a>(pub(super) Option<&'a CudaStreamBackend>);

impl WaitOnDrop<'_> {
    /// Waits now, reporting an error the work ran into: through the end word where the last
    /// kernel was launched with `end` ([`ReportWords::wait_end`]), else the driver's wait.
    pub(super) fn wait(mut self, reports: &ReportWords, end: EndSignal) -> Result<()> {
        match self.0.take() {
            Some(s) if end.armed() => reports.wait_end(s, end),
            Some(s) => s.synchronize(),
            None => Ok(()),
        }
    }
}

impl Drop for WaitOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.0.map(|s| s.synchronize()) {
            tracing::error!(error = %e, "waiting for a row kernel failed");
        }
    }
}

/// The device's time between two timing events, where both were recorded.
pub(super) fn event_time(
    start: Option<Box<dyn EventBackend>>,
    end: Option<Box<dyn EventBackend>>,
) -> Result<Option<Duration>> {
    match (start, end) {
        (Some(start), Some(end)) => elapsed(start.as_ref(), end.as_ref()).map(Some),
        _ => Ok(None),
    }
}

/// The device's time from timing event `from` to timing event `to`.
pub(super) fn elapsed(from: &dyn EventBackend, to: &dyn EventBackend) -> Result<Duration> {
    let ms = to.elapsed_ms_since(from)?;
    Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
}

impl CudaStreamBackend {
    /// Runs a row job: the CUDA side of `rows::RowsOp`.
    ///
    /// # Safety
    /// A host pool (and a host index list) stays valid,
    /// registered with this device, and (for a scatter's pool) untouched by anything else
    /// until the call returns.
    pub(crate) unsafe fn run_rows(&self, job: RowJob<'_>, hooks: RowHooks<'_>) -> Result<RowsDone> {
        self.shared.bind()?;
        let pool = job.pool.addr();
        let (rows_addr, idx) = (job.rows.addr(), job.idx.addr());
        let rb = job.row_bytes as u64;
        let hot_addr = job.hot.map_or(0, |h| h.rows.addr());
        let (slot, width) = widest_piece(rb, [pool, rows_addr, hot_addr]);
        let func = &self.shared.function(match job.kernel {
            _ if job.hot.is_some() => HOT[slot],
            RowKernel::Naive => G::GatherNaive,
            RowKernel::Sorted => ORDERED[slot],
            RowKernel::Tuned if job.scatter => SCATTER[slot],
            RowKernel::Tuned => GATHER[slot],
        })?;
        // A sorted gather's rows are dealt out by pool line where that wastes at most half
        // the lanes (see gather.cu's gpuio_rows_by_line).
        let lines = match job.kernel {
            RowKernel::Sorted => line_slots(pool, rb, width),
            _ => 0,
        };
        let config = |rows: u64| {
            if job.kernel == RowKernel::Naive {
                self.shared.launch_config(rows * 32)
            } else if lines > 0 {
                // GPUIO_LINE_UNROLL (8) loads in flight per thread.
                let items = rows * u64::from(lines) * (128 / width);
                self.shared.launch_config(items.div_ceil(8))
            } else {
                // Each thread keeps GPUIO_UNROLL (4) loads in flight.
                self.shared.launch_config((rows * (rb / width)).div_ceil(4))
            }
        };
        let launches = job.pieces.len().clamp(1, crate::gpu::rows::MAX_PIECES);
        // One report word per launch of the row kernel: the first out-of-range index
        // position within its piece (a sorted job's single launch reports positions in the
        // whole list).
        let ordering = (job.kernel == RowKernel::Sorted).then(|| Ordering::new(&job));
        let words = if ordering.is_some() { 1 } else { launches };
        // Held for the call: the report words are this job's until it is done.
        let report = self.reports()?;
        // Held for the call: the sorting scratch is this job's until it is done.
        let mut order_scratch = self.order.lock_unpoisoned();
        let order = match &ordering {
            Some(o) => Some(o.layout(order_scratch.reserve(&self.shared, o.bytes)?)),
            None => None,
        };
        let pool_rows = (job.pool.len() as u64) / rb;
        if let (Some(o), Some(at)) = (&ordering, &order) {
            // SAFETY: the bucket counts lie inside the reserved sorting scratch.
            unsafe { driver::memset_d32_async(at.counts, 0, o.buckets as usize, self.raw())? };
        }
        let RowHooks { mut stage, timed } = hooks;
        // Events bracket the launches when the device's time is asked for (the driver's wait
        // then, which the events need); else a last kernel of at most a block per
        // multiprocessor tells the end itself.
        let start = timed.then(|| self.record(true)).transpose()?;
        let last_rows = match &ordering {
            Some(_) => job.count,
            None => job.count - job.pieces.get(launches - 1).map_or(0, |p| p.start),
        };
        let signal = if !timed && self.shared.block_per_sm(&config(last_rows as u64)) {
            report.arm_end()
        } else {
            EndSignal::NONE
        };
        // From the first launch on, kernels may be running: every way out (an error, a panic
        // in `stage`) waits for them before the borrows of the pool and buffers end.
        let running = WaitOnDrop(Some(self));
        for (k, piece) in job.pieces.iter().take(launches).enumerate() {
            if let Some(stage) = stage.as_mut() {
                stage(k);
            }
            // The last launch takes any pieces beyond MAX_PIECES (never made by rows.rs).
            let end = if k + 1 == launches {
                job.count
            } else {
                piece.end
            };
            let (start_row, n) = (piece.start as u64, (end - piece.start) as u64);
            if let (Some(src), RowMem::Device(dst)) = (job.idx_upload, job.idx) {
                let part = dst.part(piece.start * 8, (end - piece.start) * 8)?;
                // SAFETY: the staged indices are pinned host memory borrowed for the call
                // (which waits for its kernels before returning), this piece's part written by
                // `stage` already; `part` is a checked part of a live device range.
                unsafe { self.copy_h2d(src.wrapping_add(piece.start * 8), part)? };
            }
            let idx = idx + start_row * 8;
            if let (Some(o), Some(at)) = (&ordering, &order) {
                // A sorted job counts each piece's buckets as it arrives; the rows move once
                // the whole list is ordered, after the loop.
                let rank = at.rank + start_row * 4;
                let function = self.shared.function(G::OrderCount)?;
                let mut launch = self.stream.launch_builder(&function);
                launch.arg(&idx).arg(&n).arg(&pool_rows).arg(&rb);
                launch
                    .arg(&o.shift)
                    .arg(&o.buckets)
                    .arg(&at.counts)
                    .arg(&rank);
                // SAFETY: the arguments match gpuio_order_count(const u64*, u64, u64, u64,
                // u32, u32, u32*, u32*); it reads this piece of the checked device index
                // range and writes its ranks and the bucket counts, all inside the sorting
                // scratch reserved (and locked) for this call, which waits for its kernels
                // before returning.
                unsafe { launch.launch(self.shared.launch_config(n)) }
                    .map_err(cuda_err("cuLaunchKernel(gpuio_order_count)"))?;
                continue;
            }
            let dense = rows_addr + start_row * rb;
            let report = report.device_word(k);
            let tell = if k + 1 == launches {
                signal
            } else {
                EndSignal::NONE
            }
            .words();
            // Gathers take (pool, .., dense); scatters (dense source, .., pool).
            let (first, last) = if job.scatter {
                (dense, pool)
            } else {
                (pool, dense)
            };
            let mut launch = self.stream.launch_builder(func);
            launch
                .arg(&first)
                .arg(&pool_rows)
                .arg(&rb)
                .arg(&idx)
                .arg(&n)
                .arg(&last)
                .arg(&report)
                .arg(&tell);
            // A gather through hot rows also reads the kept rows and their index.
            let hot = job
                .hot
                .map(|h| (h.hot_rows, h.index.addr(), h.index.len as u64 / 8));
            let (hot_rows, index, mask) = hot.map_or((0, 0, 0), |(r, i, w)| (r, i, w - 1));
            let probes = job.hot.map_or(0, |h| h.probes);
            if job.hot.is_some() {
                launch.arg(&hot_addr).arg(&hot_rows).arg(&index);
                launch.arg(&mask).arg(&probes);
            }
            // A hot gather reads only kept rows below `hot_rows` and index words under the
            // mask of the index range's power-of-two length: both checked ranges.
            // SAFETY: the arguments match every row kernel's (pool, rows, row_bytes, idx, n,
            // dense, err, end) signature (a hot gather's adds hot, hot_rows, index, mask,
            // probes). It touches only checked pool rows, this piece's part of the checked idx
            // and dense ranges, its report word, and (the last launch) the stream's end word
            // and block count; the pool stays registered (caller's contract), the piece's
            // indices were staged first, and we wait for it before returning.
            unsafe { launch.launch(config(n)) }
                .map_err(cuda_err("cuLaunchKernel(gpuio row kernel)"))?;
        }
        if let (Some(o), Some(at)) = (&ordering, &order) {
            let count = job.count as u64;
            let block = |blocks: u32| LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            };
            let function = self.shared.function(G::OrderScanBlocks)?;
            let mut launch = self.stream.launch_builder(&function);
            launch.arg(&at.counts).arg(&o.buckets).arg(&at.sums);
            // SAFETY: matches gpuio_order_scan_blocks(u32*, u32, u32*); one block per 4096
            // counts, all inside the reserved scratch, as are the `scan_blocks` sums.
            unsafe { launch.launch(block(o.scan_blocks)) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_order_scan_blocks)"))?;
            let function = self.shared.function(G::OrderScanSums)?;
            let mut launch = self.stream.launch_builder(&function);
            launch.arg(&at.sums).arg(&o.scan_blocks);
            // SAFETY: matches gpuio_order_scan_sums(u32*, u32): the sums written just before.
            unsafe { launch.launch(block(1)) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_order_scan_sums)"))?;
            let function = self.shared.function(G::OrderPlace)?;
            let mut launch = self.stream.launch_builder(&function);
            launch.arg(&idx).arg(&count).arg(&pool_rows).arg(&rb);
            launch
                .arg(&o.shift)
                .arg(&o.buckets)
                .arg(&at.counts)
                .arg(&at.sums);
            launch.arg(&at.rank).arg(&at.pairs);
            // SAFETY: matches gpuio_order_place(const u64*, u64, u64, u64, u32, u32, const
            // u32*, const u32*, const u32*, ulonglong2*): it reads the whole checked index
            // range and the scratch, and writes each of the `count` pairs once (a bucket's
            // start plus a rank below its count).
            unsafe { launch.launch(self.shared.launch_config(count)) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_order_place)"))?;
            let mut launch = self.stream.launch_builder(func);
            launch.arg(&pool).arg(&pool_rows).arg(&rb).arg(&at.pairs);
            let report = report.device_word(0);
            let tell = signal.words();
            launch.arg(&count).arg(&rows_addr).arg(&report).arg(&tell);
            launch.arg(&lines);
            // SAFETY: matches gpuio_gather_ordered_W(pool, rows, row_bytes, pairs, n, dense,
            // err, end, lines): it reads the pairs just placed, pool rows below `pool_rows`
            // (checked per pair; by line it reads only the pieces inside the row), writes each
            // pair's position of the checked dense range, report word 0 and the stream's end
            // word and block count; the pool stays registered until this call returns, and we
            // wait for it first.
            unsafe { launch.launch(config(count)) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_gather_ordered)"))?;
        }
        let end = start.is_some().then(|| self.record(true)).transpose()?;
        // This also reports an error a kernel ran into.
        running.wait(&report, signal)?;
        drop(order_scratch);
        let device_time = event_time(start, end)?;
        let bad_index = if ordering.is_some() {
            report.word(0)
        } else {
            (0..words).find_map(|k| {
                let start = job.pieces.get(k).map_or(0, |p| p.start as u64);
                report.word(k).map(|at| start + at)
            })
        };
        Ok(RowsDone {
            bad_index,
            device_time,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::line_slots;

    #[test]
    fn line_slots_cover_every_line_a_row_can_touch() {
        // 656-byte rows start 16-byte steps into a line: up to 112 bytes in, 6 lines.
        assert_eq!(line_slots(0, 656, 16), 6);
        // 64-byte rows of an aligned pool never cross a line; 160-byte rows touch two.
        assert_eq!(line_slots(4096, 64, 16), 1);
        assert_eq!(line_slots(0, 160, 16), 2);
        // A pool 16 bytes into a line shifts 64-byte rows across line boundaries.
        assert_eq!(
            line_slots(16, 64, 16),
            0,
            "2 lines for 64 bytes idles over half"
        );
        assert_eq!(line_slots(16, 4096, 16), 33);
        assert_eq!(line_slots(0, 4096, 16), 32);
        // Short rows and narrow pieces keep the dense order.
        assert_eq!(line_slots(0, 16, 16), 0);
        assert_eq!(line_slots(0, 656, 8), 0);
        assert_eq!(line_slots(0, 0, 16), 0);
        // Brute force: the slots reach the last byte of every row of a few pools.
        for pool in [0u64, 16, 48, 112] {
            for rb in (16..2048).step_by(16) {
                let lines = u64::from(line_slots(pool, rb, 16));
                if lines == 0 {
                    continue;
                }
                for k in 0..256 {
                    let start = pool + k * rb;
                    assert!(
                        start + rb <= (start & !127) + lines * 128,
                        "{pool} {rb} {k}"
                    );
                }
            }
        }
    }
}
