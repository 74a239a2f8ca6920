//! The request scheduler (SAD §2.2.1, SDD §3.1, §10.5): many sessions with different priority
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

mod handle;
pub mod queue;
mod ticket;

pub use handle::{BatchHandle, BatchReport, Completion, RequestHandle, Ticket};
pub use queue::{Meta, Policy, QueueConfig, Rank, ReadyQueue, SessionId};
pub use ticket::SchedStats;

use crate::batch;
use crate::endpoint::Endpoint;
use crate::engine::{Engines, Outcome};
use crate::error::{CoreError, Result};
use crate::metrics::SchedMetrics;
use crate::request::{Request, Status};
use crate::retry::RetryPolicy;
use crossbeam_deque::{Steal, Stealer, Worker};
use gpuio_hal::sync::{CondvarExt, MutexExt};
use handle::Slot;
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use ticket::{Accounting, Budgets, Counters, Done, SessionState, TicketInner};

/// The scheduler's settings (the `[scheduler]` section of the configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    /// Worker threads.
    pub workers: usize,
    /// Ordering policy.
    pub policy: Policy,
    /// Starvation bound: a class waiting this long while others run goes next.
    #[serde(with = "micros")]
    pub max_wait: Duration,
    /// ADAPTIVE: deadlines closer than this are served first.
    #[serde(with = "micros")]
    pub urgent_window: Duration,
    /// Requests larger than this are queued as chunks of this size (preemption points).
    pub chunk_size: usize,
    /// Bytes admitted and not yet completed, per engine.
    pub engine_in_flight: u64,
    /// Bytes admitted and not yet completed, per session.
    pub session_in_flight: u64,
    /// A worker takes units from the shared queue until they add up to this many bytes.
    pub grab_bytes: u64,
    /// Adjacent small requests are merged into transfers of at most this size.
    pub coalesce_max: usize,
    /// How long an idle worker spins before it sleeps.
    #[serde(with = "micros")]
    pub spin: Duration,
}

mod micros {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_micros() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_micros)
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        let q = QueueConfig::default();
        Self {
            workers: 4,
            policy: q.policy,
            max_wait: q.max_wait,
            urgent_window: q.urgent_window,
            chunk_size: 1 << 20,
            engine_in_flight: 8 << 30,
            session_in_flight: 2 << 30,
            grab_bytes: 256 << 10,
            coalesce_max: 1 << 20,
            spin: Duration::from_micros(50),
        }
    }
}

/// How a session shares the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionOptions {
    /// Fair-share weight against other sessions of the same class (≥ 1).
    pub weight: u32,
    /// Bytes this session may have in flight (default: the scheduler's `session_in_flight`).
    pub max_in_flight: Option<u64>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            weight: 1,
            max_in_flight: None,
        }
    }
}

/// A unit of work in the queues.
enum Unit {
    /// Bytes `off..off+len` of one request.
    Chunk {
        t: Arc<TicketInner>,
        off: usize,
        len: usize,
    },
    /// Whole requests, adjacent on both sides, run as one transfer.
    Group(Vec<Arc<TicketInner>>),
}

impl Unit {
    fn abandon(self) {
        match self {
            Unit::Chunk { t, .. } => t.abandon_chunk(),
            Unit::Group(ts) => ts.iter().for_each(|t| t.abandon_chunk()),
        }
    }
}

/// What a worker runs a chunk on.
enum Work {
    /// The whole request, taken out of its ticket.
    Owned(Request),
    /// Sources (the source and its alternates) and destination, advanced to the chunk.
    Shared(Vec<Endpoint>, Endpoint, bool),
}

struct State {
    queue: ReadyQueue<Unit>,
    closing: bool,
}

struct Shared {
    cfg: SchedulerConfig,
    /// Mirrors `State::closing`, so submissions are refused before they touch a request.
    closing: AtomicBool,
    engines: Engines,
    retry: RetryPolicy,
    state: Mutex<State>,
    work: Condvar,
    queued: crossbeam_utils::CachePadded<AtomicUsize>,
    sleepers: AtomicUsize,
    acct: Arc<Accounting>,
    stealers: Vec<Stealer<Unit>>,
    next_session: AtomicU64,
}

thread_local! {
    static IN_WORKER: Cell<bool> = const { Cell::new(false) };
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

fn durable_sync(req: &Request) -> Result<()> {
    if req.flags.durable
        && let Endpoint::File { file, .. } = &req.dst
    {
        file.sync_data()?;
    }
    Ok(())
}

impl Shared {
    fn policy(&self, no_retry: bool) -> &RetryPolicy {
        if no_retry {
            &RetryPolicy::NONE
        } else {
            &self.retry
        }
    }

    fn meta(&self, t: &TicketInner, cost: usize) -> Meta {
        Meta {
            seq: 0,
            session: t.session.id,
            weight: t.session.weight,
            class: t.class,
            deadline: t.deadline,
            engine: t.engine,
            cost: cost as u64,
            arrival: t.submitted,
        }
    }

    /// Queues units; wakes sleeping workers.
    fn push(&self, st: &mut State, units: Vec<(Meta, Unit)>) {
        let n = units.len();
        for (meta, unit) in units {
            st.queue.push(meta, unit);
        }
        self.queued.fetch_add(n, Ordering::AcqRel);
        self.acct.metrics.queue_depth.set(st.queue.len() as f64);
        let sleeping = self.sleepers.load(Ordering::Acquire);
        if sleeping > 0 {
            if n >= sleeping {
                self.work.notify_all();
            } else {
                (0..n).for_each(|_| self.work.notify_one());
            }
        }
    }

    /// Queues admitted tickets (one unit per chunk); refuses them all if shutting down.
    fn enqueue(&self, tickets: &[Arc<TicketInner>]) -> Result<()> {
        let units: Vec<(Meta, Unit)> = tickets
            .iter()
            .flat_map(|t| {
                let chunk = self.cfg.chunk_size.max(1);
                let n = t.len.div_ceil(chunk).max(1);
                (0..n).map(move |i| {
                    let off = i * chunk;
                    let len = chunk.min(t.len - off.min(t.len));
                    (
                        self.meta(t, len),
                        Unit::Chunk {
                            t: t.clone(),
                            off,
                            len,
                        },
                    )
                })
            })
            .collect();
        self.enqueue_units(tickets, units)
    }

    fn enqueue_units(&self, tickets: &[Arc<TicketInner>], units: Vec<(Meta, Unit)>) -> Result<()> {
        let mut st = self.state.lock_unpoisoned();
        if st.closing {
            drop(st);
            for t in tickets {
                t.disarm();
                t.fail_unstarted(CoreError::ShutDown);
            }
            return Err(CoreError::ShutDown);
        }
        for t in tickets {
            let m = &self.acct.metrics;
            m.class(t.engine, t.class).submitted.increment(1);
            m.engine(t.engine)
                .in_flight
                .set(self.acct.budgets.in_flight(t.engine) as f64);
        }
        self.acct
            .counters
            .submitted
            .fetch_add(tickets.len() as u64, Ordering::Relaxed);
        self.push(&mut st, units);
        Ok(())
    }

    /// Takes units from the shared queue into a worker's deque. False if there were none.
    fn grab(&self, local: &Worker<Unit>) -> bool {
        if self.queued.load(Ordering::Acquire) == 0 {
            return false;
        }
        let now = Instant::now();
        let mut taken = Vec::new();
        {
            let mut st = self.state.lock_unpoisoned();
            let mut bytes = 0u64;
            while let Some((meta, unit)) = st.queue.pop(now) {
                bytes += meta.cost.max(4096);
                taken.push(unit);
                if bytes >= self.cfg.grab_bytes || taken.len() >= 64 {
                    break;
                }
            }
            self.queued.fetch_sub(taken.len(), Ordering::AcqRel);
            self.acct.metrics.queue_depth.set(st.queue.len() as f64);
        }
        if taken.is_empty() {
            return false;
        }
        for u in self.coalesce(taken) {
            local.push(u);
        }
        true
    }

    /// Merges whole small requests that continue each other on both sides. A merged group
    /// takes the place of its earliest member, so the policy's order otherwise stands.
    fn coalesce(&self, taken: Vec<Unit>) -> Vec<Unit> {
        let max = self.cfg.coalesce_max;
        if taken.len() < 2 || max == 0 {
            return taken;
        }
        // Most grabs hold nothing to merge: look at the sorted keys before rebuilding.
        let mut keys: Vec<(batch::MergeKey, usize)> = taken
            .iter()
            .filter_map(|u| match u {
                Unit::Chunk { t, off: 0, len } if *len == t.len && *len > 0 && *len <= max => {
                    t.merge.map(|k| (k, *len))
                }
                _ => None,
            })
            .collect();
        keys.sort_unstable_by_key(|(k, _)| *k);
        let mergeable = keys
            .windows(2)
            .any(|w| w[0].0.continued_by(&w[1].0, w[0].1) && w[0].1 + w[1].1 <= max);
        if !mergeable {
            return taken;
        }
        let mut out: Vec<(usize, Unit)> = Vec::with_capacity(taken.len());
        let mut cands = Vec::new();
        for (i, u) in taken.into_iter().enumerate() {
            match u {
                Unit::Chunk { t, off: 0, len } if len == t.len && len > 0 && len <= max => {
                    match t.merge {
                        Some(key) => cands.push((key, i, t)),
                        None => out.push((i, Unit::Chunk { t, off: 0, len })),
                    }
                }
                other => out.push((i, other)),
            }
        }
        cands.sort_unstable_by_key(|(k, _, _)| *k);
        let mut run: Vec<(usize, Arc<TicketInner>)> = Vec::new();
        let mut run_key: Option<batch::MergeKey> = None;
        let mut run_len = 0;
        let flush = |run: &mut Vec<(usize, Arc<TicketInner>)>, out: &mut Vec<(usize, Unit)>| {
            let first = run.iter().map(|(i, _)| *i).min().unwrap_or(0);
            match run.len() {
                0 => {}
                1 => {
                    let (_, t) = run.pop().expect("one");
                    let len = t.len;
                    out.push((first, Unit::Chunk { t, off: 0, len }));
                }
                n => {
                    self.acct
                        .counters
                        .coalesced
                        .fetch_add(n as u64, Ordering::Relaxed);
                    let ts = run.drain(..).map(|(_, t)| t).collect();
                    out.push((first, Unit::Group(ts)));
                }
            }
        };
        for (key, i, t) in cands {
            let joins =
                run_key.is_some_and(|k| k.continued_by(&key, run_len)) && run_len + t.len <= max;
            if !joins {
                flush(&mut run, &mut out);
                run_len = 0;
                run_key = Some(key);
            }
            run_len += t.len;
            run.push((i, t));
        }
        flush(&mut run, &mut out);
        out.sort_unstable_by_key(|(i, _)| *i);
        out.into_iter().map(|(_, u)| u).collect()
    }

    fn steal(&self, me: usize) -> Option<Unit> {
        let n = self.stealers.len();
        for i in 1..n {
            let s = &self.stealers[(me + i) % n];
            loop {
                match s.steal() {
                    Steal::Success(u) => {
                        self.acct.counters.stolen.fetch_add(1, Ordering::Relaxed);
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

    /// Waits for work: spins, then sleeps. False when the scheduler is closing and the shared
    /// queue is empty (the worker exits).
    fn idle(&self) -> bool {
        let spin_until = Instant::now() + self.cfg.spin;
        while Instant::now() < spin_until {
            if self.queued.load(Ordering::Acquire) > 0 || self.stealable() {
                return true;
            }
            std::hint::spin_loop();
        }
        let mut st = self.state.lock_unpoisoned();
        loop {
            if !st.queue.is_empty() {
                return true;
            }
            if st.closing {
                return false;
            }
            self.sleepers.fetch_add(1, Ordering::AcqRel);
            let (g, timeout) = self
                .work
                .wait_timeout_unpoisoned(st, Duration::from_millis(50));
            st = g;
            self.sleepers.fetch_sub(1, Ordering::AcqRel);
            if timeout.timed_out() && self.stealable() {
                return true;
            }
        }
    }

    fn run(&self, unit: Unit) {
        match unit {
            Unit::Chunk { t, off, len } => {
                if t.pick_up() {
                    self.run_chunk(&t, off, len);
                }
            }
            Unit::Group(ts) => self.run_group(ts),
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
            t.chunk_done(Err(CoreError::Cancelled(t.id)), |_| Ok(()));
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
                        c.retries.fetch_add(1, Ordering::Relaxed);
                        m.retries.increment(1);
                    },
                    &mut || {
                        c.failovers.fetch_add(1, Ordering::Relaxed);
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
                let result = result.and_then(|o| durable_sync(&req).map(|()| o));
                // Let go of the buffers before the completion is delivered.
                drop(req);
                t.chunk_done(result, |_| Ok(()));
            }
            Work::Shared(sources, dst, no_retry) => {
                let result = run(&sources, &dst, no_retry);
                drop((sources, dst));
                t.chunk_done(result, durable_sync);
            }
        }
    }

    /// Runs merged requests as one transfer; on failure (or if some were cancelled meanwhile)
    /// runs them one by one, so one bad request fails alone.
    fn run_group(&self, ts: Vec<Arc<TicketInner>>) {
        let all = ts.len();
        let picked: Vec<Arc<TicketInner>> = ts.into_iter().filter(|t| t.pick_up()).collect();
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
                        self.engines.execute(&src, &dst, total, false)
                    })
                });
                let synced = result.and_then(|o| {
                    let s = picked[0].state.lock_unpoisoned();
                    s.req.as_ref().map_or(Ok(()), durable_sync).map(|()| o)
                });
                if let Ok(o) = synced {
                    let route = format!("{} ({all} requests coalesced)", o.route);
                    for t in &picked {
                        let outcome = Outcome {
                            bytes: t.len,
                            engine: o.engine,
                            route: route.clone(),
                        };
                        t.chunk_done(Ok(outcome), |_| Ok(()));
                    }
                    return;
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
                c.retries.fetch_add(1, Ordering::Relaxed);
            },
            op,
        )
    }
}

fn worker_main(sh: Arc<Shared>, me: usize, local: Worker<Unit>) {
    IN_WORKER.with(|w| w.set(true));
    loop {
        if let Some(u) = local.pop() {
            sh.run(u);
            continue;
        }
        if sh.grab(&local) {
            continue;
        }
        if let Some(u) = sh.steal(me) {
            sh.run(u);
            continue;
        }
        if !sh.idle() {
            return;
        }
    }
}

/// The scheduler: its worker pool and the default session (which it dereferences to, so
/// `scheduler.submit(request)` works).
pub struct Scheduler {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    default: SchedSession,
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
            sleepers: AtomicUsize::new(0),
            acct: Arc::new(Accounting {
                budgets: Budgets::new(cfg.engine_in_flight),
                counters: Counters::default(),
                metrics: SchedMetrics::new(),
            }),
            stealers: locals.iter().map(Worker::stealer).collect(),
            next_session: AtomicU64::new(1),
            closing: AtomicBool::new(false),
            cfg,
        });
        let mut workers = Vec::with_capacity(n);
        for (i, local) in locals.into_iter().enumerate() {
            let sh = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("gpuio-worker-{i}"))
                .spawn(move || worker_main(sh, i, local));
            match spawned {
                Ok(h) => workers.push(h),
                Err(e) => {
                    let mut s = Self {
                        default: SchedSession::new(&shared, SessionOptions::default(), false),
                        shared,
                        workers,
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

    /// Stops taking work, lets the workers finish what is queued, and joins them.
    pub fn shutdown(&mut self) {
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
        // Workers leave nothing queued; if one died, what it left fails here, once.
        let rest: Vec<Unit> = {
            let mut st = self.shared.state.lock_unpoisoned();
            std::iter::from_fn(|| st.queue.pop(Instant::now()).map(|(_, u)| u)).collect()
        };
        drop(rest);
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
        self.state.in_flight.load(Ordering::Relaxed)
    }

    fn ticket(&self, req: Request, done: Done, now: Instant) -> Result<Arc<TicketInner>> {
        if req.status() != Status::Pending {
            return Err(CoreError::InvalidRequest(format!(
                "request {} is already {:?}; submit takes new requests",
                req.id,
                req.status()
            )));
        }
        let chunks = req.len.div_ceil(self.shared.cfg.chunk_size.max(1));
        req.status_cell().advance(Status::Submitted)?;
        Ok(Arc::new(TicketInner::new(
            req,
            done,
            chunks,
            self.state.clone(),
            self.shared.acct.clone(),
            now,
        )))
    }

    fn public(t: &Arc<TicketInner>) -> Ticket {
        Ticket {
            id: t.id,
            cell: t.cell.clone(),
            inner: Arc::downgrade(t),
        }
    }

    /// Admits and queues requests one by one; when admission has to wait, what is admitted
    /// so far is queued first (it may be what frees the room).
    fn submit_all(&self, items: Vec<(Request, Done)>, wait: bool) -> Result<Vec<Ticket>> {
        let sh = &self.shared;
        if sh.closing.load(Ordering::Acquire) {
            return Err(CoreError::ShutDown);
        }
        if let Some((r, _)) = items.iter().find(|(r, _)| r.status() != Status::Pending) {
            return Err(CoreError::InvalidRequest(format!(
                "request {} is already {:?}; submit takes new requests",
                r.id,
                r.status()
            )));
        }
        let in_worker = IN_WORKER.with(Cell::get);
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
            let t = match self.ticket(req, done, now) {
                Ok(t) => t,
                Err(e) => {
                    // Its status changed under us: give back its bytes and the prepaid rest.
                    budgets.release(engine, &self.state, bytes + prepaid);
                    sh.enqueue(&pending)?;
                    return Err(e);
                }
            };
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

    /// Plans a batch (sort, coalesce, group by engine; SDD §8.1) and queues its transfers.
    /// Each request's status follows its own result; the handle reports them all.
    pub fn submit_batch(&self, requests: Vec<Request>) -> Result<BatchHandle> {
        let sh = &self.shared;
        if sh.closing.load(Ordering::Acquire) {
            return Err(CoreError::ShutDown);
        }
        if let Some(r) = requests.iter().find(|r| r.status() != Status::Pending) {
            return Err(CoreError::InvalidRequest(format!(
                "request {} is already {:?}; a batch takes new requests",
                r.id,
                r.status()
            )));
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
        let in_worker = IN_WORKER.with(Cell::get);
        let mut tickets: Vec<Arc<TicketInner>> = Vec::with_capacity(n);
        for req in requests {
            let (engine, bytes) = (req.engine, req.len as u64);
            let admitted = sh
                .acct
                .budgets
                .acquire(engine, &self.state, bytes, true, in_worker);
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
            let made = admitted.and_then(|()| {
                self.ticket(req, done, Instant::now()).inspect_err(|_| {
                    sh.acct.budgets.release(engine, &self.state, bytes);
                })
            });
            match made {
                Ok(t) => tickets.push(t),
                Err(e) => {
                    // Nothing was queued: the ones made so far fail quietly (releasing
                    // their budget); the caller hears the error.
                    for t in &tickets {
                        t.disarm();
                        t.fail_unstarted(CoreError::ShutDown);
                    }
                    return Err(e);
                }
            }
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

    /// Cancels every queued request of this session (running ones finish).
    pub fn cancel_queued(&self) -> usize {
        let drained = {
            let mut st = self.shared.state.lock_unpoisoned();
            let d = st.queue.drain_session(self.state.id);
            self.shared.queued.fetch_sub(d.len(), Ordering::AcqRel);
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

impl Drop for SchedSession {
    fn drop(&mut self) {
        if self.cancel_on_drop {
            self.state.closed.store(true, Ordering::Release);
            self.cancel_queued();
        }
    }
}
