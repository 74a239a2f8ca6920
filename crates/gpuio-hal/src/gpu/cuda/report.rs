//! A stream's report words in mapped host memory ([`ReportWords`]), for the gather kernels
//! (row, tiered): a kernel that meets a bad index lowers its word (`atomicMin` over the bus:
//! atomic among the device's threads, which is all it needs), and the host reads the words
//! after the wait it makes anyway. A small gather so costs no memset before its kernel and no
//! copy back after it (each a driver call and a trip through the copy engine: most of a
//! few-row call's time beyond the device's work), only a few host stores resetting the words
//! before its launches. A job holds them through [`Reports`] ([`CudaStreamBackend::reports`]).

use super::driver;
use super::stream::CudaStreamBackend;
use crate::error::HalError;
use crate::error::Result;
use crate::sync::MutexExt;
use cudarc::driver::sys;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Report words a stream keeps (one per piece of a row job).
pub(super) const REPORT_WORDS: usize = crate::gpu::rows::MAX_PIECES;

/// One stream's report words.
pub(crate) struct ReportWords {
    host: *mut u64,
    device: sys::CUdeviceptr,
    words: usize,
}

// SAFETY: the pointer is to page-locked memory this value alone owns (until Drop); the host
// reads and writes the words only while it holds its stream's report lock (`Reports`), before
// a job's launches or after its wait.
unsafe impl Send for ReportWords {}
// SAFETY: as above: shared, the words are still touched by one holder of the lock at a time.
unsafe impl Sync for ReportWords {}

/// "No bad index" (what the kernels' `atomicMin` lowers).
const NONE: u64 = u64::MAX;

impl ReportWords {
    /// `words` report words in the calling thread's bound context (reset before each use).
    fn new(words: usize) -> Result<Self> {
        let host = driver::mem_host_alloc_mapped(words * 8)?.cast::<u64>();
        // SAFETY: `host` starts a fresh DEVICEMAP allocation.
        let device = match unsafe { driver::mem_host_get_device_pointer(host.cast()) } {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: allocated just above, freed once, used by nothing.
                let _ = unsafe { driver::mem_free_host(host.cast()) };
                return Err(e);
            }
        };
        Ok(Self {
            host,
            device,
            words,
        })
    }

    /// Where kernels report: word `k`.
    pub(crate) fn device_word(&self, k: usize) -> u64 {
        self.device + 8 * k.min(self.words - 1) as u64
    }

    /// Sets every word to "no report" (every time: a call that failed after its kernels ran
    /// may have left words lowered unread), while no work of the stream uses the words.
    fn reset(&self) {
        for k in 0..self.words {
            // SAFETY: `k` is below `words`, inside the allocation; no kernel runs on it now.
            unsafe { self.host.add(k).write_volatile(NONE) };
        }
        // The words are written before the launches that follow read them.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// Word `k` as the kernels left it (None: no report). Call it after the stream's work
    /// finished (its writes over the bus are then visible).
    pub(crate) fn word(&self, k: usize) -> Option<u64> {
        if k >= self.words {
            return None;
        }
        // SAFETY: `k` is inside the allocation; the kernels that wrote it are done.
        let w = unsafe { self.host.add(k).read_volatile() };
        Some(w).filter(|&w| w != NONE)
    }
}

impl Drop for ReportWords {
    fn drop(&mut self) {
        if super::probe::driver_forked() {
            return;
        }
        // SAFETY: allocated by mem_host_alloc_mapped, freed once; the stream that owns this
        // report drained its work and bound its context first (it leaks the report where it
        // cannot).
        if let Err(e) = unsafe { driver::mem_free_host(self.host.cast()) } {
            tracing::error!(error = %e, "freeing a stream's row report failed");
        }
    }
}

/// A stream's report words, made on first use, and the lock a job holds them by.
#[derive(Default)]
pub(super) struct StreamReports {
    words: OnceLock<ReportWords>,
    held: Mutex<()>,
}

impl StreamReports {
    /// The words, for the stream's Drop to free after its wait (or leak).
    pub(super) fn take(&mut self) -> Option<ReportWords> {
        self.words.take()
    }
}

/// A stream's report words held by one job, every word reset: launch the kernels with
/// [`ReportWords::device_word`], read [`ReportWords::word`] after the job's wait, and drop the
/// guard only then.
pub(crate) struct Reports<'a> {
    words: &'a ReportWords,
    _held: MutexGuard<'a, ()>,
}

impl std::ops::Deref for Reports<'_> {
    type Target = ReportWords;
    fn deref(&self) -> &ReportWords {
        self.words
    }
}

impl CudaStreamBackend {
    /// The stream's report words for one job, made on first use (in the bound context) and
    /// reset to "no report"; no other job of the stream uses them until the guard drops.
    pub(crate) fn reports(&self) -> Result<Reports<'_>> {
        let held = self.reports.held.lock_unpoisoned();
        if self.reports.words.get().is_none() {
            // Under the lock: no other job makes them meanwhile.
            let _ = self.reports.words.set(ReportWords::new(REPORT_WORDS)?);
        }
        let words = self.reports.words.get().ok_or_else(|| {
            HalError::InvalidArgument("a stream's report words could not be kept".into())
        })?;
        words.reset();
        Ok(Reports { words, _held: held })
    }
}
