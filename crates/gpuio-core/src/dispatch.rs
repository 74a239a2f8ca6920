//! Dispatch (first cut): a pool of worker threads runs queued requests on their engines, with
//! the retry policy, and delivers each completion exactly once — to a waiting handle (blocking
//! or as a future) or to a callback. A queued request always completes: if the dispatcher
//! goes away first, it completes with [`CoreError::ShutDown`]; a request that could not be
//! queued is refused with an error instead, and never also completes. A panic inside an engine
//! fails that request ([`CoreError::Internal`]) and leaves the worker serving.
//!
//! A completion is delivered after the request has let go of its buffers, so a caller who
//! hears "done" can take its `HostMemory` back at once.
//!
//! The full scheduler (priorities, deadlines, fairness, backpressure) replaces the FIFO queue
//! here; the completion contract stays.

use crate::batch::{self, Segment};
use crate::engine::{Engines, Outcome};
use crate::error::{CoreError, Result};
use crate::request::{Request, RequestId, Status, StatusCell};
use crate::retry::RetryPolicy;
use crossbeam_channel::{Receiver, Sender};
use gpuio_hal::ErrorCode;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A finished request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Which request.
    pub id: RequestId,
    /// What the engine reported.
    pub outcome: Outcome,
    /// Time from pickup by a worker to completion.
    pub elapsed: Duration,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded states (a slot, a report, a counter) are updated in single steps; a panic
    // cannot leave them half-written.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A one-shot value, awaitable both by blocking and as a future.
struct Slot<T> {
    state: Mutex<(Option<T>, Option<Waker>)>,
    ready: Condvar,
}

impl<T> Slot<T> {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new((None, None)),
            ready: Condvar::new(),
        })
    }

    fn put(&self, value: T) {
        let mut s = lock(&self.state);
        s.0 = Some(value);
        if let Some(w) = s.1.take() {
            w.wake();
        }
        self.ready.notify_all();
    }

    fn wait(&self) -> T {
        let mut s = lock(&self.state);
        loop {
            if let Some(v) = s.0.take() {
                return v;
            }
            s = self.ready.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn poll(&self, cx: &Context<'_>) -> Poll<T> {
        let mut s = lock(&self.state);
        match s.0.take() {
            Some(v) => Poll::Ready(v),
            None => {
                s.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// Delivers a result exactly once: the worker's, or [`CoreError::ShutDown`] if the job is
/// dropped unrun while still armed. A job that never made it into the queue is disarmed
/// first, because its submitter reports the failure instead.
struct Completer<T> {
    deliver: Option<Box<dyn FnOnce(Result<T>) + Send>>,
    armed: Arc<AtomicBool>,
}

impl<T> Completer<T> {
    fn new(f: impl FnOnce(Result<T>) + Send + 'static) -> (Self, Arc<AtomicBool>) {
        let armed = Arc::new(AtomicBool::new(true));
        (
            Self {
                deliver: Some(Box::new(f)),
                armed: armed.clone(),
            },
            armed,
        )
    }

    fn complete(mut self, r: Result<T>) {
        if let Some(f) = self.deliver.take() {
            f(r);
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(f) = self.deliver.take()
            && self.armed.load(Ordering::Acquire)
        {
            f(Err(CoreError::ShutDown));
        }
    }
}

type Job = Box<dyn FnOnce(&Engines, &RetryPolicy) + Send>;

/// The worker pool.
pub struct Dispatcher {
    tx: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("workers", &self.workers.len())
            .finish()
    }
}

fn worker(rx: Receiver<Job>, engines: Engines, retry: RetryPolicy) {
    for job in rx {
        job(&engines, &retry);
    }
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

/// Runs one request on a worker: pickup (unless cancelled), the transfer with retries,
/// the final status.
fn run(req: &Request, engines: &Engines, retry: &RetryPolicy) -> Result<Completion> {
    let cell = req.status_cell();
    if cell.advance(Status::InProgress).is_err() {
        return Err(CoreError::Cancelled(req.id));
    }
    let start = Instant::now();
    let policy = if req.flags.no_retry {
        &RetryPolicy::NONE
    } else {
        retry
    };
    let result = guarded("request", || policy.run(|| engines.execute_request(req)));
    cell.advance(if result.is_ok() {
        Status::Completed
    } else {
        Status::Error
    })?;
    result.map(|outcome| Completion {
        id: req.id,
        outcome,
        elapsed: start.elapsed(),
    })
}

/// One batch segment on a worker: if every member is picked up, one transfer; if some were
/// cancelled meanwhile, the others run one by one. Returns each member's result.
fn run_segment(
    seg: &Segment,
    requests: &[Request],
    engines: &Engines,
    retry: &RetryPolicy,
) -> Vec<(RequestId, Result<u64>)> {
    let policy = if seg.no_retry {
        &RetryPolicy::NONE
    } else {
        retry
    };
    let members: Vec<&Request> = seg.members.iter().map(|&i| &requests[i]).collect();
    let picked: Vec<bool> = members
        .iter()
        .map(|r| r.status_cell().advance(Status::InProgress).is_ok())
        .collect();
    let finish = |r: &Request, result: Result<u64>| {
        let status = if result.is_ok() {
            Status::Completed
        } else {
            Status::Error
        };
        let _ = r.status_cell().advance(status);
        (r.id, result)
    };
    if picked.iter().all(|&p| p) {
        let result = guarded("batch segment", || {
            policy.run(|| engines.execute(&seg.src, &seg.dst, seg.len, seg.durable))
        });
        return match result {
            Ok(_) => members
                .iter()
                .map(|r| finish(r, Ok(r.len as u64)))
                .collect(),
            Err(e) => {
                let msg = e.to_string();
                let code = e.code();
                members
                    .iter()
                    .map(|r| {
                        finish(
                            r,
                            Err(CoreError::Failed {
                                code,
                                message: msg.clone(),
                            }),
                        )
                    })
                    .collect()
            }
        };
    }
    members
        .iter()
        .zip(picked)
        .map(|(r, p)| {
            if !p {
                return (r.id, Err(CoreError::Cancelled(r.id)));
            }
            let result = guarded("request", || {
                policy
                    .run(|| engines.execute_request(r))
                    .map(|o| o.bytes as u64)
            });
            finish(r, result)
        })
        .collect()
}

impl Dispatcher {
    /// Starts `workers` threads over `engines`.
    pub fn new(engines: Engines, workers: usize, retry: RetryPolicy) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let workers = (0..workers.max(1))
            .map(|i| {
                let (rx, engines, retry) = (rx.clone(), engines.clone(), retry.clone());
                std::thread::Builder::new()
                    .name(format!("gpuio-worker-{i}"))
                    .spawn(move || worker(rx, engines, retry))
                    .map_err(|e| CoreError::Internal(format!("starting a worker: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            tx: Some(tx),
            workers,
        })
    }

    fn sender(&self) -> Result<&Sender<Job>> {
        self.tx.as_ref().ok_or(CoreError::ShutDown)
    }

    /// Queues a request; `on_done` runs on a worker thread when it finishes (or with
    /// [`CoreError::ShutDown`] if the dispatcher stops before running it). If the request
    /// cannot be queued, this returns the error and `on_done` never runs. Returns the
    /// request's status cell.
    pub fn submit_with(
        &self,
        req: Request,
        on_done: impl FnOnce(Result<Completion>) + Send + 'static,
    ) -> Result<Arc<StatusCell>> {
        let tx = self.sender()?;
        let cell = req.status_cell().clone();
        cell.advance(Status::Submitted)?;
        let (done, armed) = Completer::new(on_done);
        let job: Job = Box::new(move |engines, retry| {
            let result = run(&req, engines, retry);
            // Release the request's buffers before saying it is done.
            drop(req);
            done.complete(result)
        });
        if let Err(unsent) = tx.send(job) {
            armed.store(false, Ordering::Release);
            drop(unsent);
            let _ = cell.advance(Status::Error);
            return Err(CoreError::ShutDown);
        }
        Ok(cell)
    }

    /// Queues a request and returns a handle to wait on, poll as a future, or cancel.
    pub fn submit(&self, req: Request) -> Result<RequestHandle> {
        let id = req.id;
        let slot = Slot::new();
        let s = slot.clone();
        let status = self.submit_with(req, move |r| s.put(r))?;
        Ok(RequestHandle { id, status, slot })
    }

    /// Plans a batch (sort, coalesce, group by engine; SDD §8.1) and queues its segments.
    /// Each request's status follows its own result. Requests must all be new (pending).
    pub fn submit_batch(&self, requests: Vec<Request>) -> Result<BatchHandle> {
        let tx = self.sender()?;
        if let Some(r) = requests.iter().find(|r| r.status() != Status::Pending) {
            return Err(CoreError::InvalidRequest(format!(
                "request {} is already {:?}; a batch takes new requests",
                r.id,
                r.status()
            )));
        }
        let plan = batch::plan(&requests);
        let requests: Arc<Vec<Request>> = Arc::new(requests);
        let segments: Vec<Segment> = plan.groups.into_values().flatten().collect();
        let report = Arc::new(Mutex::new(BatchReport {
            requests: requests.len(),
            segments: segments.len(),
            ..BatchReport::default()
        }));
        let slot = Slot::new();
        for r in requests.iter() {
            r.status_cell().advance(Status::Submitted)?;
        }
        if segments.is_empty() {
            slot.put(Ok(lock(&report).clone()));
        }
        let remaining = Arc::new(Mutex::new(segments.len()));
        let mut segments = segments.into_iter();
        while let Some(seg) = segments.next() {
            let ids: Vec<RequestId> = seg.members.iter().map(|&i| requests[i].id).collect();
            let (report, slot, remaining) = (report.clone(), slot.clone(), remaining.clone());
            let finish = move |results: Result<Vec<(RequestId, Result<u64>)>>| {
                {
                    let mut rep = lock(&report);
                    match results {
                        Ok(results) => {
                            for (id, r) in results {
                                match r {
                                    Ok(bytes) => rep.bytes += bytes,
                                    Err(e) => rep.failed.push((id, e.code(), e.to_string())),
                                }
                            }
                        }
                        Err(e) => rep
                            .failed
                            .extend(ids.iter().map(|&id| (id, e.code(), e.to_string()))),
                    }
                }
                let mut left = lock(&remaining);
                *left -= 1;
                if *left == 0 {
                    slot.put(Ok(lock(&report).clone()));
                }
            };
            let (done, armed) = Completer::new(finish);
            let reqs = requests.clone();
            let job: Job = Box::new(move |engines, retry| {
                let results = run_segment(&seg, &reqs, engines, retry);
                drop((seg, reqs));
                done.complete(Ok(results))
            });
            if let Err(unsent) = tx.send(job) {
                armed.store(false, Ordering::Release);
                drop(unsent);
                // Nothing from here on was queued: those requests fail now, once.
                for r in requests.iter().filter(|r| r.status() == Status::Submitted) {
                    let _ = r.status_cell().advance(Status::Error);
                }
                drop(segments);
                return Err(CoreError::ShutDown);
            }
        }
        Ok(BatchHandle { slot })
    }

    /// Stops taking work, lets the workers finish what is queued, and joins them.
    pub fn shutdown(&mut self) {
        self.tx = None;
        for w in self.workers.drain(..) {
            if w.join().is_err() {
                tracing::error!("a gpuio worker thread panicked");
            }
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A queued request: wait for it, `.await` it, or cancel it while it is still queued.
pub struct RequestHandle {
    id: RequestId,
    status: Arc<StatusCell>,
    slot: Arc<Slot<Result<Completion>>>,
}

impl std::fmt::Debug for RequestHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestHandle")
            .field("id", &self.id)
            .field("status", &self.status())
            .finish()
    }
}

impl RequestHandle {
    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Its current status.
    pub fn status(&self) -> Status {
        self.status.get()
    }

    /// Cancels it if no worker has picked it up yet; it then completes with
    /// [`CoreError::Cancelled`]. Returns whether the cancel won.
    pub fn cancel(&self) -> bool {
        self.status.advance(Status::Cancelled).is_ok()
    }

    /// Blocks until it completes.
    pub fn wait(self) -> Result<Completion> {
        self.slot.wait()
    }
}

impl Future for RequestHandle {
    type Output = Result<Completion>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.slot.poll(cx)
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
    slot: Arc<Slot<Result<BatchReport>>>,
}

fn batch_result(r: Result<BatchReport>) -> Result<BatchReport> {
    match r {
        Ok(report) if !report.failed.is_empty() => Err(CoreError::Batch(Box::new(report))),
        other => other,
    }
}

impl std::fmt::Debug for BatchHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchHandle").finish_non_exhaustive()
    }
}

impl BatchHandle {
    /// Blocks until every segment has finished.
    pub fn wait(self) -> Result<BatchReport> {
        batch_result(self.slot.wait())
    }
}

impl Future for BatchHandle {
    type Output = Result<BatchReport>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.slot.poll(cx).map(batch_result)
    }
}
