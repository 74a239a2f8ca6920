//! The host proxy of the GPU→host request ring (the on-demand flow,
//! docs/REFERENCE.md#on-demand-access): GPU threads post IO requests into a [`RingMemory`]
//! (`kernels/gpuio_ring.cuh`), and the proxy's threads carry each out through [`Engines`] and
//! publish its completion.
//!
//! A request names a **resource** by the handle [`RingProxy::register`] gave it (a file, host
//! memory or device memory, as an [`Endpoint`] whose offset is the resource's origin), an
//! offset and a length in it, and a raw **device address**. The device address is trusted
//! only inside a device buffer registered with [`RingProxy::register_device`]: the proxy
//! resolves it to (buffer, offset) and completes anything else with
//! [`ring::RESULT_UNREGISTERED`] without reading or writing a byte. A READ moves resource →
//! device memory, a WRITE device memory → resource.
//!
//! [`RingProxy::shutdown`] (and drop) stops the ring cleanly with requests in flight: the
//! requests being served finish and publish their results, those still posted complete with
//! [`ring::RESULT_SHUT_DOWN`], then the ring is closed and waiting GPU threads return.
//!
//! On CUDA the kernels that post requests run while the proxy serves them, so nothing on the
//! serving path may wait for the whole device (`cuCtxSynchronize`, `cuMemFree`, ...): it would
//! wait for kernels that wait for it. The ring memory keeps a stream alive for that reason
//! (see [`RingMemory`]); likewise, do not let the last handle of a device buffer drop while
//! ring kernels run (unregistering keeps the caller's handle; the memory is freed, and the
//! device synchronized, only when the last one goes).
//!
//! ```
//! # use gpuio_core::{Endpoint, Engines, HostMemory};
//! # use gpuio_core::ring::{RingConfig, RingProxy};
//! # use gpuio_hal::{BackendPreference, HostAllocOptions, HostBuffer, probe};
//! # use gpuio_transport_localio::{LocalIo, LocalIoConfig};
//! # use gpuio_transport_memio::{MemIo, MemIoConfig};
//! # use std::sync::Arc;
//! let gpus = probe(BackendPreference::Host).unwrap();
//! let gpu = gpus.gpus[0].clone();
//! let engines = Engines::new(
//!     Arc::new(MemIo::new(gpus.gpus, MemIoConfig::default()).unwrap()),
//!     Arc::new(LocalIo::new(LocalIoConfig::default()).unwrap()),
//! );
//! let mut proxy = RingProxy::new(engines, &gpu, RingConfig::default()).unwrap();
//!
//! let mut src = HostBuffer::alloc(4096, &HostAllocOptions::default()).unwrap();
//! src.fill(7);
//! let table = proxy.register(Endpoint::host(&HostMemory::new(src), 0)).unwrap();
//! let dev = gpu.alloc(4096).unwrap();
//! proxy.register_device(&dev).unwrap();
//!
//! // What a GPU thread does with gpuio_read(); here a host thread stands in for it.
//! let producer = proxy.host_producer().unwrap();
//! let n = producer.read(table, 1024, 512, dev.device_addr(), None).unwrap();
//! assert_eq!(n, 512);
//! proxy.shutdown().unwrap();
//! ```

use crate::endpoint::{Dest, Endpoint, Source};
use crate::engine::Engines;
use crate::error::{CoreError, Result};
use crate::metrics::{BYTES, REQUESTS_FINISHED};
use crate::route::EngineKind;
use crossbeam_utils::CachePadded;
use gpuio_hal::sync::RwLockExt;
use gpuio_hal::{DeviceBuffer, ErrorCode, Gpu};
use gpuio_ring::{self as ring, HostProducer, RingDevice, RingMemory, RingOp, RingRequest, Take};
use metrics::{Counter, counter};
use std::collections::BTreeMap;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

pub use gpuio_ring::WaitPolicy;

/// How a [`RingProxy`] runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingConfig {
    /// Slots of the ring [`RingProxy::new`] allocates (a power of two, 2 to 2^20);
    /// [`RingProxy::with_ring`] serves the ring it is given.
    pub slots: usize,
    /// Bytes of each slot's bounce buffer in pinned host memory (a multiple of 64, at most
    /// 1 MiB; 0: none), for [`RingProxy::new`]. Kernel reads that fit are delivered there
    /// and copied by the waiting GPU thread: no DMA and no driver call per request, which is
    /// what small random reads need.
    pub bounce_bytes: usize,
    /// Proxy threads (1 to 256): requests served at once.
    pub threads: usize,
    /// How idle proxy threads wait for requests.
    pub wait: WaitPolicy,
    /// How long shutdown waits for requests being served to finish.
    pub shutdown_timeout: Duration,
}

impl Default for RingConfig {
    fn default() -> Self {
        Self {
            slots: 256,
            bounce_bytes: 16 << 10,
            threads: 2,
            wait: WaitPolicy::default(),
            shutdown_timeout: Duration::from_secs(60),
        }
    }
}

/// What a proxy has done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RingStats {
    /// Requests completed successfully.
    pub served: u64,
    /// Requests completed with an error (bad request or failed transfer).
    pub failed: u64,
    /// Bytes moved by successful requests.
    pub bytes: u64,
    /// Requests completed with the shutdown error by the final sweep.
    pub swept: u64,
}

#[derive(Default)]
struct Counters {
    served: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
    swept: AtomicU64,
}

struct RingMetrics {
    ok: Counter,
    failed: Counter,
    bytes_memio: Counter,
    bytes_localio: Counter,
    bytes_remoteio: Counter,
}

impl RingMetrics {
    fn new() -> Self {
        let fin =
            |o: &'static str| counter!(REQUESTS_FINISHED, "class" => "gpu_ring", "outcome" => o);
        Self {
            ok: fin("ok"),
            failed: fin("error"),
            bytes_memio: counter!(BYTES, "engine" => "memio"),
            bytes_localio: counter!(BYTES, "engine" => "localio"),
            bytes_remoteio: counter!(BYTES, "engine" => "remoteio"),
        }
    }
}

/// Why a request failed: the negative result to publish and a message for the log.
struct Failure {
    code: i64,
    why: String,
}

impl Failure {
    fn new(code: ErrorCode, why: impl Into<String>) -> Self {
        Self {
            code: ring::result_of(code),
            why: why.into(),
        }
    }
}

impl From<CoreError> for Failure {
    fn from(e: CoreError) -> Self {
        Self::new(e.code(), e.to_string())
    }
}

/// The two tables are taken poison-tolerant: they hold no invariant a panicking writer could
/// break.
struct Shared {
    engines: Engines,
    ring: Arc<RingMemory>,
    /// Handle `h` is `resources[h - 1]`; handles are never reused, so a stale handle in a
    /// kernel fails instead of reaching another resource. Replaced whole on every change
    /// (rare), so proxy threads serve from a snapshot of their own without taking a lock per
    /// request; `resources_version` tells them when to take a new one.
    resources: RwLock<Arc<Vec<Option<Endpoint>>>>,
    resources_version: AtomicU64,
    /// Registered device buffers by base device address.
    devices: RwLock<BTreeMap<u64, DeviceBuffer>>,
    /// One shard per proxy thread (and one for the sweep), each on its own cache line: no
    /// counter is shared between threads that serve millions of requests a second.
    counters: Vec<CachePadded<Counters>>,
    metrics: RingMetrics,
}

impl Shared {
    /// Replaces the resource table with `change` applied to a copy of it.
    fn change_resources<T>(&self, change: impl FnOnce(&mut Vec<Option<Endpoint>>) -> T) -> T {
        let mut table = self.resources.write_unpoisoned();
        let mut next = (**table).clone();
        let out = change(&mut next);
        *table = Arc::new(next);
        self.resources_version.fetch_add(1, Ordering::Release);
        out
    }
}

/// A proxy thread's snapshot of the resource table.
struct Snapshot {
    version: u64,
    table: Arc<Vec<Option<Endpoint>>>,
}

impl Snapshot {
    fn new(shared: &Shared) -> Self {
        let version = shared.resources_version.load(Ordering::Acquire);
        Self {
            version,
            table: shared.resources.read_unpoisoned().clone(),
        }
    }

    /// The table as of now: refreshed if a registration changed it.
    fn current(&mut self, shared: &Shared) -> &[Option<Endpoint>] {
        if shared.resources_version.load(Ordering::Acquire) != self.version {
            *self = Self::new(shared);
        }
        &self.table
    }
}

/// File offsets are an off_t: refuses ranges that end past it, before any engine does
/// arithmetic on them.
fn file_range(offset: u64, len: u64) -> Result<(), Failure> {
    match offset.checked_add(len) {
        Some(end) if end <= i64::MAX as u64 => Ok(()),
        _ => Err(Failure::new(
            ErrorCode::InvalidArg,
            format!("file range {offset}+{len} is beyond the largest file offset"),
        )),
    }
}

/// A WRITE asking for [`ring::FLAG_DURABLE`] reaches stable storage before it completes.
fn durable(req: &RingRequest, at: &Endpoint) -> Result<(), Failure> {
    if req.flags & ring::FLAG_DURABLE != 0
        && let Some(file) = at.durable_file()
    {
        file.sync_data().map_err(CoreError::from)?;
    }
    Ok(())
}

/// `base` moved `by` bytes on, refusing offsets that overflow.
fn endpoint_at(base: &Endpoint, by: u64) -> Result<Endpoint, Failure> {
    let overflow = || {
        Failure::new(
            ErrorCode::InvalidArg,
            format!("offset {by} overflows the resource's address range"),
        )
    };
    let by_usize = || usize::try_from(by).map_err(|_| overflow());
    Ok(match base {
        Endpoint::Host { mem, offset } => Endpoint::Host {
            mem: mem.clone(),
            offset: offset.checked_add(by_usize()?).ok_or_else(overflow)?,
        },
        Endpoint::Device { buf, offset } => Endpoint::Device {
            buf: buf.clone(),
            offset: offset.checked_add(by_usize()?).ok_or_else(overflow)?,
        },
        Endpoint::File { file, offset } => Endpoint::File {
            file: file.clone(),
            offset: offset.checked_add(by).ok_or_else(overflow)?,
        },
        Endpoint::Remote { res, offset } => Endpoint::Remote {
            res: res.clone(),
            offset: offset.checked_add(by).ok_or_else(overflow)?,
        },
    })
}

impl Shared {
    /// The registered device buffer holding all of `[addr, addr + len)`, and the offset of
    /// `addr` in it.
    fn device_range(&self, addr: u64, len: u64) -> Option<(DeviceBuffer, usize)> {
        let devices = self.devices.read_unpoisoned();
        let (&base, buf) = devices.range(..=addr).next_back()?;
        let offset = addr - base;
        let end = offset.checked_add(len)?;
        (end <= buf.len() as u64).then(|| (buf.clone(), offset as usize))
    }

    /// Checks and carries out one request; returns the bytes moved. With `bounce` (a READ
    /// that asked for staging, and the slot's bounce buffer), the bytes go there instead of
    /// to the device: the producer copies them itself.
    fn execute(
        &self,
        resources: &[Option<Endpoint>],
        req: &RingRequest,
        bounce: Option<&mut [u8]>,
    ) -> Result<u64, Failure> {
        let invalid = |why: String| Failure::new(ErrorCode::InvalidArg, why);
        let Some(op) = req.operation() else {
            return Err(invalid(format!("unknown op {}", req.op)));
        };
        if req.flags & !ring::FLAGS_KNOWN != 0 {
            return Err(invalid(format!("unknown flags {:#x}", req.flags)));
        }
        if req.len == 0 {
            return Err(invalid("zero-length request".into()));
        }
        let len = usize::try_from(req.len)
            .ok()
            .filter(|_| i64::try_from(req.len).is_ok())
            .ok_or_else(|| invalid(format!("length {} is too large", req.len)))?;
        let Some(base) = (req.resource as usize)
            .checked_sub(1)
            .and_then(|i| resources.get(i))
            .and_then(Option::as_ref)
        else {
            return Err(Failure::new(
                ErrorCode::NotFound,
                format!("unknown resource handle {}", req.resource),
            ));
        };
        // Staged requests borrow the resource from the thread's snapshot: no reference-count
        // traffic on the resource, which every proxy thread would share.
        if let Some(bounce) = bounce
            && let Some(bytes) = bounce.get_mut(..len)
        {
            return match op {
                RingOp::Read => self.read_into(base, req.offset, bytes),
                RingOp::Write => self.write_from(base, req, bytes),
            };
        }
        let at = endpoint_at(base, req.offset)?;
        if let Endpoint::File { offset, .. } = &at {
            file_range(*offset, req.len)?;
        }
        let Some((buf, dev_off)) = self.device_range(req.dev_addr, req.len) else {
            return Err(Failure {
                code: ring::RESULT_UNREGISTERED,
                why: format!(
                    "device range {:#x}+{} is not inside one registered device buffer",
                    req.dev_addr, req.len
                ),
            });
        };
        let device = Endpoint::device(&buf, dev_off);
        let outcome = match op {
            RingOp::Read => self.engines.execute(&at, &device, len)?,
            RingOp::Write => {
                let o = self.engines.execute(&device, &at, len)?;
                durable(req, &at)?;
                o
            }
        };
        self.landed(&outcome, len)
    }

    /// Reads `out.len()` bytes of `base` from `by` bytes on into host memory (a slot's bounce
    /// buffer).
    fn read_into(&self, base: &Endpoint, by: u64, out: &mut [u8]) -> Result<u64, Failure> {
        let len = out.len();
        let Some(src) = base.source_at(by) else {
            return Err(Failure::new(
                ErrorCode::InvalidArg,
                format!("offset {by} overflows the resource's address range"),
            ));
        };
        if let Source::File(_, from) = src {
            file_range(from, len as u64)?;
        }
        let outcome = self.engines.transfer(src, Dest::Host(out), len)?;
        self.landed(&outcome, len)
    }

    /// Writes `bytes` (a staged WRITE's, in the slot's bounce buffer) to `base` at the
    /// request's offset.
    fn write_from(&self, base: &Endpoint, req: &RingRequest, bytes: &[u8]) -> Result<u64, Failure> {
        let len = bytes.len();
        let at = endpoint_at(base, req.offset)?;
        if let Endpoint::File { offset, .. } = &at {
            file_range(*offset, len as u64)?;
        }
        let outcome = self.engines.transfer(Source::Host(bytes), at.dest(), len)?;
        durable(req, &at)?;
        self.landed(&outcome, len)
    }

    /// Checks that a request's transfer moved all `len` bytes and counts them by engine.
    fn landed(&self, outcome: &crate::Outcome, len: usize) -> Result<u64, Failure> {
        if outcome.bytes != len {
            return Err(Failure::new(
                ErrorCode::General,
                format!("moved {} of {len} bytes", outcome.bytes),
            ));
        }
        match outcome.engine {
            EngineKind::LocalIo => self.metrics.bytes_localio.increment(len as u64),
            EngineKind::RemoteIo => self.metrics.bytes_remoteio.increment(len as u64),
            EngineKind::MemIo => self.metrics.bytes_memio.increment(len as u64),
        }
        Ok(len as u64)
    }

    /// Carries out a request and returns the result to publish; never panics.
    fn serve(
        &self,
        shard: &Counters,
        resources: &[Option<Endpoint>],
        req: &RingRequest,
        bounce: Option<&mut [u8]>,
    ) -> i64 {
        let outcome = catch_unwind(AssertUnwindSafe(|| self.execute(resources, req, bounce)))
            .unwrap_or_else(|p| {
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                Err(Failure::new(
                    ErrorCode::General,
                    format!("engine panicked: {msg}"),
                ))
            });
        match outcome {
            Ok(bytes) => {
                shard.served.fetch_add(1, Ordering::Relaxed);
                shard.bytes.fetch_add(bytes, Ordering::Relaxed);
                self.metrics.ok.increment(1);
                bytes as i64
            }
            Err(f) => {
                tracing::debug!(
                    ticket = req.ticket,
                    code = f.code,
                    why = %f.why,
                    "ring request failed"
                );
                shard.failed.fetch_add(1, Ordering::Relaxed);
                self.metrics.failed.increment(1);
                f.code
            }
        }
    }
}

fn proxy_thread(shared: Arc<Shared>, index: usize, wait: WaitPolicy) {
    let ring = shared.ring.clone();
    let shard = &shared.counters[index];
    let mut snapshot = Snapshot::new(&shared);
    loop {
        let mut claim = ring.claim();
        loop {
            match claim.take(&wait, None) {
                Take::Taken(mut taken) => {
                    let req = *taken.request();
                    let bounce = taken.bounce();
                    // Only a READ's result travels in the bounce buffer.
                    let staged = bounce.is_some() && req.operation() == Some(RingOp::Read);
                    let resources = snapshot.current(&shared);
                    let result = shared.serve(shard, resources, &req, bounce);
                    if staged && result >= 0 {
                        taken.complete_staged(result as u64);
                    } else {
                        taken.complete(result);
                    }
                    break;
                }
                // Only with a deadline; keep the ticket rather than lose its request.
                Take::Pending(c) => claim = c,
                Take::Stopped => return,
            }
        }
    }
}

/// The host side of a request ring: threads (`gpuio-ring-N`) that take the requests GPU
/// threads post, carry them out through the engines, and publish the completions.
pub struct RingProxy {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    shutdown_timeout: Duration,
    closed: bool,
    /// The process that started the threads, in its line of forks.
    generation: u64,
}

impl fmt::Debug for RingProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RingProxy")
            .field("ring", &self.shared.ring)
            .field("threads", &self.threads.len())
            .field("stats", &self.stats())
            .finish()
    }
}

impl RingProxy {
    /// A proxy with a new ring of `cfg.slots` slots (and their bounce buffers) pinned and
    /// mapped for `gpu`.
    pub fn new(engines: Engines, gpu: &Gpu, cfg: RingConfig) -> Result<Self> {
        let ring = Arc::new(RingMemory::with_bounce(cfg.slots, cfg.bounce_bytes, gpu)?);
        Self::with_ring(engines, ring, cfg)
    }

    /// A proxy serving `ring` (which must be open and served by no other proxy).
    pub fn with_ring(engines: Engines, ring: Arc<RingMemory>, cfg: RingConfig) -> Result<Self> {
        if !(1..=256).contains(&cfg.threads) {
            return Err(CoreError::InvalidRequest(format!(
                "a ring proxy needs 1 to 256 threads, not {}",
                cfg.threads
            )));
        }
        if ring.state() != ring::RingState::Open {
            return Err(CoreError::InvalidRequest(
                "the request ring is already shut down".into(),
            ));
        }
        let shared = Arc::new(Shared {
            engines,
            ring,
            resources: RwLock::new(Arc::new(Vec::new())),
            resources_version: AtomicU64::new(0),
            devices: RwLock::new(BTreeMap::new()),
            // One shard per thread, and the last for the sweep.
            counters: (0..=cfg.threads)
                .map(|_| CachePadded::new(Counters::default()))
                .collect(),
            metrics: RingMetrics::new(),
        });
        let mut proxy = Self {
            shared,
            threads: Vec::with_capacity(cfg.threads),
            shutdown_timeout: cfg.shutdown_timeout,
            closed: false,
            generation: gpuio_hal::sys::fork_generation(),
        };
        for i in 0..cfg.threads {
            let shared = proxy.shared.clone();
            let wait = cfg.wait;
            let spawned = std::thread::Builder::new()
                .name(format!("gpuio-ring-{i}"))
                .spawn(move || proxy_thread(shared, i, wait));
            match spawned {
                Ok(handle) => proxy.threads.push(handle),
                Err(e) => {
                    // Drop shuts down the threads already started.
                    return Err(CoreError::Internal(format!(
                        "starting ring proxy thread {i}: {e}"
                    )));
                }
            }
        }
        Ok(proxy)
    }

    /// The ring memory.
    pub fn ring(&self) -> &Arc<RingMemory> {
        &self.shared.ring
    }

    /// The descriptor kernels receive by value (`struct gpuio_ring`). The ring is then fed by
    /// kernels only (see [`RingMemory::device`]).
    pub fn device(&self) -> Result<RingDevice> {
        Ok(self.shared.ring.device()?)
    }

    /// A producer on host threads, standing in for kernels (tests, or a host that feeds the
    /// same proxy); refused once the descriptor went to kernels.
    pub fn host_producer(&self) -> Result<HostProducer> {
        Ok(HostProducer::new(self.shared.ring.clone())?)
    }

    /// Registers a resource requests can name; its offset is the resource's origin (a
    /// request's offset counts from there). Returns the handle (never 0).
    pub fn register(&self, resource: Endpoint) -> Result<u32> {
        self.shared.change_resources(|table| {
            let handle = u32::try_from(table.len() + 1).map_err(|_| {
                CoreError::InvalidRequest("the ring's resource table is full".into())
            })?;
            table.push(Some(resource));
            Ok(handle)
        })
    }

    /// Unregisters a resource and returns it; later requests naming the handle fail with
    /// `GPUIO_ERROR_NOT_FOUND` (requests already running finish).
    pub fn unregister(&self, handle: u32) -> Result<Endpoint> {
        self.shared.change_resources(|table| {
            (handle as usize)
                .checked_sub(1)
                .and_then(|i| table.get_mut(i))
                .and_then(Option::take)
                .ok_or_else(|| CoreError::InvalidRequest(format!("no ring resource {handle}")))
        })
    }

    /// Lets requests read from and write to `buf`: device addresses inside it are resolved to
    /// it. The proxy keeps a handle, so the memory stays allocated while registered.
    pub fn register_device(&self, buf: &DeviceBuffer) -> Result<()> {
        if buf.is_empty() {
            return Err(CoreError::InvalidRequest(
                "an empty device buffer cannot be a ring destination".into(),
            ));
        }
        self.shared
            .devices
            .write_unpoisoned()
            .insert(buf.device_addr(), buf.clone());
        Ok(())
    }

    /// Stops resolving device addresses to `buf`; returns whether it was registered. (Freeing
    /// device memory synchronizes a CUDA device: keep a handle until ring kernels are done.)
    pub fn unregister_device(&self, buf: &DeviceBuffer) -> bool {
        let mut devices = self.shared.devices.write_unpoisoned();
        match devices.get(&buf.device_addr()) {
            Some(b) if b.same_buffer(buf) => devices.remove(&buf.device_addr()).is_some(),
            _ => false,
        }
    }

    /// What the proxy has done so far.
    pub fn stats(&self) -> RingStats {
        let sum = |f: fn(&Counters) -> &AtomicU64| {
            self.shared
                .counters
                .iter()
                .map(|c| f(c).load(Ordering::Relaxed))
                .sum()
        };
        RingStats {
            served: sum(|c| &c.served),
            failed: sum(|c| &c.failed),
            bytes: sum(|c| &c.bytes),
            swept: sum(|c| &c.swept),
        }
    }

    /// Shuts the ring down with requests in flight: refuses new requests, lets the proxy
    /// threads finish the requests they are serving (their results are published), completes
    /// every request still posted with the shutdown error, closes the ring and joins the
    /// threads. Idempotent; also done on drop.
    pub fn shutdown(&mut self) -> Result<RingStats> {
        if self.closed {
            return Ok(self.stats());
        }
        if gpuio_hal::sys::fork_generation() != self.generation {
            // A forked child: the threads and the ring they serve are the parent's.
            self.threads.drain(..).for_each(std::mem::forget);
            self.closed = true;
            return Err(CoreError::InvalidRequest(
                "this ring was started before fork(): its threads stayed in the parent process"
                    .into(),
            ));
        }
        let ring = self.shared.ring.clone();
        ring.begin_shutdown();
        let mut first_error = None;
        for handle in self.threads.drain(..) {
            if handle.join().is_err() {
                first_error
                    .get_or_insert(CoreError::Internal("a ring proxy thread panicked".into()));
            }
        }
        // Someone holding the ring may have closed it already; then there is nothing to sweep.
        if ring.state() == ring::RingState::Stopping {
            match ring.sweep(self.shutdown_timeout) {
                Ok(swept) => {
                    if let Some(c) = self.shared.counters.last() {
                        c.swept.fetch_add(swept as u64, Ordering::Relaxed);
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e.into());
                }
            }
        }
        if let Err(e) = ring.close(self.shutdown_timeout) {
            first_error.get_or_insert(e.into());
        }
        self.closed = true;
        match first_error {
            Some(e) => Err(e),
            None => Ok(self.stats()),
        }
    }
}

impl Drop for RingProxy {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!(error = %e, "ring proxy shutdown failed");
        }
    }
}
