//! The multi-level block cache (docs/REFERENCE.md#block-cache) in front of a [`BackingStore`].
//!
//! Three levels, each optional: **L1** in GPU memory (one device arena), **L2** in host memory
//! (one arena, pinned for the GPU where there is one), **L3** on a local SSD (one unlinked file
//! in a configured directory). Levels are *exclusive*: a block lives in at most one of them. A
//! hit below the top promotes the block to the top; a full level's LRU victim moves down one
//! level, keeping its state; the lowest level's victim is written back if dirty, then dropped.
//!
//! Blocks follow the coherence protocol ([`BlockState`], docs/REFERENCE.md#coherence-states): a
//! read miss loads a block as `Valid`; a write makes it `Dirty` (write-back) or writes the backing
//! store too and leaves it `Valid` (write-through); a flush marks it `Flushing`, copies it out,
//! writes it with the directory unlocked and makes it `Valid` again — unless a write landed
//! meanwhile, which left it `Dirty`. A block with a flush in flight never moves, so the flush
//! always finds it.
//!
//! One mutex guards the directory and the levels' storage; the only IO done without it is
//! flushing and prefetch loads. A [`prefetch`] thread loads predicted blocks into L2 (or the
//! top level where there is no L2) as `Valid`, never over a cached block.
//!
//! This file holds the public interface: the configuration, the counters and [`BlockCache`].
//! `dir.rs` holds the directory (which level holds which block, in which slot and state, in
//! LRU order) and the levels' storage; `coherence.rs` the protocol run under the directory's
//! lock (reads, writes, promotion, eviction, prefetch loads); `writeback.rs` flushing, the one
//! write to the backing store made with the directory unlocked.

mod coherence;
mod dir;
pub mod prefetch;
#[cfg(test)]
mod tests;
mod writeback;

pub use prefetch::{Predictor, PrefetchConfig};

use crate::{CoreError, Result};
use coherence::Shared;
use dir::{Dir, Src, Store, Tier, l3_file};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{DeviceBuffer, Gpu, HostAllocOptions, HostBuffer, Stream};
use gpuio_transport_localio::FileHandle;
use metrics::counter;
use prefetch::Prefetcher;
use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};

/// Largest accepted [`CacheConfig::block_size`].
pub const MAX_BLOCK_SIZE: usize = 1 << 30;

/// Upload streams a cache keeps between [`BlockCache::read_to_device`] calls (one per reader
/// running at once, up to this many).
const KEPT_STREAMS: usize = 16;

/// What the cache sits in front of: a fixed-size byte store with positioned IO.
pub trait BackingStore: Send + Sync + fmt::Debug {
    /// Length in bytes.
    fn len(&self) -> Result<u64>;
    /// Whether the store has no bytes.
    fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Reads exactly `buf.len()` bytes at `off`.
    fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<()>;
    /// Writes all of `buf` at `off`.
    fn write_at(&self, off: u64, buf: &[u8]) -> Result<()>;
    /// Makes written data durable.
    fn sync(&self) -> Result<()>;
}

impl BackingStore for FileHandle {
    fn len(&self) -> Result<u64> {
        Ok(FileHandle::len(self)?)
    }

    fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        Ok(self.read_exact_at(off, buf)?)
    }

    fn write_at(&self, off: u64, buf: &[u8]) -> Result<()> {
        Ok(self.write_all_at(off, buf)?)
    }

    fn sync(&self) -> Result<()> {
        Ok(self.sync_data()?)
    }
}

/// When writes reach the backing store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteMode {
    /// Every write goes to the backing store before it returns; cached blocks stay `Valid`.
    WriteThrough,
    /// Writes stay in the cache (`Dirty`) until a flush or an eviction writes them back.
    #[default]
    WriteBack,
}

/// How a [`BlockCache`] is built. A level with no blocks, L1 without a GPU and L3 without a
/// directory are absent; at least one level must be present.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Bytes per block (at most [`MAX_BLOCK_SIZE`]).
    pub block_size: usize,
    /// Blocks in GPU memory (L1).
    pub l1_blocks: usize,
    /// Blocks in host memory (L2).
    pub l2_blocks: usize,
    /// Blocks on the local SSD (L3).
    pub l3_blocks: usize,
    /// Where L3's file goes (`None`: no L3). It is unlinked as soon as it is open, so nothing
    /// is left behind, even after a crash.
    pub l3_dir: Option<PathBuf>,
    /// The GPU of L1, which L2 is also pinned for (`None`: no L1).
    pub gpu: Option<Gpu>,
    /// Write-through or write-back.
    pub mode: WriteMode,
    /// Prefetching.
    pub prefetch: PrefetchConfig,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            block_size: 64 << 10,
            l1_blocks: 256,
            l2_blocks: 1024,
            l3_blocks: 4096,
            l3_dir: None,
            gpu: None,
            mode: WriteMode::default(),
            prefetch: PrefetchConfig::default(),
        }
    }
}

/// A cache level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// GPU memory.
    L1,
    /// Host memory.
    L2,
    /// Local SSD.
    L3,
}

impl Level {
    /// The metric label: `l1`, `l2` or `l3`.
    pub fn label(self) -> &'static str {
        match self {
            Self::L1 => "l1",
            Self::L2 => "l2",
            Self::L3 => "l3",
        }
    }
}

/// A block's coherence state (docs/REFERENCE.md#coherence-states).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum BlockState {
    /// Not cached.
    Invalid,
    /// Cached, equal to the backing store.
    Valid,
    /// Cached, newer than the backing store.
    Dirty,
    /// Being written to the backing store.
    Flushing,
}

/// One level's counters.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LevelStats {
    /// The level.
    pub level: Level,
    /// Its capacity in blocks.
    pub capacity: usize,
    /// Blocks it holds now.
    pub resident: usize,
    /// Lookups that found the block here.
    pub hits: u64,
    /// Lookups that reached this level and did not find the block here.
    pub misses: u64,
    /// Blocks that left this level to make room (moved down, or dropped from the lowest).
    pub evictions: u64,
}

/// A snapshot of a cache's counters.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CacheStats {
    /// The levels present, top first.
    pub levels: Vec<LevelStats>,
    /// Dirty blocks written to the backing store (flushes and evictions).
    pub writebacks: u64,
    /// Blocks the prefetcher loaded into the cache.
    pub prefetch_issued: u64,
    /// Prefetched blocks that were hit before they left the cache.
    pub prefetch_useful: u64,
}

impl CacheStats {
    /// The counters of `level`, if the cache has it.
    pub fn level(&self, level: Level) -> Option<&LevelStats> {
        self.levels.iter().find(|l| l.level == level)
    }
}

/// A block cache in front of a [`BackingStore`]; see the [module docs](self). Share it behind
/// an `Arc`: every method takes `&self` except [`close`](Self::close).
pub struct BlockCache {
    shared: Arc<Shared>,
    prefetcher: Option<Prefetcher>,
    /// Streams that uploaded blocks not in L1, kept for the next reads to device memory:
    /// making a stream is a driver call, which would cost more than a small read.
    uploads: Mutex<Vec<Stream>>,
}

impl fmt::Debug for BlockCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockCache")
            .field("backing", &self.shared.backing)
            .field("len", &self.shared.len)
            .field("block_size", &self.shared.block_size)
            .field("mode", &self.shared.mode)
            .finish_non_exhaustive()
    }
}

impl BlockCache {
    /// Builds a cache over `backing`, whose length is read once, now: the cache serves exactly
    /// that many bytes.
    pub fn new(backing: Arc<dyn BackingStore>, cfg: CacheConfig) -> Result<Self> {
        let bs = cfg.block_size;
        if bs == 0 || bs > MAX_BLOCK_SIZE {
            return Err(CoreError::InvalidRequest(format!(
                "cache block size {bs} is outside 1..={MAX_BLOCK_SIZE}"
            )));
        }
        cfg.prefetch.validate()?;
        let arena = |blocks: usize, what: &str| {
            blocks.checked_mul(bs).ok_or_else(|| {
                CoreError::InvalidRequest(format!("{what}: {blocks} blocks of {bs} bytes overflow"))
            })
        };
        let mut tiers = Vec::new();
        if let Some(gpu) = cfg.gpu.as_ref().filter(|_| cfg.l1_blocks > 0) {
            let buf = gpu.alloc(arena(cfg.l1_blocks, "L1")?)?;
            let stream = gpu.stream()?;
            tiers.push(Tier::new(
                Level::L1,
                cfg.l1_blocks,
                Store::Device { buf, stream },
            ));
        }
        if cfg.l2_blocks > 0 {
            let mut buf =
                HostBuffer::alloc(arena(cfg.l2_blocks, "L2")?, &HostAllocOptions::default())?;
            if let Some(gpu) = &cfg.gpu {
                // Pinned, so promotions to and demotions from L1 run as direct DMA.
                buf.pin(gpu)?;
            }
            tiers.push(Tier::new(Level::L2, cfg.l2_blocks, Store::Host(buf)));
        }
        if let Some(dir) = cfg.l3_dir.as_ref().filter(|_| cfg.l3_blocks > 0) {
            let len = arena(cfg.l3_blocks, "L3")? as u64;
            tiers.push(Tier::new(
                Level::L3,
                cfg.l3_blocks,
                Store::File(l3_file(dir, len)?),
            ));
        }
        if tiers.is_empty() {
            return Err(CoreError::InvalidRequest(
                "the cache has no level: give L1 blocks and a GPU, L2 blocks, or L3 blocks and a \
                 directory"
                    .into(),
            ));
        }
        let prefetch_tier = tiers.iter().position(|t| t.level == Level::L2).unwrap_or(0);
        let len = backing.len()?;
        let shared = Arc::new(Shared {
            backing,
            len,
            block_size: bs,
            nblocks: len.div_ceil(bs as u64),
            mode: cfg.mode,
            prefetch_tier,
            dir: Mutex::new(Dir {
                tiers,
                entries: HashMap::new(),
                clock: 0,
                epoch: 0,
                writebacks: 0,
                prefetch_issued: 0,
                prefetch_useful: 0,
            }),
            idle: Condvar::new(),
            writebacks: counter!(crate::metrics::CACHE_WRITEBACKS),
        });
        let prefetcher = if cfg.prefetch.enabled && cfg.prefetch.depth > 0 {
            let s = Arc::clone(&shared);
            Some(Prefetcher::start(
                &cfg.prefetch,
                shared.nblocks,
                move |b| s.prefetch(b),
            )?)
        } else {
            None
        };
        Ok(Self {
            shared,
            prefetcher,
            uploads: Mutex::new(Vec::new()),
        })
    }

    /// Bytes the cache serves (the backing store's length when the cache was built).
    pub fn len(&self) -> u64 {
        self.shared.len
    }

    /// Whether the cache serves no bytes.
    pub fn is_empty(&self) -> bool {
        self.shared.len == 0
    }

    /// Bytes per block.
    pub fn block_size(&self) -> usize {
        self.shared.block_size
    }

    /// Reads `buf.len()` bytes at `off`.
    pub fn read(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        let s = &*self.shared;
        let blocks = s.check(off, buf.len())?;
        self.observe(blocks);
        let mut done = 0;
        for (b, at, n) in s.pieces(off, buf.len()) {
            let out = &mut buf[done..done + n];
            s.read_block(b, at, n, &mut |src| match src {
                Src::Store(store, pos) => store.read(pos, out),
                Src::Mem(m) => {
                    out.copy_from_slice(m);
                    Ok(())
                }
            })?;
            done += n;
        }
        Ok(())
    }

    /// Reads `len` bytes at `off` into `dst` at `dst_off`. Blocks in L1 are copied device to
    /// device where `dst` is on L1's GPU; the rest go through host memory.
    pub fn read_to_device(
        &self,
        off: u64,
        len: usize,
        dst: &DeviceBuffer,
        dst_off: usize,
    ) -> Result<()> {
        let s = &*self.shared;
        if dst_off.checked_add(len).is_none_or(|end| end > dst.len()) {
            return Err(CoreError::InvalidRequest(format!(
                "destination range {dst_off}+{len} exceeds the {}-byte device buffer",
                dst.len()
            )));
        }
        let blocks = s.check(off, len)?;
        self.observe(blocks);
        // Taken on first use: a range entirely in L1 needs no stream of dst's device.
        let mut stream: Option<Stream> = None;
        let copied = self.copy_to_device(off, len, dst, dst_off, &mut stream);
        // Kept only after success: a stream that failed may be unusable.
        if let (Some(st), Ok(())) = (stream, &copied) {
            let mut kept = self.uploads.lock_unpoisoned();
            if kept.len() < KEPT_STREAMS {
                kept.push(st);
            }
        }
        copied
    }

    /// [`read_to_device`](Self::read_to_device)'s copies, uploading through `stream` (taken
    /// from the kept ones, or made, when first needed).
    fn copy_to_device(
        &self,
        off: u64,
        len: usize,
        dst: &DeviceBuffer,
        dst_off: usize,
        stream: &mut Option<Stream>,
    ) -> Result<()> {
        let s = &*self.shared;
        let mut bounce = Vec::new();
        let mut done = 0;
        for (b, at, n) in s.pieces(off, len) {
            let to = dst_off + done;
            let mut upload = |data: &[u8]| -> Result<()> {
                let st = match stream {
                    Some(st) => st,
                    None => stream.insert(self.upload_stream(dst.gpu())?),
                };
                Ok(st.upload(data, dst, to)?)
            };
            s.read_block(b, at, n, &mut |src| match src {
                Src::Store(Store::Device { buf, stream: l1 }, pos)
                    if buf.gpu().same_device(dst.gpu()) || buf.gpu().can_access_peer(dst.gpu()) =>
                {
                    Ok(l1.copy_device(buf, pos, dst, to, n)?)
                }
                Src::Store(store, pos) => {
                    bounce.resize(n, 0);
                    store.read(pos, &mut bounce)?;
                    upload(&bounce)
                }
                Src::Mem(m) => upload(m),
            })?;
            done += n;
        }
        Ok(())
    }

    /// A kept upload stream of `gpu`, or a new one.
    fn upload_stream(&self, gpu: &Gpu) -> Result<Stream> {
        let mut kept = self.uploads.lock_unpoisoned();
        match kept.iter().position(|st| st.gpu().same_device(gpu)) {
            Some(i) => Ok(kept.swap_remove(i)),
            None => {
                drop(kept);
                Ok(gpu.stream()?)
            }
        }
    }

    /// Writes `data` at `off`.
    pub fn write(&self, off: u64, data: &[u8]) -> Result<()> {
        let s = &*self.shared;
        s.check(off, data.len())?;
        let mut done = 0;
        for (b, at, n) in s.pieces(off, data.len()) {
            s.write_block(b, at, &data[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Writes every block that was dirty when the call began to the backing store and syncs
    /// it. Blocks written meanwhile may stay dirty. Keeps going past a failed block and
    /// returns the first error.
    pub fn flush(&self) -> Result<()> {
        self.shared.flush()
    }

    /// Stops the prefetcher and flushes. The cache still serves requests afterwards, without
    /// prefetching. Dropping the cache does the same, logging what fails.
    pub fn close(&mut self) -> Result<()> {
        if let Some(mut p) = self.prefetcher.take() {
            p.stop();
        }
        self.shared.flush()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> CacheStats {
        let d = self.shared.dir.lock_unpoisoned();
        CacheStats {
            levels: d
                .tiers
                .iter()
                .map(|t| LevelStats {
                    level: t.level,
                    capacity: t.capacity,
                    resident: t.lru.len(),
                    hits: t.hits,
                    misses: t.misses,
                    evictions: t.evictions,
                })
                .collect(),
            writebacks: d.writebacks,
            prefetch_issued: d.prefetch_issued,
            prefetch_useful: d.prefetch_useful,
        }
    }

    /// Introspection (tests, debugging): the level holding block `block`, if any.
    pub fn level_of(&self, block: u64) -> Option<Level> {
        let d = self.shared.dir.lock_unpoisoned();
        d.entries.get(&block).map(|e| d.tiers[e.tier].level)
    }

    /// Introspection (tests, debugging): the state of block `block`.
    pub fn state_of(&self, block: u64) -> BlockState {
        let d = self.shared.dir.lock_unpoisoned();
        d.entries
            .get(&block)
            .map_or(BlockState::Invalid, |e| e.state)
    }

    fn observe(&self, blocks: std::ops::Range<u64>) {
        if let Some(p) = &self.prefetcher {
            p.observe(blocks, |hints| {
                let d = self.shared.dir.lock_unpoisoned();
                hints.retain(|b| !d.entries.contains_key(b));
            });
        }
    }
}

impl Drop for BlockCache {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::error!(error = %e, "block cache: writing dirty blocks back on drop failed");
        }
    }
}
