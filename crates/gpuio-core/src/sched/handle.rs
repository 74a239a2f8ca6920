//! What a submitter holds: a [`Ticket`] to watch or cancel a queued request, a
//! [`RequestHandle`] to also wait for it (blocking or as a future), a [`BatchHandle`] for a
//! batch, and the [`Completion`] each finally delivers.

use super::ticket::TicketInner;
use crate::error::{CoreError, Result};
use crate::outcome::Outcome;
use crate::request::{RequestId, Status};
use gpuio_hal::ErrorCode;
use gpuio_hal::sync::{CondvarExt, MutexExt};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// A finished request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Which request.
    pub id: RequestId,
    /// What the engine reported.
    pub outcome: Outcome,
    /// Time from the first pickup by a worker to completion.
    pub elapsed: Duration,
    /// Time from submission to completion.
    pub latency: Duration,
}

/// A one-shot value, awaitable both by blocking and as a future.
pub(crate) struct Slot<T> {
    state: Mutex<(Option<T>, Option<Waker>)>,
    ready: Condvar,
    /// The process whose workers fill it, in its line of forks: in a forked child nothing
    /// will, so a wait there ends at once with the result of `forked` below.
    generation: u64,
}

/// What waiting on a slot a forked child's workers will never fill gives.
fn forked<T>() -> Result<T> {
    Err(CoreError::InvalidRequest(
        "this request was submitted before fork(): the workers that run it stayed in the \
         parent process"
            .into(),
    ))
}

impl<T> Slot<T> {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new((None, None)),
            ready: Condvar::new(),
            generation: gpuio_hal::sys::fork_generation(),
        })
    }

    fn orphaned(&self) -> bool {
        gpuio_hal::sys::fork_generation() != self.generation
    }

    pub(crate) fn put(&self, value: T) {
        let mut s = self.state.lock_unpoisoned();
        s.0 = Some(value);
        if let Some(w) = s.1.take() {
            w.wake();
        }
        self.ready.notify_all();
    }

    /// The value, once put; `orphan()` where no worker of this process will put it.
    fn wait(&self, orphan: impl FnOnce() -> T) -> T {
        let mut s = self.state.lock_unpoisoned();
        loop {
            if let Some(v) = s.0.take() {
                return v;
            }
            if self.orphaned() {
                return orphan();
            }
            s = self.ready.wait_unpoisoned(s);
        }
    }

    fn poll(&self, cx: &Context<'_>, orphan: impl FnOnce() -> T) -> Poll<T> {
        let mut s = self.state.lock_unpoisoned();
        match s.0.take() {
            Some(v) => Poll::Ready(v),
            None if self.orphaned() => Poll::Ready(orphan()),
            None => {
                s.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// A submitted request: its status, and a way to cancel it while it is still queued. Holding
/// a ticket keeps its status readable, not the request's buffers: those are let go when it
/// finishes.
#[derive(Clone)]
pub struct Ticket {
    pub(crate) id: RequestId,
    pub(crate) inner: Arc<TicketInner>,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("id", &self.id)
            .field("status", &self.status())
            .finish()
    }
}

impl Ticket {
    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Its current status.
    pub fn status(&self) -> Status {
        self.inner.cell.get()
    }

    /// Cancels it if no worker has picked it up yet; its completion ([`CoreError::Cancelled`])
    /// is delivered at once, and its buffers are let go before that. Returns whether the
    /// cancel won.
    pub fn cancel(&self) -> bool {
        self.inner.cancel()
    }
}

/// A queued request: wait for it, `.await` it, or cancel it while it is still queued.
pub struct RequestHandle {
    pub(crate) ticket: Ticket,
    pub(crate) slot: Arc<Slot<Result<Completion>>>,
}

impl std::fmt::Debug for RequestHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestHandle")
            .field("id", &self.ticket.id)
            .field("status", &self.status())
            .finish()
    }
}

impl RequestHandle {
    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.ticket.id
    }

    /// Its current status.
    pub fn status(&self) -> Status {
        self.ticket.status()
    }

    /// The ticket (to cancel from elsewhere).
    pub fn ticket(&self) -> &Ticket {
        &self.ticket
    }

    /// See [`Ticket::cancel`].
    pub fn cancel(&self) -> bool {
        self.ticket.cancel()
    }

    /// Blocks until it completes.
    pub fn wait(self) -> Result<Completion> {
        self.slot.wait(forked)
    }
}

impl Future for RequestHandle {
    type Output = Result<Completion>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.slot.poll(cx, forked)
    }
}

/// What a batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Requests submitted.
    pub requests: usize,
    /// Transfers issued after coalescing.
    pub segments: usize,
    /// Bytes moved by the requests that succeeded.
    pub bytes: u64,
    /// Requests that failed or were cancelled: id, code, reason.
    pub failed: Vec<(RequestId, ErrorCode, String)>,
}

/// A queued batch: wait for it or `.await` it. It succeeds only if every request did; otherwise
/// the error ([`CoreError::Batch`]) carries the report, naming each failure.
pub struct BatchHandle {
    pub(crate) tickets: Vec<Ticket>,
    pub(crate) slot: Arc<Slot<Result<BatchReport>>>,
}

fn batch_result(r: Result<BatchReport>) -> Result<BatchReport> {
    match r {
        Ok(report) if !report.failed.is_empty() => Err(CoreError::Batch(Box::new(report))),
        other => other,
    }
}

impl std::fmt::Debug for BatchHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchHandle")
            .field("requests", &self.tickets.len())
            .finish_non_exhaustive()
    }
}

impl BatchHandle {
    /// The members' tickets, in submission order.
    pub fn tickets(&self) -> &[Ticket] {
        &self.tickets
    }

    /// Blocks until every request has finished.
    pub fn wait(self) -> Result<BatchReport> {
        batch_result(self.slot.wait(forked))
    }
}

impl Future for BatchHandle {
    type Output = Result<BatchReport>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.slot.poll(cx, forked).map(batch_result)
    }
}
