//! External peers, run as the user would run them: fio (the storage limit: same file, block
//! size and depth) and kvikio (Python, file → GPU). Each says why it could not run instead of
//! being faked.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What a peer measured.
#[derive(Debug, Clone, Copy)]
pub struct PeerResult {
    /// Bytes per second.
    pub bytes_per_s: f64,
    /// Operations per second.
    pub iops: f64,
}

/// Where to find fio: `$GPUIO_FIO`, else `fio` on the PATH.
pub fn fio_binary() -> Result<PathBuf, String> {
    let bin = std::env::var_os("GPUIO_FIO").map_or_else(|| PathBuf::from("fio"), PathBuf::from);
    match Command::new(&bin).arg("--version").output() {
        Ok(o) if o.status.success() => Ok(bin),
        Ok(_) => Err(format!("{} --version failed", bin.display())),
        Err(e) => Err(format!(
            "fio not found ({}: {e}); install fio or set GPUIO_FIO",
            bin.display()
        )),
    }
}

/// An fio job over `path` (io_uring engine), e.g. `rw=read bs=4M iodepth=32 direct=1`.
#[derive(Debug, Clone)]
pub struct FioJob<'a> {
    /// The file.
    pub path: &'a Path,
    /// Bytes to move (per job).
    pub size: u64,
    /// `read`, `write`, `randread`.
    pub rw: &'a str,
    /// Block size in bytes.
    pub bs: usize,
    /// Queue depth per job.
    pub iodepth: usize,
    /// Jobs (threads), each over its own share of the file.
    pub numjobs: usize,
    /// O_DIRECT.
    pub direct: bool,
    /// fsync at the end of a write job.
    pub end_fsync: bool,
    /// For random jobs: run for this long instead of a size.
    pub runtime_s: Option<u32>,
}

/// Runs an fio job `reps` times (as gpuio's side is timed: a median) and returns the median
/// aggregate throughput.
pub fn fio(job: &FioJob<'_>, reps: usize) -> Result<PeerResult, String> {
    let mut runs = (0..reps.max(1))
        .map(|_| fio_once(job))
        .collect::<Result<Vec<_>, _>>()?;
    runs.sort_by(|a, b| a.bytes_per_s.total_cmp(&b.bytes_per_s));
    Ok(runs[runs.len() / 2])
}

fn fio_once(job: &FioJob<'_>) -> Result<PeerResult, String> {
    let bin = fio_binary()?;
    let mut cmd = Command::new(bin);
    cmd.arg("--output-format=json")
        .arg("--name=gpuio-peer")
        .arg(format!("--filename={}", job.path.display()))
        .arg("--ioengine=io_uring")
        .arg("--fixedbufs=1")
        .arg("--registerfiles=1")
        .arg("--thread")
        .arg("--group_reporting")
        .arg(format!("--rw={}", job.rw))
        .arg(format!("--bs={}", job.bs))
        .arg(format!("--iodepth={}", job.iodepth))
        .arg(format!("--numjobs={}", job.numjobs))
        .arg(format!("--direct={}", job.direct as u8))
        .arg(format!("--end_fsync={}", job.end_fsync as u8))
        // fio drops the file's cached pages before a job by default; a buffered job here
        // measures the page cache as gpuio sees it (warm), a direct one the device.
        .arg(format!("--invalidate={}", job.direct as u8))
        .arg("--randrepeat=0");
    if job.numjobs > 1 {
        // Each job reads its own slice of the file, as gpuio's lanes share one transfer.
        cmd.arg(format!("--size={}", job.size / job.numjobs as u64))
            .arg(format!(
                "--offset_increment={}",
                job.size / job.numjobs as u64
            ));
    } else {
        cmd.arg(format!("--size={}", job.size));
    }
    if let Some(t) = job.runtime_s {
        cmd.arg(format!("--runtime={t}")).arg("--time_based");
    }
    let out = cmd.output().map_err(|e| format!("running fio: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ));
    }
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("fio output is not JSON: {e}"))?;
    let dir = if job.rw.contains("write") {
        "write"
    } else {
        "read"
    };
    let j = &json["jobs"][0][dir];
    let bw = j["bw_bytes"].as_f64().ok_or("fio JSON lacks bw_bytes")?;
    Ok(PeerResult {
        bytes_per_s: bw,
        iops: j["iops"].as_f64().unwrap_or(0.0),
    })
}

/// The storage limit where fio is absent: `job`'s sequential read or write by `numjobs`
/// parallel `dd` processes, each over its own share of the file in `bs` blocks (O_DIRECT and
/// a closing `fdatasync` as the job says); the median of `reps` runs' aggregate rate.
pub fn dd(job: &FioJob<'_>, reps: usize) -> Result<PeerResult, String> {
    let jobs = job.numjobs.max(1) as u64;
    let blocks = job.size / job.bs as u64 / jobs;
    if blocks == 0 || job.rw.starts_with("rand") {
        return Err(format!("dd: no sequential job of {} bytes", job.size));
    }
    let write = job.rw == "write";
    let mut rates = Vec::new();
    for _ in 0..reps.max(1) {
        let start = std::time::Instant::now();
        let children = (0..jobs)
            .map(|j| {
                let mut cmd = Command::new("dd");
                cmd.arg(format!("bs={}", job.bs))
                    .arg(format!("count={blocks}"))
                    .arg("status=none");
                if write {
                    let mut conv = "conv=notrunc".to_string();
                    if job.end_fsync {
                        conv += ",fdatasync";
                    }
                    cmd.arg("if=/dev/zero")
                        .arg(format!("of={}", job.path.display()))
                        .arg(format!("seek={}", j * blocks))
                        .arg(conv);
                    if job.direct {
                        cmd.arg("oflag=direct");
                    }
                } else {
                    cmd.arg(format!("if={}", job.path.display()))
                        .arg("of=/dev/null")
                        .arg(format!("skip={}", j * blocks));
                    if job.direct {
                        cmd.arg("iflag=direct");
                    }
                }
                cmd.spawn().map_err(|e| format!("running dd: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        for mut c in children {
            let status = c.wait().map_err(|e| format!("waiting for dd: {e}"))?;
            if !status.success() {
                return Err(format!("dd failed: {status}"));
            }
        }
        let bytes = (blocks * jobs * job.bs as u64) as f64;
        rates.push(bytes / start.elapsed().as_secs_f64().max(1e-9));
    }
    rates.sort_by(f64::total_cmp);
    Ok(PeerResult {
        bytes_per_s: rates[rates.len() / 2],
        iops: 0.0,
    })
}

/// fio where it is installed, else [`dd`]; with the tool's name, or why neither could run.
pub fn storage(job: &FioJob<'_>, reps: usize) -> Result<(PeerResult, &'static str), String> {
    match fio(job, reps) {
        Ok(r) => Ok((r, "fio")),
        Err(no_fio) => dd(job, reps)
            .map(|r| (r, "dd"))
            .map_err(|e| format!("{no_fio}; {e}")),
    }
}

const KVIKIO_SCRIPT: &str = include_str!("../peers/kvikio_peer.py");

/// What kvikio should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvikioMode {
    /// Read the whole file into GPU memory, page cache warm.
    Warm,
    /// The same with the file's pages dropped before each read.
    Cold,
    /// Random 4 KiB reads into GPU memory through `pread` futures.
    Random4k,
}

/// Runs kvikio (Python) on `path` with `threads` threads; errors say why it could not run.
pub fn kvikio(
    path: &Path,
    size: u64,
    threads: usize,
    mode: KvikioMode,
    reps: usize,
) -> Result<PeerResult, String> {
    let mode = match mode {
        KvikioMode::Warm => "warm",
        KvikioMode::Cold => "cold",
        KvikioMode::Random4k => "rand4k",
    };
    let out = python_peer("kvikio", KVIKIO_SCRIPT, |cmd| {
        cmd.arg(path)
            .arg(size.to_string())
            .arg(mode)
            .arg(reps.to_string())
            .env("KVIKIO_NTHREADS", threads.to_string())
            // kvikio's own POSIX path, its best without nvidia-fs (the reference
            // figures); cuFile's compat mode is measured as a peer of its own.
            .env("KVIKIO_COMPAT_MODE", "ON");
    })?;
    let json = out.last().ok_or("kvikio printed no result")?;
    Ok(PeerResult {
        bytes_per_s: json["bytes_per_s"].as_f64().unwrap_or(0.0),
        iops: json["iops"].as_f64().unwrap_or(0.0),
    })
}

/// How long one Python peer may run: a hung peer (a loader that deadlocks, a device that
/// stops answering) is killed, not waited for, so a suite ends within a device call.
const PEER_LIMIT: std::time::Duration = std::time::Duration::from_secs(540);

/// Runs `script` with the Python of `GPUIO_PYTHON` (else `python3`), its arguments and
/// environment set by `args`; returns the JSON objects it printed, one per line, or why it
/// could not run (`<what> unavailable:` and its last error line; one that outlives
/// [`PEER_LIMIT`] is killed).
pub(crate) fn python_peer(
    what: &str,
    script: &str,
    args: impl FnOnce(&mut Command),
) -> Result<Vec<serde_json::Value>, String> {
    let python = std::env::var("GPUIO_PYTHON").unwrap_or_else(|_| "python3".into());
    // Run from a file, not `-c`: Triton compiles only functions it can find the source of.
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let base = std::env::temp_dir().join(format!("gpuio-peer-{}-{n}", std::process::id()));
    let [file, out, err] = ["py", "out", "err"].map(|e| base.with_extension(e));
    let ran = run_python(&python, script, &file, &out, &err, args);
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let (text, errors) = (read(&out), read(&err));
    for f in [&file, &out, &err] {
        let _ = std::fs::remove_file(f);
    }
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with('{')).collect();
    let succeeded = ran.map_err(|why| format!("{what} unavailable: {why}"))?;
    if !succeeded || lines.is_empty() {
        return Err(format!(
            "{what} unavailable: {}",
            errors.lines().last().unwrap_or("no output").trim()
        ));
    }
    lines
        .iter()
        .map(|l| serde_json::from_str(l).map_err(|e| format!("{what} output: {e}")))
        .collect()
}

/// Runs `script` (written to `file`) with its output in `out` and `err`; whether it
/// succeeded, or why it could not run or was killed.
fn run_python(
    python: &str,
    script: &str,
    file: &Path,
    out: &Path,
    err: &Path,
    args: impl FnOnce(&mut Command),
) -> Result<bool, String> {
    let create = |p: &Path| std::fs::File::create(p).map_err(|e| format!("{}: {e}", p.display()));
    std::fs::write(file, script).map_err(|e| format!("{}: {e}", file.display()))?;
    let mut cmd = Command::new(python);
    cmd.arg(file).stdout(create(out)?).stderr(create(err)?);
    args(&mut cmd);
    let mut child = cmd.spawn().map_err(|e| format!("running {python}: {e}"))?;
    let started = std::time::Instant::now();
    loop {
        match child.try_wait().map_err(|e| e.to_string())? {
            Some(status) => return Ok(status.success()),
            None if started.elapsed() > PEER_LIMIT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("killed after {} s", PEER_LIMIT.as_secs()));
            }
            None => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
}

const TORCH_LOAD_SCRIPT: &str = include_str!("../peers/torch_load_peer.py");

/// Runs the torch model-load peer (each file read whole, then `.cuda()`) over `paths`, `mode`
/// "cold" (pages dropped before each load) or "warm"; errors say why it could not run.
pub fn torch_load(paths: &[PathBuf], mode: &str, reps: usize) -> Result<PeerResult, String> {
    let out = python_peer("torch", TORCH_LOAD_SCRIPT, |cmd| {
        cmd.arg(mode).arg(reps.to_string()).args(paths);
    })?;
    let json = out.last().ok_or("torch printed no result")?;
    Ok(PeerResult {
        bytes_per_s: json["bytes_per_s"].as_f64().unwrap_or(0.0),
        iops: 0.0,
    })
}

const TORCH_GATHER_SCRIPT: &str = include_str!("../peers/torch_gather_peer.py");

/// What the torch gather peer measured for one row size and index list.
#[derive(Debug, Clone, Copy)]
pub struct TorchGather {
    /// Row size in bytes.
    pub row: usize,
    /// Whether it gathered the distinct-rows list (else the uniform one).
    pub distinct: bool,
    /// Gather plus copy to the GPU, bytes of rows per second (median).
    pub bytes_per_s: f64,
    /// For the latency line: median seconds per call.
    pub latency_s: Option<f64>,
}

/// Runs the CPU gather peer (`torch.index_select` on a pinned pool of `pool_bytes`, then a copy
/// to the GPU) for each row size in `rows` on gpuio's own index lists, read from `lists`
/// (`<row>-uniform.u64`, `<row>-distinct.u64`), and the latency of `latency.0` rows of
/// `latency.1` bytes if the count is non-zero. Errors say why it could not run.
pub fn torch_gather(
    pool_bytes: usize,
    rows: &[usize],
    lists: &Path,
    reps: usize,
    latency: (usize, usize),
) -> Result<Vec<TorchGather>, String> {
    let list = rows
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out = python_peer("torch", TORCH_GATHER_SCRIPT, |cmd| {
        cmd.args([pool_bytes.to_string(), list])
            .arg(lists)
            .args([reps, latency.0, latency.1].map(|n| n.to_string()));
    })?;
    Ok(out
        .iter()
        .map(|j| TorchGather {
            row: j["row"].as_u64().unwrap_or(0) as usize,
            distinct: j["list"].as_str() == Some("distinct"),
            bytes_per_s: j["bytes_per_s"].as_f64().unwrap_or(0.0),
            latency_s: j["latency_p50_s"].as_f64(),
        })
        .collect())
}

const PYTHON_SUITE_SCRIPT: &str = include_str!("../peers/python_suite.py");

/// Runs gpuio's Python binding through `python_suite.py` in `mode` with `args`; returns the
/// JSON object it printed, or why it could not run (the package not importable, no torch).
pub fn python_binding(mode: &str, args: &[String]) -> Result<serde_json::Value, String> {
    let out = python_peer("gpuio's Python binding", PYTHON_SUITE_SCRIPT, |cmd| {
        cmd.arg(mode).args(args);
    })?;
    out.into_iter()
        .last()
        .ok_or_else(|| "the Python binding printed no result".into())
}

const LMCACHE_SCRIPT: &str = include_str!("../peers/lmcache_peer.py");

/// LMCache's own stores against gpuio's connector on the same KV chunks (`lmcache_peer.py`):
/// its JSON, or why LMCache could not run here.
pub fn lmcache(scratch: &Path, chunks: usize, reps: usize) -> Result<serde_json::Value, String> {
    let out = python_peer("LMCache", LMCACHE_SCRIPT, |cmd| {
        cmd.arg(scratch)
            .arg(chunks.to_string())
            .arg(reps.to_string());
    })?;
    out.into_iter()
        .last()
        .ok_or_else(|| "LMCache printed no result".into())
}

const DSA_SCRIPT: &str = include_str!("../peers/dsa_peer.py");

/// One peer's figures for one trace of a race (DSA decode, Engram lookups).
#[derive(Debug, Clone)]
pub struct PeerTiming {
    /// Which of the traces given.
    pub trace: usize,
    /// The peer, e.g. `torch index_select` or `triton UVA`.
    pub mode: String,
    /// Its time per step (a layer's loads, a batch's lookups), median, µs.
    pub p50_us: f64,
    /// The 99th percentile.
    pub p99_us: f64,
    /// Wall-clock time per step, median, µs, where the peer reports it apart (B1: its p50/p99
    /// are then device time).
    pub wall_p50_us: Option<f64>,
}

/// Runs the DSA decode peers (`dsa_peer.py`) over `traces` (one file per overlap: `steps`
/// steps after `warmup`, each `batch` selections of `topk` u64 positions) with the same
/// hot-buffer scheme, and why any peer could not run; errors say why none could.
pub fn dsa(
    ctx: u64,
    batch: usize,
    topk: usize,
    hot_slots: usize,
    warmup: usize,
    steps: usize,
    traces: &[&Path],
) -> Result<(Vec<PeerTiming>, Vec<String>), String> {
    let out = python_peer("the DSA peers", DSA_SCRIPT, |cmd| {
        cmd.args([ctx as usize, batch, topk, hot_slots, warmup, steps].map(|n| n.to_string()))
            .args(traces);
    })?;
    Ok(timings(&out))
}

const ENGRAM_SCRIPT: &str = include_str!("../peers/engram_peer.py");

/// Runs the Engram lookup peers (`engram_peer.py`: a Triton gather over unified addressing,
/// and a CPU gather plus one copy) on two tables of `rows` rows of `row_bytes`, over `traces`
/// (one file per batch size: `warmup + steps` steps of two tables' ids), and why any peer
/// could not run; errors say why none could.
pub fn engram(
    rows: u64,
    row_bytes: usize,
    warmup: usize,
    steps: usize,
    traces: &[&Path],
) -> Result<(Vec<PeerTiming>, Vec<String>), String> {
    let out = python_peer("the Engram peers", ENGRAM_SCRIPT, |cmd| {
        cmd.args([rows as usize, row_bytes, warmup, steps].map(|n| n.to_string()))
            .args(traces);
    })?;
    Ok(timings(&out))
}

/// A peer script's timings, and the reasons it gave for peers that could not run.
fn timings(out: &[serde_json::Value]) -> (Vec<PeerTiming>, Vec<String>) {
    let (errors, results): (Vec<_>, Vec<_>) = out.iter().partition(|j| j["error"].is_string());
    let peers = results
        .iter()
        .map(|j| PeerTiming {
            trace: j["trace"].as_u64().unwrap_or(0) as usize,
            mode: j["mode"].as_str().unwrap_or("peer").to_string(),
            p50_us: j["p50_us"].as_f64().unwrap_or(0.0),
            p99_us: j["p99_us"].as_f64().unwrap_or(0.0),
            wall_p50_us: j["wall_p50_us"].as_f64(),
        })
        .collect();
    let errors = errors
        .iter()
        .filter_map(|j| j["error"].as_str().map(String::from))
        .collect();
    (peers, errors)
}

const GRAPH_SCRIPT: &str = include_str!("../peers/graph_peer.py");

/// Runs the graph gather peer (`graph_peer.py`: NumPy neighbour sampling, a CPU gather from a
/// pinned tensor or a memory map of the embeddings file, one copy) over the same graph files,
/// seeds and embeddings: its timings by mode (`host memory`, `file`).
pub fn graph(
    offsets: &Path,
    neighbors: &Path,
    seeds: &Path,
    embeddings: &Path,
    row_bytes: usize,
    opts: &crate::ai::GraphOptions,
) -> Result<Vec<PeerTiming>, String> {
    let out = python_peer("the graph peer", GRAPH_SCRIPT, |cmd| {
        cmd.args([offsets, neighbors, seeds, embeddings]).args(
            [row_bytes, opts.seeds, opts.fanout, opts.warmup, opts.steps].map(|n| n.to_string()),
        );
    })?;
    let (found, errors) = timings(&out);
    if found.is_empty() {
        return Err(errors.join("; "));
    }
    Ok(found)
}
