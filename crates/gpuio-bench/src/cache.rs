//! The cache suite: random reads of a hot working set through a file opened with
//! `Session::open_cached`, the cache built from the session's `[cache]` configuration (so it
//! measures the cache a user configured), into host memory and into GPU memory. Peers, on the
//! same file and offsets in the same run: the reads without the cache, `pread` from the warm
//! page cache (plus one `cudaMemcpy` per read for GPU memory), which is what a program does
//! without gpuio's cache, and for host memory also `pread` through O_DIRECT, what the reads
//! cost where the page cache does not hold the working set. The working set is three quarters
//! of the cache's capacity (capped), so once warm it is all in the cache; each record's route
//! gives the levels' hit rates over its case. With `--metrics-addr`, `gpuio stat` shows the
//! same hit rates while it runs.

use crate::localio::{api, make_file};
use crate::{Budget, Record, Result, Target, human, race};
use gpuio_api::{Access, CacheStats, CachedFile, Session, Uri};
use gpuio_hal::pattern;
use std::path::PathBuf;

/// The suite's name in records and file names.
pub const SUITE: &str = "cache";

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Directory for the test file.
    pub scratch: PathBuf,
    /// Bytes per read.
    pub read_size: usize,
    /// Reads per timed repetition.
    pub reads: usize,
    /// Largest working set (the test file's size), whatever the cache's capacity.
    pub max_working_set: u64,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            scratch: std::env::temp_dir(),
            read_size: 4096,
            reads: 16_384,
            max_working_set: 1 << 30,
        }
    }
}

impl Options {
    /// A short run (CI, smoke runs).
    pub fn quick() -> Self {
        Self {
            reads: 2048,
            max_working_set: 16 << 20,
            ..Self::default()
        }
    }
}

/// Removes the test file when the suite ends, however it ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Hit rates of the levels over the lookups between `before` and `after`, e.g.
/// `cache l2 99.8% hits`.
fn hit_rates(before: &CacheStats, after: &CacheStats) -> String {
    let rates: Vec<String> = after
        .levels
        .iter()
        .map(|l| {
            let b = before.level(l.level);
            let hits = l.hits - b.map_or(0, |b| b.hits);
            let misses = l.misses - b.map_or(0, |b| b.misses);
            let pct = 100.0 * hits as f64 / (hits + misses).max(1) as f64;
            format!("{} {pct:.1}%", l.level.label())
        })
        .collect();
    format!("cache {} hits", rates.join(", "))
}

/// Runs the suite on GPU 0; `progress` hears about each case as it starts.
pub fn run(
    session: &Session,
    opts: &Options,
    budget: &Budget,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let gpu = session.gpu(0)?.clone();
    let rs = opts.read_size;
    let c = &session.config().cache;
    // The capacity of the configured levels, from a cache over an empty file.
    let capacity = {
        let probe = Scratch(
            opts.scratch
                .join(format!(".gpuio-bench-cache-probe-{}", std::process::id())),
        );
        std::fs::write(&probe.0, b"").map_err(|e| crate::BenchError::Output {
            path: probe.0.display().to_string(),
            message: e.to_string(),
        })?;
        let f = open(session, &probe.0)?;
        let blocks: usize = f.stats().levels.iter().map(|l| l.capacity).sum();
        blocks as u64 * f.block_size() as u64
    };
    let ws = (capacity / 4 * 3).min(opts.max_working_set) / rs as u64 * rs as u64;
    if ws < rs as u64 {
        return Err(crate::BenchError::Options(format!(
            "the cache holds {} bytes: no room for a working set of {} reads",
            capacity,
            human(rs)
        )));
    }
    let seed = crate::fresh_seed();
    let path = opts
        .scratch
        .join(format!("gpuio-bench-cache-{}", std::process::id()));
    let _file_guard = Scratch(path.clone());
    make_file(&path, ws, seed)?;
    let cached = open(session, &path)?;
    let plain = cached.file().clone();
    let mut notes = vec![format!(
        "[cache] block {}, L1 {}, L2 {}, L3 {} ({}), {:?}, prefetch {}; working set {} ({} \
         of the cache's {})",
        c.block_size,
        c.l1_size,
        c.l2_size,
        c.l3_size,
        if c.l3_dir.is_empty() {
            "no l3_dir"
        } else {
            &c.l3_dir
        },
        c.write_policy,
        if c.prefetch { "on" } else { "off" },
        human(ws as usize),
        "3/4",
        human(capacity as usize),
    )];
    let slots = ws / rs as u64;
    let offsets: Vec<u64> = (0..opts.reads)
        .map(|i| pattern::mix64(seed ^ (i as u64 + 1)) % slots * rs as u64)
        .collect();
    // Warm both: every block into the cache, every page into the page cache.
    let mut buf = vec![0u8; rs];
    for k in 0..slots {
        cached.read(k * rs as u64, &mut buf).map_err(api)?;
        plain.read_exact_at(k * rs as u64, &mut buf).map_err(api)?;
    }
    let mut records = Vec::new();
    let device = gpu.to_string();
    let mut record =
        |case: &str, (ours, reps): (f64, usize), peer: &str, theirs: f64, route: String| {
            records.push(Record {
                suite: SUITE.into(),
                case: format!("{case}/{}", human(ws as usize)),
                metric: "reads/s".into(),
                value: ours,
                unit: "M reads/s".into(),
                peer: peer.into(),
                peer_value: theirs,
                ratio: ours / theirs.max(1e-12),
                bytes: rs,
                route,
                device: device.clone(),
                reps,
                rows: None,
            });
        };
    let rate = |t: std::time::Duration| opts.reads as f64 / t.as_secs_f64().max(1e-9) / 1e6;

    // 1. Random reads into host memory.
    let case = format!("hot_read_{}", human(rs).replace(' ', ""));
    progress(&case);
    // The cache's reads raced against the same reads from `peer`, recorded under `name`.
    let mut race_reads = |peer: &gpuio_api::FileHandle, name: &str| -> Result<()> {
        let before = cached.stats();
        let (ours, theirs) = race(
            budget,
            |_| {
                for &off in &offsets {
                    cached.read(off, &mut buf).map_err(api)?;
                }
                Ok(())
            },
            |_| {
                let mut b = vec![0u8; rs];
                for &off in &offsets {
                    peer.read_exact_at(off, &mut b).map_err(api)?;
                }
                Ok(())
            },
        )?;
        record(
            &case,
            (rate(ours.median), ours.reps),
            name,
            rate(theirs.median),
            hit_rates(&before, &cached.stats()),
        );
        Ok(())
    };
    race_reads(&plain, "pread (page cache warm)")?;
    // The same reads from the device (O_DIRECT: what a working set the page cache does not
    // hold costs), where the file system allows it.
    match gpuio_api::FileHandle::open(&path, gpuio_api::OpenOptions::READ.direct()) {
        Ok(direct) => race_reads(&direct, "O_DIRECT pread (from the device)")?,
        Err(e) => notes.push(format!("O_DIRECT peer: {e}")),
    }
    for &off in offsets.iter().step_by(97) {
        cached.read(off, &mut buf).map_err(api)?;
        crate::check_pattern(&case, &buf, off, seed)?;
    }

    // 2. Random reads into GPU memory, each to its own place in a device buffer.
    let case = format!("hot_read_{}_to_gpu", human(rs).replace(' ', ""));
    progress(&case);
    let span = opts.reads.min(4096);
    let dev = gpu.alloc(span * rs)?;
    let before = cached.stats();
    let (ours, theirs) = race(
        budget,
        |_| {
            for (k, &off) in offsets.iter().enumerate() {
                cached
                    .read_to_device(off, &dev, k % span * rs, rs)
                    .map_err(api)?;
            }
            Ok(())
        },
        |_| {
            let mut b = vec![0u8; rs];
            for (k, &off) in offsets.iter().enumerate() {
                plain.read_exact_at(off, &mut b).map_err(api)?;
                gpu.baseline_upload(&b, &dev, k % span * rs)?;
            }
            Ok(())
        },
    )?;
    for k in (0..span.min(offsets.len())).step_by(97) {
        cached
            .read_to_device(offsets[k], &dev, k * rs, rs)
            .map_err(api)?;
        session.download(&dev, k * rs, &mut buf)?;
        crate::check_pattern(&case, &buf, offsets[k], seed)?;
    }
    record(
        &case,
        (rate(ours.median), ours.reps),
        "pread + cudaMemcpy per read",
        rate(theirs.median),
        hit_rates(&before, &cached.stats()),
    );
    cached.close().map_err(api)?;
    Ok((records, Vec::new(), notes))
}

fn open(session: &Session, path: &std::path::Path) -> Result<CachedFile> {
    let uri = Uri::File {
        path: path.to_path_buf(),
        direct: false,
        gds: None,
    };
    session.open_cached(&uri, Access::Read).map_err(api)
}
