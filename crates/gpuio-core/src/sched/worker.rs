//! The worker threads. Each takes a few units at a time (up to `grab_bytes`) from the shared
//! queue into its own deque, merging adjacent small requests on the way (`coalesce.rs`),
//! steals from the others' deques when it has nothing, and spins briefly before it sleeps.
//! It runs a unit through the engines — retries, failover to alternate sources, a panic
//! turned into the request's error, a coalesced group that fails run again request by
//! request — and settles it.

use super::Shared;
use super::coalesce::Unit;
use super::ticket::TicketInner;
use crate::endpoint::Endpoint;
use crate::error::{CoreError, Result};
use crate::outcome::Outcome;
use crate::request::Request;
use crate::retry::RetryPolicy;
use crossbeam_deque::{Steal, Worker};
use gpuio_hal::sync::{ArcSlot, CondvarExt, MutexExt};
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// What a worker runs a chunk on.
enum Work {
    /// The whole request, taken out of its ticket.
    Owned(Request),
    /// Sources (the source and its alternates) and destination, advanced to the chunk.
    Shared(Vec<Endpoint>, Endpoint, bool),
}

/// What an idle worker does next.
enum Idle {
    /// Runs the unit a submitter handed it.
    Run(Unit),
    /// Looks for work again.
    Look,
    /// Exits: the scheduler is closing.
    Exit,
}

thread_local! {
    static IN_WORKER: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is one of the scheduler's workers (a completion callback
/// submitting more work: always admitted, so it cannot deadlock the pool).
pub(super) fn in_worker() -> bool {
    IN_WORKER.with(Cell::get)
}

/// Runs `f`, turning a panic into [`CoreError::Internal`].
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        tracing::error!(%what, %msg, "engine panicked");
        Err(CoreError::Internal(format!("{what} panicked: {msg}")))
    })
}

/// A worker thread: its own deque first, then the shared queue, then the others' deques,
/// then sleep; returns when the scheduler is closing and nothing is queued.
pub(super) fn worker_main(sh: Arc<Shared>, me: usize, local: Worker<Unit>) {
    IN_WORKER.with(|w| w.set(true));
    let mut spent = Vec::with_capacity(SPENT_BATCH);
    loop {
        let unit = match local.pop() {
            Some(u) => u,
            None => match sh.grab(&local).or_else(|| sh.steal(me)) {
                Some(u) => u,
                None => match sh.idle(me, &mut spent) {
                    Idle::Run(u) => u,
                    Idle::Look => continue,
                    Idle::Exit => return,
                },
            },
        };
        sh.run(unit, &mut spent);
        if spent.len() >= SPENT_BATCH {
            sh.spent.lock_unpoisoned().append(&mut spent);
        }
    }
}

/// Settled tickets a worker gathers before handing them back (one lock per this many).
const SPENT_BATCH: usize = 64;

impl Shared {
    fn policy(&self, no_retry: bool) -> &RetryPolicy {
        if no_retry {
            &RetryPolicy::NONE
        } else {
            &self.retry
        }
    }

    /// Takes units from the shared queue: returns the first to run now and puts the rest in
    /// the worker's deque (a lone unit never touches the deque, which idle workers poll).
    /// `None` if there were none.
    fn grab(&self, local: &Worker<Unit>) -> Option<Unit> {
        if self.queued.load(Ordering::Acquire) == 0 {
            return None;
        }
        let now = Instant::now();
        let mut taken = Vec::new();
        {
            let mut st = self.state.lock_unpoisoned();
            let mut bytes = 0u64;
            let floor = self.gate.floor();
            let mut counts = super::ClassCounts::default();
            while let Some((meta, unit)) = st.queue.pop_above(now, floor) {
                counts.count(meta.class);
                bytes += meta.cost.max(4096);
                taken.push(unit);
                if bytes >= self.cfg.grab_bytes || taken.len() >= 64 {
                    break;
                }
            }
            self.queued.fetch_sub(taken.len(), Ordering::AcqRel);
            self.queued_less(&counts);
            self.acct.metrics.queue_depth.set(st.queue.len() as f64);
        }
        self.publish_in_flight();
        let mut units = self.coalesce(taken).into_iter();
        let first = units.next()?;
        for u in units {
            local.push(u);
        }
        Some(first)
    }

    fn steal(&self, me: usize) -> Option<Unit> {
        let n = self.stealers.len();
        for i in 1..n {
            let s = &self.stealers[(me + i) % n];
            loop {
                match s.steal() {
                    Steal::Success(u) => {
                        self.acct.counters.stolen.add(1);
                        return Some(u);
                    }
                    Steal::Empty => break,
                    Steal::Retry => {}
                }
            }
        }
        None
    }

    fn stealable(&self) -> bool {
        self.stealers.iter().any(|s| !s.is_empty())
    }

    /// Waits for work: spins with its hand-off slot open, then sleeps. `Exit` when the
    /// scheduler is closing and the shared queue is empty.
    ///
    /// Settled tickets are kept while it spins: freeing them would write the session's
    /// reference count and the submitter's heap, lines the next submission then fetches
    /// back. Before it sleeps it lets go of them, and of those handed back.
    fn idle(&self, me: usize, spent: &mut Vec<Arc<TicketInner>>) -> Idle {
        let handoff = &self.handoffs[me];
        handoff.open();
        let found = self.spin(handoff);
        if let Some(t) = handoff.close() {
            let len = t.len;
            return Idle::Run(Unit::Chunk { t, off: 0, len });
        }
        if found {
            return Idle::Look;
        }
        spent.clear();
        self.free_spent();
        self.sleep()
    }

    /// Spins for a while: true when there is work in the queue or another worker's deque, or
    /// in this worker's hand-off slot (which `idle` then takes).
    fn spin(&self, handoff: &ArcSlot<TicketInner>) -> bool {
        // The shared queue's count and the slot are polled on every turn; the other workers'
        // deques and the clock every 32nd: reading a deque takes its lines from the worker
        // pushing and popping it, which slows that worker.
        let spin_until = Instant::now() + self.cfg.spin;
        let mut turn = 0u32;
        loop {
            // While a lease holds less urgent classes back, only units it lets through are
            // spun on; the held-back ones are looked at again when it ends, or by `sleep`
            // once they have waited `max_wait`.
            let queued = match self.gate.floor() {
                None => self.queued.load(Ordering::Acquire) > 0,
                Some(f) => self.queued_at_or_above(f),
            };
            if queued || handoff.is_full() {
                return true;
            }
            turn = turn.wrapping_add(1);
            if turn.is_multiple_of(32) {
                if self.stealable() {
                    return true;
                }
                if Instant::now() >= spin_until {
                    return false;
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Sleeps until work is queued (or another worker's deque has some after a timeout);
    /// `Exit` when the scheduler is closing and nothing is queued.
    fn sleep(&self) -> Idle {
        self.publish_in_flight();
        let mut st = self.state.lock_unpoisoned();
        loop {
            if st.queue.has_eligible(Instant::now(), self.gate.floor()) {
                return Idle::Look;
            }
            if st.closing {
                return Idle::Exit;
            }
            // Units held back by a lease become eligible once it ends (which wakes the
            // workers) or once they have waited `max_wait` (the timeout).
            let nap = if st.queue.is_empty() {
                Duration::from_millis(50)
            } else {
                self.cfg
                    .max_wait
                    .clamp(Duration::from_micros(100), Duration::from_millis(50))
            };
            self.sleepers.fetch_add(1, Ordering::AcqRel);
            let (g, timeout) = self.work.wait_timeout_unpoisoned(st, nap);
            st = g;
            self.sleepers.fetch_sub(1, Ordering::AcqRel);
            if timeout.timed_out() && self.stealable() {
                return Idle::Look;
            }
        }
    }

    /// Runs a unit and puts its tickets in `spent`.
    fn run(&self, unit: Unit, spent: &mut Vec<Arc<TicketInner>>) {
        match unit {
            Unit::Chunk { t, off, len } => {
                if t.pick_up() {
                    self.run_chunk(&t, off, len);
                }
                spent.push(t);
            }
            Unit::Group(ts) => {
                self.run_group(&ts);
                spent.extend(ts);
            }
        }
    }

    /// Runs a picked-up chunk: retries, alternates on failure, then settles it.
    fn run_chunk(&self, t: &TicketInner, off: usize, len: usize) {
        // A request of one chunk runs on this worker alone: take it out of the ticket
        // instead of cloning its endpoints (shared reference counts are costly to touch).
        let work = {
            let mut s = t.state.lock_unpoisoned();
            if s.error.is_some() {
                None
            } else if s.chunks_left == 1 && off == 0 && len == t.len {
                s.req.take().map(Work::Owned)
            } else {
                s.req.as_ref().map(|r| {
                    Work::Shared(
                        std::iter::once(&r.src)
                            .chain(&r.alternates)
                            .map(|e| e.advanced(off))
                            .collect(),
                        r.dst.advanced(off),
                        r.flags.no_retry,
                    )
                })
            }
        };
        let Some(work) = work else {
            // An earlier chunk failed: this one only counts down.
            t.chunk_done(Err(CoreError::Cancelled(t.id)));
            return;
        };
        let span = tracing::debug_span!("request", id = t.id.0, engine = %t.engine, off, len);
        let _enter = span.enter();
        let run = |sources: &[Endpoint], dst: &Endpoint, no_retry: bool| {
            let c = &self.acct.counters;
            let m = &self.acct.metrics;
            guarded("request", || {
                self.engines.execute_any(
                    sources,
                    dst,
                    len,
                    self.policy(no_retry),
                    t.expires,
                    &mut || {
                        c.retries.add(1);
                        m.retries.increment(1);
                    },
                    &mut || {
                        c.failovers.add(1);
                        m.failovers.increment(1);
                    },
                )
            })
        };
        match work {
            Work::Owned(req) => {
                let result = if req.alternates.is_empty() {
                    run(std::slice::from_ref(&req.src), &req.dst, req.flags.no_retry)
                } else {
                    let sources: Vec<Endpoint> = std::iter::once(&req.src)
                        .chain(&req.alternates)
                        .cloned()
                        .collect();
                    run(&sources, &req.dst, req.flags.no_retry)
                };
                // Let go of the buffers before the completion is delivered.
                drop(req);
                t.chunk_done(result);
            }
            Work::Shared(sources, dst, no_retry) => {
                let result = run(&sources, &dst, no_retry);
                drop((sources, dst));
                t.chunk_done(result);
            }
        }
    }

    /// Runs merged requests as one transfer; on failure (or if some were cancelled meanwhile)
    /// runs them one by one, so one bad request fails alone.
    fn run_group(&self, ts: &[Arc<TicketInner>]) {
        let all = ts.len();
        let picked: Vec<&Arc<TicketInner>> = ts.iter().filter(|t| t.pick_up()).collect();
        if picked.len() == all && all > 1 {
            let first = {
                let s = picked[0].state.lock_unpoisoned();
                s.req
                    .as_ref()
                    .map(|r| (r.src.clone(), r.dst.clone(), r.flags.no_retry))
            };
            let total: usize = picked.iter().map(|t| t.len).sum();
            let until = picked.iter().filter_map(|t| t.expires).min();
            if let Some((src, dst, no_retry)) = first {
                let result = guarded("coalesced requests", || {
                    self.retry_policy_run(no_retry, until, || {
                        self.engines.execute(&src, &dst, total)
                    })
                });
                // Durable members write one file: it is flushed once for the group. If that
                // fails, each member runs (and flushes) again on its own.
                let durable: Vec<_> = picked.iter().map(|t| t.take_durable()).collect();
                let synced = result.and_then(|o| match durable.iter().flatten().next() {
                    Some(file) => file.sync_data().map(|()| o).map_err(CoreError::from),
                    None => Ok(o),
                });
                match synced {
                    Ok(o) => {
                        drop(durable);
                        for t in &picked {
                            let outcome = Outcome {
                                bytes: t.len,
                                coalesced: all,
                                ..o.clone()
                            };
                            t.chunk_done(Ok(outcome));
                        }
                        return;
                    }
                    Err(_) => {
                        for (t, file) in picked.iter().zip(durable) {
                            t.restore_durable(file);
                        }
                    }
                }
            }
        }
        for t in &picked {
            self.run_chunk(t, 0, t.len);
        }
    }

    fn retry_policy_run<T>(
        &self,
        no_retry: bool,
        until: Option<Instant>,
        op: impl FnMut() -> Result<T>,
    ) -> Result<T> {
        let c = &self.acct.counters;
        self.policy(no_retry).run_until(
            until,
            || {
                c.retries.add(1);
            },
            op,
        )
    }
}
