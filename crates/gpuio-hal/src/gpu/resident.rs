//! A resident row server ([`ResidentRows`]): small gathers from pinned pools (through hot rows
//! where given) served by one block that stays on the device between calls, so that a call
//! pays neither a launch nor the driver's wait. On an H200 the launch call alone is 4-5 µs and
//! a one-row gather's whole wall 12-13 µs; the resident block answers in a few PCIe round
//! trips.
//!
//! The block spins on a word of mapped host memory while it waits; it leaves after the
//! server's linger without a call, and comes back with the next call. gpuio's own calls that
//! wait for the whole device (`Gpu::synchronize`, freeing and unregistering memory) send it
//! home first; a wait elsewhere in the process lasts the linger after the last call at most.
//! It runs on a stream of its own.
//! On the host backend the same jobs run on the calling thread.

use super::backend::{RowJob, RowMem, RowsDone};
use super::hot_jobs::bad_position;
use super::op::{CudaRun, DeviceOp, HostRun, check_disjoint};
use super::{DeviceBuffer, Gpu, HOT_MAX_JOBS, HotRows, Stream};
use crate::error::{HalError, Result};
use crate::memory::HostBuffer;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Most indices one [`ResidentRows::gather`] call takes, over all its jobs (resident.cu's
/// `GPUIO_RESIDENT_ROWS`).
pub const RESIDENT_MAX_ROWS: usize = 1024;

/// Most bytes one call moves. One block on one multiprocessor keeps few reads in flight: on
/// an H200 it moved 64 rows of 656 B (42 KiB) in 13.5 µs against a launched gather's 18, but
/// 768 rows of 256 B in 31 µs against 18.
pub const RESIDENT_MAX_BYTES: usize = 64 << 10;

/// One pool's part of a [`ResidentRows::gather`] call: its row `i` goes to `dst` at
/// `dst_offset + i * row_bytes`, from pool row `indices[i]` (read from its copy where `hot`
/// keeps it).
#[derive(Debug, Clone, Copy)]
pub struct ResidentJob<'a> {
    /// The pinned pool.
    pub pool: &'a HostBuffer,
    /// Copies of some of its rows on the server's device ([`Stream::keep_hot`]), if any.
    pub hot: Option<&'a HotRows>,
    /// The rows to gather.
    pub indices: &'a [u64],
    /// Where they go, on the server's device.
    pub dst: &'a DeviceBuffer,
    /// Byte offset in `dst`.
    pub dst_offset: usize,
}

/// Small gathers served by a block resident on one device ([`Gpu::resident_rows`]). Calls are
/// answered one at a time, in the order made; each returns once its rows are in device memory.
/// A call is ordered with no stream: work that writes its pools or reads its rows on a stream
/// is ordered by the caller, as with any call that returns when done.
#[derive(Debug)]
pub struct ResidentRows {
    stream: Stream,
    linger: Duration,
    calls: AtomicU64,
    launches: AtomicU64,
}

/// What a [`ResidentRows`] has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResidentStats {
    /// Calls answered (calls with no rows are not counted).
    pub calls: u64,
    /// Times its block was launched: once, then once per return after it left (its linger
    /// passed, or a wait of gpuio's for the whole device sent it home: a synchronize, a free).
    /// 0 on the host backend, which has none.
    pub launches: u64,
}

impl Gpu {
    /// A resident row server on this device whose block leaves after `linger` without a call
    /// (at least a millisecond: less would leave between a model's steps and pay a launch
    /// per call). Nothing runs until the first call.
    pub fn resident_rows(&self, linger: Duration) -> Result<ResidentRows> {
        if linger < Duration::from_millis(1) {
            return Err(HalError::InvalidArgument(format!(
                "a resident server's linger of {linger:?} is under a millisecond"
            )));
        }
        Ok(ResidentRows {
            stream: self.stream()?,
            linger,
            calls: AtomicU64::new(0),
            launches: AtomicU64::new(0),
        })
    }
}

impl ResidentRows {
    /// The device it serves.
    pub fn gpu(&self) -> &Gpu {
        self.stream.gpu()
    }

    /// How long its block waits for a call before it leaves.
    pub fn linger(&self) -> Duration {
        self.linger
    }

    /// Its calls and launches so far.
    pub fn stats(&self) -> ResidentStats {
        ResidentStats {
            calls: self.calls.load(Ordering::Relaxed),
            launches: self.launches.load(Ordering::Relaxed),
        }
    }

    /// Gathers every job's rows (rows of `row_bytes`; at most [`HOT_MAX_JOBS`] jobs,
    /// [`RESIDENT_MAX_ROWS`] indices and [`RESIDENT_MAX_BYTES`] in all) and waits for them.
    /// An index past its pool fails the call with [`HalError::IndexOutOfRange`] at its
    /// position in the jobs' lists taken one after another (the other rows are gathered).
    pub fn gather(&self, jobs: &[ResidentJob<'_>], row_bytes: usize) -> Result<()> {
        let invalid = |why: String| Err(HalError::InvalidArgument(why));
        if row_bytes == 0 {
            return invalid("a resident gather's rows must have bytes".into());
        }
        if jobs.len() > HOT_MAX_JOBS {
            return invalid(format!(
                "{} jobs in one resident gather, more than {HOT_MAX_JOBS}",
                jobs.len()
            ));
        }
        let rows: usize = jobs.iter().map(|j| j.indices.len()).sum();
        if rows > RESIDENT_MAX_ROWS || rows.saturating_mul(row_bytes) > RESIDENT_MAX_BYTES {
            return invalid(format!(
                "{rows} rows of {row_bytes} B in one resident gather, more than \
                 {RESIDENT_MAX_ROWS} rows or {RESIDENT_MAX_BYTES} B"
            ));
        }
        let spans = jobs.iter().map(|j| {
            let len = j.indices.len() * row_bytes;
            (j.dst.device_addr().saturating_add(j.dst_offset as u64), len)
        });
        check_disjoint(spans.collect(), "the jobs' destinations")?;
        let checked = jobs
            .iter()
            .map(|j| {
                // The list is the caller's host memory: the kernel reads a copy of it.
                let idx = RowMem::Host {
                    ptr: j.indices.as_ptr().cast::<u8>().cast_mut(),
                    addr: 0,
                    len: j.indices.len() * 8,
                };
                let dst = (j.dst, j.dst_offset);
                let count = j.indices.len();
                self.stream
                    .pool_job(j.pool, j.hot, row_bytes, count, idx, dst)
            })
            .collect::<Result<Vec<_>>>()?;
        if rows == 0 {
            return Ok(());
        }
        let done = self.stream.run(&ResidentOp {
            jobs: &checked,
            linger: self.linger,
            launches: &self.launches,
        })?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        match done.bad_index {
            None => Ok(()),
            Some(position) => {
                let lists = jobs.iter().map(|j| (j.indices.len(), j.pool));
                Err(bad_position(position, lists, row_bytes))
            }
        }
    }
}

/// Checked jobs as an op. Built only by `gather`, whose checks (every range against its live,
/// borrowed allocation; pools pinned and borrowed for the call; index lists borrowed host
/// memory within the limits) make running it sound.
struct ResidentOp<'a, 'j> {
    jobs: &'j [RowJob<'a>],
    linger: Duration,
    launches: &'j AtomicU64,
}

impl DeviceOp for ResidentOp<'_, '_> {
    type Output = RowsDone;

    fn host(&self, _host: &HostRun<'_>) -> Result<RowsDone> {
        // SAFETY: the struct's contract; the host backend locks the device ranges itself.
        unsafe { super::host::run_hot_jobs(self.jobs, None, false) }
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<RowsDone> {
        let _ = (self.linger, self.launches);
        cuda.never()
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<RowsDone> {
        // SAFETY: the struct's contract; the server's stream runs nothing but its calls.
        unsafe {
            cuda.stream
                .serve_resident(self.jobs, self.linger, self.launches)
        }
    }
}
