//! The IO request, the core unit of work (docs/REFERENCE.md#requests): what to move, where from and
//! to, how urgently, and a status that only moves forward through
//! PENDING → SUBMITTED → IN_PROGRESS → COMPLETED / ERROR / CANCELLED.

use crate::endpoint::{Endpoint, EndpointKind};
use crate::error::{CoreError, Result};
use crate::route::EngineKind;
use serde::Serialize;
use std::fmt;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A request's identity, unique within a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct RequestId(pub u64);

impl RequestId {
    /// A fresh id.
    pub fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// What a request does (`gpuio_request_type_t`; docs/REFERENCE.md#requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum RequestType {
    /// From a storage or remote resource into memory.
    Read,
    /// From memory to a storage or remote resource.
    Write,
    /// Memory to memory.
    Copy,
    /// Remote compare-and-swap (RemoteIO).
    AtomicCmpSwap,
    /// Remote fetch-and-add (RemoteIO).
    AtomicFetchAdd,
    /// A batch of requests submitted together.
    Batch,
}

impl RequestType {
    /// The type of a transfer between two kinds of endpoint.
    pub fn of_transfer(src: EndpointKind, dst: EndpointKind) -> Self {
        match (src.is_remote_or_storage(), dst.is_remote_or_storage()) {
            (true, false) => Self::Read,
            (false, true) | (true, true) => Self::Write,
            (false, false) => Self::Copy,
        }
    }
}

/// Where a request is in its life (`gpuio_status_t`; docs/REFERENCE.md#status-machine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[repr(u8)]
pub enum Status {
    /// Created, not yet handed to a queue.
    Pending = 0,
    /// Queued for an engine.
    Submitted = 1,
    /// An engine is carrying it out.
    InProgress = 2,
    /// Done; every byte moved.
    Completed = 3,
    /// Failed; see the error delivered with its completion.
    Error = 4,
    /// Cancelled before it ran.
    Cancelled = 5,
}

impl Status {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Pending,
            1 => Self::Submitted,
            2 => Self::InProgress,
            3 => Self::Completed,
            4 => Self::Error,
            _ => Self::Cancelled,
        }
    }

    /// Whether the request has finished, one way or another.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Completed | Self::Error | Self::Cancelled)
    }

    /// Whether the state machine allows `self → next`. Work can be cancelled until an engine
    /// picks it up; only running work completes or fails.
    pub fn allows(self, next: Status) -> bool {
        use Status::*;
        matches!(
            (self, next),
            (Pending, Submitted)
                | (Pending | Submitted, Cancelled)
                | (Submitted, InProgress)
                | (InProgress, Completed | Error)
                // A request that fails validation never reaches an engine.
                | (Pending | Submitted, Error)
        )
    }
}

/// A request's status, kept in the scheduler's ticket and read by its handles. Transitions are
/// atomic compare-and-swaps, so a cancel and a worker's pickup never both win.
#[derive(Debug)]
pub(crate) struct StatusCell {
    id: RequestId,
    state: AtomicU8,
}

impl StatusCell {
    /// A cell in `status`.
    pub(crate) fn at(id: RequestId, status: Status) -> Self {
        Self {
            id,
            state: AtomicU8::new(status as u8),
        }
    }

    /// The current status.
    pub fn get(&self) -> Status {
        Status::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Moves to `next` if the current status allows it; otherwise says what the status was.
    pub fn advance(&self, next: Status) -> Result<()> {
        let mut cur = self.get();
        loop {
            if !cur.allows(next) {
                return Err(CoreError::IllegalTransition {
                    id: self.id,
                    from: cur,
                    to: next,
                });
            }
            match self.state.compare_exchange(
                cur as u8,
                next as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(actual) => cur = Status::from_u8(actual),
            }
        }
    }
}

/// The most chunks the scheduler cuts one request into (256 GiB in the default 1 MiB chunks;
/// each queued chunk costs about 100 bytes); a longer request runs whole.
pub const MAX_SPLIT_CHUNKS: usize = 1 << 18;

/// Priority classes for AI workloads (docs/REFERENCE.md#priority-classes), most urgent first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize)]
pub enum Priority {
    /// User-facing inference.
    InferenceRealtime,
    /// Training forward pass; the class of ordinary foreground work.
    #[default]
    TrainingForward,
    /// Training backward pass.
    TrainingBackward,
    /// Model checkpointing.
    Checkpoint,
    /// Engram write-back.
    EngramSync,
    /// Prefetch, cleanup.
    Background,
}

impl Priority {
    /// The classes, most urgent first (a class's index is its place here).
    pub const ALL: [Self; 6] = [
        Self::InferenceRealtime,
        Self::TrainingForward,
        Self::TrainingBackward,
        Self::Checkpoint,
        Self::EngramSync,
        Self::Background,
    ];

    /// The class at `index` of [`ALL`](Self::ALL), if any.
    pub fn from_index(index: u8) -> Option<Self> {
        Self::ALL.get(index as usize).copied()
    }
}

/// Options of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct RequestFlags {
    /// Fail at the first error instead of retrying retryable ones (docs/REFERENCE.md#retry-policy).
    pub no_retry: bool,
    /// For writes to storage: flush to stable storage (`fdatasync`) before completing.
    pub durable: bool,
}

/// An IO request (`gpuio_request_t`): the source and destination with their offsets,
/// the length, and how it should be scheduled.
#[derive(Debug)]
pub struct Request {
    /// Identity.
    pub id: RequestId,
    /// Read, write or copy (from the endpoints).
    pub ty: RequestType,
    /// The transport that will carry it.
    pub engine: EngineKind,
    /// Where the bytes come from.
    pub src: Endpoint,
    /// Where they go.
    pub dst: Endpoint,
    /// How many bytes.
    pub len: usize,
    /// Options.
    pub flags: RequestFlags,
    /// Scheduling class.
    pub priority: Priority,
    /// When the caller needs it done by (a scheduling target; see [`Request::timeout`] for a
    /// limit).
    pub deadline: Option<Instant>,
    /// Fail with a timeout if not done this long after submission: a request still queued
    /// then fails without running, and retries stop. A transfer already running is not
    /// interrupted.
    pub timeout: Option<Duration>,
    /// Other sources holding the same bytes (replicas), tried in order of load when the
    /// source fails (failover) and used to balance load across devices.
    pub alternates: Vec<Endpoint>,
}

impl Request {
    /// A transfer of `len` bytes from `src` to `dst`, for the engine that serves them.
    pub fn new(src: Endpoint, dst: Endpoint, len: usize) -> Result<Self> {
        let engine = EngineKind::serving(src.kind(), dst.kind());
        let id = RequestId::next();
        Ok(Self {
            id,
            ty: RequestType::of_transfer(src.kind(), dst.kind()),
            engine,
            src,
            dst,
            len,
            flags: RequestFlags::default(),
            priority: Priority::default(),
            deadline: None,
            timeout: None,
            alternates: Vec::new(),
        })
    }

    /// Sets the priority class.
    pub fn with_priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Sets a deadline.
    pub fn with_deadline(mut self, deadline: Instant) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Sets a timeout (see [`Request::timeout`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Adds a replica of the source (see [`Request::alternates`]); it must be of the same
    /// kind as the source.
    pub fn with_alternate_source(mut self, src: Endpoint) -> Result<Self> {
        if src.kind() != self.src.kind() {
            return Err(CoreError::InvalidRequest(format!(
                "an alternate source must be {:?} like the source, not {:?}",
                self.src.kind(),
                src.kind()
            )));
        }
        self.alternates.push(src);
        Ok(self)
    }

    /// Whether the request may run as chunks of `chunk` bytes in any order, on any workers:
    /// its memory ends hold all of it, it is at most [`MAX_SPLIT_CHUNKS`] chunks, and its
    /// source and destination do not overlap. Otherwise it runs whole: a request longer than
    /// its memory then fails in the engine with its own error (not after a chunk list the size
    /// of a mistaken length was built), and overlapping ends are moved as `memmove` does or
    /// refused by the engine, where chunks in any order would read bytes an earlier chunk had
    /// written.
    pub(crate) fn splittable(&self, chunk: usize) -> bool {
        let fits = |e: &Endpoint| e.room().is_none_or(|room| room >= self.len);
        self.len.div_ceil(chunk.max(1)) <= MAX_SPLIT_CHUNKS
            && fits(&self.src)
            && fits(&self.dst)
            && self.alternates.iter().all(fits)
            && !std::iter::once(&self.src)
                .chain(&self.alternates)
                .any(|s| s.overlaps(&self.dst, self.len))
    }

    /// Sets the flags.
    pub fn with_flags(mut self, flags: RequestFlags) -> Self {
        self.flags = flags;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_status_machine_only_moves_forward() {
        use Status::*;
        let all = [Pending, Submitted, InProgress, Completed, Error, Cancelled];
        for from in all {
            for to in all {
                let expect = matches!(
                    (from, to),
                    (Pending, Submitted)
                        | (Pending, Cancelled)
                        | (Submitted, Cancelled)
                        | (Submitted, InProgress)
                        | (InProgress, Completed)
                        | (InProgress, Error)
                        | (Pending, Error)
                        | (Submitted, Error)
                );
                assert_eq!(from.allows(to), expect, "{from:?} -> {to:?}");
            }
            if from.is_final() {
                assert!(all.iter().all(|&to| !from.allows(to)));
            }
        }
    }

    #[test]
    fn cancel_and_pickup_race_has_one_winner() {
        for _ in 0..200 {
            let cell = Arc::new(StatusCell::at(RequestId::next(), Status::Pending));
            cell.advance(Status::Submitted).unwrap();
            let c2 = cell.clone();
            let t = std::thread::spawn(move || c2.advance(Status::Cancelled).is_ok());
            let picked = cell.advance(Status::InProgress).is_ok();
            let cancelled = t.join().unwrap();
            assert!(picked ^ cancelled, "picked {picked} cancelled {cancelled}");
        }
    }
}
