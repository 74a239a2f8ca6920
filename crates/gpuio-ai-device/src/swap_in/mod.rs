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
//! A call may also prefetch ([`SwapInLoad::ahead`]): the entries after its count (the
//! indexer's next candidates, which a model's next step is likely to select) are copied aside
//! by the fetch and, after the install, brought into slots by the two kernels again — their
//! hits marked used, their misses read into staging and installed, nothing delivered — off the
//! critical path like the install. It is a step of its own: its hits and misses age the slots
//! as a load's do.
//!
//! A call may also be queued in a caller's stream order ([`swap_in_queued`]): its fetch runs
//! on the caller's stream, behind the work that wrote the selections and ahead of the work
//! that reads the rows, and the call returns at once; the upload, the report's download and
//! the install run on the table's own stream, and [`SwapInTable::finish`] reads the report.
//!
//! The jobs' descriptions are written to the device once, by [`swap_in_table`]; a call
//! uploads only each job's layer length and selection count. The host backend runs the same
//! steps in Rust (`plan.rs`, `plan_on_host`): the two leave the same states, which the GPU
//! tests check step by step against a model.
//!
//! Victims are exact LRU up to 255 steps of age; older slots count as equally old, lower slots
//! first. A selection must not hold a position twice or a position past the layer's length:
//! that job is refused — it installs nothing (its hits are marked used) and its output may
//! hold some of its rows — while the call's other jobs are loaded; the call reports each
//! job's outcome, counts or refusal.
//!
//! Here: the public types and the states; `table.rs`: the table and the calls' checks;
//! `plan.rs`: the load as the host runs it, and the report words; `op.rs`: the load as an op
//! (the kernels, or the plan and the copy on the CPU) and the table's layout.

mod op;
mod plan;
mod table;
#[cfg(test)]
mod tests;

pub use table::{SwapInOutcome, SwapInTable, swap_in, swap_in_queued, swap_in_table};

use gpuio_hal::error::{HalError, Result};
use gpuio_hal::gpu::{DeviceBuffer, Stream};
use gpuio_hal::memory::HostBuffer;
use plan::state_words;
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
const NONE: u32 = u32::MAX;
/// A position the fetch found missing, before the install gives it a slot.
const PENDING: u32 = u32::MAX - 1;
/// Bytes of one job in the table (`op::SwapJob`).
const JOB_BYTES: usize = 88;

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

/// One job of a device-planned load, as [`swap_in_table`] records it.
#[derive(Debug, Clone, Copy)]
pub struct SwapInJob<'a> {
    /// The hot buffer: `slots` rows from its start.
    pub hot: &'a DeviceBuffer,
    /// Slots in the hot buffer (at most [`SWAP_IN_MAX_SLOTS`]).
    pub slots: usize,
    /// The job's state ([`swap_in_state_len`] bytes from its start), reset by
    /// [`swap_in_reset`] before its first load.
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
    /// Entries after the count to prefetch (`count..count + ahead` of the selection; 0 for
    /// none): brought into the hot buffer after the load, delivered nowhere.
    pub ahead: usize,
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
    /// reset it ([`swap_in_reset`]) before the job loads again.
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
    /// and, where the call prefetches, the prefetch's fetch, download and install (CUDA
    /// events; zero on the host backend). A timed call waits for it.
    pub install_time: Option<Duration>,
}

fn bad<T>(why: String) -> Result<T> {
    Err(HalError::InvalidArgument(format!("swap-in: {why}")))
}

/// Sets a job's state ([`swap_in_state_len`] bytes of `state`) to hold nothing, at step 0, on
/// `stream`, and waits. A state a table's install may still be writing must not be reset:
/// drop the table first.
pub fn swap_in_reset(
    stream: &Stream,
    state: &DeviceBuffer,
    positions: u64,
    slots: usize,
) -> Result<()> {
    if swap_in_state_len(positions, slots).is_none_or(|l| l > state.len()) {
        return bad(format!(
            "a state of {} bytes for {positions} positions and {slots} slots",
            state.len()
        ));
    }
    stream.upload(&initial_state(positions, slots), state, 0)
}

/// A job's state before its first load: step 0, no position held.
fn initial_state(positions: u64, slots: usize) -> Vec<u8> {
    let mut words = vec![NONE; state_words(positions, slots)];
    words[0] = 0;
    words[1] = 0;
    words[2 + positions as usize + slots..].fill(0);
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}
