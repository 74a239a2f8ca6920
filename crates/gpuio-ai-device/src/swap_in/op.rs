//! A device-planned load as an op run in three stages ([`Stage`]): on a GPU, the control words'
//! upload, the fetch kernel, then the report's download and the install kernel (and, where the
//! call prefetches, both kernels again over the entries ahead with that report's download),
//! each queued (`kernels/ai.cu`), the table reading the report once the download's event has
//! passed; on the host backend, the fetch stage plans each job (`plan.rs`) and copies its
//! codes, then the same for the prefetch, done when it returns. Also the job table's layout,
//! as both sides read it.

use super::plan::{HostPlan, plan_on_host, state_words};
use super::{JOB_BYTES, SwapInLoad, bad, swap_in_state_len};
use crate::kernels::AiKernel;
use gpuio_hal::error::{HalError, Result, check_range};
use gpuio_hal::gpu::tiered::{self, copy_tiered};
use gpuio_hal::gpu::{
    Access, CudaRun, DevArg, DeviceOp, Event, HostArg, HostRun, KernelArgs, LaunchShape,
};
use gpuio_hal::gpu::{WaitOnDrop, widest_piece};
use gpuio_hal::memory::HostBuffer;
use std::cell::RefCell;
use std::mem::offset_of;
use std::time::{Duration, Instant};

/// The fetch's block, its warps (ai.cu's `GPUIO_SWAP_FETCH_THREADS`,
/// `GPUIO_SWAP_FETCH_ENTRIES`) and the row pieces a warp copies (`GPUIO_SWAP_CHUNK_PIECES`):
/// a warp per chunk of a row.
const FETCH_THREADS: u32 = 256;
const FETCH_ENTRIES: u64 = FETCH_THREADS as u64 / 32;
const CHUNK_PIECES: u64 = 4 * 32;
/// Calls of at most this many jobs pass their control words in the fetch's parameters
/// (ai.cu's `gpuio_swap_inline`, 8 + 16 bytes a job): a queued fetch then waits for no upload.
pub(super) const INLINE_JOBS: usize = 16;
const INLINE_BYTES: usize = 8 + 16 * INLINE_JOBS;
const _: () = assert!(INLINE_BYTES == 264);
/// The install's block, one per job (ai.cu's `GPUIO_SWAP_THREADS`).
const INSTALL_THREADS: u32 = 1024;

/// One job of the table the kernels read: ai.cu's `gpuio_swap_job`, whose size and offsets
/// are asserted there too.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct SwapJob {
    /// The selection: u32 positions.
    pub(super) selection: u64,
    /// The job's control words in the table (the layer's length; the count and the entries
    /// ahead, a u32 each), uploaded per call.
    pub(super) control: u64,
    /// The state: step, bad flag, slot per position, position and last step per slot.
    pub(super) state: u64,
    /// Warm row 0, as the device reaches the pinned pool, and the warm row of position 0.
    pub(super) warm: u64,
    pub(super) warm_first: u64,
    /// The hot buffer (`slots` rows) and the destination (`max_count` rows).
    pub(super) hot: u64,
    pub(super) dst: u64,
    /// The job's staging rows and its copy of the selection (`max_count` each) in the table.
    pub(super) staging: u64,
    pub(super) seen: u64,
    pub(super) positions: u32,
    pub(super) slots: u32,
    pub(super) max_count: u32,
    pub(super) unused: u32,
}

const _: () = assert!(size_of::<SwapJob>() == JOB_BYTES);
const _: () = assert!(offset_of!(SwapJob, selection) == 0);
const _: () = assert!(offset_of!(SwapJob, control) == 8);
const _: () = assert!(offset_of!(SwapJob, state) == 16);
const _: () = assert!(offset_of!(SwapJob, warm) == 24);
const _: () = assert!(offset_of!(SwapJob, warm_first) == 32);
const _: () = assert!(offset_of!(SwapJob, hot) == 40);
const _: () = assert!(offset_of!(SwapJob, dst) == 48);
const _: () = assert!(offset_of!(SwapJob, staging) == 56);
const _: () = assert!(offset_of!(SwapJob, seen) == 64);
const _: () = assert!(offset_of!(SwapJob, positions) == 72);
const _: () = assert!(offset_of!(SwapJob, slots) == 76);
const _: () = assert!(offset_of!(SwapJob, max_count) == 80);
const _: () = assert!(offset_of!(SwapJob, unused) == 84);

impl SwapJob {
    /// Its bytes as the device reads them: little-endian, in field order (the offsets
    /// asserted above).
    pub(super) fn to_le_bytes(self) -> [u8; JOB_BYTES] {
        let mut out = [0; JOB_BYTES];
        let words = [
            self.selection,
            self.control,
            self.state,
            self.warm,
            self.warm_first,
            self.hot,
            self.dst,
            self.staging,
            self.seen,
        ];
        for (b, w) in out.chunks_exact_mut(8).zip(words) {
            b.copy_from_slice(&w.to_le_bytes());
        }
        let halves = [self.positions, self.slots, self.max_count, self.unused];
        for (b, h) in out[72..].chunks_exact_mut(4).zip(halves) {
            b.copy_from_slice(&h.to_le_bytes());
        }
        out
    }
}

/// One job of a checked call.
pub(super) struct Part<'a> {
    pub(super) hot: DevArg<'a>,
    pub(super) state: DevArg<'a>,
    pub(super) selection: DevArg<'a>,
    /// The destination's `max_count` rows.
    pub(super) dst: DevArg<'a>,
    /// The job's staging rows in the table (`max_count`): where the host backend's prefetch
    /// puts its rows, which go nowhere else.
    pub(super) staging: DevArg<'a>,
    /// Pinned host memory.
    pub(super) warm: HostArg<'a>,
    /// This call's length, count and entries ahead (also in the control words the call
    /// uploads).
    pub(super) load: SwapInLoad,
    pub(super) positions: u64,
    pub(super) slots: usize,
    pub(super) warm_first: u64,
}

/// The part of a load one run of the op queues on a GPU: the control words' upload, the fetch,
/// then the report's download and the install (and the prefetch's fetch, download and
/// install, where the call has entries ahead). A queued call runs the first and the last on
/// the table's side stream, so that only the fetch lies on the caller's; a call that waits runs
/// all three on its stream. On the host backend the fetch stage does the whole load and the
/// others nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    Control,
    Fetch,
    Tail,
}

/// A stage as the op leaves it.
pub(super) enum Ran {
    /// The host backend's whole load: the report words (1 + 2 per job), the prefetch's where
    /// it ran, and, when asked, the time.
    Done {
        report: Vec<u64>,
        prefetched: Option<Vec<u64>>,
        device_time: Option<Duration>,
    },
    /// Queued on a GPU: the stage's end (the upload's, the fetch's, the install's: timing
    /// events where timed); the report's arrival in the table's pinned words (the tail); the
    /// fetch's start (a timed fetch).
    Queued {
        end: Event,
        fetched: Option<Event>,
        start: Option<Event>,
    },
    /// Nothing for this backend to do in this stage.
    Nothing,
}

/// A checked load: `table` holds the jobs (from 0), the control words (from `control_at`,
/// uploaded from `control`), the report words (from `report_at`: the call's first failure,
/// each job's first failure, each job's hits and misses) and the staging rows (from
/// `staging_at`).
pub(super) struct Load<'a> {
    pub(super) stage: Stage,
    pub(super) row_bytes: usize,
    pub(super) table: DevArg<'a>,
    /// Pinned: each job's length, then its count | entries ahead << 32, 16 bytes a job.
    pub(super) control: &'a HostBuffer,
    /// Pinned: where the report words are downloaded (1 + 2 per job), then the prefetch's.
    pub(super) report_host: RefCell<&'a mut [u8]>,
    pub(super) control_at: usize,
    pub(super) report_at: usize,
    pub(super) staging_at: usize,
    pub(super) parts: Vec<Part<'a>>,
    /// Time the fetch (events around it).
    pub(super) timed: bool,
}

impl DeviceOp for Load<'_> {
    type Output = Ran;

    fn host(&self, host: &HostRun<'_>) -> Result<Ran> {
        if self.stage != Stage::Fetch {
            return Ok(Ran::Nothing);
        }
        let t = Instant::now();
        let report = self.plan_on_host(host, 0)?;
        let device_time = self.timed.then(|| t.elapsed());
        let prefetched = self.prefetches().then(|| self.plan_on_host(host, 1));
        Ok(Ran::Done {
            report,
            prefetched: prefetched.transpose()?,
            device_time,
        })
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<Ran> {
        let rb = self.row_bytes as u64;
        let jobs = self.parts.len();
        let staging = self.table.addr() + self.staging_at as u64;
        let starts = self
            .parts
            .iter()
            .flat_map(|p| [p.hot.addr(), p.warm.addr(), p.dst.addr()])
            .chain([staging]);
        let (_, width) = widest_piece(rb, starts);
        let report = self.table.part(self.report_at, 8 * (1 + 2 * jobs))?;
        // The job count, then each job's length and count | ahead << 32 (the pinned control
        // words, as the upload sends them); all zeros past INLINE_JOBS jobs.
        let mut inline = [0u8; INLINE_BYTES];
        if jobs <= INLINE_JOBS && self.control.len() >= 16 * jobs {
            inline[..8].copy_from_slice(&(jobs as u64).to_le_bytes());
            inline[8..8 + 16 * jobs].copy_from_slice(&self.control[..16 * jobs]);
        }
        // The install's arguments, then the fetch's: the same and the inline control words.
        let args = |phase: u64| {
            KernelArgs::new()
                .ptr(&self.table)
                .u64(rb)
                .u64(width)
                .ptr(&report)
                .u64(phase)
        };
        let fetch_args = |phase: u64| args(phase).bytes(&inline);
        // A warp per chunk of an entry's row (ai.cu's GPUIO_SWAP_CHUNK_PIECES); phase 0's
        // also copy the entries ahead aside, a warp each.
        let chunks = (rb / width).div_ceil(CHUNK_PIECES);
        let fetch = |phase: u64| {
            let entries = |p: &Part<'_>| match phase {
                0 => p.load.count.max(p.load.ahead),
                _ => p.load.ahead,
            };
            let most = self.parts.iter().map(entries).max().unwrap_or(0) as u64;
            LaunchShape {
                grid: (most * chunks).div_ceil(FETCH_ENTRIES).max(1) as u32,
                grid_y: jobs as u32,
                block: FETCH_THREADS,
                shared_bytes: 0,
            }
        };
        let install = LaunchShape {
            grid: jobs as u32,
            grid_y: 1,
            block: INSTALL_THREADS,
            shared_bytes: 0,
        };
        let running = WaitOnDrop::new(cuda);
        let ran = match self.stage {
            Stage::Control => {
                let control = self.table.part(self.control_at, 16 * jobs)?;
                if self.control.len() < control.len() {
                    return Err(HalError::InvalidArgument(
                        "swap-in: control words shorter than their jobs".into(),
                    ));
                }
                // SAFETY: the control words are 16 bytes a job of the table's pinned memory,
                // which it rewrites only in its next call, after the install queued behind
                // this copy; the destination is the table's control range (its layout).
                unsafe { cuda.upload(self.control.base_ptr(), control)? };
                Ran::Queued {
                    end: cuda.record(false)?,
                    fetched: None,
                    start: None,
                }
            }
            Stage::Fetch => {
                let start = self.timed.then(|| cuda.record(true)).transpose()?;
                // SAFETY: matches gpuio_swap_in_fetch(jobs, u64 rb, u64 width, u64* report,
                // u64 phase, gpuio_swap_inline ctl), `inline` laid out as that struct (its
                // size asserted on both sides). The jobs name only ranges the HAL checked and
                // the table keeps alive, and a registered warm pool; the kernel reads
                // selection entries below max_count, follows positions below the length and
                // slots below the job's slots, and writes only the destination's rows (phase
                // 0), those slot words (their marks), the report words and the table's own
                // words (the selection's copy, the staging rows). `width` divides every row
                // and address.
                unsafe { cuda.launch(AiKernel::SwapInFetch, fetch(0), &fetch_args(0))? };
                Ran::Queued {
                    end: cuda.record(self.timed)?,
                    fetched: None,
                    start,
                }
            }
            Stage::Tail => {
                let mut words_at = self.report_host.borrow_mut();
                if words_at.len() < 2 * report.len() {
                    return Err(HalError::InvalidArgument(
                        "swap-in: a report buffer shorter than its words".into(),
                    ));
                }
                // SAFETY: `words_at` is the table's pinned report words, twice the report's
                // length (the load's, then the prefetch's), which the table reads only after
                // `fetched` (below; the prefetch's after the install's end) and lends to its
                // next call only after the install queued behind these copies.
                unsafe { cuda.download(report, words_at.as_mut_ptr())? };
                let fetched = cuda.record(false)?;
                // SAFETY: matches gpuio_swap_in_install(const gpuio_swap_job*, u64 rb, u64
                // width, u64* report, u64 phase). It reads the same jobs, control words, report
                // words and the fetch's copy of the selection, follows only positions and slots
                // inside the state's tables (a victim's position outside them flags the state
                // instead), copies staging rows below max_count into slots below the job's
                // slots, and resets the report words. The table waits for it before it lets
                // the buffers go (the event returned).
                unsafe { cuda.launch(AiKernel::SwapInInstall, install, &args(0))? };
                if self.prefetches() {
                    // SAFETY: as the fetch above, phase 1: the entries ahead from the table's
                    // copy, misses into staging rows only; queued behind the install, which
                    // cleared the load's marks and reset the report words.
                    unsafe { cuda.launch(AiKernel::SwapInFetch, fetch(1), &fetch_args(1))? };
                    let (_, prefetched) = words_at.split_at_mut(report.len());
                    // SAFETY: the second half of the pinned report words (checked above), read
                    // by the table only after the install below has ended.
                    unsafe { cuda.download(report, prefetched.as_mut_ptr())? };
                    // SAFETY: as the install above, phase 1.
                    unsafe { cuda.launch(AiKernel::SwapInInstall, install, &args(1))? };
                }
                Ran::Queued {
                    end: cuda.record(self.timed)?,
                    fetched: Some(fetched),
                    start: None,
                }
            }
        };
        // Everything of the stage is queued: it runs on after the call, the table keeping
        // what it reads and writes alive until the install's end.
        running.disarm();
        Ok(ran)
    }
}

impl Part<'_> {
    /// The entries a phase takes: the load (0) its count from the start, its prefetch (1) the
    /// entries ahead, after the count.
    fn window(&self, phase: u64) -> (usize, usize) {
        match phase {
            0 => (0, self.load.count),
            _ => (self.load.count, self.load.ahead),
        }
    }
}

impl Load<'_> {
    /// Whether any job has entries ahead to prefetch.
    fn prefetches(&self) -> bool {
        self.parts.iter().any(|p| p.load.ahead > 0)
    }

    /// Each job's fetch and install on the CPU (`plan_on_host`, what the kernels do) for
    /// `phase`, then the tiered copy of its codes: into the destination for the load (0), into
    /// the job's staging rows for its prefetch (1). Its report words: the call's first failure,
    /// each job's, each job's counts.
    fn plan_on_host(&self, host: &HostRun<'_>, phase: u64) -> Result<Vec<u64>> {
        let mut uses = Vec::new();
        for p in &self.parts {
            check_part(p, self.row_bytes)?;
            let out = if phase == 0 { p.dst } else { p.staging };
            uses.extend([(p.hot, Access::Write), (p.state, Access::Write)]);
            uses.extend([(p.selection, Access::Read), (out, Access::Write)]);
        }
        let _locks = host.lock(&uses)?;
        let n = self.parts.len();
        let total: usize = self.parts.iter().map(|p| p.window(phase).1).sum();
        let mut codes = vec![u64::MAX; total];
        let (mut report, mut counts) = (vec![u64::MAX; 1 + n], Vec::with_capacity(n));
        let mut copies = Vec::with_capacity(n);
        let mut first = 0;
        for (j, p) in self.parts.iter().enumerate() {
            let words = state_words(p.positions, p.slots);
            let (from, want) = p.window(phase);
            if phase == 1 && want == 0 {
                // Nothing ahead: no prefetch, not a step (as the kernels skip it).
                counts.push(0);
                continue;
            }
            // SAFETY: the state range holds `words` u32s (check_part), 4-aligned (words_at),
            // locked for writing above; the selection range holds `count + ahead` u32s (the
            // table checked `max_count` of them and the call `count + ahead <= max_count`),
            // locked for reading.
            let (state, selection) = unsafe {
                (
                    std::slice::from_raw_parts_mut(words_at(&p.state)?, words),
                    std::slice::from_raw_parts(words_at(&p.selection)?, from + want),
                )
            };
            let mine = &mut codes[first..first + want];
            let shape = HostPlan {
                positions: p.positions as usize,
                slots: p.slots,
                len: p.load.len,
                warm_first: p.warm_first,
                job: j,
                first_entry: from as u64,
                want: (p.load.count + p.load.ahead) as u64,
            };
            let out = if phase == 0 { p.dst } else { p.staging };
            let out = out.part(from * self.row_bytes, want * self.row_bytes)?;
            let (count, stats) = match plan_on_host(state, &selection[from..], mine, &shape) {
                Ok((hits, misses)) => (want, hits as u64 | (misses as u64) << 32),
                Err(word) => {
                    report[0] = report[0].min(word);
                    report[1 + j] = word;
                    (0, 0)
                }
            };
            counts.push(stats);
            copies.push(tiered::TieredPart {
                hot: p.hot,
                warm: p.warm,
                dst: out,
                first,
                count,
            });
            first += want;
        }
        // Refused jobs copy nothing (count 0); a code outside its tier cannot come from the
        // plan, which checks every index it follows.
        // SAFETY: the warm pools are borrowed by this op; the hot and destination ranges are
        // locked for writing above, and disjoint (the table checked).
        if let Some(i) = unsafe { copy_tiered(&copies, &codes, self.row_bytes) } {
            return Err(HalError::InvalidArgument(format!(
                "swap-in: code {i} names a row outside its tier"
            )));
        }
        report.extend(counts);
        Ok(report)
    }
}

/// Checks a call's shape against the host's reading of the parts.
fn check_part(p: &Part<'_>, row_bytes: usize) -> Result<()> {
    let rows = p.load.count + p.load.ahead;
    check_range("swap-in destination", 0, rows * row_bytes, p.dst.len())?;
    check_range("swap-in staging", 0, rows * row_bytes, p.staging.len())?;
    if p.selection.len() < 4 * rows {
        return bad("a selection shorter than its count and the entries ahead".into());
    }
    if p.state.len() < swap_in_state_len(p.positions, p.slots).unwrap_or(usize::MAX) {
        return bad("a state shorter than its tables".into());
    }
    Ok(())
}

/// The range of `r` the host may take as u32s: its address, 4-aligned.
fn words_at(r: &DevArg<'_>) -> Result<*mut u32> {
    if !r.addr().is_multiple_of(4) {
        return bad("a state or selection that is not 4-aligned".into());
    }
    Ok(r.host_ptr().cast::<u32>())
}
