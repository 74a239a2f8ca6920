//! The `ring` suite: IO started by GPU threads through the request ring (GPU machine only).
//!
//! - `ring_read_4k`: random 4 KiB reads of a warm file, each posted by a GPU thread
//!   (`gpuio_read_each_warp`, 1024 threads in flight) and served by the host proxy through LocalIO into
//!   the slot's bounce buffer (the thread copies it to its destination), against the same
//!   reads issued by the host LocalIO engine (`read_blocks_to_device`).
//! - `ring_read_4k_vs_pread`: the same ring reads against the proxy's threads reading the same
//!   blocks with `pread` alone (no ring, no GPU): what a proxy serving each request with one
//!   positioned read can reach on this machine, the kernel's page cache copy included.
//! - `ring_read_4k_sweep`: the same reads with 256, 1024 and 4096 GPU threads in flight and a
//!   quarter, half and all-but-two of the cores as proxy threads (records only: where the
//!   ring's rate comes from).
//! - `ring_round_trip`: one GPU thread posting minimal requests (8 bytes) one after another;
//!   the p50 of post-to-result times on the GPU's clock, and of each phase (ticket, post, the
//!   host serving it until the GPU sees the completion, collecting it).

use crate::localio::{Cleanup, api, make_file};
use crate::{BenchError, Record, Result, Target, fresh_seed};
use gpuio_api::{OpenOptions, Session};
use gpuio_core::ring::WaitPolicy;
use gpuio_core::{Endpoint, RingConfig, RingProxy};
use gpuio_hal::{DeviceBuffer, Stream, pattern};
use gpuio_ring::ops as ring_kernels;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The suite's name.
pub const SUITE: &str = "ring";

/// Sizes of the suite.
#[derive(Debug, Clone)]
pub struct Options {
    /// Test file size.
    pub file_size: u64,
    /// Random reads per measurement.
    pub reads: usize,
    /// GPU threads posting reads (requests in flight).
    pub threads: u32,
    /// Round trips timed.
    pub pings: usize,
    /// Timed repetitions (median).
    pub reps: usize,
    /// Directory for the test file.
    pub scratch: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            file_size: 1 << 30,
            reads: 262_144,
            threads: 1024,
            pings: 2000,
            reps: 5,
            scratch: std::env::temp_dir(),
        }
    }
}

impl Options {
    /// A short run.
    pub fn quick() -> Self {
        Self {
            file_size: 64 << 20,
            reads: 16_384,
            pings: 200,
            reps: 1,
            ..Self::default()
        }
    }
}

/// A proxy configuration for the suite: 4 KiB bounce buffers, latency-first waiting (idle
/// threads spin about a millisecond before they yield).
fn ring_config(threads: usize) -> RingConfig {
    RingConfig {
        slots: 4096,
        bounce_bytes: 4096,
        threads,
        wait: WaitPolicy {
            spins: 1 << 18,
            yields: 1 << 10,
            max_sleep: Duration::from_micros(20),
        },
        ..RingConfig::default()
    }
}

/// Checks the `n` result words `ring_read_blocks` stored in `results`: each `want` bytes.
pub(crate) fn check_results(
    stream: &Stream,
    results: &DeviceBuffer,
    n: usize,
    want: i64,
    what: &str,
) -> Result<()> {
    let mut res = vec![0u8; n * 8];
    stream.download(results, 0, &mut res)?;
    let words = res.chunks_exact(8).map(|w| {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        i64::from_le_bytes(b)
    });
    match words.enumerate().find(|&(_, r)| r != want) {
        Some((k, r)) => Err(BenchError::Options(format!("{what} {k} returned {r}"))),
        None => Ok(()),
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Runs the suite; on the host backend it reports that it needs a GPU and records nothing.
pub fn run(
    session: &Session,
    opts: &Options,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let gpu = match crate::cuda_gpu(
        session,
        "ring: needs a GPU (kernels post the requests); the host backend's producer is tested in CI",
    )? {
        Ok(gpu) => gpu,
        Err(nothing) => return Ok(nothing),
    };
    let io = session.localio();
    let seed = fresh_seed();
    let path = opts
        .scratch
        .join(format!("gpuio-ring-{}.bin", std::process::id()));
    let _cleanup = Cleanup(vec![path.clone()]);
    progress("writing the test file");
    make_file(&path, opts.file_size, seed)?;
    let file = io.open(&path, OpenOptions::READ).map_err(api)?;
    let blocks = opts.file_size / 4096;
    let n = opts.reads.min(blocks as usize);
    let offsets: Vec<u64> = (0..n)
        .map(|i| pattern::mix64(seed ^ (i as u64) << 1) % blocks * 4096)
        .collect();
    let stream = gpu.stream()?;
    let offs = gpu.alloc(n * 8)?;
    let bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
    stream.upload(&bytes, &offs, 0)?;
    let dst = gpu.alloc(n * 4096)?;
    let results = gpu.alloc(n * 8)?;
    let cores = std::thread::available_parallelism().map_or(2, |c| c.get());
    // Throughput: proxy threads on all but two cores (the driver and the launching thread
    // keep theirs). Latency: two, so that spinning proxies never crowd the cores.
    let mut cfg = ring_config(cores.saturating_sub(2).clamp(1, 16));
    // Idle while the peers run: its threads sleep up to 200 us between polls rather than 20,
    // so they do not wake hundreds of thousands of times a second on the peers' cores (a
    // ring pass may start up to 200 us late, under 0.5 % of it).
    cfg.wait.max_sleep = Duration::from_micros(200);
    let threads = cfg.threads;
    let mut proxy = RingProxy::new(session.engines().clone(), &gpu, cfg).map_err(api)?;
    let handle = proxy.register(Endpoint::file(&file, 0)).map_err(api)?;
    proxy.register_device(&dst).map_err(api)?;

    // Kernel-issued reads against the host engine's, alternating, page cache warm.
    progress("ring_read_4k");
    let ring_reads = || -> Result<()> {
        let t = opts.threads;
        let r = proxy.ring();
        Ok(ring_kernels::read_blocks(
            &stream, r, handle, &offs, n, 4096, &dst, &results, t,
        )?)
    };
    let host_reads = || -> Result<()> {
        io.read_blocks_to_device(&file, &offsets, 4096, &dst, 0)
            .map(|_| ())
            .map_err(api)
    };
    // The proxy's threads reading the same blocks with pread alone: the ceiling of serving
    // each request with one positioned read.
    let pread_alone = || -> Result<()> {
        let per = n.div_ceil(threads);
        std::thread::scope(|s| {
            let workers: Vec<_> = offsets
                .chunks(per)
                .map(|part| {
                    s.spawn(|| {
                        let mut block = vec![0u8; 4096];
                        part.iter()
                            .try_for_each(|&o| file.read_exact_at(o, &mut block))
                    })
                })
                .collect();
            workers.into_iter().try_for_each(|w| {
                w.join()
                    .map_err(|_| BenchError::Options("a pread thread panicked".into()))?
                    .map_err(api)
            })
        })
    };
    // Warm the page cache and the kernels' compilation.
    host_reads()?;
    ring_reads()?;
    pread_alone()?;
    let (mut ring_t, mut host_t, mut pread_t) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..opts.reps.max(1) {
        for (run, times) in [
            (&ring_reads as &dyn Fn() -> Result<()>, &mut ring_t),
            (&host_reads, &mut host_t),
            (&pread_alone, &mut pread_t),
        ] {
            let t = Instant::now();
            run()?;
            times.push(t.elapsed());
        }
    }
    // The last ring run's data and results, checked.
    ring_reads()?;
    check_results(&stream, &results, n, 4096, "ring read")?;
    let mut sample = vec![0u8; 4096];
    for k in [0, n / 2, n - 1] {
        stream.download(&dst, k * 4096, &mut sample)?;
        if let Some(off) = pattern::first_deviation(&sample, offsets[k], seed) {
            return Err(BenchError::Corrupt {
                case: "ring_read_4k".into(),
                size: 4096,
                offset: off as u64,
            });
        }
    }
    let ring_iops = n as f64 / median(ring_t).as_secs_f64().max(1e-9);
    let host_iops = n as f64 / median(host_t).as_secs_f64().max(1e-9);
    let pread_iops = n as f64 / median(pread_t).as_secs_f64().max(1e-9);
    let device = gpu.info().name.clone();
    let mut records = vec![Record {
        suite: SUITE.into(),
        case: "ring_read_4k".into(),
        metric: "iops".into(),
        value: ring_iops / 1e6,
        unit: "M IOPS".into(),
        peer: "host LocalIO read_blocks_to_device".into(),
        peer_value: host_iops / 1e6,
        ratio: ring_iops / host_iops.max(1e-9),
        bytes: 4096,
        route: format!("{} GPU threads, {threads} proxy threads", opts.threads),
        device: device.clone(),
        reps: opts.reps,
        rows: None,
    }];
    let mut vs_pread = Record::versus(
        SUITE,
        ("ring_read_4k_vs_pread", "iops", "M IOPS"),
        ring_iops / 1e6,
        &format!("pread alone on {threads} threads (no ring, no GPU)"),
        pread_iops / 1e6,
        true,
    );
    vs_pread.bytes = 4096;
    vs_pread.route = records[0].route.clone();
    vs_pread.device = device.clone();
    vs_pread.reps = opts.reps;
    records.push(vs_pread);
    let mut targets = vec![Target {
        description: "kernel-issued 4 KiB reads >= 1.0x the host engine's rate".into(),
        measured: Some(format!(
            "{:.2} M vs {:.2} M IOPS ({:.2}x)",
            ring_iops / 1e6,
            host_iops / 1e6,
            ring_iops / host_iops.max(1e-9)
        )),
        met: Some(ring_iops >= host_iops),
    }];

    let stats = proxy.shutdown().map_err(api)?;
    let mut notes = vec![format!("ring proxy for reads: {stats:?}")];

    // Where the ring's rate comes from: the same reads with fewer or more GPU threads in
    // flight and proxy threads serving them (records only; the target above is the default).
    let proxies = [(cores / 4).max(1), (cores / 2).max(1), threads];
    for gpu_threads in [256u32, opts.threads, 4 * opts.threads] {
        for &p in &proxies {
            progress(&format!(
                "ring_read_4k sweep: {gpu_threads} GPU, {p} proxy threads"
            ));
            let mut proxy =
                RingProxy::new(session.engines().clone(), &gpu, ring_config(p)).map_err(api)?;
            let handle = proxy.register(Endpoint::file(&file, 0)).map_err(api)?;
            proxy.register_device(&dst).map_err(api)?;
            let reads = || -> Result<()> {
                Ok(ring_kernels::read_blocks(
                    &stream,
                    proxy.ring(),
                    handle,
                    &offs,
                    n,
                    4096,
                    &dst,
                    &results,
                    gpu_threads,
                )?)
            };
            reads()?;
            let mut t = Vec::new();
            for _ in 0..opts.reps.max(1) {
                let start = Instant::now();
                reads()?;
                t.push(start.elapsed());
            }
            let iops = n as f64 / median(t).as_secs_f64().max(1e-9);
            records.push(Record {
                suite: SUITE.into(),
                case: "ring_read_4k_sweep".into(),
                metric: "iops".into(),
                value: iops / 1e6,
                unit: "M IOPS".into(),
                peer: "host LocalIO read_blocks_to_device".into(),
                peer_value: host_iops / 1e6,
                ratio: iops / host_iops.max(1e-9),
                bytes: 4096,
                route: format!("{gpu_threads} GPU threads, {p} proxy threads"),
                device: device.clone(),
                reps: opts.reps,
                rows: None,
            });
            proxy.shutdown().map_err(api)?;
        }
    }

    // Round trips of a minimal request.
    progress("ring_round_trip");
    let mut proxy = RingProxy::new(session.engines().clone(), &gpu, ring_config(2)).map_err(api)?;
    let handle = proxy.register(Endpoint::file(&file, 0)).map_err(api)?;
    proxy.register_device(&dst).map_err(api)?;
    let phases = ring_kernels::RING_PING_PHASES;
    let ns = gpu.alloc(opts.pings * 8 * phases)?;
    ring_kernels::ping(
        &stream,
        proxy.ring(),
        handle,
        opts.pings.min(100),
        8,
        &dst,
        &ns,
    )?;
    ring_kernels::ping(&stream, proxy.ring(), handle, opts.pings, 8, &dst, &ns)?;
    let mut raw = vec![0u8; opts.pings * 8 * phases];
    stream.download(&ns, 0, &mut raw)?;
    let stamps: Vec<u64> = raw
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
        .collect();
    if stamps.contains(&u64::MAX) {
        return Err(BenchError::Options("a ring round trip failed".into()));
    }
    // Where a round trip's time goes: the p50 of each phase's own length.
    let p50_of = |f: &dyn Fn(&[u64]) -> u64| {
        let mut v: Vec<u64> = stamps.chunks_exact(phases).map(f).collect();
        v.sort_unstable();
        v[v.len() / 2] as f64 / 1e3
    };
    notes.push(format!(
        "ring round trip by phase (p50 us): ticket {:.2}, post {:.2}, host serves and the \
         GPU sees the completion {:.2}, collect and hand the slot back {:.2}",
        p50_of(&|t| t[0]),
        p50_of(&|t| t[1] - t[0]),
        p50_of(&|t| t[2] - t[1]),
        p50_of(&|t| t[3] - t[2]),
    ));
    let mut times: Vec<u64> = stamps.chunks_exact(phases).map(|t| t[3]).collect();
    times.sort_unstable();
    let p50 = times[times.len() / 2] as f64 / 1e3;
    let p99 = times[times.len() * 99 / 100] as f64 / 1e3;
    records.push(Record {
        suite: SUITE.into(),
        case: "ring_round_trip".into(),
        metric: "latency p50".into(),
        value: p50,
        unit: "us".into(),
        peer: "p99".into(),
        peer_value: p99,
        ratio: p99 / p50.max(1e-9),
        bytes: 8,
        route: "2 proxy threads".into(),
        device,
        reps: opts.pings,
        rows: None,
    });
    targets.push(Target {
        description: "ring round trip of a minimal request, p50 <= 5 us".into(),
        measured: Some(format!("{p50:.2} us (p99 {p99:.2} us)")),
        met: Some(p50 <= 5.0),
    });
    let stats = proxy.shutdown().map_err(api)?;
    notes.push(format!("ring proxy for round trips: {stats:?}"));
    Ok((records, targets, notes))
}
