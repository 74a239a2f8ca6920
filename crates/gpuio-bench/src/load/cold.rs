//! The load suite's cold part. Cold reads of one file move with the disk's moment as much as
//! the loaders differ, so one cold read per loader would rank the disk's moments: every
//! loader (gpuio also with `direct=True`, O_DIRECT as fastsafetensors reads) and the disk
//! read in rounds, and each figure is a median. Beside them, `cold_spread` sets gpuio's
//! slowest cold load against its fastest; a note gives every rate by round.

use super::{Result, load};
use crate::peers::{self, FioJob};
use std::collections::BTreeMap;
use std::path::Path;

/// The checkpoint the cold part loads.
pub(super) struct Checkpoint<'a> {
    /// Its shape's name (`large`, `small`).
    pub shape: &'a str,
    /// `load_suite.py`'s prefix for it.
    pub prefix: &'a Path,
    /// The safetensors file.
    pub path: &'a Path,
    /// Its data's bytes.
    pub bytes: u64,
}

/// One cold figure of gpuio's against a peer's, in GB/s.
pub(super) struct Figure {
    /// `cold`, `cold_direct` or `cold_spread`.
    pub case: &'static str,
    /// gpuio's figure.
    pub ours: f64,
    /// The peer (a loader, the disk, or gpuio's own fastest load).
    pub peer: String,
    /// The peer's figure.
    pub theirs: f64,
    /// How gpuio loaded.
    pub route: &'static str,
}

/// Loads `file` cold with `loaders` (and gpuio's `direct=True`) in `rounds` rounds beside
/// the disk; gpuio's medians against each peer's (kvikio at its best thread count), the
/// disk's and its own spread.
pub(super) fn figures(
    loaders: &[String],
    file: &Checkpoint<'_>,
    device: &str,
    rounds: usize,
    progress: &mut dyn FnMut(&str),
    notes: &mut Vec<String>,
) -> Result<Vec<Figure>> {
    let mut cold = loaders.to_vec();
    cold.insert(1, "gpuio-direct".into());
    // The disk, O_DIRECT, 16 readers of 4 MiB and of 16 MiB blocks (a disk can serve a
    // deeper queue faster: fastsafetensors reads 16 MiB at a time).
    let disk_jobs = [4usize << 20, 16 << 20].map(|bs| FioJob {
        path: file.path,
        size: file.bytes,
        rw: "read",
        bs,
        iodepth: 2,
        numjobs: 16,
        direct: true,
        end_fsync: false,
        runtime_s: None,
    });
    let Cold { times, disk } =
        cold_rounds(&cold, file, device, &disk_jobs, rounds, progress, notes)?;
    let gbps = |s: f64| file.bytes as f64 / s / 1e9;
    let by_round: Vec<String> = times
        .iter()
        .map(|(l, t)| {
            let rates: Vec<String> = t.iter().map(|&s| format!("{:.2}", gbps(s))).collect();
            format!("{l} {}", rates.join(" "))
        })
        .collect();
    notes.push(format!(
        "{} cold, GB/s by round: {}",
        file.shape,
        by_round.join("; ")
    ));
    let mut out = Vec::new();
    let Some(gpuio) = times.get("gpuio") else {
        return Ok(out);
    };
    let kvikio = times
        .iter()
        .filter(|(l, _)| l.starts_with("kvikio-"))
        .map(|(l, t)| (l, median(t)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let peers = times
        .iter()
        .filter(|(l, _)| !l.starts_with("kvikio-") && !l.starts_with("gpuio"))
        .map(|(l, t)| (l, median(t)))
        .chain(kvikio);
    let ours = [
        ("cold", "gpuio", "gpuio.safetensors"),
        ("cold_direct", "gpuio-direct", "direct=True"),
    ];
    for (case, loader, route) in ours {
        let Some(ours) = times.get(loader).map(|t| gbps(median(t))) else {
            continue;
        };
        let mut add = |peer: String, theirs: f64| {
            out.push(Figure {
                case,
                ours,
                peer,
                theirs,
                route,
            });
        };
        for (peer, s) in peers.clone() {
            add(peer.clone(), gbps(s));
        }
        if let Some((rate, how)) = &disk {
            add(format!("the disk ({how})"), *rate);
        }
    }
    // The limit beside any ranking of one cold read each: how far gpuio's own cold loads of
    // this file moved between rounds.
    if gpuio.len() >= 2 {
        let (fast, slow) = gpuio
            .iter()
            .fold((f64::MAX, 0.0f64), |(f, s), &t| (f.min(t), s.max(t)));
        out.push(Figure {
            case: "cold_spread",
            ours: gbps(slow),
            peer: "gpuio's fastest cold load of the same file, this run".into(),
            theirs: gbps(fast),
            route: "gpuio.safetensors",
        });
    }
    Ok(out)
}

/// What the cold rounds measured.
struct Cold {
    /// Each loader's seconds, by round.
    times: BTreeMap<String, Vec<f64>>,
    /// The disk's median rate in GB/s under the job that read it fastest, and that job.
    disk: Option<(f64, String)>,
}

/// Cold loads, in `rounds` rounds: each round loads with every loader once (its pages
/// dropped first) and reads the disk once with each of `disk_jobs` (O_DIRECT), in an order
/// turned by one each round, so that no loader always follows the same one. Cold reads of
/// one file move with the disk's moment as much as loaders differ, so one read each would
/// rank the disk's moments.
fn cold_rounds(
    loaders: &[String],
    file: &Checkpoint<'_>,
    device: &str,
    disk_jobs: &[FioJob<'_>],
    rounds: usize,
    progress: &mut dyn FnMut(&str),
    notes: &mut Vec<String>,
) -> Result<Cold> {
    let (shape, prefix) = (file.shape, file.prefix);
    // Loaders by name, then the disk's jobs by index.
    let mut order: Vec<Result<&str, usize>> = loaders.iter().map(|l| Ok(l.as_str())).collect();
    order.extend((0..disk_jobs.len()).map(Err));
    let mut times = BTreeMap::<String, Vec<f64>>::new();
    let mut disk: Vec<(Vec<f64>, &str)> = vec![(Vec::new(), ""); disk_jobs.len()];
    for round in 0..rounds {
        for who in order
            .iter()
            .cycle()
            .skip(round % order.len())
            .take(order.len())
        {
            match *who {
                Ok(loader) => {
                    progress(&format!("{shape}: {loader} (cold, round {})", round + 1));
                    match load(loader, prefix, device, "cold", 0)? {
                        Ok(l) => times.entry(loader.to_string()).or_default().push(l.first_s),
                        Err(why) => notes.push(format!("{shape} cold: {loader} {why}")),
                    }
                }
                Err(k) => {
                    progress(&format!("{shape}: the disk (cold, round {})", round + 1));
                    match peers::storage(&disk_jobs[k], 1) {
                        Ok((d, tool)) => {
                            disk[k].0.push(d.bytes_per_s / 1e9);
                            disk[k].1 = tool;
                        }
                        Err(why) => notes.push(format!("{shape} cold: the disk: {why}")),
                    }
                }
            }
        }
    }
    let disk = disk
        .iter()
        .zip(disk_jobs)
        .filter(|((rates, _), _)| !rates.is_empty())
        .map(|((rates, tool), job)| {
            let how = format!("{tool} O_DIRECT {} MiB x {}", job.bs >> 20, job.numjobs);
            let each: Vec<String> = rates.iter().map(|r| format!("{r:.2}")).collect();
            notes.push(format!(
                "{shape} cold, the disk ({how}), GB/s by round: {}",
                each.join(" ")
            ));
            (median(rates), how)
        })
        .max_by(|a, b| a.0.total_cmp(&b.0));
    Ok(Cold { times, disk })
}

/// The median of `v` (the mean of the middle two where their count is even; NaN, which no
/// record takes, where `v` is empty).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
