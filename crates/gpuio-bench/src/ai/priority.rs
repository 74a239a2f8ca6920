//! B5 — priority: B1's decode steps (KV loads, the realtime class) timed alone and beside the
//! AI tier's background IO, all of it running again and again while the steps run:
//! - an Engram prefetch: 64 Ki random rows of a 1 GiB table (256-byte rows) into GPU memory;
//! - KV stores: 4096 entries of another sequence from GPU memory into its pool;
//! - a checkpoint: 1 GiB of GPU memory written to a file through the scheduler, 64 MiB
//!   requests.
//!
//! Classes on: each in its own class (prefetch and stores background, the checkpoint its
//! own), the decode's loads holding realtime leases, so the scheduler holds the rest back while
//! a step loads. Classes off: the same load with every part in the realtime class, so nothing
//! is told apart. The target: a step's p99 with classes on within 1.2× of the step alone.

use super::{ENTRY, Measured, Options, run_gpuio};
use crate::{BenchError, Record, Result};
use gpuio_ai::AiWork;
use gpuio_ai::engram::EngramTable;
use gpuio_ai::kv::{KvPool, KvPoolConfig};
use gpuio_api::{DeviceBuffer, Endpoint, HostPlacement, OpenOptions, Priority, Request, Session};
use gpuio_hal::pattern::mix64;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The checkpoint's size and its requests'.
const CHECKPOINT: usize = 1 << 30;
const PIECE: usize = 64 << 20;
/// The Engram table: rows and row size (1 GiB), and rows per prefetch.
const ROWS: u64 = 1 << 22;
const ROW: usize = 256;
const PREFETCH_ROWS: usize = 1 << 16;
/// KV entries per background store.
const STORE_ENTRIES: usize = 4096;

/// What ran beside the steps: bytes each part moved.
#[derive(Debug, Clone, Copy, Default)]
struct Moved {
    prefetch: f64,
    stores: f64,
    checkpoint: f64,
}

/// Runs B5 over `trace` (`batch` requests per step) with `pools` and `outs` of B1.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    session: &Arc<Session>,
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
    let background = Background::new(session, &path)?;
    let alone = run_gpuio(pools, outs, trace, batch, opts)?;
    let (on, on_moved) = background.beside(true, || run_gpuio(pools, outs, trace, batch, opts))?;
    let (off, off_moved) =
        background.beside(false, || run_gpuio(pools, outs, trace, batch, opts))?;
    drop(background);
    let _ = std::fs::remove_file(&path);
    let mut r = Record::versus(
        super::SUITE,
        (
            &format!("B5: {case} beside the AI background IO"),
            "exposed p99 per layer",
            "µs",
        ),
        on.p99_us,
        "the same load, classes off",
        off.p99_us,
        false,
    );
    r.route = format!(
        "alone p99 {:.1} µs (p50 {:.1}); classes on p50 {:.1}, off p50 {:.1}; on/alone p99 {:.2}x",
        alone.p99_us,
        alone.p50_us,
        on.p50_us,
        off.p50_us,
        on.p99_us / alone.p99_us.max(1e-9)
    );
    r.device = device.to_string();
    r.reps = opts.steps;
    let gb = |m: &Moved| {
        format!(
            "prefetch {:.2} GB, KV stores {:.2} GB, checkpoint {:.2} GB",
            m.prefetch / 1e9,
            m.stores / 1e9,
            m.checkpoint / 1e9
        )
    };
    let note = format!(
        "B5: {case}: device p99 per layer alone {:.1} µs, wall p50 {:.1}; beside the background \
         with classes on {:.1} µs (wall p50 {:.1}; {}), classes off {:.1} µs (wall p50 {:.1}; {})",
        alone.p99_us,
        alone.wall_p50_us,
        on.p99_us,
        on.wall_p50_us,
        gb(&on_moved),
        off.p99_us,
        off.wall_p50_us,
        gb(&off_moved)
    );
    Ok((vec![r], vec![note]))
}

/// The background parts' state: the checkpoint's source and file, the Engram table, the
/// stores' pool and source.
struct Background<'a> {
    session: &'a Arc<Session>,
    checkpoint: DeviceBuffer,
    file: gpuio_api::FileHandle,
    table: EngramTable,
    rows_out: DeviceBuffer,
    pool: std::sync::Mutex<KvPool>,
    entries: DeviceBuffer,
}

impl<'a> Background<'a> {
    fn new(session: &'a Arc<Session>, path: &Path) -> Result<Self> {
        let ai = |e: gpuio_ai::AiError| BenchError::Options(format!("B5: {e}"));
        let dram = HostPlacement::Dram { numa: None };
        let pool = KvPool::new(
            session,
            KvPoolConfig {
                layers: 1,
                entry_bytes: ENTRY,
                max_tokens: STORE_ENTRIES as u64,
                warm_entries: STORE_ENTRIES as u64,
                hot_slots: 64,
                max_selection: 64,
                gpu: 0,
                placement: dram,
            },
        )
        .map_err(ai)?;
        Ok(Self {
            session,
            checkpoint: session.alloc_device(0, CHECKPOINT)?,
            file: session.open_file(path, OpenOptions::CREATE)?,
            table: EngramTable::new(session, ROWS, ROW, dram).map_err(ai)?,
            rows_out: session.alloc_device(0, PREFETCH_ROWS * ROW)?,
            pool: std::sync::Mutex::new(pool),
            entries: session.alloc_device(0, STORE_ENTRIES * ENTRY)?,
        })
    }

    /// Runs `f` while the three parts run over and over (each in its own class where
    /// `classes`, all realtime otherwise); `f`'s figures and what the parts moved meanwhile.
    fn beside(
        &self,
        classes: bool,
        f: impl FnOnce() -> Result<Measured>,
    ) -> Result<(Measured, Moved)> {
        let (stop, moved) = (
            &AtomicBool::new(false),
            &[AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
        );
        let failed = |what: &str, e: String| BenchError::Options(format!("B5 {what}: {e}"));
        std::thread::scope(|s| {
            let prefetch = s.spawn(|| -> Result<()> {
                let mut table = self.table.clone();
                if !classes {
                    table
                        .set_work(AiWork::Decode)
                        .map_err(|e| failed("prefetch", e.to_string()))?;
                }
                for k in 0u64.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let ids: Vec<u64> = (0..PREFETCH_ROWS as u64)
                        .map(|i| mix64(k << 20 ^ i) % ROWS)
                        .collect();
                    let r = if classes {
                        let p = table
                            .prefetch(self.session, ids, self.rows_out.clone(), 0)
                            .map_err(|e| failed("prefetch", e.to_string()))?;
                        p.wait()
                    } else {
                        table.lookup(self.session, &ids, &self.rows_out, 0)
                    };
                    r.map_err(|e| failed("prefetch", e.to_string()))?;
                    moved[0].fetch_add((PREFETCH_ROWS * ROW) as u64, Ordering::Relaxed);
                }
                Ok(())
            });
            let stores = s.spawn(|| -> Result<()> {
                let mut pool = self
                    .pool
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                pool.set_work(if classes {
                    AiWork::Prefetch
                } else {
                    AiWork::Decode
                })
                .map_err(|e| failed("KV store", e.to_string()))?;
                while !stop.load(Ordering::Relaxed) {
                    pool.store(self.session, 0, 0, STORE_ENTRIES, &self.entries, 0, None)
                        .map_err(|e| failed("KV store", e.to_string()))?;
                    moved[1].fetch_add((STORE_ENTRIES * ENTRY) as u64, Ordering::Relaxed);
                }
                Ok(())
            });
            let class = if classes {
                Priority::Checkpoint
            } else {
                Priority::InferenceRealtime
            };
            let checkpoint = s.spawn(move || -> Result<()> {
                while !stop.load(Ordering::Relaxed) {
                    let handles = (0..CHECKPOINT / PIECE)
                        .map(|k| {
                            let req = Request::new(
                                Endpoint::device(&self.checkpoint, k * PIECE),
                                Endpoint::file(&self.file, (k * PIECE) as u64),
                                PIECE,
                            )?
                            .with_priority(class);
                            self.session.submit(req)
                        })
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    for h in handles {
                        h.wait().map_err(gpuio_api::Error::from)?;
                        moved[2].fetch_add(PIECE as u64, Ordering::Relaxed);
                    }
                }
                Ok(())
            });
            let measured = f();
            stop.store(true, Ordering::Relaxed);
            for (what, t) in [
                ("prefetch", prefetch),
                ("KV stores", stores),
                ("checkpoint", checkpoint),
            ] {
                t.join().map_err(|_| {
                    BenchError::Options(format!("B5: the {what} thread panicked"))
                })??;
            }
            let m = |i: usize| moved[i].load(Ordering::Relaxed) as f64;
            Ok((
                measured?,
                Moved {
                    prefetch: m(0),
                    stores: m(1),
                    checkpoint: m(2),
                },
            ))
        })
    }
}
