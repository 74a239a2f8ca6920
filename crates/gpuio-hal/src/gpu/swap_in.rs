//! Device-planned tiered loads: HiSparse's hot buffer, refilled by a swap-in the device plans.
//!
//! A [tiered gather](super::TieredRows) moves rows whose codes the host wrote. Here the device
//! writes them: a job is one request's layer — a top-k selection of positions in device memory
//! (as the model's indexer leaves it there), a hot buffer of slots, a state in device memory
//! (each position's slot, each slot's position and last step) and the layer's entries in
//! pinned host memory (position `p` at warm row `warm_first + p`). One kernel plans every job
//! of a call (a block each): a selected position with a slot is a hit; the others are misses,
//! each given the slot selected longest ago (never one this step selects) and read from host
//! memory into both the output and that slot. The tiered gather kernel then moves the rows.
//! A call is two launches and one wait: no codes cross the bus and the host plans nothing.
//!
//! The jobs' descriptions are written to the device once, by [`Stream::swap_in_table`]; a
//! call passes only each job's layer length and selection count, which the plan reads from
//! pinned host memory. The host backend runs the same plan in Rust ([`plan_on_host`]): the two
//! give the same codes, which the GPU tests check step by step.
//!
//! Victims are exact LRU up to 255 steps of age; older slots count as equally old, lower slots
//! first. A selection must not hold a position twice or a position past the layer's length:
//! that job is refused — it installs nothing and writes no output (its hits are marked used) —
//! while the call's other jobs are loaded; the call reports each job's outcome, counts or
//! refusal.

use super::backend::{DevRange, RowMem, SwapInLaunch, SwapInPart};
use super::tiered::check_disjoint;
use super::{DeviceBuffer, Stream, TIER_MAX_JOBS, TIER_MAX_WARM_ROWS};
use crate::error::{HalError, Result, check_range};
use crate::memory::{HostAllocOptions, HostBuffer};
use std::time::Duration;

/// Most positions one selection may hold (the plan keeps its misses in shared memory).
pub const SWAP_IN_MAX_SELECTION: usize = 4096;
/// Most slots one job's hot buffer may have (the plan keeps every slot's state in its
/// threads' registers).
pub const SWAP_IN_MAX_SLOTS: usize = 8192;
/// A position with no slot, a slot with no position.
pub(crate) const NONE: u32 = u32::MAX;
/// A position this plan found missing, before its slot is chosen.
const PENDING: u32 = u32::MAX - 1;
/// Bytes of one job in either table (gather.cu's `gpuio_tier_job`, ai.cu's `gpuio_swap_job`).
const JOB_BYTES: usize = 64;
/// Ages are counted up to this many steps.
const OLDEST: u32 = 255;
/// The plan's failures, in the order the first is reported.
const PAST_LEN: u64 = 0;
const TWICE: u64 = 1;
const TOO_MANY: u64 = 2;
const EXHAUSTED: u64 = 3;
const CORRUPT: u64 = 4;

/// Bytes of a job's state for `positions` positions and `slots` slots: a step counter and an
/// unused word, then a u32 slot per position, a u32 position per slot and a u32 last step per
/// slot. `None` where that overflows.
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
    /// [`SWAP_IN_MAX_SELECTION`]).
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
    /// Positions read from host memory (and installed).
    pub misses: usize,
}

/// Why one job of a call installed and wrote nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("swap-in: {why}")]
pub struct SwapInRefused {
    /// Whose fault it is: the call's selection, or the job's state.
    pub fault: SwapInFault,
    /// What the plan found.
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

/// A call's outcome: each job's counts or why it was refused, and the device's time when
/// asked.
#[derive(Debug, Clone, PartialEq)]
pub struct SwapInDone {
    /// Per job, in the table's order.
    pub jobs: Vec<std::result::Result<SwapInCounts, SwapInRefused>>,
    /// The plan and the gather on the device (CUDA events; on the host backend, their
    /// time on the CPU).
    pub device_time: Option<Duration>,
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
    first: usize,
}

/// Jobs written to the device once, loaded by [`Stream::swap_in`] as often as asked. Keeps
/// every job's device buffers alive.
#[derive(Debug)]
pub struct SwapInTable {
    gpu: super::Gpu,
    row_bytes: usize,
    /// The gather table, the plan table, the codes, the report words.
    device: DeviceBuffer,
    /// Pinned: per job its length and count for the next call.
    control: HostBuffer,
    jobs: Vec<Kept>,
    codes_at: usize,
    report_at: usize,
}

impl SwapInTable {
    /// Jobs in the table.
    pub fn jobs(&self) -> usize {
        self.jobs.len()
    }
}

fn bad<T>(why: String) -> Result<T> {
    Err(HalError::InvalidArgument(format!("swap-in: {why}")))
}

impl Stream {
    /// Sets a job's state ([`swap_in_state_len`] bytes of `state`) to hold nothing, at step 0,
    /// and waits.
    pub fn swap_in_reset(&self, state: &DeviceBuffer, positions: u64, slots: usize) -> Result<()> {
        if swap_in_state_len(positions, slots).is_none_or(|l| l > state.len()) {
            return bad(format!(
                "a state of {} bytes for {positions} positions and {slots} slots",
                state.len()
            ));
        }
        self.upload(&initial_state(positions, slots), state, 0)
    }

    /// Checks `jobs` and writes their tables to the device. The states are used as they are:
    /// reset each first ([`swap_in_reset`](Self::swap_in_reset)); one another table used
    /// carries its hot buffer over. A state belongs to one hot buffer, warm pool, `warm_first`
    /// and row size: paired with others it serves other rows (memory stays safe: every index
    /// is checked). Hot buffers, states, selections and destinations must not overlap.
    pub fn swap_in_table(&self, row_bytes: usize, jobs: &[SwapInJob<'_>]) -> Result<SwapInTable> {
        if row_bytes == 0 || jobs.is_empty() || jobs.len() > TIER_MAX_JOBS {
            return bad(format!(
                "{} jobs of {row_bytes}-byte rows (1..={TIER_MAX_JOBS} jobs of rows of at \
                 least a byte)",
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
        let codes_at = 2 * n * JOB_BYTES;
        let report_at = codes_at + 8 * first;
        let device = self.gpu.alloc(report_at + 8 * (2 + n))?;
        let mut control =
            HostBuffer::alloc_pinned(16 * n, &HostAllocOptions::default(), &self.gpu)?;
        control.as_mut_slice().fill(0);
        let control_addr = self.host_pool(&control)?.addr();
        let mut bytes = vec![0u8; report_at + 8 * (2 + n)];
        let words = |at: usize, bytes: &mut [u8], w: &[u64]| {
            for (k, v) in w.iter().enumerate() {
                bytes[at + 8 * k..at + 8 * k + 8].copy_from_slice(&v.to_le_bytes());
            }
        };
        for (i, k) in kept.iter().enumerate() {
            let hot = k.hot.device_addr();
            let dst = k.dst.device_addr() + k.dst_offset as u64;
            let warm_rows = (k.warm.2 / row_bytes) as u64;
            let gather = [
                hot,
                k.slots as u64,
                k.warm.1,
                warm_rows,
                dst,
                k.first as u64,
                0,
                0,
            ];
            words(i * JOB_BYTES, &mut bytes, &gather);
            let sizes = [k.positions | (k.slots as u64) << 32, k.max_count as u64];
            let plan = [
                k.selection.device_addr(),
                control_addr + 16 * i as u64,
                k.state.device_addr(),
                device.device_addr() + (i * JOB_BYTES) as u64,
                k.warm_first,
                k.first as u64,
                sizes[0],
                sizes[1],
            ];
            words((n + i) * JOB_BYTES, &mut bytes, &plan);
        }
        // The call's two failure words and each job's word, all ones until something is
        // reported (the kernel keeps minima in them).
        words(report_at, &mut bytes, &vec![u64::MAX; 2 + n]);
        self.upload(&bytes, &device, 0)?;
        Ok(SwapInTable {
            gpu: self.gpu.clone(),
            row_bytes,
            device,
            control,
            jobs: kept,
            codes_at,
            report_at,
        })
    }

    /// Plans and moves one load of every job of `table` and waits: job `j`'s first
    /// `loads[j].count` selected positions are written, in order, to its destination — each
    /// from its slot, or from `warm[j]` (the pinned buffer the table was made with) into the
    /// output and the slot it takes. A job whose selection holds a position twice or one at
    /// or past its length is refused: it installs and writes nothing, the others are loaded,
    /// and [`SwapInDone::jobs`] says which, with the refused jobs' reasons. An error is
    /// returned only where the call as a whole failed. Where the device itself fails (a
    /// launch, a copy), the states may name rows their hot buffers did not receive: reset
    /// them.
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
                first: k.first,
            });
        }
        let launch = SwapInLaunch {
            row_bytes: table.row_bytes,
            table: table.device.range("swap-in table", 0, table.device.len())?,
            plans_at: n * JOB_BYTES,
            codes_at: table.codes_at,
            report_at: table.report_at,
            parts: &parts,
            timed,
        };
        // SAFETY: every range was checked against its live allocation above and the buffers
        // are held by the table; the warm pools and the control words are pinned host memory
        // borrowed (registered) for the call, which waits for the device before returning.
        let ran = unsafe { self.inner.swap_in(launch)? };
        if let Some(&i) = ran.report.get(1).filter(|&&w| w != u64::MAX) {
            return bad(format!(
                "code {i} names a row outside its tier: a state was written by something other \
                 than this table's loads"
            ));
        }
        let words = ran.report.get(2..).unwrap_or_default();
        if words.len() != n {
            return bad(format!("{} job words for {n} jobs", words.len()));
        }
        let jobs = words
            .iter()
            .map(|&w| match w {
                w if w >> 63 == 1 => Err(plan_failure(w & !(1 << 63), &parts)),
                w => Ok(SwapInCounts {
                    hits: (w & 0xffff_ffff) as usize,
                    misses: (w >> 32) as usize,
                }),
            })
            .collect();
        Ok(SwapInDone {
            jobs,
            device_time: ran.device_time,
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

/// The refusal a plan's failure word names.
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
        CORRUPT => format!(
            "job {job}: its state names a slot or position outside its tables (written by \
             something other than this HAL's loads; reset it)"
        ),
        _ => format!("job {job}: unknown plan failure {word:#x}"),
    };
    SwapInRefused { fault, why }
}

/// A report word naming one failure (the kernel's `gpuio_swap_bad`).
fn failure(kind: u64, job: usize, value: u64) -> u64 {
    kind << 60 | (job as u64) << 32 | (value & 0xffff_ffff)
}

/// What one job's plan on the host works on besides its state, selection and codes.
pub(crate) struct HostPlan {
    pub(crate) positions: usize,
    pub(crate) slots: usize,
    /// The layer's length this call.
    pub(crate) len: u64,
    pub(crate) warm_first: u64,
    /// The job's place in the call (for its failure word).
    pub(crate) job: usize,
}

/// One job's plan on the host, step for step what `gpuio_swap_in_plan` does: writes the codes
/// of `selection` into `codes` and updates `state`; returns `(hits, misses)`, or the smallest
/// failure word (the kernel keeps the minimum too).
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
    if head[0] == u32::MAX {
        return Err(failure(EXHAUSTED, job, selection.len() as u64));
    }
    let step = head[0] + 1;
    let mut worst = u64::MAX;
    let (mut hits, mut misses) = (0usize, Vec::new());
    // Slots selected this step (the kernel's shared bitmap).
    let mut hit = vec![false; slots];
    for (i, &pos) in selection.iter().enumerate() {
        if u64::from(pos) >= len {
            worst = worst.min(failure(PAST_LEN, job, i as u64));
            continue;
        }
        let slot = slot_of[pos as usize];
        if slot == NONE {
            slot_of[pos as usize] = PENDING;
            misses.push((pos, i));
        } else if slot != PENDING && slot as usize >= slots {
            worst = worst.min(failure(CORRUPT, job, u64::from(pos)));
        } else if slot == PENDING || std::mem::replace(&mut hit[slot as usize], true) {
            worst = worst.min(failure(TWICE, job, u64::from(pos)));
        } else {
            hits += 1;
            last_used[slot as usize] = step;
            codes[i] = u64::from(slot);
        }
    }
    head[0] = step;
    if worst != u64::MAX {
        for &(pos, _) in &misses {
            slot_of[pos as usize] = NONE;
        }
        return Err(worst);
    }
    let m = misses.len();
    if m == 0 {
        return Ok((hits, 0));
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
    let victims: Vec<usize> = (0..slots)
        .filter(|&s| !hit[s])
        .filter(|&s| match age(last_used[s]).cmp(&edge) {
            std::cmp::Ordering::Greater => true,
            std::cmp::Ordering::Equal => {
                at_edge += 1;
                at_edge <= m - older
            }
            std::cmp::Ordering::Less => false,
        })
        .collect();
    // A victim's position is followed: one outside the table fails the plan, installing
    // nothing.
    let corrupt = victims
        .iter()
        .filter(|&&s| holder[s] != NONE && holder[s] as usize >= positions)
        .map(|&s| failure(CORRUPT, job, s as u64))
        .min();
    if let Some(word) = corrupt {
        for &(pos, _) in &misses {
            slot_of[pos as usize] = NONE;
        }
        return Err(word);
    }
    for (&s, &(pos, i)) in victims.iter().zip(&misses) {
        if holder[s] != NONE {
            slot_of[holder[s] as usize] = NONE;
        }
        holder[s] = pos;
        slot_of[pos as usize] = s as u32;
        last_used[s] = step;
        codes[i] = super::TieredSource::Warm {
            row: warm_first + u64::from(pos),
            install: Some(s as u64),
        }
        .code()
        .unwrap_or(u64::MAX);
    }
    Ok((hits, m))
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
            let want = crate::gpu::TieredSource::Warm {
                row: 100 + i as u64,
                install: Some(i as u64),
            };
            assert_eq!(crate::gpu::TieredSource::from_code(*c), want);
        }
        // Step 2: 1 hits; 7 takes slot 3 (never used, the oldest).
        let (h, m, codes) = run(&mut st, p, s, &[1, 7], 64);
        assert_eq!((h, m), (1, 1));
        assert_eq!(codes[0], 1);
        // Step 3: 5 and 6 miss: the oldest unselected are slots 0 and 2 (step 1); 1 and 3
        // were used in step 2 and 3 is selected now (position 7).
        let (h, m, codes) = run(&mut st, p, s, &[5, 7, 6], 64);
        assert_eq!((h, m), (1, 2));
        let slot = |c: u64| match crate::gpu::TieredSource::from_code(c) {
            crate::gpu::TieredSource::Warm { install, .. } => install,
            crate::gpu::TieredSource::Hot(_) => None,
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
        assert_eq!(st[2..2 + p], before[..], "nothing installed or dropped");
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
        let mut st = fresh(p, s);
        st[2 + p] = 99; // slot 0 "holds" position 99 of 8
        let before = st.clone();
        let e = plan_on_host(&mut st, &[1], &mut codes, &shape(p, s, 8, 0)).unwrap_err();
        assert_eq!(e, failure(CORRUPT, 0, 0));
        assert_eq!(
            st[1..],
            before[1..],
            "nothing installed; only the step was spent"
        );
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

        /// Any state words and any selection: the plan answers (a count or a failure word)
        /// without panicking, its codes name rows inside their tiers, and a failed plan
        /// installs nothing (only the step and its hits' last steps may change).
        #[test]
        fn any_state_and_selection_is_answered_never_followed_out_of_bounds(
            words in proptest::collection::vec(proptest::prelude::any::<u32>(), 2 + 24 + 2 * 6),
            small in proptest::collection::vec(0u32..30, 38),
            use_small in proptest::prelude::any::<bool>(),
            selection in proptest::collection::vec(0u32..30, 0..7),
            len in 0u64..=24,
        ) {
            let (p, s) = (24, 6);
            // Random words reach the checks; small ones reach the plan's deeper steps.
            let mut st = if use_small { small } else { words };
            st[0] %= 1 << 20;
            let before = st.clone();
            let mut codes = vec![u64::MAX; selection.len()];
            match plan_on_host(&mut st, &selection, &mut codes, &shape(p, s, len, 0)) {
                Ok((hits, misses)) => {
                    proptest::prop_assert_eq!(hits + misses, selection.len());
                    for c in codes {
                        match crate::gpu::TieredSource::from_code(c) {
                            crate::gpu::TieredSource::Hot(slot) => {
                                proptest::prop_assert!(slot < s as u64)
                            }
                            crate::gpu::TieredSource::Warm { row, install } => {
                                proptest::prop_assert!(row >= 100 && row < 100 + len);
                                proptest::prop_assert!(install.is_some_and(|i| i < s as u64));
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
