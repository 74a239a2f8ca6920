//! Metrics (docs/REFERENCE.md#metrics) through the `metrics` facade: throughput, latency
//! histograms, queue depths, error and deadline-miss rates, retries and failovers, cache and
//! registration hit rates, pinned memory. Recording is a no-op until a recorder is installed; the
//! CLI installs the Prometheus exporter (`--metrics-addr`) and `gpuio stat` reads it back. Handles
//! are resolved once, so the hot path only touches atomics.

use crate::request::Priority;
use crate::route::EngineKind;
use gpuio_staging::PoolStats;
use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};

/// Requests submitted, by `engine` and `class`.
pub const REQUESTS_SUBMITTED: &str = "gpuio_requests_submitted_total";
/// Requests finished, by `engine`, `class` and `outcome` (ok, error, cancelled).
pub const REQUESTS_FINISHED: &str = "gpuio_requests_finished_total";
/// Bytes moved by successful requests, by `engine`.
pub const BYTES: &str = "gpuio_bytes_total";
/// Submission-to-completion latency in seconds, by `engine` and `class`.
pub const LATENCY: &str = "gpuio_request_latency_seconds";
/// Time from submission to first pickup by a worker, in seconds, by `engine`.
pub const QUEUE_WAIT: &str = "gpuio_queue_wait_seconds";
/// Units waiting in the scheduler's queues.
pub const QUEUE_DEPTH: &str = "gpuio_queue_depth";
/// Bytes admitted and not yet completed, by `engine`.
pub const IN_FLIGHT_BYTES: &str = "gpuio_in_flight_bytes";
/// Requests that finished after their deadline, by `class`.
pub const DEADLINE_MISSES: &str = "gpuio_deadline_misses_total";
/// Requests that finished with a deadline, by `class`.
pub const DEADLINE_REQUESTS: &str = "gpuio_deadline_requests_total";
/// Retries of retryable errors.
pub const RETRIES: &str = "gpuio_retries_total";
/// Switches to another source after a failure.
pub const FAILOVERS: &str = "gpuio_failovers_total";
/// Cache lookups, by `level` (l1, l2, l3) and `result` (hit, miss).
pub const CACHE_LOOKUPS: &str = "gpuio_cache_lookups_total";
/// Blocks evicted from a cache level, by `level`.
pub const CACHE_EVICTIONS: &str = "gpuio_cache_evictions_total";
/// Blocks written back to the backing store.
pub const CACHE_WRITEBACKS: &str = "gpuio_cache_writebacks_total";
/// Registration-cache lookups, by `kind` and `result` (hit, miss).
pub const REG_LOOKUPS: &str = "gpuio_registration_lookups_total";
/// Registrations evicted, by `kind`.
pub const REG_EVICTIONS: &str = "gpuio_registration_evictions_total";
/// The staging pool's limit in bytes (`memory_pool_size`).
pub const POOL_LIMIT_BYTES: &str = "gpuio_pool_limit_bytes";
/// Pinned bytes held by the staging pool.
pub const POOL_PINNED_BYTES: &str = "gpuio_pool_pinned_bytes";
/// Pinned bytes of the staging pool handed out (the transports' lanes hold theirs while
/// cached between transfers).
pub const POOL_IN_USE_BYTES: &str = "gpuio_pool_in_use_bytes";
/// The most pinned bytes the staging pool held at once.
pub const POOL_PEAK_BYTES: &str = "gpuio_pool_peak_pinned_bytes";
/// Staging pool events, by `event`: `allocation` (a buffer pinned), `reuse` (a free buffer
/// served), `release` (a free buffer unpinned to make room), `wait` (a request that waited for
/// room), `failure` (one that got none).
pub const POOL_EVENTS: &str = "gpuio_pool_events_total";
/// Idle bytes the staging pool's holders (the transports' cached lanes) gave back for room.
pub const POOL_RECLAIMED_BYTES: &str = "gpuio_pool_reclaimed_bytes_total";

/// Pinned bytes the page cache registrations kept for hot files may hold (`page_cache_keep`).
pub const PAGE_CACHE_LIMIT_BYTES: &str = "gpuio_page_cache_keep_limit_bytes";
/// Pinned bytes of page cache kept registered for hot files.
pub const PAGE_CACHE_KEPT_BYTES: &str = "gpuio_page_cache_kept_bytes";
/// Hot files whose page cache registration is kept.
pub const PAGE_CACHE_KEPT_FILES: &str = "gpuio_page_cache_kept_files";
/// Reads into GPU memory the page cache policy looked at, by `result`: `hit` (a kept
/// registration served it) or `miss` (registered for the read, or staged).
pub const PAGE_CACHE_READS: &str = "gpuio_page_cache_reads_total";
/// Kept registrations let go (for room, a changed file, or memory pressure).
pub const PAGE_CACHE_RELEASED: &str = "gpuio_page_cache_released_total";

/// Publishes LocalIO's kept page cache registrations (after a read into GPU memory).
pub(crate) fn page_cache(s: &gpuio_transport_localio::PageCacheStats) {
    gauge!(PAGE_CACHE_LIMIT_BYTES).set(s.limit as f64);
    gauge!(PAGE_CACHE_KEPT_BYTES).set(s.kept_bytes as f64);
    gauge!(PAGE_CACHE_KEPT_FILES).set(s.kept_files as f64);
    counter!(PAGE_CACHE_READS, "result" => "hit").absolute(s.hits);
    counter!(PAGE_CACHE_READS, "result" => "miss").absolute(s.misses);
    counter!(PAGE_CACHE_RELEASED).absolute(s.released);
}

/// Every metric with its help text, for exporters.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(REQUESTS_SUBMITTED, "requests submitted");
    describe_counter!(REQUESTS_FINISHED, "requests finished, by outcome");
    describe_counter!(BYTES, Unit::Bytes, "bytes moved by successful requests");
    describe_histogram!(LATENCY, Unit::Seconds, "submission to completion");
    describe_histogram!(QUEUE_WAIT, Unit::Seconds, "submission to first pickup");
    describe_gauge!(QUEUE_DEPTH, "units waiting in the scheduler's queues");
    describe_gauge!(IN_FLIGHT_BYTES, Unit::Bytes, "admitted, not yet completed");
    describe_counter!(DEADLINE_MISSES, "requests finished after their deadline");
    describe_counter!(DEADLINE_REQUESTS, "requests finished that had a deadline");
    describe_counter!(RETRIES, "retries of retryable errors");
    describe_counter!(FAILOVERS, "switches to another source after a failure");
    describe_counter!(CACHE_LOOKUPS, "block cache lookups by level and result");
    describe_counter!(CACHE_EVICTIONS, "blocks evicted from a cache level");
    describe_counter!(
        CACHE_WRITEBACKS,
        "dirty blocks written to the backing store"
    );
    describe_counter!(REG_LOOKUPS, "registration cache lookups");
    describe_counter!(REG_EVICTIONS, "registrations evicted");
    describe_gauge!(
        POOL_LIMIT_BYTES,
        Unit::Bytes,
        "pinned staging memory allowed"
    );
    describe_gauge!(POOL_PINNED_BYTES, Unit::Bytes, "pinned staging memory held");
    describe_gauge!(
        POOL_IN_USE_BYTES,
        Unit::Bytes,
        "pinned staging memory handed out"
    );
    describe_gauge!(
        POOL_PEAK_BYTES,
        Unit::Bytes,
        "most pinned staging memory held at once"
    );
    describe_counter!(
        POOL_EVENTS,
        "staging pool allocations, reuses, releases, waits, failures"
    );
    describe_gauge!(
        PAGE_CACHE_LIMIT_BYTES,
        Unit::Bytes,
        "page cache pinned for hot files, at most"
    );
    describe_gauge!(
        PAGE_CACHE_KEPT_BYTES,
        Unit::Bytes,
        "page cache kept registered for hot files"
    );
    describe_gauge!(PAGE_CACHE_KEPT_FILES, "hot files kept registered");
    describe_counter!(PAGE_CACHE_READS, "page cache reads by result (hit: kept)");
    describe_counter!(PAGE_CACHE_RELEASED, "kept registrations let go");
    describe_counter!(
        POOL_RECLAIMED_BYTES,
        Unit::Bytes,
        "idle staging memory the transports gave back for room"
    );
}

/// What a staging pool reports, as metrics: pass it to
/// [`StagingPool::with_observer`](gpuio_staging::StagingPool::with_observer) (the session
/// does), and the pool publishes its counters after every change. The handles are resolved
/// here, once.
pub fn pool_observer() -> impl Fn(&PoolStats) + Send + Sync + 'static {
    let limit = gauge!(POOL_LIMIT_BYTES);
    let pinned = gauge!(POOL_PINNED_BYTES);
    let in_use = gauge!(POOL_IN_USE_BYTES);
    let peak = gauge!(POOL_PEAK_BYTES);
    let event = |e: &'static str| counter!(POOL_EVENTS, "event" => e);
    let (allocations, reuses, releases) = (event("allocation"), event("reuse"), event("release"));
    let (waits, failures) = (event("wait"), event("failure"));
    let reclaimed = counter!(POOL_RECLAIMED_BYTES);
    move |s: &PoolStats| {
        limit.set(s.limit as f64);
        pinned.set(s.pinned_bytes as f64);
        in_use.set(s.in_use_bytes as f64);
        peak.set(s.peak_pinned_bytes as f64);
        allocations.absolute(s.allocations);
        reuses.absolute(s.reuses);
        releases.absolute(s.releases);
        waits.absolute(s.waits);
        failures.absolute(s.failures);
        reclaimed.absolute(s.reclaimed_bytes);
    }
}

const ENGINES: [EngineKind; 3] = [EngineKind::MemIo, EngineKind::LocalIo, EngineKind::RemoteIo];
const CLASSES: [Priority; 6] = [
    Priority::InferenceRealtime,
    Priority::TrainingForward,
    Priority::TrainingBackward,
    Priority::Checkpoint,
    Priority::EngramSync,
    Priority::Background,
];

/// A priority class's metric label.
pub fn class_label(p: Priority) -> &'static str {
    match p {
        Priority::InferenceRealtime => "inference_realtime",
        Priority::TrainingForward => "training_fw",
        Priority::TrainingBackward => "training_bw",
        Priority::Checkpoint => "checkpoint",
        Priority::EngramSync => "engram_sync",
        Priority::Background => "background",
    }
}

fn engine_label(e: EngineKind) -> &'static str {
    match e {
        EngineKind::MemIo => "memio",
        EngineKind::LocalIo => "localio",
        EngineKind::RemoteIo => "remoteio",
    }
}

pub(crate) struct ClassMetrics {
    pub submitted: Counter,
    pub ok: Counter,
    pub failed: Counter,
    pub cancelled: Counter,
    pub latency: Histogram,
}

pub(crate) struct EngineMetrics {
    pub classes: Vec<ClassMetrics>,
    pub bytes: Counter,
    pub queue_wait: Histogram,
    pub in_flight: Gauge,
}

/// The scheduler's metric handles.
pub(crate) struct SchedMetrics {
    pub engines: Vec<EngineMetrics>,
    pub queue_depth: Gauge,
    pub deadline: Vec<(Counter, Counter)>,
    pub retries: Counter,
    pub failovers: Counter,
}

impl SchedMetrics {
    pub fn new() -> Self {
        let engines = ENGINES
            .iter()
            .map(|&e| {
                let el = engine_label(e);
                EngineMetrics {
                    classes: CLASSES
                        .iter()
                        .map(|&c| {
                            let cl = class_label(c);
                            let fin = |o: &'static str| {
                                counter!(REQUESTS_FINISHED, "engine" => el, "class" => cl, "outcome" => o)
                            };
                            ClassMetrics {
                                submitted: counter!(REQUESTS_SUBMITTED, "engine" => el, "class" => cl),
                                ok: fin("ok"),
                                failed: fin("error"),
                                cancelled: fin("cancelled"),
                                latency: histogram!(LATENCY, "engine" => el, "class" => cl),
                            }
                        })
                        .collect(),
                    bytes: counter!(BYTES, "engine" => el),
                    queue_wait: histogram!(QUEUE_WAIT, "engine" => el),
                    in_flight: gauge!(IN_FLIGHT_BYTES, "engine" => el),
                }
            })
            .collect();
        Self {
            engines,
            queue_depth: gauge!(QUEUE_DEPTH),
            deadline: CLASSES
                .iter()
                .map(|&c| {
                    let cl = class_label(c);
                    (
                        counter!(DEADLINE_REQUESTS, "class" => cl),
                        counter!(DEADLINE_MISSES, "class" => cl),
                    )
                })
                .collect(),
            retries: counter!(RETRIES),
            failovers: counter!(FAILOVERS),
        }
    }

    pub fn engine(&self, e: EngineKind) -> &EngineMetrics {
        &self.engines[e as usize]
    }

    pub fn class(&self, e: EngineKind, c: Priority) -> &ClassMetrics {
        &self.engines[e as usize].classes[c as usize]
    }
}
