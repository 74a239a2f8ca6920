//! The software controller's queues: the table of I/O queues the admin thread keeps and the
//! workers serve, and serving one submission queue — fetching entries, completing them (held
//! back and reordered, or late, where faults say), and moving data through PRPs.

use super::super::prp;
use super::super::spec::{Cqe, PAGE, Sqe, Status, doorbell};
use super::{DSTRD, MapView, SoftFaults, State};
use std::collections::BTreeMap;
use std::sync::atomic::{Ordering, fence};

/// Where an I/O submission queue lies and which completion queue it posts to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SqSpec {
    pub(super) base: u64,
    pub(super) size: u16,
    pub(super) cqid: u16,
}

/// Where an I/O completion queue lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CqSpec {
    pub(super) base: u64,
    pub(super) size: u16,
}

/// The I/O queues that exist.
#[derive(Debug, Default)]
pub(super) struct QueueTable {
    pub(super) sqs: BTreeMap<u16, SqSpec>,
    pub(super) cqs: BTreeMap<u16, CqSpec>,
}

/// A submission queue as its server sees it.
pub(super) struct SoftSq {
    pub(super) spec: SqSpec,
    pub(super) head: u16,
}

/// A completion queue as its server sees it.
pub(super) struct SoftCq {
    pub(super) id: u16,
    pub(super) spec: CqSpec,
    tail: u16,
    /// The head doorbell as last read.
    head: u32,
    phase: bool,
    /// Completions held back (reordering).
    held: Vec<Cqe>,
}

impl SoftSq {
    pub(super) fn new(spec: SqSpec) -> Self {
        Self { spec, head: 0 }
    }
}

impl SoftCq {
    pub(super) fn new(id: u16, spec: CqSpec) -> Self {
        Self {
            id,
            spec,
            tail: 0,
            head: 0,
            phase: true,
            held: Vec::new(),
        }
    }
}

/// The thread serving queues: the controller's shared state, the thread's view of the IO
/// address table, and its index (for its served-commands counter).
pub(super) struct Server<'a> {
    pub(super) state: &'a State,
    pub(super) view: &'a mut MapView,
    pub(super) index: usize,
}

/// Serves submission queue `qid` (`sq`, posting to `cq`) until it runs dry or its completion
/// queue fills; `execute` runs each command. Whether anything was done.
pub(super) fn serve(
    srv: &mut Server<'_>,
    qid: u16,
    sq: &mut SoftSq,
    cq: &mut SoftCq,
    faults: &SoftFaults,
    mut execute: impl FnMut(&mut Server<'_>, &Sqe) -> (Status, u32),
) -> bool {
    let state = srv.state;
    let tail = state.reg(doorbell(qid, false, DSTRD));
    // The entries the doorbell announces were written before it.
    fence(Ordering::Acquire);
    if tail >= sq.spec.size as u32 {
        // An invalid doorbell write is a fatal error for a real controller too.
        state.go_fatal();
        return true;
    }
    let mut worked = false;
    while sq.head != tail as u16 && has_room(state, cq) {
        let mut raw = [0u8; size_of::<Sqe>()];
        let at = sq.spec.base + sq.head as u64 * raw.len() as u64;
        if !state.mapper.read_into(srv.view, at, &mut raw) {
            state.go_fatal();
            return true;
        }
        let sqe = sqe_from_bytes(&raw);
        sq.head = (sq.head + 1) % sq.spec.size;
        let (status, result) = execute(srv, &sqe);
        let cqe = Cqe {
            result,
            rsvd: 0,
            sq_head: sq.head,
            sq_id: qid,
            cid: sqe.cid(),
            status: status.0 << 1,
        };
        complete(srv, cq, cqe, faults);
        worked = true;
        state.served[srv.index].fetch_add(1, Ordering::Relaxed);
        if faults
            .fatal_after
            .is_some_and(|n| state.served_total() >= n)
        {
            state.go_fatal();
            return true;
        }
    }
    // Post what reordering holds once the queue runs dry.
    if !cq.held.is_empty() {
        for cqe in std::mem::take(&mut cq.held).into_iter().rev() {
            post(srv, cq, cqe, faults);
        }
    }
    worked
}

/// Whether `cq` has room for one more entry (counting held ones). The head doorbell (a line
/// the host or GPU writes) is read again only when the head last read leaves no room: the
/// head only moves forward, so room seen once stays.
fn has_room(state: &State, cq: &mut SoftCq) -> bool {
    let size = cq.spec.size as u32;
    let room = |head: u32| {
        let used = (cq.tail as u32 + size - head % size) % size + cq.held.len() as u32;
        used + 1 < size
    };
    if room(cq.head) {
        return true;
    }
    cq.head = state.reg(doorbell(cq.id, true, DSTRD));
    room(cq.head)
}

fn complete(srv: &mut Server<'_>, cq: &mut SoftCq, cqe: Cqe, faults: &SoftFaults) {
    if faults.reorder > 1 {
        cq.held.push(cqe);
        if cq.held.len() >= faults.reorder {
            for cqe in std::mem::take(&mut cq.held).into_iter().rev() {
                post(srv, cq, cqe, faults);
            }
        }
    } else {
        post(srv, cq, cqe, faults);
    }
}

/// Writes a completion, as the faults' tampering has it (the admin queue is served without
/// faults).
fn post(srv: &mut Server<'_>, cq: &mut SoftCq, mut cqe: Cqe, faults: &SoftFaults) {
    if !faults.delay.is_zero() {
        std::thread::sleep(faults.delay);
    }
    // The count every worker shares is touched only while tampering is set: an honest
    // controller's completions stay off that cache line.
    if faults.tamper.is_empty() {
        return write(srv, cq, cqe);
    }
    let n = srv.state.posted.fetch_add(1, Ordering::Relaxed);
    let Some(t) = usize::try_from(n).ok().and_then(|n| faults.tamper.get(n)) else {
        return write(srv, cq, cqe);
    };
    if t.lose {
        return;
    }
    cqe.cid ^= t.cid_xor;
    cqe.result ^= t.result_xor;
    if let Some(status) = t.status {
        cqe.status = status << 1;
    }
    write(srv, cq, cqe);
    if t.duplicate && has_room(srv.state, cq) {
        write(srv, cq, cqe);
    }
}

/// Writes a completion: its body, then (after a release fence) its status and phase.
fn write(srv: &mut Server<'_>, cq: &mut SoftCq, mut cqe: Cqe) {
    let at = cq.spec.base + cq.tail as u64 * size_of::<Cqe>() as u64;
    cqe.status |= cq.phase as u16;
    let bytes = cqe_to_bytes(&cqe);
    cq.tail = (cq.tail + 1) % cq.spec.size;
    if cq.tail == 0 {
        cq.phase = !cq.phase;
    }
    let mapper = &srv.state.mapper;
    let body = mapper.write_from(srv.view, at, &bytes[..14]);
    fence(Ordering::Release);
    if !body || !mapper.write_from(srv.view, at + 14, &bytes[14..]) {
        srv.state.go_fatal();
    }
}

/// Moves `len` bytes between the memory the command's PRPs name and `copy`'s side: `copy`
/// is called with each (IO address, offset into the transfer, length) piece and says whether
/// it could move it.
pub(super) fn transfer(
    srv: &mut Server<'_>,
    sqe: &Sqe,
    len: usize,
    mut copy: impl FnMut(&mut Server<'_>, u64, usize, usize) -> bool,
) -> Status {
    if !sqe.prp1.is_multiple_of(4) {
        return Status::INVALID_PRP_OFFSET;
    }
    let mapper = &srv.state.mapper;
    let view = &mut *srv.view;
    let pieces = prp::walk(sqe.prp1, sqe.prp2, len, |at, n| {
        let mut raw = vec![0u8; 8 * n];
        mapper.read_into(view, at, &mut raw).then(|| {
            raw.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect()
        })
    });
    let Some(pieces) = pieces else {
        return Status::DATA_TRANSFER_ERROR;
    };
    let mut done = 0;
    for (at, n) in pieces {
        if !copy(srv, at, done, n) {
            return Status::DATA_TRANSFER_ERROR;
        }
        done += n;
    }
    Status::SUCCESS
}

/// Copies `data` to the memory the command's PRPs name (Identify data).
pub(super) fn transfer_out(srv: &mut Server<'_>, sqe: &Sqe, data: &[u8; PAGE]) -> Status {
    transfer(srv, sqe, PAGE, |srv, at, off, n| {
        srv.state
            .mapper
            .write_from(srv.view, at, &data[off..off + n])
    })
}

fn sqe_from_bytes(raw: &[u8; 64]) -> Sqe {
    let d =
        |i: usize| u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]]);
    let q = |i: usize| d(i) as u64 | (d(i + 1) as u64) << 32;
    Sqe {
        cdw0: d(0),
        nsid: d(1),
        cdw2: d(2),
        cdw3: d(3),
        mptr: q(4),
        prp1: q(6),
        prp2: q(8),
        cdw10: d(10),
        cdw11: d(11),
        cdw12: d(12),
        cdw13: d(13),
        cdw14: d(14),
        cdw15: d(15),
    }
}

fn cqe_to_bytes(cqe: &Cqe) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&cqe.result.to_le_bytes());
    b[4..8].copy_from_slice(&cqe.rsvd.to_le_bytes());
    b[8..10].copy_from_slice(&cqe.sq_head.to_le_bytes());
    b[10..12].copy_from_slice(&cqe.sq_id.to_le_bytes());
    b[12..14].copy_from_slice(&cqe.cid.to_le_bytes());
    b[14..16].copy_from_slice(&cqe.status.to_le_bytes());
    b
}
