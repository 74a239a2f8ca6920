//! The row kernels' report words in mapped host memory ([`RowReport`]): a kernel that meets a
//! bad index lowers its word (`atomicMin` over the bus: atomic among the device's threads,
//! which is all it needs), and the host reads the words after the wait it makes anyway. A
//! small gather so costs no memset before its kernel and no copy back after it (each a
//! driver call and a trip through the copy engine: most of a few-row call's time beyond the
//! device's work), only a few host stores resetting the words before its launches.

use super::driver;
use crate::error::Result;
use cudarc::driver::sys;

/// One stream's report words.
pub(super) struct RowReport {
    host: *mut u64,
    device: sys::CUdeviceptr,
    words: usize,
}

// SAFETY: the pointer is to page-locked memory this value alone owns (until Drop); every
// access goes through `&mut self` or happens after the stream's work is done.
unsafe impl Send for RowReport {}

/// "No bad index" (what the kernels' `atomicMin` lowers).
const NONE: u64 = u64::MAX;

impl RowReport {
    /// `words` report words, each "no report", in the calling thread's bound context.
    pub(super) fn new(words: usize) -> Result<Self> {
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
    pub(super) fn device_word(&self, k: usize) -> u64 {
        self.device + 8 * k.min(self.words - 1) as u64
    }

    /// Sets every word to "no report" (every time: a call that failed after its kernels ran
    /// may have left words lowered unread). Call it before launching kernels that report,
    /// while no work of the stream uses the words.
    pub(super) fn reset(&mut self) {
        for k in 0..self.words {
            // SAFETY: `k` is below `words`, inside the allocation; no kernel runs on it now.
            unsafe { self.host.add(k).write_volatile(NONE) };
        }
        // The words are written before the launches that follow read them.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// Word `k` as the kernels left it (None: no report). Call it after the stream's work
    /// finished (its writes over the bus are then visible).
    pub(super) fn word(&self, k: usize) -> Option<u64> {
        if k >= self.words {
            return None;
        }
        // SAFETY: `k` is inside the allocation; the kernels that wrote it are done.
        let w = unsafe { self.host.add(k).read_volatile() };
        Some(w).filter(|&w| w != NONE)
    }
}

impl Drop for RowReport {
    fn drop(&mut self) {
        // SAFETY: allocated by mem_host_alloc_mapped, freed once; the stream that owns this
        // report drained its work and bound its context first (it leaks the report where it
        // cannot).
        if let Err(e) = unsafe { driver::mem_free_host(self.host.cast()) } {
            tracing::error!(error = %e, "freeing a stream's row report failed");
        }
    }
}
