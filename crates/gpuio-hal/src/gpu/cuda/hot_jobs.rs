//! Hot gathers of several pools in one launch on a CUDA stream (`hot_jobs::HotJobsOp`'s CUDA
//! side): the jobs as the kernel's by-value argument (gather.cu's `gpuio_hot_jobs`), one grid
//! row per job, each job's first bad index in its own report word.

use super::driver::cuda_err;
use super::report::EndSignal;
use super::rows::{WaitOnDrop, event_time};
use super::stream::CudaStreamBackend;
use crate::error::Result;
use crate::gpu::backend::{RowJob, RowsDone, StreamBackend};
use crate::gpu::hot_jobs::{HOT_MAX_JOBS, Upload};
use crate::gpu::widest_piece;
use crate::kernels::GatherKernel::{self, self as G};
use cudarc::driver::PushKernelArg;
use std::mem::{offset_of, size_of};

/// The kernels by piece width slot (16, 8, 4, 1 bytes): [`widest_piece`]'s first value.
const HOT_JOBS: [GatherKernel; 4] = [
    G::GatherHotJobs16,
    G::GatherHotJobs8,
    G::GatherHotJobs4,
    G::GatherHotJobs1,
];

/// One job as the kernel reads it: gather.cu's `gpuio_hot_job`, whose size and offsets are
/// asserted there too.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct HotJobWords {
    pool: u64,
    rows: u64,
    idx: u64,
    n: u64,
    dst: u64,
    err: u64,
    hot: u64,
    hot_rows: u64,
    index: u64,
    mask: u64,
    probes: u64,
    unused: u64,
}

pub(super) const JOB_WORDS: usize = 12;
// Each job reports in a word of its own.
const _: () = assert!(HOT_MAX_JOBS <= super::report::REPORT_WORDS);
const _: () = assert!(size_of::<HotJobWords>() == 8 * JOB_WORDS);
const _: () = assert!(offset_of!(HotJobWords, pool) == 0);
const _: () = assert!(offset_of!(HotJobWords, idx) == 16);
const _: () = assert!(offset_of!(HotJobWords, dst) == 32);
const _: () = assert!(offset_of!(HotJobWords, hot) == 48);
const _: () = assert!(offset_of!(HotJobWords, index) == 64);
const _: () = assert!(offset_of!(HotJobWords, probes) == 80);

impl HotJobWords {
    /// `job` (rows of `row_bytes`) with its list at `idx` and its report word at `err`; a job
    /// without hot rows has no index (0), which the kernels read as every row from the pool.
    pub(super) fn of(job: &RowJob<'_>, row_bytes: u64, idx: u64, err: u64) -> Self {
        let hot = job.hot;
        Self {
            pool: job.pool.addr(),
            rows: job.pool.len() as u64 / row_bytes,
            idx,
            n: job.count as u64,
            dst: job.rows.addr(),
            err,
            hot: hot.map_or(0, |h| h.rows.addr()),
            hot_rows: hot.map_or(0, |h| h.hot_rows),
            index: hot.map_or(0, |h| h.index.addr()),
            mask: hot.map_or(0, |h| h.index.len as u64 / 8 - 1),
            probes: hot.map_or(1, |h| u64::from(h.probes)),
            unused: 0,
        }
    }

    /// Its words in field order (the offsets asserted above).
    pub(super) fn words(self) -> [u64; JOB_WORDS] {
        [
            self.pool,
            self.rows,
            self.idx,
            self.n,
            self.dst,
            self.err,
            self.hot,
            self.hot_rows,
            self.index,
            self.mask,
            self.probes,
            self.unused,
        ]
    }
}

impl CudaStreamBackend {
    /// Runs hot gathers of several pools in one launch, after the staged list's copy.
    ///
    /// # Safety
    /// The host pools, a host index list and the upload's source stay valid (and the pools
    /// registered with this device) until the call returns; every job holds hot rows.
    pub(crate) unsafe fn run_hot_jobs(
        &self,
        jobs: &[RowJob<'_>],
        upload: Option<Upload<'_>>,
        timed: bool,
    ) -> Result<RowsDone> {
        self.shared.bind()?;
        let row_bytes = jobs.first().map_or(1, |j| j.row_bytes) as u64;
        let addrs = jobs.iter().flat_map(|j| {
            let hot = j.hot.map_or(0, |h| h.rows.addr());
            [j.pool.addr(), j.rows.addr(), hot]
        });
        let (slot, width) = widest_piece(row_bytes, addrs);
        let func = self.shared.function(HOT_JOBS[slot])?;
        // Held for the call: the report words are this job's until it is done.
        let report = self.reports()?;
        let mut table = [0u64; JOB_WORDS * HOT_MAX_JOBS];
        let mut longest = 0u64;
        for (k, (job, words)) in jobs
            .iter()
            .zip(table.chunks_exact_mut(JOB_WORDS))
            .take(HOT_MAX_JOBS)
            .enumerate()
        {
            if job.hot.is_none() {
                continue;
            }
            longest = longest.max(job.count as u64);
            let entry = HotJobWords::of(job, row_bytes, job.idx.addr(), report.device_word(k));
            words.copy_from_slice(&entry.words());
        }
        let start = timed.then(|| self.record(true)).transpose()?;
        // Each thread keeps GPUIO_UNROLL (4) loads in flight; one grid row per job.
        let mut config = self
            .shared
            .launch_config((longest * (row_bytes / width)).div_ceil(4));
        config.grid_dim.1 = jobs.len().min(HOT_MAX_JOBS) as u32;
        // Timed by events, the driver's wait (which they need); else a kernel of at most a
        // block per multiprocessor tells its end itself.
        let signal = if !timed && longest > 0 && self.shared.block_per_sm(&config) {
            report.arm_end()
        } else {
            EndSignal::NONE
        };
        // From the copy on, work may be running: every way out waits for it before the
        // borrows of the pools and buffers end.
        let running = WaitOnDrop(Some(self));
        if let Some(u) = upload {
            // SAFETY: the staged indices are pinned host memory borrowed for the call (which
            // waits for the kernel after it before returning); `to` is a checked range of a
            // live allocation.
            unsafe { self.copy_h2d(u.from, u.to)? };
        }
        if longest > 0 {
            let mut launch = self.stream.launch_builder(&func);
            let tell = signal.words();
            launch.arg(&table).arg(&row_bytes).arg(&tell);
            // SAFETY: the arguments match gpuio_gather_hot_jobs_W(gpuio_hot_jobs, u64,
            // gpuio_end): a table of HOT_MAX_JOBS jobs, of which the grid's rows read the
            // first `jobs.len()`. Each job touches only checked pool rows (below `rows`), its
            // checked index and destination ranges, kept rows below `hot_rows`, index words
            // under the mask of the index range's power-of-two length, and its own report
            // word; the last block the stream's end word and block count. The pools stay
            // registered (caller's contract), the list was copied first, and we wait before
            // returning.
            unsafe { launch.launch(config) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_gather_hot_jobs)"))?;
        }
        let end = start.is_some().then(|| self.record(true)).transpose()?;
        // This also reports an error the kernel ran into (with no jobs launched, nothing tells
        // the end: the driver's wait, for the copy).
        running.wait(&report, signal)?;
        let device_time = event_time(start, end)?;
        let mut first = 0u64;
        let mut bad_index = None;
        for (k, job) in jobs.iter().enumerate() {
            bad_index = bad_index.or(report.word(k).map(|at| first + at));
            first += job.count as u64;
        }
        Ok(RowsDone {
            bad_index,
            device_time,
        })
    }
}
