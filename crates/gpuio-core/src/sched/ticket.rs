//! A request inside the scheduler: its [`TicketInner`] carries the request, the completion to
//! deliver, and the chunk count; the accounting it settles when it finishes (budgets,
//! statistics, metrics); and the sessions that own requests.
//!
//! Exactly-once delivery rests on the status machine: only the caller whose compare-and-swap
//! moves the status to a final state ([`Status::is_final`]) calls [`TicketInner::finish`]. A
//! ticket dropped before it finished (its queue went away) finishes itself with
//! [`CoreError::ShutDown`].

use super::budget::{Budget, Budgets};
use super::handle::Completion;
use super::queue::SessionId;
use crate::batch::MergeKey;
use crate::error::{CoreError, Result};
use crate::metrics::SchedMetrics;
use crate::outcome::Outcome;
use crate::request::{Priority, Request, RequestId, Status, StatusCell};
use crate::route::EngineKind;
use gpuio_hal::sync::{MutexExt, StripedCounter};
use gpuio_transport_localio::FileHandle;
use serde::Serialize;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub(crate) type Done = Box<dyn FnOnce(Result<Completion>) + Send>;

/// A scheduling session's shared state.
#[derive(Debug)]
pub(crate) struct SessionState {
    pub id: SessionId,
    pub weight: u32,
    pub limit: u64,
    /// Bytes admitted and not yet completed.
    pub in_flight: Budget,
    pub closed: AtomicBool,
    /// The scheduler's accounting, reached through the session so that a ticket holds one
    /// shared reference, not two: each is a reference count the submitter and a worker both
    /// touch per request.
    pub acct: Arc<Accounting>,
}

/// Counters of the scheduler's life (see [`SchedStats`]). Submitters and every worker add
/// to them on each request, so each is striped (one cache line per thread's slot).
#[derive(Default)]
pub(crate) struct Counters {
    pub submitted: StripedCounter,
    pub completed: StripedCounter,
    pub failed: StripedCounter,
    pub cancelled: StripedCounter,
    pub bytes: StripedCounter,
    pub deadline_met: StripedCounter,
    pub deadline_missed: StripedCounter,
    pub coalesced: StripedCounter,
    pub stolen: StripedCounter,
    pub retries: StripedCounter,
    pub failovers: StripedCounter,
}

/// A snapshot of the scheduler's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SchedStats {
    /// Requests accepted.
    pub submitted: u64,
    /// Requests completed successfully.
    pub completed: u64,
    /// Requests that failed (including timeouts and shutdown).
    pub failed: u64,
    /// Requests cancelled before they ran.
    pub cancelled: u64,
    /// Bytes moved by completed requests.
    pub bytes: u64,
    /// Requests with a deadline that finished in time.
    pub deadline_met: u64,
    /// Requests with a deadline that finished late (or failed).
    pub deadline_missed: u64,
    /// Requests that ran merged with an adjacent one.
    pub coalesced: u64,
    /// Units a worker took from another worker's deque.
    pub stolen: u64,
    /// Retries of retryable errors.
    pub retries: u64,
    /// Switches to an alternate source after a failure.
    pub failovers: u64,
    /// Units waiting in the queues now.
    pub queued: u64,
    /// Bytes admitted and not yet completed, per engine (MemIO, LocalIO, RemoteIO).
    pub in_flight_bytes: [u64; 3],
}

/// What every ticket settles when it finishes.
pub(crate) struct Accounting {
    pub budgets: Budgets,
    pub counters: Counters,
    pub metrics: SchedMetrics,
}

impl std::fmt::Debug for Accounting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accounting").finish_non_exhaustive()
    }
}

impl Counters {
    pub fn snapshot(&self) -> SchedStats {
        let g = |a: &StripedCounter| a.get();
        SchedStats {
            submitted: g(&self.submitted),
            completed: g(&self.completed),
            failed: g(&self.failed),
            cancelled: g(&self.cancelled),
            bytes: g(&self.bytes),
            deadline_met: g(&self.deadline_met),
            deadline_missed: g(&self.deadline_missed),
            coalesced: g(&self.coalesced),
            stolen: g(&self.stolen),
            retries: g(&self.retries),
            failovers: g(&self.failovers),
            ..SchedStats::default()
        }
    }
}

pub(crate) struct TicketState {
    pub req: Option<Request>,
    done: Option<Done>,
    pub chunks_left: usize,
    pub error: Option<Box<CoreError>>,
    pub started: Option<Instant>,
    /// The first chunk's outcome, kept for a request of several chunks.
    pub first: Option<Box<Outcome>>,
    /// A durable request's file, flushed once every chunk has landed (then let go, before the
    /// completion is delivered).
    pub durable: Option<FileHandle>,
    finished: bool,
}

/// A request owned by the scheduler. Aligned to a line pair so that its `Arc`'s reference
/// counts, which a submitter moves when it lets go of its `Ticket`, share no line with what
/// the worker running it reads and writes.
#[repr(align(128))]
pub(crate) struct TicketInner {
    pub id: RequestId,
    /// The request's status, on the ticket's first lines (which its worker reads anyway).
    pub cell: StatusCell,
    pub engine: EngineKind,
    pub class: Priority,
    pub len: usize,
    /// Units it is queued as: chunks of `chunk_size`, or 1 for a request that runs whole
    /// (`Request::splittable`).
    pub chunks: usize,
    pub deadline: Option<Instant>,
    pub expires: Option<Instant>,
    pub submitted: Instant,
    pub session: Arc<SessionState>,
    /// Whether (and with what) it may run merged with adjacent requests; fixed at submission,
    /// so workers read it without the lock.
    pub merge: Option<MergeKey>,
    pub state: Mutex<TicketState>,
}

impl TicketInner {
    pub fn new(
        req: Request,
        done: Done,
        chunks: usize,
        session: Arc<SessionState>,
        now: Instant,
    ) -> Self {
        let durable = req
            .flags
            .durable
            .then(|| req.dst.durable_file().cloned())
            .flatten();
        Self {
            id: req.id,
            cell: StatusCell::at(req.id, Status::Submitted),
            engine: req.engine,
            class: req.priority,
            len: req.len,
            chunks: chunks.max(1),
            deadline: req.deadline,
            expires: req.timeout.map(|t| now + t),
            submitted: now,
            session,
            merge: crate::batch::merge_key(&req),
            state: Mutex::new(TicketState {
                req: Some(req),
                done: Some(done),
                chunks_left: chunks.max(1),
                error: None,
                started: None,
                first: None,
                durable,
                finished: false,
            }),
        }
    }

    /// Forgets the completion (the request was refused at submission; the submitter reports
    /// that instead).
    pub fn disarm(&self) {
        self.state.lock_unpoisoned().done = None;
    }

    /// Settles a request whose status is final; only the first call does anything.
    pub fn finish(&self, result: Result<Outcome>) {
        let (req, done, started) = {
            let mut s = self.state.lock_unpoisoned();
            if s.finished {
                return;
            }
            s.finished = true;
            // A durable file still here was never flushed for this request (it was cancelled
            // or failed before it ran): let it go with the buffers.
            ((s.req.take(), s.durable.take()), s.done.take(), s.started)
        };
        // Release the request's buffers before saying it is done.
        drop(req);
        let now = Instant::now();
        let acct = &self.session.acct;
        acct.budgets
            .release(self.engine, &self.session, self.len as u64);
        let m = acct.metrics.class(self.engine, self.class);
        let c = &acct.counters;
        match &result {
            Ok(_) => {
                c.completed.add(1);
                c.bytes.add(self.len as u64);
                m.ok.increment(1);
                acct.metrics
                    .engine(self.engine)
                    .bytes
                    .increment(self.len as u64);
            }
            Err(CoreError::Cancelled(_)) => {
                c.cancelled.add(1);
                m.cancelled.increment(1);
            }
            Err(_) => {
                c.failed.add(1);
                m.failed.increment(1);
            }
        }
        let latency = now - self.submitted;
        m.latency.record(latency.as_secs_f64());
        if let Some(d) = self.deadline
            && !matches!(result, Err(CoreError::Cancelled(_)))
        {
            let (total, missed) = &acct.metrics.deadline[self.class as usize];
            total.increment(1);
            if now > d || result.is_err() {
                missed.increment(1);
                c.deadline_missed.add(1);
            } else {
                c.deadline_met.add(1);
            }
        }
        if let Some(done) = done {
            let completion = result.map(|outcome| Completion {
                id: self.id,
                outcome,
                elapsed: started.map_or(Duration::ZERO, |s| now - s),
                latency,
            });
            // A caller's callback that panics must not take the worker (and the requests it
            // holds) with it.
            let delivered = catch_unwind(AssertUnwindSafe(|| done(completion)));
            if delivered.is_err() {
                tracing::error!(id = self.id.0, "a completion callback panicked");
            }
        }
    }

    /// Cancels the request if it has not started; delivers the cancellation at once.
    pub fn cancel(&self) -> bool {
        if self.cell.advance(Status::Cancelled).is_ok() {
            self.finish(Err(CoreError::Cancelled(self.id)));
            true
        } else {
            false
        }
    }

    /// Fails the request if it has not started.
    pub fn fail_unstarted(&self, e: CoreError) -> bool {
        if self.cell.advance(Status::Error).is_ok() {
            self.finish(Err(e));
            true
        } else {
            false
        }
    }

    /// A worker takes up one of its units: true if it should run. A request that expired in
    /// the queue fails with a timeout; one whose session has closed is cancelled.
    pub fn pick_up(&self) -> bool {
        match self.cell.get() {
            Status::Submitted => {
                if self.expires.is_some_and(|t| Instant::now() > t) {
                    self.fail_unstarted(CoreError::TimedOut(self.id));
                    return false;
                }
                if self.session.closed.load(Ordering::Acquire) {
                    self.cancel();
                    return false;
                }
                match self.cell.advance(Status::InProgress) {
                    Ok(()) => {
                        let now = Instant::now();
                        self.state.lock_unpoisoned().started = Some(now);
                        self.session
                            .acct
                            .metrics
                            .engine(self.engine)
                            .queue_wait
                            .record((now - self.submitted).as_secs_f64());
                        true
                    }
                    // Another chunk's worker won the pickup, or a cancel did.
                    Err(_) => self.cell.get() == Status::InProgress,
                }
            }
            Status::InProgress => true,
            // Cancelled between the grab and the pickup: settle it here.
            Status::Cancelled => {
                self.finish(Err(CoreError::Cancelled(self.id)));
                false
            }
            _ => {
                self.finish(Err(CoreError::Internal(format!(
                    "request {} was finished outside the scheduler",
                    self.id
                ))));
                false
            }
        }
    }

    /// Takes a durable request's file out (a coalesced group flushes it once for all its
    /// members); [`restore_durable`](Self::restore_durable) puts it back.
    pub fn take_durable(&self) -> Option<FileHandle> {
        self.state.lock_unpoisoned().durable.take()
    }

    /// Puts back what [`take_durable`](Self::take_durable) took.
    pub fn restore_durable(&self, file: Option<FileHandle>) {
        self.state.lock_unpoisoned().durable = file;
    }

    /// Records one chunk's end; the last chunk settles the request. A durable request's
    /// destination is synced once, after every chunk succeeded, before it completes.
    pub fn chunk_done(&self, result: Result<Outcome>) {
        let mut s = self.state.lock_unpoisoned();
        s.chunks_left -= 1;
        if s.chunks_left > 0 {
            // Kept in the ticket only because a later chunk must see it: the ticket is written
            // by the submitter and read by a worker, so every line it spans is a line to fetch.
            match result {
                Ok(o) if s.first.is_none() => s.first = Some(Box::new(o)),
                Err(e) if s.error.is_none() => s.error = Some(Box::new(e)),
                _ => {}
            }
            return;
        }
        let earlier = s.error.take();
        let first = s.first.take();
        let durable = s.durable.take();
        drop(s);
        // The request's result: the first error, else its bytes the way its first chunk went,
        // once its file (if durable) is flushed.
        let result = match earlier {
            Some(e) => Err(*e),
            None => result.map(|last| first.map_or(last, |f| *f)),
        }
        .and_then(|o| {
            if let Some(file) = durable {
                file.sync_data()?;
            }
            Ok(Outcome {
                bytes: self.len,
                ..o
            })
        });
        let status = if result.is_ok() {
            Status::Completed
        } else {
            Status::Error
        };
        if self.cell.advance(status).is_ok() {
            self.finish(result);
        }
    }

    /// Gives up a queued chunk of a started request (its session closed).
    pub fn abandon_chunk(&self) {
        if !self.cancel() && self.cell.get() == Status::InProgress {
            self.chunk_done(Err(CoreError::Cancelled(self.id)));
        }
    }
}

impl Drop for TicketInner {
    fn drop(&mut self) {
        // Settled (the usual case): read without the lock, so that a submitter letting go of
        // many tickets a worker settled fetches their lines side by side, not one lock at a
        // time.
        if self.state.get_mut_unpoisoned().finished {
            return;
        }
        // Never settled: its queue went away unrun.
        if !self.cell.get().is_final() {
            let _ = self.cell.advance(Status::Error);
        }
        let e = match self.cell.get() {
            Status::Cancelled => CoreError::Cancelled(self.id),
            _ => CoreError::ShutDown,
        };
        self.finish(Err(e));
    }
}
