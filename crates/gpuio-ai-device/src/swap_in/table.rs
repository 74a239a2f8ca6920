//! A device-planned load's table, written to the device once ([`swap_in_table`]), and its
//! calls ([`swap_in`], or [`swap_in_queued`] then [`SwapInTable::finish`]): every argument
//! checked here, the work done by the op in `op.rs`.

use super::op::{INLINE_JOBS, Load, Part, Ran, Stage, SwapJob};
use super::plan::plan_failure;
use super::{
    JOB_BYTES, PENDING, SWAP_IN_MAX_ROW_BYTES, SWAP_IN_MAX_SELECTION, SWAP_IN_MAX_SLOTS,
    SwapInCounts, SwapInDone, SwapInJob, SwapInLoad, SwapInRefused, bad, swap_in_state_len,
};
use gpuio_hal::error::Result;
use gpuio_hal::gpu::check_disjoint;
use gpuio_hal::gpu::tiered::{TIER_MAX_JOBS, TIER_MAX_WARM_ROWS};
use gpuio_hal::gpu::{DeviceBuffer, Event, Gpu, Stream, elapsed};
use gpuio_hal::memory::{HostAllocOptions, HostBuffer};
use std::cell::RefCell;
use std::time::Duration;

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

/// Jobs written to the device once, loaded by [`swap_in`] as often as asked. Keeps
/// every job's device buffers alive, and waits for the last call's install before it drops
/// them.
pub struct SwapInTable {
    gpu: Gpu,
    row_bytes: usize,
    /// The jobs, the control words, the report words, the selections' copy, the staging rows.
    device: DeviceBuffer,
    /// Pinned: per job its length, count and entries ahead for the next call.
    control: HostBuffer,
    /// Pinned: the report words of the last call, downloaded, then its prefetch's.
    report_host: HostBuffer,
    jobs: Vec<Kept>,
    layout: TableLayout,
    /// Where a queued call's control words go up, its report comes down and its install runs:
    /// beside the caller's stream, which then carries only the fetch.
    side: Stream,
    /// The last call's install, while it may still run.
    installing: Option<Event>,
    /// A queued call whose report [`SwapInTable::finish`] has not read yet.
    pending: Option<Pending>,
    /// The last call's prefetch, where it had one: its loads, and its report where the host
    /// backend made it at once (on a GPU it is read after the install).
    prefetch: Option<(Vec<SwapInLoad>, Option<Vec<u64>>)>,
    /// A call failed on the device: its fetch may have marked states that no install
    /// cleared, so the table refuses every later call.
    broken: bool,
}

/// A queued call until its report is read: the report where the host backend made it at once,
/// else the fetch's end, the report's arrival and, when timed, the fetch's start; the call's
/// loads, which name its failures. Its install is the table's `installing`.
struct Pending {
    report: Option<(Vec<u64>, Option<Duration>)>,
    fetch: Option<(Event, Event, Option<Event>)>,
    loads: Vec<SwapInLoad>,
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
            .field("pending", &self.pending.is_some())
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

    /// Waits for the last call's install and returns what its prefetch found, per job: the
    /// entries ahead that were in slots already (hits) and those brought in (misses), or why
    /// the job's prefetch was refused; `None` where the last call had nothing ahead. Refused
    /// while a queued call is to be finished.
    pub fn prefetched(&mut self) -> Result<Option<Vec<SwapInOutcome>>> {
        if self.pending.is_some() {
            return bad("prefetched: a queued call is still to be finished".into());
        }
        self.wait()?;
        let n = self.jobs.len();
        let Some((loads, words)) = &self.prefetch else {
            return Ok(None);
        };
        let words = match words {
            Some(w) => w.clone(),
            None => report_words(&self.report_host[8 * (1 + 2 * n)..], n),
        };
        decode(&words, loads, n).map(Some)
    }

    /// Waits for the queued call's fetch and returns what it found, as [`swap_in`] does: each
    /// job's counts or why it was refused, and the device's times where it was timed (then
    /// it waits for the install too). Refused where no call is queued.
    pub fn finish(&mut self) -> Result<SwapInDone> {
        let Some(pending) = self.pending.take() else {
            return bad("finish: no queued call".into());
        };
        let n = self.jobs.len();
        let (report, device_time, install_time) = match (pending.report, pending.fetch) {
            (Some((report, time)), _) => (report, time, time.map(|_| Duration::ZERO)),
            (None, Some((end, fetched, start))) => {
                if let Err(e) = fetched.synchronize() {
                    // The fetch may have marked states that no install will clear.
                    self.broken = true;
                    return Err(e);
                }
                let report = report_words(&self.report_host, n);
                let (mut fetch, mut install) = (None, None);
                if let (Some(start), Some(installed)) = (&start, &self.installing) {
                    installed.synchronize()?;
                    fetch = Some(elapsed(start, &end)?);
                    install = Some(elapsed(&end, installed)?);
                    self.installing = None;
                }
                (report, fetch, install)
            }
            (None, None) => return bad("finish: a call that left no report".into()),
        };
        Ok(SwapInDone {
            jobs: decode(&report, &pending.loads, n)?,
            device_time,
            install_time,
        })
    }
}

/// One job's outcome in a call (or its prefetch).
pub type SwapInOutcome = std::result::Result<SwapInCounts, SwapInRefused>;

/// The first `1 + 2 * n` report words of `bytes`.
fn report_words(bytes: &[u8], n: usize) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .take(1 + 2 * n)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
        .collect()
}

/// Each job's outcome from a call's report words: its counts, or the refusal its failure word
/// names.
fn decode(report: &[u64], loads: &[SwapInLoad], n: usize) -> Result<Vec<SwapInOutcome>> {
    let (failures, counts) = report.split_at(report.len().min(1 + n));
    if failures.len() != 1 + n || counts.len() != n {
        return bad(format!("{} report words for {n} jobs", report.len()));
    }
    let jobs = failures[1..]
        .iter()
        .zip(counts)
        .map(|(&failed, &c)| match failed {
            u64::MAX => Ok(SwapInCounts {
                hits: (c & 0xffff_ffff) as usize,
                misses: (c >> 32) as usize,
            }),
            w => Err(plan_failure(w, loads)),
        })
        .collect();
    Ok(jobs)
}

impl Drop for SwapInTable {
    fn drop(&mut self) {
        // The install reads and writes the jobs' buffers, which drop with the table, as may a
        // queued call's upload or download left by a failed call. A device that failed has
        // nothing left running.
        let _ = self.wait();
        let _ = self.side.synchronize();
    }
}

/// Checks `jobs` and writes their table to `stream`'s device. The states are used as they
/// are: reset each first ([`swap_in_reset`](super::swap_in_reset)); one another table used carries its hot buffer
/// over. A state belongs to one hot buffer, warm pool, `warm_first` and row size: paired with
/// others it serves other rows (memory stays safe: every index is checked). Hot buffers,
/// states, selections and destinations must not overlap.
pub fn swap_in_table(
    stream: &Stream,
    row_bytes: usize,
    jobs: &[SwapInJob<'_>],
) -> Result<SwapInTable> {
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
            // Whose buffer it is, before any other check.
            stream.arg(what, b, 0, 0)?;
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
        let hot = stream.arg("swap-in hot buffer", j.hot, 0, j.slots * row_bytes)?;
        let state = stream.arg("swap-in state", j.state, 0, state_len)?;
        let sel = stream.arg("swap-in selection", j.selection, 0, 4 * j.max_count)?;
        let out = j.max_count.saturating_mul(row_bytes);
        let dst = stream.arg("swap-in destination", j.dst, j.dst_offset, out)?;
        if !state.addr().is_multiple_of(4) || !sel.addr().is_multiple_of(4) {
            return bad(format!(
                "job {i}: the state and selection must be 4-aligned"
            ));
        }
        spans.extend([hot, state, sel, dst].map(|r| (r.addr(), r.len())));
        let warm = stream.host_arg("swap-in warm tier", j.warm, 0, j.warm.len())?;
        kept.push(Kept {
            hot: j.hot.clone(),
            state: j.state.clone(),
            selection: j.selection.clone(),
            dst: j.dst.clone(),
            dst_offset: j.dst_offset,
            slots: j.slots,
            positions: j.positions,
            warm_first: j.warm_first,
            warm: (warm.ptr() as usize, warm.addr(), warm.len()),
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
    let gpu = stream.gpu();
    let device = gpu.alloc(layout.len)?;
    let pinned = |len| HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), gpu);
    let (control, report_host) = (pinned(16 * n)?, pinned(16 * (1 + 2 * n))?);
    let table_addr = device.device_addr();
    let mut head = Vec::with_capacity(layout.report_at);
    for (i, k) in kept.iter().enumerate() {
        let job = SwapJob {
            selection: k.selection.device_addr(),
            control: table_addr + (layout.control_at + 16 * i) as u64,
            state: k.state.device_addr(),
            warm: k.warm.1,
            warm_first: k.warm_first,
            hot: k.hot.device_addr(),
            dst: k.dst.device_addr() + k.dst_offset as u64,
            staging: table_addr + (layout.staging_at + k.first * row_bytes) as u64,
            seen: table_addr + (layout.seen_at + 4 * k.first) as u64,
            // Below PENDING and SWAP_IN_MAX_SLOTS, and max_count below the slots (checked).
            positions: k.positions as u32,
            slots: k.slots as u32,
            max_count: k.max_count as u32,
            unused: 0,
        };
        head.extend(job.to_le_bytes());
    }
    head.resize(layout.report_at, 0);
    let mut table = SwapInTable {
        gpu: gpu.clone(),
        row_bytes,
        device,
        control,
        report_host,
        jobs: kept,
        layout,
        side: gpu.stream()?,
        installing: None,
        pending: None,
        prefetch: None,
        broken: false,
    };
    // The report words as they start: no failure, no counts.
    let mut words = vec![u64::MAX; 1 + n];
    words.resize(1 + 2 * n, 0);
    head.extend(words.iter().flat_map(|w| w.to_le_bytes()));
    stream.upload(&head, &table.device, 0)?;
    table.control.as_mut_slice().fill(0);
    Ok(table)
}

/// Loads every job of `table` once on `stream`: job `j`'s first `loads[j].count` selected
/// positions are written, in order, to its destination — each from its slot, or from
/// `warm[j]` (the pinned buffer the table was made with). Returns once the rows are there:
/// the selections and destinations are the caller's again. The install that gives the misses
/// their slots runs on, on this stream; the table's next call, its drop and
/// [`SwapInTable::wait`] wait for it. A job whose selection holds a position twice or one at
/// or past its length is refused: it installs nothing, its destination may hold some of its
/// rows, the others are loaded, and [`SwapInDone::jobs`] says which, with the refused jobs'
/// reasons. A loaded job may still install nothing, where the install finds its state bad
/// (it is flagged, and its next load refused). An error is returned only where the call as a
/// whole failed; after one on the device, the states may be marked or name rows their hot
/// buffers did not receive: reset them and make a new table (this one refuses further
/// calls).
pub fn swap_in(
    stream: &Stream,
    table: &mut SwapInTable,
    warm: &[&HostBuffer],
    loads: &[SwapInLoad],
    timed: bool,
) -> Result<SwapInDone> {
    queue(stream, table, warm, loads, timed, false)?;
    table.finish()
}

/// [`swap_in`] without waiting: the call is queued on `stream` and returns at once (on the
/// host backend, once it is done). Its fetch follows the work queued on `stream` so far (what
/// wrote the selections), and work queued there afterwards finds the rows in place; the
/// control words' upload, the report's download and the install run on the table's own
/// stream, ordered to `stream` by events. Until [`SwapInTable::finish`] returns its outcome
/// the selections must not change, and a refused job's rows may be wrong, which only `finish`
/// says; the table takes no other call until then.
pub fn swap_in_queued(
    stream: &Stream,
    table: &mut SwapInTable,
    warm: &[&HostBuffer],
    loads: &[SwapInLoad],
    timed: bool,
) -> Result<()> {
    queue(stream, table, warm, loads, timed, true)
}

/// Checks and queues a call, its fetch on `stream`, the rest on the table's side stream where
/// `split` (a caller that goes on at once), else on `stream` too (a caller that waits: no
/// hand-over between streams).
fn queue(
    stream: &Stream,
    table: &mut SwapInTable,
    warm: &[&HostBuffer],
    loads: &[SwapInLoad],
    timed: bool,
    split: bool,
) -> Result<()> {
    let n = table.jobs.len();
    if table.pending.is_some() {
        return bad("a queued call is still to be finished (SwapInTable::finish)".into());
    }
    if !table.gpu.same_device(stream.gpu()) {
        return bad(format!(
            "a table made on {} used on a stream of {}",
            table.gpu,
            stream.gpu()
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
    let rb = table.row_bytes;
    let table_arg = stream.arg("swap-in table", &table.device, 0, table.device.len())?;
    let mut parts = Vec::with_capacity(n);
    for (i, ((k, w), l)) in table.jobs.iter().zip(warm).zip(loads).enumerate() {
        let pool = stream.host_arg("swap-in warm tier", w, 0, w.len())?;
        if (pool.ptr() as usize, pool.addr(), pool.len()) != k.warm {
            return bad(format!(
                "job {i}: not the warm pool the table was made with"
            ));
        }
        if l.len > k.positions || l.count.saturating_add(l.ahead) > k.max_count {
            return bad(format!(
                "job {i}: a length of {} (at most {}) and {} selected with {} ahead (at most {} \
                 in all)",
                l.len, k.positions, l.count, l.ahead, k.max_count
            ));
        }
        let control = &mut table.control[16 * i..16 * i + 16];
        control[..8].copy_from_slice(&l.len.to_le_bytes());
        // Both below max_count (checked above), itself at most SWAP_IN_MAX_SELECTION.
        control[8..12].copy_from_slice(&(l.count as u32).to_le_bytes());
        control[12..].copy_from_slice(&(l.ahead as u32).to_le_bytes());
        let state_len = swap_in_state_len(k.positions, k.slots).unwrap_or(usize::MAX);
        parts.push(Part {
            hot: stream.arg("swap-in hot buffer", &k.hot, 0, k.slots * rb)?,
            state: stream.arg("swap-in state", &k.state, 0, state_len)?,
            selection: stream.arg("swap-in selection", &k.selection, 0, 4 * k.max_count)?,
            dst: stream.arg(
                "swap-in destination",
                &k.dst,
                k.dst_offset,
                k.max_count * rb,
            )?,
            staging: table_arg.part(table.layout.staging_at + k.first * rb, k.max_count * rb)?,
            warm: pool,
            load: *l,
            positions: k.positions,
            slots: k.slots,
            warm_first: k.warm_first,
        });
    }
    let mut load = Load {
        stage: Stage::Control,
        row_bytes: rb,
        table: table_arg,
        control: &table.control,
        report_host: RefCell::new(table.report_host.as_mut_slice()),
        control_at: table.layout.control_at,
        report_at: table.layout.report_at,
        staging_at: table.layout.staging_at,
        parts,
        timed,
    };
    // Until the call is queued whole, a failure may leave marks no install clears.
    table.broken = true;
    let side = if split { &table.side } else { stream };
    // The control words go up beside the caller's work, for the install; the fetch follows
    // them unless it takes them in its parameters.
    if let Ran::Queued { end, .. } = side.run(&load)?
        && split
        && n > INLINE_JOBS
    {
        stream.wait_for(&end)?;
    }
    load.stage = Stage::Fetch;
    let mut host_prefetch = None;
    let (report, fetch, installing) = match stream.run(&load)? {
        Ran::Done {
            report,
            prefetched,
            device_time,
        } => {
            host_prefetch = prefetched;
            (Some((report, device_time)), None, None)
        }
        Ran::Queued { end, start, .. } => {
            // The report and the install follow the fetch.
            let mut tail = || {
                if split {
                    side.wait_for(&end)?;
                }
                load.stage = Stage::Tail;
                side.run(&load)
            };
            match tail() {
                Ok(Ran::Queued {
                    end: installed,
                    fetched: Some(fetched),
                    ..
                }) => (None, Some((end, fetched, start)), Some(installed)),
                failed => {
                    // The fetch is queued on the caller's stream over the table's memory:
                    // done before the error goes back (the table may be dropped next).
                    let _ = stream.synchronize();
                    return match failed {
                        Err(e) => Err(e),
                        Ok(_) => bad("the report's download was not queued".into()),
                    };
                }
            }
        }
        Ran::Nothing => return bad("the fetch ran nowhere".into()),
    };
    drop(load);
    let ahead = loads.iter().any(|l| l.ahead > 0);
    table.prefetch = ahead.then(|| (loads.to_vec(), host_prefetch));
    table.pending = Some(Pending {
        report,
        fetch,
        loads: loads.to_vec(),
    });
    table.installing = installing;
    table.broken = false;
    Ok(())
}
