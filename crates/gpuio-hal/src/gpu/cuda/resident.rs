//! The resident row server's host side (`resident::ResidentOp`'s CUDA side): a call block in
//! mapped host memory (resident.cu's `gpuio_resident_call`), and the one-block kernel that
//! serves it on this stream, launched when a call finds it gone.
//!
//! A call writes its jobs and indices into the block, then its number word (its number times
//! 2048 plus its index count, which the kernel reads with the number); it waits until the
//! block's `done` word holds that word. The kernel leaves after the server's linger without
//! a call, or when sent home (the stop number: the server's drop, a device-wide wait); a call
//! that finds the stream idle with its number unanswered launches it again (the number is
//! served at most once more: the same rows, written twice).

use super::device::Shared;
use super::driver::{self, cuda_err};
use super::stream::CudaStreamBackend;
use crate::error::Result;
use crate::gpu::backend::{RowJob, RowMem, RowsDone};
use crate::gpu::hot_jobs::HOT_MAX_JOBS;
use crate::gpu::resident::RESIDENT_MAX_ROWS;
use crate::gpu::widest_piece;
use crate::kernels::GatherKernel;
use crate::sync::MutexExt;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The kernel's block size (resident.cu's `GPUIO_RESIDENT_THREADS`): 64 rows of 656 B in two
/// rounds of loads. At 116 registers a thread (sm_90) it holds most of one multiprocessor's
/// register file while it stays: one of an H200's 132.
const RESIDENT_THREADS: u32 = 512;
/// A number word's index count bits (resident.cu's `% 2048`).
const COUNT_BITS: u32 = 11;
const _: () = assert!(RESIDENT_MAX_ROWS < 1 << COUNT_BITS);
/// The number that sends the kernel home (resident.cu's `GPUIO_RESIDENT_STOP`).
const STOP: u64 = u64::MAX;
/// "No bad index" (what the kernel's `atomicMin` lowers).
const NONE: u64 = u64::MAX;
/// How often a waiting call asks the driver whether the stream is idle (the kernel gone, or
/// failed).
const QUERY_EVERY: Duration = Duration::from_micros(20);
/// Within this much of its linger since its last answer, the kernel may have left: a call
/// asks the driver before posting rather than wait `QUERY_EVERY` to find out.
const LINGER_MARGIN: Duration = Duration::from_micros(100);

/// The call block, as resident.cu's `gpuio_resident_call` (its size and offsets asserted there
/// too).
#[repr(C)]
struct CallBlock {
    seq: u64,
    _unused0: [u64; 15],
    done: u64,
    bad: [u64; HOT_MAX_JOBS],
    _unused1: [u64; 7],
    width: u64,
    row_bytes: u64,
    jobs: u64,
    rows: u64,
    job: [[u64; 12]; HOT_MAX_JOBS],
    index: [u64; RESIDENT_MAX_ROWS],
}

const _: () = assert!(size_of::<CallBlock>() == 288 + 96 * HOT_MAX_JOBS + 8 * RESIDENT_MAX_ROWS);
const _: () = assert!(offset_of!(CallBlock, done) == 128);
const _: () = assert!(offset_of!(CallBlock, bad) == 136);
const _: () = assert!(offset_of!(CallBlock, width) == 256);
const _: () = assert!(offset_of!(CallBlock, job) == 288);
const _: () = assert!(offset_of!(CallBlock, index) == 288 + 96 * HOT_MAX_JOBS);

/// A call block in mapped host memory: freed on drop, once its stream has drained.
pub(crate) struct CallMemory {
    host: *mut CallBlock,
    device: u64,
    /// How often a device-wide wait sent the kernel home ([`send_home`]).
    sent_home: AtomicU64,
}

// SAFETY: the pointer is to page-locked memory this value alone owns (until Drop). The call
// words are written only by the stream's resident lock holder; the number word is also
// stored by `send_home`, through an atomic.
unsafe impl Send for CallMemory {}
// SAFETY: as above.
unsafe impl Sync for CallMemory {}

impl CallMemory {
    fn new() -> Result<Self> {
        let host = driver::mem_host_alloc_mapped(size_of::<CallBlock>())?.cast::<CallBlock>();
        // SAFETY: `host` starts a fresh allocation of a CallBlock's size, used by nothing yet.
        let device = unsafe { driver::mem_host_get_device_pointer(host.cast()) };
        let device = device.inspect_err(|_| {
            // SAFETY: allocated just above, freed once, used by nothing.
            let _ = unsafe { driver::mem_free_host(host.cast()) };
        })?;
        // SAFETY: as above; the block's words start at "nothing posted, nothing answered".
        unsafe {
            (*host).seq = 0;
            (*host).done = 0;
        }
        Ok(Self {
            host,
            device,
            sent_home: AtomicU64::new(0),
        })
    }

    /// A word of the block, shared with the device: read and written only through atomics.
    fn word(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is one of the block's 8-byte-aligned words, live as long as `self`.
        unsafe { AtomicU64::from_ptr(self.host.cast::<u8>().add(at).cast()) }
    }

    /// Stores the number word: the call's words written before it are seen before it.
    fn post(&self, seq: u64) {
        self.word(offset_of!(CallBlock, seq))
            .store(seq, Ordering::Release);
    }

    fn done(&self) -> u64 {
        self.word(offset_of!(CallBlock, done))
            .load(Ordering::Acquire)
    }

    /// Job `k`'s first bad position, once the call is answered.
    fn bad(&self, k: usize) -> Option<u64> {
        let w = self
            .word(offset_of!(CallBlock, bad) + 8 * k)
            .load(Ordering::Acquire);
        (w != NONE).then_some(w)
    }
}

impl Drop for CallMemory {
    fn drop(&mut self) {
        if super::probe::driver_forked() {
            return;
        }
        // SAFETY: allocated by mem_host_alloc_mapped, freed once; the stream that owned it
        // sent its kernel home and drained first.
        if let Err(e) = unsafe { driver::mem_free_host(self.host.cast()) } {
            tracing::error!(error = %e, "freeing a resident call block failed");
        }
    }
}

/// Sends every resident kernel of `shared`'s device home, before a device-wide wait: such a
/// wait would otherwise last until they leave by themselves. A call in flight is answered
/// first, or finds its kernel gone and launches it again.
pub(super) fn send_home(shared: &Shared) {
    let mut residents = shared.residents.lock_unpoisoned();
    residents.retain(|weak| {
        let Some(mem) = weak.upgrade() else {
            return false;
        };
        mem.sent_home.fetch_add(1, Ordering::AcqRel);
        mem.post(STOP);
        true
    });
}

/// A stream's call block and what the host knows of its kernel.
pub(crate) struct ResidentBlock {
    mem: Arc<CallMemory>,
    /// The last number word posted (and answered: calls hold the lock until answered).
    posted: u64,
    /// When the last answer came, if the kernel may still be there: the call memory's
    /// `sent_home` count then.
    answered: Option<(Instant, u64)>,
}

/// A stream's resident block, made on a first call.
#[derive(Default)]
pub(super) struct StreamResident(Mutex<Option<ResidentBlock>>);

impl StreamResident {
    /// Sends the kernel home (a stream about to be drained), and gives the block for its
    /// Drop to free after the drain.
    pub(super) fn stop(&mut self) -> Option<ResidentBlock> {
        let block = self.0.get_mut_unpoisoned().take()?;
        block.mem.post(STOP);
        Some(block)
    }
}

impl ResidentBlock {
    /// A block, known to `shared`'s device-wide waits.
    fn new(shared: &Shared) -> Result<Self> {
        let mem = Arc::new(CallMemory::new()?);
        let mut residents = shared.residents.lock_unpoisoned();
        residents.retain(|w| w.strong_count() > 0);
        residents.push(Arc::downgrade(&mem));
        Ok(Self {
            mem,
            posted: 0,
            answered: None,
        })
    }

    /// Writes the call (the kernel is idle until its number is posted); its index count.
    ///
    /// # Safety
    /// Every job's index list is host memory (`RowMem::Host`) readable for the call; the jobs
    /// hold at most `RESIDENT_MAX_ROWS` indices and `HOT_MAX_JOBS` jobs (checked by the op).
    unsafe fn write(&mut self, jobs: &[RowJob<'_>], width: u64, row_bytes: u64) -> u64 {
        let block = self.mem.host;
        let mut at = 0usize;
        // SAFETY: the block is ours (the stream's resident lock); the kernel reads these words
        // only after the number.
        unsafe {
            (*block).width = width;
            (*block).row_bytes = row_bytes;
            (*block).jobs = jobs.len() as u64;
            for (k, job) in jobs.iter().enumerate().take(HOT_MAX_JOBS) {
                (*block).bad[k] = NONE;
                let n = job.count;
                if let RowMem::Host { ptr, .. } = job.idx {
                    let to = (*block).index.as_mut_ptr().add(at);
                    std::ptr::copy_nonoverlapping(ptr.cast::<u64>(), to, n);
                }
                let hot = job.hot;
                (*block).job[k] = [
                    job.pool.addr(),
                    job.pool.len() as u64 / row_bytes,
                    at as u64,
                    n as u64,
                    job.rows.addr(),
                    0,
                    hot.map_or(0, |h| h.rows.addr()),
                    hot.map_or(0, |h| h.hot_rows),
                    hot.map_or(0, |h| h.index.addr()),
                    hot.map_or(0, |h| h.index.len as u64 / 8 - 1),
                    hot.map_or(1, |h| u64::from(h.probes)),
                    0,
                ];
                at += n;
            }
            (*block).rows = at as u64;
        }
        fence(Ordering::Release);
        at as u64
    }
}

impl CudaStreamBackend {
    /// Serves `jobs` through the stream's resident kernel (launched where it is not there),
    /// and waits for the answer.
    ///
    /// # Safety
    /// The pools and the host index lists stay valid (the pools registered with this device)
    /// until the call returns; the jobs hold at most `RESIDENT_MAX_ROWS` indices in host
    /// memory and `HOT_MAX_JOBS` jobs, all of rows of one size, every range checked. Nothing
    /// but resident calls runs on this stream.
    pub(crate) unsafe fn serve_resident(
        &self,
        jobs: &[RowJob<'_>],
        linger: Duration,
    ) -> Result<RowsDone> {
        self.shared.bind()?;
        let mut held = self.resident.0.lock_unpoisoned();
        if held.is_none() {
            *held = Some(ResidentBlock::new(&self.shared)?);
        }
        let Some(block) = held.as_mut() else {
            unreachable!("set above")
        };
        let row_bytes = jobs.first().map_or(1, |j| j.row_bytes) as u64;
        let addrs = jobs.iter().flat_map(|j| {
            let hot = j.hot.map_or(0, |h| h.rows.addr());
            [j.pool.addr(), j.rows.addr(), hot]
        });
        let (_, width) = widest_piece(row_bytes, addrs);
        // SAFETY: the caller's contract; the kernel is idle (every earlier call answered).
        let rows = unsafe { block.write(jobs, width, row_bytes) };
        let seen = block.posted;
        let seq = ((seen >> COUNT_BITS) + 1) << COUNT_BITS | rows;
        block.posted = seq;
        // Once posted, the kernel may be reading the pools: every way out stops it and waits
        // for the stream before the borrows end.
        let sent_home = block.mem.sent_home.load(Ordering::Acquire);
        let fresh = block
            .answered
            .take()
            .is_some_and(|(t, sent)| sent == sent_home && t.elapsed() + LINGER_MARGIN < linger);
        let mem = &*block.mem;
        let stopper = StopOnDrop(Some((self, mem)));
        mem.post(seq);
        if !fresh {
            self.launch_if_idle(mem, seen, seq, linger)?;
        }
        let mut asked = Instant::now();
        while mem.done() != seq {
            if asked.elapsed() >= QUERY_EVERY {
                self.launch_if_idle(mem, seen, seq, linger)?;
                asked = Instant::now();
            }
            std::hint::spin_loop();
        }
        std::mem::forget(stopper);
        let mut first = 0u64;
        let mut bad_index = None;
        for (k, job) in jobs.iter().enumerate() {
            bad_index = bad_index.or(mem.bad(k).map(|at| first + at));
            first += job.count as u64;
        }
        block.answered = Some((Instant::now(), sent_home));
        Ok(RowsDone {
            bad_index,
            device_time: None,
        })
    }

    /// Launches the kernel for call `seq` (the last answered: `seen`) where the stream is idle
    /// and the call unanswered (the kernel left, or was never there). An error the stream ran
    /// into is returned.
    fn launch_if_idle(
        &self,
        block: &CallMemory,
        seen: u64,
        seq: u64,
        linger: Duration,
    ) -> Result<()> {
        // SAFETY: the stream is live and its context bound (serve_resident).
        if !unsafe { driver::stream_query(self.raw()) }? || block.done() == seq {
            return Ok(());
        }
        let func = self.shared.function(GatherKernel::ResidentRows)?;
        let config = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (RESIDENT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let linger_ns = u64::try_from(linger.as_nanos()).unwrap_or(u64::MAX);
        let mut launch = self.stream.launch_builder(&func);
        launch.arg(&block.device).arg(&seen).arg(&linger_ns);
        // SAFETY: the arguments match gpuio_resident_rows(gpuio_resident_call*, u64, u64): the
        // block's device address (mapped, live while the stream is). The kernel reads calls
        // the host wrote from checked jobs (serve_resident's contract), each answered before
        // its borrows end; the stream runs nothing else.
        unsafe { launch.launch(config) }
            .map(drop)
            .map_err(cuda_err("cuLaunchKernel(gpuio_resident_rows)"))
    }
}

/// On a way out before the answer: sends the kernel home and waits for the stream, so that
/// nothing reads or writes the call's memory after the call returns.
struct StopOnDrop<'a>(Option<(&'a CudaStreamBackend, &'a CallMemory)>);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        if let Some((stream, block)) = self.0.take() {
            block.post(STOP);
            if let Err(e) = stream.stream.synchronize() {
                tracing::error!(error = %e, "waiting for the resident kernel failed");
            }
        }
    }
}
