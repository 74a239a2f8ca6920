//! The `python` suite: what gpuio's Python binding costs over the Rust call it wraps, and a
//! file read into a torch CUDA tensor against the ways Python users do it today.
//!
//! - `py_read_4k`: 4 KiB reads at scattered offsets of a page-cached file, one at a time, into
//!   a gpuio host buffer: `session.read(f, buf, offset=o)` in Python against
//!   `Session::transfer_owned` of the same endpoints in Rust; the difference of the p50s is
//!   the binding's overhead per call (target ≤ 2 µs). Into a `bytearray` (copied over) for
//!   reference.
//! - `py_ai_kv_load`, `py_ai_swap_in_load`, `py_ai_engram_lookup`: `gpuio.ai`'s calls against
//!   the gpuio-ai calls they wrap (`python/ai.rs`); `py_ai_b1_step`: B1's decode step from both;
//!   `py_ai_b2_step_N`: B2's step of N tokens (one lookup of two tables with hot tiers), from
//!   both.
//! - `py_lmcache_file`, `py_lmcache_pinned` (where LMCache is installed: it needs torch and
//!   CUDA): gpuio's LMCache connector against LMCache's filesystem L2 adapter and its CPU
//!   backend, store and retrieve GB/s and per-chunk p50 (`python/lmcache.rs`).
//! - `py_load_cuda` (CUDA and torch only): a 1 GiB page-cached file into a torch CUDA tensor
//!   through gpuio against torch's way (read the bytes, `torch.frombuffer(..).cuda()`) and
//!   kvikio where it is installed.
//!
//! The Python side runs the installed `gpuio` package (`pip install crates/gpuio-py`) with the
//! Python of `GPUIO_PYTHON`; without it, the suite says why and measures nothing.

mod ai;
mod lmcache;

use crate::localio::make_file;
use crate::peers;
use crate::{Record, Result, Target, fresh_seed};
use gpuio_api::{Endpoint, FileHandle, HostPlacement, OpenOptions, Session};
use gpuio_hal::Backend;
use std::path::PathBuf;
use std::time::Instant;

/// The suite's name.
pub const SUITE: &str = "python";

/// Sizes of the suite.
#[derive(Debug, Clone)]
pub struct Options {
    /// Calls timed one at a time.
    pub calls: usize,
    /// The load case's file size.
    pub load_bytes: u64,
    /// Timed loads per side.
    pub reps: usize,
    /// KV chunks (32 MiB each) per LMCache store.
    pub lmcache_chunks: usize,
    /// Directory for the files.
    pub scratch: PathBuf,
}

impl Options {
    /// The full measurement for `backend`.
    pub fn for_backend(backend: Backend) -> Self {
        Self {
            calls: 50_000,
            load_bytes: if backend == Backend::Cuda {
                1 << 30
            } else {
                64 << 20
            },
            reps: 5,
            lmcache_chunks: 32,
            scratch: std::env::temp_dir(),
        }
    }

    /// A short run.
    pub fn quick(mut self) -> Self {
        self.calls = 5_000;
        self.reps = 2;
        self.lmcache_chunks = 16;
        self
    }
}

const SMALL: usize = 4096;
const FILE: u64 = 64 << 20;

fn record(case: &str, metric: &str, value: f64, unit: &str, peer: &str, peer_value: f64) -> Record {
    let rate = metric == "bandwidth";
    Record {
        bytes: SMALL,
        ..Record::versus(SUITE, (case, metric, unit), value, peer, peer_value, rate)
    }
}

/// The Rust call the binding wraps: p50 ns of a 4 KiB read of `file` at scattered offsets.
fn rust_p50_ns(session: &Session, file: &FileHandle, calls: usize) -> Result<f64> {
    let mem = session.alloc_host(HostPlacement::Dram { numa: None }, SMALL, true)?;
    let dst = Endpoint::host(&mem, 0);
    let pages = FILE / SMALL as u64;
    let offset = |i: usize| (i as u64 * 7919 % pages) * SMALL as u64;
    for i in 0..calls.min(2000) {
        session.transfer_owned(&Endpoint::file(file, offset(i)), &dst, SMALL)?;
    }
    let mut lat = Vec::with_capacity(calls);
    for i in 0..calls {
        let t = Instant::now();
        session.transfer_owned(&Endpoint::file(file, offset(i)), &dst, SMALL)?;
        lat.push(t.elapsed().as_nanos() as f64);
    }
    lat.sort_by(f64::total_cmp);
    Ok(lat[lat.len() / 2])
}

/// Runs the suite; returns the records, the targets, and notes.
pub fn run(
    session: &Session,
    opts: &Options,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let (mut records, mut targets, mut notes) = (Vec::new(), Vec::new(), Vec::new());
    let seed = fresh_seed();
    let path = opts
        .scratch
        .join(format!("gpuio-python-{}.bin", std::process::id()));
    let _cleanup = crate::localio::Cleanup(vec![path.clone()]);
    make_file(&path, FILE, seed)?;
    let file = session.open_file(&path, OpenOptions::READ)?;

    progress("py_read_4k");
    let rust = rust_p50_ns(session, &file, opts.calls)?;
    let args = [path.display().to_string(), opts.calls.to_string()];
    match peers::python_binding("overhead", &args) {
        Ok(py) => {
            let host = py["host_p50_ns"].as_f64().unwrap_or(f64::NAN);
            let copied = py["bytearray_p50_ns"].as_f64().unwrap_or(f64::NAN);
            let over = (host - rust) / 1e3;
            records.push(record(
                "py_read_4k",
                "p50",
                host / 1e3,
                "us",
                "Rust call",
                rust / 1e3,
            ));
            records.push(record(
                "py_read_4k_bytearray",
                "p50",
                copied / 1e3,
                "us",
                "Rust call",
                rust / 1e3,
            ));
            targets.push(Target {
                description: "Python binding overhead per 4 KiB read, p50 <= 2 us over Rust".into(),
                measured: Some(format!("{over:.2} us")),
                met: Some(over <= 2.0),
            });
        }
        Err(why) => notes.push(format!("py_read_4k: {why}")),
    }
    drop(file);

    progress("py_ai");
    match ai::cases(session, opts.calls)? {
        Ok((r, t)) => {
            records.extend(r);
            targets.extend(t);
        }
        Err(why) => notes.push(format!("py_ai: {why}")),
    }

    progress("py_lmcache");
    let dir = opts
        .scratch
        .join(format!("gpuio-lmcache-{}", std::process::id()));
    match peers::lmcache(&dir, opts.lmcache_chunks, opts.reps.min(3)) {
        Ok(py) => {
            let (r, t) = lmcache::records(&py, &mut notes)?;
            records.extend(r);
            targets.extend(t);
        }
        Err(why) => notes.push(format!("py_lmcache: {why}")),
    }
    let _ = std::fs::remove_dir_all(&dir);

    let backend = session.gpu(0)?.backend();
    if backend != Backend::Cuda {
        notes.push("py_load_cuda: needs CUDA and torch (this run is on the host backend)".into());
        return Ok((records, targets, notes));
    }
    progress("py_load_cuda");
    let load = opts
        .scratch
        .join(format!("gpuio-python-load-{}.bin", std::process::id()));
    let _cleanup_load = crate::localio::Cleanup(vec![load.clone()]);
    make_file(&load, opts.load_bytes, seed ^ 1)?;
    let args = [load.display().to_string(), opts.reps.to_string()];
    match peers::python_binding("load", &args) {
        Ok(py) => {
            if py["gpuio_correct"].as_bool() != Some(true) {
                return Err(crate::BenchError::Options(
                    "py_load_cuda: gpuio's tensor differs from torch's".into(),
                ));
            }
            let gb = |k: &str| py[k].as_f64().map(|b| b / 1e9);
            let ours = gb("gpuio_bps").unwrap_or(0.0);
            let mut r = record(
                "py_load_cuda",
                "bandwidth",
                ours,
                "GB/s",
                "torch read + .cuda()",
                0.0,
            );
            r.peer_value = gb("torch_bps").unwrap_or(0.0);
            r.ratio = ours / r.peer_value.max(1e-9);
            r.bytes = opts.load_bytes as usize;
            records.push(r.clone());
            match gb("kvikio_bps") {
                Some(k) if py["kvikio_correct"].as_bool() == Some(true) => {
                    records.push(Record {
                        peer: "kvikio".into(),
                        peer_value: k,
                        ratio: ours / k.max(1e-9),
                        ..r
                    });
                }
                Some(_) => notes.push("py_load_cuda: kvikio's tensor differs from torch's".into()),
                None => notes.push(format!(
                    "py_load_cuda: kvikio absent ({})",
                    py["kvikio_absent"].as_str().unwrap_or("not importable")
                )),
            }
        }
        Err(why) => notes.push(format!("py_load_cuda: {why}")),
    }
    Ok((records, targets, notes))
}
