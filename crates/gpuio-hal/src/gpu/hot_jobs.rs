//! Gathers through hot rows of several pools in one launch ([`Stream::gather_hot_jobs`]): a
//! model that reads two Engram tables per decode step knows both tables' ids at once, and
//! one launch and one wait for both halves the fixed cost that dominates small lookups.
//!
//! Each job is what [`Stream::gather_hot`] does for one pool; the jobs' index lists lie one
//! after another in one list, so a single staged copy (or none, for a pinned list the kernel
//! reads in place) serves them all.

use super::backend::{DevRange, RowJob, RowMem, RowsDone};
use super::op::{CudaRun, DeviceOp, HostRun, check_disjoint};
use super::{DeviceBuffer, HotRows, RowIndices, RowKernel, Stream};
use crate::error::{HalError, Result};
use crate::memory::HostBuffer;
use std::time::Duration;

/// Most jobs one [`Stream::gather_hot_jobs`] call takes (gather.cu's `GPUIO_HOT_JOBS`).
pub const HOT_MAX_JOBS: usize = 8;

/// One pool's part of [`Stream::gather_hot_jobs`]: `count` rows of `pool` (their indices the
/// next `count` of the call's list) into `dst` at `dst_offset`, each row `hot` keeps read
/// from its copy.
#[derive(Debug, Clone, Copy)]
pub struct HotGather<'a> {
    /// The pinned pool.
    pub pool: &'a HostBuffer,
    /// Copies of some of its rows, on the stream's device ([`Stream::keep_hot`]).
    pub hot: &'a HotRows,
    /// Rows this job gathers.
    pub count: usize,
    /// Where they go.
    pub dst: &'a DeviceBuffer,
    /// Byte offset in `dst`.
    pub dst_offset: usize,
}

impl Stream {
    /// Runs every job of `jobs` (at most [`HOT_MAX_JOBS`], rows of one size) as
    /// [`gather_hot`](Self::gather_hot) would, in one launch, and waits for them. `indices`
    /// holds the jobs' lists one after another (`Device`, `Pinned` or `Staged`; not
    /// `Streamed`). An index past its pool fails the call with [`HalError::IndexOutOfRange`]
    /// at its position in the whole list (the other rows are gathered).
    pub fn gather_hot_jobs(&self, jobs: &[HotGather<'_>], indices: RowIndices<'_>) -> Result<()> {
        self.hot_jobs(jobs, indices, false).map(drop)
    }

    /// Like [`gather_hot_jobs`](Self::gather_hot_jobs); returns how long the device worked
    /// on it (events around its copy and launch; on the host backend, the copies' time).
    pub fn gather_hot_jobs_timed(
        &self,
        jobs: &[HotGather<'_>],
        indices: RowIndices<'_>,
    ) -> Result<Duration> {
        self.hot_jobs(jobs, indices, true)
            .map(Option::unwrap_or_default)
    }

    fn hot_jobs(
        &self,
        jobs: &[HotGather<'_>],
        indices: RowIndices<'_>,
        timed: bool,
    ) -> Result<Option<Duration>> {
        let invalid = |why: String| Err(HalError::InvalidArgument(why));
        let Some(first) = jobs.first() else {
            return invalid("a hot gather of several pools needs a job".into());
        };
        if jobs.len() > HOT_MAX_JOBS {
            return invalid(format!(
                "{} jobs in one hot gather, more than {HOT_MAX_JOBS}",
                jobs.len()
            ));
        }
        let row_bytes = first.hot.row_bytes();
        if jobs.iter().any(|j| j.hot.row_bytes() != row_bytes) {
            return invalid("the jobs of one hot gather must have rows of one size".into());
        }
        let total = jobs
            .iter()
            .try_fold(0usize, |n, j| n.checked_add(j.count))
            .and_then(|n| n.checked_mul(8))
            .ok_or_else(|| HalError::InvalidArgument("hot gather size overflows".into()))?;
        let spans = jobs.iter().map(|j| {
            let len = j.count.saturating_mul(row_bytes);
            (j.dst.device_addr().saturating_add(j.dst_offset as u64), len)
        });
        check_disjoint(spans.collect(), "the jobs' destinations")?;
        let (idx, upload) = self.job_list(&indices, total, jobs)?;
        let mut checked = Vec::with_capacity(jobs.len());
        let mut at = 0usize;
        for j in jobs {
            let list = part(idx, at * 8, j.count * 8)?;
            let dst = (j.dst, j.dst_offset);
            checked.push(self.pool_job(j.pool, Some(j.hot), row_bytes, j.count, list, dst)?);
            at += j.count;
        }
        let done = self.run(&HotJobsOp {
            jobs: &checked,
            upload,
            timed,
        })?;
        match done.bad_index {
            None => Ok(done.device_time),
            Some(position) => {
                let lists = jobs.iter().map(|j| (j.count, j.pool));
                Err(bad_position(position, lists, row_bytes))
            }
        }
    }

    /// One pool's job of a gather of several (through `hot` rows where given), checked:
    /// `count` rows of `row_bytes` of the pinned `pool` (its hot rows copies of its rows, on
    /// this device) into `dst` at its offset, their indices `idx`.
    pub(super) fn pool_job<'a>(
        &self,
        pool: &'a HostBuffer,
        hot: Option<&'a HotRows>,
        row_bytes: usize,
        count: usize,
        idx: RowMem<'a>,
        (dst, dst_offset): (&'a DeviceBuffer, usize),
    ) -> Result<RowJob<'a>> {
        if let Some(hot) = hot {
            hot.check_pool(pool)?;
            self.gpu.check_owns("hot rows", &hot.rows)?;
            if hot.row_bytes() != row_bytes {
                return Err(HalError::InvalidArgument(format!(
                    "hot rows of {} B in a gather of rows of {row_bytes} B",
                    hot.row_bytes()
                )));
            }
        }
        self.gpu.check_owns("rows", dst)?;
        let overflow = || HalError::InvalidArgument(format!("{count} rows of {row_bytes} B"));
        let bytes = count.checked_mul(row_bytes).ok_or_else(overflow)?;
        let pool_mem = self.host_pool(pool)?;
        if pool_mem.len() < row_bytes {
            return Err(HalError::InvalidArgument(format!(
                "the pool ({} B) holds no row of {row_bytes} B",
                pool_mem.len()
            )));
        }
        Ok(RowJob {
            pool: pool_mem,
            row_bytes,
            count,
            idx,
            idx_upload: None,
            rows: dst.range("rows", dst_offset, bytes)?,
            scatter: false,
            kernel: RowKernel::Tuned,
            pieces: &[],
            hot: hot.map(HotRows::refs).transpose()?,
        })
    }

    /// The whole index list as the kernel reads it, and the staged copy that puts it there.
    fn job_list<'a>(
        &self,
        indices: &RowIndices<'a>,
        bytes: usize,
        jobs: &[HotGather<'_>],
    ) -> Result<(RowMem<'a>, Option<Upload<'a>>)> {
        let not_rows = |list: &DeviceBuffer| -> Result<()> {
            self.gpu.check_owns("row indices", list)?;
            if jobs.iter().any(|j| j.dst.same_buffer(list)) {
                return Err(HalError::InvalidArgument(
                    "row indices and rows must be different buffers".into(),
                ));
            }
            Ok(())
        };
        Ok(match *indices {
            RowIndices::Device(list) => {
                not_rows(list)?;
                (RowMem::Device(list.range("row indices", 0, bytes)?), None)
            }
            RowIndices::Pinned(host) => {
                crate::check_range("row indices", 0, bytes, host.len())?;
                (self.host_pool(host)?, None)
            }
            RowIndices::Staged { host, device } => {
                crate::check_range("row indices", 0, bytes, host.len())?;
                not_rows(device)?;
                if !host.is_pinned() {
                    return Err(HalError::InvalidArgument(
                        "staged row indices must be in pinned memory".into(),
                    ));
                }
                let to = device.range("row indices", 0, bytes)?;
                let upload = Upload {
                    from: host.base_ptr() as *const u8,
                    to,
                };
                (RowMem::Device(to), Some(upload))
            }
            RowIndices::Streamed { .. } => {
                return Err(HalError::InvalidArgument(
                    "a hot gather of several pools takes a whole index list, not a streamed one"
                        .into(),
                ));
            }
        })
    }
}

/// A bad index at `position` of `lists` (each job's row count and pool) taken one after
/// another: the job holding it names the pool it missed.
pub(super) fn bad_position<'a>(
    position: u64,
    lists: impl IntoIterator<Item = (usize, &'a HostBuffer)>,
    row_bytes: usize,
) -> HalError {
    let mut start = 0u64;
    let rows = lists
        .into_iter()
        .find(|&(count, _)| {
            start += count as u64;
            position < start
        })
        .map_or(0, |(_, pool)| (pool.len() / row_bytes) as u64);
    HalError::IndexOutOfRange { position, rows }
}

/// `len` bytes of a checked index list from `offset`.
fn part(list: RowMem<'_>, offset: usize, len: usize) -> Result<RowMem<'_>> {
    Ok(match list {
        RowMem::Host {
            ptr,
            addr,
            len: all,
        } => {
            crate::check_range("row indices", offset, len, all)?;
            RowMem::Host {
                ptr: ptr.wrapping_add(offset),
                addr: addr + offset as u64,
                len,
            }
        }
        RowMem::Device(r) => RowMem::Device(r.part(offset, len)?),
    })
}

/// A staged list's copy into device memory, run before the launch in stream order.
#[derive(Clone, Copy)]
pub(crate) struct Upload<'a> {
    /// Pinned host bytes, `to.len` of them, borrowed for the call.
    pub(crate) from: *const u8,
    pub(crate) to: DevRange<'a>,
}

/// Checked jobs as an op. Built only by `hot_jobs`, whose checks (every range against its
/// live, borrowed allocation; pools pinned and borrowed for the call) make running it sound.
struct HotJobsOp<'a, 'j> {
    jobs: &'j [RowJob<'a>],
    upload: Option<Upload<'a>>,
    timed: bool,
}

impl DeviceOp for HotJobsOp<'_, '_> {
    type Output = RowsDone;

    fn host(&self, _host: &HostRun<'_>) -> Result<RowsDone> {
        // SAFETY: the struct's contract; the host backend locks the device ranges itself.
        unsafe { super::host::run_hot_jobs(self.jobs, self.upload, self.timed) }
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<RowsDone> {
        cuda.never()
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<RowsDone> {
        // SAFETY: the struct's contract.
        unsafe { cuda.stream.run_hot_jobs(self.jobs, self.upload, self.timed) }
    }
}
