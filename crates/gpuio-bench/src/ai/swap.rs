//! B1's device-planned mode: the same trace served by `SwapInKv` and `SwapInBatch` — the
//! hot buffer's bookkeeping on the device, a step one fetch kernel (the critical path, timed)
//! and one install kernel after it (timed apart) for the whole batch. Each request's
//! selection is uploaded to device memory before its step's clock starts (a model's indexer
//! leaves its top-k there); the timed part is the load call.

use super::{ENTRY, Measured, Options, Steps, ai};
use crate::Result;
use gpuio_ai::kv::{SwapInBatch, SwapInConfig, SwapInKv, SwapInTarget};
use gpuio_api::{DeviceBuffer, HostPlacement, Session};
use std::time::Instant;

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

    /// The trace's steps for the first `batch` sequences, into `outs`.
    pub(super) fn run(
        &self,
        session: &Session,
        outs: &[DeviceBuffer],
        trace: &[Vec<u64>],
        batch: usize,
        opts: &Options,
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
        let mut steps = Steps::default();
        let mut words = Vec::with_capacity(4 * opts.topk);
        for (step, sels) in trace.chunks(batch).enumerate() {
            for (sel, buf) in sels.iter().zip(&self.selections) {
                words.clear();
                words.extend(sel.iter().flat_map(|&p| (p as u32).to_le_bytes()));
                stream.upload(&words, buf, 0)?;
            }
            let counts: Vec<usize> = sels.iter().map(Vec::len).collect();
            let t = Instant::now();
            let (reports, times) = loader.load_timed(&counts).map_err(ai)?;
            let wall = t.elapsed();
            let reports = reports.into_iter().collect::<gpuio_ai::Result<Vec<_>>>();
            let reports = reports.map_err(ai)?;
            if step >= opts.warmup {
                steps.record(times.exposed, wall, &reports);
                steps.installs.push(times.install.as_secs_f64() * 1e6);
            }
        }
        Ok(steps.measured())
    }
}
