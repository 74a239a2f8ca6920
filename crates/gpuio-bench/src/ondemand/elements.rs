//! The element cases, `element_gather_{zipf,uniform}`: 4-byte elements (a float feature, an
//! id) read at random by GPU threads, a thread per element (`gpuio_array<uint32_t>::gather`),
//! from a read-only array over the warm file, four times the cache, in steady state (a pass
//! first, then timed passes). Zipf(0.9) draws 64-byte lines (a row of 16 floats) and a
//! uniform element within; uniform draws any element. The array reads in place with the
//! cache's default admission ([`DEFAULT_ADMIT_AFTER`]); the note gives the other settings'
//! rates and bytes moved per byte delivered, measured the same way.
//!
//! Beside it, the same reads through an array over host memory holding the file (read in
//! place from it: the host memory source), and the bus's own rate for them: the same kernel
//! shape reading pinned host memory holding the file directly (zero-copy, no cache, no
//! protocol), the limit any in-place read meets.
//!
//! Peers in the same run: a CPU gather then one copy to the GPU — one thread, as NumPy's
//! fancy index runs (from the file's bytes in memory: what a memory map of the warm file
//! reads, without its page faults), and all cores; and UVM first touch: the file in managed
//! memory, written by the host, then read by the same kernel shape straight from it (each
//! pass a fresh allocation, so every page starts on the host). Every kernel runs
//! [`Options::element_threads`](super::Options) threads (in-place reads hold no ring slot, so
//! more threads keep more reads in flight). Every value is checked.

use super::{Ctx, SUITE, median, row_ids, timed, upload_u64s};
use crate::localio::api;
use crate::{BenchError, Record, Result, Target};
use gpuio_core::ondemand::{ArrayMode, DEFAULT_ADMIT_AFTER, OnDemandArray};
use gpuio_core::{Endpoint, HostMemory};
use gpuio_hal::{DeviceBuffer, HostAllocOptions, HostBuffer, pattern};
use gpuio_ring::ondemand::ops::{self as array_kernels, WordSource};
use rayon::prelude::*;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// The settings measured besides the default, as (page size, admit_after): every miss
/// cached, 8, 32 touches first, never (`u32::MAX`), and 512-byte pages at their break-even
/// (16 touches of a 32-byte sector cost a page).
const SWEEP: [(usize, u32); 5] = [
    (4096, 0),
    (4096, 8),
    (4096, 32),
    (4096, u32::MAX),
    (512, 16),
];

/// One element case: its record, its targets, and a note with the sweep and the peers.
pub(super) fn element_gather(ctx: &Ctx<'_>, zipf: bool) -> Result<(Record, Vec<Target>, String)> {
    let case = format!("element_gather_{}", if zipf { "zipf" } else { "uniform" });
    let n = ctx.opts.rows * 16;
    let elements = ctx.size / 4;
    let idx: Vec<u64> = if zipf {
        let lines = row_ids(ctx.size / 64, n, true, ctx.seed ^ 0xe1e);
        lines
            .iter()
            .enumerate()
            .map(|(k, &l)| l * 16 + (pattern::mix64(ctx.seed ^ k as u64) & 15))
            .collect()
    } else {
        row_ids(elements, n, false, ctx.seed ^ 0xe1e)
    };
    let expected: Vec<u32> = idx.par_iter().map(|&i| element(ctx.seed, i)).collect();
    let idx_buf = upload_u64s(&ctx.gpu, &ctx.stream, &idx)?;
    let out = ctx.gpu.alloc(n * 4)?;
    let check = |what: &str| check_all(ctx, &out, &expected, &idx, &format!("{case} ({what})"));
    let rate = |t: Duration| n as f64 / t.as_secs_f64().max(1e-9) / 1e6;

    let threads = ctx.opts.element_threads;
    // The file's bytes in host memory: the CPU gathers' source, an array's, and the
    // zero-copy kernel's.
    let mut words = HostBuffer::alloc(ctx.size as usize, &HostAllocOptions::default())?;
    read_file(ctx, &mut words)?;
    let memory = HostMemory::new(words);

    // The array over the file, at the default admission and the sweep's; then over host
    // memory at the default.
    let mut ours = None;
    let mut sweep = Vec::new();
    let default = (4096, DEFAULT_ADMIT_AFTER);
    let sources = std::iter::once(default)
        .chain(SWEEP)
        .map(|s| (s, Endpoint::file(&ctx.file, 0)))
        .chain([(default, Endpoint::host(&memory, 0))]);
    for ((page, admit), source) in sources {
        let over_memory = matches!(source, Endpoint::Host { .. });
        let cache = ctx.cache_admitting(page, ctx.opts.cache, admit)?;
        let array: OnDemandArray<u32> = cache
            .array(source, elements, ArrayMode::ReadOnly)
            .map_err(api)?;
        if !array.reads_in_place() {
            return Err(BenchError::Options(format!(
                "{case}: the array does not read in place ({})",
                array.miss_path()
            )));
        }
        let t = timed(ctx.opts.reps, || {
            gather(ctx, &array, &idx_buf, n, &out, threads)
        })?;
        check(&format!("admit_after {admit}"))?;
        let s = array.stats().map_err(api)?;
        let moved = s.moved_per_delivered(4).unwrap_or(0.0);
        let shown = if admit == u32::MAX {
            "never".to_string()
        } else {
            admit.to_string()
        };
        let over = if over_memory {
            "over host memory, "
        } else {
            ""
        };
        sweep.push(format!(
            "{over}{page} B pages, admit_after {shown}: {:.1} M reads/s, {moved:.1} bytes moved per byte, {:.0}% in place, {} pages cached",
            rate(t),
            100.0 * s.direct_reads as f64 / s.accesses().max(1) as f64,
            s.misses
        ));
        if ours.is_none() {
            ours = Some((t, moved));
        }
    }
    let (ours, moved) = ours.unwrap_or_default();

    // CPU gathers from the file's bytes, then one copy.
    let read = memory.read();
    let words: &[u8] = &read;
    let mut pinned = HostBuffer::alloc(n * 4, &HostAllocOptions::default())?;
    let mut cpu = |parallel: bool| -> Result<Duration> {
        let t = timed(ctx.opts.reps, || {
            let dst: &mut [u8] = &mut pinned;
            if parallel {
                dst.par_chunks_mut(4 * 4096)
                    .zip(idx.par_chunks(4096))
                    .for_each(|(d, ids)| put(d, ids, words));
            } else {
                put(dst, &idx, words);
            }
            ctx.stream.upload(&pinned, &out, 0)?;
            Ok(())
        })?;
        check(if parallel {
            "CPU gather, all cores"
        } else {
            "CPU gather"
        })?;
        Ok(t)
    };
    let (one_core, all_cores) = (cpu(false)?, cpu(true)?);
    drop(read);

    // The bus's rate: the kernel reading the pinned bytes directly.
    let mut words = memory
        .into_inner()
        .ok_or_else(|| BenchError::Options("the host memory is still shared".into()))?;
    words.pin(&ctx.gpu)?;
    let zero_copy = timed(ctx.opts.reps, || {
        let from = WordSource::Pinned(&words);
        Ok(array_kernels::bench_reads_u32(
            &ctx.stream,
            from,
            &idx_buf,
            n,
            &out,
            threads,
        )?)
    })?;
    check("zero-copy")?;

    // UVM first touch: a fresh managed copy of the file per pass, written by the host.
    let mut uvm = Vec::new();
    for _ in 0..ctx.opts.reps.max(1) {
        let mut managed = ctx.gpu.alloc_managed(ctx.size as usize)?;
        managed.write(0, &words)?;
        let start = Instant::now();
        let from = WordSource::Device(managed.device());
        array_kernels::bench_reads_u32(&ctx.stream, from, &idx_buf, n, &out, threads)?;
        uvm.push(start.elapsed());
    }
    check("UVM")?;
    drop(words);
    let uvm = median(uvm);

    let (ours_r, one_r, all_r, uvm_r) = (rate(ours), rate(one_core), rate(all_cores), rate(uvm));
    let bus_r = rate(zero_copy);
    let mut r = Record::versus(
        SUITE,
        (&case, "reads/s", "M reads/s"),
        ours_r,
        "CPU gather (one thread, as NumPy) + one copy",
        one_r,
        true,
    );
    r.bytes = 4;
    r.route = format!(
        "{threads} GPU threads, {} MiB cache of {} MiB, in place, admit_after {DEFAULT_ADMIT_AFTER}",
        ctx.opts.cache >> 20,
        ctx.size >> 20
    );
    let targets = vec![
        Target {
            description: format!("{case}: >= 5x a CPU gather (one thread, as NumPy) + one copy"),
            measured: Some(format!(
                "{ours_r:.1} vs {one_r:.1} M reads/s ({:.2}x)",
                r.ratio
            )),
            met: Some(r.ratio >= 5.0),
        },
        Target {
            description: format!(
                "{case}: >= 0.8x the bus's rate for the same reads (zero-copy kernel, no cache)"
            ),
            measured: Some(format!(
                "{ours_r:.1} vs {bus_r:.1} M reads/s ({:.2}x)",
                ours_r / bus_r.max(1e-9)
            )),
            met: Some(ours_r >= 0.8 * bus_r),
        },
        Target {
            description: format!("{case}: >= 10x UVM first touch, same kernel"),
            measured: Some(format!(
                "{ours_r:.1} vs {uvm_r:.1} M reads/s ({:.2}x)",
                ours_r / uvm_r.max(1e-9)
            )),
            met: Some(ours_r >= 10.0 * uvm_r),
        },
    ];
    let note = format!(
        "{case} ({threads} GPU threads): ours {ours_r:.1} M reads/s ({moved:.1} bytes moved per \
         byte delivered); the bus's rate (zero-copy reads of pinned host memory, same kernel) \
         {bus_r:.1} ({:.2}x of it); CPU gather + copy {one_r:.1} on one thread, {all_r:.1} on \
         all cores ({:.2}x); UVM first touch {uvm_r:.1}. {}",
        ours_r / bus_r.max(1e-9),
        ours_r / all_r.max(1e-9),
        sweep.join("; ")
    );
    Ok((r, targets, note))
}

/// Element `i` of the file's u32s (pattern words, little-endian).
fn element(seed: u64, i: u64) -> u32 {
    (pattern::word_at(seed, i / 2) >> (32 * (i % 2))) as u32
}

/// `dst[k] = words[ids[k]]` for 4-byte words.
fn put(dst: &mut [u8], ids: &[u64], words: &[u8]) {
    for (d, &i) in dst.chunks_exact_mut(4).zip(ids) {
        let at = i as usize * 4;
        d.copy_from_slice(&words[at..at + 4]);
    }
}

fn gather(
    ctx: &Ctx<'_>,
    array: &OnDemandArray<u32>,
    idx: &DeviceBuffer,
    n: usize,
    out: &DeviceBuffer,
    threads: u32,
) -> Result<()> {
    let (m, t, ring) = array.hal_parts();
    let from = WordSource::Array(m.as_ref(), t, &ring);
    array_kernels::bench_reads_u32(&ctx.stream, from, idx, n, out, threads)?;
    array.check().map_err(api)
}

/// The whole file into `dst`.
fn read_file(ctx: &Ctx<'_>, dst: &mut [u8]) -> Result<()> {
    std::fs::File::open(&ctx.path)
        .and_then(|f| f.read_exact_at(dst, 0))
        .map_err(|e| BenchError::Options(format!("reading the test file: {e}")))
}

/// Checks every element of `out` against `expected`.
fn check_all(
    ctx: &Ctx<'_>,
    out: &DeviceBuffer,
    expected: &[u32],
    idx: &[u64],
    case: &str,
) -> Result<()> {
    let mut got = vec![0u8; expected.len() * 4];
    ctx.stream.download(out, 0, &mut got)?;
    match got
        .chunks_exact(4)
        .zip(expected)
        .position(|(g, &e)| g != e.to_le_bytes())
    {
        Some(k) => Err(BenchError::Corrupt {
            case: case.into(),
            size: 4,
            offset: idx[k] * 4,
        }),
        None => Ok(()),
    }
}
