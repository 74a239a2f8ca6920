//! B5 — priority: B1's loads timed alone and under a concurrent checkpoint write-back — 1 GB of
//! GPU memory written to a file through the session's scheduler in 64 MiB requests, again and
//! again while the loads run — once submitted at the checkpoint's own class and once at the
//! realtime class. The KV loads are tiered gathers, not scheduler requests: what the classes
//! can change is only when the scheduler lets the checkpoint's requests run.

use super::{Measured, Options, run_gpuio};
use crate::{BenchError, Record, Result};
use gpuio_ai::kv::KvPool;
use gpuio_api::{DeviceBuffer, Endpoint, OpenOptions, Priority, Request, Session};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The checkpoint's size and its requests'.
const CHECKPOINT: usize = 1 << 30;
const PIECE: usize = 64 << 20;

/// Runs B5 over `trace` (`batch` requests per step) with `pools` and `outs` of B1.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    session: &Session,
    pools: &mut [KvPool],
    outs: &[DeviceBuffer],
    trace: &[Vec<u64>],
    batch: usize,
    opts: &Options,
    case: &str,
    device: &str,
) -> Result<(Vec<Record>, Vec<String>)> {
    let path = opts
        .scratch
        .join(format!("gpuio-checkpoint-{}.bin", std::process::id()));
    let alone = run_gpuio(pools, outs, trace, batch, opts)?;
    let mut under = Vec::new();
    for class in [Priority::Checkpoint, Priority::InferenceRealtime] {
        under.push(with_checkpoint(session, &path, class, || {
            run_gpuio(pools, outs, trace, batch, opts)
        })?);
    }
    let _ = std::fs::remove_file(&path);
    let [(own, own_gb), (rt, rt_gb)] = [under[0], under[1]];
    let mut r = Record::versus(
        super::SUITE,
        (
            &format!("B5: {case} under a checkpoint"),
            "exposed p99 per layer",
            "µs",
        ),
        own.p99_us,
        "the checkpoint at the realtime class",
        rt.p99_us,
        false,
    );
    r.route = format!(
        "alone p99 {:.1} µs (p50 {:.1}); checkpoint class p50 {:.1}, realtime class p50 {:.1}",
        alone.p99_us, alone.p50_us, own.p50_us, rt.p50_us
    );
    r.device = device.to_string();
    r.reps = opts.steps;
    let note = format!(
        "B5: {case}: device p99 per layer alone {:.1} µs, under the checkpoint at its class \
         {:.1} µs (wall p50 {:.1}, checkpoint moved {own_gb:.1} GB), at the realtime class \
         {:.1} µs (wall p50 {:.1}, {rt_gb:.1} GB); the loads are gathers the scheduler does not \
         see, so its classes order only the checkpoint's requests",
        alone.p99_us, own.p99_us, own.wall_p50_us, rt.p99_us, rt.wall_p50_us
    );
    Ok((vec![r], vec![note]))
}

/// Runs `f` while a thread writes the checkpoint at `class` over and over; `f`'s figures and
/// the gigabytes the checkpoint wrote meanwhile.
fn with_checkpoint(
    session: &Session,
    path: &Path,
    class: Priority,
    f: impl FnOnce() -> Result<Measured>,
) -> Result<(Measured, f64)> {
    let src = session.alloc_device(0, CHECKPOINT)?;
    let file = session.open_file(path, OpenOptions::CREATE)?;
    let (stop, written) = (AtomicBool::new(false), AtomicU64::new(0));
    std::thread::scope(|s| {
        let writer = s.spawn(|| -> Result<()> {
            while !stop.load(Ordering::Relaxed) {
                let handles = (0..CHECKPOINT / PIECE)
                    .map(|k| {
                        let req = Request::new(
                            Endpoint::device(&src, k * PIECE),
                            Endpoint::file(&file, (k * PIECE) as u64),
                            PIECE,
                        )?
                        .with_priority(class);
                        session.submit(req)
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                for h in handles {
                    h.wait().map_err(gpuio_api::Error::from)?;
                    written.fetch_add(PIECE as u64, Ordering::Relaxed);
                }
            }
            Ok(())
        });
        let measured = f();
        stop.store(true, Ordering::Relaxed);
        let wrote = writer
            .join()
            .map_err(|_| BenchError::Options("the checkpoint writer panicked".into()))?;
        wrote?;
        Ok((measured?, written.load(Ordering::Relaxed) as f64 / 1e9))
    })
}
