//! The `gather` suite: rows picked at random from a pinned host pool into GPU memory.
//!
//! A grid of row sizes × pool sizes. In each cell, the same fresh random index list (1 M rows or
//! 256 MiB of rows, whichever is fewer) goes through gpuio's `gather` (strategy `Auto`, as a
//! user calls it, with the list in host memory and with it in device memory), through each of
//! its paths forced (host list), and through the two baselines of the issue: a naive
//! warp-per-row zero-copy kernel (indices already on the device) and a CPU gather
//! (`torch.index_select` on a pinned pool, all cores, then one copy; run as a Python peer
//! right after ours on a pool of the same size, on the same lists). The target per cell: gpuio
//! ≥ min(1.5 × the better baseline, 0.9 × pinned `cudaMemcpy` bandwidth measured in the same
//! run), gpuio given its index list where that baseline has it (the kernel's on the device,
//! torch's on the host); the notes also count the cells where the host-list call alone meets
//! it. Every result is checked against a CPU gather of the same rows.
//!
//! That list is drawn uniformly with replacement, so some rows repeat and a repeat may come
//! from a cache rather than across the link: every record carries the bytes a call delivers
//! (rows × row size) and the unique bytes among them (distinct rows × row size). Each cell
//! also races `Auto` (both list places) against the same peers on a list of distinct rows (a
//! random permutation's prefix), where delivered and unique bytes are equal; those cases are
//! recorded but not judged.
//!
//! Also the latency of one DSA decode layer's gather: 2048 rows of 656 B from the 2 GiB pool;
//! and small calls' cost beyond the device's time (`gather/small.rs`).

mod cell;
mod lists;
mod small;

pub(crate) use lists::GridCase;

use self::cell::{AutoRun, Cell, List, gbps, most_taken};
use self::lists::ListDir;
use crate::peers::torch_gather;
use crate::{BenchError, Budget, Record, Result, RowBytes, Target, Timing, fresh_seed, race};
use gpuio_api::Session;
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_memio::{GatherOptions, MemIo, MemIoConfig};
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
    /// Run the grid (and the decode layer's latency).
    pub grid: bool,
    /// Run the small calls (`gather/small.rs`).
    pub small: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            rows: vec![64, 160, 656, 4096],
            pools: vec![256 << 20, 2 << 30, 16 << 30],
            max_rows: 1 << 20,
            max_bytes: 256 << 20,
            latency_calls: 200,
            grid: true,
            small: true,
        }
    }
}

impl Options {
    /// Keeps only `parts` (of `grid` and `small`).
    pub fn keep_parts(&mut self, parts: &[String]) -> Result<()> {
        let known = ["grid", "small"];
        if let Some(p) = parts.iter().find(|p| !known.contains(&p.as_str())) {
            return Err(BenchError::Options(format!(
                "gather part {p:?}: the parts are {}",
                known.join(", ")
            )));
        }
        self.grid = parts.iter().any(|p| p == "grid");
        self.small = parts.iter().any(|p| p == "small");
        Ok(())
    }

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
const NAIVE: &str = "naive warp-per-row kernel";
const TORCH: &str = "torch.index_select + copy";

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

/// One record of the grid: gpuio's figure for `case` against `peer`'s, on a list that moves
/// `rows`.
fn record(case: &GridCase, rows: RowBytes, value: f64, peer: &str, peer_value: f64) -> Record {
    Record {
        suite: SUITE.into(),
        case: case.to_string(),
        metric: "throughput".into(),
        value,
        unit: "GB/s".into(),
        peer: peer.into(),
        peer_value,
        ratio: value / peer_value.max(1e-9),
        bytes: case.row,
        route: String::new(),
        device: String::new(),
        reps: 0,
        rows: Some(rows),
    }
}

/// What one cell measured, kept until its torch peer has run.
struct Measured {
    case: GridCase,
    uniform: AutoRun,
    uniform_bytes: RowBytes,
    distinct: AutoRun,
    distinct_bytes: RowBytes,
}

impl Measured {
    fn rate(&self, distinct: bool, t: impl Fn(&AutoRun) -> Timing) -> f64 {
        let (run, bytes) = if distinct {
            (&self.distinct, self.distinct_bytes)
        } else {
            (&self.uniform, self.uniform_bytes)
        };
        gbps(bytes.delivered_bytes as usize, t(run).median)
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
    if opts.small {
        progress("small calls");
        let (r, t, note) = small::run(session, &io, opts.latency_calls * 10, fresh_seed())?;
        records.extend(r);
        targets.extend(t);
        notes.push(note);
    }
    if !opts.grid {
        return Ok((records, targets, notes));
    }

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
        let list_dir = ListDir::new(pool_len).map_err(|e| BenchError::Output {
            path: std::env::temp_dir().display().to_string(),
            message: e.to_string(),
        })?;
        let mut measured: Vec<Measured> = Vec::new();
        for &rb in &opts.rows {
            let grid = GridCase {
                row: rb,
                pool_mib: pool_len >> 20,
                distinct: false,
                device_list: false,
            };
            let case = grid.cell();
            progress(&case);
            let rows = pool_len / rb;
            let n = opts.max_rows.min(opts.max_bytes / rb);
            let cell_seed = seed ^ rb as u64 ^ pool_len as u64;
            let uniform = List::new(&gpu, &stream, lists::uniform(n, rows, cell_seed), rb)?;
            let distinct_rows = lists::distinct(n, rows, cell_seed.rotate_left(29));
            let distinct = List::new(&gpu, &stream, distinct_rows, rb)?;
            for (list, is_distinct) in [(&uniform, false), (&distinct, true)] {
                list_dir
                    .write(rb, is_distinct, &list.host)
                    .map_err(|e| BenchError::Output {
                        path: list_dir.path().display().to_string(),
                        message: e.to_string(),
                    })?;
            }
            let dst = gpu.alloc(n * rb)?;
            let cell = Cell {
                io: &io,
                gpu: &gpu,
                stream: &stream,
                pool: &pool,
                row: rb,
                dst: &dst,
                budget,
                case: &case,
            };
            let u = cell.race_auto(&uniform)?;
            let (note, fastest) = cell.paths_note(&uniform, &u)?;
            notes.push(note);
            progress(&format!("{case} distinct"));
            let d = cell.race_auto(&distinct)?;
            for (list, run, is_distinct) in [(&uniform, &u, false), (&distinct, &d, true)] {
                let g = |t: Timing| gbps(list.out(), t.median);
                for device_list in [false, true] {
                    let (t, paths) = if device_list {
                        (run.device, &run.device_paths)
                    } else {
                        (run.host, &run.host_paths)
                    };
                    let name = GridCase {
                        distinct: is_distinct,
                        device_list,
                        ..grid
                    };
                    let mut r = record(&name, list.bytes, g(t), NAIVE, g(run.naive));
                    r.reps = t.reps;
                    r.device = device.clone();
                    // The uniform host-list call: the fastest forced path, what Auto should
                    // settle on; the others: the path Auto took most.
                    r.route = if is_distinct || device_list {
                        most_taken(paths)
                    } else {
                        format!("{fastest:?}")
                    };
                    records.push(r);
                }
            }
            let m = Measured {
                case: grid,
                uniform: u,
                uniform_bytes: uniform.bytes,
                distinct: d,
                distinct_bytes: distinct.bytes,
            };
            if let Some(note) = above_ceiling(&m, memcpy) {
                notes.push(note);
            }
            measured.push(m);
        }

        // The latency case runs on the 2 GiB pool (or the largest one below it).
        let latency_here = pool_len == latency_pool(opts);
        let mut latency_ours = None;
        if latency_here {
            progress("decode layer latency");
            let rows = pool_len / LATENCY_ROW;
            let idx = lists::uniform(LATENCY_ROWS, rows, seed ^ 0x1a7);
            let list = List::new(&gpu, &stream, idx, LATENCY_ROW)?;
            let dst = gpu.alloc(LATENCY_ROWS * LATENCY_ROW)?;
            let opts_auto = GatherOptions::default();
            let call = || {
                let t = Instant::now();
                io.gather(&pool, LATENCY_ROW, &list.host, &dst, 0, &opts_auto)
                    .map(|_| t.elapsed())
                    .map_err(|e| BenchError::Gpuio(e.into()))
            };
            for _ in 0..16 {
                call()?;
            }
            let mut times: Vec<Duration> = (0..opts.latency_calls)
                .map(|_| call())
                .collect::<Result<_>>()?;
            times.sort();
            let cell = Cell {
                io: &io,
                gpu: &gpu,
                stream: &stream,
                pool: &pool,
                row: LATENCY_ROW,
                dst: &dst,
                budget,
                case: "decode layer latency",
            };
            cell.check(&list)?;
            latency_ours = Some(times[times.len() / 2]);
        }
        drop(pool);

        // The CPU peer on a pool of the same size, right after ours, on the same lists.
        progress(&format!("torch peer, pool {} MiB", pool_len >> 20));
        let lat_rows = if latency_here { LATENCY_ROWS } else { 0 };
        let reps = budget.min_reps.max(3);
        let torch = torch_gather(
            pool_len,
            &opts.rows,
            list_dir.path(),
            reps,
            (lat_rows, LATENCY_ROW),
        );
        drop(list_dir);
        let torch = match torch {
            Ok(t) => t,
            Err(why) => {
                notes.push(format!("CPU gather peer not run: {why}"));
                Vec::new()
            }
        };
        for m in &measured {
            let torch_rate = |distinct: bool| {
                torch
                    .iter()
                    .find(|t| t.row == m.case.row && t.distinct == distinct)
                    .filter(|t| t.latency_s.is_none())
                    .map(|t| t.bytes_per_s / 1e9)
            };
            for (distinct, bytes) in [(false, m.uniform_bytes), (true, m.distinct_bytes)] {
                if let Some(cpu) = torch_rate(distinct) {
                    let name = GridCase { distinct, ..m.case };
                    let ours = m.rate(distinct, |r| r.host);
                    let mut r = record(&name, bytes, ours, TORCH, cpu);
                    r.device = device.clone();
                    records.push(r);
                }
            }
            let case = m.case.cell();
            let cpu = torch_rate(false);
            let naive = m.rate(false, |r| r.naive);
            let better = naive.max(cpu.unwrap_or(0.0));
            let goal = (1.5 * better).min(0.9 * memcpy);
            // gpuio with its list where the better baseline has its own.
            let (ours, list) = if naive >= cpu.unwrap_or(0.0) {
                (m.rate(false, |r| r.device), "device")
            } else {
                (m.rate(false, |r| r.host), "host")
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
                strict.push((case, m.rate(false, |r| r.host) >= goal));
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
                peer: TORCH.into(),
                peer_value: peer.map_or(0.0, |p| p * 1e6),
                ratio: peer.map_or(0.0, |p| p * 1e6 / us.max(1e-9)),
                bytes: LATENCY_ROW,
                route: String::new(),
                device: device.clone(),
                reps: opts.latency_calls,
                rows: None,
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

/// Where a cell delivered more than `cudaMemcpy` can move, says how much of it was repeats.
fn above_ceiling(m: &Measured, memcpy: f64) -> Option<String> {
    let host = m.rate(false, |r| r.host);
    let device = m.rate(false, |r| r.device);
    let best = host.max(device);
    if best <= memcpy {
        return None;
    }
    let b = m.uniform_bytes;
    let share = b.unique_bytes as f64 / b.delivered_bytes.max(1) as f64;
    Some(format!(
        "{}: {best:.1} GB/s delivered is above the {memcpy:.1} GB/s cudaMemcpy ceiling: {:.0}% \
         of its rows are distinct ({:.1} GB/s of unique rows), a repeat may come from a cache; \
         on distinct rows {:.1} GB/s (host list) and {:.1} (device list)",
        m.case.cell(),
        100.0 * share,
        best * share,
        m.rate(true, |r| r.host),
        m.rate(true, |r| r.device),
    ))
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
