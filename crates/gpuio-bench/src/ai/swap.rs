//! B1's device-planned mode: the same trace served by `SwapInKv` and `SwapInBatch` — the
//! hot buffer's bookkeeping on the device, a step one fetch kernel (the critical path, timed)
//! and one install kernel after it (timed apart) for the whole batch. Each request's
//! selection is uploaded to device memory before its step's clock starts (a model's indexer
//! leaves its top-k there); the timed part is the load call.
//!
//! Queued (`SwapInBatch::load_on`): the load follows a stand-in for the indexer on the
//! model's stream (a 128 MiB device copy, some 50-100 µs), so its launch overlaps the GPU's
//! work as a model's host running ahead would have it; the clock runs on the model's stream
//! from the stand-in's end to the point where the stream may read the entries.

use super::{ENTRY, Measured, Options, Steps, ai};
use crate::Result;
use gpuio_ai::kv::{LoadTimes, SwapInBatch, SwapInConfig, SwapInKv, SwapInTarget};
use gpuio_api::{DeviceBuffer, HostPlacement, Session};
use gpuio_hal::gpu::elapsed;
use std::time::Instant;

/// Bytes the indexer's stand-in copies before a queued load.
pub(super) const STAND_IN: usize = 128 << 20;

/// `requests` sequences of one layer of `ctx` tokens, each holding the entries of `source`
/// (`ctx` entries in device memory), with their selection buffers.
pub(super) struct Sequences {
    kvs: Vec<SwapInKv>,
    selections: Vec<DeviceBuffer>,
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
            max_selection: opts.topk,
            gpu: 0,
            placement: HostPlacement::Dram { numa: None },
        };
        let mut bytes = vec![0u8; ctx as usize * ENTRY];
        source.gpu().stream()?.download(source, 0, &mut bytes)?;
        let mut kvs = Vec::with_capacity(requests);
        let mut selections = Vec::with_capacity(requests);
        for _ in 0..requests {
            let kv = SwapInKv::new(session, cfg).map_err(ai)?;
            kv.append(0, &bytes).map_err(ai)?;
            kvs.push(kv);
            selections.push(session.alloc_device(0, 4 * opts.topk)?);
        }
        Ok(Self { kvs, selections })
    }

    /// The trace's steps for the first `batch` sequences, into `outs`; `queued`: each load
    /// queued behind the indexer's stand-in (the wall then is the host's time in the call).
    pub(super) fn run(
        &self,
        session: &Session,
        outs: &[DeviceBuffer],
        trace: &[Vec<u64>],
        batch: usize,
        opts: &Options,
        queued: bool,
    ) -> Result<Measured> {
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
        for (step, sels) in trace.chunks(batch).enumerate() {
            for (sel, buf) in sels.iter().zip(&self.selections) {
                words.clear();
                words.extend(sel.iter().flat_map(|&p| (p as u32).to_le_bytes()));
                stream.upload(&words, buf, 0)?;
            }
            let counts: Vec<usize> = sels.iter().map(Vec::len).collect();
            let (reports, times, wall) = match &stand_in {
                Some((from, to)) => {
                    let indexer = model.copy_device_async(from, 0, to, 0, STAND_IN)?;
                    let start = model.record_event()?;
                    let t = Instant::now();
                    let load = loader.load_on(&model, &counts).map_err(ai)?;
                    let wall = t.elapsed();
                    let end = model.record_event()?;
                    let reports = load.finish().map_err(ai)?;
                    end.synchronize()?;
                    indexer.wait()?;
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
