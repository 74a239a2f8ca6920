//! HiSparse's scheme with the planning on the device: a sequence's whole sparse KV in pinned
//! host memory, a hot buffer per layer in HBM, and loads whose hits, misses and victims the
//! device works out from a selection already in device memory (where the model's indexer
//! leaves its top-k). The host plans nothing and uploads only each sequence's length and
//! count per load: a load is the HAL's [`swap_in`] — a fetch kernel that puts every
//! selected entry in its destination (from its slot, or from host memory), which the call
//! waits for, then an install kernel that gives the misses their slots while the caller
//! goes on (the batch's next load, and its drop, wait for it).
//!
//! A batch may also prefetch ([`SwapInBatch::set_prefetch`]): a model's indexer that writes
//! its next candidates after the top-k (the positions ranked just below it, which the next
//! step's selection is likely to take in) has each load bring them into the hot buffer after
//! its install, off the critical path, so that the next step finds them there.
//!
//! [`KvPool`](super::KvPool) is the other way to serve the same selections: planned on the
//! host, over three tiers (a cold one, importance eviction, entries rewritten in place). A
//! [`SwapInKv`] keeps every entry in host memory and only appends, which is what lets the
//! device own the hot buffer's bookkeeping.

use super::LoadReport;
use crate::AiWork;
use crate::{AiError, Result};
use gpuio_ai_device::{
    SWAP_IN_MAX_ROW_BYTES, SWAP_IN_MAX_SELECTION, SWAP_IN_MAX_SLOTS, SwapInDone, SwapInFault,
    SwapInJob, SwapInLoad, SwapInOutcome, SwapInTable, swap_in, swap_in_queued, swap_in_reset,
    swap_in_state_len, swap_in_table,
};
use gpuio_api::{DeviceBuffer, HostMemory, HostPlacement, Lease, Lessor, Session};
use gpuio_hal::{HostBuffer, HostRead, Stream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// The shape of a [`SwapInKv`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwapInConfig {
    /// Attention layers.
    pub layers: usize,
    /// Bytes per entry (one token of one layer): 656 for DeepSeek V3.2.
    pub entry_bytes: usize,
    /// Tokens the sequence may hold (below `u32::MAX - 1`).
    pub max_tokens: u64,
    /// Slots of each layer's hot buffer (at most 8192).
    pub hot_slots: usize,
    /// The largest selection one load takes (the top-k); at most `hot_slots` and 4096.
    pub max_selection: usize,
    /// The GPU whose memory holds the hot buffers.
    pub gpu: u32,
    /// Where the entries live (DRAM on a node, or CXL).
    pub placement: HostPlacement,
}

impl SwapInConfig {
    /// DeepSeek V3.2's shape for one sequence of `max_tokens`: 61 layers of 656-byte
    /// entries, top-2048 selections, 4096 hot slots per layer.
    pub fn deepseek_v32(max_tokens: u64) -> Self {
        Self {
            layers: 61,
            entry_bytes: 656,
            max_tokens,
            hot_slots: 4096,
            max_selection: 2048,
            gpu: 0,
            placement: HostPlacement::Dram { numa: None },
        }
    }
}

/// One layer's device side: the hot buffer, the swap-in state, the length, and whether a
/// batch holds it.
#[derive(Debug)]
struct Layer {
    hot: DeviceBuffer,
    state: DeviceBuffer,
    len: AtomicU64,
    in_batch: AtomicBool,
}

#[derive(Debug)]
struct Inner {
    cfg: SwapInConfig,
    /// Every layer's entries, layer after layer, pinned.
    warm: HostMemory,
    layers: Vec<Layer>,
}

/// One sequence's sparse KV for device-planned loads. A shared handle: clones are the same
/// sequence. Entries are appended ([`append`](Self::append)) and loaded through a
/// [`SwapInBatch`].
#[derive(Debug, Clone)]
pub struct SwapInKv {
    inner: Arc<Inner>,
}

impl SwapInKv {
    /// A sequence of `cfg`'s shape: its host memory (pinned), hot buffers and states allocated
    /// now, every hot buffer empty.
    pub fn new(session: &Session, cfg: SwapInConfig) -> Result<Self> {
        let bad = |why: String| Err(AiError::InvalidArgument(format!("swap-in KV: {why}")));
        if cfg.layers == 0 || cfg.entry_bytes == 0 || cfg.max_tokens == 0 || cfg.hot_slots == 0 {
            return bad(format!("{cfg:?} has nothing to hold"));
        }
        if cfg.entry_bytes > SWAP_IN_MAX_ROW_BYTES {
            return bad(format!(
                "{}-byte entries: the device's swap-in moves up to {SWAP_IN_MAX_ROW_BYTES}",
                cfg.entry_bytes
            ));
        }
        if cfg.hot_slots > SWAP_IN_MAX_SLOTS {
            return bad(format!(
                "{} hot slots: the device's swap-in takes up to {SWAP_IN_MAX_SLOTS}",
                cfg.hot_slots
            ));
        }
        if cfg.max_selection == 0
            || cfg.max_selection > cfg.hot_slots.min(SWAP_IN_MAX_SELECTION)
            || cfg.max_tokens >= u64::from(u32::MAX - 1)
        {
            return bad(format!(
                "a selection of {} from {} tokens: 1 to min(hot slots, \
                 {SWAP_IN_MAX_SELECTION}) from fewer than 2^32 - 2",
                cfg.max_selection, cfg.max_tokens
            ));
        }
        let layer_bytes = cfg.max_tokens.checked_mul(cfg.entry_bytes as u64);
        let warm_len = layer_bytes
            .and_then(|b| b.checked_mul(cfg.layers as u64))
            .and_then(|b| usize::try_from(b).ok());
        let state_len = swap_in_state_len(cfg.max_tokens, cfg.hot_slots);
        let hot_len = cfg.hot_slots.checked_mul(cfg.entry_bytes);
        let (Some(warm_len), Some(state_len), Some(hot_len)) = (warm_len, state_len, hot_len)
        else {
            return bad(format!("{cfg:?} overflows"));
        };
        let warm = session.alloc_host(cfg.placement, warm_len, true)?;
        let stream = session.gpu(cfg.gpu)?.stream()?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            let state = session.alloc_device(cfg.gpu, state_len)?;
            swap_in_reset(&stream, &state, cfg.max_tokens, cfg.hot_slots)?;
            layers.push(Layer {
                hot: session.alloc_device(cfg.gpu, hot_len)?,
                state,
                len: AtomicU64::new(0),
                in_batch: AtomicBool::new(false),
            });
        }
        Ok(Self {
            inner: Arc::new(Inner { cfg, warm, layers }),
        })
    }

    /// Its shape.
    pub fn config(&self) -> &SwapInConfig {
        &self.inner.cfg
    }

    /// Tokens stored in `layer` (0 for a layer that is not there).
    pub fn len(&self, layer: usize) -> u64 {
        self.inner
            .layers
            .get(layer)
            .map_or(0, |l| l.len.load(Ordering::Acquire))
    }

    /// Whether no layer holds a token.
    pub fn is_empty(&self) -> bool {
        (0..self.inner.cfg.layers).all(|l| self.len(l) == 0)
    }

    /// Appends whole entries (`entries.len()` a multiple of the entry size) to `layer`;
    /// returns the position of the first. Refused, storing nothing, past `max_tokens`.
    pub fn append(&self, layer: usize, entries: &[u8]) -> Result<u64> {
        let cfg = &self.inner.cfg;
        let l = self.layer(layer)?;
        if !entries.len().is_multiple_of(cfg.entry_bytes) {
            return Err(AiError::InvalidArgument(format!(
                "{} bytes are not whole {}-byte entries",
                entries.len(),
                cfg.entry_bytes
            )));
        }
        let n = (entries.len() / cfg.entry_bytes) as u64;
        // The write lock orders appends to one sequence; the length is published after the
        // bytes (Release), so a load that reads it finds them.
        let mut warm = self.inner.warm.write();
        let first = l.len.load(Ordering::Acquire);
        if first + n > cfg.max_tokens {
            return Err(AiError::TierFull(format!(
                "layer {layer} holds {first} of {} tokens: no room for {n} more",
                cfg.max_tokens
            )));
        }
        let at = (layer as u64 * cfg.max_tokens + first) as usize * cfg.entry_bytes;
        warm[at..at + entries.len()].copy_from_slice(entries);
        l.len.store(first + n, Ordering::Release);
        Ok(first)
    }

    /// Empties layer `layer`'s hot buffer: its state forgets every slot, so the next load
    /// reads every selected entry from host memory again. What a layer needs after a load
    /// refused for its state (`AiError::Corrupt`) or a device failure during a load. Refused
    /// while the layer is in a batch.
    pub fn reset(&self, session: &Session, layer: usize) -> Result<()> {
        let l = self.layer(layer)?;
        if l.in_batch
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(AiError::InvalidArgument(format!(
                "layer {layer} is in a batch: drop the batch before resetting it"
            )));
        }
        let cfg = &self.inner.cfg;
        let reset = || -> Result<()> {
            let stream = session.gpu(cfg.gpu)?.stream()?;
            Ok(swap_in_reset(
                &stream,
                &l.state,
                cfg.max_tokens,
                cfg.hot_slots,
            )?)
        };
        let done = reset();
        l.in_batch.store(false, Ordering::Release);
        done
    }

    /// Entry (`layer`, `pos`) as stored.
    pub fn entry(&self, layer: usize, pos: u64) -> Result<Vec<u8>> {
        let e = self.inner.cfg.entry_bytes;
        if pos >= self.len(layer) {
            return Err(AiError::InvalidArgument(format!(
                "position {pos} of layer {layer}, which holds {} tokens",
                self.len(layer)
            )));
        }
        let at = (layer as u64 * self.inner.cfg.max_tokens + pos) as usize * e;
        Ok(self.inner.warm.read()[at..at + e].to_vec())
    }

    fn layer(&self, layer: usize) -> Result<&Layer> {
        self.inner.layers.get(layer).ok_or_else(|| {
            AiError::InvalidArgument(format!("layer {layer} of {}", self.inner.cfg.layers))
        })
    }
}

/// One sequence's part in a [`SwapInBatch`]: its selection (little-endian u32 positions in
/// device memory, up to the sequence's `max_selection`) and where its entries go.
#[derive(Debug, Clone, Copy)]
pub struct SwapInTarget<'a> {
    /// The sequence.
    pub kv: &'a SwapInKv,
    /// Its selection.
    pub selection: &'a DeviceBuffer,
    /// Where its entries go, in selection order.
    pub dst: &'a DeviceBuffer,
    /// Byte offset in `dst`.
    pub dst_offset: usize,
}

/// One layer's loads for a batch of sequences: made once, then [`load`](Self::load)ed every
/// step, all sequences planned and moved in one call. A sequence's layer belongs to one batch
/// at a time (its hot buffer's state is the batch's while it lives); its hot buffer carries
/// over from one batch to the next.
#[derive(Debug)]
pub struct SwapInBatch {
    // Dropped in this order: the table waits for its last install before the layers are
    // let go.
    table: SwapInTable,
    stream: Stream,
    claims: Claims,
    /// Takes the scheduler lease each load runs under, in `work`'s class.
    lessor: Lessor,
    work: AiWork,
    /// Per sequence, the entries after its count each load prefetches.
    ahead: Vec<usize>,
}

/// The device's time for one [`SwapInBatch::load_timed`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadTimes {
    /// From the load's first work on the device until every entry is in its destination:
    /// what the layer that uses them waits for.
    pub exposed: Duration,
    /// The install after it (the misses into their slots, then the prefetch where the batch
    /// prefetches), which overlaps whatever the caller runs next and must end before the
    /// batch's next load.
    pub install: Duration,
}

/// The batch's sequences, their layer claimed until this drops (however the batch ends).
#[derive(Debug)]
struct Claims {
    kvs: Vec<SwapInKv>,
    layer: usize,
}

impl Drop for Claims {
    fn drop(&mut self) {
        for kv in &self.kvs {
            kv.inner.layers[self.layer]
                .in_batch
                .store(false, Ordering::Release);
        }
    }
}

/// Read guards on the sequences' host memory, in their order, taken in one global order (by
/// address): batches that lock overlapping sets never wait on each other in a cycle behind a
/// writer (`append`).
fn read_all<'a>(kvs: &[&'a SwapInKv]) -> Vec<HostRead<'a>> {
    let mut order: Vec<usize> = (0..kvs.len()).collect();
    order.sort_by_key(|&i| Arc::as_ptr(&kvs[i].inner) as usize);
    let mut guards: Vec<Option<HostRead<'a>>> = kvs.iter().map(|_| None).collect();
    for i in order {
        guards[i] = Some(kvs[i].inner.warm.read());
    }
    guards.into_iter().flatten().collect()
}

impl SwapInBatch {
    /// A batch of `targets` for `layer`, its tables written to the device now. Refused where
    /// a sequence is in another batch for this layer (or twice in this one), or the
    /// sequences are on different GPUs.
    pub fn new(session: &Session, layer: usize, targets: &[SwapInTarget<'_>]) -> Result<Self> {
        let Some(first) = targets.first() else {
            return Err(AiError::InvalidArgument(
                "a swap-in batch of nothing".into(),
            ));
        };
        let gpu = first.kv.inner.cfg.gpu;
        let entry = first.kv.inner.cfg.entry_bytes;
        if let Some(t) = targets
            .iter()
            .find(|t| t.kv.inner.cfg.gpu != gpu || t.kv.inner.cfg.entry_bytes != entry)
        {
            return Err(AiError::InvalidArgument(format!(
                "a batch mixes GPUs or entry sizes ({:?} against GPU {gpu}, {entry} B)",
                t.kv.inner.cfg
            )));
        }
        if let Some(t) = targets.iter().find(|t| layer >= t.kv.inner.cfg.layers) {
            return Err(AiError::InvalidArgument(format!(
                "layer {layer} of a sequence of {} layers",
                t.kv.inner.cfg.layers
            )));
        }
        let mut claims = Claims {
            kvs: Vec::with_capacity(targets.len()),
            layer,
        };
        for t in targets {
            if t.kv.inner.layers[layer]
                .in_batch
                .swap(true, Ordering::AcqRel)
            {
                return Err(AiError::InvalidArgument(format!(
                    "layer {layer} of a sequence is in another swap-in batch (or twice in this one)"
                )));
            }
            claims.kvs.push(t.kv.clone());
        }
        let (stream, table) = Self::table(session, layer, targets, gpu, entry)?;
        Ok(Self {
            table,
            stream,
            ahead: vec![0; claims.kvs.len()],
            claims,
            lessor: session.lessor(),
            work: AiWork::Decode,
        })
    }

    /// Has each later load prefetch: after sequence `i`'s first `counts[i]` entries are
    /// loaded and installed, the next `ahead[i]` of its selection (the indexer's next
    /// candidates, written after the top-k) are brought into its hot buffer on the batch's
    /// own stream, off the critical path and delivered nowhere; 0 for none. A prefetch is a
    /// step of its own for the hot buffer's ages, its misses take the slots selected longest
    /// ago (never the load's), and the batch's next load waits for it. A load whose count and
    /// entries ahead pass the sequence's `max_selection` is refused.
    pub fn set_prefetch(&mut self, ahead: &[usize]) -> Result<()> {
        if ahead.len() != self.claims.kvs.len() {
            return Err(AiError::InvalidArgument(format!(
                "{} prefetch depths for {} sequences",
                ahead.len(),
                self.claims.kvs.len()
            )));
        }
        if let Some((a, kv)) = ahead
            .iter()
            .zip(&self.claims.kvs)
            .find(|(a, kv)| **a > kv.inner.cfg.max_selection)
        {
            return Err(AiError::InvalidArgument(format!(
                "a prefetch of {a} entries past a selection of at most {}",
                kv.inner.cfg.max_selection
            )));
        }
        self.ahead = ahead.to_vec();
        Ok(())
    }

    /// Waits for the last load's prefetch and returns each sequence's report of it: of its
    /// entries ahead, those already in slots (hits) and those brought in from host memory
    /// (misses), or why it was refused (it installed nothing). `None` where the last load
    /// prefetched nothing.
    pub fn prefetched(&mut self) -> Result<Option<Vec<Result<LoadReport>>>> {
        let entry = self.claims.kvs[0].inner.cfg.entry_bytes;
        let Some(jobs) = self.table.prefetched()? else {
            return Ok(None);
        };
        // A prefetch that ran took each of its entries as a hit or a miss (the depth may have
        // been set again since).
        let selected = |j: &SwapInOutcome| j.as_ref().map_or(0, |c| c.hits + c.misses);
        Ok(Some(
            jobs.into_iter()
                .map(|j| {
                    let n = selected(&j);
                    report_of(j, n, entry)
                })
                .collect(),
        ))
    }

    /// The work the batch's loads are for (a decode step's, [`AiWork::Decode`], unless set):
    /// each load holds a scheduler lease of its class, with its IO deadline where it has one.
    /// Work that leaves no time for IO is refused.
    pub fn set_work(&mut self, work: AiWork) -> Result<()> {
        self.work = work.checked()?;
        Ok(())
    }

    fn table(
        session: &Session,
        layer: usize,
        targets: &[SwapInTarget<'_>],
        gpu: u32,
        entry: usize,
    ) -> Result<(Stream, SwapInTable)> {
        let stream = session.gpu(gpu)?.stream()?;
        let kvs: Vec<&SwapInKv> = targets.iter().map(|t| t.kv).collect();
        let guards = read_all(&kvs);
        let jobs: Vec<SwapInJob<'_>> = targets
            .iter()
            .zip(&guards)
            .map(|(t, warm)| {
                let cfg = &t.kv.inner.cfg;
                let l = &t.kv.inner.layers[layer];
                SwapInJob {
                    hot: &l.hot,
                    slots: cfg.hot_slots,
                    state: &l.state,
                    positions: cfg.max_tokens,
                    warm,
                    warm_first: layer as u64 * cfg.max_tokens,
                    selection: t.selection,
                    max_count: cfg.max_selection,
                    dst: t.dst,
                    dst_offset: t.dst_offset,
                }
            })
            .collect();
        let table = swap_in_table(&stream, entry, &jobs)?;
        Ok((stream, table))
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.claims.kvs.len()
    }

    /// Whether the batch is empty (never: a batch has a sequence).
    pub fn is_empty(&self) -> bool {
        self.claims.kvs.is_empty()
    }

    /// Loads the first `counts[i]` positions of sequence `i`'s selection into its destination
    /// and returns once they are there, with each sequence's report; the install that gives
    /// the misses their slots runs on, and the next load waits for it. A sequence whose
    /// selection holds a position twice or one the layer has not stored is refused (its entry
    /// is the error): it installs nothing, its destination may hold some of its entries, and
    /// the others are loaded all the same. The outer error is a call that did not run (bad
    /// counts, a device failure).
    pub fn load(&mut self, counts: &[usize]) -> Result<Vec<Result<LoadReport>>> {
        self.run(counts, false).map(|(r, _)| r)
    }

    /// [`load`](Self::load), timed on the device (CUDA events), and waiting for the install
    /// too.
    pub fn load_timed(&mut self, counts: &[usize]) -> Result<(Vec<Result<LoadReport>>, LoadTimes)> {
        self.run(counts, true)
            .map(|(r, t)| (r, t.unwrap_or_default()))
    }

    /// [`load`](Self::load) in `stream`'s order, without waiting: the load starts once the
    /// work queued on `stream` so far is done (the indexer that writes the selections, say),
    /// and work queued on `stream` after this call starts once the entries are in their
    /// destinations. The host goes on at once, so the load's launch overlaps the GPU's work
    /// instead of following it. [`QueuedLoad::finish`] waits for the entries and returns the
    /// reports; until then a refused sequence's entries may be wrong for the work that reads
    /// them, and the batch takes no other load. `stream` must be on the batch's GPU.
    pub fn load_on(&mut self, stream: &Stream, counts: &[usize]) -> Result<QueuedLoad<'_>> {
        if !stream.gpu().same_device(self.stream.gpu()) {
            return Err(AiError::InvalidArgument(format!(
                "a load on a stream of {} for a batch on {}",
                stream.gpu(),
                self.stream.gpu()
            )));
        }
        let (lease, _) = self.queue(Some(stream), counts, false)?;
        Ok(QueuedLoad {
            counts: counts.to_vec(),
            batch: Some(self),
            _lease: lease,
        })
    }

    fn run(
        &mut self,
        counts: &[usize],
        timed: bool,
    ) -> Result<(Vec<Result<LoadReport>>, Option<LoadTimes>)> {
        let (_lease, done) = self.queue(None, counts, timed)?;
        self.reports(done, counts)
    }

    /// Runs a load on the batch's stream and returns its outcome (`caller` none), or queues
    /// one whose fetch runs on `caller`; with the lease it holds until its outcome is read.
    fn queue(
        &mut self,
        caller: Option<&Stream>,
        counts: &[usize],
        timed: bool,
    ) -> Result<(Lease, Option<SwapInDone>)> {
        if counts.len() != self.claims.kvs.len() {
            return Err(AiError::InvalidArgument(format!(
                "{} counts for {} sequences",
                counts.len(),
                self.claims.kvs.len()
            )));
        }
        let lease = self.work.lease(&self.lessor)?;
        let loads: Vec<SwapInLoad> = self
            .claims
            .kvs
            .iter()
            .zip(counts)
            .zip(&self.ahead)
            .map(|((kv, &count), &ahead)| SwapInLoad {
                len: kv.len(self.claims.layer),
                count,
                ahead,
            })
            .collect();
        // The warm pools are read under their locks only while the call is checked and
        // queued: entries are only ever appended, past the lengths this load reads.
        let kvs: Vec<&SwapInKv> = self.claims.kvs.iter().collect();
        let guards = read_all(&kvs);
        let warm: Vec<&HostBuffer> = guards.iter().map(|g| &**g).collect();
        let done = match caller {
            Some(caller) => {
                swap_in_queued(caller, &mut self.table, &warm, &loads, timed)?;
                None
            }
            None => Some(swap_in(
                &self.stream,
                &mut self.table,
                &warm,
                &loads,
                timed,
            )?),
        };
        Ok((lease, done))
    }

    /// A load's reports (and its times where timed): `done`, or the queued load's outcome.
    fn reports(
        &mut self,
        done: Option<SwapInDone>,
        counts: &[usize],
    ) -> Result<(Vec<Result<LoadReport>>, Option<LoadTimes>)> {
        let done = match done {
            Some(done) => done,
            None => self.table.finish()?,
        };
        let entry = self.claims.kvs[0].inner.cfg.entry_bytes;
        let reports = done.jobs.into_iter().zip(counts);
        let reports = reports.map(|(j, &n)| report_of(j, n, entry)).collect();
        let times = done.device_time.map(|exposed| LoadTimes {
            exposed,
            install: done.install_time.unwrap_or_default(),
        });
        Ok((reports, times))
    }
}

/// One sequence's report of a load (or a prefetch) of `selected` entries.
fn report_of(job: SwapInOutcome, selected: usize, entry: usize) -> Result<LoadReport> {
    let c = job.map_err(|r| match r.fault {
        SwapInFault::Selection => AiError::InvalidArgument(r.to_string()),
        // Not the caller's selection: the state in device memory cannot be trusted;
        // `SwapInKv::reset` empties the layer's hot buffer.
        SwapInFault::State => AiError::Corrupt(format!("{r}; reset the layer")),
    })?;
    Ok(LoadReport {
        selected,
        hits: c.hits,
        misses: c.misses,
        from_cold: 0,
        bytes_from_host: (c.misses * entry) as u64,
    })
}

/// A load queued on a caller's stream ([`SwapInBatch::load_on`]). Dropped unfinished, it
/// waits for the fetch and drops the reports.
#[must_use = "a queued load's reports are read by finish"]
#[derive(Debug)]
pub struct QueuedLoad<'a> {
    counts: Vec<usize>,
    /// `None` once finished.
    batch: Option<&'a mut SwapInBatch>,
    /// The load's scheduler lease, held until its fetch is waited for.
    _lease: Lease,
}

impl QueuedLoad<'_> {
    /// Waits until the entries are in their destinations and returns each sequence's report,
    /// as [`SwapInBatch::load`] does.
    pub fn finish(mut self) -> Result<Vec<Result<LoadReport>>> {
        match self.batch.take() {
            Some(batch) => batch.reports(None, &self.counts).map(|(r, _)| r),
            None => Err(AiError::Internal("a queued load finished twice".into())),
        }
    }
}

impl Drop for QueuedLoad<'_> {
    fn drop(&mut self) {
        if let Some(batch) = self.batch.take() {
            let _ = batch.table.finish();
        }
    }
}
