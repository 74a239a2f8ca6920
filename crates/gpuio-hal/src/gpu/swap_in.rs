//! Device-planned tiered loads: HiSparse's hot buffer, refilled by a swap-in the device plans.
//!
//! A job is one request's layer: a top-k selection of positions in device memory (as the
//! model's indexer leaves it there), a hot buffer of slots, a state in device memory (each
//! position's slot, each slot's position and last step) and the layer's entries in pinned
//! host memory (position `p` at warm row `warm_first + p`). A load is two kernels
//! (`kernels/ai.cu`), because only the first is on the critical path:
//!
//! - the **fetch** looks every selected position up and copies its row into the output —
//!   from its slot on a hit, from host memory on a miss (and into the job's staging rows) —
//!   with many blocks per job; the call waits for it and reads each job's counts;
//! - the **install** then gives each miss a slot — the slot selected longest ago, never one
//!   this step selects — and copies its row there from staging. It runs on after the call
//!   returns, overlapping whatever the caller does next; the table's next call, its drop
//!   and [`SwapInTable::wait`] wait for it.
//!
//! The jobs' descriptions are written to the device once, by [`Stream::swap_in_table`]; a
//! call uploads only each job's layer length and selection count. The host backend runs the
//! same steps in Rust ([`plan_on_host`]): the two leave the same states, which the GPU tests
//! check step by step against a model.
//!
//! Victims are exact LRU up to 255 steps of age; older slots count as equally old, lower slots
//! first. A selection must not hold a position twice or a position past the layer's length:
//! that job is refused — it installs nothing (its hits are marked used) and its output may
//! hold some of its rows — while the call's other jobs are loaded; the call reports each
//! job's outcome, counts or refusal.

use super::backend::{DevRange, EventBackend, RowMem, SwapInLaunch, SwapInPart};
use super::{DeviceBuffer, Stream};
use crate::ai::{TIER_MAX_JOBS, TIER_MAX_WARM_ROWS, check_disjoint};
use crate::error::{HalError, Result, check_range};
use crate::memory::{HostAllocOptions, HostBuffer};
use std::time::Duration;

/// Most positions one selection may hold (the install keeps its misses in shared memory).
pub const SWAP_IN_MAX_SELECTION: usize = 4096;
/// Most slots one job's hot buffer may have (the install keeps every slot's state in its
/// threads' registers).
pub const SWAP_IN_MAX_SLOTS: usize = 8192;
/// The largest row a device-planned load moves: the kernels count a job's row pieces in 32
/// bits.
pub const SWAP_IN_MAX_ROW_BYTES: usize = 256 << 10;
/// A position with no slot, a slot with no position.
pub(crate) const NONE: u32 = u32::MAX;
/// A position the fetch found missing, before the install gives it a slot.
const PENDING: u32 = u32::MAX - 1;
/// The fetch's mark on a hit's slot word (slots are below 2^13; NONE and PENDING carry it).
const SEL: u32 = 1 << 30;
/// Bytes of one job in the table (ai.cu's `gpuio_swap_job`).
const JOB_BYTES: usize = 88;
/// Ages are counted up to this many steps.
const OLDEST: u32 = 255;
/// The failures, in the order the first is reported.
const PAST_LEN: u64 = 0;
const TWICE: u64 = 1;
const TOO_MANY: u64 = 2;
const EXHAUSTED: u64 = 3;
const CORRUPT: u64 = 4;

/// Bytes of a job's state for `positions` positions and `slots` slots: a step counter and a
/// bad-state flag, then a u32 slot per position, a u32 position per slot and a u32 last step
/// per slot. `None` where that overflows.
pub fn swap_in_state_len(positions: u64, slots: usize) -> Option<usize> {
    let words = usize::try_from(positions)
        .ok()?
        .checked_add(slots.checked_mul(2)?)?
        .checked_add(2)?;
    words.checked_mul(4)
}

/// One job of a device-planned load, as [`Stream::swap_in_table`] records it.
#[derive(Debug, Clone, Copy)]
pub struct SwapInJob<'a> {
    /// The hot buffer: `slots` rows from its start.
    pub hot: &'a DeviceBuffer,
    /// Slots in the hot buffer (at most [`SWAP_IN_MAX_SLOTS`]).
    pub slots: usize,
    /// The job's state ([`swap_in_state_len`] bytes from its start), reset by
    /// [`Stream::swap_in_reset`] before its first load.
    pub state: &'a DeviceBuffer,
    /// Positions the state tracks (the layer's capacity, at most `u32::MAX - 1`).
    pub positions: u64,
    /// The layer's entries, pinned: position `p` is warm row `warm_first + p`.
    pub warm: &'a HostBuffer,
    /// The warm row of position 0.
    pub warm_first: u64,
    /// The selection: up to `max_count` little-endian u32 positions from its start.
    pub selection: &'a DeviceBuffer,
    /// The largest selection a call may pass (at most `slots` and
    /// [`SWAP_IN_MAX_SELECTION`]). The table keeps as many rows of device memory per job
    /// for the misses on their way to their slots.
    pub max_count: usize,
    /// Where the entries go: `count` rows from `dst_offset`.
    pub dst: &'a DeviceBuffer,
    /// Byte offset in `dst`.
    pub dst_offset: usize,
}

/// What one call asks of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapInLoad {
    /// The layer's length: positions at or past it are refused.
    pub len: u64,
    /// Positions in the selection this call.
    pub count: usize,
}

/// What one job's load did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SwapInCounts {
    /// Selected positions found in a slot.
    pub hits: usize,
    /// Positions read from host memory (and installed, unless the install found the state
    /// bad and flagged it).
    pub misses: usize,
}

/// Why one job of a call installed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("swap-in: {why}")]
pub struct SwapInRefused {
    /// Whose fault it is: the call's selection, or the job's state.
    pub fault: SwapInFault,
    /// What the fetch found.
    pub why: String,
}

/// What a refused job needs before it loads again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapInFault {
    /// The selection holds a position twice or one past the layer's length (or more
    /// positions than the table allows): the next call with a good selection loads.
    Selection,
    /// The state has run out of steps, or names slots or positions outside its tables:
    /// reset it ([`Stream::swap_in_reset`]) before the job loads again.
    State,
}

/// A call's outcome: each job's counts or why it was refused, and the device's times when
/// asked.
#[derive(Debug, Clone, PartialEq)]
pub struct SwapInDone {
    /// Per job, in the table's order.
    pub jobs: Vec<std::result::Result<SwapInCounts, SwapInRefused>>,
    /// The critical path on the device: the fetch, from its start to its end (CUDA events;
    /// the control words' upload runs just before; on the host backend, the whole call's time
    /// on the CPU).
    pub device_time: Option<Duration>,
    /// From the fetch's end to the install's: the report words' download, then the install
    /// (CUDA events; zero on the host backend). A timed call waits for it.
    pub install_time: Option<Duration>,
}

/// One job as the table keeps it: its buffers (shared handles, alive while the table is) and
/// its warm pool's identity, which every call checks.
#[derive(Debug)]
struct Kept {
    hot: DeviceBuffer,
    state: DeviceBuffer,
    selection: DeviceBuffer,
    dst: DeviceBuffer,
    dst_offset: usize,
    slots: usize,
    positions: u64,
    warm_first: u64,
    warm: (usize, u64, usize),
    max_count: usize,
    /// Its first staging row and entry of the selections' copy.
    first: usize,
}

/// Jobs written to the device once, loaded by [`Stream::swap_in`] as often as asked. Keeps
/// every job's device buffers alive, and waits for the last call's install before it drops
/// them.
pub struct SwapInTable {
    gpu: super::Gpu,
    row_bytes: usize,
    /// The jobs, the control words, the report words, the selections' copy, the staging rows.
    device: DeviceBuffer,
    /// Pinned: per job its length and count for the next call.
    control: HostBuffer,
    /// Pinned: the report words of the last call, downloaded.
    report_host: HostBuffer,
    jobs: Vec<Kept>,
    layout: TableLayout,
    /// The last call's install, while it may still run.
    installing: Option<Box<dyn EventBackend>>,
    /// A call failed on the device: its fetch may have marked states that no install
    /// cleared, so the table refuses every later call.
    broken: bool,
}

/// Where a table's parts start in its device memory: the jobs, the control words, the report
/// words, the selections as the fetch read them (a u32 per entry), the staging rows (a row
/// per entry).
#[derive(Debug, Clone, Copy)]
struct TableLayout {
    control_at: usize,
    report_at: usize,
    seen_at: usize,
    staging_at: usize,
    len: usize,
}

impl TableLayout {
    /// For `jobs` jobs of `entries` selection entries in all.
    fn new(jobs: usize, entries: usize, row_bytes: usize) -> Option<Self> {
        let control_at = jobs * JOB_BYTES;
        let report_at = control_at + 16 * jobs;
        let seen_at = report_at + 8 * (1 + 2 * jobs);
        // Staging rows 256-aligned, as the rows of any other device buffer.
        let staging_at = (seen_at + 4 * entries).next_multiple_of(256);
        let len = staging_at.checked_add(entries.checked_mul(row_bytes)?)?;
        Some(Self {
            control_at,
            report_at,
            seen_at,
            staging_at,
            len,
        })
    }
}

impl std::fmt::Debug for SwapInTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapInTable")
            .field("gpu", &self.gpu)
            .field("row_bytes", &self.row_bytes)
            .field("jobs", &self.jobs)
            .field("installing", &self.installing.is_some())
            .finish_non_exhaustive()
    }
}

impl SwapInTable {
    /// Jobs in the table.
    pub fn jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Waits for the last call's install: until then its hot buffers and states are still
    /// being written. The table's next call and its drop wait too; anything else that reads
    /// or resets a job's hot buffer or state (from any stream) waits here first.
    pub fn wait(&mut self) -> Result<()> {
        match self.installing.take() {
            Some(e) => e.synchronize(),
            None => Ok(()),
        }
    }
}

impl Drop for SwapInTable {
    fn drop(&mut self) {
        // The install reads and writes the jobs' buffers, which drop with the table. A
        // device that failed has nothing left running.
        let _ = self.wait();
    }
}

fn bad<T>(why: String) -> Result<T> {
    Err(HalError::InvalidArgument(format!("swap-in: {why}")))
}

impl Stream {
    /// Sets a job's state ([`swap_in_state_len`] bytes of `state`) to hold nothing, at step 0,
    /// and waits. A state a table's install may still be writing must not be reset: drop the
    /// table first.
    pub fn swap_in_reset(&self, state: &DeviceBuffer, positions: u64, slots: usize) -> Result<()> {
        if swap_in_state_len(positions, slots).is_none_or(|l| l > state.len()) {
            return bad(format!(
                "a state of {} bytes for {positions} positions and {slots} slots",
                state.len()
            ));
        }
        self.upload(&initial_state(positions, slots), state, 0)
    }

    /// Checks `jobs` and writes their table to the device. The states are used as they are:
    /// reset each first ([`swap_in_reset`](Self::swap_in_reset)); one another table used
    /// carries its hot buffer over. A state belongs to one hot buffer, warm pool, `warm_first`
    /// and row size: paired with others it serves other rows (memory stays safe: every index
    /// is checked). Hot buffers, states, selections and destinations must not overlap.
    pub fn swap_in_table(&self, row_bytes: usize, jobs: &[SwapInJob<'_>]) -> Result<SwapInTable> {
        if row_bytes == 0
            || row_bytes > SWAP_IN_MAX_ROW_BYTES
            || jobs.is_empty()
            || jobs.len() > TIER_MAX_JOBS
        {
            return bad(format!(
                "{} jobs of {row_bytes}-byte rows (1..={TIER_MAX_JOBS} jobs of rows of 1 to \
                 {SWAP_IN_MAX_ROW_BYTES} bytes)",
                jobs.len()
            ));
        }
        let mut kept = Vec::with_capacity(jobs.len());
        let mut spans = Vec::new();
        let mut first = 0usize;
        for (i, j) in jobs.iter().enumerate() {
            for (what, b) in [
                ("hot buffer", j.hot),
                ("state", j.state),
                ("selection", j.selection),
                ("destination", j.dst),
            ] {
                self.gpu.check_owns(what, b)?;
            }
            let Some(state_len) = swap_in_state_len(j.positions, j.slots) else {
                return bad(format!("job {i}: {} positions overflow", j.positions));
            };
            let warm_rows = (j.warm.len() / row_bytes) as u64;
            let limits = [
                (j.slots == 0 || j.slots > SWAP_IN_MAX_SLOTS, "slots"),
                (
                    j.positions == 0 || j.positions >= u64::from(PENDING),
                    "positions",
                ),
                (
                    j.max_count > j.slots.min(SWAP_IN_MAX_SELECTION),
                    "max_count",
                ),
                (
                    j.warm_first.saturating_add(j.positions) > warm_rows.min(TIER_MAX_WARM_ROWS),
                    "warm rows",
                ),
            ];
            if let Some((_, what)) = limits.iter().find(|l| l.0) {
                return bad(format!(
                    "job {i}: {what} out of bounds ({} slots up to {SWAP_IN_MAX_SLOTS}, {} \
                     positions, a selection of up to {} of at most {SWAP_IN_MAX_SELECTION}, \
                     warm rows {}..{} of {warm_rows})",
                    j.slots,
                    j.positions,
                    j.max_count,
                    j.warm_first,
                    j.warm_first.saturating_add(j.positions)
                ));
            }
            let hot = j.hot.range("swap-in hot buffer", 0, j.slots * row_bytes)?;
            let state = j.state.range("swap-in state", 0, state_len)?;
            let sel = j.selection.range("swap-in selection", 0, 4 * j.max_count)?;
            let out = j.max_count.saturating_mul(row_bytes);
            let dst = j.dst.range("swap-in destination", j.dst_offset, out)?;
            if !state.addr().is_multiple_of(4) || !sel.addr().is_multiple_of(4) {
                return bad(format!(
                    "job {i}: the state and selection must be 4-aligned"
                ));
            }
            spans.extend([hot, state, sel, dst].map(|r| (r.addr(), r.len)));
            let RowMem::Host { ptr, addr, len } = self.host_pool(j.warm)? else {
                return bad("the warm tier is host memory".into());
            };
            kept.push(Kept {
                hot: j.hot.clone(),
                state: j.state.clone(),
                selection: j.selection.clone(),
                dst: j.dst.clone(),
                dst_offset: j.dst_offset,
                slots: j.slots,
                positions: j.positions,
                warm_first: j.warm_first,
                warm: (ptr as usize, addr, len),
                max_count: j.max_count,
                first,
            });
            first += j.max_count;
        }
        check_disjoint(
            spans,
            "swap-in: hot buffers, states, selections and destinations",
        )?;
        let n = kept.len();
        let Some(layout) = TableLayout::new(n, first, row_bytes) else {
            return bad(format!(
                "{first} staging rows of {row_bytes} bytes overflow"
            ));
        };
        let device = self.gpu.alloc(layout.len)?;
        let pinned = |len| HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), &self.gpu);
        let (control, report_host) = (pinned(16 * n)?, pinned(8 * (1 + 2 * n))?);
        let table_addr = device.device_addr();
        let mut head = Vec::with_capacity(layout.report_at);
        for (i, k) in kept.iter().enumerate() {
            let job = [
                k.selection.device_addr(),
                table_addr + (layout.control_at + 16 * i) as u64,
                k.state.device_addr(),
                k.warm.1,
                k.warm_first,
                k.hot.device_addr(),
                k.dst.device_addr() + k.dst_offset as u64,
                table_addr + (layout.staging_at + k.first * row_bytes) as u64,
                table_addr + (layout.seen_at + 4 * k.first) as u64,
                k.positions | (k.slots as u64) << 32,
                k.max_count as u64,
            ];
            head.extend(job.iter().flat_map(|w| w.to_le_bytes()));
        }
        head.resize(layout.report_at, 0);
        let mut table = SwapInTable {
            gpu: self.gpu.clone(),
            row_bytes,
            device,
            control,
            report_host,
            jobs: kept,
            layout,
            installing: None,
            broken: false,
        };
        // The report words as they start: no failure, no counts.
        let mut words = vec![u64::MAX; 1 + n];
        words.resize(1 + 2 * n, 0);
        head.extend(words.iter().flat_map(|w| w.to_le_bytes()));
        self.upload(&head, &table.device, 0)?;
        table.control.as_mut_slice().fill(0);
        Ok(table)
    }

    /// Loads every job of `table` once: job `j`'s first `loads[j].count` selected positions
    /// are written, in order, to its destination — each from its slot, or from `warm[j]`
    /// (the pinned buffer the table was made with). Returns once the rows are there: the
    /// selections and destinations are the caller's again. The install that gives the misses
    /// their slots runs on, on this stream; the table's next call, its drop and
    /// [`SwapInTable::wait`] wait for it. A job whose selection holds a position twice or one
    /// at or past its length is refused: it installs nothing, its destination may hold some
    /// of its rows, the others are loaded, and [`SwapInDone::jobs`] says which, with the
    /// refused jobs' reasons. A loaded job may still install nothing, where the install finds
    /// its state bad (it is flagged, and its next load refused). An error is returned only
    /// where the call as a whole failed; after one on the device, the states may be marked or
    /// name rows their hot buffers did not receive: reset them and make a new table (this one
    /// refuses further calls).
    pub fn swap_in(
        &self,
        table: &mut SwapInTable,
        warm: &[&HostBuffer],
        loads: &[SwapInLoad],
        timed: bool,
    ) -> Result<SwapInDone> {
        let n = table.jobs.len();
        if !table.gpu.same_device(&self.gpu) {
            return bad(format!(
                "a table made on {} used on a stream of {}",
                table.gpu, self.gpu
            ));
        }
        if warm.len() != n || loads.len() != n {
            return bad(format!(
                "{n} jobs, {} warm pools and {} loads",
                warm.len(),
                loads.len()
            ));
        }
        if table.broken {
            return bad(
                "an earlier call failed on the device and may have left its states \
                 marked: reset them (swap_in_reset) and make a new table"
                    .into(),
            );
        }
        if let Err(e) = table.wait() {
            // The install may not have cleared its marks.
            table.broken = true;
            return Err(e);
        }
        let mut parts = Vec::with_capacity(n);
        for (i, ((k, w), l)) in table.jobs.iter().zip(warm).zip(loads).enumerate() {
            let pool = self.host_pool(w)?;
            let RowMem::Host { ptr, addr, len } = pool else {
                return bad("the warm tier is host memory".into());
            };
            if (ptr as usize, addr, len) != k.warm {
                return bad(format!(
                    "job {i}: not the warm pool the table was made with"
                ));
            }
            if l.len > k.positions || l.count > k.max_count {
                return bad(format!(
                    "job {i}: a length of {} (at most {}) and {} selected (at most {})",
                    l.len, k.positions, l.count, k.max_count
                ));
            }
            let control = &mut table.control[16 * i..16 * i + 16];
            control[..8].copy_from_slice(&l.len.to_le_bytes());
            control[8..].copy_from_slice(&(l.count as u64).to_le_bytes());
            let state_len = swap_in_state_len(k.positions, k.slots).unwrap_or(usize::MAX);
            parts.push(SwapInPart {
                hot: k
                    .hot
                    .range("swap-in hot buffer", 0, k.slots * table.row_bytes)?,
                state: k.state.range("swap-in state", 0, state_len)?,
                selection: k.selection.range("swap-in selection", 0, 4 * k.max_count)?,
                dst: k.dst.range(
                    "swap-in destination",
                    k.dst_offset,
                    k.max_count * table.row_bytes,
                )?,
                warm: pool,
                load: *l,
                positions: k.positions,
                slots: k.slots,
                warm_first: k.warm_first,
            });
        }
        let launch = SwapInLaunch {
            row_bytes: table.row_bytes,
            table: table.device.range("swap-in table", 0, table.device.len())?,
            control: &table.control,
            report_host: &mut table.report_host,
            control_at: table.layout.control_at,
            report_at: table.layout.report_at,
            staging_at: table.layout.staging_at,
            parts: &parts,
            timed,
        };
        // Until the call returns its install, a failure may leave marks no install clears.
        table.broken = true;
        // SAFETY: every range was checked against its live allocation above and the buffers
        // are held by the table, which waits for the install before it lets them go; the
        // warm pools and the control words are pinned host memory borrowed (registered) for
        // the call, which waits for the fetch (their last reader) before returning.
        let ran = unsafe { self.inner.swap_in(launch)? };
        table.broken = false;
        table.installing = ran.installing;
        let (failures, counts) = ran.report.split_at(ran.report.len().min(1 + n));
        if failures.len() != 1 + n || counts.len() != n {
            return bad(format!("{} report words for {n} jobs", ran.report.len()));
        }
        let jobs = failures[1..]
            .iter()
            .zip(counts)
            .map(|(&failed, &c)| match failed {
                u64::MAX => Ok(SwapInCounts {
                    hits: (c & 0xffff_ffff) as usize,
                    misses: (c >> 32) as usize,
                }),
                w => Err(plan_failure(w, &parts)),
            })
            .collect();
        Ok(SwapInDone {
            jobs,
            device_time: ran.device_time,
            install_time: ran.install_time,
        })
    }
}

/// A job's state before its first load: step 0, no position held.
fn initial_state(positions: u64, slots: usize) -> Vec<u8> {
    let mut words = vec![NONE; state_words(positions, slots)];
    words[0] = 0;
    words[1] = 0;
    words[2 + positions as usize + slots..].fill(0);
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The refusal a failure word names.
fn plan_failure(word: u64, parts: &[SwapInPart<'_>]) -> SwapInRefused {
    let (kind, job, value) = (word >> 60, (word >> 32) & 0x0fff_ffff, word & 0xffff_ffff);
    let load = parts.get(job as usize).map(|p| p.load);
    let fault = match kind {
        EXHAUSTED | CORRUPT => SwapInFault::State,
        _ => SwapInFault::Selection,
    };
    let why = match kind {
        PAST_LEN => format!(
            "job {job}: selection entry {value} is at or past the layer's length ({:?})",
            load.map(|l| l.len)
        ),
        TWICE => format!("job {job}: position {value} is selected twice"),
        TOO_MANY => format!("job {job}: {value} selected, more than the table allows"),
        EXHAUSTED => format!("job {job}: the state has run out of steps (2^32 - 1 loads)"),
        CORRUPT if value == u64::from(NONE) => format!(
            "job {job}: an earlier load found a slot holding a position outside the state's \
             table and installed nothing (the state was written by something other than \
             this HAL's loads; reset it)"
        ),
        CORRUPT => format!(
            "job {job}: its state names a slot or position outside its tables, or a slot that \
             holds another position (written by something other than this HAL's loads; reset \
             it)"
        ),
        _ => format!("job {job}: unknown swap-in failure {word:#x}"),
    };
    SwapInRefused { fault, why }
}

/// A report word naming one failure (the kernel's `gpuio_swap_bad`).
fn failure(kind: u64, job: usize, value: u64) -> u64 {
    kind << 60 | (job as u64) << 32 | (value & 0xffff_ffff)
}

/// What one job's load on the host works on besides its state, selection and codes.
pub(crate) struct HostPlan {
    pub(crate) positions: usize,
    pub(crate) slots: usize,
    /// The layer's length this call.
    pub(crate) len: u64,
    pub(crate) warm_first: u64,
    /// The job's place in the call (for its failure word).
    pub(crate) job: usize,
}

/// One job's load on the host, step for step what the fetch and the install do on the
/// device: writes the codes of `selection` into `codes` (a hit's slot; a miss's warm row and
/// the slot it takes, or none where the install found the state bad) and updates `state`;
/// returns `(hits, misses)`, or the smallest failure word (the kernels keep the minimum too).
pub(crate) fn plan_on_host(
    state: &mut [u32],
    selection: &[u32],
    codes: &mut [u64],
    plan: &HostPlan,
) -> std::result::Result<(usize, usize), u64> {
    let HostPlan {
        positions,
        slots,
        len,
        warm_first,
        job,
    } = *plan;
    let (head, tables) = state.split_at_mut(2);
    let (slot_of, rest) = tables.split_at_mut(positions);
    let (holder, last_used) = rest.split_at_mut(slots);
    // Refused before anything is marked (a count past the table never reaches here).
    if head[0] == NONE {
        return Err(failure(EXHAUSTED, job, selection.len() as u64));
    }
    if head[1] != 0 {
        return Err(failure(CORRUPT, job, u64::from(NONE)));
    }
    let step = head[0] + 1;
    // The fetch: every entry looked up and marked.
    let mut worst = u64::MAX;
    let mut bad = |kind, value| worst = worst.min(failure(kind, job, value));
    for (i, &pos) in selection.iter().enumerate() {
        if u64::from(pos) >= len {
            bad(PAST_LEN, i as u64);
            continue;
        }
        let old = slot_of[pos as usize];
        if old != NONE && old != PENDING && (old & !SEL) as usize >= slots {
            bad(CORRUPT, u64::from(pos));
        } else if old == NONE {
            slot_of[pos as usize] = PENDING;
        } else if old == PENDING || old & SEL != 0 {
            bad(TWICE, u64::from(pos));
        } else {
            slot_of[pos as usize] = old | SEL;
            // Loads keep slot_of[p] = s exactly when holder[s] = p: a slot holding another
            // position (or two positions naming one slot) is the state's fault.
            if holder[old as usize] != pos {
                bad(CORRUPT, u64::from(pos));
            }
        }
    }
    // The install: hits unmarked and used this step; misses in selection order.
    let refused = worst != u64::MAX;
    let (mut hits, mut misses) = (0usize, Vec::new());
    let mut hit = vec![false; slots];
    for (i, &pos) in selection.iter().enumerate() {
        let Some(mark) = slot_of
            .get_mut(pos as usize)
            .filter(|_| u64::from(pos) < len)
        else {
            continue;
        };
        if *mark == PENDING {
            if refused {
                *mark = NONE;
            } else {
                misses.push((pos, i));
            }
        } else if *mark & SEL != 0 && ((*mark & !SEL) as usize) < slots {
            *mark &= !SEL;
            let s = *mark as usize;
            last_used[s] = step;
            hit[s] = true;
            hits += 1;
            codes[i] = s as u64;
        }
    }
    head[0] = step;
    if refused {
        return Err(worst);
    }
    let m = misses.len();
    let victims = victims(last_used, &hit, step, m);
    // A victim's position is followed: one outside the table leaves the misses read but not
    // installed, and flags the state so that its next load is refused.
    let flagged = victims
        .iter()
        .any(|&s| holder[s] != NONE && holder[s] as usize >= positions);
    for (&s, &(pos, i)) in victims.iter().zip(&misses) {
        let install = if flagged {
            slot_of[pos as usize] = NONE;
            None
        } else {
            if holder[s] != NONE {
                slot_of[holder[s] as usize] = NONE;
            }
            holder[s] = pos;
            slot_of[pos as usize] = s as u32;
            last_used[s] = step;
            Some(s as u64)
        };
        codes[i] = crate::ai::TieredSource::Warm {
            row: warm_first + u64::from(pos),
            install,
        }
        .code()
        .unwrap_or(u64::MAX);
    }
    head[1] = u32::from(flagged);
    Ok((hits, m))
}

/// The `m` slots the misses of step `step` take: the unselected slots (`hit` false) selected
/// longest ago (ages capped at [`OLDEST`]; among equal ages, lower slots first), in slot
/// order.
fn victims(last_used: &[u32], hit: &[bool], step: u32, m: usize) -> Vec<usize> {
    if m == 0 {
        return Vec::new();
    }
    let age = |lu: u32| step.wrapping_sub(lu).min(OLDEST) as usize;
    let mut by_age = [0usize; OLDEST as usize + 1];
    for (s, &lu) in last_used.iter().enumerate() {
        if !hit[s] {
            by_age[age(lu)] += 1;
        }
    }
    // The youngest age the victims reach, and how many unselected slots are older.
    let (mut edge, mut older) = (0, 0);
    for a in (0..by_age.len()).rev() {
        if older + by_age[a] >= m {
            edge = a;
            break;
        }
        older += by_age[a];
    }
    let mut at_edge = 0;
    (0..last_used.len())
        .filter(|&s| !hit[s])
        .filter(|&s| match age(last_used[s]).cmp(&edge) {
            std::cmp::Ordering::Greater => true,
            std::cmp::Ordering::Equal => {
                at_edge += 1;
                at_edge <= m - older
            }
            std::cmp::Ordering::Less => false,
        })
        .collect()
}

/// Checks a call's shape against the host backend's reading of the parts (used there only).
pub(crate) fn check_part(p: &SwapInPart<'_>, row_bytes: usize) -> Result<()> {
    check_range(
        "swap-in destination",
        0,
        p.load.count * row_bytes,
        p.dst.len,
    )?;
    if p.state.len < swap_in_state_len(p.positions, p.slots).unwrap_or(usize::MAX) {
        return bad("a state shorter than its tables".into());
    }
    Ok(())
}

/// u32 words of a job's state (see [`swap_in_state_len`]).
pub(crate) fn state_words(positions: u64, slots: usize) -> usize {
    2 + positions as usize + 2 * slots
}

/// The range of `r` a host-backend reading may take as u32s: its address, 4-aligned.
pub(crate) fn words_at(r: &DevRange<'_>) -> Result<*mut u32> {
    if !r.addr().is_multiple_of(4) {
        return bad("a state or selection that is not 4-aligned".into());
    }
    Ok(r.addr() as *mut u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state with `positions` and `slots`, as the table resets it.
    fn fresh(positions: usize, slots: usize) -> Vec<u32> {
        initial_state(positions as u64, slots)
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    fn shape(positions: usize, slots: usize, len: u64, job: usize) -> HostPlan {
        HostPlan {
            positions,
            slots,
            len,
            warm_first: 100,
            job,
        }
    }

    fn run(
        state: &mut [u32],
        p: usize,
        s: usize,
        sel: &[u32],
        len: u64,
    ) -> (usize, usize, Vec<u64>) {
        let mut codes = vec![0; sel.len()];
        let (h, m) = plan_on_host(state, sel, &mut codes, &shape(p, s, len, 0)).expect("plan");
        (h, m, codes)
    }

    #[test]
    fn misses_take_the_oldest_unselected_slots_in_slot_order() {
        let (p, s) = (64, 4);
        let mut st = fresh(p, s);
        // Step 1: 0, 1, 2 miss into slots 0, 1, 2 (never used: equally old, lower first).
        let (h, m, codes) = run(&mut st, p, s, &[0, 1, 2], 64);
        assert_eq!((h, m), (0, 3));
        for (i, c) in codes.iter().enumerate() {
            let want = crate::ai::TieredSource::Warm {
                row: 100 + i as u64,
                install: Some(i as u64),
            };
            assert_eq!(crate::ai::TieredSource::from_code(*c), want);
        }
        // Step 2: 1 hits; 7 takes slot 3 (never used, the oldest).
        let (h, m, codes) = run(&mut st, p, s, &[1, 7], 64);
        assert_eq!((h, m), (1, 1));
        assert_eq!(codes[0], 1);
        // Step 3: 5 and 6 miss: the oldest unselected are slots 0 and 2 (step 1); 1 and 3
        // were used in step 2 and 3 is selected now (position 7).
        let (h, m, codes) = run(&mut st, p, s, &[5, 7, 6], 64);
        assert_eq!((h, m), (1, 2));
        let slot = |c: u64| match crate::ai::TieredSource::from_code(c) {
            crate::ai::TieredSource::Warm { install, .. } => install,
            crate::ai::TieredSource::Hot(_) => None,
        };
        assert_eq!(
            (slot(codes[0]), codes[1], slot(codes[2])),
            (Some(0), 3, Some(2))
        );
        // Position 0 and 2 lost their slots; 1 kept its.
        let (h, m, _) = run(&mut st, p, s, &[0, 1], 64);
        assert_eq!((h, m), (1, 1));
    }

    #[test]
    fn bad_selections_install_nothing_and_name_the_first_failure() {
        let (p, s) = (16, 8);
        let mut st = fresh(p, s);
        run(&mut st, p, s, &[3, 4], 16);
        let before: Vec<u32> = st[2..2 + p].to_vec();
        let mut codes = vec![0; 3];
        let e = plan_on_host(&mut st, &[5, 9, 5], &mut codes, &shape(p, s, 16, 2)).unwrap_err();
        assert_eq!(e, failure(TWICE, 2, 5));
        let e = plan_on_host(&mut st, &[3, 12, 1], &mut codes, &shape(p, s, 12, 0)).unwrap_err();
        assert_eq!(e, failure(PAST_LEN, 0, 1));
        let e = plan_on_host(&mut st, &[4, 4], &mut codes[..2], &shape(p, s, 16, 0)).unwrap_err();
        assert_eq!(e, failure(TWICE, 0, 4));
        assert_eq!(
            st[2..2 + p],
            before[..],
            "nothing installed or dropped, no mark left"
        );
        // The failed steps were spent: a later load sees its hits as fresh.
        let (h, m, _) = run(&mut st, p, s, &[3, 4, 5], 16);
        assert_eq!((h, m), (2, 1));
    }

    #[test]
    fn a_state_naming_slots_past_its_tables_is_refused_not_followed() {
        let (p, s) = (8, 2);
        let mut st = fresh(p, s);
        st[2 + 3] = 7; // position 3 "in" slot 7 of 2
        let mut codes = vec![0; 1];
        let e = plan_on_host(&mut st, &[3], &mut codes, &shape(p, s, 8, 0)).unwrap_err();
        assert_eq!(e, failure(CORRUPT, 0, 3));
        assert_eq!(st[2 + 3], 7, "left as it was");
        // Slot 0 "holds" position 99 of 8: found only when slot 0 is a victim, after the
        // row went out. The load reads its misses without installing them, and flags the
        // state, whose next load is refused.
        let mut st = fresh(p, s);
        st[2 + p] = 99;
        let before = st.clone();
        let (hits, misses) = plan_on_host(&mut st, &[1], &mut codes, &shape(p, s, 8, 0)).unwrap();
        assert_eq!((hits, misses), (0, 1));
        let want = crate::ai::TieredSource::Warm {
            row: 101,
            install: None,
        };
        assert_eq!(crate::ai::TieredSource::from_code(codes[0]), want);
        assert_eq!(st[1], 1, "flagged");
        assert_eq!(st[2..], before[2..], "nothing installed");
        let e = plan_on_host(&mut st, &[1], &mut codes, &shape(p, s, 8, 0)).unwrap_err();
        assert_eq!(e, failure(CORRUPT, 0, u64::from(NONE)));
        let r = plan_failure(e, &[]);
        assert!(r.to_string().contains("an earlier load"), "{r}");
        assert_eq!(r.fault, SwapInFault::State);
    }

    #[test]
    fn refusals_say_whether_the_selection_or_the_state_is_at_fault() {
        for (kind, fault) in [
            (PAST_LEN, SwapInFault::Selection),
            (TWICE, SwapInFault::Selection),
            (TOO_MANY, SwapInFault::Selection),
            (EXHAUSTED, SwapInFault::State),
            (CORRUPT, SwapInFault::State),
        ] {
            let r = plan_failure(failure(kind, 0, 7), &[]);
            assert_eq!(r.fault, fault, "{r}");
            assert!(r.to_string().starts_with("swap-in: job 0: "), "{r}");
        }
    }

    #[test]
    fn an_exhausted_state_is_refused() {
        let mut st = fresh(4, 2);
        st[0] = u32::MAX;
        let mut codes = vec![0; 1];
        let e = plan_on_host(&mut st, &[0], &mut codes, &shape(4, 2, 4, 1)).unwrap_err();
        assert_eq!(e >> 60, EXHAUSTED);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Any state words and any selection (of at most as many positions as slots, as the
        /// table enforces): the load answers (a count or a failure word) without panicking,
        /// its codes name rows inside their tiers, and a refused load installs nothing and
        /// leaves no mark (only the step and its hits' last steps may change).
        #[test]
        fn any_state_and_selection_is_answered_never_followed_out_of_bounds(
            words in proptest::collection::vec(proptest::prelude::any::<u32>(), 2 + 24 + 2 * 6),
            small in proptest::collection::vec(0u32..30, 38),
            use_small in proptest::prelude::any::<bool>(),
            selection in proptest::collection::vec(0u32..30, 0..=6),
            len in 0u64..=24,
        ) {
            let (p, s) = (24, 6);
            // Random words reach the checks; small ones reach the plan's deeper steps.
            let mut st = if use_small { small } else { words };
            st[0] %= 1 << 20;
            // A flagged state is refused before anything else (a test of its own above).
            st[1] = u32::from(st[1] == 1);
            let before = st.clone();
            let mut codes = vec![u64::MAX; selection.len()];
            match plan_on_host(&mut st, &selection, &mut codes, &shape(p, s, len, 0)) {
                Ok((hits, misses)) => {
                    proptest::prop_assert_eq!(hits + misses, selection.len());
                    for c in codes {
                        match crate::ai::TieredSource::from_code(c) {
                            crate::ai::TieredSource::Hot(slot) => {
                                proptest::prop_assert!(slot < s as u64)
                            }
                            crate::ai::TieredSource::Warm { row, install } => {
                                proptest::prop_assert!(row >= 100 && row < 100 + len);
                                proptest::prop_assert!(install.is_none_or(|i| i < s as u64));
                                proptest::prop_assert_eq!(install.is_none(), st[1] == 1);
                            }
                        }
                    }
                }
                Err(_) => {
                    proptest::prop_assert_eq!(&st[2..2 + p + s], &before[2..2 + p + s]);
                }
            }
        }
    }

    #[test]
    fn state_lengths_count_every_table() {
        assert_eq!(swap_in_state_len(10, 3), Some(4 * (2 + 10 + 6)));
        assert_eq!(swap_in_state_len(u64::MAX, 1), None);
    }
}
