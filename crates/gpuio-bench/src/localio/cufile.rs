//! The `cufile` part: cuFile programs, unchanged, on gpuio's `libcufile.so.0` (gpuio-cufile)
//! against the same programs on NVIDIA's, each in fresh processes on the suite's test file
//! (`peers/cufile_suite.py`): kvikio at each thread count (warm: a process's first read; hot:
//! the steady state of a loop reading the file back to back, and `hot_first`, its first three
//! reads; cold; 4 KiB random reads), and torch.cuda.gds against `torch.load` + `.cuda()`. The
//! disk's own rate (O_DIRECT `dd`, 16 streams) and the bus's (a pinned 1 GiB copy to the GPU)
//! are measured in the same run, the limits beside the cold and hot cases.
//! Every byte is checked by the suite; a wrong byte through gpuio's library fails the part.
//!
//! Where NVIDIA's cuFile cannot register files (no nvidia-fs), kvikio's default (`AUTO`) falls
//! back to its own POSIX path: that is the peer, what kvikio users get there.

use crate::peers;
use crate::{BenchError, Record, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

const SCRIPT: &str = include_str!("../../peers/cufile_suite.py");
const SUITE: &str = super::SUITE;
const PEER: &str = "kvikio on NVIDIA's libcufile (its POSIX path)";

/// Where gpuio's `libcufile.so.0` is: `GPUIO_CUFILE_LIB_DIR`, else `lib/` beside the
/// executable's `bin/` (the GPU bundle's layout).
pub fn library_dir() -> Option<PathBuf> {
    let named = std::env::var_os("GPUIO_CUFILE_LIB_DIR").map(PathBuf::from);
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.parent()?.join("lib")));
    named
        .into_iter()
        .chain(beside)
        .find(|d| d.join("libcufile.so.0").exists())
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v[key].as_f64().filter(|x| x.is_finite() && *x > 0.0)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// Runs the part on `path` (`size` bytes).
pub fn run(
    path: &Path,
    size: u64,
    device: &str,
    notes: &mut Vec<String>,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Record>> {
    let Some(lib) = library_dir() else {
        notes.push(
            "cufile: no gpuio libcufile.so.0 (set GPUIO_CUFILE_LIB_DIR, or run from the GPU \
             bundle)"
                .into(),
        );
        return Ok(Vec::new());
    };
    progress("cufile: kvikio and torch.cuda.gds on both libraries");
    let rows = match peers::python_peer("the cuFile suite", SCRIPT, |cmd| {
        cmd.arg(path).arg(&lib).args(["--threads", "8,16,32"]);
    }) {
        Ok(rows) => rows,
        Err(why) => {
            notes.push(format!("cufile: {why}"));
            return Ok(Vec::new());
        }
    };
    let bad: Vec<&Value> = rows
        .iter()
        .filter(|r| r["lib"] == "gpuio")
        .filter(|r| r["ok"] == false || r["failed"].is_string() || r["failed"].is_number())
        .collect();
    let gds_wrong = rows.iter().find(|r| {
        r["suite"] == "torch.gds"
            && r["lib"] == "gpuio"
            && (r["works"] != true
                || ["warm_ok", "hot_ok", "save_load_ok"]
                    .iter()
                    .any(|k| r[*k] != true))
    });
    if let Some(r) = bad.first().copied().or(gds_wrong) {
        return Err(BenchError::Options(format!(
            "cufile: a program on gpuio's library failed or read wrong bytes: {r}"
        )));
    }
    let pick = |suite: &str, lib: &str| -> Vec<&Value> {
        rows.iter()
            .filter(|r| r["suite"] == suite && r["lib"] == lib)
            .collect()
    };
    let record =
        |case: String, metric: &str, unit: &str, ours, peer: &str, theirs, higher| Record {
            bytes: size as usize,
            route: "cuFile API".into(),
            device: device.to_string(),
            reps: 1,
            ..Record::versus(SUITE, (&case, metric, unit), ours, peer, theirs, higher)
        };
    let mut records = Vec::new();
    for threads in [8, 16, 32] {
        for case in ["warm", "hot_first", "hot", "cold"] {
            let rate = |lib: &str| {
                median(
                    pick("kvikio", lib)
                        .into_iter()
                        .filter(|r| r["threads"] == threads && r["case"] == case)
                        .filter_map(|r| num(r, "gbps"))
                        .collect(),
                )
            };
            if let (Some(ours), Some(theirs)) = (rate("gpuio"), rate("nvidia")) {
                records.push(record(
                    format!("cufile_kvikio_{case}/{threads}threads"),
                    "bandwidth",
                    "GB/s",
                    ours,
                    PEER,
                    theirs,
                    true,
                ));
            }
        }
        let latency = |lib: &str| {
            pick("kvikio-4k", lib)
                .into_iter()
                .find(|r| r["threads"] == threads)
                .and_then(|r| Some((num(r, "us")?, num(r, "h2d_copy_floor_us")?)))
        };
        if let (Some((ours, floor)), Some((theirs, _))) = (latency("gpuio"), latency("nvidia")) {
            records.push(record(
                format!("cufile_kvikio_4k_random/{threads}threads"),
                "latency",
                "us",
                ours,
                PEER,
                theirs,
                false,
            ));
            notes.push(format!(
                "cufile 4 KiB reads ({threads} threads): {ours:.1} us through gpuio, {theirs:.1} \
                 us through the peer; one synchronous 4 KiB pinned copy alone takes {floor:.1} us"
            ));
        }
    }
    let disk = rows
        .iter()
        .find(|r| r["suite"] == "disk")
        .and_then(|r| num(r, "gbps"));
    if let Some(disk) = disk {
        for threads in [8, 16, 32] {
            let cold = pick("kvikio", "gpuio")
                .into_iter()
                .find(|r| r["threads"] == threads && r["case"] == "cold")
                .and_then(|r| num(r, "gbps"));
            if let Some(ours) = cold {
                records.push(record(
                    format!("cufile_kvikio_cold_vs_disk/{threads}threads"),
                    "bandwidth",
                    "GB/s",
                    ours,
                    "O_DIRECT dd x16 (the disk)",
                    disk,
                    true,
                ));
            }
        }
    }
    let bus = rows
        .iter()
        .find(|r| r["suite"] == "bus")
        .and_then(|r| num(r, "gbps"));
    if let Some(bus) = bus {
        // The limit beside the hot case: no read of a hot file beats one pinned copy.
        let hot: Vec<(String, f64, f64)> = (records.iter())
            .filter(|r| r.case.starts_with("cufile_kvikio_hot/"))
            .map(|r| (r.case.replace("hot/", "hot_vs_bus/"), r.value, r.peer_value))
            .collect();
        for (case, ours, theirs) in hot {
            notes.push(format!(
                "{case}: 1.2x the peer would be {:.1} GB/s; the bus moves {bus:.1}",
                1.2 * theirs
            ));
            let bus_peer = "pinned 1 GiB copy to the GPU (the bus)";
            records.push(record(case, "bandwidth", "GB/s", ours, bus_peer, bus, true));
        }
    }
    let torch_load = median(
        rows.iter()
            .filter(|r| r["suite"] == "torch.load")
            .filter_map(|r| num(r, "gbps"))
            .collect(),
    );
    for gds in pick("torch.gds", "gpuio") {
        for case in ["warm", "hot"] {
            if let (Some(ours), Some(theirs)) = (num(gds, case), torch_load) {
                records.push(record(
                    format!("cufile_torch_gds_{case}"),
                    "bandwidth",
                    "GB/s",
                    ours,
                    "torch.load(mmap) + .cuda()",
                    theirs,
                    true,
                ));
            }
        }
    }
    for r in pick("torch.gds", "nvidia") {
        if r["works"] == false {
            notes.push(format!(
                "cufile: torch.cuda.gds on NVIDIA's libcufile fails here: {}",
                r["error"].as_str().unwrap_or("?")
            ));
        }
    }
    if let Some(r) = pick("kvikio", "nvidia-cufile-forced").first() {
        notes.push(format!(
            "cufile: kvikio with cuFile forced (KVIKIO_COMPAT_MODE=OFF) on NVIDIA's library: {}",
            r["stderr"]
                .as_str()
                .and_then(|e| e.lines().last())
                .unwrap_or("ran")
        ));
    }
    Ok(records)
}
