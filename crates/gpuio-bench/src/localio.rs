//! The LocalIO suite, in three parts (`--localio-parts`):
//! - `device`: a file to GPU memory (page cache warm; cold through O_DIRECT), GPU memory to a
//!   file with `fdatasync`, and random 4 KiB reads gathered into GPU memory. Peers, each in
//!   the same run on the same file: fio (io_uring engine, same block size and depth: the
//!   storage limit), kvikio (same thread count), cuFile as kvikio drives it (4 MiB calls on the
//!   same threads; compat mode where nvidia-fs is absent) and a naive `read` + `cudaMemcpy`
//!   loop. One more case prices the end-to-end crc32c against the same read without it.
//! - `host`: a file into host memory and back (`localio/host.rs`).
//! - `second-read`: a read that asks for a registration against the same read through the
//!   lanes (`localio/second_read.rs`; CUDA only: the host backend registers nothing).
//! - `cufile` (only when named: it needs torch, kvikio and gpuio's `libcufile.so.0`): cuFile
//!   programs on gpuio's library against the same programs on NVIDIA's (`localio/cufile.rs`).
//!
//! A peer that cannot run here is named in the notes, not faked.

use crate::peers::{self, FioJob, KvikioMode};
use crate::{Record, Result, Target, human};
use gpuio_api::{Durability, FileHandle};
use gpuio_api::{OpenOptions, Session};
use gpuio_hal::{Backend, DeviceBuffer, GdsMode, Gpu, HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_localio::{IoEngine, LocalIo, LocalIoConfig, PageCachePolicy};
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod cufile;
mod host;
mod second_read;
mod targets;
pub use targets::targets;

/// The suite's name in records and file names.
pub const SUITE: &str = "localio";

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Size of the sequential test file.
    pub size: u64,
    /// Directory for the test files.
    pub scratch: PathBuf,
    /// Timed repetitions per side.
    pub reps: usize,
    /// Random 4 KiB reads per repetition.
    pub random_reads: usize,
    /// The parts to run, of [`PARTS`].
    pub parts: Vec<&'static str>,
}

/// The suite's parts; all but `cufile` run unless parts are named.
pub const PARTS: [&str; 4] = ["device", "host", "second-read", "cufile"];

impl Options {
    /// The defaults for a backend: 4 GiB on a GPU, 256 MiB on the host backend.
    pub fn for_backend(backend: Backend) -> Self {
        let gpu = backend == Backend::Cuda;
        Self {
            size: if gpu { 4 << 30 } else { 256 << 20 },
            scratch: std::env::temp_dir(),
            reps: if gpu { 5 } else { 3 },
            random_reads: if gpu { 262_144 } else { 32_768 },
            parts: PARTS[..3].to_vec(),
        }
    }

    /// Keeps only the named parts (of [`PARTS`]); an unknown name is refused.
    pub fn keep_parts(&mut self, parts: &[String]) -> Result<()> {
        if let Some(p) = parts.iter().find(|p| !PARTS.contains(&p.as_str())) {
            return Err(crate::BenchError::Options(format!(
                "localio part {p:?}: the parts are {}",
                PARTS.join(", ")
            )));
        }
        self.parts = PARTS
            .into_iter()
            .filter(|p| parts.iter().any(|q| q == p))
            .collect();
        Ok(())
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Median time of `reps` runs of `f` (after one untimed run), with `before` (e.g. dropping
/// the cache) untimed ahead of each.
fn time_it(
    reps: usize,
    mut before: impl FnMut() -> Result<()>,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Duration> {
    before()?;
    f()?;
    let mut t = Vec::new();
    for _ in 0..reps.max(1) {
        before()?;
        let s = Instant::now();
        f()?;
        t.push(s.elapsed());
    }
    Ok(median(t))
}

pub(crate) fn api(e: impl Into<gpuio_api::Error>) -> crate::BenchError {
    crate::BenchError::Gpuio(e.into())
}

/// Writes the sequential test file (pattern `seed`), in parallel 64 MiB pieces.
pub(crate) fn make_file(path: &Path, size: u64, seed: u64) -> Result<()> {
    const PIECE: usize = 64 << 20;
    let f = FileHandle::open(path, OpenOptions::CREATE).map_err(api)?;
    let pieces = size.div_ceil(PIECE as u64) as usize;
    (0..pieces).into_par_iter().try_for_each(|i| {
        let at = i as u64 * PIECE as u64;
        let n = (size - at).min(PIECE as u64) as usize;
        let mut buf = vec![0u8; n];
        pattern::fill(&mut buf, at, seed);
        f.write_all_at(at, &buf).map_err(api)
    })?;
    f.sync_data().map_err(api)
}

/// The crc32c of the test file's pattern, computed apart from any transfer (64 MiB pieces
/// in parallel, combined in order).
fn pattern_crc32c(size: u64, seed: u64) -> u32 {
    const PIECE: u64 = 64 << 20;
    let pieces: Vec<(u32, usize)> = (0..size.div_ceil(PIECE))
        .into_par_iter()
        .map(|i| {
            let at = i * PIECE;
            let mut buf = vec![0u8; (size - at).min(PIECE) as usize];
            pattern::fill(&mut buf, at, seed);
            (crc32c::crc32c(&buf), buf.len())
        })
        .collect();
    pieces
        .into_iter()
        .fold(0, |crc, (c, n)| crc32c::crc32c_combine(crc, c, n))
}

pub(crate) fn check_device(
    gpu: &Gpu,
    dev: &DeviceBuffer,
    reference: &DeviceBuffer,
    len: usize,
    seed: u64,
    case: &str,
) -> Result<()> {
    let s = gpu.stream()?;
    s.fill_pattern(reference, 0, len, seed)?;
    if let Some(off) = s.find_mismatch(dev, 0, reference, 0, len)? {
        return Err(crate::BenchError::Corrupt {
            case: case.into(),
            size: len,
            offset: off,
        });
    }
    Ok(())
}

/// Runs the suite on GPU 0; `progress` hears about each case as it starts.
pub fn run(
    session: &Session,
    opts: &Options,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let gpu = session.gpu(0)?.clone();
    let io = session.localio();
    let scratch = |ext: &str| {
        opts.scratch
            .join(format!("gpuio-bench-{}.{ext}", std::process::id()))
    };
    let (path, wpath, warmup) = (scratch("bin"), scratch("out"), scratch("warmup"));
    let _cleanup = Cleanup(vec![path.clone(), wpath.clone(), warmup.clone()]);
    let seed = crate::fresh_seed();
    progress(&format!(
        "writing a {} test file",
        human(opts.size as usize)
    ));
    make_file(&path, opts.size, seed)?;
    let has = |part: &str| opts.parts.contains(&part);
    let (mut records, mut notes) = (Vec::new(), Vec::new());
    if has("device") {
        let (r, n) = device_part(session, opts, (&path, &wpath), seed, progress)?;
        records.extend(r);
        notes.extend(n);
    }
    let lanes = io.config().lanes;
    let device = gpu.info().name.clone();
    if has("host") {
        let part = host::HostPart {
            io,
            gpu: &gpu,
            path: &path,
            size: opts.size,
            seed,
            reps: opts.reps,
            fio: FioJob {
                path: &path,
                size: opts.size,
                rw: "read",
                bs: io.config().chunk_size,
                iodepth: 1,
                numjobs: lanes,
                direct: false,
                end_fsync: false,
                runtime_s: None,
            },
            device: device.clone(),
        };
        records.extend(host::run(&part, &mut notes, progress)?);
    }
    if has("second-read") {
        if gpu.info().page_cache_dma.available {
            progress("second_read");
            make_file(&warmup, 256 << 20, seed ^ 3)?;
            records.extend(second_read::run(
                &gpu,
                io.config(),
                &path,
                opts.size,
                &warmup,
                opts.reps,
                &device,
            )?);
        } else {
            notes.push(format!(
                "second_read: nothing is registered here ({})",
                gpu.info().page_cache_dma.detail
            ));
        }
    }
    if has("cufile") {
        if gpu.backend() == Backend::Cuda {
            records.extend(cufile::run(
                &path, opts.size, &device, &mut notes, progress,
            )?);
        } else {
            notes.push("cufile: cuFile programs need a CUDA GPU".into());
        }
    }
    let targets = if gpu.backend() == Backend::Cuda {
        targets(&records, lanes)
    } else {
        Vec::new()
    };
    Ok((records, targets, notes))
}

/// The `device` part on the test file at `path` (pattern `seed`); `wpath` for the writes.
fn device_part(
    session: &Session,
    opts: &Options,
    (path, wpath): (&Path, &Path),
    seed: u64,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<String>)> {
    let gpu = session.gpu(0)?.clone();
    let io = session.localio();
    let (engine, _) = io.engine();
    let lanes = io.config().lanes;
    let slots = io.config().slots_per_lane;
    let chunk = io.config().chunk_size;
    let device = gpu.info().name.clone();
    let size = opts.size;
    let len = size as usize;
    let buffered = io.open(path, OpenOptions::READ).map_err(api)?;
    let direct = io.open(path, OpenOptions::READ.direct()).ok();
    let dev = gpu.alloc(len)?;
    let reference = gpu.alloc(len)?;
    let mut records = Vec::new();
    let mut notes = Vec::new();
    let route = format!(
        "{engine} x {lanes} lanes, {} KiB chunks, {slots} slots/lane",
        chunk >> 10
    );
    // One-off reads: an engine that keeps no registrations (so repeating the read measures
    // the first read again), and the route it takes.
    let once = LocalIo::new(LocalIoConfig {
        page_cache_keep: 0,
        ..io.config().clone()
    })
    .map_err(api)?;
    let warm_route = once
        .read_to_device(&buffered, 0, &dev, 0, len)
        .map_err(api)?
        .to_string();
    // A hot file (weights loaded again and again): the session's engine keeps the
    // registration the second read asks for, made in the background.
    for _ in 0..2 {
        io.read_to_device(&buffered, 0, &dev, 0, len).map_err(api)?;
    }
    io.wait_for_page_cache();
    let hot_route = io
        .read_to_device(&buffered, 0, &dev, 0, len)
        .map_err(api)?
        .to_string();
    // Few threads: two lanes, or two registering threads.
    let two = |page_cache| {
        LocalIo::new(LocalIoConfig {
            lanes: 2,
            page_cache,
            page_cache_keep: 0,
            ..io.config().clone()
        })
        .map_err(api)
    };
    let two_route = two(PageCachePolicy::Auto)?
        .read_to_device(&buffered, 0, &dev, 0, len)
        .map_err(api)?
        .to_string();
    let mut record =
        |case: &str, metric: &str, unit: &str, value: f64, peer: &str, peer_value: f64| {
            let route = match case {
                "seq_read_warm" => &warm_route,
                "seq_read_hot" => &hot_route,
                "seq_read_warm_2threads" => &two_route,
                _ => &route,
            };
            records.push(Record {
                suite: SUITE.into(),
                case: format!("{case}/{}", human(len)),
                metric: metric.into(),
                value,
                unit: unit.into(),
                peer: peer.into(),
                peer_value,
                ratio: value / peer_value,
                bytes: len,
                route: route.clone(),
                device: device.clone(),
                reps: opts.reps,
                rows: None,
            });
        };
    let gbps = |t: Duration| size as f64 / t.as_secs_f64().max(1e-9) / 1e9;
    let fio_base = FioJob {
        path,
        size,
        rw: "read",
        bs: chunk,
        iodepth: slots,
        numjobs: lanes,
        direct: false,
        end_fsync: false,
        runtime_s: None,
    };
    let no_prep = || Ok(());

    // Naive peer: one thread, read a piece, cudaMemcpy it.
    let naive = |file: &FileHandle, cold: bool| -> Result<Duration> {
        const PIECE: usize = 64 << 20;
        let mut buf = vec![0u8; PIECE.min(len)];
        time_it(
            opts.reps,
            || {
                if cold {
                    file.drop_cache().map_err(api)?;
                }
                Ok(())
            },
            || {
                let mut at = 0;
                while at < len {
                    let n = (len - at).min(PIECE);
                    file.read_exact_at(at as u64, &mut buf[..n]).map_err(api)?;
                    gpu.baseline_upload(&buf[..n], &dev, at)?;
                    at += n;
                }
                Ok(())
            },
        )
    };

    // 1. Sequential read, page cache warm.
    progress("seq_read_warm");
    let ours = time_it(opts.reps, no_prep, || {
        once.read_to_device(&buffered, 0, &dev, 0, len)
            .map_err(api)
            .map(|_| ())
    })?;
    check_device(&gpu, &dev, &reference, len, seed, "seq_read_warm")?;
    let ours = gbps(ours);
    let t = naive(&buffered, false)?;
    record(
        "seq_read_warm",
        "bandwidth",
        "GB/s",
        ours,
        "read+cudaMemcpy",
        gbps(t),
    );
    if let Some(k) = peer(
        &mut notes,
        "kvikio warm",
        peers::kvikio(path, size, lanes, KvikioMode::Warm, opts.reps),
    ) {
        record(
            "seq_read_warm",
            "bandwidth",
            "GB/s",
            ours,
            &format!("kvikio POSIX ({lanes} threads)"),
            k.bytes_per_s / 1e9,
        );
    }
    if let Some(f) = peer(&mut notes, "fio warm", peers::fio(&fio_base, 3)) {
        record(
            "seq_read_warm",
            "bandwidth",
            "GB/s",
            ours,
            "fio (to host memory)",
            f.bytes_per_s / 1e9,
        );
    }

    // 1a. The same read through the staged lanes (the page cache path off), and the copy
    // engine's rate from pinned memory: the ceiling of any read into GPU memory.
    progress("seq_read_warm staged");
    let staged = LocalIo::new(LocalIoConfig {
        page_cache: PageCachePolicy::Off,
        ..io.config().clone()
    })
    .map_err(api)?;
    let t = time_it(opts.reps, no_prep, || {
        staged
            .read_to_device(&buffered, 0, &dev, 0, len)
            .map_err(api)
            .map(drop)
    })?;
    check_device(&gpu, &dev, &reference, len, seed, "seq_read_warm staged")?;
    drop(staged);
    record(
        "seq_read_warm",
        "bandwidth",
        "GB/s",
        ours,
        &format!("gpuio staged lanes ({lanes})"),
        gbps(t),
    );
    let staged_rate = gbps(t);
    // The copy engine's rate from pinned memory: the ceiling of any read into GPU memory.
    let pinned_rate = if gpu.info().backend == Backend::Cuda {
        let pinned = HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), &gpu)?;
        let t = time_it(opts.reps, no_prep, || {
            Ok(gpu.baseline_upload(&pinned, &dev, 0)?)
        })?;
        record(
            "seq_read_warm",
            "bandwidth",
            "GB/s",
            ours,
            "cudaMemcpy from pinned memory",
            gbps(t),
        );
        Some(gbps(t))
    } else {
        None
    };

    // 1c. Few threads: two lanes staged against two registering threads.
    progress("seq_read_warm_2 threads");
    let mut two_lanes = Vec::new();
    for pc in [PageCachePolicy::Auto, PageCachePolicy::Off] {
        let e = two(pc)?;
        let t = time_it(opts.reps, no_prep, || {
            e.read_to_device(&buffered, 0, &dev, 0, len)
                .map_err(api)
                .map(drop)
        })?;
        check_device(&gpu, &dev, &reference, len, seed, "seq_read_warm 2 threads")?;
        two_lanes.push(gbps(t));
    }
    record(
        "seq_read_warm_2threads",
        "bandwidth",
        "GB/s",
        two_lanes[0],
        "gpuio staged lanes (2)",
        two_lanes[1],
    );

    // 1d. A hot file: every read a copy from its kept registration.
    progress("seq_read_hot");
    let cpu = cpu_seconds();
    let t = time_it(opts.reps, no_prep, || {
        io.read_to_device(&buffered, 0, &dev, 0, len)
            .map_err(api)
            .map(drop)
    })?;
    let cpu = cpu_seconds() - cpu;
    check_device(&gpu, &dev, &reference, len, seed, "seq_read_hot")?;
    let hot = gbps(t);
    // Kept registrations pin the file's pages: the cold cases below must be able to drop them.
    io.release_page_cache();
    notes.push(format!(
        "seq_read_hot: {:.3} CPU seconds per GB read ({} reads)",
        cpu / (size as f64 * (opts.reps.max(1) + 1) as f64 / 1e9),
        opts.reps.max(1) + 1
    ));
    if let Some(p) = pinned_rate {
        record(
            "seq_read_hot",
            "bandwidth",
            "GB/s",
            hot,
            "cudaMemcpy from pinned memory",
            p,
        );
    }
    record(
        "seq_read_hot",
        "bandwidth",
        "GB/s",
        hot,
        &format!("gpuio staged lanes ({lanes})"),
        staged_rate,
    );

    // 1b. The same read with the end-to-end crc32c checked against the file's.
    progress("seq_read_warm+crc32c");
    let expected = pattern_crc32c(size, seed);
    let checked = LocalIo::new(LocalIoConfig {
        checksum: true,
        ..io.config().clone()
    })
    .map_err(api)?;
    let t = time_it(opts.reps, no_prep, || {
        let t = checked
            .read_to_device(&buffered, 0, &dev, 0, len)
            .map_err(api)?;
        t.verify_crc32c(expected).map_err(api)
    })?;
    record(
        "seq_read_warm+crc32c",
        "bandwidth",
        "GB/s",
        gbps(t),
        "gpuio without checksum",
        ours,
    );
    drop(checked);

    // cuFile as kvikio drives it: 4 MiB calls on the same threads, O_DIRECT descriptor.
    let cufile = gpu.gds();
    let cufile_peer = |mode: &GdsMode| {
        let kind = match mode {
            GdsMode::Native => "GDS",
            GdsMode::Compat => "compat mode",
        };
        format!("cuFile {kind} ({lanes} threads)")
    };
    if let Err(e) = &cufile {
        notes.push(format!("cuFile: {e}"));
    }

    // 2. Sequential read, cold: O_DIRECT.
    progress("seq_read_cold");
    match &direct {
        Some(d) => {
            let ours = time_it(
                opts.reps,
                || d.drop_cache().map_err(api),
                || {
                    io.read_to_device(d, 0, &dev, 0, len)
                        .map_err(api)
                        .map(|_| ())
                },
            )?;
            check_device(&gpu, &dev, &reference, len, seed, "seq_read_cold")?;
            let ours = gbps(ours);
            if let Some(f) = peer(
                &mut notes,
                "fio cold",
                peers::fio(
                    &FioJob {
                        iodepth: lanes * slots,
                        numjobs: 1,
                        direct: true,
                        ..fio_base.clone()
                    },
                    3,
                ),
            ) {
                record(
                    "seq_read_cold",
                    "bandwidth",
                    "GB/s",
                    ours,
                    "fio O_DIRECT (to host memory)",
                    f.bytes_per_s / 1e9,
                );
            }
            if let Some(k) = peer(
                &mut notes,
                "kvikio cold",
                peers::kvikio(path, size, lanes, KvikioMode::Cold, opts.reps.min(3)),
            ) {
                record(
                    "seq_read_cold",
                    "bandwidth",
                    "GB/s",
                    ours,
                    &format!("kvikio POSIX cold ({lanes} threads)"),
                    k.bytes_per_s / 1e9,
                );
            }
            if let Ok((mode, _)) = &cufile {
                let run = || -> Result<Duration> {
                    let f = io
                        .open(
                            path,
                            OpenOptions {
                                gds: Some(true),
                                ..OpenOptions::READ.direct()
                            },
                        )
                        .map_err(api)?;
                    let t = time_it(
                        opts.reps,
                        || f.drop_cache().map_err(api),
                        || {
                            let t = io.read_to_device(&f, 0, &dev, 0, len).map_err(api)?;
                            expect_cufile(t.engine)
                        },
                    )?;
                    check_device(&gpu, &dev, &reference, len, seed, "seq_read_cold cuFile")?;
                    Ok(t)
                };
                match run() {
                    Ok(t) => record(
                        "seq_read_cold",
                        "bandwidth",
                        "GB/s",
                        ours,
                        &cufile_peer(mode),
                        gbps(t),
                    ),
                    Err(e) => notes.push(format!("cuFile cold read: {e}")),
                }
            }
            let t = naive(&buffered, true)?;
            record(
                "seq_read_cold",
                "bandwidth",
                "GB/s",
                ours,
                "read+cudaMemcpy (cold)",
                gbps(t),
            );
        }
        None => notes.push("seq_read_cold: O_DIRECT is refused on the scratch file system".into()),
    }

    // 3. GPU to file, then fdatasync.
    progress("seq_write_sync");
    gpu.stream()?.fill_pattern(&dev, 0, len, seed ^ 1)?;
    let out = io.open(wpath, OpenOptions::CREATE).map_err(api)?;
    let ours = time_it(opts.reps, no_prep, || {
        io.write_from_device(&dev, 0, &out, 0, len, Durability::DataSync)
            .map_err(api)
            .map(|_| ())
    })?;
    let mut head = vec![0u8; (16 << 20).min(len)];
    out.read_exact_at(0, &mut head).map_err(api)?;
    if let Some(off) = pattern::first_deviation(&head, 0, seed ^ 1) {
        return Err(crate::BenchError::Corrupt {
            case: "seq_write_sync".into(),
            size: len,
            offset: off as u64,
        });
    }
    let ours = gbps(ours);
    if let Some(f) = peer(
        &mut notes,
        "fio write",
        peers::fio(
            &FioJob {
                path: wpath,
                rw: "write",
                end_fsync: true,
                ..fio_base.clone()
            },
            3,
        ),
    ) {
        record(
            "seq_write_sync",
            "bandwidth",
            "GB/s",
            ours,
            "fio write+fsync (from host memory)",
            f.bytes_per_s / 1e9,
        );
    }

    if let Ok((mode, _)) = &cufile {
        let mut run = || -> Result<Duration> {
            gpu.stream()?.fill_pattern(&dev, 0, len, seed ^ 2)?;
            let f = io
                .open(
                    wpath,
                    OpenOptions {
                        gds: Some(true),
                        ..OpenOptions::CREATE
                    },
                )
                .map_err(api)?;
            let t = time_it(opts.reps, no_prep, || {
                let t = io
                    .write_from_device(&dev, 0, &f, 0, len, Durability::DataSync)
                    .map_err(api)?;
                expect_cufile(t.engine)
            })?;
            out.read_exact_at(0, &mut head).map_err(api)?;
            if let Some(off) = pattern::first_deviation(&head, 0, seed ^ 2) {
                return Err(crate::BenchError::Corrupt {
                    case: "seq_write_sync cuFile".into(),
                    size: len,
                    offset: off as u64,
                });
            }
            Ok(t)
        };
        match run() {
            Ok(t) => record(
                "seq_write_sync",
                "bandwidth",
                "GB/s",
                ours,
                &cufile_peer(mode),
                gbps(t),
            ),
            Err(e) => notes.push(format!("cuFile write: {e}")),
        }
    }

    // 4. A model load: a directory of safetensors-sized files, cold, warm and hot.
    let model = crate::model_load::run(&gpu, io, opts, &mut notes, progress)?;

    // 5. Random 4 KiB reads, page cache warm, gathered into GPU memory.
    progress("rand_read_4k");
    let n = opts.random_reads.min(len / 4096);
    let offsets: Vec<u64> = (0..n)
        .map(|i| pattern::mix64(seed ^ i as u64) % (size / 4096) * 4096)
        .collect();
    let t = time_it(opts.reps, no_prep, || {
        io.read_blocks_to_device(&buffered, &offsets, 4096, &dev, 0)
            .map_err(api)
            .map(|_| ())
    })?;
    let mut sample = vec![0u8; 4096];
    let k = n / 2;
    gpu.stream()?.download(&dev, k * 4096, &mut sample)?;
    if let Some(off) = pattern::first_deviation(&sample, offsets[k], seed) {
        return Err(crate::BenchError::Corrupt {
            case: "rand_read_4k".into(),
            size: 4096,
            offset: off as u64,
        });
    }
    let iops = n as f64 / t.as_secs_f64().max(1e-9);
    let rand_job = FioJob {
        rw: "randread",
        bs: 4096,
        iodepth: 256,
        runtime_s: Some(3),
        ..fio_base.clone()
    };
    if let Some(f) = peer(&mut notes, "fio randread", peers::fio(&rand_job, 3)) {
        record(
            "rand_read_4k",
            "iops",
            "IOPS",
            iops,
            "fio randread (to host memory)",
            f.iops,
        );
    }
    if let Some(k) = peer(
        &mut notes,
        "kvikio futures",
        peers::kvikio(path, size, lanes, KvikioMode::Random4k, opts.reps.min(3)),
    ) {
        record(
            "rand_read_4k",
            "iops",
            "IOPS",
            iops,
            "kvikio POSIX pread futures",
            k.iops,
        );
    }
    // Naive peer: one thread, pread each block, one cudaMemcpy of them all.
    let mut host = vec![0u8; n * 4096];
    let t = time_it(opts.reps, no_prep, || {
        for (k, off) in offsets.iter().enumerate() {
            buffered
                .read_exact_at(*off, &mut host[k * 4096..(k + 1) * 4096])
                .map_err(api)?;
        }
        Ok(gpu.baseline_upload(&host, &dev, 0)?)
    })?;
    record(
        "rand_read_4k",
        "iops",
        "IOPS",
        iops,
        "pread loop+cudaMemcpy",
        n as f64 / t.as_secs_f64().max(1e-9),
    );

    records.extend(model);
    Ok((records, notes))
}

/// A cuFile peer must have run on cuFile, not fallen back to the lanes.
fn expect_cufile(engine: IoEngine) -> Result<()> {
    match engine {
        IoEngine::Gds(_) => Ok(()),
        other => Err(crate::BenchError::Gpuio(gpuio_api::Error::Invalid(
            format!("the cuFile peer ran on {other}"),
        ))),
    }
}

/// A peer's result, or a note saying why it could not run.
pub(crate) fn peer<T>(
    notes: &mut Vec<String>,
    name: &str,
    r: std::result::Result<T, String>,
) -> Option<T> {
    r.map_err(|e| notes.push(format!("{name}: {e}"))).ok()
}

/// Removes the suite's scratch files, however it ends.
pub(crate) struct Cleanup(pub(crate) Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// CPU seconds this process has used (user and system, all threads), from `/proc/self/stat`
/// (in the kernel's fixed 100 ticks per second); 0 where it cannot be read.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at its closing parenthesis;
    // utime and stime are the 14th and 15th fields of the line.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    f.iter().sum::<f64>() / 100.0
}
