//! On-demand arrays: GPU threads index data bigger than GPU memory (a file, host or CXL
//! memory, a remote export) as `gpuio_array<T>` in their kernels (`kernels/gpuio_array.cuh`),
//! through a page cache in GPU memory whose misses go through the request ring to a
//! [`RingProxy`] and its engines.
//!
//! A [`PageCache`] owns the frames (its capacity in GPU memory, cut into pages of 512 B to
//! 64 KiB) and the ring proxy; it holds up to 64 [`OnDemandArray`]s at once, which share its
//! frames. An array hands its kernels a descriptor ([`OnDemandArray::device`]); between
//! kernels the host can prefetch pages, write dirty pages back ([`OnDemandArray::synchronize`])
//! and read the array's counters ([`OnDemandArray::stats`]). The protocol, the layout and the
//! write-back order are gpuio-hal's `ondemand` module's.
//!
//! ```
//! # use gpuio_core::{Endpoint, Engines, HostMemory};
//! # use gpuio_core::ondemand::{ArrayMode, PageCache, PageCacheConfig};
//! # use gpuio_hal::{BackendPreference, HostAllocOptions, HostBuffer, pattern, probe};
//! # use gpuio_transport_localio::{LocalIo, LocalIoConfig};
//! # use gpuio_transport_memio::{MemIo, MemIoConfig};
//! # use std::sync::Arc;
//! let gpus = probe(BackendPreference::Host).unwrap();
//! let gpu = gpus.gpus[0].clone();
//! let engines = Engines::new(
//!     Arc::new(MemIo::new(gpus.gpus, MemIoConfig::default()).unwrap()),
//!     Arc::new(LocalIo::new(LocalIoConfig::default()).unwrap()),
//! );
//! // 64 KiB of u64s in host memory, behind a cache of four 4 KiB pages.
//! let mut src = HostBuffer::alloc(64 << 10, &HostAllocOptions::default()).unwrap();
//! pattern::fill(&mut src, 0, 7);
//! let cfg = PageCacheConfig { page_size: 4096, capacity: 4 * 4096, ..Default::default() };
//! let cache = PageCache::new(engines, &gpu, cfg).unwrap();
//! let array = cache
//!     .array::<u64>(Endpoint::host(&HostMemory::new(src), 0), 8192, ArrayMode::ReadWrite)
//!     .unwrap();
//! // A GPU kernel would take array.device(); on the host backend host threads play its part.
//! let access = array.host_accessor().unwrap();
//! assert_eq!(access.load_u64(5000).unwrap(), pattern::word_at(7, 5000));
//! access.store_u64(5000, 42).unwrap();
//! array.synchronize().unwrap();
//! assert_eq!(array.stats().unwrap().misses, 1);
//! ```

use crate::endpoint::Endpoint;
use crate::engine::Engines;
use crate::error::{CoreError, Result};
use crate::ring::{RingConfig, RingProxy, WaitPolicy};
use gpuio_hal::memory::mapped::MappingPin;
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{Backend, Gpu, HalError, SharedPin};
use gpuio_ring::RingMemory;
use gpuio_ring::ondemand::{
    ArrayDevice, HeldPages, HostAccessor, InPlace, PageCacheMemory, PageTable, ResidentDevice,
    SourceReader,
};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Counters of one array since it was made (hits, misses, waits, evictions, write-backs,
/// bytes in and out, failures, and the miss-latency histogram with its quantiles).
pub use gpuio_ring::ondemand::ArrayCounters as ArrayStats;
pub use gpuio_ring::ondemand::{MAX_ARRAYS, MAX_PAGE, MIN_PAGE};

/// [`PageCacheConfig::admit_after`]'s default: the break-even of the default 4 KiB pages,
/// where the 32-byte sectors read in place have cost one page: per page, reading in place
/// until that rent equals the page's price (the ski-rental rule) moves at most about twice
/// the bytes that the best choice made in hindsight would. `gpuio bench ondemand` measures
/// the alternatives. For other page sizes, `page_size / 32` is the same rule.
pub const DEFAULT_ADMIT_AFTER: u32 = 128;

/// Most pinned host memory a cache's ring gives its bounce buffers.
const BOUNCE_MEMORY: usize = 64 << 20;

/// How a [`PageCache`] is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageCacheConfig {
    /// Bytes per page: a power of two from 512 B to 64 KiB. Misses read whole pages.
    pub page_size: usize,
    /// GPU memory for the frames, in bytes (whole pages).
    pub capacity: usize,
    /// The request ring misses and write-backs go through: slots, proxy threads, how they
    /// wait. Its bounce buffers are made at least a page (pages are delivered there and
    /// copied by the missing warp, and written back from there), and its slots cut so that
    /// the buffers take at most 64 MiB of pinned memory.
    pub ring: RingConfig,
    /// Read-only arrays over warm files, and over host memory, are read in place where the
    /// device can register the file's page cache pages (or the memory): the range is pinned
    /// for the array's life (up to a quarter of the memory the machine can back, over the
    /// cache's arrays), and a miss reads it over the bus, with no ring round trip
    /// ([`OnDemandArray::miss_path`] says which path an array took, and why). Bytes of the
    /// source changed while such an array lives may be read old or new. Host memory stays
    /// registered with the device for the array's life, so registering the same range again
    /// elsewhere (`HostBuffer::pin`, another in-place array) is refused meanwhile; where the
    /// range is registered already, the array misses through the ring.
    pub in_place: bool,
    /// For arrays read in place: touches of a page not cached that are served from the
    /// source itself (only the bytes asked for: a 4-byte element moves one 32-byte sector
    /// instead of a page) before the next one brings the page into the cache. Pages touched
    /// this often while not cached earn a frame; the rest never cost one. 0: every miss
    /// brings its page in (the right choice when accesses read most of a page, or the array
    /// fits the cache). A prefetch or a hold brings pages in whatever their touches.
    pub admit_after: u32,
}

impl Default for PageCacheConfig {
    fn default() -> Self {
        Self {
            page_size: 4096,
            capacity: 256 << 20,
            // Misses wait for the proxy: its threads spin (about a millisecond) before they
            // yield or sleep, since a sleeping proxy adds its sleep to every miss.
            ring: RingConfig {
                slots: 4096,
                threads: 8,
                wait: WaitPolicy {
                    spins: 1 << 18,
                    yields: 1 << 10,
                    max_sleep: std::time::Duration::from_micros(20),
                },
                ..RingConfig::default()
            },
            in_place: true,
            admit_after: DEFAULT_ADMIT_AFTER,
        }
    }
}

/// Whether kernels may store into an array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArrayMode {
    /// Loads only; a store is refused (recorded as an error).
    ReadOnly,
    /// Loads and stores; dirty pages are written back on eviction and by `synchronize`.
    ReadWrite,
}

/// An array's element type: plain numbers, whose every bit pattern is a value.
pub trait Element: Copy + Send + Sync + 'static + private::Sealed {}

mod private {
    pub trait Sealed {}
}

macro_rules! elements {
    ($($t:ty),*) => {$(
        impl private::Sealed for $t {}
        impl Element for $t {}
    )*};
}
elements!(u8, u16, u32, u64, i8, i16, i32, i64, f32, f64);

/// A page cache in one GPU's memory, with the ring proxy that serves its misses. Cheap to
/// clone; the proxy shuts down when the cache and every array of it are gone.
#[derive(Clone)]
pub struct PageCache {
    inner: Arc<CacheInner>,
}

struct CacheInner {
    memory: Arc<PageCacheMemory>,
    proxy: Mutex<RingProxy>,
    in_place: bool,
    admit_after: u32,
    /// Bytes of files and memory pinned for in-place reads by this cache's arrays.
    pinned: Arc<AtomicU64>,
}

impl Drop for CacheInner {
    fn drop(&mut self) {
        let mut proxy = self.proxy.lock_unpoisoned();
        if let Err(e) = proxy.shutdown() {
            tracing::warn!(error = %e, "shutting down a page cache's ring proxy");
        }
    }
}

impl std::fmt::Debug for PageCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageCache")
            .field("page_size", &self.page_size())
            .field("frames", &self.frames())
            .finish()
    }
}

impl PageCache {
    /// A cache of `cfg.capacity` bytes of `gpu`'s memory, and a ring proxy serving its misses
    /// through `engines`.
    pub fn new(engines: Engines, gpu: &Gpu, cfg: PageCacheConfig) -> Result<Self> {
        let memory = Arc::new(PageCacheMemory::new(gpu, cfg.page_size, cfg.capacity)?);
        // Every miss and write-back goes through a bounce buffer (no DMA and no driver call on
        // the host side, which must never wait for the device while kernels run), so they
        // hold a page; being pinned host memory, at most 64 MiB of them.
        let mut ring = cfg.ring;
        ring.bounce_bytes = ring.bounce_bytes.max(cfg.page_size);
        let fit = (BOUNCE_MEMORY / ring.bounce_bytes).max(2);
        ring.slots = ring.slots.min(1 << fit.ilog2());
        let proxy = RingProxy::new(engines, gpu, ring)?;
        proxy.register_device(memory.frame_memory())?;
        Ok(Self {
            inner: Arc::new(CacheInner {
                memory,
                proxy: Mutex::new(proxy),
                in_place: cfg.in_place,
                admit_after: cfg.admit_after,
                pinned: Arc::new(AtomicU64::new(0)),
            }),
        })
    }

    /// Bytes per page.
    pub fn page_size(&self) -> usize {
        self.inner.memory.page_size()
    }

    /// The GPU whose memory holds the cache.
    pub fn gpu(&self) -> &Gpu {
        self.inner.memory.gpu()
    }

    /// Shuts the ring proxy down: misses being served finish, waiting ones fail with the
    /// shutdown error, and every later miss fails (hits still read cached pages).
    pub fn shutdown(&self) -> Result<crate::ring::RingStats> {
        self.inner.proxy.lock_unpoisoned().shutdown()
    }

    /// Frames (pages the cache holds at once).
    pub fn frames(&self) -> usize {
        self.inner.memory.frames()
    }

    /// An array of `len` elements of `T` over `source` (from its offset on), which must hold
    /// `len * size_of::<T>()` bytes: a read past its end fails the access. Every page starts
    /// uncached.
    pub fn array<T: Element>(
        &self,
        source: Endpoint,
        len: u64,
        mode: ArrayMode,
    ) -> Result<OnDemandArray<T>> {
        let size = size_of::<T>() as u64;
        let bytes = len
            .checked_mul(size)
            .filter(|&b| b > 0)
            .ok_or_else(|| CoreError::InvalidRequest(format!("an array of {len} elements")))?;
        if let Some(room) = source.room()
            && (room as u64) < bytes
        {
            return Err(CoreError::InvalidRequest(format!(
                "the source holds {room} bytes from its offset; the array needs {bytes}"
            )));
        }
        if mode == ArrayMode::ReadWrite
            && let Endpoint::File { file, .. } = &source
            && !file.is_writable()
        {
            // Refused now rather than by every write-back later.
            return Err(CoreError::InvalidRequest(format!(
                "a read-write array over {} opened read-only",
                file.path().display()
            )));
        }
        let (in_place, mut miss_path) = self.in_place(&source, bytes, mode);
        let reading = in_place.as_ref().map(|p| {
            // Elements are read where they lie: only a source aligned for every element type
            // (and the 16-byte loads of spans) can be.
            let aligned = p.addr % 16 == 0;
            let admit_after = if aligned { self.inner.admit_after } else { 0 };
            if admit_after > 0 {
                miss_path.push_str(&format!(
                    "; a page's first {admit_after} touches read only their bytes, the next caches it"
                ));
            }
            InPlace {
                addr: p.addr,
                admit_after,
            }
        });
        let proxy = self.inner.proxy.lock_unpoisoned();
        let resource = proxy.register(source.clone())?;
        let table = match self.inner.memory.add_array(
            bytes,
            resource,
            mode == ArrayMode::ReadWrite,
            reading,
        ) {
            Ok(t) => t,
            Err(e) => {
                let _ = proxy.unregister(resource);
                return Err(e.into());
            }
        };
        Ok(OnDemandArray {
            cache: self.clone(),
            table: Some(table),
            source,
            len,
            miss_path,
            _in_place: in_place,
            _element: PhantomData,
        })
    }

    /// The pin of `bytes` of a file or host-memory source for in-place reads, where this
    /// cache reads in place, the array is read-only, the budget allows and the file's pages
    /// (or the memory) can be pinned; and the array's miss path in words either way.
    fn in_place(
        &self,
        source: &Endpoint,
        bytes: u64,
        mode: ArrayMode,
    ) -> (Option<InPlacePin>, String) {
        const RING: &str = "through the ring";
        if !matches!(source, Endpoint::File { .. } | Endpoint::Host { .. }) {
            return (
                None,
                format!("{RING} (the source is neither a file nor host memory)"),
            );
        }
        if !self.inner.in_place || mode == ArrayMode::ReadWrite {
            let why = if mode == ArrayMode::ReadWrite {
                "a writable array's pages go back through it"
            } else {
                "in-place reads are off"
            };
            return (None, format!("{RING} ({why})"));
        }
        let budget = gpuio_hal::memory::backing::backable_bytes(false).map_or(0, |b| b / 4);
        let pinned = &self.inner.pinned;
        let taken = pinned.fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
            p.checked_add(bytes).filter(|&t| t <= budget)
        });
        // Given back when dropped: on any refusal below, or with the pin that holds it.
        let reserved = match taken {
            Ok(_) => Reserved {
                bytes,
                pinned: pinned.clone(),
            },
            Err(_) => {
                return (
                    None,
                    format!(
                        "{RING} (pinning {bytes} more bytes of files would pass the budget, a \
                     quarter of the {} bytes the machine can back)",
                        budget * 4
                    ),
                );
            }
        };
        let gpu = self.inner.memory.gpu();
        let len = match usize::try_from(bytes) {
            Ok(len) => len,
            Err(_) => {
                return (
                    None,
                    format!("{RING} ({bytes} bytes cannot be pinned here)"),
                );
            }
        };
        let pinned = match source {
            Endpoint::File { file, offset } => match file.len() {
                Ok(size) if size >= offset.saturating_add(bytes) => file
                    .pin_page_cache(gpu, *offset, len)
                    .map(|pin| {
                        (
                            pin.device_addr(),
                            Pinned::File { _pin: pin },
                            "the file's page cache pages",
                        )
                    })
                    .map_err(|e| e.to_string()),
                Ok(size) => Err(format!(
                    "the file holds {size} bytes: reads past its end must fail"
                )),
                Err(e) => Err(e.to_string()),
            },
            Endpoint::Host { mem, offset } => gpu
                .pin_shared(mem.shared().clone(), *offset, len)
                .map(|pin| (pin.device_addr(), Pinned::Host { pin }, "the host memory"))
                .map_err(|e| e.to_string()),
            _ => Err("not a file or host memory".into()),
        };
        match pinned {
            Ok((addr, pin, what)) => (
                Some(InPlacePin {
                    addr,
                    _pin: pin,
                    _reserved: reserved,
                }),
                format!("in place, from {what} pinned for the device"),
            ),
            Err(why) => (None, format!("{RING} ({why})")),
        }
    }
}

/// A source range pinned for in-place reads, counted against its cache's budget until
/// dropped.
struct InPlacePin {
    /// Where kernels read its first byte.
    addr: u64,
    _pin: Pinned,
    _reserved: Reserved,
}

/// What keeps an in-place source readable by the device.
enum Pinned {
    File {
        _pin: MappingPin,
    },
    /// Host threads read it in place too (the host backend's twin), under its locks.
    Host {
        pin: SharedPin,
    },
}

/// Bytes counted against a cache's in-place budget, given back when dropped.
struct Reserved {
    bytes: u64,
    pinned: Arc<AtomicU64>,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.pinned.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// An array of `T` over a source, read (and written) by GPU threads through a [`PageCache`].
/// Dropping it writes dirty pages back (logging a failure; call [`close`](Self::close) to see
/// it) and frees its frames; do that only while no kernel uses it.
pub struct OnDemandArray<T: Element> {
    cache: PageCache,
    table: Option<PageTable>,
    source: Endpoint,
    len: u64,
    miss_path: String,
    // Declared after `table`, which drop (`Drop for OnDemandArray`) removes first: kernels
    // stop reading the pinned pages before they are let go.
    _in_place: Option<InPlacePin>,
    _element: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for OnDemandArray<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnDemandArray")
            .field("len", &self.len)
            .field("source", &self.source.to_string())
            .finish_non_exhaustive()
    }
}

impl<T: Element> OnDemandArray<T> {
    fn table(&self) -> &PageTable {
        self.table.as_ref().expect("an open array has its table")
    }

    /// Elements.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no elements (never: arrays have at least one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Pages.
    pub fn pages(&self) -> u64 {
        self.table().pages()
    }

    /// How misses are read: in place from a file's pinned page cache pages or pinned host
    /// memory (and from which touch a page is cached), or through the ring (and why not in
    /// place).
    pub fn miss_path(&self) -> &str {
        &self.miss_path
    }

    /// Whether misses are read in place (see [`PageCacheConfig::in_place`]).
    pub fn reads_in_place(&self) -> bool {
        self._in_place.is_some()
    }

    /// The cache it lives in.
    pub fn cache(&self) -> &PageCache {
        &self.cache
    }

    /// The descriptor a kernel takes by value as `gpuio_array_desc` (wrap it in
    /// `gpuio_array<T>`). Only kernels on a GPU can use it: the host backend's part is
    /// played by [`host_accessor`](Self::host_accessor).
    pub fn device(&self) -> Result<ArrayDevice> {
        let memory = &self.cache.inner.memory;
        if memory.gpu().backend() == Backend::Host {
            return Err(HalError::Unsupported {
                what: "an on-demand array's kernel descriptor",
                reason: "the host backend runs no kernels; use host_accessor()".into(),
            }
            .into());
        }
        let proxy = self.cache.inner.proxy.lock_unpoisoned();
        Ok(memory.array_device(proxy.device()?, self.table()))
    }

    /// The HAL's parts of the array (its cache's memory, its page table, the ring), for
    /// gpuio's own kernels (the GPU tests' checked reads and stores).
    pub fn hal_parts(&self) -> (&Arc<PageCacheMemory>, &PageTable, Arc<RingMemory>) {
        let ring = self.cache.inner.proxy.lock_unpoisoned().ring().clone();
        (&self.cache.inner.memory, self.table(), ring)
    }

    /// Host threads' access to the array through the cache protocol (the host backend's
    /// stand-in for GPU threads).
    pub fn host_accessor(&self) -> Result<HostAccessor> {
        let producer = self.cache.inner.proxy.lock_unpoisoned().host_producer()?;
        let access = HostAccessor::new(self.cache.inner.memory.clone(), self.table(), producer)?;
        let Some(InPlacePin {
            _pin: Pinned::Host { pin },
            ..
        }) = &self._in_place
        else {
            return Ok(access);
        };
        // Reads in place take the memory's own read lock, as any reader of it does; the
        // reader keeps the memory alive for as long as the accessor lives.
        let (owner, start) = (pin.owner().clone(), pin.range().start);
        let reader: SourceReader = Arc::new(move |byte| {
            let at = usize::try_from(byte)
                .ok()
                .and_then(|b| start.checked_add(b))
                .ok_or_else(|| HalError::InvalidArgument(format!("in-place read at {byte}")))?;
            let bytes = owner.read_range(at, 8)?;
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[..8]);
            Ok(u64::from_le_bytes(word))
        });
        Ok(access.reading_in_place(self.table(), reader))
    }

    /// Brings the pages holding elements `start .. start + count` into the cache (as many
    /// as fit: a prefetch larger than the cache evicts its own first pages).
    pub fn prefetch(&self, start: u64, count: u64) -> Result<()> {
        let end = start
            .checked_add(count)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                CoreError::InvalidRequest(format!(
                    "elements {start}..+{count} of an array of {}",
                    self.len
                ))
            })?;
        if count == 0 {
            return Ok(());
        }
        let ps = self.cache.page_size() as u64;
        let size = size_of::<T>() as u64;
        let pages = start * size / ps..(end * size).div_ceil(ps);
        self.run_pages(pages, false)
    }

    /// Holds every page of this read-only array in the cache, bringing in those not cached,
    /// until the returned view drops: kernels then read it through `gpuio_resident_array<T>`
    /// with no pin or check per access (the hit path of an array known to fit). Refused for
    /// a read-write array (a held dirty page could never be written back) and for one with
    /// more pages than the cache has frames; held pages count against the cache's frames
    /// until let go.
    pub fn resident(&self) -> Result<ResidentArray<'_, T>> {
        let held = self.hold()?;
        Ok(ResidentArray {
            array: Holds::Borrowed(self),
            held,
        })
    }

    /// [`resident`](Self::resident) for an array shared through an `Arc`: the view keeps the
    /// array alive instead of borrowing it, for owners that cannot express a borrow (the
    /// Python binding). The array cannot be closed while such a view lives, since closing
    /// takes it by value.
    pub fn resident_shared(self: &Arc<Self>) -> Result<ResidentArray<'static, T>> {
        let held = self.hold()?;
        Ok(ResidentArray {
            array: Holds::Shared(self.clone()),
            held,
        })
    }

    fn hold(&self) -> Result<HeldPages> {
        let ring = self.cache.inner.proxy.lock_unpoisoned().ring().clone();
        Ok(self.cache.inner.memory.hold(self.table(), &ring)?)
    }

    /// Writes every dirty page back to the source and waits for it (a file's data is then
    /// flushed to storage). Call it after the kernels that stored into the array finished;
    /// it also reports the first error a kernel's access met since the last check.
    pub fn synchronize(&self) -> Result<()> {
        self.run_pages(0..self.pages(), true)?;
        if let Some(file) = self.source.durable_file() {
            file.sync_data()?;
        }
        Ok(())
    }

    /// The first error kernels' accesses met since the last check (an index past the end, a
    /// store to a read-only array, a failed miss or write-back), as an error: call it after
    /// each kernel, since a failed access reads as zero.
    pub fn check(&self) -> Result<()> {
        match self.cache.inner.memory.take_error(self.table())? {
            Some(code) => Err(HalError::OnDemand { code }.into()),
            None => Ok(()),
        }
    }

    /// The array's counters.
    pub fn stats(&self) -> Result<ArrayStats> {
        Ok(self.cache.inner.memory.counters(self.table())?)
    }

    /// Writes dirty pages back and takes the array out of its cache.
    pub fn close(mut self) -> Result<()> {
        self.release()
    }

    fn run_pages(&self, pages: std::ops::Range<u64>, flush: bool) -> Result<()> {
        let ring = self.cache.inner.proxy.lock_unpoisoned().ring().clone();
        Ok(self
            .cache
            .inner
            .memory
            .run_pages(self.table(), &ring, pages, flush)?)
    }

    fn release(&mut self) -> Result<()> {
        let Some(table) = self.table.as_ref() else {
            return Ok(());
        };
        let flushed = if table.writable() {
            self.synchronize()
        } else {
            Ok(())
        };
        let table = self.table.take().expect("checked above");
        let resource = table.resource();
        let removed = self.cache.inner.memory.remove_array(table);
        let _ = self
            .cache
            .inner
            .proxy
            .lock_unpoisoned()
            .unregister(resource);
        flushed?;
        Ok(removed?)
    }
}

impl<T: Element> Drop for OnDemandArray<T> {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            tracing::warn!(error = %e, "closing an on-demand array");
        }
    }
}

/// A read-only [`OnDemandArray`] held in its cache ([`OnDemandArray::resident`]): no page is
/// evicted or moves while it lives, so kernels read it through `gpuio_resident_array<T>`
/// (`gpuio_array.cuh`) with two loads per element, the page's frame and the element. Dropping
/// it lets the pages go (a failure is logged; [`release`](Self::release) reports it). Reads
/// through it are not counted in the array's statistics.
pub struct ResidentArray<'a, T: Element> {
    // Dropped first: the pages are let go while the array is still in its cache (a shared
    // array's last handle may be this view's).
    held: HeldPages,
    array: Holds<'a, T>,
}

/// How a [`ResidentArray`] keeps its array in its cache: by borrowing it, or by sharing it.
enum Holds<'a, T: Element> {
    Borrowed(&'a OnDemandArray<T>),
    Shared(Arc<OnDemandArray<T>>),
}

impl<T: Element> std::ops::Deref for Holds<'_, T> {
    type Target = OnDemandArray<T>;

    fn deref(&self) -> &OnDemandArray<T> {
        match self {
            Holds::Borrowed(a) => a,
            Holds::Shared(a) => a,
        }
    }
}

impl<T: Element> std::fmt::Debug for ResidentArray<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentArray")
            .field("array", &*self.array)
            .field("held", &self.held)
            .finish()
    }
}

impl<T: Element> ResidentArray<'_, T> {
    /// The array held.
    pub fn array(&self) -> &OnDemandArray<T> {
        &self.array
    }

    /// The descriptor a kernel takes by value as `gpuio_resident_desc` (wrap it in
    /// `gpuio_resident_array<T>`), valid while this view lives. Only kernels on a GPU use it.
    pub fn device(&self) -> Result<ResidentDevice> {
        if self.array.cache.inner.memory.gpu().backend() == Backend::Host {
            return Err(HalError::Unsupported {
                what: "a resident array's kernel descriptor",
                reason: "the host backend runs no kernels".into(),
            }
            .into());
        }
        Ok(self.held.device())
    }

    /// The HAL's hold (its frame table), for gpuio's own kernels and tests.
    pub fn held(&self) -> &HeldPages {
        &self.held
    }

    /// Lets the pages go, reporting a failure.
    pub fn release(mut self) -> Result<()> {
        Ok(self.held.let_go()?)
    }
}
