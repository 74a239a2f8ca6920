//! The resident row server's host side (`resident::ResidentOp`'s CUDA side): a call block in
//! mapped host memory (resident.cu's `gpuio_resident_call`), and the one-block kernel that
//! serves it on this stream, launched when a call finds it gone.
//!
//! A call writes its jobs and indices into the block, then its number word (its number times
//! 2048 plus its index count, which the kernel reads with the number); it waits until the
//! block's `done` word holds that word. The kernel leaves after the server's linger without
//! a call, or once the stop word has grown and no call waits; a call that finds the stream
//! idle with its number unanswered launches it again. The stop word grows on the server's drop
//! and before every wait of gpuio's for the whole device ([`send_home`]: a context
//! synchronize, a free or unregistration of memory), which would otherwise last the linger.

use super::driver::{self, cuda_err};
use super::hot_jobs::{HotJobWords, JOB_WORDS};
use super::stream::CudaStreamBackend;
use crate::error::Result;
use crate::gpu::backend::{RowJob, RowMem, RowsDone};
use crate::gpu::hot_jobs::HOT_MAX_JOBS;
use crate::gpu::resident::RESIDENT_MAX_ROWS;
use crate::gpu::widest_piece;
use crate::kernels::GatherKernel;
use crate::sync::MutexExt;
use cudarc::driver::sys::CUdevice;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The kernel's block size (resident.cu's `GPUIO_RESIDENT_THREADS`): 64 rows of 656 B in two
/// rounds of loads. At 116 registers a thread (sm_90) it holds most of one multiprocessor's
/// register file while it stays: one of an H200's 132.
const RESIDENT_THREADS: u32 = 512;
/// A number word's index count bits (resident.cu's `% 2048`).
const COUNT_BITS: u32 = 11;
const _: () = assert!(RESIDENT_MAX_ROWS < 1 << COUNT_BITS);
/// "No bad index" (what the kernel's `atomicMin` lowers).
const NONE: u64 = u64::MAX;
/// How often a waiting call asks the driver whether the stream is idle (the kernel gone, or
/// failed).
const QUERY_EVERY: Duration = Duration::from_micros(20);
/// Past this, a waiting call yields its core between looks (a busy device: the block is
/// not running yet).
const SPIN_FOR: Duration = Duration::from_millis(1);
/// Within this much of its linger since its last answer, the kernel may have left: a call
/// asks the driver before posting rather than wait `QUERY_EVERY` to find out.
const LINGER_MARGIN: Duration = Duration::from_micros(100);

/// The call block, as resident.cu's `gpuio_resident_call` (its size and offsets asserted there
/// too).
#[repr(C)]
struct CallBlock {
    seq: u64,
    stop: u64,
    _unused0: [u64; 14],
    done: u64,
    bad: [u64; HOT_MAX_JOBS],
    _unused1: [u64; 7],
    width: u64,
    row_bytes: u64,
    jobs: u64,
    rows: u64,
    job: [[u64; JOB_WORDS]; HOT_MAX_JOBS],
    index: [u64; RESIDENT_MAX_ROWS],
}

const _: () = assert!(size_of::<CallBlock>() == 288 + 96 * HOT_MAX_JOBS + 8 * RESIDENT_MAX_ROWS);
const _: () = assert!(offset_of!(CallBlock, stop) == 8);
const _: () = assert!(offset_of!(CallBlock, done) == 128);
const _: () = assert!(offset_of!(CallBlock, bad) == 136);
const _: () = assert!(offset_of!(CallBlock, width) == 256);
const _: () = assert!(offset_of!(CallBlock, job) == 288);
const _: () = assert!(offset_of!(CallBlock, index) == 288 + 96 * HOT_MAX_JOBS);

/// A call block in mapped host memory: freed on drop, once its stream has drained.
pub(crate) struct CallMemory {
    host: *mut CallBlock,
    device: u64,
    /// The GPU whose kernel reads it.
    gpu: CUdevice,
}

// SAFETY: the pointer is to page-locked memory this value alone owns (until Drop). The call
// words are written only by the stream's resident lock holder; the stop word by anyone, and
// it and the number, done and report words only through atomics.
unsafe impl Send for CallMemory {}
// SAFETY: as above.
unsafe impl Sync for CallMemory {}

impl CallMemory {
    fn new(gpu: CUdevice) -> Result<Self> {
        let host = driver::mem_host_alloc_mapped(size_of::<CallBlock>())?.cast::<CallBlock>();
        // SAFETY: `host` starts a fresh allocation of a CallBlock's size, used by nothing yet.
        let device = unsafe { driver::mem_host_get_device_pointer(host.cast()) };
        let device = device.inspect_err(|_| {
            // SAFETY: allocated just above, freed once, used by nothing.
            let _ = unsafe { driver::mem_free_host(host.cast()) };
        })?;
        // SAFETY: as above; the block's words start at "nothing posted, answered or stopped".
        unsafe {
            (*host).seq = 0;
            (*host).stop = 0;
            (*host).done = 0;
        }
        Ok(Self { host, device, gpu })
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

    /// The stop word: the kernel leaves once it differs from its launch's and no call waits.
    fn stop_word(&self) -> &AtomicU64 {
        self.word(offset_of!(CallBlock, stop))
    }

    /// Asks the kernel to leave once no call waits.
    fn send_home(&self) {
        self.stop_word().fetch_add(1, Ordering::SeqCst);
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
        // The free waits for the device: other servers' kernels would hold it.
        let _waiting = send_home(self.gpu);
        // SAFETY: allocated by mem_host_alloc_mapped, freed once; the stream that owned it
        // sent its kernel home and drained first.
        if let Err(e) = unsafe { driver::mem_free_host(self.host.cast()) } {
            tracing::error!(error = %e, "freeing a resident call block failed");
        }
    }
}

/// Every resident server's call block in the process, by device (a device's primary context
/// is the process's, whichever probe opened it).
static DEVICES: Mutex<Vec<(CUdevice, Vec<std::sync::Weak<CallMemory>>)>> = Mutex::new(Vec::new());
/// Whether any server ever made a block: until then a wait raises no stop word.
static ANY: AtomicBool = AtomicBool::new(false);
/// Waits for a whole device in progress, on any device: while above 0, a block launched
/// serves its call and leaves at once (no linger). Counted before `ANY` is read and any stop
/// word raised, so that a launch during a wait either sees the count or is sent home.
static WAITS: AtomicUsize = AtomicUsize::new(0);

/// `gpu`'s blocks, with the dead ones dropped.
fn blocks(
    devices: &mut Vec<(CUdevice, Vec<std::sync::Weak<CallMemory>>)>,
    gpu: CUdevice,
) -> &mut Vec<std::sync::Weak<CallMemory>> {
    let at = match devices.iter().position(|(d, _)| *d == gpu) {
        Some(at) => at,
        None => {
            devices.push((gpu, Vec::new()));
            devices.len() - 1
        }
    };
    let blocks = &mut devices[at].1;
    blocks.retain(|w| w.strong_count() > 0);
    blocks
}

/// Sends every resident kernel of `gpu` home, before a wait of gpuio's for the whole device
/// (a context synchronize; a free or unregistration of memory, which waits for the device's
/// kernels): it would otherwise last until they leave by themselves. A call waiting is served
/// first. Hold the guard over the wait: a kernel launched meanwhile serves its call and leaves.
#[must_use = "held over the wait"]
pub(super) fn send_home(gpu: CUdevice) -> Waiting {
    // A forked child's blocks are the parent's memory, which it must not touch.
    if super::probe::driver_forked() {
        return Waiting(false);
    }
    WAITS.fetch_add(1, Ordering::SeqCst);
    if !ANY.load(Ordering::SeqCst) {
        return Waiting(true);
    }
    let live: Vec<Arc<CallMemory>> = {
        let mut devices = DEVICES.lock_unpoisoned();
        blocks(&mut devices, gpu)
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect()
    };
    // Outside the lock: dropping the last reference to a block frees it, which comes here.
    for mem in live {
        mem.send_home();
    }
    Waiting(true)
}

/// A wait for a whole device in progress ([`send_home`]).
pub(super) struct Waiting(bool);

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.0 {
            WAITS.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A stream's call block and what the host knows of its kernel.
pub(crate) struct ResidentBlock {
    mem: Arc<CallMemory>,
    /// The last number word posted (and answered: calls hold the lock until answered).
    posted: u64,
    /// When the last answer came, if the kernel may still be there.
    answered: Option<Instant>,
    /// The stop word the kernel last launched was given.
    launched_with: Option<u64>,
}

/// A stream's resident block, made on a first call.
#[derive(Default)]
pub(super) struct StreamResident(Mutex<Option<ResidentBlock>>);

impl StreamResident {
    /// Sends the kernel home (a stream about to be drained), and gives the block for its
    /// Drop to free after the drain.
    pub(super) fn stop(&mut self) -> Option<ResidentBlock> {
        let block = self.0.get_mut_unpoisoned().take()?;
        block.mem.send_home();
        Some(block)
    }

    /// The block, untouched (a forked child's: the parent's memory).
    pub(super) fn take(&mut self) -> Option<ResidentBlock> {
        self.0.get_mut_unpoisoned().take()
    }
}

impl ResidentBlock {
    /// A block for `gpu`, known to its waits ([`send_home`]).
    fn new(gpu: CUdevice) -> Result<Self> {
        let mem = Arc::new(CallMemory::new(gpu)?);
        blocks(&mut DEVICES.lock_unpoisoned(), gpu).push(Arc::downgrade(&mem));
        ANY.store(true, Ordering::SeqCst);
        Ok(Self {
            mem,
            posted: 0,
            answered: None,
            launched_with: None,
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
                if let RowMem::Host { ptr, .. } = job.idx {
                    let to = (*block).index.as_mut_ptr().add(at);
                    std::ptr::copy_nonoverlapping(ptr.cast::<u64>(), to, job.count);
                }
                // The job's list is at its position in the block's (err: unused, `bad[k]`).
                (*block).job[k] = HotJobWords::of(job, row_bytes, at as u64, 0).words();
                at += job.count;
            }
            (*block).rows = at as u64;
        }
        fence(Ordering::Release);
        at as u64
    }
}

impl CudaStreamBackend {
    /// Serves `jobs` through the stream's resident kernel (launched where it is not there),
    /// and waits for the answer; counts the kernel's launches in `launches`.
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
        launches: &AtomicU64,
    ) -> Result<RowsDone> {
        self.shared.bind()?;
        let mut held = self.resident.0.lock_unpoisoned();
        if held.is_none() {
            *held = Some(ResidentBlock::new(self.shared.device)?);
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
        // Still there: answered lately, and not sent home since its launch.
        let stop = block.mem.stop_word().load(Ordering::Acquire);
        let recent = block
            .answered
            .take()
            .is_some_and(|t| t.elapsed() + LINGER_MARGIN < linger);
        let fresh = recent && block.launched_with == Some(stop);
        let mem = &*block.mem;
        let launch = Launch {
            stream: self,
            mem,
            seen,
            seq,
            linger,
            launches,
        };
        let mut launched_with = block.launched_with;
        // Once posted, the kernel may be reading the pools: every way out sends it home and
        // waits for the stream before the borrows end.
        let guard = StopOnDrop(Some((self, mem)));
        mem.post(seq);
        if !fresh {
            launched_with = launch.if_idle()?.or(launched_with);
        }
        let (start, mut asked) = (Instant::now(), Instant::now());
        while mem.done() != seq {
            if asked.elapsed() >= QUERY_EVERY {
                launched_with = launch.if_idle()?.or(launched_with);
                asked = Instant::now();
            }
            if start.elapsed() < SPIN_FOR {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        std::mem::forget(guard);
        let mut first = 0u64;
        let mut bad_index = None;
        for (k, job) in jobs.iter().enumerate() {
            bad_index = bad_index.or(mem.bad(k).map(|at| first + at));
            first += job.count as u64;
        }
        block.answered = Some(Instant::now());
        block.launched_with = launched_with;
        Ok(RowsDone {
            bad_index,
            device_time: None,
        })
    }
}

/// What launching the kernel for one call takes.
struct Launch<'a> {
    stream: &'a CudaStreamBackend,
    mem: &'a CallMemory,
    /// The last number word answered, and the call's.
    seen: u64,
    seq: u64,
    linger: Duration,
    launches: &'a AtomicU64,
}

impl Launch<'_> {
    /// Launches the kernel where the stream is idle and the call unanswered (the kernel left,
    /// or was never there); the stop word it was given. An error the stream ran into is
    /// returned.
    fn if_idle(&self) -> Result<Option<u64>> {
        let s = self.stream;
        // SAFETY: the stream is live and its context bound (serve_resident).
        if !unsafe { driver::stream_query(s.raw()) }? || self.mem.done() == self.seq {
            return Ok(None);
        }
        let func = s.shared.function(GatherKernel::ResidentRows)?;
        let config = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (RESIDENT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // The stop word first: `send_home` counts its wait before it raises the word, so a
        // launch that takes the raised word also sees the wait and does not linger; one that
        // takes the word before it leaves when it sees it raised. (The other order would let a
        // launch take both the raised word and no wait, and hold the wait for its linger.) A
        // block made during a wait, which raised no stop word for it, sees the count too.
        let stopped = self.mem.stop_word().load(Ordering::SeqCst);
        let linger = if WAITS.load(Ordering::SeqCst) > 0 {
            Duration::ZERO
        } else {
            self.linger
        };
        let linger_ns = u64::try_from(linger.as_nanos()).unwrap_or(u64::MAX);
        let mut launch = s.stream.launch_builder(&func);
        launch
            .arg(&self.mem.device)
            .arg(&self.seen)
            .arg(&stopped)
            .arg(&linger_ns);
        // SAFETY: the arguments match gpuio_resident_rows(gpuio_resident_call*, u64, u64,
        // u64): the block's device address (mapped, live while the stream is). The kernel
        // reads calls the host wrote from checked jobs (serve_resident's contract), each
        // answered before its borrows end; the stream runs nothing else.
        unsafe { launch.launch(config) }
            .map_err(cuda_err("cuLaunchKernel(gpuio_resident_rows)"))?;
        self.launches.fetch_add(1, Ordering::Relaxed);
        Ok(Some(stopped))
    }
}

/// On a way out before the answer: sends the kernel home and waits for the stream, so that
/// nothing reads or writes the call's memory after the call returns.
struct StopOnDrop<'a>(Option<(&'a CudaStreamBackend, &'a CallMemory)>);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        if let Some((stream, mem)) = self.0.take() {
            mem.send_home();
            if let Err(e) = stream.stream.synchronize() {
                tracing::error!(error = %e, "waiting for the resident kernel failed");
            }
        }
    }
}
