//! The DSA KV pool: one sequence's sparse-attention KV entries (DeepSeek V3.2: 656 bytes per
//! token per layer, FP8 with scales) in three tiers.
//!
//! - **Hot**: per layer, a buffer of device-memory slots refilled by LRU — HiSparse's scheme
//!   (`hot.rs`).
//! - **Warm**: entries in pinned host memory (DRAM or CXL), `warm_entries` of them.
//! - **Cold**: entries evicted from host memory, compressed into a file (`cold.rs`), where a
//!   cold tier is attached; without one, evicted entries are dropped.
//!
//! Each decode step's top-k selection (2048 positions per layer) is [`load`](KvPool::load)ed
//! into one contiguous device buffer — or every request's at once, by [`KvBatch`]. Entries in
//! the hot buffer come from there; misses are read by the device's threads from pinned host
//! memory (cold ones brought back to host memory first) and written, on the way, into the
//! least recently selected slots, so the next step — whose selection overlaps this one by
//! 80–95% — finds them. A load is one upload of a code per entry, one kernel and one wait
//! (`load.rs`).
//!
//! [`SwapInKv`] serves the same selections with the planning on the device (HiSparse's
//! swap-in kernel): every entry in host memory, appended only, selections already in device
//! memory, nothing planned on the host (`swap.rs`).
//!
//! [`store`](KvPool::store) writes entries to host memory and drops their hot copies, so a
//! load never returns a stale entry. [`evict_by_importance`](KvPool::evict_by_importance)
//! frees host memory from the least important entries.

mod cold;
mod hot;
mod load;
mod swap;

pub use cold::ColdTier;
pub use load::{KvBatch, KvLoad};
pub use swap::{LoadTimes, QueuedLoad, SwapInBatch, SwapInConfig, SwapInKv, SwapInTarget};

use crate::AiWork;
use crate::{AiError, Result};
use gpuio_ai_device::{TIER_MAX_HOT_ROWS, TIER_MAX_WARM_ROWS, tiered_stage_len};
use gpuio_api::{DeviceBuffer, HostMemory, HostPlacement, Lessor, Session};
use hot::HotLayer;
use load::Stage;

/// The shape of a KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPoolConfig {
    /// Attention layers.
    pub layers: usize,
    /// Bytes per entry (one token of one layer): 656 for DeepSeek V3.2.
    pub entry_bytes: usize,
    /// Tokens the sequence may hold.
    pub max_tokens: u64,
    /// Entries host memory holds, over all layers (at most `layers × max_tokens`).
    pub warm_entries: u64,
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
    /// DeepSeek V3.2's shape for one sequence of `max_tokens`, all of it in host memory: 61
    /// layers of 656-byte entries, top-2048 selections, 4096 hot slots per layer.
    pub fn deepseek_v32(max_tokens: u64) -> Self {
        Self {
            layers: 61,
            entry_bytes: 656,
            max_tokens,
            warm_entries: 61 * max_tokens,
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
    /// Of those, brought back from the cold tier first.
    pub from_cold: usize,
    /// Bytes that crossed from host memory.
    pub bytes_from_host: u64,
}

/// What an eviction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EvictReport {
    /// Entries that left host memory.
    pub evicted: usize,
    /// Of them, kept compressed in the cold tier (the rest are gone).
    pub to_cold: usize,
    /// Host memory freed, in bytes.
    pub bytes_freed: u64,
}

/// Where an entry is kept (a hot copy in device memory may exist beside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Host memory.
    Warm,
    /// Compressed in the cold tier.
    Cold,
    /// Evicted with no cold tier: gone.
    Dropped,
}

/// Where an entry is: its warm row, `COLD | frame`, or nowhere.
const ABSENT: u64 = u64::MAX;
const COLD: u64 = 1 << 63;

/// A sequence's KV entries across the tiers. Not shared between threads: one decode loop
/// drives it.
pub struct KvPool {
    cfg: KvPoolConfig,
    warm: HostMemory,
    free_rows: Vec<u64>,
    /// Per layer, per position: where the entry is (positions below the layer's length).
    residence: Vec<Vec<u64>>,
    /// Importance scores per layer, by position.
    importance: Vec<Vec<f32>>,
    hot: Vec<HotLayer>,
    /// A load's codes; taken out for the length of a load.
    stage: Option<Stage>,
    cold: Option<ColdTier>,
    step: u64,
    /// Takes the scheduler leases its IO runs under, in `work`'s class.
    lessor: Lessor,
    work: AiWork,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("config", &self.cfg)
            .field("warm_free", &self.free_rows.len())
            .field("cold", &self.cold)
            .finish()
    }
}

impl KvPool {
    /// A pool of `cfg`'s shape, its host memory and hot buffers allocated now; a size the
    /// machine cannot back is refused first.
    pub fn new(session: &Session, cfg: KvPoolConfig) -> Result<Self> {
        let bad = |why: String| Err(AiError::InvalidArgument(format!("KV pool: {why}")));
        let entries = (cfg.layers as u64).checked_mul(cfg.max_tokens);
        if cfg.layers == 0 || cfg.entry_bytes == 0 || cfg.max_tokens == 0 || cfg.warm_entries == 0 {
            return bad(format!("{cfg:?} has nothing to hold"));
        }
        if entries.is_none_or(|n| cfg.warm_entries > n) {
            return bad(format!(
                "{} warm entries, more than the {} layers × {} tokens",
                cfg.warm_entries, cfg.layers, cfg.max_tokens
            ));
        }
        if cfg.max_selection == 0 || cfg.max_selection > cfg.hot_slots {
            return bad(format!(
                "a selection of up to {} needs 1 to {} hot slots",
                cfg.max_selection, cfg.hot_slots
            ));
        }
        if cfg.hot_slots as u64 >= TIER_MAX_HOT_ROWS || cfg.warm_entries >= TIER_MAX_WARM_ROWS {
            return bad(format!(
                "{} hot slots and {} warm entries: at most {} and {}",
                cfg.hot_slots,
                cfg.warm_entries,
                TIER_MAX_HOT_ROWS - 1,
                TIER_MAX_WARM_ROWS - 1
            ));
        }
        let warm_len = cfg
            .warm_entries
            .checked_mul(cfg.entry_bytes as u64)
            .and_then(|b| usize::try_from(b).ok());
        let hot_len = cfg.hot_slots.checked_mul(cfg.entry_bytes);
        let (Some(warm_len), Some(hot_len)) = (warm_len, hot_len) else {
            return bad(format!("{cfg:?} overflows"));
        };
        let warm = session.alloc_host(cfg.placement, warm_len, true)?;
        let gpu = session.gpu(cfg.gpu)?.clone();
        let mut hot = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            hot.push(HotLayer::new(
                session.alloc_device(cfg.gpu, hot_len)?,
                cfg.hot_slots,
            ));
        }
        Ok(Self {
            stage: Some(Stage::new(&gpu, tiered_stage_len(cfg.max_selection, 1))?),
            free_rows: (0..cfg.warm_entries).rev().collect(),
            residence: vec![Vec::new(); cfg.layers],
            importance: vec![Vec::new(); cfg.layers],
            cfg,
            warm,
            hot,
            cold: None,
            step: 0,
            lessor: session.lessor(),
            work: AiWork::Decode,
        })
    }

    /// The work this pool's IO is for (a decode step's, [`AiWork::Decode`], unless set):
    /// every load, store and eviction holds a scheduler lease of its class while it moves
    /// data, with its IO deadline where it has one. Work that leaves no time for IO is
    /// refused, and the pool keeps its work.
    pub fn set_work(&mut self, work: AiWork) -> Result<()> {
        self.work = work.checked()?;
        Ok(())
    }

    /// The work this pool's IO is for.
    pub fn work(&self) -> AiWork {
        self.work
    }

    /// A lease for this pool's IO.
    pub(crate) fn lease(&self) -> Result<gpuio_api::Lease> {
        self.work.lease(&self.lessor)
    }

    /// Evicted entries go to `tier` from now on, compressed, instead of being dropped. A
    /// pool keeps one cold tier for its life: a second is refused (the entries in the first
    /// are found by their place in it).
    pub fn attach_cold_tier(&mut self, tier: ColdTier) -> Result<()> {
        if self.cold.is_some() {
            return Err(AiError::InvalidArgument(
                "this KV pool has a cold tier already".into(),
            ));
        }
        self.cold = Some(tier);
        Ok(())
    }

    /// The cold tier, where one is attached.
    pub fn cold_tier(&self) -> Option<&ColdTier> {
        self.cold.as_ref()
    }

    /// Its shape.
    pub fn config(&self) -> &KvPoolConfig {
        &self.cfg
    }

    /// Tokens stored in `layer` (0 for a layer that is not there).
    pub fn len(&self, layer: usize) -> u64 {
        self.residence.get(layer).map_or(0, |r| r.len() as u64)
    }

    /// Whether no layer holds a token.
    pub fn is_empty(&self) -> bool {
        self.residence.iter().all(Vec::is_empty)
    }

    /// Entries host memory has room for now.
    pub fn warm_free(&self) -> u64 {
        self.free_rows.len() as u64
    }

    /// Entries of `layer` in the hot buffer now.
    pub fn hot_entries(&self, layer: usize) -> usize {
        self.hot.get(layer).map_or(0, HotLayer::len)
    }

    /// Where entry (`layer`, `pos`) is kept; `None` where it was never stored.
    pub fn tier_of(&self, layer: usize, pos: u64) -> Option<Tier> {
        let r = *self.residence.get(layer)?.get(pos as usize)?;
        Some(match r {
            ABSENT => Tier::Dropped,
            r if r & COLD != 0 => Tier::Cold,
            _ => Tier::Warm,
        })
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

    fn full(&self, needed: usize) -> AiError {
        AiError::TierFull(format!(
            "host memory holds {} more KV entries, {needed} needed: evict_by_importance first",
            self.free_rows.len()
        ))
    }

    /// Stores `count` entries of `layer` from `src` at `src_offset` (entry after entry) at
    /// positions `first..first + count`, with their importance scores where given (one per
    /// entry). Entries may be written again, but not past the end with a gap
    /// (`first <= len(layer)`). They go to host memory (room for them is checked first) and
    /// their hot copies are dropped.
    #[allow(clippy::too_many_arguments)]
    pub fn store(
        &mut self,
        session: &Session,
        layer: usize,
        first: u64,
        count: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        scores: Option<&[f32]>,
    ) -> Result<()> {
        self.check_layer(layer)?;
        let len = self.len(layer);
        let end = first.checked_add(count as u64);
        if first > len || end.is_none_or(|e| e > self.cfg.max_tokens) {
            return Err(AiError::InvalidArgument(format!(
                "storing positions {first}..{first}+{count} of layer {layer}, which holds {len} \
                 of at most {} tokens",
                self.cfg.max_tokens
            )));
        }
        if scores.is_some_and(|s| s.len() != count) {
            return Err(AiError::InvalidArgument(format!(
                "{count} entries with {} importance scores",
                scores.map_or(0, <[f32]>::len)
            )));
        }
        let end = first + count as u64;
        let e = self.cfg.entry_bytes;
        gpuio_hal::check_range(
            "KV store source",
            src_offset,
            count.saturating_mul(e),
            src.len(),
        )
        .map_err(gpuio_api::Error::from)?;
        let res = &self.residence[layer];
        let needed = (first..end)
            .filter(|&p| res.get(p as usize).is_none_or(|&r| r & COLD != 0))
            .count();
        if needed > self.free_rows.len() {
            return Err(self.full(needed));
        }
        // Before anything changes: a lease that cannot be had leaves the pool as it was.
        let lease = self.lease()?;
        let res = &mut self.residence[layer];
        let old_len = res.len();
        if res.len() < end as usize {
            res.resize(end as usize, ABSENT);
        }
        // Hot copies go first: a scatter that fails half-way must not leave them beside
        // changed host rows.
        let hot = &mut self.hot[layer];
        (first..end).for_each(|p| hot.drop_entry(p));
        let res = &mut self.residence[layer];
        let mut rows = Vec::with_capacity(count);
        let mut taken = Vec::new();
        for p in first..end {
            let r = &mut res[p as usize];
            if *r & COLD != 0 {
                taken.push((p, *r));
                *r = self.free_rows.pop().expect("room was checked");
            }
            rows.push(*r);
        }
        let scattered = {
            let mut warm = self.warm.write();
            session
                .memio()
                .scatter(src, src_offset, e, &rows, &mut warm)
        };
        drop(lease);
        if let Err(err) = scattered {
            // Nothing stored: the entries keep where they were, the rows go back.
            let res = &mut self.residence[layer];
            for &(p, old) in taken.iter().rev() {
                self.free_rows.push(res[p as usize]);
                res[p as usize] = old;
            }
            res.truncate(old_len);
            return Err(gpuio_api::Error::from(err).into());
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
    /// once. A miss evicted without a cold tier is an error, and so is a cold miss when host
    /// memory has no room to bring it back ([`AiError::TierFull`]).
    pub fn load(
        &mut self,
        layer: usize,
        selection: &[u64],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<LoadReport> {
        let mut stage = self
            .stage
            .take()
            .ok_or_else(|| AiError::InvalidArgument("the KV pool's stage is in use".into()))?;
        let mut one = [KvLoad {
            pool: self,
            layer,
            selection,
            dst,
            dst_offset,
        }];
        let done = load::run(&mut one, &mut stage, None, false);
        self.stage = Some(stage);
        Ok(done?.0.pop().unwrap_or_default())
    }

    /// Brings the cold ones among `misses` back to host memory (checked and decompressed);
    /// how many. Refused before any moves where one was dropped or host memory lacks room.
    fn bring_back(&mut self, layer: usize, misses: &[u64]) -> Result<usize> {
        let res = &self.residence[layer];
        if let Some(p) = misses.iter().find(|&&p| res[p as usize] == ABSENT) {
            return Err(AiError::InvalidArgument(format!(
                "position {p} of layer {layer} was evicted with no cold tier to keep it"
            )));
        }
        let cold: Vec<u64> = misses
            .iter()
            .copied()
            .filter(|&p| res[p as usize] & COLD != 0)
            .collect();
        if cold.len() > self.free_rows.len() {
            return Err(self.full(cold.len()));
        }
        let e = self.cfg.entry_bytes;
        for &p in &cold {
            let frame = self.residence[layer][p as usize] & !COLD;
            let tier = self.cold.as_ref().ok_or_else(|| {
                AiError::Corrupt(format!(
                    "position {p} of layer {layer} is cold, with no tier"
                ))
            })?;
            let row = *self.free_rows.last().expect("room was checked");
            let at = row as usize * e;
            tier.get(frame, &mut self.warm.write()[at..at + e])?;
            self.free_rows.pop();
            self.residence[layer][p as usize] = row;
        }
        Ok(cold.len())
    }

    /// Frees host memory of at least `required` bytes (as far as there are such entries)
    /// from entries whose importance is below `threshold`, least important first: each goes
    /// to the cold tier, compressed, or is dropped where there is none. Their hot copies stay
    /// (they are still right).
    pub fn evict_by_importance(&mut self, required: u64, threshold: f32) -> Result<EvictReport> {
        let mut candidates: Vec<(f32, usize, u64)> = Vec::new();
        for (layer, res) in self.residence.iter().enumerate() {
            for (pos, &r) in res.iter().enumerate() {
                let imp = self.importance(layer, pos as u64);
                if r & COLD == 0 && imp < threshold {
                    candidates.push((imp, layer, pos as u64));
                }
            }
        }
        candidates.sort_by(|a, b| a.0.total_cmp(&b.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        let e = self.cfg.entry_bytes;
        let mut report = EvictReport::default();
        let mut entry = vec![0u8; e];
        // Entries leave for the cold tier (a file or another node) under the pool's class.
        let _lease = self.cold.is_some().then(|| self.lease()).transpose()?;
        for (_, layer, pos) in candidates {
            if report.bytes_freed >= required {
                break;
            }
            let row = self.residence[layer][pos as usize];
            let next = match self.cold.as_mut() {
                Some(tier) => {
                    let at = row as usize * e;
                    entry.copy_from_slice(&self.warm.read()[at..at + e]);
                    report.to_cold += 1;
                    COLD | tier.put(&entry)?
                }
                None => ABSENT,
            };
            self.residence[layer][pos as usize] = next;
            self.free_rows.push(row);
            report.evicted += 1;
            report.bytes_freed += e as u64;
        }
        Ok(report)
    }

    /// Moves every entry below `threshold` to the cold tier (which must be attached).
    pub fn compact(&mut self, threshold: f32) -> Result<EvictReport> {
        if self.cold.is_none() {
            return Err(AiError::InvalidArgument(
                "compact needs a cold tier (attach_cold_tier)".into(),
            ));
        }
        self.evict_by_importance(u64::MAX, threshold)
    }
}
