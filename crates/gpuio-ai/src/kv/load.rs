//! Loads: a selection planned against the hot buffer (hits, misses, the slots the misses take),
//! written as one code per entry, and every load of a call moved by one tiered gather — an
//! upload of the codes, one kernel, one wait — whether one request's
//! ([`KvPool::load`](super::KvPool::load)) or a whole batch's ([`KvBatch::load`]). The kernel
//! copies each hit from its slot and each miss from pinned host memory, writing a miss into the
//! slot it takes on the way (slots this step reads are never taken, so no slot is written while
//! read).

use super::{KvPool, LoadReport};
use crate::{AiError, AiWork, Result};
use gpuio_ai_device::{
    TieredRows, TieredSource, gather_tiered, gather_tiered_timed, tiered_stage_len,
};
use gpuio_api::DeviceBuffer;
use gpuio_hal::{HostAllocOptions, HostBuffer, Stream};
use std::time::Duration;

/// One request's load within a batch: the entries of `layer` at `selection` into `dst` from
/// `dst_offset`, as [`KvPool::load`](super::KvPool::load) takes them.
#[derive(Debug)]
pub struct KvLoad<'a> {
    /// The request's pool.
    pub pool: &'a mut KvPool,
    /// The layer.
    pub layer: usize,
    /// The positions, in output order.
    pub selection: &'a [u64],
    /// Where the entries go.
    pub dst: &'a DeviceBuffer,
    /// Byte offset in `dst`.
    pub dst_offset: usize,
}

/// The codes' stage: pinned host memory and its device copy, and the stream that moves them.
pub(super) struct Stage {
    pub(super) host: HostBuffer,
    pub(super) device: DeviceBuffer,
    pub(super) stream: Stream,
}

impl Stage {
    /// A stage of at least `len` bytes on `gpu`.
    pub(super) fn new(gpu: &gpuio_api::Gpu, len: usize) -> Result<Self> {
        Ok(Self {
            host: HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), gpu)?,
            device: gpu.alloc(len)?,
            stream: gpu.stream()?,
        })
    }
}

/// What `prepare` did to a pool, kept to undo it if the gather fails.
pub(super) struct Prepared {
    pub(super) report: LoadReport,
    /// The misses, each given a slot before the gather fills it.
    misses: Vec<u64>,
}

impl KvPool {
    /// Checks a load, plans it against the hot buffer (the misses take their slots now),
    /// brings cold misses back to host memory and writes one code per selected entry into
    /// `codes` (8 bytes each).
    pub(super) fn prepare(
        &mut self,
        layer: usize,
        selection: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
        codes: &mut [u8],
    ) -> Result<Prepared> {
        self.check_layer(layer)?;
        self.check_selection(selection)?;
        let (e, slots) = (self.cfg.entry_bytes, self.cfg.hot_slots as u64);
        let len = self.len(layer);
        if let Some(p) = selection.iter().find(|&&p| p >= len) {
            return Err(AiError::InvalidArgument(format!(
                "position {p} of layer {layer}, which holds {len} tokens"
            )));
        }
        gpuio_hal::check_range(
            "KV load destination",
            dst_offset,
            selection.len() * e,
            dst.len(),
        )
        .map_err(gpuio_api::Error::from)?;
        if selection.is_empty() {
            return Ok(Prepared {
                report: LoadReport::default(),
                misses: Vec::new(),
            });
        }
        self.step += 1;
        let plan = self.hot[layer]
            .plan(selection, self.step, len)
            .map_err(|p| {
                AiError::InvalidArgument(format!(
                    "position {p} of layer {layer}, which holds {len} tokens"
                ))
            })?;
        let from_cold = self.bring_back(layer, &plan.misses)?;
        let victims = match plan.misses.len() {
            0 => Vec::new(),
            _ => self.hot[layer].install(&plan.misses, self.step),
        };
        let res = &self.residence[layer];
        let mut installed = vec![false; plan.misses.len()];
        for (word, &row) in codes.chunks_exact_mut(8).zip(&plan.rows) {
            let source = match row.checked_sub(slots) {
                None => TieredSource::Hot(row),
                Some(j) => {
                    let j = j as usize;
                    // Installed by its first occurrence only.
                    let first = !std::mem::replace(&mut installed[j], true);
                    TieredSource::Warm {
                        row: res[plan.misses[j] as usize],
                        install: first.then(|| victims[j]),
                    }
                }
            };
            // Every row fits a code: `KvPool::new` bounds the slots and the warm rows.
            word.copy_from_slice(&source.code().unwrap_or(u64::MAX).to_le_bytes());
        }
        Ok(Prepared {
            report: LoadReport {
                selected: selection.len(),
                hits: plan.hits,
                misses: plan.misses.len(),
                from_cold,
                bytes_from_host: (plan.misses.len() * e) as u64,
            },
            misses: plan.misses,
        })
    }

    fn check_selection(&self, selection: &[u64]) -> Result<()> {
        if selection.len() > self.cfg.max_selection {
            return Err(AiError::InvalidArgument(format!(
                "a selection of {} entries, more than the pool's {}",
                selection.len(),
                self.cfg.max_selection
            )));
        }
        Ok(())
    }

    /// Undoes a prepared load whose gather failed: its misses' slots did not get their
    /// entries, so they are forgotten rather than served.
    fn unprepare(&mut self, layer: usize, prepared: &Prepared) {
        let hot = &mut self.hot[layer];
        prepared.misses.iter().for_each(|&p| hot.drop_entry(p));
    }
}

/// One worker's share of a batch's planning: consecutive loads and their codes' bytes.
struct Share<'l, 'a> {
    loads: &'l mut [KvLoad<'a>],
    codes: &'l mut [u8],
    done: Vec<Result<Prepared>>,
}

impl Share<'_, '_> {
    fn prepare(&mut self) {
        let mut at = 0;
        for l in self.loads.iter_mut() {
            let codes = &mut self.codes[at..at + 8 * l.selection.len()];
            let r = l
                .pool
                .prepare(l.layer, l.selection, l.dst, l.dst_offset, codes);
            self.done.push(r);
            at += codes.len();
        }
    }
}

/// Runs `loads` as one tiered gather through `stage` (large enough for them all), planning
/// them on `workers` where given (each load's planning is its own pool's: independent).
pub(super) fn run(
    loads: &mut [KvLoad<'_>],
    stage: &mut Stage,
    workers: Option<&rayon::ThreadPool>,
    timed: bool,
) -> Result<(Vec<LoadReport>, Duration)> {
    let Some(first) = loads.first() else {
        return Ok((Vec::new(), Duration::ZERO));
    };
    // The loads move under one scheduler lease: the most urgent of their pools' work.
    let work = loads
        .iter()
        .map(|l| l.pool.work())
        .min_by_key(AiWork::priority)
        .unwrap_or(AiWork::Decode);
    let _lease = work.lease(&first.pool.lessor)?;
    let e = first.pool.cfg.entry_bytes;
    if let Some(l) = loads.iter().find(|l| l.pool.cfg.entry_bytes != e) {
        return Err(AiError::InvalidArgument(format!(
            "one batch of {e}-byte and {}-byte KV entries",
            l.pool.cfg.entry_bytes
        )));
    }
    for l in loads.iter() {
        l.pool.check_selection(l.selection)?;
    }
    let rows: usize = loads.iter().map(|l| l.selection.len()).sum();
    if tiered_stage_len(rows, loads.len()) > stage.host.len() {
        return Err(AiError::InvalidArgument(format!(
            "{rows} entries of {} loads overflow the stage",
            loads.len()
        )));
    }
    let prepared = prepare_all(loads, &mut stage.host[..8 * rows], workers)?;
    let moved = {
        let warm: Vec<_> = loads.iter().map(|l| l.pool.warm.read()).collect();
        let jobs: Vec<TieredRows<'_>> = loads
            .iter()
            .zip(&warm)
            .map(|(l, warm)| TieredRows {
                hot: &l.pool.hot[l.layer].buf,
                warm,
                dst: l.dst,
                dst_offset: l.dst_offset,
                count: l.selection.len(),
            })
            .collect();
        let stream = &stage.stream;
        if timed {
            gather_tiered_timed(stream, e, &jobs, &mut stage.host, &stage.device)
        } else {
            gather_tiered(stream, e, &jobs, &mut stage.host, &stage.device).map(|()| Duration::ZERO)
        }
    };
    match moved {
        Ok(t) => Ok((prepared.into_iter().map(|p| p.report).collect(), t)),
        Err(err) => {
            undo(loads, &prepared);
            Err(gpuio_api::Error::from(err).into())
        }
    }
}

/// Plans every load, writing its codes; where one is refused, undoes the others.
fn prepare_all(
    loads: &mut [KvLoad<'_>],
    mut codes: &mut [u8],
    workers: Option<&rayon::ThreadPool>,
) -> Result<Vec<Prepared>> {
    let count = loads.len();
    let threads = workers
        .map_or(1, |w| w.current_num_threads())
        .clamp(1, count);
    let per = loads.len().div_ceil(threads);
    let mut shares = Vec::with_capacity(threads);
    let mut rest = &mut *loads;
    while !rest.is_empty() {
        let (mine, others) = rest.split_at_mut(per.min(rest.len()));
        let bytes = 8 * mine.iter().map(|l| l.selection.len()).sum::<usize>();
        let (own, after) = codes.split_at_mut(bytes);
        shares.push(Share {
            loads: mine,
            codes: own,
            done: Vec::with_capacity(per),
        });
        (rest, codes) = (others, after);
    }
    let ran = match workers {
        Some(pool) if shares.len() > 1 => {
            gpuio_hal::workers::run_workers(pool, &mut shares, |s, _| {
                s.prepare();
                Ok::<(), AiError>(())
            })
        }
        _ => {
            shares.iter_mut().for_each(Share::prepare);
            Ok(())
        }
    };
    // Per load, in order: what its planning gave (none where its worker panicked first).
    let mut outcome: Vec<Option<Result<Prepared>>> = Vec::with_capacity(count);
    for s in shares {
        let end = outcome.len() + s.loads.len();
        outcome.extend(s.done.into_iter().map(Some));
        outcome.resize_with(end, || None);
    }
    let mut first_err = ran.err();
    let mut prepared = Vec::with_capacity(outcome.len());
    for r in outcome {
        prepared.push(match r {
            Some(Ok(p)) => Some(p),
            Some(Err(e)) => {
                first_err.get_or_insert(e);
                None
            }
            None => None,
        });
    }
    if let Some(e) = first_err {
        for (l, p) in loads.iter_mut().zip(&prepared) {
            if let Some(p) = p {
                l.pool.unprepare(l.layer, p);
            }
        }
        return Err(e);
    }
    Ok(prepared.into_iter().flatten().collect())
}

fn undo(loads: &mut [KvLoad<'_>], prepared: &[Prepared]) {
    for (l, p) in loads.iter_mut().zip(prepared) {
        l.pool.unprepare(l.layer, p);
    }
}

/// Loads for a batch of requests at once — a decode step's loads of one layer for every
/// request: all their codes in one upload, one kernel, one wait, instead of a round trip per
/// request; the loads are planned on a thread per core. Keeps its stage and threads between
/// calls, the stage grown as batches need.
#[derive(Default)]
pub struct KvBatch {
    stage: Option<Stage>,
    /// Threads that plan a batch's loads in parallel, started with the first batch.
    workers: Option<rayon::ThreadPool>,
}

impl std::fmt::Debug for KvBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvBatch")
            .field("stage_bytes", &self.stage.as_ref().map(|s| s.host.len()))
            .finish()
    }
}

impl KvBatch {
    /// A batch loader with no stage yet (the first load makes one).
    pub fn new() -> Self {
        Self::default()
    }

    /// Loads every request's selection, as [`KvPool::load`](super::KvPool::load) does one;
    /// their reports in order. Every destination must be on one GPU, with every pool's
    /// entries of one size; a pool appears once (each load borrows its own). Where one load
    /// is refused, or the gather fails, no destination is written and no pool serves a wrong
    /// entry afterwards; but cold entries may have been brought back to host memory, and the
    /// slots the misses took from other entries are left empty (those entries miss next time).
    pub fn load(&mut self, loads: &mut [KvLoad<'_>]) -> Result<Vec<LoadReport>> {
        self.load_all(loads, false).map(|(reports, _)| reports)
    }

    /// [`load`](Self::load), with the device's time for the batch: its upload and kernel, as
    /// CUDA events around them measure it (the planning on the host is not in it; on the
    /// host backend, the copy's time).
    pub fn load_timed(&mut self, loads: &mut [KvLoad<'_>]) -> Result<(Vec<LoadReport>, Duration)> {
        self.load_all(loads, true)
    }

    fn load_all(
        &mut self,
        loads: &mut [KvLoad<'_>],
        timed: bool,
    ) -> Result<(Vec<LoadReport>, Duration)> {
        let Some(first) = loads.first() else {
            return Ok((Vec::new(), Duration::ZERO));
        };
        // Refused before a stage is sized for them.
        for l in loads.iter() {
            l.pool.check_selection(l.selection)?;
        }
        let gpu = first.dst.gpu().clone();
        let rows = loads.iter().map(|l| l.selection.len()).sum();
        let need = tiered_stage_len(rows, loads.len());
        let fits = self
            .stage
            .as_ref()
            .is_some_and(|s| s.host.len() >= need && s.device.gpu().same_device(&gpu));
        if !fits {
            self.stage = None;
            self.stage = Some(Stage::new(&gpu, need.next_power_of_two())?);
        }
        let stage = self
            .stage
            .as_mut()
            .ok_or_else(|| AiError::InvalidArgument("the batch loader has no stage".into()))?;
        if self.workers.is_none() && loads.len() > 1 {
            // Planning one load takes tens of microseconds: a thread per core pays off.
            let threads = std::thread::available_parallelism().map_or(4, |n| n.get().min(16));
            self.workers = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("gpuio-kv-plan-{i}"))
                .build()
                .ok();
        }
        run(loads, stage, self.workers.as_ref(), timed)
    }
}
