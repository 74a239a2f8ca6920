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

pub mod prefetch;

pub use prefetch::{Predictor, PrefetchConfig};

use crate::{CoreError, Result};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{DeviceBuffer, Gpu, HostAllocOptions, HostBuffer, Stream};
use gpuio_transport_localio::{FileHandle, LocalIoError};
use metrics::{Counter, counter};
use prefetch::Prefetcher;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Largest accepted [`CacheConfig::block_size`].
pub const MAX_BLOCK_SIZE: usize = 1 << 30;

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
        Ok(Self { shared, prefetcher })
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
        // Made on first use: a range entirely in L1 needs no stream of dst's device.
        let mut stream: Option<Stream> = None;
        let mut bounce = Vec::new();
        let mut done = 0;
        for (b, at, n) in s.pieces(off, len) {
            let to = dst_off + done;
            let mut upload = |data: &[u8]| -> Result<()> {
                let st = match &stream {
                    Some(st) => st,
                    None => stream.insert(dst.gpu().stream()?),
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
            p.observe(blocks);
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

/// Creates L3's file in `dir`, `len` bytes long, and unlinks it: the open handle keeps it.
fn l3_file(dir: &Path, len: u64) -> Result<FileHandle> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut tries = 0;
    let (file, path) = loop {
        let path = dir.join(format!(
            ".gpuio-cache-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(f) => break (f, path),
            // A stale file of an earlier process with our pid: take the next name.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 64 => tries += 1,
            Err(source) => return Err(LocalIoError::Open { path, source }.into()),
        }
    };
    std::fs::remove_file(&path).map_err(|source| LocalIoError::Io {
        op: "unlink",
        path: path.clone(),
        offset: 0,
        source,
    })?;
    let handle = FileHandle::from_file(file, path, true);
    handle.set_len(len)?;
    Ok(handle)
}

/// Where a level keeps its blocks; slot `i` is at byte `i * block_size`.
enum Store {
    Device { buf: DeviceBuffer, stream: Stream },
    Host(HostBuffer),
    File(FileHandle),
}

impl Store {
    fn read(&self, at: usize, out: &mut [u8]) -> Result<()> {
        match self {
            Self::Device { buf, stream } => Ok(stream.download(buf, at, out)?),
            Self::Host(h) => {
                out.copy_from_slice(&h[at..at + out.len()]);
                Ok(())
            }
            Self::File(f) => Ok(f.read_exact_at(at as u64, out)?),
        }
    }

    fn write(&mut self, at: usize, data: &[u8]) -> Result<()> {
        match self {
            Self::Device { buf, stream } => Ok(stream.upload(data, buf, at)?),
            Self::Host(h) => {
                h[at..at + data.len()].copy_from_slice(data);
                Ok(())
            }
            Self::File(f) => Ok(f.write_all_at(at as u64, data)?),
        }
    }
}

/// Where a read's bytes come from: a level's storage at a byte offset, or a block just loaded.
enum Src<'a> {
    Store(&'a Store, usize),
    Mem(&'a [u8]),
}

struct Tier {
    level: Level,
    capacity: usize,
    store: Store,
    free: Vec<usize>,
    /// LRU order: access stamp → block; the first entry is the least recently used.
    lru: BTreeMap<u64, u64>,
    hits: u64,
    misses: u64,
    evictions: u64,
    m_hit: Counter,
    m_miss: Counter,
    m_evict: Counter,
}

impl Tier {
    fn new(level: Level, capacity: usize, store: Store) -> Self {
        let l = level.label();
        Self {
            level,
            capacity,
            store,
            free: (0..capacity).rev().collect(),
            lru: BTreeMap::new(),
            hits: 0,
            misses: 0,
            evictions: 0,
            m_hit: counter!(crate::metrics::CACHE_LOOKUPS, "level" => l, "result" => "hit"),
            m_miss: counter!(crate::metrics::CACHE_LOOKUPS, "level" => l, "result" => "miss"),
            m_evict: counter!(crate::metrics::CACHE_EVICTIONS, "level" => l),
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    tier: usize,
    slot: usize,
    stamp: u64,
    state: BlockState,
    /// A flush is writing this block with the directory unlocked: it must not move.
    busy: bool,
    /// Brought in by the prefetcher and not hit since.
    prefetched: bool,
}

/// The directory and the levels' storage, under one mutex.
struct Dir {
    tiers: Vec<Tier>,
    entries: HashMap<u64, Entry>,
    clock: u64,
    /// Bumped whenever a write to the backing store begins, so a prefetch that read the store
    /// unlocked can tell whether what it read may be stale.
    epoch: u64,
    writebacks: u64,
    prefetch_issued: u64,
    prefetch_useful: u64,
}

impl Dir {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Marks `b` most recently used in its level.
    fn touch(&mut self, b: u64) {
        let stamp = self.tick();
        if let Some(e) = self.entries.get_mut(&b) {
            let tier = &mut self.tiers[e.tier];
            tier.lru.remove(&e.stamp);
            tier.lru.insert(stamp, b);
            e.stamp = stamp;
        }
    }

    /// Writes `data` into a free slot of `tier` and returns the slot (the directory is
    /// unchanged if the write fails).
    fn store_into(&mut self, tier: usize, data: &[u8], bs: usize) -> Result<usize> {
        let t = &mut self.tiers[tier];
        let slot = t.free.pop().ok_or_else(|| {
            CoreError::Internal(format!("cache level {:?} has no free slot", t.level))
        })?;
        if let Err(e) = t.store.write(slot * bs, data) {
            t.free.push(slot);
            return Err(e);
        }
        Ok(slot)
    }

    /// Enters `b` as held in `slot` of `tier`, most recently used.
    fn link(&mut self, b: u64, tier: usize, slot: usize, state: BlockState, prefetched: bool) {
        let stamp = self.tick();
        self.tiers[tier].lru.insert(stamp, b);
        self.entries.insert(
            b,
            Entry {
                tier,
                slot,
                stamp,
                state,
                busy: false,
                prefetched,
            },
        );
    }

    /// Removes `b` from the directory and frees its slot.
    fn unlink(&mut self, b: u64) -> Option<Entry> {
        let e = self.entries.remove(&b)?;
        let t = &mut self.tiers[e.tier];
        t.lru.remove(&e.stamp);
        t.free.push(e.slot);
        Some(e)
    }

    fn read_slot(&self, e: &Entry, len: usize, bs: usize) -> Result<Vec<u8>> {
        let mut data = vec![0; len];
        self.tiers[e.tier].store.read(e.slot * bs, &mut data)?;
        Ok(data)
    }

    /// Counts a lookup that found its block in `tier` (and missed every level above).
    fn count_hit(&mut self, tier: usize) {
        for t in &mut self.tiers[..tier] {
            t.misses += 1;
            t.m_miss.increment(1);
        }
        let t = &mut self.tiers[tier];
        t.hits += 1;
        t.m_hit.increment(1);
    }

    /// Counts a lookup that missed every level.
    fn count_miss(&mut self) {
        for t in &mut self.tiers {
            t.misses += 1;
            t.m_miss.increment(1);
        }
    }
}

/// Whether a step could run or must wait for a flush to finish.
#[must_use]
enum Progress {
    Done,
    Blocked,
}

struct Shared {
    backing: Arc<dyn BackingStore>,
    len: u64,
    block_size: usize,
    nblocks: u64,
    mode: WriteMode,
    /// Where prefetched blocks go: L2, or the top level where there is no L2.
    prefetch_tier: usize,
    dir: Mutex<Dir>,
    /// Signalled whenever a flush of a block finishes (a busy block became movable).
    idle: Condvar,
    writebacks: Counter,
}

impl Shared {
    fn lock(&self) -> Result<MutexGuard<'_, Dir>> {
        self.dir
            .lock()
            .map_err(|_| CoreError::Internal("the cache directory is poisoned".into()))
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Dir>) -> Result<MutexGuard<'a, Dir>> {
        self.idle
            .wait(g)
            .map_err(|_| CoreError::Internal("the cache directory is poisoned".into()))
    }

    /// Checks `off..off+len` against the store and returns the blocks it touches.
    fn check(&self, off: u64, len: usize) -> Result<std::ops::Range<u64>> {
        match off.checked_add(len as u64) {
            Some(end) if end <= self.len => {
                let bs = self.block_size as u64;
                Ok(off / bs..end.div_ceil(bs))
            }
            _ => Err(CoreError::InvalidRequest(format!(
                "range {off}+{len} lies outside the {}-byte cached store",
                self.len
            ))),
        }
    }

    /// `off..off+len` cut at block boundaries: (block, offset in it, length).
    fn pieces(&self, off: u64, len: usize) -> impl Iterator<Item = (u64, usize, usize)> + use<> {
        let bs = self.block_size as u64;
        let end = off + len as u64;
        let mut at = off;
        std::iter::from_fn(move || {
            (at < end).then(|| {
                let b = at / bs;
                let n = ((b + 1) * bs).min(end) - at;
                let piece = (b, (at - b * bs) as usize, n as usize);
                at += n;
                piece
            })
        })
    }

    fn block_len(&self, b: u64) -> usize {
        let start = b * self.block_size as u64;
        (self.len - start).min(self.block_size as u64) as usize
    }

    fn block_off(&self, b: u64) -> u64 {
        b * self.block_size as u64
    }

    fn count_writeback(&self, d: &mut Dir) {
        d.writebacks += 1;
        self.writebacks.increment(1);
    }

    fn read_block(
        &self,
        b: u64,
        at: usize,
        n: usize,
        sink: &mut dyn FnMut(Src<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut g = self.lock()?;
        loop {
            match self.try_read(&mut g, b, at, n, sink)? {
                Progress::Done => return Ok(()),
                Progress::Blocked => g = self.wait(g)?,
            }
        }
    }

    fn try_read(
        &self,
        d: &mut Dir,
        b: u64,
        at: usize,
        n: usize,
        sink: &mut dyn FnMut(Src<'_>) -> Result<()>,
    ) -> Result<Progress> {
        if let Some(&e) = d.entries.get(&b) {
            d.count_hit(e.tier);
            self.promote(d, b)?;
            let e = d.entries.get_mut(&b).ok_or_else(|| lost(b))?;
            if std::mem::take(&mut e.prefetched) {
                d.prefetch_useful += 1;
            }
            let e = *e;
            d.touch(b);
            sink(Src::Store(
                &d.tiers[e.tier].store,
                e.slot * self.block_size + at,
            ))?;
            return Ok(Progress::Done);
        }
        if let Progress::Blocked = self.make_room(d, 0)? {
            return Ok(Progress::Blocked);
        }
        d.count_miss();
        let mut block = vec![0; self.block_len(b)];
        self.backing.read_at(self.block_off(b), &mut block)?;
        let slot = d.store_into(0, &block, self.block_size)?;
        d.link(b, 0, slot, BlockState::Valid, false);
        sink(Src::Mem(&block[at..at + n]))?;
        Ok(Progress::Done)
    }

    fn write_block(&self, b: u64, at: usize, data: &[u8]) -> Result<()> {
        let mut g = self.lock()?;
        loop {
            match self.try_write(&mut g, b, at, data)? {
                Progress::Done => return Ok(()),
                Progress::Blocked => g = self.wait(g)?,
            }
        }
    }

    fn try_write(&self, d: &mut Dir, b: u64, at: usize, data: &[u8]) -> Result<Progress> {
        let bs = self.block_size;
        let pos = self.block_off(b) + at as u64;
        if let Some(&e) = d.entries.get(&b) {
            d.count_hit(e.tier);
            self.promote(d, b)?;
            let e = *d.entries.get(&b).ok_or_else(|| lost(b))?;
            if self.mode == WriteMode::WriteThrough {
                d.epoch += 1;
                if let Err(err) = self.backing.write_at(pos, data) {
                    // The store may hold part of the write now; a Valid copy may not differ.
                    d.unlink(b);
                    return Err(err);
                }
            }
            if let Err(err) = d.tiers[e.tier].store.write(e.slot * bs + at, data) {
                if e.state == BlockState::Valid {
                    d.unlink(b);
                }
                return Err(err);
            }
            if self.mode == WriteMode::WriteBack {
                // Also when Flushing: the flush in flight has an older copy.
                d.entries.get_mut(&b).ok_or_else(|| lost(b))?.state = BlockState::Dirty;
            }
            d.touch(b);
            return Ok(Progress::Done);
        }
        if let Progress::Blocked = self.make_room(d, 0)? {
            return Ok(Progress::Blocked);
        }
        d.count_miss();
        let mut block = vec![0; self.block_len(b)];
        if data.len() < block.len() {
            self.backing.read_at(self.block_off(b), &mut block)?;
        }
        block[at..at + data.len()].copy_from_slice(data);
        let state = match self.mode {
            WriteMode::WriteThrough => {
                d.epoch += 1;
                self.backing.write_at(pos, data)?;
                BlockState::Valid
            }
            WriteMode::WriteBack => BlockState::Dirty,
        };
        let slot = d.store_into(0, &block, bs)?;
        d.link(b, 0, slot, state, false);
        Ok(Progress::Done)
    }

    /// Moves cached block `b` to the top level. Best effort: a block being flushed stays put,
    /// and so does one for which no room can be made without waiting.
    fn promote(&self, d: &mut Dir, b: u64) -> Result<()> {
        let e = *d.entries.get(&b).ok_or_else(|| lost(b))?;
        if e.tier == 0 || e.busy {
            return Ok(());
        }
        let data = d.read_slot(&e, self.block_len(b), self.block_size)?;
        // Out of the directory while room is made, so the cascade of demotions ends in its
        // slot instead of evicting from the lowest level.
        d.unlink(b);
        let made = self.make_room(d, 0);
        let target = match made {
            Ok(Progress::Done) => Some(0),
            // A demotion failed or had to wait: one slot between the top and `b`'s old level
            // is free, the one the cascade had reached.
            _ => (0..=e.tier).find(|&t| !d.tiers[t].free.is_empty()),
        };
        let placed = match target {
            Some(t) => d
                .store_into(t, &data, self.block_size)
                .map(|slot| (t, slot)),
            None => Err(CoreError::Internal(
                "no free cache slot after a promotion".into(),
            )),
        };
        match placed {
            Ok((t, slot)) => d.link(b, t, slot, e.state, e.prefetched),
            Err(err) => {
                // Nowhere to keep it: never lose a dirty block.
                if e.state == BlockState::Dirty {
                    d.epoch += 1;
                    self.backing.write_at(self.block_off(b), &data)?;
                    self.count_writeback(d);
                }
                return Err(err);
            }
        }
        made.map(|_| ())
    }

    /// Makes a slot free in `tier`, moving its LRU victim down a level (recursively) or, at
    /// the lowest level, writing it back if dirty and dropping it. `Blocked` where every
    /// candidate is being flushed; nothing has changed for the caller then.
    fn make_room(&self, d: &mut Dir, tier: usize) -> Result<Progress> {
        if !d.tiers[tier].free.is_empty() {
            return Ok(Progress::Done);
        }
        let victim = d.tiers[tier]
            .lru
            .values()
            .copied()
            .find(|v| d.entries.get(v).is_some_and(|e| !e.busy));
        let Some(v) = victim else {
            return Ok(Progress::Blocked);
        };
        let e = *d.entries.get(&v).ok_or_else(|| lost(v))?;
        let len = self.block_len(v);
        if tier + 1 == d.tiers.len() {
            if e.state == BlockState::Dirty {
                let data = d.read_slot(&e, len, self.block_size)?;
                d.epoch += 1;
                self.backing.write_at(self.block_off(v), &data)?;
                self.count_writeback(d);
            }
            d.unlink(v);
        } else {
            // Lower levels only: `v` stays this level's victim meanwhile.
            if let Progress::Blocked = self.make_room(d, tier + 1)? {
                return Ok(Progress::Blocked);
            }
            let data = d.read_slot(&e, len, self.block_size)?;
            let slot = d.store_into(tier + 1, &data, self.block_size)?;
            d.unlink(v);
            d.link(v, tier + 1, slot, e.state, e.prefetched);
        }
        let t = &mut d.tiers[tier];
        t.evictions += 1;
        t.m_evict.increment(1);
        Ok(Progress::Done)
    }

    fn flush(&self) -> Result<()> {
        let mut targets: Vec<u64> = {
            let d = self.lock()?;
            d.entries
                .iter()
                .filter(|(_, e)| e.state == BlockState::Dirty || e.busy)
                .map(|(&b, _)| b)
                .collect()
        };
        targets.sort_unstable();
        let mut first = None;
        for b in targets {
            if let Err(e) = self.flush_block(b) {
                first.get_or_insert(e);
            }
        }
        let synced = self.backing.sync();
        match first {
            Some(e) => Err(e),
            None => synced,
        }
    }

    /// Writes block `b` back if it is dirty, after any flush of it already in flight.
    fn flush_block(&self, b: u64) -> Result<()> {
        let mut g = self.lock()?;
        let e = loop {
            match g.entries.get(&b) {
                // Evicted meanwhile, which wrote it back if it was dirty.
                None => return Ok(()),
                // Its data may predate what we must flush: wait, then look again.
                Some(e) if e.busy => g = self.wait(g)?,
                Some(e) if e.state != BlockState::Dirty => return Ok(()),
                Some(&e) => break e,
            }
        };
        let data = g.read_slot(&e, self.block_len(b), self.block_size)?;
        g.epoch += 1;
        if let Some(e) = g.entries.get_mut(&b) {
            e.state = BlockState::Flushing;
            e.busy = true;
        }
        drop(g);
        let res = self.backing.write_at(self.block_off(b), &data);
        // Poisoned or not, the block must be released, or it could never move again.
        let mut g = self.dir.lock_unpoisoned();
        if let Some(e) = g.entries.get_mut(&b) {
            e.busy = false;
            if e.state == BlockState::Flushing {
                e.state = if res.is_ok() {
                    BlockState::Valid
                } else {
                    BlockState::Dirty
                };
            }
        }
        if res.is_ok() {
            self.count_writeback(&mut g);
        }
        drop(g);
        self.idle.notify_all();
        res
    }

    /// Loads block `b` for the prefetcher, unless it is cached. The store is read unlocked;
    /// the block is entered only if no write to the store began meanwhile.
    fn prefetch(&self, b: u64) {
        let epoch = match self.dir.lock() {
            Ok(d) if !d.entries.contains_key(&b) => d.epoch,
            _ => return,
        };
        let mut data = vec![0; self.block_len(b)];
        if let Err(e) = self.backing.read_at(self.block_off(b), &mut data) {
            tracing::debug!(block = b, error = %e, "cache prefetch read failed");
            return;
        }
        let Ok(mut g) = self.dir.lock() else { return };
        let d = &mut *g;
        if d.entries.contains_key(&b) || d.epoch != epoch {
            return;
        }
        let tier = self.prefetch_tier;
        match self.make_room(d, tier) {
            Ok(Progress::Done) => {}
            Ok(Progress::Blocked) => return,
            Err(e) => {
                tracing::debug!(block = b, error = %e, "cache prefetch found no room");
                return;
            }
        }
        match d.store_into(tier, &data, self.block_size) {
            Ok(slot) => {
                d.link(b, tier, slot, BlockState::Valid, true);
                d.prefetch_issued += 1;
            }
            Err(e) => tracing::debug!(block = b, error = %e, "cache prefetch store failed"),
        }
    }
}

fn lost(b: u64) -> CoreError {
    CoreError::Internal(format!("cache block {b} vanished from the directory"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// Host memory as a backing store whose writes can be held at a gate.
    #[derive(Debug, Default)]
    struct Gated {
        data: Mutex<Vec<u8>>,
        gate: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
    }

    impl BackingStore for Gated {
        fn len(&self) -> Result<u64> {
            Ok(self.data.lock().unwrap().len() as u64)
        }
        fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<()> {
            let d = self.data.lock().unwrap();
            buf.copy_from_slice(&d[off as usize..off as usize + buf.len()]);
            Ok(())
        }
        fn write_at(&self, off: u64, buf: &[u8]) -> Result<()> {
            // The first write after the gate is armed says it arrived and waits for release.
            if let Some((entered, release)) = self.gate.lock().unwrap().take() {
                entered.send(()).unwrap();
                release.recv().unwrap();
            }
            self.data.lock().unwrap()[off as usize..off as usize + buf.len()].copy_from_slice(buf);
            Ok(())
        }
        fn sync(&self) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_write_during_a_flush_makes_the_block_dirty_again() {
        let store = Arc::new(Gated {
            data: Mutex::new(vec![0; 4096]),
            ..Gated::default()
        });
        let cache = Arc::new(
            BlockCache::new(
                store.clone(),
                CacheConfig {
                    block_size: 1024,
                    l2_blocks: 4,
                    prefetch: PrefetchConfig {
                        enabled: false,
                        ..PrefetchConfig::default()
                    },
                    ..CacheConfig::default()
                },
            )
            .unwrap(),
        );
        cache.write(1024, &[1; 1024]).unwrap();
        assert_eq!(cache.state_of(1), BlockState::Dirty);

        let (entered_tx, entered) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        *store.gate.lock().unwrap() = Some((entered_tx, release_rx));
        let flusher = {
            let cache = Arc::clone(&cache);
            std::thread::spawn(move || cache.flush())
        };
        entered.recv().unwrap();
        assert_eq!(cache.state_of(1), BlockState::Flushing);
        // The directory is not locked during the write-back: this write goes through.
        cache.write(1024 + 10, &[2; 4]).unwrap();
        assert_eq!(cache.state_of(1), BlockState::Dirty);
        release.send(()).unwrap();
        flusher.join().unwrap().unwrap();
        // The flush wrote the older copy and left the newer one dirty.
        assert_eq!(cache.state_of(1), BlockState::Dirty);
        assert_eq!(store.data.lock().unwrap()[1024 + 10], 1);
        cache.flush().unwrap();
        assert_eq!(cache.state_of(1), BlockState::Valid);
        assert_eq!(store.data.lock().unwrap()[1024 + 10..1024 + 14], [2; 4]);
        assert_eq!(cache.stats().writebacks, 2);
    }

    #[test]
    fn pieces_cut_at_block_boundaries() {
        let store = Arc::new(Gated {
            data: Mutex::new(vec![0; 2500]),
            ..Gated::default()
        });
        let cache = BlockCache::new(
            store,
            CacheConfig {
                block_size: 1000,
                l2_blocks: 1,
                ..CacheConfig::default()
            },
        )
        .unwrap();
        let s = &cache.shared;
        assert_eq!(s.nblocks, 3);
        assert_eq!(s.block_len(2), 500);
        let p: Vec<_> = s.pieces(900, 1300).collect();
        assert_eq!(p, vec![(0, 900, 100), (1, 0, 1000), (2, 0, 200)]);
        assert_eq!(s.check(900, 1300).unwrap(), 0..3);
        assert!(s.check(2000, 501).is_err());
        assert!(s.check(u64::MAX, 2).is_err());
    }

    #[test]
    fn a_cache_needs_a_level_and_a_sane_block_size() {
        let store: Arc<dyn BackingStore> = Arc::new(Gated::default());
        let none = CacheConfig {
            l2_blocks: 0,
            ..CacheConfig::default()
        };
        assert!(matches!(
            BlockCache::new(store.clone(), none),
            Err(CoreError::InvalidRequest(_))
        ));
        let zero = CacheConfig {
            block_size: 0,
            ..CacheConfig::default()
        };
        assert!(matches!(
            BlockCache::new(store, zero),
            Err(CoreError::InvalidRequest(_))
        ));
    }
}
