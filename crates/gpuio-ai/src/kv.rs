//! The DSA KV pool: one sequence's sparse-attention KV entries (DeepSeek V3.2: 656 bytes per
//! token per layer, FP8 with scales), all of them in pinned host memory (the warm tier), and per
//! layer a hot buffer of device-memory slots refilled by LRU — HiSparse's scheme. Each decode
//! step's top-k selection (2048 positions per layer) is [`load`](KvPool::load)ed into one
//! contiguous device buffer: entries already in the hot buffer come from there, the misses
//! from host memory by MemIO's row gather, and the misses then replace the least recently
//! selected slots, so that the next step — whose selection overlaps this one by 80–95% —
//! finds them.
//!
//! A load is three device operations: the misses gathered from host memory into the staging
//! rows behind the layer's slots; the output gathered from slots and staging rows in selection
//! order; and, where there were misses, the slots rebuilt into a spare buffer with the misses
//! in their new places (the spare and the layer's buffer then trade places). Every entry
//! written by [`store`](KvPool::store) invalidates its hot copy, so a load never returns a
//! stale entry.

use crate::{AiError, Result};
use gpuio_api::{DeviceBuffer, HostMemory, HostPlacement, Session};
use gpuio_hal::{HostAllocOptions, HostBuffer, RowIndices};
use gpuio_transport_memio::GatherOptions;
use std::collections::HashMap;

/// The shape of a KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPoolConfig {
    /// Attention layers.
    pub layers: usize,
    /// Bytes per entry (one token of one layer): 656 for DeepSeek V3.2.
    pub entry_bytes: usize,
    /// Tokens the sequence may hold.
    pub max_tokens: u64,
    /// Slots of each layer's hot buffer in device memory.
    pub hot_slots: usize,
    /// The largest selection one load takes (the top-k: 2048); at most `hot_slots`.
    pub max_selection: usize,
    /// The GPU whose memory holds the hot buffers.
    pub gpu: u32,
    /// Where the warm tier lives (DRAM on a node, or CXL).
    pub placement: HostPlacement,
}

impl KvPoolConfig {
    /// DeepSeek V3.2's shape for one sequence of `max_tokens`: 61 layers of 656-byte entries,
    /// top-2048 selections, 4096 hot slots per layer.
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

/// What one load did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadReport {
    /// Entries written to the destination.
    pub selected: usize,
    /// Of them, found in the hot buffer.
    pub hits: usize,
    /// Distinct entries read from host memory.
    pub misses: usize,
    /// Bytes that crossed from host memory.
    pub bytes_from_host: u64,
}

/// One layer's hot buffer: `hot_slots` slots, then `max_selection` staging rows.
struct HotLayer {
    buf: DeviceBuffer,
    slot_of: HashMap<u64, u32>,
    holder: Vec<Option<u64>>,
    /// The step each slot was last selected in (0: never).
    last_used: Vec<u64>,
}

/// A sequence's KV entries: the warm tier in pinned host memory and the per-layer hot
/// buffers. Not shared between threads: one decode loop drives it.
pub struct KvPool {
    cfg: KvPoolConfig,
    warm: HostMemory,
    /// Tokens stored per layer (positions below are loadable).
    lengths: Vec<u64>,
    /// Importance scores per layer, by position.
    importance: Vec<Vec<f32>>,
    hot: Vec<HotLayer>,
    /// The buffer a layer's slots are rebuilt into, then traded for the layer's own.
    spare: DeviceBuffer,
    /// Row indices for the device gathers, pinned, and their device copy.
    idx_host: HostBuffer,
    idx_dev: DeviceBuffer,
    step: u64,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("config", &self.cfg)
            .field("lengths", &self.lengths)
            .finish()
    }
}

impl KvPool {
    /// A pool of `cfg`'s shape: the warm tier (layers × max_tokens entries, pinned) and the
    /// hot buffers, all allocated now; a size the machine cannot back is refused first.
    pub fn new(session: &Session, cfg: KvPoolConfig) -> Result<Self> {
        let bad = |why: String| Err(AiError::InvalidArgument(format!("KV pool: {why}")));
        if cfg.layers == 0 || cfg.entry_bytes == 0 || cfg.max_tokens == 0 {
            return bad(format!("{cfg:?} has nothing to hold"));
        }
        if cfg.max_selection == 0 || cfg.max_selection > cfg.hot_slots {
            return bad(format!(
                "a selection of up to {} needs 1 to {} hot slots",
                cfg.max_selection, cfg.hot_slots
            ));
        }
        let warm_len = (cfg.layers as u64)
            .checked_mul(cfg.max_tokens)
            .and_then(|e| e.checked_mul(cfg.entry_bytes as u64))
            .and_then(|b| usize::try_from(b).ok());
        let hot_rows = cfg.hot_slots + cfg.max_selection;
        let hot_len = hot_rows.checked_mul(cfg.entry_bytes);
        let (Some(warm_len), Some(hot_len)) = (warm_len, hot_len) else {
            return bad(format!("{cfg:?} overflows"));
        };
        let warm = session.alloc_host(cfg.placement, warm_len, true)?;
        let gpu = session.gpu(cfg.gpu)?.clone();
        let mut hot = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            hot.push(HotLayer {
                buf: session.alloc_device(cfg.gpu, hot_len)?,
                slot_of: HashMap::new(),
                holder: vec![None; cfg.hot_slots],
                last_used: vec![0; cfg.hot_slots],
            });
        }
        let idx_len = hot_rows * 8;
        Ok(Self {
            spare: session.alloc_device(cfg.gpu, hot_len)?,
            idx_host: HostBuffer::alloc_pinned(idx_len, &HostAllocOptions::default(), &gpu)
                .map_err(gpuio_api::Error::from)?,
            idx_dev: session.alloc_device(cfg.gpu, idx_len)?,
            lengths: vec![0; cfg.layers],
            importance: vec![Vec::new(); cfg.layers],
            cfg,
            warm,
            hot,
            step: 0,
        })
    }

    /// Its shape.
    pub fn config(&self) -> &KvPoolConfig {
        &self.cfg
    }

    /// Tokens stored in `layer` (0 for a layer that is not there).
    pub fn len(&self, layer: usize) -> u64 {
        self.lengths.get(layer).copied().unwrap_or(0)
    }

    /// Whether no layer holds a token.
    pub fn is_empty(&self) -> bool {
        self.lengths.iter().all(|&l| l == 0)
    }

    /// Entries of `layer` in the hot buffer now.
    pub fn hot_entries(&self, layer: usize) -> usize {
        self.hot.get(layer).map_or(0, |h| h.slot_of.len())
    }

    /// The importance score of an entry (0 where none was given).
    pub fn importance(&self, layer: usize, pos: u64) -> f32 {
        self.importance
            .get(layer)
            .and_then(|v| v.get(pos as usize))
            .copied()
            .unwrap_or(0.0)
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.cfg.layers {
            return Err(AiError::InvalidArgument(format!(
                "layer {layer} of a {}-layer KV pool",
                self.cfg.layers
            )));
        }
        Ok(())
    }

    /// Row of (layer, pos) in the warm tier.
    fn warm_row(&self, layer: usize, pos: u64) -> u64 {
        layer as u64 * self.cfg.max_tokens + pos
    }

    /// Stores `count` entries of `layer` from `src` at `src_offset` (entry after entry) at
    /// positions `first..first + count`, with their importance scores where given (one per
    /// entry). Entries may be written again, but not past the end with a gap
    /// (`first <= len(layer)`). Their hot copies are dropped.
    #[allow(clippy::too_many_arguments)]
    pub fn store(
        &mut self,
        layer: usize,
        first: u64,
        count: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        scores: Option<&[f32]>,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let end = first.checked_add(count as u64);
        if first > self.lengths[layer] || end.is_none_or(|e| e > self.cfg.max_tokens) {
            return Err(AiError::InvalidArgument(format!(
                "storing positions {first}..{first}+{count} of layer {layer}, which holds {} \
                 of at most {} tokens",
                self.lengths[layer], self.cfg.max_tokens
            )));
        }
        if scores.is_some_and(|s| s.len() != count) {
            return Err(AiError::InvalidArgument(format!(
                "{count} entries with {} importance scores",
                scores.map_or(0, <[f32]>::len)
            )));
        }
        let e = self.cfg.entry_bytes;
        let at = self.warm_row(layer, first) as usize * e;
        {
            let mut warm = self.warm.write();
            src.gpu()
                .stream()
                .and_then(|s| s.download(src, src_offset, &mut warm[at..at + count * e]))
                .map_err(gpuio_api::Error::from)?;
        }
        let end = first + count as u64;
        self.lengths[layer] = self.lengths[layer].max(end);
        let hot = &mut self.hot[layer];
        for pos in first..end {
            if let Some(slot) = hot.slot_of.remove(&pos) {
                hot.holder[slot as usize] = None;
                hot.last_used[slot as usize] = 0;
            }
        }
        let imp = &mut self.importance[layer];
        if imp.len() < end as usize {
            imp.resize(end as usize, 0.0);
        }
        if let Some(s) = scores {
            imp[first as usize..end as usize].copy_from_slice(s);
        }
        Ok(())
    }

    /// Loads the entries of `layer` at `selection` (positions, each stored) into `dst` from
    /// `dst_offset`, entry `i` being position `selection[i]`; the misses then take the least
    /// recently selected slots of the layer's hot buffer. A position may appear more than
    /// once.
    pub fn load(
        &mut self,
        session: &Session,
        layer: usize,
        selection: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<LoadReport> {
        self.check_layer(layer)?;
        let cfg = self.cfg;
        if selection.len() > cfg.max_selection {
            return Err(AiError::InvalidArgument(format!(
                "a selection of {} entries, more than the pool's {}",
                selection.len(),
                cfg.max_selection
            )));
        }
        if let Some(p) = selection.iter().find(|&&p| p >= self.lengths[layer]) {
            return Err(AiError::InvalidArgument(format!(
                "position {p} of layer {layer}, which holds {} tokens",
                self.lengths[layer]
            )));
        }
        let e = cfg.entry_bytes;
        gpuio_hal::check_range(
            "KV load destination",
            dst_offset,
            selection.len() * e,
            dst.len(),
        )
        .map_err(gpuio_api::Error::from)?;
        if selection.is_empty() {
            return Ok(LoadReport::default());
        }
        self.step += 1;
        let step = self.step;
        // Each selected entry's row in the layer's buffer: its slot, or a staging row.
        let hot = &mut self.hot[layer];
        let mut misses: Vec<u64> = Vec::new();
        let mut staged: HashMap<u64, u64> = HashMap::new();
        let mut rows = Vec::with_capacity(selection.len());
        let mut hits = 0;
        for &pos in selection {
            if let Some(&slot) = hot.slot_of.get(&pos) {
                hot.last_used[slot as usize] = step;
                hits += 1;
                rows.push(slot as u64);
            } else {
                let row = *staged.entry(pos).or_insert_with(|| {
                    misses.push(pos);
                    (cfg.hot_slots + misses.len() - 1) as u64
                });
                rows.push(row);
            }
        }
        let stream = dst.gpu().stream().map_err(gpuio_api::Error::from)?;
        if !misses.is_empty() {
            let warm_rows: Vec<u64> = misses
                .iter()
                .map(|&p| layer as u64 * cfg.max_tokens + p)
                .collect();
            let warm = self.warm.read();
            session
                .memio()
                .gather(
                    &warm,
                    e,
                    &warm_rows[..],
                    &hot.buf,
                    cfg.hot_slots * e,
                    &GatherOptions::default(),
                )
                .map_err(gpuio_api::Error::from)?;
        }
        let idx = |host: &mut HostBuffer, rows: &[u64]| {
            for (i, r) in rows.iter().enumerate() {
                host[8 * i..8 * i + 8].copy_from_slice(&r.to_le_bytes());
            }
        };
        idx(&mut self.idx_host, &rows);
        let indices = RowIndices::Staged {
            host: &self.idx_host,
            device: &self.idx_dev,
        };
        stream
            .gather_device(&hot.buf, e, indices, rows.len(), dst, dst_offset)
            .map_err(gpuio_api::Error::from)?;
        if !misses.is_empty() {
            // The misses replace the slots selected longest ago (never this step's).
            let mut victims: Vec<usize> = (0..cfg.hot_slots)
                .filter(|&s| hot.last_used[s] != step)
                .collect();
            victims.select_nth_unstable_by_key(misses.len() - 1, |&s| hot.last_used[s]);
            victims.truncate(misses.len());
            let mut source: Vec<u64> = (0..cfg.hot_slots as u64).collect();
            for (j, (&slot, &pos)) in victims.iter().zip(&misses).enumerate() {
                source[slot] = (cfg.hot_slots + j) as u64;
                if let Some(old) = hot.holder[slot].replace(pos) {
                    hot.slot_of.remove(&old);
                }
                hot.slot_of.insert(pos, slot as u32);
                hot.last_used[slot] = step;
            }
            idx(&mut self.idx_host, &source);
            let indices = RowIndices::Staged {
                host: &self.idx_host,
                device: &self.idx_dev,
            };
            stream
                .gather_device(&hot.buf, e, indices, cfg.hot_slots, &self.spare, 0)
                .map_err(gpuio_api::Error::from)?;
            std::mem::swap(&mut hot.buf, &mut self.spare);
        }
        Ok(LoadReport {
            selected: selection.len(),
            hits,
            misses: misses.len(),
            bytes_from_host: (misses.len() * e) as u64,
        })
    }
}
