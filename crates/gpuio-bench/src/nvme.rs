//! The `nvme` suite: NVMe commands submitted by GPU threads (GPU machine only). The GPU machine
//! has no NVMe, so the controller is gpuio's software controller (a host thread serving the
//! queues from a RAM namespace): these figures are the queue protocol's and that controller's,
//! not a drive's.
//!
//! - `nvme_flush`: FLUSH commands (no data) from `grid` blocks (at most that many SMs), one
//!   queue pair per block, against the target of 10 M commands/s. The controller serves the
//!   pairs with `controller_threads` host threads (8: half the GPU machine's cores; the ring
//!   peer below gets all but two), so that it is not what limits the GPU's side.
//! - `nvme_read_4k`: 4 KiB READs at random LBAs into host memory mapped for the GPU, every word
//!   checked by the lane that asked, against the same 4 KiB reads of the same bytes (in host
//!   memory) posted by GPU threads through the request ring (1024 threads in flight, proxy
//!   threads on all but two cores), in the same run.

use crate::localio::api;
use crate::{BenchError, Record, Result, Target, fresh_seed, median};
use gpuio_api::Session;
use gpuio_core::ring::WaitPolicy;
use gpuio_core::{Endpoint, HostMemory, RingConfig, RingProxy};
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_nvme::ops as nvme_kernels;
use gpuio_nvme::{Controller, ControllerOptions, GpuNvmeOp, SoftConfig, SoftController};
use gpuio_ring::ops as ring_kernels;
use std::time::{Duration, Instant};

/// The suite's name.
pub const SUITE: &str = "nvme";

/// Sizes of the suite.
#[derive(Debug, Clone)]
pub struct Options {
    /// Namespace size in bytes (512-byte blocks).
    pub namespace: u64,
    /// FLUSH commands per measurement.
    pub flushes: usize,
    /// 4 KiB reads per measurement.
    pub reads: usize,
    /// Blocks of 128 threads submitting (an upper bound on the SMs used).
    pub grid: u32,
    /// Threads of the software controller serving the I/O queues.
    pub controller_threads: usize,
    /// Timed repetitions (median).
    pub reps: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            namespace: 256 << 20,
            flushes: 4_000_000,
            reads: 262_144,
            grid: 16,
            controller_threads: 8,
            reps: 3,
        }
    }
}

impl Options {
    /// A short run.
    pub fn quick() -> Self {
        Self {
            namespace: 64 << 20,
            flushes: 200_000,
            reads: 16_384,
            reps: 1,
            ..Self::default()
        }
    }
}

fn hal(e: gpuio_hal::HalError) -> BenchError {
    BenchError::from(e)
}

/// Runs the suite; on the host backend it reports that it needs a GPU and records nothing.
pub fn run(
    session: &Session,
    opts: &Options,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let gpu = match crate::cuda_gpu(
        session,
        "nvme: needs a GPU (kernels drive the queues); the host driver is tested in CI",
    )? {
        Ok(gpu) => gpu,
        Err(nothing) => return Ok(nothing),
    };
    let seed = fresh_seed();
    let blocks = opts.namespace / 512;
    progress("software controller and namespace");
    let soft = SoftController::start(SoftConfig {
        namespaces: vec![blocks],
        io_threads: opts.controller_threads,
        ..SoftConfig::default()
    })
    .map_err(hal)?;
    soft.fill_pattern(1, seed).map_err(hal)?;
    let ctrl = Controller::enable(
        soft.registers(),
        soft.mapper(),
        ControllerOptions::default(),
    )
    .map_err(hal)?;
    let ns = ctrl.namespace(1).map_err(hal)?;
    let grid = opts.grid.max(1);
    let pairs = (0..grid)
        .map(|_| ctrl.gpu_queue_pair(&gpu, 64))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(hal)?;
    let queues: Vec<_> = pairs.iter().collect();
    let data = ctrl.dma_buffer(grid as usize * 128 * 4096).map_err(hal)?;
    let mapped = data.map_for_gpu(&gpu).map_err(hal)?;
    let stream = gpu.stream()?;
    let device = gpu.info().name.clone();
    let route = format!(
        "{grid} blocks of 128 threads, {grid} queue pairs of 64, software controller ({} I/O \
         threads)",
        opts.controller_threads
    );
    let upload = |v: &[u64]| -> Result<gpuio_hal::DeviceBuffer> {
        let buf = gpu.alloc(v.len() * 8)?;
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        stream.upload(&bytes, &buf, 0)?;
        Ok(buf)
    };
    let all_succeeded = |st: &gpuio_hal::DeviceBuffer, n: usize, case: &str| -> Result<()> {
        let mut raw = vec![0u8; n * 4];
        stream.download(st, 0, &mut raw)?;
        match raw.chunks_exact(4).position(|c| c != [0, 0, 0, 0]) {
            None => Ok(()),
            Some(k) => Err(BenchError::Options(format!(
                "{case}: command {k} failed with status {:#x}",
                u32::from_le_bytes(raw[4 * k..4 * k + 4].try_into().unwrap_or_default())
            ))),
        }
    };

    // FLUSH: the protocol's own rate.
    progress("nvme_flush");
    let n = opts.flushes;
    let zeros = upload(&vec![0u64; n])?;
    let st = gpu.alloc(n * 4)?;
    let flush = || -> Result<()> {
        nvme_kernels::io(
            &stream,
            &queues,
            GpuNvmeOp::Flush,
            &ns,
            &zeros,
            n,
            0,
            &mapped,
            &st,
            grid,
        )
        .map(|_| ())
        .map_err(hal)
    };
    flush()?;
    let mut t = Vec::new();
    for _ in 0..opts.reps.max(1) {
        let start = Instant::now();
        flush()?;
        t.push(start.elapsed());
    }
    all_succeeded(&st, n, "nvme_flush")?;
    let flush_rate = n as f64 / median(t).as_secs_f64().max(1e-9);
    let mut records = vec![Record {
        suite: SUITE.into(),
        case: "nvme_flush".into(),
        metric: "commands/s".into(),
        value: flush_rate / 1e6,
        unit: "M cmd/s".into(),
        peer: "target".into(),
        peer_value: 10.0,
        ratio: flush_rate / 10e6,
        bytes: 0,
        route: route.clone(),
        device: device.clone(),
        reps: opts.reps,
        rows: None,
    }];
    let mut targets = vec![Target {
        description: format!(
            "GPU-submitted commands >= 10 M/s with <= {grid} SMs (software controller)"
        ),
        measured: Some(format!("{:.2} M commands/s", flush_rate / 1e6)),
        met: Some(flush_rate >= 10e6),
    }];

    // 4 KiB reads, checked, against the ring's 4 KiB reads of the same bytes.
    progress("nvme_read_4k");
    let slots = blocks / 8;
    let n = opts.reads;
    let lbas: Vec<u64> = (0..n as u64)
        .map(|i| pattern::mix64(seed ^ i) % slots * 8)
        .collect();
    let lba_buf = upload(&lbas)?;
    let st = gpu.alloc(n * 4)?;
    let nvme_reads = || -> Result<u64> {
        nvme_kernels::io(
            &stream,
            &queues,
            GpuNvmeOp::ReadChecked(seed),
            &ns,
            &lba_buf,
            n,
            8,
            &mapped,
            &st,
            grid,
        )
        .map_err(hal)
    };
    nvme_reads()?;
    let mut bytes_host = HostBuffer::alloc(opts.namespace as usize, &HostAllocOptions::default())?;
    pattern::fill(bytes_host.as_mut_slice(), 0, seed);
    let memory = HostMemory::new(bytes_host);
    let cores = std::thread::available_parallelism().map_or(2, |c| c.get());
    let cfg = RingConfig {
        slots: 4096,
        bounce_bytes: 4096,
        threads: cores.saturating_sub(2).clamp(1, 16),
        wait: WaitPolicy {
            spins: 1 << 18,
            yields: 1 << 10,
            max_sleep: Duration::from_micros(20),
        },
        ..RingConfig::default()
    };
    let proxy_threads = cfg.threads;
    let mut proxy = RingProxy::new(session.engines().clone(), &gpu, cfg).map_err(api)?;
    let handle = proxy.register(Endpoint::host(&memory, 0)).map_err(api)?;
    let dst = gpu.alloc(n * 4096)?;
    proxy.register_device(&dst).map_err(api)?;
    let offsets = upload(&lbas.iter().map(|l| l * 512).collect::<Vec<_>>())?;
    let results = gpu.alloc(n * 8)?;
    let ring_reads = || -> Result<()> {
        Ok(ring_kernels::read_blocks(
            &stream,
            proxy.ring(),
            handle,
            &offsets,
            n,
            4096,
            &dst,
            &results,
            1024,
        )?)
    };
    ring_reads()?;
    let (mut nvme_t, mut ring_t) = (Vec::new(), Vec::new());
    for _ in 0..opts.reps.max(1) {
        let start = Instant::now();
        let bad = nvme_reads()?;
        nvme_t.push(start.elapsed());
        if bad != 0 {
            return Err(BenchError::Options(format!(
                "nvme_read_4k: {bad} words read differ from the namespace"
            )));
        }
        let start = Instant::now();
        ring_reads()?;
        ring_t.push(start.elapsed());
    }
    all_succeeded(&st, n, "nvme_read_4k")?;
    let mut sample = vec![0u8; 4096];
    for k in [0, n / 2, n - 1] {
        stream.download(&dst, k * 4096, &mut sample)?;
        if let Some(off) = pattern::first_deviation(&sample, lbas[k] * 512, seed) {
            return Err(BenchError::Corrupt {
                case: "nvme_read_4k (ring peer)".into(),
                size: 4096,
                offset: off as u64,
            });
        }
    }
    let stats = proxy.shutdown().map_err(api)?;
    let nvme_iops = n as f64 / median(nvme_t).as_secs_f64().max(1e-9);
    let ring_iops = n as f64 / median(ring_t).as_secs_f64().max(1e-9);
    records.push(Record {
        suite: SUITE.into(),
        case: "nvme_read_4k".into(),
        metric: "iops".into(),
        value: nvme_iops / 1e6,
        unit: "M IOPS".into(),
        peer: format!("request ring, 1024 GPU threads, {proxy_threads} proxy threads"),
        peer_value: ring_iops / 1e6,
        ratio: nvme_iops / ring_iops.max(1e-9),
        bytes: 4096,
        route,
        device,
        reps: opts.reps,
        rows: None,
    });
    targets.push(Target {
        description: "GPU-submitted NVMe 4 KiB reads >= 1.2x the request ring's IOPS".into(),
        measured: Some(format!(
            "{:.2} M vs {:.2} M IOPS ({:.2}x)",
            nvme_iops / 1e6,
            ring_iops / 1e6,
            nvme_iops / ring_iops.max(1e-9)
        )),
        met: Some(nvme_iops >= 1.2 * ring_iops),
    });
    let notes = vec![
        format!(
            "nvme: the controller is gpuio's software controller ({} I/O threads, RAM namespace): \
             these are the queue protocol's rates with that controller, not a drive's; {} commands served",
            opts.controller_threads,
            soft.served()
        ),
        format!("ring proxy for the peer reads: {stats:?}"),
    ];
    drop(mapped);
    drop(pairs);
    Ok((records, targets, notes))
}
