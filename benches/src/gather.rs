//! The `gather` suite: rows picked at random from a pinned host pool into GPU memory.
//!
//! A grid of row sizes × pool sizes. In each cell, the same fresh random index list (1 M rows or
//! 256 MiB of rows, whichever is fewer) goes through gpuio's `gather` (strategy `Auto`, as a
//! user calls it, with the list in host memory and with it in device memory), through each of
//! its paths forced (host list), and through the two baselines of the issue: a naive
//! warp-per-row zero-copy kernel (indices already on the device) and a CPU gather
//! (`torch.index_select` on a pinned pool, all cores, then one copy; run as a Python peer
//! right after ours on a pool of the same size). The target per cell: gpuio ≥ min(1.5 × the
//! better baseline, 0.9 × pinned `cudaMemcpy` bandwidth measured in the same run), gpuio given
//! its index list where that baseline has it (the kernel's on the device, torch's on the
//! host); the notes also count the cells where the host-list call alone meets it. Every
//! result is checked against a CPU gather of the same rows.
//! Also the latency of one DSA decode layer's gather: 2048 rows of 656 B from the 2 GiB pool.

use crate::peers::{TorchGather, torch_gather};
use crate::{BenchError, Budget, Record, Result, Target, fresh_seed, race};
use gpuio_api::Session;
use gpuio_hal::{DeviceBuffer, HostAllocOptions, HostBuffer, RowKernel, pattern};
use gpuio_transport_memio::{
    GatherIndices, GatherOptions, GatherStrategy, IndexPlace, MemIo, MemIoConfig,
};
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// The suite's name.
pub const SUITE: &str = "gather";

/// Sizes of the grid.
#[derive(Debug, Clone)]
pub struct Options {
    /// Row sizes in bytes.
    pub rows: Vec<usize>,
    /// Host pool sizes in bytes.
    pub pools: Vec<usize>,
    /// Most rows per gather.
    pub max_rows: usize,
    /// Most bytes per gather.
    pub max_bytes: usize,
    /// Calls timed for the latency case.
    pub latency_calls: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            rows: vec![64, 160, 656, 4096],
            pools: vec![256 << 20, 2 << 30, 16 << 30],
            max_rows: 1 << 20,
            max_bytes: 256 << 20,
            latency_calls: 200,
        }
    }
}

impl Options {
    /// A short run (CI, smoke runs, the host backend).
    pub fn quick() -> Self {
        Self {
            pools: vec![64 << 20, 256 << 20],
            max_rows: 1 << 16,
            max_bytes: 16 << 20,
            latency_calls: 50,
            ..Self::default()
        }
    }
}

const LATENCY_ROWS: usize = 2048;
const LATENCY_ROW: usize = 656;

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}

/// Allocates, fills (in parallel) and pins a pool.
fn make_pool(session: &Session, len: usize, seed: u64) -> Result<HostBuffer> {
    let gpu = &session.gpus()[0];
    let opts = HostAllocOptions {
        numa: gpu.info().numa_node,
        huge_pages: true,
        ..HostAllocOptions::default()
    };
    let mut pool = HostBuffer::alloc(len, &opts)?;
    const PIECE: usize = 64 << 20;
    pool.par_chunks_mut(PIECE)
        .enumerate()
        .for_each(|(i, c)| pattern::fill(c, (i * PIECE) as u64, seed));
    pool.pin(gpu)?;
    Ok(pool)
}

fn indices(n: usize, rows: usize, seed: u64) -> Vec<u64> {
    (0..n)
        .into_par_iter()
        .map(|i| pattern::mix64(seed ^ (i as u64).wrapping_mul(0x9e37_79b9)) % rows as u64)
        .collect()
}

/// Checks `dst` against a CPU gather of the same rows.
fn check(
    io: &MemIo,
    pool: &HostBuffer,
    rb: usize,
    idx: &[u64],
    dst: &DeviceBuffer,
    case: &str,
) -> Result<()> {
    let mut got = vec![0u8; idx.len() * rb];
    io.download(dst, 0, &mut got)
        .map_err(gpuio_api::Error::from)?;
    let bad = got
        .par_chunks(rb)
        .zip(idx.par_iter())
        .position_first(|(row, &r)| row != &pool[r as usize * rb..(r as usize + 1) * rb]);
    match bad {
        None => Ok(()),
        Some(i) => Err(BenchError::Corrupt {
            case: case.into(),
            size: rb,
            offset: (i * rb) as u64,
        }),
    }
}

fn record(case: &str, rb: usize, value: f64, peer: &str, peer_value: f64, reps: usize) -> Record {
    Record {
        suite: SUITE.into(),
        case: case.into(),
        metric: "throughput".into(),
        value,
        unit: "GB/s".into(),
        peer: peer.into(),
        peer_value,
        ratio: value / peer_value.max(1e-9),
        bytes: rb,
        route: String::new(),
        device: String::new(),
        reps,
    }
}

/// Runs the suite; returns the records, the targets, and notes.
pub fn run(
    session: &Session,
    opts: &Options,
    budget: &Budget,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let gpu = session.gpus()[0].clone();
    let device = gpu.to_string();
    // An engine of its own, with every core for the CPU path (the session's may have fewer).
    let io =
        MemIo::new(vec![gpu.clone()], MemIoConfig::default()).map_err(gpuio_api::Error::from)?;
    let stream = gpu.stream()?;
    let (mut records, mut targets, mut notes) = (Vec::new(), Vec::new(), Vec::new());

    // The bandwidth ceiling: pinned cudaMemcpy of 256 MiB (the largest gather's output).
    progress("cudaMemcpy ceiling");
    let ceiling_len = opts.max_bytes;
    let mut staging = HostBuffer::alloc(ceiling_len, &HostAllocOptions::default())?;
    staging.pin(&gpu)?;
    let ceiling_dst = gpu.alloc(ceiling_len)?;
    let (t, _) = race(
        budget,
        |_| Ok(gpu.baseline_upload(&staging, &ceiling_dst, 0)?),
        |_| Ok(()),
    )?;
    let memcpy = gbps(ceiling_len, t.median);
    drop((staging, ceiling_dst));
    notes.push(format!("pinned cudaMemcpy H2D ceiling: {memcpy:.1} GB/s"));

    let seed = fresh_seed();
    // Per cell: whether Auto with a host list alone meets the target.
    let mut strict: Vec<(String, bool)> = Vec::new();
    for &pool_len in &opts.pools {
        progress(&format!("pool {} MiB: fill and pin", pool_len >> 20));
        let pool = make_pool(session, pool_len, seed ^ pool_len as u64)?;
        // (row size, Auto with a host list, Auto with a device list, the naive kernel)
        let mut ours: Vec<(usize, f64, f64, f64)> = Vec::new();
        for &rb in &opts.rows {
            let case = format!("gather_{rb}B_pool{}M", pool_len >> 20);
            progress(&case);
            let rows = pool_len / rb;
            let n = opts.max_rows.min(opts.max_bytes / rb);
            let idx = indices(n, rows, seed ^ rb as u64 ^ pool_len as u64);
            let bytes: Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
            let dev_idx = gpu.alloc(bytes.len())?;
            stream.upload(&bytes, &dev_idx, 0)?;
            let dst = gpu.alloc(n * rb)?;
            let out = n * rb;
            let with = |strategy| GatherOptions {
                strategy,
                ..GatherOptions::default()
            };
            let report = |strategy| {
                io.gather(&pool, rb, &idx, &dst, 0, &with(strategy))
                    .map_err(|e| BenchError::Gpuio(e.into()))
            };
            let gather = |strategy| report(strategy).map(|_| ());
            // Auto measures each path in its first calls (a warm-up and a measured call each)
            // and balances the hybrid's share over a few more: give it those before timing (a
            // user's steady state is what counts).
            for _ in 0..20 {
                gather(GatherStrategy::Auto)?;
            }
            // The naive peer; Auto's timed calls alternate with it.
            let naive_kernel =
                || stream.gather(&pool, rb, (&dev_idx).into(), n, &dst, 0, RowKernel::Naive);
            // Which path Auto's timed calls took.
            let paths = [
                GatherStrategy::ZeroCopy,
                GatherStrategy::Sorted,
                GatherStrategy::CpuStaged,
                GatherStrategy::Hybrid,
            ];
            let mut auto_paths = [0usize; 4];
            let (auto, naive) = race(
                budget,
                |_| {
                    let r = report(GatherStrategy::Auto)?;
                    if let Some(i) = paths.iter().position(|s| *s == r.strategy) {
                        auto_paths[i] += 1;
                    }
                    Ok(())
                },
                |_| Ok(naive_kernel()?),
            )?;
            check(&io, &pool, rb, &idx, &dst, &case)?;
            // The same list already in device memory, where the naive kernel has it (and a
            // top-k kernel would leave it): Auto learns this shape on its own.
            let on_device = GatherIndices::Device {
                list: &dev_idx,
                count: n,
            };
            let device_call = || {
                io.gather(&pool, rb, on_device, &dst, 0, &with(GatherStrategy::Auto))
                    .map_err(|e| BenchError::Gpuio(e.into()))
            };
            for _ in 0..20 {
                device_call()?;
            }
            let mut device_paths = [0usize; 4];
            let (auto_device, _) = race(
                budget,
                |_| {
                    let r = device_call()?;
                    if let Some(i) = paths.iter().position(|s| *s == r.strategy) {
                        device_paths[i] += 1;
                    }
                    Ok(())
                },
                |_| Ok(naive_kernel()?),
            )?;
            check(&io, &pool, rb, &idx, &dst, &case)?;
            // Each path forced, back to back (alternating with another path would charge each
            // for the state the other leaves: busy cores, a cold device).
            let forced = |strategy| -> Result<crate::Timing> {
                let (t, _) = race(budget, |_| gather(strategy), |_| Ok(()))?;
                check(&io, &pool, rb, &idx, &dst, &case)?;
                Ok(t)
            };
            let zero = forced(GatherStrategy::ZeroCopy)?;
            let sorted = forced(GatherStrategy::Sorted)?;
            let staged = forced(GatherStrategy::CpuStaged)?;
            let hybrid = forced(GatherStrategy::Hybrid)?;
            // The same, each call right after the naive kernel's (as Auto's calls run): what
            // a call pays for the idle CPU and the GPU state a long peer call leaves.
            let (hybrid_after, _) = race(
                budget,
                |_| gather(GatherStrategy::Hybrid),
                |_| Ok(naive_kernel()?),
            )?;
            check(&io, &pool, rb, &idx, &dst, &case)?;
            // The kernels alone, with the index list already on the device.
            let kernel_alone =
                |kernel| stream.gather(&pool, rb, (&dev_idx).into(), n, &dst, 0, kernel);
            let (tuned, tuned_sorted) = race(
                budget,
                |_| Ok(kernel_alone(RowKernel::Tuned)?),
                |_| Ok(kernel_alone(RowKernel::Sorted)?),
            )?;
            check(&io, &pool, rb, &idx, &dst, &case)?;
            let g = |t: crate::Timing| gbps(out, t.median);
            let plan = io.gather_plan(&pool, &gpu, rb, n, IndexPlace::Host);
            notes.push(format!(
                "{case}: auto {:.1} (calls by zero-copy / sorted / CPU-staged / hybrid: {:?}), \
                 auto with the list on the device {:.1} ({:?}), \
                 zero-copy {:.1} (kernel alone, device indices {:.1}), sorted {:.1} (kernel \
                 alone {:.1}), CPU-staged {:.1}, hybrid {:.1} (GPU share {:.2}; {:.1} \
                 alternating with the naive kernel), naive kernel {:.1} GB/s",
                g(auto),
                auto_paths,
                g(auto_device),
                device_paths,
                g(zero),
                g(tuned),
                g(sorted),
                g(tuned_sorted),
                g(staged),
                g(hybrid),
                plan.map_or(0.0, |p| p.gpu_share),
                g(hybrid_after),
                g(naive)
            ));
            let mut r = record(
                &case,
                rb,
                g(auto),
                "naive warp-per-row kernel",
                g(naive),
                auto.reps,
            );
            r.device = device.clone();
            let forced = [g(zero), g(sorted), g(staged), g(hybrid)];
            r.route = format!("{:?}", fastest(&paths, &forced));
            records.push(r);
            let mut r = record(
                &format!("{case} device list"),
                rb,
                g(auto_device),
                "naive warp-per-row kernel",
                g(naive),
                auto_device.reps,
            );
            r.device = device.clone();
            // The path Auto took most.
            let most = (0..paths.len()).max_by_key(|&i| device_paths[i]);
            r.route = most.map_or(String::new(), |i| format!("{:?}", paths[i]));
            records.push(r);
            ours.push((rb, g(auto), g(auto_device), g(naive)));
        }

        // The latency case runs on the 2 GiB pool (or the largest one below it).
        let latency_here = pool_len == latency_pool(opts);
        let mut latency_ours = None;
        if latency_here {
            progress("decode layer latency");
            let rows = pool_len / LATENCY_ROW;
            let idx = indices(LATENCY_ROWS, rows, seed ^ 0x1a7);
            let dst = gpu.alloc(LATENCY_ROWS * LATENCY_ROW)?;
            let opts_auto = GatherOptions::default();
            for _ in 0..16 {
                io.gather(&pool, LATENCY_ROW, &idx, &dst, 0, &opts_auto)
                    .map_err(|e| BenchError::Gpuio(e.into()))?;
            }
            let mut times: Vec<Duration> = (0..opts.latency_calls)
                .map(|_| {
                    let t = Instant::now();
                    io.gather(&pool, LATENCY_ROW, &idx, &dst, 0, &opts_auto)
                        .map(|_| t.elapsed())
                        .map_err(|e| BenchError::Gpuio(e.into()))
                })
                .collect::<Result<_>>()?;
            times.sort();
            check(&io, &pool, LATENCY_ROW, &idx, &dst, "decode layer latency")?;
            latency_ours = Some(times[times.len() / 2]);
        }
        drop(pool);

        // The CPU peer on a pool of the same size, right after ours.
        progress(&format!("torch peer, pool {} MiB", pool_len >> 20));
        let lat_rows = if latency_here { LATENCY_ROWS } else { 0 };
        let mut peer_rows = opts.rows.clone();
        if latency_here {
            // The latency line uses the first row size: put 656 B first.
            peer_rows.retain(|&r| r != LATENCY_ROW);
            peer_rows.insert(0, LATENCY_ROW);
        }
        let reps = budget.min_reps.max(3);
        let torch: std::result::Result<Vec<TorchGather>, String> = torch_gather(
            pool_len,
            &peer_rows,
            opts.max_bytes,
            opts.max_rows,
            reps,
            lat_rows,
        );
        let torch = match torch {
            Ok(t) => t,
            Err(why) => {
                notes.push(format!("CPU gather peer not run: {why}"));
                Vec::new()
            }
        };
        for (rb, auto, auto_device, naive) in ours {
            let case = format!("gather_{rb}B_pool{}M", pool_len >> 20);
            let cpu = torch
                .iter()
                .find(|t| t.row == rb && t.latency_s.is_none())
                .map(|t| t.bytes_per_s / 1e9);
            if let Some(cpu) = cpu {
                let mut r = record(&case, rb, auto, "torch.index_select + copy", cpu, 0);
                r.device = device.clone();
                records.push(r);
            }
            let better = naive.max(cpu.unwrap_or(0.0));
            let goal = (1.5 * better).min(0.9 * memcpy);
            // gpuio with its list where the better baseline has its own.
            let (ours, list) = if naive >= cpu.unwrap_or(0.0) {
                (auto_device, "device")
            } else {
                (auto, "host")
            };
            targets.push(Target {
                description: format!(
                    "{case} ({list} list): >= min(1.5 x better baseline, 0.9 x cudaMemcpy) = \
                     {goal:.1} GB/s{}",
                    if cpu.is_none() {
                        " (torch peer absent)"
                    } else {
                        ""
                    }
                ),
                measured: Some(format!("{ours:.1} GB/s")),
                met: cpu.map(|_| ours >= goal),
            });
            if cpu.is_some() {
                strict.push((case, auto >= goal));
            }
        }
        if let Some(t) = latency_ours {
            let peer = torch.iter().find_map(|t| t.latency_s);
            let us = t.as_secs_f64() * 1e6;
            let mut r = Record {
                suite: SUITE.into(),
                case: "decode_layer_2048x656B".into(),
                metric: "latency p50".into(),
                value: us,
                unit: "us".into(),
                peer: "torch.index_select + copy".into(),
                peer_value: peer.map_or(0.0, |p| p * 1e6),
                ratio: peer.map_or(0.0, |p| p * 1e6 / us.max(1e-9)),
                bytes: LATENCY_ROW,
                route: String::new(),
                device: device.clone(),
                reps: opts.latency_calls,
            };
            if peer.is_none() {
                r.peer = "torch peer absent".into();
            }
            records.push(r);
        }
    }
    if !strict.is_empty() {
        let missed: Vec<&str> = strict
            .iter()
            .filter(|(_, met)| !met)
            .map(|(c, _)| c.as_str())
            .collect();
        notes.push(format!(
            "with a host list in every cell, against the better baseline: met in {} of {}{}",
            strict.len() - missed.len(),
            strict.len(),
            if missed.is_empty() {
                String::new()
            } else {
                format!(" (missed: {})", missed.join(", "))
            }
        ));
    }
    Ok((records, targets, notes))
}

/// Which forced path measured fastest (what `Auto` should settle on).
fn fastest(paths: &[GatherStrategy], rates: &[f64]) -> GatherStrategy {
    paths
        .iter()
        .zip(rates)
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(GatherStrategy::Auto, |(p, _)| *p)
}

/// The pool the latency case uses: 2 GiB, or the largest below it.
fn latency_pool(opts: &Options) -> usize {
    opts.pools
        .iter()
        .copied()
        .filter(|&p| p <= 2 << 30)
        .max()
        .or_else(|| opts.pools.first().copied())
        .unwrap_or(0)
}
