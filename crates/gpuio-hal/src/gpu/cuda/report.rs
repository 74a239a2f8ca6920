//! A stream's report words in mapped host memory ([`ReportWords`]), for the gather kernels
//! (row, tiered): a kernel that meets a bad index lowers its word (`atomicMin` over the bus:
//! atomic among the device's threads, which is all it needs), and the host reads the words
//! after the wait it makes anyway. A small gather so costs no memset before its kernel and no
//! copy back after it (each a driver call and a trip through the copy engine: most of a
//! few-row call's time beyond the device's work), only a few host stores resetting the words
//! before its launches. A job holds them through [`Reports`] ([`CudaStreamBackend::reports`]).
//!
//! Beside them lies the stream's end word: an untimed call's last kernel, where its grid has
//! at most a block per multiprocessor, stores the call's number there once its last block is
//! done ([`EndSignal`], gather.cu's `gpuio_end`), and the host, which watches it
//! ([`ReportWords::wait_end`]), returns without the driver's wait (which sees the end 1-2 µs
//! later on an H200).

use super::driver;
use super::stream::CudaStreamBackend;
use crate::error::HalError;
use crate::error::Result;
use crate::gpu::backend::StreamBackend;
use crate::sync::MutexExt;
use cudarc::driver::sys;
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Report words a stream keeps (one per piece of a row job).
pub(super) const REPORT_WORDS: usize = crate::gpu::rows::MAX_PIECES;

/// One stream's report words, and its end word after them.
pub(crate) struct ReportWords {
    host: *mut u64,
    device: sys::CUdeviceptr,
    words: usize,
    /// The count of a signalling kernel's finished blocks (device memory, zero between calls).
    blocks: sys::CUdeviceptr,
    /// The number of the stream's last signalling call (the end word starts below the first).
    seq: AtomicU64,
    /// The GPU, whose resident kernels the frees send home first.
    gpu: sys::CUdevice,
}

/// What a kernel that tells its end takes (gather.cu's `gpuio_end`, whose size and offsets are
/// asserted there too): where it counts its blocks, the end word's device address (0: tell
/// nothing), and the number to store.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct EndSignal {
    blocks: u64,
    word: u64,
    seq: u64,
}

const _: () = assert!(size_of::<EndSignal>() == 24);
const _: () = assert!(offset_of!(EndSignal, word) == 8);
const _: () = assert!(offset_of!(EndSignal, seq) == 16);

impl EndSignal {
    /// Tells nothing: for every launch of a call but its last, and for calls timed by events.
    pub(crate) const NONE: Self = Self {
        blocks: 0,
        word: 0,
        seq: 0,
    };

    /// Whether the kernel tells its end.
    pub(crate) fn armed(self) -> bool {
        self.word != 0
    }

    /// The kernel argument's words, in field order.
    pub(crate) fn words(self) -> [u64; 3] {
        [self.blocks, self.word, self.seq]
    }
}

/// How often a wait for the end word asks the driver whether the stream failed (a kernel that
/// faults never stores the word), and how long it watches before it leaves the rest of a long
/// call to the driver's wait.
const QUERY_EVERY: Duration = Duration::from_micros(20);
const WATCH_FOR: Duration = Duration::from_micros(500);

// SAFETY: the pointer is to page-locked memory this value alone owns (until Drop); the host
// reads and writes the words only while it holds its stream's report lock (`Reports`), before
// a job's launches or after its wait.
unsafe impl Send for ReportWords {}
// SAFETY: as above: shared, the words are still touched by one holder of the lock at a time.
unsafe impl Sync for ReportWords {}

/// "No bad index" (what the kernels' `atomicMin` lowers).
const NONE: u64 = u64::MAX;

impl ReportWords {
    /// `words` report words and the end word in the calling thread's bound context, for
    /// `stream` (the report words reset before each use, the end word at 0, the block count
    /// zeroed in the stream's order, before any of its kernels).
    fn new(words: usize, stream: sys::CUstream, gpu: sys::CUdevice) -> Result<Self> {
        let host = driver::mem_host_alloc_mapped((words + 1) * 8)?.cast::<u64>();
        // SAFETY: `host` starts a fresh allocation of `words + 1` words, used by nothing yet.
        unsafe { host.add(words).write_volatile(0) };
        let free_host = || {
            // SAFETY: allocated just above, freed once, used by nothing.
            let _ = unsafe { driver::mem_free_host(host.cast()) };
        };
        // SAFETY: `host` starts a fresh DEVICEMAP allocation.
        let device = unsafe { driver::mem_host_get_device_pointer(host.cast()) }
            .inspect_err(|_| free_host())?;
        let blocks = driver::mem_alloc(8).inspect_err(|_| free_host())?;
        let this = Self {
            host,
            device,
            words,
            blocks,
            seq: AtomicU64::new(0),
            gpu,
        };
        this.zero_blocks(stream)?;
        Ok(this)
    }

    /// Sets the block count to zero, in `stream`'s order (cuMemAlloc leaves memory as it
    /// was; a copy from pageable memory would run on another stream and may land late).
    fn zero_blocks(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: `blocks` is 8 bytes (two u32 words) of this context's device memory, which
        // only `stream`'s kernels use, after this set in the stream's order.
        unsafe { driver::memset_d32_async(self.blocks, 0, 2, stream) }
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

    /// Word `k` as the kernels left it (None: no report). Call it after the job's wait (the
    /// kernels' writes over the bus are then visible).
    pub(crate) fn word(&self, k: usize) -> Option<u64> {
        if k >= self.words {
            return None;
        }
        // SAFETY: `k` is inside the allocation; the kernels that wrote it are done.
        let w = unsafe { self.host.add(k).read_volatile() };
        Some(w).filter(|&w| w != NONE)
    }

    /// The end signal for a call's last kernel, under a fresh number.
    pub(crate) fn arm_end(&self) -> EndSignal {
        EndSignal {
            blocks: self.blocks,
            word: self.device + 8 * self.words as u64,
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
        }
    }

    /// The end word as the last signalling kernel left it; what that kernel wrote before it
    /// is visible once the word is (the kernel's fences order its stores before the word's).
    fn end_word(&self) -> u64 {
        // SAFETY: word `words` is inside the allocation (8-byte aligned, page-locked, live as
        // long as `self`); the host touches it only through atomics, the device only stores.
        unsafe { AtomicU64::from_ptr(self.host.add(self.words)) }.load(Ordering::Acquire)
    }

    /// Waits for the work queued on `stream` up to and including the kernel launched with
    /// `end`: until the end word holds its number, or the driver reports the stream done (or
    /// failed); after [`WATCH_FOR`] with neither, through the driver's wait. Once the word is
    /// there every block of that kernel is done with memory (each counted its stores first),
    /// though the stream may not have retired the kernel yet.
    pub(crate) fn wait_end(&self, stream: &CudaStreamBackend, end: EndSignal) -> Result<()> {
        let start = Instant::now();
        let mut asked = start;
        loop {
            if self.end_word() == end.seq {
                return Ok(());
            }
            let now = Instant::now();
            if now - asked >= QUERY_EVERY {
                asked = now;
                // SAFETY: the stream is live (borrowed) and its context bound by the caller.
                if unsafe { driver::stream_query(stream.raw()) }? {
                    return self.done_without_word(stream, end);
                }
                if now - start >= WATCH_FOR {
                    stream.synchronize()?;
                    return self.done_without_word(stream, end);
                }
            }
            std::hint::spin_loop();
        }
    }

    /// The stream finished: the word is there by now, or the kernel's count went astray (it
    /// never happens while every launch on the stream completes); then it is set back, in
    /// the stream's order, before its next kernel.
    fn done_without_word(&self, stream: &CudaStreamBackend, end: EndSignal) -> Result<()> {
        if self.end_word() == end.seq {
            return Ok(());
        }
        tracing::warn!(
            seq = end.seq,
            "a kernel finished without its end signal; resetting its block count"
        );
        self.zero_blocks(stream.raw())
    }
}

impl Drop for ReportWords {
    fn drop(&mut self) {
        if super::probe::driver_forked() {
            return;
        }
        // Frees wait for the device: resident kernels would hold them for their linger.
        let _waiting = super::resident::send_home(self.gpu);
        // SAFETY: allocated by mem_host_alloc_mapped and mem_alloc, each freed once; the
        // stream that owns this report drained its work and bound its context first (it leaks
        // the report where it cannot).
        let freed = unsafe { driver::mem_free_host(self.host.cast()) }
            // SAFETY: as above.
            .and(unsafe { driver::mem_free(self.blocks) });
        if let Err(e) = freed {
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
            let _ = self.reports.words.set(ReportWords::new(
                REPORT_WORDS,
                self.raw(),
                self.shared.device,
            )?);
        }
        let words = self.reports.words.get().ok_or_else(|| {
            HalError::InvalidArgument("a stream's report words could not be kept".into())
        })?;
        words.reset();
        Ok(Reports { words, _held: held })
    }
}
