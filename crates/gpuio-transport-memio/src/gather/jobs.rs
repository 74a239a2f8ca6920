//! Gathers through hot rows of several pools in one call ([`MemIo::gather_hot_jobs`]): a model
//! that reads two Engram tables per step knows both tables' ids at once. Each path runs every
//! job together — the GPU's as one launch (one wait, where two calls wait twice), the CPU's on
//! the gather threads, a hybrid's GPU shares in one launch while the CPU takes the rest of
//! every list — and `Auto` learns among them for such calls apart from one-pool calls.

use super::indices::IndexPath;
use super::{GatherOptions, GatherReport, GatherStrategy, IndexPlace};
use crate::{MemIo, MemIoError, Result};
use gpuio_hal::gpu::check_disjoint;
use gpuio_hal::{
    DeviceBuffer, HOT_MAX_JOBS, HalError, HostBuffer, HotGather, HotRows, ResidentJob, RowKernel,
};
use std::time::{Duration, Instant};

/// One pool's part of [`MemIo::gather_hot_jobs`]: output row `i` (at `dst_offset + i *
/// row_bytes` of `dst`) is pool row `indices[i]`, read from its copy where `hot` keeps it.
#[derive(Debug, Clone, Copy)]
pub struct HotLookup<'a> {
    /// The pinned pool.
    pub pool: &'a HostBuffer,
    /// Copies of some of its rows on the destination's GPU.
    pub hot: &'a HotRows,
    /// The rows to gather.
    pub indices: &'a [u64],
    /// Where they go.
    pub dst: &'a DeviceBuffer,
    /// Byte offset in `dst`.
    pub dst_offset: usize,
}

impl MemIo {
    /// Runs every lookup of `jobs` as [`gather_hot`](Self::gather_hot) would, together: at
    /// most [`HOT_MAX_JOBS`], rows of one size, destinations on one GPU. Returns one report
    /// per job. An index past its pool fails the call with [`HalError::IndexOutOfRange`] at
    /// its position in the jobs' lists taken one after another (destinations are then partly
    /// written). With `dedup`, each job runs on its own.
    pub fn gather_hot_jobs(
        &self,
        jobs: &[HotLookup<'_>],
        opts: &GatherOptions,
    ) -> Result<Vec<GatherReport>> {
        let refuse = |why: String| Err(HalError::InvalidArgument(why).into());
        let Some(first) = jobs.first() else {
            return refuse("a gather of several pools needs a job".into());
        };
        if jobs.len() > HOT_MAX_JOBS {
            return refuse(format!(
                "{} jobs in one gather, more than {HOT_MAX_JOBS}",
                jobs.len()
            ));
        }
        let row_bytes = first.hot.row_bytes();
        if jobs.iter().any(|j| j.hot.row_bytes() != row_bytes) {
            return refuse("the jobs of one gather must have rows of one size".into());
        }
        let gpu = first.dst.gpu();
        if jobs.iter().any(|j| !j.dst.gpu().same_device(gpu)) {
            return refuse("the jobs of one gather must write to one GPU".into());
        }
        if jobs.len() == 1 || opts.dedup {
            return jobs
                .iter()
                .map(|j| self.gather_hot(j.pool, j.hot, j.indices, j.dst, j.dst_offset, opts))
                .collect();
        }
        if opts.strategy == GatherStrategy::Sorted {
            return refuse("a sorted gather does not read hot rows".into());
        }
        if let Some(s) = opts.gpu_share
            && !(0.0..=1.0).contains(&s)
        {
            return refuse(format!(
                "a hybrid gather's GPU share must be between 0 and 1, not {s}"
            ));
        }
        for j in jobs {
            if !j.hot.copies_of(j.pool) {
                return refuse("hot rows are copies of another pool's rows".into());
            }
            if !j.hot.gpu().same_device(gpu) {
                return refuse("hot rows must be on the destination's GPU".into());
            }
            let bytes = j
                .indices
                .len()
                .checked_mul(row_bytes)
                .ok_or_else(|| HalError::InvalidArgument("gather size overflows".into()))?;
            gpuio_hal::check_range("gather destination", j.dst_offset, bytes, j.dst.len())?;
        }
        // Jobs run at once (one launch; the CPU beside the GPU): their rows must not land on
        // each other's.
        let spans = jobs.iter().map(|j| {
            let len = j.indices.len() * row_bytes;
            (j.dst.device_addr().saturating_add(j.dst_offset as u64), len)
        });
        check_disjoint(spans.collect(), "the jobs' destinations")?;
        self.device(gpu)?;
        let rows: usize = jobs.iter().map(|j| j.indices.len()).sum();
        let largest = jobs
            .iter()
            .map(|j| j.pool)
            .max_by_key(|p| p.len())
            .unwrap_or(first.pool);
        let key = self
            .shape(largest, gpu, row_bytes, rows, IndexPlace::Host, true)
            .of_jobs(jobs.len());
        // A pool no longer pinned can only be gathered by the CPU (`resolve` says so).
        let unpinned = jobs.iter().map(|j| j.pool).find(|p| !p.is_pinned());
        let strategy = self.resolve(opts.strategy, unpinned.unwrap_or(largest), key);
        let t = Instant::now();
        if rows > 0 {
            match strategy {
                GatherStrategy::ZeroCopy => {
                    let all: Vec<usize> = jobs.iter().map(|j| j.indices.len()).collect();
                    self.launch_jobs(jobs, &all, row_bytes, false)?;
                }
                GatherStrategy::Hybrid => {
                    let share = opts
                        .gpu_share
                        .unwrap_or_else(|| self.planner.gpu_share(key));
                    let (used, gpu_time, cpu_time) = self.hybrid_jobs(jobs, share, row_bytes)?;
                    if opts.gpu_share.is_none() {
                        self.planner.balance(key, used, gpu_time, cpu_time);
                    }
                }
                _ => {
                    let none = vec![0; jobs.len()];
                    self.staged_jobs(jobs, &none, row_bytes)?;
                }
            }
            if opts.gpu_share.is_none() || strategy != GatherStrategy::Hybrid {
                let bytes = rows * row_bytes;
                let secs = t.elapsed().as_secs_f64();
                self.planner.record(key, strategy, bytes, secs);
            }
            self.count_h2d(rows * row_bytes);
        }
        Ok(jobs
            .iter()
            .map(|j| GatherReport {
                strategy,
                rows: j.indices.len(),
                rows_fetched: j.indices.len(),
            })
            .collect())
    }

    /// The first `counts[k]` rows of each job `k`, by the GPU's threads in one launch; how
    /// long the device worked on them if `timed` (two events: only hybrid calls need it).
    fn launch_jobs(
        &self,
        jobs: &[HotLookup<'_>],
        counts: &[usize],
        row_bytes: usize,
        timed: bool,
    ) -> Result<Duration> {
        let gpu = jobs[0].dst.gpu();
        let rows = counts.iter().sum();
        let out = match self.resident_for(gpu, rows, row_bytes)? {
            Some(server) if !timed => {
                let resident: Vec<ResidentJob<'_>> = jobs
                    .iter()
                    .zip(counts)
                    .map(|(j, &n)| ResidentJob {
                        pool: j.pool,
                        hot: Some(j.hot),
                        indices: &j.indices[..n],
                        dst: j.dst,
                        dst_offset: j.dst_offset,
                    })
                    .collect();
                server
                    .gather(&resident, row_bytes)
                    .map(|()| Duration::ZERO)
                    .map_err(MemIoError::from)
            }
            _ => self.launch_lists(jobs, counts, row_bytes, timed),
        };
        // The device's positions count in the launched lists: map them to the jobs' lists.
        out.map_err(|e| match e {
            MemIoError::Hal(HalError::IndexOutOfRange { position, rows }) => {
                let (k, at) = locate(counts, position as usize);
                let before: usize = jobs[..k].iter().map(|j| j.indices.len()).sum();
                HalError::IndexOutOfRange {
                    position: (before + at) as u64,
                    rows,
                }
                .into()
            }
            other => other,
        })
    }

    /// The first `counts[k]` rows of each job `k` in one launch of the hot-jobs kernel.
    fn launch_lists(
        &self,
        jobs: &[HotLookup<'_>],
        counts: &[usize],
        row_bytes: usize,
        timed: bool,
    ) -> Result<Duration> {
        let lists: Vec<&[u64]> = jobs
            .iter()
            .zip(counts)
            .map(|(j, &n)| &j.indices[..n])
            .collect();
        let hal_jobs: Vec<HotGather<'_>> = jobs
            .iter()
            .zip(counts)
            .map(|(j, &count)| HotGather {
                pool: j.pool,
                hot: j.hot,
                count,
                dst: j.dst,
                dst_offset: j.dst_offset,
            })
            .collect();
        let path = IndexPath::of(RowKernel::Tuned, row_bytes);
        self.with_lists(jobs[0].dst.gpu(), &lists, path, |s, indices| {
            Ok(if timed {
                s.gather_hot_jobs_timed(&hal_jobs, indices)?
            } else {
                s.gather_hot_jobs(&hal_jobs, indices)
                    .map(|()| Duration::ZERO)?
            })
        })
    }

    /// The rows of each job `k` from `from[k]` on, by the CPU's gather threads; how long it
    /// took.
    fn staged_jobs(
        &self,
        jobs: &[HotLookup<'_>],
        from: &[usize],
        row_bytes: usize,
    ) -> Result<Duration> {
        let t = Instant::now();
        let mut before = 0;
        for (j, &start) in jobs.iter().zip(from) {
            let list = &j.indices[start..];
            if !list.is_empty() {
                let offset = j.dst_offset + start * row_bytes;
                self.gather_staged(j.pool, row_bytes, list, j.dst, offset)
                    .map_err(|e| match e {
                        MemIoError::Hal(HalError::IndexOutOfRange { position, rows }) => {
                            HalError::IndexOutOfRange {
                                position: (before + start) as u64 + position,
                                rows,
                            }
                            .into()
                        }
                        other => other,
                    })?;
            }
            before += j.indices.len();
        }
        Ok(t.elapsed())
    }

    /// `share` of each job's rows (its first ones) by the GPU in one launch, the rest by the
    /// CPU meanwhile; the share used, and each side's time.
    fn hybrid_jobs(
        &self,
        jobs: &[HotLookup<'_>],
        share: f64,
        row_bytes: usize,
    ) -> Result<(f64, Duration, Duration)> {
        // The share of all rows, rounded once over the lists taken together (rounded per
        // list, short lists would give one side nothing at shares that are not small).
        let mut before = 0usize;
        let split: Vec<usize> = jobs
            .iter()
            .map(|j| {
                let n = j.indices.len();
                let at = |rows: usize| (rows as f64 * share).round() as usize;
                let k = at(before + n).saturating_sub(at(before)).min(n);
                before += n;
                k
            })
            .collect();
        let (gpu_rows, rows) = (
            split.iter().sum::<usize>(),
            jobs.iter().map(|j| j.indices.len()).sum::<usize>(),
        );
        let mut cpu = None;
        let gpu = self.gather_pool()?.in_place_scope(|scope| {
            scope.spawn(|_| cpu = Some(self.staged_jobs(jobs, &split, row_bytes)));
            if gpu_rows == 0 {
                return Ok(Duration::ZERO);
            }
            self.launch_jobs(jobs, &split, row_bytes, true)
        });
        let cpu = cpu.ok_or_else(|| {
            MemIoError::Internal("the CPU share of a hybrid gather did not run".into())
        })?;
        Ok((gpu_rows as f64 / rows as f64, gpu?, cpu?))
    }
}

/// The job (by `counts`) holding position `at` of the lists one after another, and the
/// position within its list.
fn locate(counts: &[usize], mut at: usize) -> (usize, usize) {
    for (k, &n) in counts.iter().enumerate() {
        if at < n {
            return (k, at);
        }
        at -= n;
    }
    (counts.len().saturating_sub(1), at)
}
