//! The memory registration cache (docs/REFERENCE.md#registration-cache): registering host memory
//! for DMA (`cuMemHostRegister`, io_uring fixed buffers, `ibv_reg_mr`, later VFIO mappings) costs a
//! page walk and lock per call, so registrations are kept and reused across transfers.
//!
//! Lookups are range-aware: an entry covering the asked range is a hit, also for a sub-range
//! of what was registered. A miss registers the range; idle entries of the same memory that it
//! overlaps or touches are deregistered first and the union is registered instead (drivers
//! refuse overlapping registrations, and one larger registration serves later lookups of
//! either part). An entry in use — a [`Registered`] is alive — is never deregistered: a miss
//! overlapping it fails with [`CoreError::Busy`], and eviction (least recently used first,
//! when over [`RegCacheConfig::max_entries`] or [`RegCacheConfig::max_bytes`]) skips it.
//!
//! The kinds of registration are [`Registrar`]s: [`CudaHostRegistrar`], [`UringRegistrar`]
//! and (cargo feature `rdma`) `RdmaRegistrar`. Entries keep their [`HostMemory`] alive, so
//! memory cannot be freed while registered.

use crate::metrics::{REG_EVICTIONS, REG_LOOKUPS};
use crate::{CoreError, ErrorCode, HostMemory, Result};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::uring::{BufIndex, Ring, RingOptions};
use gpuio_hal::{Gpu, HalError, SharedPin};
use metrics::Counter;
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// One kind of registration of host memory.
pub trait Registrar: Send + Sync {
    /// The registration; dropping it deregisters the memory.
    type Handle: Send + Sync;

    /// The kind, as a metric label (e.g. `cuda_host`, `io_uring`).
    fn kind(&self) -> &'static str;

    /// Registers `offset..offset+len` of `mem` (already checked to lie inside it).
    fn register(&self, mem: &HostMemory, offset: usize, len: usize) -> Result<Self::Handle>;

    /// The unit registrations are rounded out to. Drivers pin whole pages anyway, so rounding
    /// to the page costs nothing and lets lookups of neighbouring bytes hit; 1 keeps ranges
    /// exact.
    fn granularity(&self) -> usize {
        1
    }
}

/// Limits of a [`RegistrationCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegCacheConfig {
    /// Entries kept at most (idle ones beyond are evicted).
    pub max_entries: usize,
    /// Registered bytes kept at most (idle entries beyond are evicted).
    pub max_bytes: u64,
}

impl Default for RegCacheConfig {
    fn default() -> Self {
        Self {
            max_entries: 1024,
            max_bytes: 16 << 30,
        }
    }
}

/// Counters of a [`RegistrationCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct RegCacheStats {
    /// Lookups served by an existing entry.
    pub hits: u64,
    /// Lookups that had to register (including those that then failed).
    pub misses: u64,
    /// Idle entries deregistered to stay within the limits.
    pub evictions: u64,
    /// Idle entries deregistered to be merged into a larger registration.
    pub merges: u64,
    /// Bytes registered by the entries now in the cache.
    pub registered_bytes: u64,
    /// Entries now in the cache.
    pub entries: u64,
}

/// A registration and the memory it keeps alive. Field order is drop order: deregister first.
struct Reg<H> {
    handle: H,
    mem: HostMemory,
    range: Range<usize>,
}

/// A registration handed out by [`RegistrationCache::get`]; its entry stays registered (and
/// cannot be evicted or merged) while this lives.
pub struct Registered<H> {
    reg: Arc<Reg<H>>,
}

impl<H> Registered<H> {
    /// The registration's handle.
    pub fn handle(&self) -> &H {
        &self.reg.handle
    }

    /// The registered range of the memory: it covers the range asked for, and may be larger.
    pub fn range(&self) -> Range<usize> {
        self.reg.range.clone()
    }

    /// The registered memory.
    pub fn memory(&self) -> &HostMemory {
        &self.reg.mem
    }
}

impl<H> fmt::Debug for Registered<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registered")
            .field("range", &self.reg.range)
            .finish_non_exhaustive()
    }
}

/// Entries are keyed by (memory identity, start of range).
type Key = (usize, usize);

struct Entry<H> {
    /// Shared with every live [`Registered`]: in use while the count is above one.
    reg: Arc<Reg<H>>,
    end: usize,
    /// Tick of the last lookup, also its key in `State::lru`.
    used: u64,
}

impl<H> Entry<H> {
    fn in_use(&self) -> bool {
        // Registered handles are only cloned from the entry under the lock, so a count of one
        // cannot grow behind our back; a handle dropping meanwhile only makes us conservative.
        Arc::strong_count(&self.reg) > 1
    }
}

struct State<H> {
    entries: BTreeMap<Key, Entry<H>>,
    /// Entries by last use, oldest first.
    lru: BTreeMap<u64, Key>,
    tick: u64,
    stats: RegCacheStats,
}

/// A cache of registrations of one kind (docs/REFERENCE.md#registration-cache). `Sync`: share it
/// behind an `Arc`.
pub struct RegistrationCache<R: Registrar> {
    registrar: R,
    config: RegCacheConfig,
    /// Taken poison-tolerant: every update of the state is completed before anything that
    /// can panic.
    state: Mutex<State<R::Handle>>,
    hit: Counter,
    miss: Counter,
    evicted: Counter,
}

impl<R: Registrar> fmt::Debug for RegistrationCache<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistrationCache")
            .field("kind", &self.registrar.kind())
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<R: Registrar> RegistrationCache<R> {
    /// An empty cache registering through `registrar`.
    pub fn new(registrar: R, config: RegCacheConfig) -> Self {
        let kind = registrar.kind();
        Self {
            hit: metrics::counter!(REG_LOOKUPS, "kind" => kind, "result" => "hit"),
            miss: metrics::counter!(REG_LOOKUPS, "kind" => kind, "result" => "miss"),
            evicted: metrics::counter!(REG_EVICTIONS, "kind" => kind),
            registrar,
            config,
            state: Mutex::new(State {
                entries: BTreeMap::new(),
                lru: BTreeMap::new(),
                tick: 0,
                stats: RegCacheStats::default(),
            }),
        }
    }

    /// The registrar.
    pub fn registrar(&self) -> &R {
        &self.registrar
    }

    /// The counters now.
    pub fn stats(&self) -> RegCacheStats {
        self.state.lock_unpoisoned().stats
    }

    /// The registered ranges of `mem`, in order, each with whether it is in use.
    pub fn entries_of(&self, mem: &HostMemory) -> Vec<(Range<usize>, bool)> {
        let id = mem.id();
        self.state
            .lock_unpoisoned()
            .entries
            .range((id, 0)..=(id, usize::MAX))
            .map(|(&(_, start), e)| (start..e.end, e.in_use()))
            .collect()
    }

    /// A registration covering `offset..offset+len` of `mem`: an existing one (hit) or a new
    /// one (miss, see the module docs). Do not call it while holding a lock on `mem`:
    /// registering reads the buffer's address through that lock.
    pub fn get(
        &self,
        mem: &HostMemory,
        offset: usize,
        len: usize,
    ) -> Result<Registered<R::Handle>> {
        let size = mem.len();
        let end = match offset.checked_add(len) {
            Some(end) if len > 0 && end <= size => end,
            _ => {
                return Err(CoreError::InvalidRequest(format!(
                    "cannot register {len} bytes at offset {offset} of a {size}-byte buffer"
                )));
            }
        };
        let id = mem.id();
        let mut st = self.state.lock_unpoisoned();
        st.tick += 1;
        let tick = st.tick;

        // Entries of one memory never overlap, so only the last one starting at or before
        // `offset` can cover the range.
        let covering = st
            .entries
            .range((id, 0)..=(id, offset))
            .next_back()
            .filter(|(_, e)| e.end >= end)
            .map(|(k, _)| *k);
        if let Some(key) = covering {
            st.stats.hits += 1;
            self.hit.increment(1);
            let State { entries, lru, .. } = &mut *st;
            let e = entries.get_mut(&key).expect("found above");
            lru.remove(&e.used);
            lru.insert(tick, key);
            e.used = tick;
            return Ok(Registered { reg: e.reg.clone() });
        }

        st.stats.misses += 1;
        self.miss.increment(1);
        let unit = self.registrar.granularity().max(1);
        let mut start = offset / unit * unit;
        let mut stop = end.div_ceil(unit).saturating_mul(unit).min(size);
        // Entries overlapping or touching the range: ends are ordered like starts, so walk
        // back from the last entry starting at or before its end.
        let mut merge = Vec::new();
        for (&key, e) in st.entries.range((id, 0)..=(id, stop)).rev() {
            if e.end < start {
                break;
            }
            let overlaps = key.1 < stop && e.end > start;
            if e.in_use() {
                if overlaps {
                    return Err(CoreError::Busy(format!(
                        "{} registration of {}..{} is in use and overlaps {start}..{stop} \
                         (asked: {offset}..{end})",
                        self.registrar.kind(),
                        key.1,
                        e.end
                    )));
                }
                // Only touching: it stays, and the new range is registered beside it.
                continue;
            }
            merge.push(key);
        }
        // Deregister before registering the union: registrations refuse overlaps. If the new
        // registration then fails, only idle entries were lost.
        let mut old = Vec::with_capacity(merge.len());
        for key in merge {
            let e = self.remove(&mut st, key);
            start = start.min(key.1);
            stop = stop.max(e.end);
            st.stats.merges += 1;
            old.push(e);
        }
        drop(old);
        let handle = self.registrar.register(mem, start, stop - start)?;
        let reg = Arc::new(Reg {
            handle,
            mem: mem.clone(),
            range: start..stop,
        });
        let key = (id, start);
        st.entries.insert(
            key,
            Entry {
                reg: reg.clone(),
                end: stop,
                used: tick,
            },
        );
        st.lru.insert(tick, key);
        st.stats.entries += 1;
        st.stats.registered_bytes += (stop - start) as u64;
        let evicted = self.evict(&mut st);
        drop(st);
        // Deregister outside the lock.
        drop(evicted);
        Ok(Registered { reg })
    }

    /// Deregisters every idle entry of `mem` (e.g. before it is freed); returns how many.
    pub fn purge(&self, mem: &HostMemory) -> usize {
        let id = mem.id();
        let mut st = self.state.lock_unpoisoned();
        let keys: Vec<Key> = st
            .entries
            .range((id, 0)..=(id, usize::MAX))
            .filter(|(_, e)| !e.in_use())
            .map(|(k, _)| *k)
            .collect();
        let removed: Vec<_> = keys.into_iter().map(|k| self.remove(&mut st, k)).collect();
        drop(st);
        removed.len()
    }

    /// Evicts idle entries until within the limits (entries become idle without telling the
    /// cache; lookups trim, and so does this).
    pub fn trim(&self) -> usize {
        let mut st = self.state.lock_unpoisoned();
        let evicted = self.evict(&mut st);
        drop(st);
        evicted.len()
    }

    fn remove(&self, st: &mut State<R::Handle>, key: Key) -> Entry<R::Handle> {
        let e = st.entries.remove(&key).expect("key taken from the map");
        st.lru.remove(&e.used);
        st.stats.entries -= 1;
        st.stats.registered_bytes -= (e.end - key.1) as u64;
        e
    }

    /// Takes idle entries out, least recently used first, until within the limits; the caller
    /// drops them (deregistering) after unlocking.
    fn evict(&self, st: &mut State<R::Handle>) -> Vec<Entry<R::Handle>> {
        let over = |s: &RegCacheStats| {
            s.entries as usize > self.config.max_entries
                || s.registered_bytes > self.config.max_bytes
        };
        if !over(&st.stats) {
            return Vec::new();
        }
        let idle: Vec<Key> = st
            .lru
            .values()
            .filter(|k| st.entries.get(k).is_some_and(|e| !e.in_use()))
            .copied()
            .collect();
        let mut out = Vec::new();
        for key in idle {
            if !over(&st.stats) {
                break;
            }
            out.push(self.remove(st, key));
            st.stats.evictions += 1;
            self.evicted.increment(1);
        }
        out
    }
}

/// Registers host memory with a GPU's driver (`cuMemHostRegister`; on the host backend, a
/// registration that locks nothing), so copies from and to it run as direct DMA.
///
/// CUDA registrations belong to the process: memory registered here cannot also be registered
/// elsewhere (another cache, [`HostBuffer::pin`](gpuio_hal::HostBuffer::pin),
/// [`Gpu::with_registered`]) while the entry lives, and such an overlap fails with the driver's
/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`, passed on as it is. Use one cache per process.
#[derive(Debug, Clone)]
pub struct CudaHostRegistrar {
    /// The device registering the memory (registrations are portable to the driver's others).
    pub gpu: Gpu,
}

impl Registrar for CudaHostRegistrar {
    type Handle = SharedPin;

    fn kind(&self) -> &'static str {
        "cuda_host"
    }

    fn register(&self, mem: &HostMemory, offset: usize, len: usize) -> Result<SharedPin> {
        Ok(self.gpu.pin_shared(mem.shared().clone(), offset, len)?)
    }

    /// Whole pages: the driver pins them whole anyway.
    fn granularity(&self) -> usize {
        gpuio_hal::page_size()
    }
}

/// Registers host memory as io_uring fixed buffers, in a sparse buffer table of one ring.
/// Fixed-buffer reads and writes skip the kernel's per-call page pinning.
#[derive(Debug, Clone)]
pub struct UringRegistrar {
    ring: Arc<Mutex<Ring>>,
}

impl UringRegistrar {
    /// A ring with a table of `slots` fixed buffers (at most 16384). Where the kernel refuses
    /// io_uring or sparse tables, [`CoreError::Unsupported`] says why.
    pub fn new(opts: RingOptions, slots: u32) -> Result<Self> {
        let ring = Ring::with_buffer_table(opts, slots).map_err(|e| match e {
            HalError::Unsupported { what, reason } => CoreError::Unsupported {
                what: what.into(),
                reason,
            },
            // io_uring refused altogether (seccomp, kernel.io_uring_disabled), or a kernel too
            // old for sparse file tables.
            HalError::Os { op, source }
                if op == "io_uring_register(files)"
                    || (op == "io_uring_setup"
                        && matches!(
                            ErrorCode::from_io(&source),
                            ErrorCode::Unsupported | ErrorCode::Permission
                        )) =>
            {
                CoreError::Unsupported {
                    what: "io_uring".into(),
                    reason: format!("{op}: {source}"),
                }
            }
            e => e.into(),
        })?;
        Ok(Self {
            ring: Arc::new(Mutex::new(ring)),
        })
    }

    /// The ring, to submit IO on registered buffers
    /// ([`Ring::read_fixed_shared`] with a [`UringBuffer::index`]). Registering and dropping
    /// registrations lock it too: do not call the cache or drop a [`Registered`] while holding
    /// it.
    pub fn ring(&self) -> &Arc<Mutex<Ring>> {
        &self.ring
    }
}

/// A range registered in a [`UringRegistrar`]'s table; dropping it empties the slot.
#[derive(Debug)]
pub struct UringBuffer {
    ring: Arc<Mutex<Ring>>,
    index: BufIndex,
}

impl UringBuffer {
    /// The slot in the ring's buffer table.
    pub fn index(&self) -> BufIndex {
        self.index
    }
}

impl Drop for UringBuffer {
    fn drop(&mut self) {
        let mut ring = self.ring.lock_unpoisoned();
        if let Err(e) = ring.unregister_shared(self.index) {
            // The slot keeps its buffer (and its memory) until the ring drops.
            tracing::error!(error = %e, slot = self.index.0, "unregistering an io_uring buffer failed");
        }
    }
}

impl Registrar for UringRegistrar {
    type Handle = UringBuffer;

    fn kind(&self) -> &'static str {
        "io_uring"
    }

    fn register(&self, mem: &HostMemory, offset: usize, len: usize) -> Result<UringBuffer> {
        let index =
            self.ring
                .lock_unpoisoned()
                .register_shared(mem.shared().clone(), offset, len)?;
        Ok(UringBuffer {
            ring: self.ring.clone(),
            index,
        })
    }
}

/// Registers host memory with an RDMA device's protection domain (`ibv_reg_mr`) for local use:
/// RemoteIO reads land in it and writes leave from it in place, with no staging copy.
#[cfg(feature = "rdma")]
#[derive(Debug, Clone)]
pub struct RdmaRegistrar {
    /// The device (its protection domain) the memory is registered with.
    pub device: Arc<gpuio_rdma::RdmaDevice>,
}

#[cfg(feature = "rdma")]
impl Registrar for RdmaRegistrar {
    type Handle = gpuio_rdma::HostRegion;

    fn kind(&self) -> &'static str {
        "rdma"
    }

    fn register(
        &self,
        mem: &HostMemory,
        offset: usize,
        len: usize,
    ) -> Result<gpuio_rdma::HostRegion> {
        let buf = mem.read();
        let access = gpuio_rdma::RdmaAccess::default();
        Ok(gpuio_rdma::HostRegion::new(
            &self.device,
            &buf,
            offset..offset + len,
            access,
        )?)
    }

    /// Whole pages: the driver pins them whole anyway.
    fn granularity(&self) -> usize {
        gpuio_hal::page_size()
    }
}
