//! Small calls (`--gather-parts small`): a zero-copy gather of 1, 8 and 64 rows of 656 B (a
//! DSA cache row) from a pinned 256 MiB pool, the index list in host memory, one call at a time
//! as a decode step makes it: the wall time of `MemIo::gather` (zero-copy forced) against the
//! device's time for the same gather (events around its kernel, `Stream::gather_timed`), p50
//! of each over the calls, alternating. The difference is what a small call costs beyond the
//! device's work: staging the list, launching, waiting, reading the kernel's report back.
//! Target: wall ≤ device time + 3 µs. Beside it, the same call through an engine that keeps a
//! resident block on the GPU (`MemIoConfig::resident_linger`: no launch, no driver wait),
//! against the same device time. Every call's rows are checked.

use super::{LATENCY_ROW, lists, make_pool};
use crate::{BenchError, Record, Result, Target};
use gpuio_api::Session;
use gpuio_hal::{DeviceBuffer, HostAllocOptions, HostBuffer, RowIndices, RowKernel, pattern};
use gpuio_transport_memio::{GatherOptions, GatherStrategy, MemIo, MemIoConfig};
use std::time::{Duration, Instant};

/// Rows per call.
const SIZES: [usize; 3] = [1, 8, 64];

/// The small-call cases: records, targets, a note.
pub(super) fn run(
    session: &Session,
    io: &MemIo,
    calls: usize,
    seed: u64,
) -> Result<(Vec<Record>, Vec<Target>, String)> {
    let gpu = session.gpus()[0].clone();
    let stream = gpu.stream()?;
    let pool_len = 256 << 20;
    let pool = make_pool(session, pool_len, seed ^ 0x5a11)?;
    let rows = pool_len / LATENCY_ROW;
    let dst = gpu.alloc(SIZES[2] * LATENCY_ROW)?;
    let mut pinned = HostBuffer::alloc(SIZES[2] * 8, &HostAllocOptions::default())?;
    pinned.pin(&gpu)?;
    let opts = GatherOptions {
        strategy: GatherStrategy::ZeroCopy,
        ..GatherOptions::default()
    };
    let resident_io = MemIo::new(
        session.gpus().to_vec(),
        MemIoConfig {
            resident_linger: Some(Duration::from_millis(100)),
            ..io.config().clone()
        },
    )
    .map_err(|e| BenchError::Gpuio(e.into()))?;
    let (mut records, mut targets, mut notes) = (Vec::new(), Vec::new(), Vec::new());
    for (k, n) in SIZES.into_iter().enumerate() {
        let case = format!("small_gather_{n}x656B");
        let mut resident = Vec::with_capacity(calls);
        let mut wall = Vec::with_capacity(calls);
        let mut device = Vec::with_capacity(calls);
        let mut bare = Vec::with_capacity(calls);
        for call in 0..calls + 16 {
            let idx = lists::uniform(n, rows, seed ^ (call * 131 + n) as u64);
            let t = Instant::now();
            io.gather(&pool, LATENCY_ROW, idx.as_slice(), &dst, 0, &opts)
                .map_err(|e| BenchError::Gpuio(e.into()))?;
            let w = t.elapsed();
            check(&stream, &dst, &idx, &case, seed ^ 0x5a11)?;
            // The device's time for the same rows, the list read from pinned memory.
            for (k, i) in idx.iter().enumerate() {
                pinned.as_mut_slice()[k * 8..k * 8 + 8].copy_from_slice(&i.to_le_bytes());
            }
            let list = RowIndices::Pinned(&pinned);
            let d = stream.gather_timed(&pool, LATENCY_ROW, list, n, &dst, 0, RowKernel::Tuned)?;
            // The stream's own call, untimed: the wall of the launch and the wait alone.
            let list = RowIndices::Pinned(&pinned);
            let t = Instant::now();
            stream.gather(&pool, LATENCY_ROW, list, n, &dst, 0, RowKernel::Tuned)?;
            let b = t.elapsed();
            // Through the resident block.
            let t = Instant::now();
            resident_io
                .gather(&pool, LATENCY_ROW, idx.as_slice(), &dst, 0, &opts)
                .map_err(|e| BenchError::Gpuio(e.into()))?;
            let r = t.elapsed();
            check(&stream, &dst, &idx, &case, seed ^ 0x5a11)?;
            if call >= 16 {
                resident.push(r);
                wall.push(w);
                device.push(d);
                bare.push(b);
            }
        }
        // Every call through the resident engine was its block's (not a launch's).
        let served = resident_io.resident_stats(&gpu).map_or(0, |s| s.calls);
        if served != ((k + 1) * (calls + 16)) as u64 {
            return Err(BenchError::Options(format!(
                "{case}: the resident block answered {served} of the engine's calls"
            )));
        }
        let (w, d, b) = (p50(&mut wall), p50(&mut device), p50(&mut bare));
        let res = p50(&mut resident);
        let extra = w.saturating_sub(d);
        let us = |t: Duration| t.as_secs_f64() * 1e6;
        // A case's wall p50 against the device's time for the launched gather.
        let record = |case: &str, wall: Duration, route: &str| {
            let mut r = Record::versus(
                super::SUITE,
                (case, "wall p50", "us"),
                us(wall),
                "the device's time for the same gather (events)",
                us(d),
                false,
            );
            r.bytes = LATENCY_ROW;
            r.reps = calls;
            r.device = gpu.to_string();
            r.route = route.into();
            r
        };
        records.push(record(
            &case,
            w,
            "zero-copy, host index list, one call at a time",
        ));
        targets.push(Target {
            description: format!("{case}: wall <= device time + 3 us"),
            measured: Some(format!(
                "{:.1} us wall, {:.1} us device: {:.1} us more",
                us(w),
                us(d),
                us(extra)
            )),
            met: Some(extra <= Duration::from_micros(3)),
        });
        // p50 sorted the series: their p99 is at the same place in each.
        let p99 = |v: &[Duration]| us(v.get(v.len() * 99 / 100).copied().unwrap_or_default());
        let launches = resident_io.resident_stats(&gpu).map_or(0, |s| s.launches);
        notes.push(format!(
            "{case}: {:.1} us beyond the device's time; the stream's bare call (launch and wait, \
             no engine) {:.1} us wall; p99 {:.1} us launched, {:.1} resident (its block \
             launched {launches} times so far)",
            us(extra),
            us(b),
            p99(&wall),
            p99(&resident)
        ));
        let case = format!("{case}, resident block");
        records.push(record(
            &case,
            res,
            "zero-copy through a resident block, host index list",
        ));
        targets.push(Target {
            description: format!("{case}: wall <= device time + 3 us"),
            measured: Some(format!(
                "{:.1} us wall, {:.1} us device (launched)",
                us(res),
                us(d)
            )),
            met: Some(res <= d + Duration::from_micros(3)),
        });
    }
    Ok((records, targets, notes.join("; ")))
}

fn p50(v: &mut [Duration]) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Checks the rows of one call against the pool's pattern.
fn check(
    stream: &gpuio_hal::Stream,
    dst: &DeviceBuffer,
    idx: &[u64],
    case: &str,
    seed: u64,
) -> Result<()> {
    let mut got = vec![0u8; idx.len() * LATENCY_ROW];
    stream.download(dst, 0, &mut got)?;
    for (k, &i) in idx.iter().enumerate() {
        let at = i * LATENCY_ROW as u64;
        if let Some(off) =
            pattern::first_deviation(&got[k * LATENCY_ROW..][..LATENCY_ROW], at, seed)
        {
            return Err(BenchError::Corrupt {
                case: case.into(),
                size: LATENCY_ROW,
                offset: at + off as u64,
            });
        }
    }
    Ok(())
}
