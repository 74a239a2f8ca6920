//! B1's device-planned mode: the same trace served by `SwapInKv` and `SwapInBatch` — the
//! hot buffer's bookkeeping on the device, a step one fetch kernel (the critical path, timed)
//! and one install kernel after it (timed apart) for the whole batch. Each request's
//! selection is uploaded to device memory before its step's clock starts (a model's indexer
//! leaves its top-k there); the timed part is the load call.
//!
//! Queued (`SwapInBatch::load_on`): the load follows a stand-in for the indexer on the
//! model's stream (a 128 MiB device copy, some 50-100 µs, then the selections copied into
//! place from device memory, as the indexer's last act writes its top-k), so its launch
//! overlaps the GPU's work as a model's host running ahead would have it; the clock runs on
//! the model's stream from the stand-in's end to the point where the stream may read the
//! entries.
//!
//! Prefetched (`SwapInBatch::set_prefetch`, on the drifting-score trace of `drift.rs`): the
//! queued load also brings the indexer's next candidates into the hot buffer after its
//! install. The clock is the queued load's; the host then waits for the install and the
//! prefetch (timed apart) before the next step, as a model's next step of the same layer
//! comes some 60 layers later.

use super::drift::drift_trace;
use super::{ENTRY, Measured, Options, QUEUED, Steps, ai, check_output, prefetched};
use crate::{Record, Result};
use gpuio_ai::kv::{LoadTimes, SwapInBatch, SwapInConfig, SwapInKv, SwapInTarget};
use gpuio_api::{DeviceBuffer, HostPlacement, Session};
use gpuio_hal::gpu::elapsed;
use std::time::Instant;

/// Bytes the indexer's stand-in copies before a queued load.
pub(super) const STAND_IN: usize = 128 << 20;

/// How a run's loads are called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// `load_timed`: the call waits, timed by its own events.
    Wait,
    /// `load_on` behind the indexer's stand-in.
    Queued,
    /// `load_on` that also prefetches this many of the trace's candidates after the top-k.
    Prefetched(usize),
}

/// `requests` sequences of one layer of `ctx` tokens, each holding the entries of `source`
/// (`ctx` entries in device memory), with their selection buffers.
pub(super) struct Sequences {
    kvs: Vec<SwapInKv>,
    selections: Vec<DeviceBuffer>,
    /// Where a queued step's selections wait for the indexer's stand-in to copy them.
    staged: Vec<DeviceBuffer>,
}

impl Sequences {
    pub(super) fn new(
        session: &Session,
        requests: usize,
        ctx: u64,
        source: &DeviceBuffer,
        opts: &Options,
    ) -> Result<Self> {
        let cfg = SwapInConfig {
            layers: 1,
            entry_bytes: ENTRY,
            max_tokens: ctx,
            hot_slots: opts.hot_slots,
            max_selection: opts.topk + opts.most_ahead(),
            gpu: 0,
            placement: HostPlacement::Dram { numa: None },
        };
        let mut bytes = vec![0u8; ctx as usize * ENTRY];
        source.gpu().stream()?.download(source, 0, &mut bytes)?;
        let mut kvs = Vec::with_capacity(requests);
        let (mut selections, mut staged) = (Vec::new(), Vec::new());
        for _ in 0..requests {
            let kv = SwapInKv::new(session, cfg).map_err(ai)?;
            kv.append(0, &bytes).map_err(ai)?;
            kvs.push(kv);
            let words = 4 * (opts.topk + opts.most_ahead());
            selections.push(session.alloc_device(0, words)?);
            staged.push(session.alloc_device(0, words)?);
        }
        Ok(Self {
            kvs,
            selections,
            staged,
        })
    }

    /// The trace's steps for the first `batch` sequences, into `outs`: each selection's top-k
    /// loaded (entries after it prefetched, in `Mode::Prefetched`). Queued, the wall is
    /// the host's time in the call.
    pub(super) fn run(
        &self,
        session: &Session,
        outs: &[DeviceBuffer],
        trace: &[Vec<u64>],
        batch: usize,
        opts: &Options,
        mode: Mode,
    ) -> Result<Measured> {
        let queued = mode != Mode::Wait;
        // The hot buffers carry over from the case before, as the host-planned pools' do;
        // the warm-up steps refill them.
        let stream = self.selections[0].gpu().stream()?;
        let targets: Vec<SwapInTarget<'_>> = (0..batch)
            .map(|i| SwapInTarget {
                kv: &self.kvs[i],
                selection: &self.selections[i],
                dst: &outs[i],
                dst_offset: 0,
            })
            .collect();
        let mut loader = SwapInBatch::new(session, 0, &targets).map_err(ai)?;
        if let Mode::Prefetched(ahead) = mode {
            loader.set_prefetch(&vec![ahead; batch]).map_err(ai)?;
        }
        let model = session.gpu(0)?.stream()?;
        let stand_in = if queued {
            Some((
                session.alloc_device(0, STAND_IN)?,
                session.alloc_device(0, STAND_IN)?,
            ))
        } else {
            None
        };
        let mut steps = Steps::default();
        let mut words = Vec::with_capacity(4 * opts.topk);
        let into = if queued {
            &self.staged
        } else {
            &self.selections
        };
        for (step, sels) in trace.chunks(batch).enumerate() {
            for (sel, buf) in sels.iter().zip(into) {
                words.clear();
                words.extend(sel.iter().flat_map(|&p| (p as u32).to_le_bytes()));
                stream.upload(&words, buf, 0)?;
            }
            let counts: Vec<usize> = sels.iter().map(|s| s.len().min(opts.topk)).collect();
            let (reports, times, wall) = match &stand_in {
                Some((from, to)) => {
                    let mut indexer = vec![model.copy_device_async(from, 0, to, 0, STAND_IN)?];
                    for ((sel, staged), buf) in sels.iter().zip(&self.staged).zip(&self.selections)
                    {
                        let top = model.copy_device_async(staged, 0, buf, 0, 4 * sel.len())?;
                        indexer.push(top);
                    }
                    let start = model.record_event()?;
                    let t = Instant::now();
                    let load = loader.load_on(&model, &counts).map_err(ai)?;
                    let wall = t.elapsed();
                    let end = model.record_event()?;
                    let reports = load.finish().map_err(ai)?;
                    end.synchronize()?;
                    for copy in indexer {
                        copy.wait()?;
                    }
                    if let Mode::Prefetched(_) = mode {
                        let t = Instant::now();
                        let brought = loader.prefetched().map_err(ai)?.unwrap_or_default();
                        if step >= opts.warmup {
                            steps.installs.push(t.elapsed().as_secs_f64() * 1e6);
                            for r in brought {
                                steps.prefetched += r.map_err(ai)?.misses;
                            }
                        }
                    }
                    let exposed = elapsed(&start, &end)?;
                    let times = LoadTimes {
                        exposed,
                        install: Default::default(),
                    };
                    (reports, times, wall)
                }
                None => {
                    let t = Instant::now();
                    let (reports, times) = loader.load_timed(&counts).map_err(ai)?;
                    (reports, times, t.elapsed())
                }
            };
            let reports = reports.into_iter().collect::<gpuio_ai::Result<Vec<_>>>();
            let reports = reports.map_err(ai)?;
            if step >= opts.warmup {
                steps.record(times.exposed, wall, &reports);
                if !queued {
                    steps.installs.push(times.install.as_secs_f64() * 1e6);
                }
            }
        }
        Ok(steps.measured())
    }
}

/// The drifting-score trace at overlap 0.9 for `batch` requests, queued loads without and
/// with a prefetch of the candidates ahead: their records against the 8 µs target, and a
/// note on the trace.
pub(super) fn drifting(
    session: &Session,
    sequences: &Sequences,
    outs: &[DeviceBuffer],
    case: &str,
    batch: usize,
    opts: &Options,
    seed: u64,
) -> Result<(Vec<Record>, Vec<String>)> {
    let ctx = sequences.kvs[0].len(0);
    let steps = opts.warmup + opts.steps;
    let t = drift_trace(ctx, batch, steps, opts.topk, &opts.ahead, 0.9, seed);
    let gpu = session.gpu(0)?;
    let last = &t.selections[steps * batch - 1][..opts.topk];
    let mut records = Vec::new();
    let mut modes = vec![(Mode::Queued, QUEUED.to_string())];
    modes.extend(
        opts.ahead
            .iter()
            .map(|&a| (Mode::Prefetched(a), prefetched(a))),
    );
    for (mode, suffix) in modes {
        let m = sequences.run(session, outs, &t.selections, batch, opts, mode)?;
        check_output(gpu, &outs[batch - 1], last, seed)?;
        let metric = format!("exposed p50 per layer{suffix}");
        let mut r = Record::versus(
            super::SUITE,
            (case, &metric, "µs"),
            m.p50_us,
            "the 8 µs target",
            8.0,
            false,
        );
        r.route = format!(
            "hit rate {:.3}, {:.0} misses per step, p99 {:.1} µs, the host {:.1} µs in the call",
            m.hit_rate,
            m.bytes_per_step / ENTRY as f64,
            m.p99_us,
            m.wall_p50_us
        );
        if let Mode::Prefetched(ahead) = mode {
            r.route.push_str(&format!(
                "; then the install and the prefetch of {ahead} candidates bring in {:.0} rows \
                 per step, {:.1} µs the host waits for them (off the clock)",
                m.prefetched_per_step, m.install_p50_us
            ));
        }
        r.reps = opts.steps;
        r.bytes = m.bytes_per_step as usize;
        records.push(r);
    }
    let covered: Vec<String> = (opts.ahead.iter().zip(&t.covered))
        .map(|(a, c)| format!("{:.1}% among its first {a}", 100.0 * c))
        .collect();
    let note = format!(
        "{case}: scores drift by AR(1) with rho {:.6}; consecutive top-{} overlap {:.3}; of the \
         positions a step takes in, {} of the step before's candidates",
        t.rho,
        opts.topk,
        t.overlap,
        covered.join(", ")
    );
    Ok((records, vec![note]))
}
