//! The request scheduler (docs/REFERENCE.md#scheduling): many sessions with different priority
//! classes and deadlines share the transports through one set of worker threads.
//!
//! - **Ordering** is the [`ReadyQueue`]'s: per-engine queues, earliest deadline first, CFS
//!   fairness across sessions, the AI priority classes, and an aging bound against starvation,
//!   under the policies FIFO, PRIORITY, DEADLINE and ADAPTIVE.
//! - **Preemption points**: requests larger than `chunk_size` are queued as chunks, so a bulk
//!   transfer yields to urgent work between chunks (and its chunks run on several workers).
//! - **Workers** take a few units at a time (up to `grab_bytes`) into their own deque, merge
//!   adjacent small requests into one transfer, and steal from each other's deques when idle.
//!   Idle workers spin briefly before they sleep, which keeps small-request latency in
//!   microseconds.
//! - **Backpressure**: bytes admitted and not yet completed are bounded per engine and per
//!   session; a submitter waits for room (or gets [`CoreError::Busy`] from `try_submit`).
//!   Submissions from worker threads (completion callbacks) are always admitted, so a callback
//!   cannot deadlock the pool.
//! - **Completions** are delivered exactly once, after the request let go of its buffers: a
//!   cancel delivers at once, a closed session cancels its queued work, and shutdown runs what
//!   is queued.
//!
//! This file holds the [`Scheduler`] and its sessions (start, submission and admission,
//! batches, cancellation, shutdown) and the state the workers share. `config.rs` holds the
//! settings; `queue.rs` the ordering alone; `coalesce.rs` how requests are cut into queue
//! units and small ones merged again; `worker.rs` the worker loop and how a unit runs;
//! `ticket.rs` a request inside the scheduler and its exactly-once settlement; `budget.rs`
//! backpressure; `handle.rs` what submitters hold.

mod budget;
mod coalesce;
mod config;
mod handle;
mod lease;
pub mod queue;
#[cfg(test)]
mod tests;
mod ticket;
mod worker;

pub use config::{SchedulerConfig, SessionOptions};
pub use handle::{BatchHandle, BatchReport, Completion, RequestHandle, Ticket};
pub use lease::{Lease, Lessor};
pub use queue::{Meta, Policy, QueueConfig, Rank, ReadyQueue, SessionId};
pub use ticket::SchedStats;

use crate::batch;
use crate::engine::Engines;
use crate::error::{CoreError, Result};
use crate::metrics::SchedMetrics;
use crate::request::{Priority, Request};
use crate::retry::RetryPolicy;
use budget::Budgets;
use coalesce::Unit;
use crossbeam_deque::{Stealer, Worker};
use gpuio_hal::sync::MutexExt;
use handle::Slot;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;
use ticket::{Accounting, Counters, Done, SessionState, TicketInner};

/// What the shared queue's lock guards.
struct State {
    queue: ReadyQueue<Unit>,
    closing: bool,
}

/// What the scheduler, its sessions and its workers share. Its methods are spread over the
/// files by concern: queueing units in `coalesce.rs`, taking and running them in `worker.rs`.
struct Shared {
    cfg: SchedulerConfig,
    /// Mirrors `State::closing`, so submissions are refused before they touch a request.
    closing: AtomicBool,
    engines: Engines,
    retry: RetryPolicy,
    state: Mutex<State>,
    work: Condvar,
    queued: crossbeam_utils::CachePadded<AtomicUsize>,
    /// Units queued per class (of `queued`): while a lease holds a class back, idle workers
    /// and the hand-off look only at the classes it lets through. On a line of its own: it
    /// changes with every grab, and the fields around it are read on every request.
    queued_by_class: crossbeam_utils::CachePadded<[AtomicUsize; 6]>,
    sleepers: AtomicUsize,
    acct: Arc<Accounting>,
    stealers: Vec<Stealer<Unit>>,
    /// One per worker, each on its own cache line: where a submitter hands a request straight
    /// to the worker while it spins for work (`Shared::enqueue`).
    handoffs: Vec<crossbeam_utils::CachePadded<gpuio_hal::sync::ArcSlot<TicketInner>>>,
    next_session: AtomicU64,
    /// The leases held (IO of a class running outside the workers).
    gate: lease::Gate,
    /// Tickets the workers are done with, handed back in bulk so that a submitting thread
    /// (which allocated them) lets them go: a worker freeing them itself would write a line
    /// of the submitter's heap and of the session's reference count for every request.
    spent: crossbeam_utils::CachePadded<Mutex<Vec<Arc<TicketInner>>>>,
}

/// The scheduler: its worker pool and the default session (which it dereferences to, so
/// `scheduler.submit(request)` works).
pub struct Scheduler {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    default: SchedSession,
    /// The process that started the workers, in its line of forks: a forked child has none
    /// of them to join.
    generation: u64,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("workers", &self.workers.len())
            .field("policy", &self.shared.cfg.policy)
            .finish()
    }
}

impl std::ops::Deref for Scheduler {
    type Target = SchedSession;

    fn deref(&self) -> &SchedSession {
        &self.default
    }
}

impl Scheduler {
    /// Starts the workers over `engines`.
    pub fn new(engines: Engines, cfg: SchedulerConfig, retry: RetryPolicy) -> Result<Self> {
        let n = cfg.workers.max(1);
        let locals: Vec<Worker<Unit>> = (0..n).map(|_| Worker::new_fifo()).collect();
        let queue = ReadyQueue::new(QueueConfig {
            policy: cfg.policy,
            max_wait: cfg.max_wait,
            urgent_window: cfg.urgent_window,
        });
        let shared = Arc::new(Shared {
            engines,
            retry,
            state: Mutex::new(State {
                queue,
                closing: false,
            }),
            work: Condvar::new(),
            queued: Default::default(),
            queued_by_class: Default::default(),
            sleepers: AtomicUsize::new(0),
            acct: Arc::new(Accounting {
                budgets: Budgets::new(cfg.engine_in_flight),
                counters: Counters::default(),
                metrics: SchedMetrics::new(),
            }),
            stealers: locals.iter().map(Worker::stealer).collect(),
            handoffs: (0..n).map(|_| Default::default()).collect(),
            next_session: AtomicU64::new(1),
            gate: Default::default(),
            spent: Default::default(),
            closing: AtomicBool::new(false),
            cfg,
        });
        let generation = gpuio_hal::sys::fork_generation();
        let mut workers = Vec::with_capacity(n);
        for (i, local) in locals.into_iter().enumerate() {
            let sh = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("gpuio-worker-{i}"))
                .spawn(move || worker::worker_main(sh, i, local));
            match spawned {
                Ok(h) => workers.push(h),
                Err(e) => {
                    let mut s = Self {
                        default: SchedSession::new(&shared, SessionOptions::default(), false),
                        shared,
                        workers,
                        generation,
                    };
                    s.shutdown();
                    return Err(CoreError::Internal(format!("starting a worker: {e}")));
                }
            }
        }
        Ok(Self {
            default: SchedSession::new(&shared, SessionOptions::default(), false),
            shared,
            workers,
            generation,
        })
    }

    /// The settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.shared.cfg
    }

    /// The engines it runs work on.
    pub fn engines(&self) -> &Engines {
        &self.shared.engines
    }

    /// A new session (tenant): its own fair share and in-flight budget. Dropping it cancels
    /// its queued work.
    pub fn session(&self, opts: SessionOptions) -> SchedSession {
        SchedSession::new(&self.shared, opts, true)
    }

    /// The default session.
    pub fn default_session(&self) -> &SchedSession {
        &self.default
    }

    /// Counters, queue depth and in-flight bytes.
    pub fn stats(&self) -> SchedStats {
        let sh = &self.shared;
        let mut s = sh.acct.counters.snapshot();
        s.queued = sh.queued.load(Ordering::Relaxed) as u64;
        s.in_flight_bytes = [
            crate::EngineKind::MemIo,
            crate::EngineKind::LocalIo,
            crate::EngineKind::RemoteIo,
        ]
        .map(|e| sh.acct.budgets.in_flight(e));
        s
    }

    /// Stops taking work, lets the workers finish what is queued, and joins them. In a
    /// process forked from the one that started them it lets go of their handles only: the
    /// workers, and the work queued for them, are the parent's.
    pub fn shutdown(&mut self) {
        if gpuio_hal::sys::fork_generation() != self.generation {
            self.workers.drain(..).for_each(std::mem::forget);
            return;
        }
        {
            let mut st = self.shared.state.lock_unpoisoned();
            st.closing = true;
            self.shared.closing.store(true, Ordering::Release);
            self.shared.work.notify_all();
        }
        for w in self.workers.drain(..) {
            if w.join().is_err() {
                tracing::error!("a gpuio worker thread panicked");
            }
        }
        // Workers leave nothing queued; if one died, what it left (in the shared queue or its
        // own deque) fails here, once: a handle may be waiting for it.
        let mut rest: Vec<Unit> = {
            let mut st = self.shared.state.lock_unpoisoned();
            std::iter::from_fn(|| st.queue.pop(Instant::now()).map(|(_, u)| u)).collect()
        };
        for s in &self.shared.stealers {
            rest.extend(std::iter::from_fn(|| {
                loop {
                    match s.steal() {
                        crossbeam_deque::Steal::Success(u) => return Some(u),
                        crossbeam_deque::Steal::Empty => return None,
                        crossbeam_deque::Steal::Retry => {}
                    }
                }
            }));
        }
        rest.into_iter().for_each(Unit::shut_down);
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A scheduling session: a tenant with its own fair share and in-flight budget. Requests
/// submitted through it are ordered against other sessions' by the policy.
pub struct SchedSession {
    shared: Arc<Shared>,
    state: Arc<SessionState>,
    cancel_on_drop: bool,
}

impl std::fmt::Debug for SchedSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedSession")
            .field("id", &self.state.id)
            .field("weight", &self.state.weight)
            .finish()
    }
}

impl SchedSession {
    fn new(shared: &Arc<Shared>, opts: SessionOptions, cancel_on_drop: bool) -> Self {
        Self {
            state: Arc::new(SessionState {
                id: SessionId(shared.next_session.fetch_add(1, Ordering::Relaxed)),
                weight: opts.weight.max(1),
                limit: opts
                    .max_in_flight
                    .unwrap_or(shared.cfg.session_in_flight)
                    .max(1),
                in_flight: Default::default(),
                closed: AtomicBool::new(false),
                acct: shared.acct.clone(),
            }),
            shared: shared.clone(),
            cancel_on_drop,
        }
    }

    /// This session's id.
    pub fn id(&self) -> SessionId {
        self.state.id
    }

    /// Bytes this session has admitted and not yet completed.
    pub fn in_flight_bytes(&self) -> u64 {
        self.state.in_flight.held()
    }

    fn ticket(&self, req: Request, done: Done, now: Instant) -> Arc<TicketInner> {
        let chunk = self.shared.cfg.chunk_size.max(1);
        let chunks = if req.splittable(chunk) {
            req.len.div_ceil(chunk).max(1)
        } else {
            1
        };
        Arc::new(TicketInner::new(req, done, chunks, self.state.clone(), now))
    }

    fn public(t: &Arc<TicketInner>) -> Ticket {
        Ticket {
            id: t.id,
            inner: t.clone(),
        }
    }

    /// Admits and queues requests one by one; when admission has to wait, what is admitted
    /// so far is queued first (it may be what frees the room).
    fn submit_all(&self, items: Vec<(Request, Done)>, wait: bool) -> Result<Vec<Ticket>> {
        let sh = &self.shared;
        if sh.closing.load(Ordering::Acquire) {
            return Err(CoreError::ShutDown);
        }
        let in_worker = worker::in_worker();
        sh.free_spent();
        let budgets = &sh.acct.budgets;
        // One admission for a whole single-engine submission where it fits: the shared
        // counters are touched once instead of once per request.
        let mut prepaid: u64 = match items.first() {
            Some((first, _))
                if items.len() > 1 && items.iter().all(|(r, _)| r.engine == first.engine) =>
            {
                let total: u64 = items.iter().map(|(r, _)| r.len as u64).sum();
                budgets
                    .acquire(first.engine, &self.state, total, false, false)
                    .map_or(0, |()| total)
            }
            _ => 0,
        };
        let now = Instant::now();
        let mut pending: Vec<Arc<TicketInner>> = Vec::new();
        let mut out = Vec::with_capacity(items.len());
        for (req, done) in items {
            let (engine, bytes) = (req.engine, req.len as u64);
            if prepaid > 0 {
                prepaid -= bytes;
            } else if budgets
                .acquire(engine, &self.state, bytes, false, in_worker)
                .is_err()
            {
                sh.enqueue(&std::mem::take(&mut pending))?;
                budgets.acquire(engine, &self.state, bytes, wait, false)?;
            }
            let t = self.ticket(req, done, now);
            out.push(Self::public(&t));
            pending.push(t);
        }
        sh.enqueue(&pending)?;
        Ok(out)
    }

    /// Queues a request; `on_done` runs (on a worker thread, or on the cancelling thread)
    /// when it finishes. Waits for room under backpressure. If the request cannot be
    /// queued, this returns the error and `on_done` never runs.
    pub fn submit_with(
        &self,
        req: Request,
        on_done: impl FnOnce(Result<Completion>) + Send + 'static,
    ) -> Result<Ticket> {
        let mut t = self.submit_all(vec![(req, Box::new(on_done))], true)?;
        t.pop()
            .ok_or_else(|| CoreError::Internal("no ticket".into()))
    }

    /// Queues a request and returns a handle to wait on, poll as a future, or cancel.
    pub fn submit(&self, req: Request) -> Result<RequestHandle> {
        self.submit_handle(req, true)
    }

    /// Like [`submit`](Self::submit), but fails with [`CoreError::Busy`] instead of waiting
    /// when the engine's or the session's in-flight budget is full.
    pub fn try_submit(&self, req: Request) -> Result<RequestHandle> {
        self.submit_handle(req, false)
    }

    fn submit_handle(&self, req: Request, wait: bool) -> Result<RequestHandle> {
        let slot = Slot::new();
        let s = slot.clone();
        let mut t = self.submit_all(vec![(req, Box::new(move |r| s.put(r)))], wait)?;
        let ticket = t
            .pop()
            .ok_or_else(|| CoreError::Internal("no ticket".into()))?;
        Ok(RequestHandle { ticket, slot })
    }

    /// Queues many requests under one lock where budgets allow; `on_done` runs for each.
    pub fn submit_each(
        &self,
        reqs: Vec<Request>,
        on_done: impl Fn(Result<Completion>) + Clone + Send + 'static,
    ) -> Result<Vec<Ticket>> {
        let items = reqs
            .into_iter()
            .map(|r| {
                let f = on_done.clone();
                (r, Box::new(f) as Done)
            })
            .collect();
        self.submit_all(items, true)
    }

    /// Plans a batch (sort, coalesce, group by engine; docs/REFERENCE.md#batches) and queues its
    /// transfers. Each request's status follows its own result; the handle reports them all.
    pub fn submit_batch(&self, requests: Vec<Request>) -> Result<BatchHandle> {
        let sh = &self.shared;
        if sh.closing.load(Ordering::Acquire) {
            return Err(CoreError::ShutDown);
        }
        let plan = batch::plan(&requests);
        let n = requests.len();
        let slot = Slot::new();
        let report = Arc::new(Mutex::new((
            BatchReport {
                requests: n,
                segments: plan.segments(),
                ..BatchReport::default()
            },
            n,
        )));
        if n == 0 {
            slot.put(Ok(report.lock_unpoisoned().0.clone()));
            return Ok(BatchHandle {
                tickets: Vec::new(),
                slot,
            });
        }
        // Admitted as a whole: admitting member by member could wait for room that only
        // earlier members, not yet queued, would free.
        let mut parts: Vec<(crate::EngineKind, u64)> = Vec::new();
        for r in &requests {
            match parts.iter_mut().find(|(e, _)| *e == r.engine) {
                Some((_, b)) => *b += r.len as u64,
                None => parts.push((r.engine, r.len as u64)),
            }
        }
        sh.acct
            .budgets
            .acquire_all(&parts, &self.state, worker::in_worker())?;
        let mut tickets: Vec<Arc<TicketInner>> = Vec::with_capacity(n);
        for req in requests {
            let (report, slot) = (report.clone(), slot.clone());
            let id = req.id;
            let done: Done = Box::new(move |r| {
                let mut g = report.lock_unpoisoned();
                match r {
                    Ok(c) => g.0.bytes += c.outcome.bytes as u64,
                    Err(e) => g.0.failed.push((id, e.code(), e.to_string())),
                }
                g.1 -= 1;
                if g.1 == 0 {
                    slot.put(Ok(g.0.clone()));
                }
            });
            tickets.push(self.ticket(req, done, Instant::now()));
        }
        let public = tickets.iter().map(Self::public).collect();
        let mut units = Vec::new();
        let mut grouped = Vec::new();
        let mut singles = Vec::new();
        for seg in plan.groups.into_values().flatten() {
            let members: Vec<Arc<TicketInner>> =
                seg.members.iter().map(|&i| tickets[i].clone()).collect();
            if members.len() == 1 {
                singles.extend(members);
            } else {
                let mut meta = sh.meta(&members[0], seg.len);
                meta.class = members.iter().map(|t| t.class).min().unwrap_or(meta.class);
                meta.deadline = members.iter().filter_map(|t| t.deadline).min();
                grouped.extend(members.iter().cloned());
                units.push((meta, Unit::Group(members)));
            }
        }
        drop(tickets);
        sh.enqueue_units(&grouped, units)?;
        sh.enqueue(&singles)?;
        Ok(BatchHandle {
            tickets: public,
            slot,
        })
    }

    /// Holds `class` for IO that runs outside the workers (a device gather on this thread, a
    /// side thread's scatter): waits until no lease of a more urgent class is held (at most
    /// `max_wait`), and while it is held, less urgent leases and queued units wait
    /// ([`Lease`]). `deadline`, where given, counts as met or missed when it is dropped.
    pub fn lease(&self, class: Priority, deadline: Option<Instant>) -> Lease {
        Lease::acquire(&self.shared, class, deadline)
    }

    /// A handle that takes leases on this scheduler, for structures that outlive a borrow of
    /// the session.
    pub fn lessor(&self) -> Lessor {
        Lessor::new(&self.shared)
    }

    /// Cancels every queued request of this session (running ones finish).
    pub fn cancel_queued(&self) -> usize {
        let drained = {
            let mut st = self.shared.state.lock_unpoisoned();
            let d = st.queue.drain_session(self.state.id);
            self.shared.queued.fetch_sub(d.len(), Ordering::AcqRel);
            let mut counts = ClassCounts::default();
            d.iter().for_each(|(meta, _)| counts.count(meta.class));
            self.shared.queued_less(&counts);
            self.shared
                .acct
                .metrics
                .queue_depth
                .set(st.queue.len() as f64);
            d
        };
        let n = drained.len();
        for (_, unit) in drained {
            unit.abandon();
        }
        n
    }
}

/// Units counted per class, applied to [`Shared::queued_by_class`] once per batch (one atomic
/// per class touched, not one per unit).
#[derive(Default)]
pub(super) struct ClassCounts([usize; 6]);

impl ClassCounts {
    pub(super) fn count(&mut self, class: Priority) {
        self.0[class as usize] += 1;
    }
}

impl Shared {
    /// Lets go of the tickets the workers handed back (skipped if a worker is handing some
    /// now).
    fn free_spent(&self) {
        drop(self.spent.try_lock().map(|mut v| std::mem::take(&mut *v)));
    }

    /// Adds (`up`) or takes away `counts` from the queued units per class.
    fn apply(&self, counts: &ClassCounts, up: bool) {
        for (n, a) in counts.0.iter().zip(self.queued_by_class.iter()) {
            if *n > 0 {
                if up {
                    a.fetch_add(*n, Ordering::AcqRel);
                } else {
                    a.fetch_sub(*n, Ordering::AcqRel);
                }
            }
        }
    }

    pub(super) fn queued_more(&self, counts: &ClassCounts) {
        self.apply(counts, true);
    }

    pub(super) fn queued_less(&self, counts: &ClassCounts) {
        self.apply(counts, false);
    }

    /// Whether a unit of `class` or a more urgent one is queued.
    fn queued_at_or_above(&self, class: Priority) -> bool {
        self.queued_by_class[..=class as usize]
            .iter()
            .any(|n| n.load(Ordering::Acquire) > 0)
    }
}

impl Drop for SchedSession {
    fn drop(&mut self) {
        if self.cancel_on_drop {
            self.state.closed.store(true, Ordering::Release);
            self.cancel_queued();
        }
    }
}
