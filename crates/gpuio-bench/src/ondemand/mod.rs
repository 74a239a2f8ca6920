//! The `ondemand` suite: on-demand arrays read by GPU threads through the page cache (GPU
//! machine only). The data is a warm file four times the cache.
//!
//! - `gnn_gather_{512,4096}_{zipf,uniform}`: feature rows of 512 B and 4 KiB at indices drawn
//!   uniformly or by Zipf(0.9) (the GIDS/BaM shape), a GPU thread per row through
//!   `gpuio_array::read_each` (pages of the row's size), in steady state (a pass first, then
//!   timed passes); peers in the same run: the same rows read into GPU memory by the host
//!   LocalIO engine (`read_blocks_to_device`: what a host program driving kvikio does, and
//!   gpuio's engine is ahead of kvikio there), and a CPU gather (threads `pread` each row into
//!   pinned memory) followed by one bulk copy. The array reads misses in place (the file's
//!   page cache pages pinned for the device, each miss one copy by the warp); the same
//!   gather with misses through the request ring is in the case's note.
//! - `hit_path`, `hit_path_resident`: random u64 elements of a fully cached array
//!   (`gpuio_array::gather`; the same array held, `gpuio_resident_array`) against
//!   the same kernel shape reading a plain device array holding the same bytes.
//! - `miss_path`: distinct random 4 KiB pages of a cold cache (every access a miss), against
//!   the request ring's raw rate (`ring_read_blocks`: the same reads through the same ring and
//!   proxy, with no cache; passes alternate) and the host LocalIO engine;
//!   `miss_path_in_place`: the same misses read in place, against the host engine.
//! - `element_gather_{zipf,uniform}`: 4-byte elements at random (`ondemand/elements.rs`).

use crate::localio::{Cleanup, api, make_file};
use crate::ring::check_results;
use crate::{BenchError, Record, Result, Target, fresh_seed};
use gpuio_api::{OpenOptions, Session};
use gpuio_core::ondemand::{ArrayMode, OnDemandArray, PageCache, PageCacheConfig};
use gpuio_core::{Endpoint, RingConfig};
use gpuio_hal::{DeviceBuffer, Gpu, HostAllocOptions, HostBuffer, Stream, pattern};
use gpuio_ring::ondemand::ops as array_kernels;
use gpuio_ring::ops as ring_kernels;
use rayon::prelude::*;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

mod elements;

/// The suite's name.
pub const SUITE: &str = "ondemand";

/// Sizes of the suite.
#[derive(Debug, Clone)]
pub struct Options {
    /// GPU memory of the page cache (the file is four times this).
    pub cache: usize,
    /// Rows per gather pass (and pages per miss pass, a quarter of it).
    pub rows: usize,
    /// GPU threads of the array kernels (a thread per row or element). Twice the cache ring's
    /// 4096 slots: every thread past the slots polls host memory for its turn, and 65536 of
    /// them measured 0.11 M misses/s where the ring alone moves 2.9 M (the polls crowd PCIe).
    pub gpu_threads: u32,
    /// GPU threads of the element cases' kernels, theirs and their peers': reads in place
    /// hold no ring slot, so every thread keeps a read in flight.
    pub element_threads: u32,
    /// Timed repetitions (median).
    pub reps: usize,
    /// Directory for the test file.
    pub scratch: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            cache: 256 << 20,
            rows: 262_144,
            gpu_threads: 8192,
            element_threads: 65536,
            reps: 3,
            scratch: std::env::temp_dir(),
        }
    }
}

impl Options {
    /// A short run.
    pub fn quick() -> Self {
        Self {
            cache: 32 << 20,
            rows: 32_768,
            reps: 1,
            ..Self::default()
        }
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Runs `f` once to warm up, then `reps` times; the median time.
fn timed(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    f()?;
    let mut t = Vec::new();
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        f()?;
        t.push(start.elapsed());
    }
    Ok(median(t))
}

/// `n` row numbers below `rows` (a power of two): uniform, or Zipf(0.9) ranks scattered over
/// the file by an odd multiplier (a bijection modulo a power of two).
fn row_ids(rows: u64, n: usize, zipf: bool, seed: u64) -> Vec<u64> {
    let unit = |k: usize| (pattern::mix64(seed ^ k as u64) >> 11) as f64 / (1u64 << 53) as f64;
    if !zipf {
        return (0..n)
            .map(|k| pattern::mix64(seed.wrapping_add(k as u64)) & (rows - 1))
            .collect();
    }
    let mut cdf = Vec::with_capacity(rows as usize);
    let mut sum = 0.0;
    for i in 0..rows {
        sum += 1.0 / ((i + 1) as f64).powf(0.9);
        cdf.push(sum);
    }
    (0..n)
        .map(|k| {
            let rank = cdf.partition_point(|&c| c < unit(k) * sum) as u64;
            rank.min(rows - 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) & (rows - 1)
        })
        .collect()
}

fn upload_u64s(gpu: &Gpu, stream: &Stream, v: &[u64]) -> Result<DeviceBuffer> {
    let buf = gpu.alloc(v.len() * 8)?;
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    stream.upload(&bytes, &buf, 0)?;
    Ok(buf)
}

/// Checks rows 0, n/2 and n-1 of `out` (row `k` holds file bytes from `offsets[k]`).
fn check_rows(
    stream: &Stream,
    out: &DeviceBuffer,
    offsets: &[u64],
    row: usize,
    seed: u64,
    case: &str,
) -> Result<()> {
    let mut got = vec![0u8; row];
    let n = offsets.len();
    for k in [0, n / 2, n - 1] {
        stream.download(out, k * row, &mut got)?;
        if let Some(at) = pattern::first_deviation(&got, offsets[k], seed) {
            return Err(BenchError::Corrupt {
                case: case.into(),
                size: row,
                offset: offsets[k] + at as u64,
            });
        }
    }
    Ok(())
}

struct Ctx<'a> {
    session: &'a Session,
    gpu: Gpu,
    stream: Stream,
    opts: &'a Options,
    file: gpuio_api::FileHandle,
    path: PathBuf,
    size: u64,
    seed: u64,
    proxies: usize,
}

impl Ctx<'_> {
    /// A cache whose read-only arrays over warm files read misses in place or (`in_place`
    /// false) through the ring.
    fn cache(&self, page: usize, capacity: usize, in_place: bool) -> Result<PageCache> {
        self.cache_with(
            page,
            capacity,
            in_place,
            PageCacheConfig::default().admit_after,
        )
    }

    /// A cache reading in place that admits a page after `admit_after` touches
    /// ([`PageCacheConfig::admit_after`]).
    fn cache_admitting(&self, page: usize, capacity: usize, admit_after: u32) -> Result<PageCache> {
        self.cache_with(page, capacity, true, admit_after)
    }

    fn cache_with(
        &self,
        page: usize,
        capacity: usize,
        in_place: bool,
        admit_after: u32,
    ) -> Result<PageCache> {
        let cfg = PageCacheConfig {
            page_size: page,
            capacity,
            ring: RingConfig {
                threads: self.proxies,
                ..PageCacheConfig::default().ring
            },
            in_place,
            admit_after,
        };
        PageCache::new(self.session.engines().clone(), &self.gpu, cfg).map_err(api)
    }

    fn array(&self, cache: &PageCache, bytes: u64) -> Result<OnDemandArray<u64>> {
        cache
            .array(
                Endpoint::file(&self.file, 0),
                bytes / 8,
                ArrayMode::ReadOnly,
            )
            .map_err(api)
    }

    /// Rows through the array into `out`.
    fn array_rows(
        &self,
        array: &OnDemandArray<u64>,
        rows: &DeviceBuffer,
        n: usize,
        row: usize,
        out: &DeviceBuffer,
    ) -> Result<()> {
        let (m, t, ring) = array.hal_parts();
        array_kernels::bench_reads(
            &self.stream,
            Ok((m.as_ref(), t, &ring)),
            rows,
            n,
            row,
            out,
            self.opts.gpu_threads,
        )?;
        array.check().map_err(api)
    }
}

/// Runs the suite; on the host backend it reports that it needs a GPU and records nothing.
pub fn run(
    session: &Session,
    opts: &Options,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let gpu = match crate::cuda_gpu(
        session,
        "ondemand: needs a GPU (kernels index the arrays); the host backend's accessor is tested in CI",
    )? {
        Ok(gpu) => gpu,
        Err(nothing) => return Ok(nothing),
    };
    let seed = fresh_seed();
    let path = opts
        .scratch
        .join(format!("gpuio-ondemand-{}.bin", std::process::id()));
    let _cleanup = Cleanup(vec![path.clone()]);
    let size = (4 * opts.cache as u64).next_power_of_two();
    progress("writing the test file");
    make_file(&path, size, seed)?;
    let file = session
        .localio()
        .open(&path, OpenOptions::READ)
        .map_err(api)?;
    let cores = std::thread::available_parallelism().map_or(2, |c| c.get());
    let ctx = Ctx {
        session,
        stream: gpu.stream()?,
        gpu,
        opts,
        file,
        path,
        size,
        seed,
        proxies: cores.saturating_sub(2).clamp(1, 16),
    };
    let mut records = Vec::new();
    let mut targets = Vec::new();
    let mut notes = Vec::new();
    for row in [512usize, 4096] {
        for zipf in [true, false] {
            let case = format!("gnn_gather_{row}_{}", if zipf { "zipf" } else { "uniform" });
            progress(&case);
            let (r, note) = gnn_gather(&ctx, row, zipf, &case)?;
            notes.push(note);
            let (goal, peer) = (if row == 512 { 2.0 } else { 1.2 }, r.peer_value);
            targets.push(Target {
                description: format!(
                    "{case}: >= {goal}x the better of the host engine and a CPU gather"
                ),
                measured: Some(format!(
                    "{:.2} vs {peer:.2} M rows/s ({:.2}x)",
                    r.value, r.ratio
                )),
                met: Some(r.ratio >= goal),
            });
            records.push(r);
        }
    }
    for zipf in [true, false] {
        progress(if zipf {
            "element_gather_zipf"
        } else {
            "element_gather_uniform"
        });
        let (r, t, note) = elements::element_gather(&ctx, zipf)?;
        records.push(r);
        targets.extend(t);
        notes.push(note);
    }
    progress("hit_path");
    let (r, resident, note) = hit_path(&ctx)?;
    notes.push(note);
    targets.push(Target {
        description: "hit path: a cached array >= 0.7x a plain device array, same kernel".into(),
        measured: Some(format!(
            "{:.2} vs {:.2} G reads/s ({:.2}x)",
            r.value, r.peer_value, r.ratio
        )),
        met: Some(r.ratio >= 0.7),
    });
    targets.push(Target {
        description: "hit path of a resident (held) array >= 0.7x a plain device array".into(),
        measured: Some(format!(
            "{:.2} vs {:.2} G reads/s ({:.2}x)",
            resident.value, resident.peer_value, resident.ratio
        )),
        met: Some(resident.ratio >= 0.7),
    });
    records.push(r);
    records.push(resident);
    progress("miss_path");
    let (ring_r, host_r, in_place_r) = miss_path(&ctx)?;
    targets.push(Target {
        description: "miss path: cold 4 KiB page misses >= 0.8x the ring's raw rate".into(),
        measured: Some(format!(
            "{:.2} vs {:.2} M/s ({:.2}x)",
            ring_r.value, ring_r.peer_value, ring_r.ratio
        )),
        met: Some(ring_r.ratio >= 0.8),
    });
    records.push(ring_r);
    records.push(host_r);
    records.push(in_place_r);
    let device = ctx.gpu.info().name.clone();
    for r in &mut records {
        r.device = device.clone();
        r.reps = opts.reps;
    }
    Ok((records, targets, notes))
}

/// One gather case: rows/s through the array and both peers' rates.
fn gnn_gather(ctx: &Ctx<'_>, row: usize, zipf: bool, case: &str) -> Result<(Record, String)> {
    let n = ctx.opts.rows;
    let ids = row_ids(ctx.size / row as u64, n, zipf, ctx.seed ^ row as u64);
    let offsets: Vec<u64> = ids.iter().map(|&i| i * row as u64).collect();
    let rows = upload_u64s(&ctx.gpu, &ctx.stream, &ids)?;
    let out = ctx.gpu.alloc(n * row)?;

    // Through the ring, then in place (the default where the file's pages can be pinned).
    let mut through = Vec::new();
    for in_place in [false, true] {
        let cache = ctx.cache(row, ctx.opts.cache, in_place)?;
        let array = ctx.array(&cache, ctx.size)?;
        let t = timed(ctx.opts.reps, || {
            ctx.array_rows(&array, &rows, n, row, &out)
        })?;
        check_rows(&ctx.stream, &out, &offsets, row, ctx.seed, case)?;
        through.push((
            t,
            array.stats().map_err(api)?,
            array.miss_path().to_string(),
        ));
    }
    let (ring_t, _, _) = through.remove(0);
    let (ours, stats, miss_path) = through.remove(0);

    let io = ctx.session.localio();
    let host = timed(ctx.opts.reps, || {
        io.read_blocks_to_device(&ctx.file, &offsets, row, &out, 0)
            .map(drop)
            .map_err(api)
    })?;
    check_rows(&ctx.stream, &out, &offsets, row, ctx.seed, case)?;

    let std_file =
        std::fs::File::open(&ctx.path).map_err(|e| BenchError::Options(e.to_string()))?;
    let mut pinned = HostBuffer::alloc(n * row, &HostAllocOptions::default())?;
    let cpu = timed(ctx.opts.reps, || {
        pinned
            .par_chunks_mut(row)
            .zip(offsets.par_iter())
            .try_for_each(|(dst, &off)| std_file.read_exact_at(dst, off))
            .map_err(|e| BenchError::Options(format!("pread: {e}")))?;
        ctx.stream.upload(&pinned, &out, 0)?;
        Ok(())
    })?;
    check_rows(&ctx.stream, &out, &offsets, row, ctx.seed, case)?;

    let rate = |t: Duration| n as f64 / t.as_secs_f64().max(1e-9) / 1e6;
    let (ours_r, host_r, cpu_r) = (rate(ours), rate(host), rate(cpu));
    let ring_r = rate(ring_t);
    let (peer, peer_r) = if host_r >= cpu_r {
        ("host LocalIO read_blocks_to_device", host_r)
    } else {
        ("CPU gather + one copy", cpu_r)
    };
    let mut r = Record::versus(
        SUITE,
        (case, "rows/s", "M rows/s"),
        ours_r,
        peer,
        peer_r,
        true,
    );
    r.bytes = row;
    r.route = format!(
        "{} GPU threads, {} MiB cache of {} MiB, misses {miss_path}",
        ctx.opts.gpu_threads,
        ctx.opts.cache >> 20,
        ctx.size >> 20
    );
    // Each pass reads n rows of one page each: the share of them that missed.
    let passes = (ctx.opts.reps.max(1) + 1) as f64;
    let note = format!(
        "{case}: ours {ours_r:.2} (misses {miss_path}; through the ring, {} proxy threads: \
         {ring_r:.2}), host engine {host_r:.2}, CPU gather + copy {cpu_r:.2} M rows/s; {:.0}% of \
         rows missed (over every pass, the first cold), miss p50 {:?} ns, p99 {:?} ns",
        ctx.proxies,
        100.0 * stats.misses as f64 / (passes * n as f64),
        stats.miss_quantile_ns(0.5),
        stats.miss_quantile_ns(0.99)
    );
    Ok((r, note))
}

/// Random u64 reads of a fully cached array, through `gpuio_array::gather` and through the
/// same array held (`gpuio_resident_array`), against a plain device array; the note gives the
/// same three at the element cases' thread count (a full GPU: the hit path's atomics then
/// count, not only its latency).
fn hit_path(ctx: &Ctx<'_>) -> Result<(Record, Record, String)> {
    let bytes = (ctx.opts.cache / 2).min(64 << 20) as u64;
    let words = bytes / 8;
    let n = ctx.opts.rows * 16;
    let idx: Vec<u64> = (0..n)
        .map(|k| pattern::mix64(ctx.seed ^ (k as u64) << 3) % words)
        .collect();
    let idx_buf = upload_u64s(&ctx.gpu, &ctx.stream, &idx)?;
    let out = ctx.gpu.alloc(n * 8)?;
    let cache = ctx.cache(4096, ctx.opts.cache, true)?;
    let array = ctx.array(&cache, bytes)?;
    array.prefetch(0, words).map_err(api)?;
    let plain = ctx.gpu.alloc(bytes as usize)?;
    ctx.session
        .localio()
        .read_to_device(&ctx.file, 0, &plain, 0, bytes as usize)
        .map_err(api)?;
    let check = |what: &str| -> Result<()> {
        let mut got = vec![0u8; 8];
        for k in [0, n / 2, n - 1] {
            ctx.stream.download(&out, k * 8, &mut got)?;
            if u64::from_le_bytes(got[..8].try_into().unwrap_or_default())
                != pattern::word_at(ctx.seed, idx[k])
            {
                return Err(BenchError::Corrupt {
                    case: format!("hit_path ({what})"),
                    size: 8,
                    offset: idx[k] * 8,
                });
            }
        }
        Ok(())
    };
    let ours = timed(ctx.opts.reps, || {
        ctx.array_rows(&array, &idx_buf, n, 0, &out)
    })?;
    check("array")?;
    let wide = ctx.opts.element_threads;
    let (m, t, ring) = array.hal_parts();
    let ours_wide = timed(ctx.opts.reps, || {
        Ok(array_kernels::bench_reads(
            &ctx.stream,
            Ok((m.as_ref(), t, &ring)),
            &idx_buf,
            n,
            0,
            &out,
            wide,
        )?)
    })?;
    check("array, full GPU")?;
    let misses = array.stats().map_err(api)?.misses;
    let pages = bytes.div_ceil(4096);
    if misses > pages {
        return Err(BenchError::Options(format!(
            "hit_path: {misses} misses for {pages} prefetched pages: the array was not fully cached"
        )));
    }
    let held = array.resident().map_err(api)?;
    let resident_at = |threads: u32| {
        timed(ctx.opts.reps, || {
            Ok(array_kernels::resident_bench_reads(
                &ctx.stream,
                held.held(),
                &idx_buf,
                n,
                &out,
                threads,
            )?)
        })
    };
    let resident = resident_at(ctx.opts.gpu_threads)?;
    check("resident")?;
    let resident_wide = resident_at(wide)?;
    check("resident, full GPU")?;
    held.release().map_err(api)?;
    array.check().map_err(api)?;
    let plain_at = |threads: u32| {
        timed(ctx.opts.reps, || {
            Ok(array_kernels::bench_reads(
                &ctx.stream,
                Err(&plain),
                &idx_buf,
                n,
                0,
                &out,
                threads,
            )?)
        })
    };
    let theirs = plain_at(ctx.opts.gpu_threads)?;
    check("plain")?;
    let theirs_wide = plain_at(wide)?;
    check("plain, full GPU")?;
    let rate = |t: Duration| n as f64 / t.as_secs_f64().max(1e-9) / 1e9;
    let record = |case: &str, t: Duration, route: String| {
        let mut r = Record::versus(
            SUITE,
            (case, "reads/s", "G reads/s"),
            rate(t),
            "plain device array, same kernel",
            rate(theirs),
            true,
        );
        r.bytes = 8;
        r.route = route;
        r
    };
    let mib = bytes >> 20;
    let note = format!(
        "hit path at {wide} threads: gather {:.2} G reads/s ({:.2}x plain), resident {:.2} \
         ({:.2}x), plain {:.2}",
        rate(ours_wide),
        rate(ours_wide) / rate(theirs_wide),
        rate(resident_wide),
        rate(resident_wide) / rate(theirs_wide),
        rate(theirs_wide)
    );
    Ok((
        record(
            "hit_path",
            ours,
            format!("{mib} MiB array, fully cached, 4 KiB pages"),
        ),
        record(
            "hit_path_resident",
            resident,
            format!("{mib} MiB array held in the cache (no pins), 4 KiB pages"),
        ),
        note,
    ))
}

/// Cold 4 KiB page misses per second against the ring's raw reads and the host engine (misses
/// through the ring), and read in place against the host engine.
fn miss_path(ctx: &Ctx<'_>) -> Result<(Record, Record, Record)> {
    let n = (ctx.opts.rows / 4).max(1024);
    let pages = ctx.size / 4096;
    // Distinct pages: an odd multiplier permutes the page numbers.
    let ids: Vec<u64> = (0..n as u64)
        .map(|k| (k ^ ctx.seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) & (pages - 1))
        .collect();
    let offsets: Vec<u64> = ids.iter().map(|&i| i * 4096).collect();
    let rows = upload_u64s(&ctx.gpu, &ctx.stream, &ids)?;
    let offs = upload_u64s(&ctx.gpu, &ctx.stream, &offsets)?;
    let out = ctx.gpu.alloc(n * 4096)?;
    // A fresh array each pass (its pages all uncached): every access misses. The cache and
    // its ring proxy stay, as they would in a program. Through the ring, each array pass is
    // paired with a pass of raw ring reads of the same pages through the same ring and proxy
    // (the array's resource handle): both see the same machine and the same proxy threads,
    // and the ratio is the median of the pairs'. Then read in place, on a cache of its own.
    let results = ctx.gpu.alloc(n * 8)?;
    let raw_out = ctx.gpu.alloc(n * 4096)?;
    // A fresh array's pass over the cold pages (timed: the misses only, since making an
    // array may pin the file's page cache pages); the array is returned for the raw pass.
    let cold_pass = |cache: &PageCache, in_place: bool| -> Result<(OnDemandArray<u64>, Duration)> {
        let array = ctx.array(cache, ctx.size)?;
        if array.reads_in_place() != in_place {
            return Err(BenchError::Options(format!(
                "miss_path: misses {}",
                array.miss_path()
            )));
        }
        let start = Instant::now();
        ctx.array_rows(&array, &rows, n, 4096, &out)?;
        let t = start.elapsed();
        match array.stats().map_err(api)?.misses {
            m if m == n as u64 => Ok((array, t)),
            m => Err(BenchError::Options(format!(
                "miss_path: {m} misses for {n} cold pages"
            ))),
        }
    };
    let pair = |cache: &PageCache| -> Result<(Duration, Duration)> {
        let (array, ours) = cold_pass(cache, false)?;
        let (_, table, ring) = array.hal_parts();
        let start = Instant::now();
        ring_kernels::read_blocks(
            &ctx.stream,
            &ring,
            table.resource(),
            &offs,
            n,
            4096,
            &raw_out,
            &results,
            4096,
        )?;
        Ok((ours, start.elapsed()))
    };
    let cache = ctx.cache(4096, ctx.opts.cache, false)?;
    pair(&cache)?; // loads the kernels and starts the proxy
    let (mut ours_t, mut ring_t, mut pairs) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ctx.opts.reps.max(5) {
        let (a, r) = pair(&cache)?;
        pairs.push(r.as_secs_f64() / a.as_secs_f64().max(1e-9));
        ours_t.push(a);
        ring_t.push(r);
    }
    drop(cache);
    check_rows(&ctx.stream, &out, &offsets, 4096, ctx.seed, "miss_path")?;
    check_rows(
        &ctx.stream,
        &raw_out,
        &offsets,
        4096,
        ctx.seed,
        "miss_path (ring)",
    )?;
    check_results(&ctx.stream, &results, n, 4096, "miss_path: raw ring read")?;
    let (ours, ring) = (median(ours_t), median(ring_t));
    pairs.sort_by(f64::total_cmp);
    let in_place = {
        let cache = ctx.cache(4096, ctx.opts.cache, true)?;
        cold_pass(&cache, true)?;
        let mut t = Vec::new();
        for _ in 0..ctx.opts.reps.max(1) {
            t.push(cold_pass(&cache, true)?.1);
        }
        check_rows(&ctx.stream, &out, &offsets, 4096, ctx.seed, "miss_path")?;
        median(t)
    };
    let io = ctx.session.localio();
    let host = timed(ctx.opts.reps, || {
        io.read_blocks_to_device(&ctx.file, &offsets, 4096, &out, 0)
            .map(drop)
            .map_err(api)
    })?;
    let rate = |t: Duration| n as f64 / t.as_secs_f64().max(1e-9) / 1e6;
    let mut a = Record::versus(
        SUITE,
        ("miss_path", "misses/s", "M/s"),
        rate(ours),
        "raw reads through the same ring (ring_read_blocks, 4096 GPU threads)",
        rate(ring),
        true,
    );
    a.bytes = 4096;
    a.reps = pairs.len();
    a.ratio = pairs[pairs.len() / 2];
    a.route = format!(
        "{n} distinct cold pages, {} proxy threads (one ring for both); ratio: median of {} \
         alternating pairs (range {:.2}-{:.2})",
        ctx.proxies,
        pairs.len(),
        pairs[0],
        pairs[pairs.len() - 1]
    );
    let mut b = Record::versus(
        SUITE,
        ("miss_path_vs_host", "misses/s", "M/s"),
        rate(ours),
        "host LocalIO read_blocks_to_device",
        rate(host),
        true,
    );
    b.bytes = 4096;
    b.route = format!("{n} distinct cold pages, {} proxy threads", ctx.proxies);
    let mut c = Record::versus(
        SUITE,
        ("miss_path_in_place", "misses/s", "M/s"),
        rate(in_place),
        "host LocalIO read_blocks_to_device",
        rate(host),
        true,
    );
    c.bytes = 4096;
    c.route = format!("{n} distinct cold pages, read in place from the pinned page cache");
    Ok((a, b, c))
}
