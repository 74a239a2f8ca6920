//! The `load` suite: safetensors checkpoints loaded the way programs load them, each load in a
//! fresh process (`peers/load_suite.py`), gpuio's loader against the loaders people use, in
//! the same run:
//!
//! - checkpoints: `large` (64 BF16 tensors of 64 MiB, 4 GiB) and `small` (4096 tensors of
//!   256 KiB to 2 MiB in F32, BF16 and F16, 3.75 GiB); without a GPU, 16 MiB and 256
//!   tensors of 4 to 32 KiB, loaded into NumPy arrays;
//! - loaders: gpuio.safetensors, safetensors' `load_file` and `safe_open`, fastsafetensors,
//!   kvikio at several thread counts (the best counts), `torch.load` of the same tensors;
//! - temperatures: `first` (a fresh process, page cache warm: wall time from the loader's
//!   import to the last tensor on the device, the figure a program meets), `hot` (the same
//!   process loading again, median), `cold` (pages dropped first; every loader and the disk,
//!   read by `dd` or fio, in rounds: medians, and gpuio's spread between rounds beside them);
//! - two GPUs where the session has them: replicated and tensor-parallel first loads;
//! - `gpuio cp` of the large checkpoint to gpu0 from process start (and of 4 KiB: the cost
//!   before any byte moves, process start and the CUDA context).
//!
//! Every load is checked against checksums of every tensor made when the checkpoint was
//! written (split parts put back together first): a load that differs fails the suite.

use crate::peers;
use crate::{Record, Result, SuiteOutcome, Target};
use gpuio_api::Session;
use gpuio_hal::Backend;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The suite's name.
pub const SUITE: &str = "load";

const SCRIPT: &str = include_str!("../peers/load_suite.py");

mod cold;

/// What the suite runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Checkpoints, of `large` and `small`.
    pub shapes: Vec<String>,
    /// Hot loads after each first one.
    pub reps: usize,
    /// kvikio's thread counts.
    pub kvikio_threads: Vec<usize>,
    /// Temperatures to load at, of `warm` (first and hot loads) and `cold`.
    pub temps: Vec<&'static str>,
    /// Cold loads per loader, in rounds.
    pub cold_rounds: usize,
    /// Directory for the checkpoints.
    pub scratch: PathBuf,
}

impl Options {
    /// The full measurement.
    pub fn standard() -> Self {
        Self {
            shapes: vec!["large".into(), "small".into()],
            reps: 3,
            kvikio_threads: vec![8, 16, 32],
            temps: vec!["warm", "cold"],
            cold_rounds: 3,
            scratch: std::env::temp_dir(),
        }
    }

    /// A short run.
    pub fn quick(mut self) -> Self {
        self.reps = 1;
        self.kvikio_threads.truncate(1);
        self.cold_rounds = 2;
        self
    }

    /// Keeps the parts named in `parts`: checkpoints (`large`, `small`) and temperatures
    /// (`warm`, `cold`); where a kind is not named, all of it.
    pub fn keep_parts(&mut self, parts: &[String]) -> Result<()> {
        const PARTS: [&str; 4] = ["large", "small", "warm", "cold"];
        if let Some(bad) = parts.iter().find(|p| !PARTS.contains(&p.as_str())) {
            return Err(crate::BenchError::Options(format!(
                "--load-parts: no part {bad:?} ({})",
                PARTS.join(", ")
            )));
        }
        let named = |all: &[&str]| all.iter().any(|a| parts.iter().any(|p| p == a));
        if named(&PARTS[..2]) {
            self.shapes.retain(|s| parts.contains(s));
        }
        if named(&PARTS[2..]) {
            self.temps.retain(|t| parts.iter().any(|p| p == t));
        }
        Ok(())
    }
}

/// One child's figures.
#[derive(Debug, Clone)]
struct Load {
    first_s: f64,
    hot_s: Option<f64>,
}

/// Runs `load_suite.py` with `args` and `env`; its last JSON line, or why it could not run.
fn child(args: &[&str], env: &[(&str, String)]) -> std::result::Result<serde_json::Value, String> {
    let out = peers::python_peer("the load suite's child", SCRIPT, |cmd| {
        cmd.args(args).envs(env.iter().map(|(k, v)| (*k, v)));
    })?;
    out.into_iter().last().ok_or_else(|| "no result".into())
}

/// One load by `loader` of the checkpoint at `prefix`: an error where it loaded wrong data
/// (or is gpuio and could not run), the reason where another loader could not run.
fn load(
    loader: &str,
    prefix: &Path,
    devices: &str,
    temp: &str,
    reps: usize,
) -> Result<std::result::Result<Load, String>> {
    let threads = loader.strip_prefix("kvikio-").unwrap_or("0").to_string();
    // kvikio's own POSIX path: its best without nvidia-fs.
    let env = [
        ("KVIKIO_NTHREADS", threads),
        ("KVIKIO_COMPAT_MODE", "ON".to_string()),
    ];
    let prefix = prefix.display().to_string();
    let reps = reps.to_string();
    let failed = |why: String| crate::BenchError::Options(format!("{loader} ({temp}): {why}"));
    let json = match child(&["load", loader, &prefix, devices, temp, &reps], &env) {
        Ok(j) => j,
        // gpuio failing fails the suite; its O_DIRECT reads may be refused by the scratch
        // file system (tmpfs before Linux 6.6), which is a note.
        Err(why) if loader.starts_with("gpuio") && loader != "gpuio-direct" => {
            return Err(failed(why));
        }
        Err(why) => return Ok(Err(why)),
    };
    if json["correct"].as_bool() != Some(true) {
        return Err(failed("tensors that differ from the checkpoint's".into()));
    }
    let mut hot: Vec<f64> = json["hot_s"]
        .as_array()
        .map(|v| v.iter().filter_map(serde_json::Value::as_f64).collect())
        .unwrap_or_default();
    hot.sort_by(f64::total_cmp);
    match json["first_s"].as_f64() {
        Some(first_s) if first_s > 0.0 => Ok(Ok(Load {
            first_s,
            hot_s: hot.get(hot.len() / 2).copied(),
        })),
        _ => Err(failed("no time printed".into())),
    }
}

/// Runs the suite.
pub fn run(
    session: &Session,
    opts: &Options,
    progress: &mut dyn FnMut(&str),
) -> Result<SuiteOutcome> {
    let (mut records, mut notes) = (Vec::new(), Vec::new());
    let gpus = session.gpus();
    let cuda = gpus[0].backend() == Backend::Cuda;
    let (framework, device) = if cuda {
        ("pt", "cuda:0")
    } else {
        ("numpy", "cpu")
    };
    let dir = opts
        .scratch
        .join(format!("gpuio-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| crate::BenchError::Output {
        path: dir.display().to_string(),
        message: e.to_string(),
    })?;
    let _cleanup = RemoveDir(dir.clone());
    let mut loaders = vec!["gpuio".to_string(), "safetensors".to_string()];
    if cuda {
        loaders.extend(["safetensors-open", "fastsafetensors", "torch-load"].map(String::from));
        loaders.extend(opts.kvikio_threads.iter().map(|t| format!("kvikio-{t}")));
    }
    let name = gpus[0].info().name.clone();
    let mut first_rate = BTreeMap::new();
    for shape in &opts.shapes {
        progress(&format!("{shape}: writing"));
        let made = child(&["make", &dir.display().to_string(), shape, framework], &[])
            .map_err(|why| crate::BenchError::Options(format!("making {shape}: {why}")))?;
        let bytes = made["bytes"].as_u64().unwrap_or(0);
        let path = PathBuf::from(made["path"].as_str().unwrap_or_default());
        let prefix = dir.join(shape);
        let gbps = |s: f64| bytes as f64 / s / 1e9;
        // `reps`: loads behind the figure (a first or cold load is one).
        let mut add = |case: &str, ours: f64, peer: &str, theirs: f64, route: &str, reps| {
            if !(ours.is_finite() && theirs.is_finite() && ours > 0.0 && theirs > 0.0) {
                return;
            }
            records.push(Record {
                bytes: bytes as usize,
                route: route.into(),
                device: name.clone(),
                reps,
                ..Record::versus(
                    SUITE,
                    (&format!("{shape}_{case}"), "bandwidth", "GB/s"),
                    ours,
                    peer,
                    theirs,
                    true,
                )
            });
        };
        for &temp in &opts.temps {
            if temp == "cold" {
                let file = cold::Checkpoint {
                    shape,
                    prefix: &prefix,
                    path: &path,
                    bytes,
                };
                let rounds = opts.cold_rounds.max(1);
                for f in cold::figures(&loaders, &file, device, rounds, progress, &mut notes)? {
                    add(f.case, f.ours, &f.peer, f.theirs, f.route, rounds);
                }
                continue;
            }
            let mut got: Vec<(String, Load)> = Vec::new();
            for loader in &loaders {
                progress(&format!("{shape}: {loader} ({temp})"));
                match load(loader, &prefix, device, temp, opts.reps)? {
                    Ok(l) => got.push((loader.clone(), l)),
                    Err(why) => notes.push(format!("{shape} {temp}: {loader} {why}")),
                }
            }
            let Some((_, ours)) = got.iter().find(|(l, _)| l == "gpuio").cloned() else {
                continue;
            };
            // kvikio at its best thread count stands for kvikio.
            let peers: Vec<(String, Load)> = got
                .iter()
                .filter(|(l, _)| l != "gpuio" && !l.starts_with("kvikio-"))
                .cloned()
                .collect();
            let best = |f: fn(&Load) -> Option<f64>| {
                got.iter()
                    .filter(|(l, _)| l.starts_with("kvikio-"))
                    .filter_map(|(l, k)| Some((l.clone(), f(k)?)))
                    .min_by(|a, b| a.1.total_cmp(&b.1))
            };
            let route = "gpuio.safetensors";
            first_rate.insert(shape.clone(), gbps(ours.first_s));
            let hot = opts.reps;
            if let Some((l, s)) = best(|k| Some(k.first_s)) {
                add("first", gbps(ours.first_s), &l, gbps(s), route, 1);
            }
            if let (Some(h), Some((l, s))) = (ours.hot_s, best(|k| k.hot_s)) {
                add("hot", gbps(h), &l, gbps(s), route, hot);
            }
            for (peer, l) in &peers {
                add("first", gbps(ours.first_s), peer, gbps(l.first_s), route, 1);
                if let (Some(h), Some(t)) = (ours.hot_s, l.hot_s) {
                    add("hot", gbps(h), peer, gbps(t), route, hot);
                }
            }
        }
        // Against the one-GPU first load of this run (measured above with the warm part).
        if let (true, Some(&one)) = (gpus.len() >= 2 && cuda, first_rate.get(shape)) {
            // The limit beside them: the same first reads of each GPU's half, side by side,
            // with no views and no copies between the GPUs.
            progress(&format!("{shape}: two GPUs, reads alone"));
            let halves = load("gpuio-halves", &prefix, "cuda:0,cuda:1", "warm", 0)?
                .map_err(crate::BenchError::Options)?;
            for mode in ["replicated", "split"] {
                progress(&format!("{shape}: two GPUs, {mode}"));
                let loader = format!("gpuio-{mode}");
                let l = load(&loader, &prefix, "cuda:0,cuda:1", "warm", 0)?
                    .map_err(crate::BenchError::Options)?;
                let case = format!("2gpu_{mode}");
                add(&case, gbps(l.first_s), "gpuio, one GPU", one, &loader, 1);
                let limit = "the halves' reads alone, two GPUs side by side";
                add(
                    &case,
                    gbps(l.first_s),
                    limit,
                    gbps(halves.first_s),
                    &loader,
                    1,
                );
            }
        }
        if shape == "large" && opts.temps.contains(&"warm") {
            progress("gpuio cp from process start");
            // Warm again: cold loads and the disk's O_DIRECT reads ran since.
            let warmed = std::fs::File::open(&path)
                .and_then(|mut f| std::io::copy(&mut f, &mut std::io::sink()));
            match warmed {
                Ok(_) => cp_first(&path, bytes, &dir, &mut records, &mut notes, &name),
                Err(e) => notes.push(format!("gpuio cp from process start: {e}")),
            }
        }
        for file in [path.clone(), prefix.with_extension("pt")] {
            let _ = std::fs::remove_file(file);
        }
    }
    let targets = if cuda { targets(&records) } else { Vec::new() };
    Ok((records, targets, notes))
}

/// `gpuio cp FILE gpu0` in a fresh process, wall time from its start; and of 4 KiB, what a
/// process pays before any byte moves (its start and the CUDA context).
fn cp_first(
    path: &Path,
    bytes: u64,
    dir: &Path,
    records: &mut Vec<Record>,
    notes: &mut Vec<String>,
    device: &str,
) {
    let small = dir.join("4k.bin");
    let run = |file: &Path| -> std::result::Result<f64, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let t = Instant::now();
        let out = Command::new(exe)
            .args(["cp", "--quiet", "--window", "16GiB"])
            .arg(file)
            .arg("gpu0")
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        Ok(t.elapsed().as_secs_f64())
    };
    let measured = std::fs::write(&small, [7u8; 4096])
        .map_err(|e| e.to_string())
        .and_then(|()| Ok((run(&small)?, run(path)?)));
    match measured {
        Ok((fixed, wall)) => records.push(Record {
            bytes: bytes as usize,
            reps: 1,
            device: device.into(),
            route: "gpuio cp, process start to exit".into(),
            ..Record::versus(
                SUITE,
                ("large_cp_from_process_start", "bandwidth", "GB/s"),
                bytes as f64 / wall / 1e9,
                "less a 4 KiB cp's time (process start, CUDA context)",
                bytes as f64 / (wall - fixed).max(1e-6) / 1e9,
                true,
            )
        }),
        Err(why) => notes.push(format!("gpuio cp from process start: {why}")),
    }
}

/// The targets, judged on `records`.
fn targets(records: &[Record]) -> Vec<Target> {
    let value = |r: &Record| r.value;
    let ratio = |r: &Record| r.ratio;
    let small_vs_large = {
        let rate = |shape: &str| {
            records
                .iter()
                .find(|r| r.case == format!("{shape}_first"))
                .map(|r| r.value)
        };
        match (rate("small"), rate("large")) {
            (Some(s), Some(l)) => Some(s / l),
            _ => None,
        }
    };
    vec![
        Target::judge(
            "fresh process's first warm load of the 4 GiB checkpoint >= 40 GB/s",
            records,
            |r| r.case == "large_first",
            value,
            40.0,
            " GB/s",
        ),
        Target::judge(
            "first warm load >= 5x safetensors' load_file",
            records,
            |r| r.case.ends_with("_first") && r.peer == "safetensors",
            ratio,
            5.0,
            "x",
        ),
        Target::judge(
            "first warm load >= 1.2x kvikio at its best thread count",
            records,
            |r| r.case.ends_with("_first") && r.peer.starts_with("kvikio"),
            ratio,
            1.2,
            "x",
        ),
        Target {
            description: "4096 small tensors >= 0.8x the large-tensor rate (first loads)".into(),
            measured: small_vs_large.map(|x| format!("{x:.2}x")),
            met: small_vs_large.map(|x| x >= 0.8),
        },
        Target::judge(
            "cold >= 0.95x the disk",
            records,
            |r| r.case.ends_with("_cold") && r.peer.starts_with("the disk"),
            ratio,
            0.95,
            "x",
        ),
        Target::judge(
            "cold >= 1x every peer",
            records,
            |r| r.case.ends_with("_cold") && !r.peer.starts_with("the disk"),
            ratio,
            1.0,
            "x",
        ),
        Target::judge(
            "cold, reading past the page cache (direct=True), >= 1x every peer",
            records,
            |r| r.case.ends_with("_cold_direct") && !r.peer.starts_with("the disk"),
            ratio,
            1.0,
            "x",
        ),
        Target::judge(
            "two GPUs, replicated and tensor-parallel, >= 1.8x one GPU's rate",
            records,
            |r| r.case.contains("_2gpu_") && r.peer == "gpuio, one GPU",
            ratio,
            1.8,
            "x",
        ),
        Target::judge(
            "gpuio cp of 4 GiB to gpu0 >= 30 GB/s from process start",
            records,
            |r| r.case == "large_cp_from_process_start",
            value,
            30.0,
            " GB/s",
        ),
    ]
}

/// Removes the suite's folder, however it ends.
struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
