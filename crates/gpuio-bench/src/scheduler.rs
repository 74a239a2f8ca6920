//! The `core` suite: what the scheduler costs and what it buys.
//!
//! - `sched_latency`: one 4 KiB host-to-host request at a time through the scheduler
//!   (submission to completion callback), against the same transfer called directly on the
//!   engine: the difference is the scheduler's overhead per request (p50, p99). Beside them
//!   (`sched_latency_relay_p50`), the same call handed to a spinning thread and back with
//!   nothing else (`relay.rs`): the floor of any scheduler's overhead on the machine.
//! - `sched_throughput`: a stream of 4 KiB requests at random offsets (nothing to coalesce)
//!   submitted from one thread, against the same transfers run back to back on one thread;
//!   over an 8 MiB working set that stays in cache (the rate is the scheduler's own cost) and,
//!   as `sched_throughput_dram`, over 64 MiB (the copies' DRAM traffic sets the rate).
//! - `mixed`: small inference-class file reads with a deadline arriving at a steady rate while
//!   a checkpoint stream writes large buffers to a file; the share of deadlines met under the
//!   DEADLINE (and ADAPTIVE) policy against FIFO, on the same load in the same run.

use crate::relay::Relay;
use crate::{BenchError, Record, Result, Target, fresh_seed, median_f64};
use gpuio_api::{OpenOptions, Session};
use gpuio_core::{
    Endpoint, HostMemory, Policy, Priority, Request, RetryPolicy, Scheduler, SchedulerConfig,
};
use gpuio_hal::sync::{MutexExt, StripedCounter};
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The suite's name.
pub const SUITE: &str = "core";

/// Sizes and durations of the suite.
#[derive(Debug, Clone)]
pub struct Options {
    /// Requests timed one at a time.
    pub latency_requests: usize,
    /// Requests in the throughput stream.
    pub throughput_requests: usize,
    /// Worker threads of the measured schedulers.
    pub workers: usize,
    /// How long each policy runs the mixed load.
    pub mixed_duration: Duration,
    /// Directory for the mixed load's files.
    pub scratch: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            latency_requests: 20_000,
            throughput_requests: 1_000_000,
            workers: 2,
            mixed_duration: Duration::from_secs(2),
            scratch: std::env::temp_dir(),
        }
    }
}

impl Options {
    /// A short run (CI, smoke runs).
    pub fn quick() -> Self {
        Self {
            latency_requests: 5_000,
            throughput_requests: 200_000,
            mixed_duration: Duration::from_millis(500),
            ..Self::default()
        }
    }
}

const SMALL: usize = 4096;

fn err(e: gpuio_core::CoreError) -> BenchError {
    BenchError::Gpuio(e.into())
}

fn host(len: usize, seed: u64) -> Result<HostMemory> {
    let mut b = HostBuffer::alloc(len, &HostAllocOptions::default())?;
    pattern::fill(&mut b, 0, seed);
    Ok(HostMemory::new(b))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn scheduler(session: &Session, workers: usize, policy: Policy) -> Result<Scheduler> {
    let cfg = SchedulerConfig {
        workers,
        policy,
        ..SchedulerConfig::default()
    };
    Scheduler::new(session.engines().clone(), cfg, RetryPolicy::default()).map_err(err)
}

fn record(case: &str, metric: &str, value: f64, unit: &str, peer: &str, peer_value: f64) -> Record {
    // Lower is better for these figures; the rates set their own ratio.
    Record {
        bytes: SMALL,
        device: "host".into(),
        ..Record::versus(SUITE, (case, metric, unit), value, peer, peer_value, false)
    }
}

/// Runs the suite; returns the records, the targets, and notes.
pub fn run(
    session: &Session,
    opts: &Options,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let mut records = Vec::new();
    let mut targets = Vec::new();
    let seed = fresh_seed();

    progress("sched_latency");
    let (overhead, lat) = latency(session, opts, seed)?;
    records.extend(lat.iter().cloned());
    let floor = lat[2].value - lat[2].peer_value;
    // Judged against the direct call in the same run, so that a slow machine can neither
    // pass nor fail it.
    targets.push(Target {
        description:
            "scheduler overhead per 4 KiB memory request, p50 <= 1.0 us over the direct call's"
                .into(),
        measured: Some(format!(
            "{overhead:.2} us over the direct call's {:.2} us (handing the call to a spinning \
             thread and back alone adds {floor:.2} us)",
            lat[0].peer_value
        )),
        met: Some(overhead <= 1.0),
    });

    // Recorded so that runs on different leases can be told apart: a sandboxing kernel (gVisor
    // reports 4.4.0) makes every system call, futex waits and wakes among them, cost more.
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut notes = vec![format!("kernel {}", kernel.trim())];
    // Two working sets: 8 MiB stays in the last-level cache, so the copies are cheap and the
    // rate is the scheduler's own; 64 MiB does not, and the copies' DRAM traffic sets it.
    for (case, buffers) in [("sched_throughput", 4), ("sched_throughput_dram", 32)] {
        progress(case);
        let Stream {
            rate,
            direct,
            rounds,
            busy,
            build_ns,
            submit_ns,
        } = throughput(session, opts, seed, buffers)?;
        let each: Vec<String> = rounds
            .iter()
            .map(|(d, o)| format!("{o:.2} vs {d:.2}"))
            .collect();
        notes.push(format!(
            "{case}: {ROUNDS} rounds, M req/s through the scheduler vs direct: {} (the record: \
             the medians); the submitting thread was busy {:.0}% of the scheduled runs (near \
             100%: it, not the workers, sets the rate): {build_ns:.0} ns a request making it, \
             {submit_ns:.0} ns submitting it",
            each.join(", "),
            busy * 100.0
        ));
        let mut r = record(
            case,
            "requests/s",
            rate / 1e6,
            "M req/s",
            "direct engine calls, 1 thread",
            direct / 1e6,
        );
        r.ratio = rate / direct;
        r.reps = opts.throughput_requests;
        records.push(r);
        if buffers == 4 {
            targets.push(Target {
                description: format!(
                    "requests/s through the scheduler ({} workers, 4 KiB, cache-resident) >= \
                     0.85x direct engine calls on one thread",
                    opts.workers
                ),
                measured: Some(format!(
                    "{:.2} vs {:.2} M/s ({:.2}x)",
                    rate / 1e6,
                    direct / 1e6,
                    rate / direct
                )),
                met: Some(rate >= 0.85 * direct),
            });
        }
    }

    progress("sched_one_large_request");
    let (ours, direct) = one_large_request(session, opts, seed)?;
    let mut r = record(
        "sched_one_large_request",
        "bandwidth",
        ours,
        "GB/s",
        "the same copy called directly on the engine (which splits it over threads of its own)",
        direct,
    );
    r.ratio = ours / direct;
    r.bytes = LARGE;
    records.push(r);
    notes.push(format!(
        "sched_one_large_request: one {} MiB host-to-host request, cut into the scheduler's \
         chunks and run by its {} workers into one destination buffer",
        LARGE >> 20,
        opts.workers
    ));

    let mut fifo = None;
    for policy in [Policy::Fifo, Policy::Deadline, Policy::Adaptive] {
        progress(&format!("mixed: {policy:?}"));
        let m = mixed(session, opts, policy, seed)?;
        notes.push(format!(
            "mixed {policy:?}: {} deadline reads, {:.2}% missed, p99 {:.0} us; checkpoint {:.2} GB/s",
            m.reads,
            m.missed_pct(),
            m.p99_us,
            m.checkpoint_gbps
        ));
        match fifo {
            None => fifo = Some(m),
            Some(ref f) => {
                let mut r = record(
                    &format!("mixed_{}", format!("{policy:?}").to_lowercase()),
                    "deadline misses",
                    m.missed_pct(),
                    "%",
                    "same load under FIFO",
                    f.missed_pct(),
                );
                r.bytes = READ;
                r.reps = m.reads as usize;
                records.push(r);
                if policy == Policy::Deadline {
                    targets.push(Target {
                        description: "mixed load under DEADLINE: deadline misses <= 1%".into(),
                        measured: Some(format!(
                            "{:.2}% (FIFO {:.2}%)",
                            m.missed_pct(),
                            f.missed_pct()
                        )),
                        met: Some(m.missed_pct() <= 1.0),
                    });
                }
            }
        }
    }
    Ok((records, targets, notes))
}

/// Returns the overhead (p50 difference, µs) and the latency records: p50, p99, and the
/// relay's p50 against the direct call's.
fn latency(session: &Session, opts: &Options, seed: u64) -> Result<(f64, [Record; 3])> {
    let sched = scheduler(session, opts.workers, Policy::default())?;
    let src = host(1 << 20, seed)?;
    let dst = host(1 << 20, 0)?;
    let n = opts.latency_requests.max(100);
    let offset = |i: usize| (pattern::mix64(seed ^ i as u64) as usize % 256) * SMALL;
    let done = Arc::new(AtomicU64::new(0));
    let mut ours = Vec::with_capacity(n);
    let mut direct = Vec::with_capacity(n);
    let engines = session.engines();
    for i in 0..n {
        let (s, d) = (
            Endpoint::host(&src, offset(i)),
            Endpoint::host(&dst, offset(i + 1)),
        );
        // Alternate which goes first, so neither always finds the caches warm.
        let mut direct_one = || -> Result<()> {
            let t = Instant::now();
            engines.execute(&s, &d, SMALL).map_err(err)?;
            direct.push(t.elapsed());
            Ok(())
        };
        if i % 2 == 1 {
            direct_one()?;
        }
        let req = Request::new(s.clone(), d.clone(), SMALL).map_err(err)?;
        let flag = done.clone();
        let t = Instant::now();
        sched
            .submit_with(req, move |r| {
                flag.store(if r.is_ok() { 1 } else { 2 }, Ordering::Release)
            })
            .map_err(err)?;
        let state = loop {
            match done.load(Ordering::Acquire) {
                0 => std::hint::spin_loop(),
                v => break v,
            }
        };
        ours.push(t.elapsed());
        done.store(0, Ordering::Release);
        if state != 1 {
            return Err(BenchError::Options("a latency request failed".into()));
        }
        if i % 2 == 0 {
            direct_one()?;
        }
    }
    // The copies landed where they should have (the last one, checked byte for byte).
    let last = n - 1;
    let g = dst.read();
    if pattern::first_deviation(
        &g[offset(last + 1)..offset(last + 1) + SMALL],
        offset(last) as u64,
        seed,
    )
    .is_some()
    {
        return Err(BenchError::Corrupt {
            case: "sched_latency".into(),
            size: SMALL,
            offset: offset(last + 1) as u64,
        });
    }
    drop(g);
    drop(sched);
    let (relayed, direct_beside) = relay_latency(session, &src, &dst, n, &offset)?;
    ours.sort();
    direct.sort();
    let (o50, o99, d50, d99) = (
        percentile(&ours, 0.5),
        percentile(&ours, 0.99),
        percentile(&direct, 0.5),
        percentile(&direct, 0.99),
    );
    let mk = |case: &str, o: Duration, d: Duration| {
        let mut r = record(
            case,
            "latency",
            us(o),
            "us",
            "direct Engines::execute",
            us(d),
        );
        r.reps = n;
        r.route = "memio host copy".into();
        r
    };
    let mut floor = mk("sched_latency_relay_p50", relayed, direct_beside);
    floor.route = "memio host copy, handed to a spinning thread and back".into();
    Ok((
        us(o50) - us(d50),
        [
            mk("sched_latency_p50", o50, d50),
            mk("sched_latency_p99", o99, d99),
            floor,
        ],
    ))
}

/// The relay's p50 and the direct call's beside it, alternating as the scheduler's case does
/// (with the scheduler's workers gone: each spins on a core of its own).
fn relay_latency(
    session: &Session,
    src: &HostMemory,
    dst: &HostMemory,
    n: usize,
    offset: &dyn Fn(usize) -> usize,
) -> Result<(Duration, Duration)> {
    let mut relay = Relay::start(session.engines().clone())
        .map_err(|e| BenchError::Options(format!("starting the relay thread: {e}")))?;
    let engines = session.engines();
    let (mut relayed, mut direct) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        let (s, d) = (
            Endpoint::host(src, offset(i)),
            Endpoint::host(dst, offset(i + 1)),
        );
        for first in [i % 2 == 0, i % 2 == 1] {
            if first {
                let t = Instant::now();
                engines.execute(&s, &d, SMALL).map_err(err)?;
                direct.push(t.elapsed());
                continue;
            }
            // Cloned outside the clock, as the scheduler's requests are made outside it.
            let (s, d) = (s.clone(), d.clone());
            let t = Instant::now();
            relay.run(s, d, SMALL).map_err(err)?;
            relayed.push(t.elapsed());
        }
    }
    relayed.sort();
    direct.sort();
    Ok((percentile(&relayed, 0.5), percentile(&direct, 0.5)))
}

/// A stream's rate (requests a second) against the direct calls', the medians of alternating
/// rounds, and where the submitting thread's time went.
struct Stream {
    rate: f64,
    direct: f64,
    /// Each round's rates (M req/s): direct calls, then through the scheduler.
    rounds: Vec<(f64, f64)>,
    /// The share of the scheduler's runs the submitting thread was not waiting for room.
    busy: f64,
    /// Per request: making it (endpoints and `Request::new`), and in `submit_each`.
    build_ns: f64,
    submit_ns: f64,
}

/// Rounds of direct calls and scheduled requests, alternating: one measurement of the direct
/// calls swung 1.41-2.30 M/s between runs of one binary on an H200, so each side is the
/// median of rounds taken side by side.
const ROUNDS: usize = 3;

/// Requests per second through the scheduler and by direct calls, over `buffers` source and
/// as many destination buffers of 1 MiB, in [`ROUNDS`] rounds of each (a fresh scheduler per
/// round, so that no idle worker spins beside the direct calls), and the share of the
/// scheduler's runs the submitting thread spent submitting (not waiting for room).
fn throughput(session: &Session, opts: &Options, seed: u64, buffers: usize) -> Result<Stream> {
    const SLOTS: usize = 256; // 4 KiB slots per 1 MiB buffer
    let src: Vec<HostMemory> = (0..buffers)
        .map(|i| host(1 << 20, seed ^ i as u64))
        .collect::<Result<_>>()?;
    let dst: Vec<HostMemory> = (0..buffers)
        .map(|_| host(1 << 20, 0))
        .collect::<Result<_>>()?;
    let n = (opts.throughput_requests / ROUNDS).max(1000);
    // Random buffers and slots: nothing adjacent to merge, little lock sharing.
    let pick = |i: usize| {
        let h = pattern::mix64(seed.wrapping_add(i as u64));
        let (b, s) = ((h as usize) % buffers, (h >> 32) as usize % SLOTS);
        let (b2, s2) = ((h >> 16) as usize % buffers, (h >> 48) as usize % SLOTS);
        (
            Endpoint::host(&src[b], s * SMALL),
            Endpoint::host(&dst[b2], s2 * SMALL),
        )
    };
    let engines = session.engines();
    let mut rounds = Vec::with_capacity(ROUNDS);
    let (mut submitting, mut total, mut built) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for round in 0..ROUNDS {
        let first = round * n;
        let t = Instant::now();
        for i in first..first + n {
            let (s, d) = pick(i);
            engines.execute(&s, &d, SMALL).map_err(err)?;
        }
        let direct = n as f64 / t.elapsed().as_secs_f64();
        let r = scheduled(session, opts, n, |i| pick(first + i))?;
        submitting += r.submitting;
        total += r.total;
        built += r.built;
        rounds.push((direct / 1e6, n as f64 / r.total.as_secs_f64() / 1e6));
    }
    let median = |side: fn(&(f64, f64)) -> f64| median_f64(rounds.iter().map(side).collect()) * 1e6;
    let per_request = |d: Duration| d.as_secs_f64() * 1e9 / (n * ROUNDS) as f64;
    Ok(Stream {
        rate: median(|r| r.1),
        direct: median(|r| r.0),
        busy: submitting.as_secs_f64() / total.as_secs_f64(),
        build_ns: per_request(built),
        submit_ns: per_request(submitting.saturating_sub(built)),
        rounds,
    })
}

/// One scheduled round's clocks: the whole run, the submitting thread's time not waiting for
/// room, and the part of that spent making requests.
struct Round {
    total: Duration,
    submitting: Duration,
    built: Duration,
}

/// `n` requests (`pick(i)`'s endpoints) streamed through a fresh scheduler from this thread.
fn scheduled(
    session: &Session,
    opts: &Options,
    n: usize,
    pick: impl Fn(usize) -> (Endpoint, Endpoint),
) -> Result<Round> {
    let sched = scheduler(session, opts.workers, Policy::default())?;
    // Counters the callback reaches without capturing anything: a captured Arc would cost
    // each request a shared reference-count update on both sides, and one plain atomic that
    // both workers add to would bounce between them; both are the bench's cost, not the
    // scheduler's. Completions are counted from where this run starts.
    static COMPLETED: StripedCounter = StripedCounter::new();
    static FAILED: AtomicU64 = AtomicU64::new(0);
    let start = COMPLETED.get();
    let completed = || COMPLETED.get().wrapping_sub(start);
    FAILED.store(0, Ordering::Release);
    const WINDOW: u64 = 16_384;
    const BATCH: usize = 512;
    let t = Instant::now();
    let mut submitted = 0u64;
    let mut waited = Duration::ZERO;
    let mut built = Duration::ZERO;
    while (submitted as usize) < n {
        // Sleep rather than spin: on a small machine the workers need this core.
        if submitted - completed() > WINDOW {
            let w = Instant::now();
            while submitted - completed() > WINDOW {
                std::thread::sleep(Duration::from_micros(200));
            }
            waited += w.elapsed();
        }
        let m = BATCH.min(n - submitted as usize);
        let building = Instant::now();
        let reqs = (0..m)
            .map(|k| {
                let (s, d) = pick(submitted as usize + k);
                Request::new(s, d, SMALL)
            })
            .collect::<gpuio_core::Result<Vec<_>>>()
            .map_err(err)?;
        built += building.elapsed();
        sched
            .submit_each(reqs, |r| {
                if r.is_err() {
                    FAILED.fetch_add(1, Ordering::Relaxed);
                }
                COMPLETED.add(1);
            })
            .map_err(err)?;
        submitted += m as u64;
    }
    let submitting = t.elapsed().saturating_sub(waited);
    while completed() < n as u64 {
        std::thread::sleep(Duration::from_micros(50));
    }
    let total = t.elapsed();
    let failed = FAILED.load(Ordering::Relaxed);
    if failed > 0 {
        return Err(BenchError::Options(format!(
            "{failed} throughput requests failed"
        )));
    }
    Ok(Round {
        total,
        submitting,
        built,
    })
}

const LARGE: usize = 64 << 20;

/// One large host-to-host request through the scheduler (its chunks spread over the workers,
/// all writing one buffer) against the same copy called on the engine: median GB/s of each.
fn one_large_request(session: &Session, opts: &Options, seed: u64) -> Result<(f64, f64)> {
    let sched = scheduler(session, opts.workers, Policy::default())?;
    let (src, dst) = (host(LARGE, seed)?, host(LARGE, 0)?);
    let (s, d) = (Endpoint::host(&src, 0), Endpoint::host(&dst, 0));
    let gbps = |t: Instant| LARGE as f64 / t.elapsed().as_secs_f64() / 1e9;
    let (mut ours, mut direct) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        let t = Instant::now();
        let req = Request::new(s.clone(), d.clone(), LARGE).map_err(err)?;
        sched.submit(req).map_err(err)?.wait().map_err(err)?;
        ours.push(gbps(t));
        let t = Instant::now();
        session.engines().execute(&s, &d, LARGE).map_err(err)?;
        direct.push(gbps(t));
    }
    Ok((median_f64(ours), median_f64(direct)))
}

const READ: usize = 16 << 10;
const DEADLINE: Duration = Duration::from_millis(5);
const ARRIVAL: Duration = Duration::from_micros(250);
const CHECKPOINT: usize = 16 << 20;
const CHECKPOINTS_IN_FLIGHT: usize = 8;

struct Mixed {
    reads: u64,
    missed: u64,
    p99_us: f64,
    checkpoint_gbps: f64,
}

impl Mixed {
    fn missed_pct(&self) -> f64 {
        100.0 * self.missed as f64 / self.reads.max(1) as f64
    }
}

fn mixed(session: &Session, opts: &Options, policy: Policy, seed: u64) -> Result<Mixed> {
    let dir = tempfile_dir(&opts.scratch)?;
    let model = dir.0.join("model.bin");
    let ckpt = dir.0.join("checkpoint.bin");
    let model_len = 64usize << 20;
    {
        let mut b = vec![0u8; model_len];
        pattern::fill(&mut b, 0, seed);
        std::fs::write(&model, &b).map_err(|e| BenchError::Options(e.to_string()))?;
    }
    let model_f = session
        .open_file(&model, OpenOptions::READ)
        .map_err(BenchError::Gpuio)?;
    let ckpt_f = session
        .open_file(&ckpt, OpenOptions::CREATE)
        .map_err(BenchError::Gpuio)?;
    let weights = host(CHECKPOINT, seed ^ 7)?;
    let outs: Vec<HostMemory> = (0..64).map(|_| host(READ, 0)).collect::<Result<_>>()?;

    let sched = Arc::new(scheduler(session, opts.workers, policy)?);
    let latencies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));

    // The checkpoint stream: keeps CHECKPOINTS_IN_FLIGHT writes queued until told to stop.
    let writer = {
        let (sched, stop, written, weights, ckpt_f) = (
            sched.clone(),
            stop.clone(),
            written.clone(),
            weights.clone(),
            ckpt_f.clone(),
        );
        std::thread::spawn(move || -> gpuio_core::Result<()> {
            let in_flight = Arc::new(AtomicU64::new(0));
            let mut k = 0u64;
            while !stop.load(Ordering::Acquire) {
                if in_flight.load(Ordering::Acquire) >= CHECKPOINTS_IN_FLIGHT as u64 {
                    std::thread::sleep(Duration::from_micros(100));
                    continue;
                }
                let off = (k % 16) * CHECKPOINT as u64;
                let req = Request::new(
                    Endpoint::host(&weights, 0),
                    Endpoint::file(&ckpt_f, off),
                    CHECKPOINT,
                )?
                .with_priority(Priority::Checkpoint);
                in_flight.fetch_add(1, Ordering::AcqRel);
                let (f, w) = (in_flight.clone(), written.clone());
                sched.submit_with(req, move |r| {
                    if r.is_ok() {
                        w.fetch_add(CHECKPOINT as u64, Ordering::Relaxed);
                    }
                    f.fetch_sub(1, Ordering::AcqRel);
                })?;
                k += 1;
            }
            Ok(())
        })
    };
    // Let the checkpoint backlog build before the reads start.
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    let mut next = start;
    let mut reads = 0u64;
    let before = sched.stats();
    while start.elapsed() < opts.mixed_duration {
        let now = Instant::now();
        if now < next {
            std::hint::spin_loop();
            continue;
        }
        next += ARRIVAL;
        let slot = (pattern::mix64(seed ^ reads) as usize) % (model_len / READ);
        let req = Request::new(
            Endpoint::file(&model_f, (slot * READ) as u64),
            Endpoint::host(&outs[reads as usize % outs.len()], 0),
            READ,
        )
        .map_err(err)?
        .with_priority(Priority::InferenceRealtime)
        .with_deadline(now + DEADLINE);
        let lat = latencies.clone();
        sched
            .submit_with(req, move |r| {
                if let Ok(c) = r {
                    lat.lock_unpoisoned().push(c.latency);
                }
            })
            .map_err(err)?;
        reads += 1;
    }
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Release);
    let bytes_at_stop = written.load(Ordering::Relaxed);
    writer
        .join()
        .map_err(|_| BenchError::Options("the checkpoint thread panicked".into()))?
        .map_err(err)?;
    // Wait for the reads to finish (the scheduler drains on drop, too).
    let target = before.deadline_met + before.deadline_missed + reads;
    while {
        let s = sched.stats();
        s.deadline_met + s.deadline_missed < target
    } {
        std::thread::sleep(Duration::from_millis(1));
    }
    let s = sched.stats();
    let mut lat = std::mem::take(&mut *latencies.lock_unpoisoned());
    lat.sort();
    drop(sched);
    Ok(Mixed {
        reads,
        missed: s.deadline_missed - before.deadline_missed,
        p99_us: us(percentile(&lat, 0.99)),
        checkpoint_gbps: bytes_at_stop as f64 / elapsed.as_secs_f64() / 1e9,
    })
}

/// A scratch directory removed on drop.
struct ScratchDir(PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempfile_dir(base: &std::path::Path) -> Result<ScratchDir> {
    let dir = base.join(format!("gpuio-core-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| BenchError::Options(format!("{}: {e}", dir.display())))?;
    Ok(ScratchDir(dir))
}
