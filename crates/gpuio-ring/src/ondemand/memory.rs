//! The page cache's memory ([`PageCacheMemory`]): frames, owner words, reference bits, the
//! slot table, statistics and the clock hand, all in one GPU's memory; and the arrays it
//! holds ([`PageTable`]): a slot and a page table each. Everything here runs on the host
//! between kernels; what threads do with this memory while kernels run is the protocol
//! (`gpuio_array.cuh` on a GPU, [`super::HostAccessor`] on host threads).

use super::HostAccessor;
use super::layout::{
    ARRAY_LIVE, ARRAY_WRITABLE, ArrayDevice, ArraySlot, CacheDevice, FRAME_FREE, FRAME_OWNED,
    FRAME_SLOT_SHIFT, MAX_ARRAYS, MAX_FRAMES, MAX_PAGE, MAX_PAGES, MIN_PAGE, STAT_BUCKETS,
    STAT_BYTES_DIRECT, STAT_BYTES_IN, STAT_BYTES_OUT, STAT_COUNTERS, STAT_DIRECT, STAT_EVICTIONS,
    STAT_FAILURES, STAT_HITS, STAT_MISSES, STAT_STRIPES, STAT_WAITS, STAT_WORDS, STAT_WRITEBACKS,
    VERSION, bucket_floor,
};
use crate::{HostProducer, RingDevice, RingMemory};
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::gpu::{Backend, DeviceBuffer, Gpu, Stream};
use gpuio_hal::sync::MutexExt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The memory of one page cache on one GPU. Arrays ([`PageTable`]) share its frames.
#[derive(Debug)]
pub struct PageCacheMemory {
    gpu: Gpu,
    page_size: usize,
    nframes: usize,
    frames: DeviceBuffer,
    pub(super) owners: DeviceBuffer,
    pub(super) refs: DeviceBuffer,
    pub(super) slots: DeviceBuffer,
    pub(super) stats: DeviceBuffer,
    pub(super) clock: DeviceBuffer,
    /// The arrays' tables and slots, as the host knows them: the host protocol resolves a
    /// victim's array here, not through device memory, so that it never follows a stale
    /// address.
    arrays: Mutex<Vec<Option<(DeviceBuffer, ArraySlot)>>>,
}

/// One array's place in a cache: its slot and its page table (device memory, zeroed: every
/// page empty). Made by [`PageCacheMemory::add_array`], given back by
/// [`PageCacheMemory::remove_array`].
#[derive(Debug)]
pub struct PageTable {
    slot: u32,
    table: DeviceBuffer,
    entry: ArraySlot,
    admit_after: u32,
}

/// Where kernels read an array's source in place, and when a page read so is brought into
/// the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InPlace {
    /// The source's first byte's device address ([`ArraySlot::direct`]).
    pub addr: u64,
    /// Touches of a page not cached served from the source itself (only the bytes asked
    /// for) before the next one brings the page in ([`ArrayDevice::admit_after`]); 0: a miss
    /// brings its page in at once.
    pub admit_after: u32,
}

impl PageTable {
    /// The array's slot in its cache.
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Pages.
    pub fn pages(&self) -> u64 {
        self.entry.pages
    }

    /// Bytes of the source.
    pub fn bytes(&self) -> u64 {
        self.entry.bytes
    }

    /// Whether kernels may store into the array.
    pub fn writable(&self) -> bool {
        self.entry.flags & ARRAY_WRITABLE != 0
    }

    /// The ring resource the array's pages come from.
    pub fn resource(&self) -> u32 {
        self.entry.resource
    }

    /// The page table (one u64 entry per page).
    pub fn table(&self) -> &DeviceBuffer {
        &self.table
    }

    /// Where kernels read the source in place, and when they admit its pages; `None`: misses
    /// go through the ring.
    pub fn in_place(&self) -> Option<InPlace> {
        (self.entry.direct != 0).then_some(InPlace {
            addr: self.entry.direct,
            admit_after: self.admit_after,
        })
    }
}

/// An array's counters, summed over their stripes, and its miss-latency histogram.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ArrayCounters {
    /// Accesses that found their page cached.
    pub hits: u64,
    /// Pages read from the source.
    pub misses: u64,
    /// Accesses that waited for another thread's fill or write-back.
    pub waits: u64,
    /// Pages evicted.
    pub evictions: u64,
    /// Dirty pages written back.
    pub writebacks: u64,
    /// Bytes read from the source.
    pub bytes_in: u64,
    /// Bytes written back.
    pub bytes_out: u64,
    /// Fills and write-backs that failed.
    pub failures: u64,
    /// Accesses served in place from the source, not through the cache (their pages not
    /// admitted yet: [`InPlace::admit_after`]).
    pub direct_reads: u64,
    /// Bytes those moved over the bus, in whole sectors ([`SECTOR_BYTES`](super::SECTOR_BYTES)).
    pub direct_bytes: u64,
    /// Misses per latency bucket (`layout::latency_bucket`).
    pub miss_latency: Vec<u64>,
}

impl ArrayCounters {
    /// Accesses counted: hits, waits, reads in place, and the misses that filled a page.
    pub fn accesses(&self) -> u64 {
        self.hits + self.waits + self.direct_reads + self.misses
    }

    /// Bytes moved from the source (pages filled, sectors read in place) per byte delivered,
    /// for accesses of `element` bytes each (`get`, `gather`, `[]`); `None` without accesses.
    pub fn moved_per_delivered(&self, element: usize) -> Option<f64> {
        let delivered = self.accesses().saturating_mul(element as u64);
        (delivered > 0).then(|| (self.bytes_in + self.direct_bytes) as f64 / delivered as f64)
    }

    /// The latency (ns, the floor of its bucket: within 19% below the true value) under which
    /// fraction `q` of the recorded misses fell; `None` without misses.
    pub fn miss_quantile_ns(&self, q: f64) -> Option<u64> {
        let total: u64 = self.miss_latency.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((total as f64 * q.clamp(0.0, 1.0)).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, n) in self.miss_latency.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Some(bucket_floor(b));
            }
        }
        None
    }
}

/// Zeroes a device buffer (in pieces: a table can be large).
fn zero(stream: &Stream, buf: &DeviceBuffer) -> Result<()> {
    const PIECE: usize = 1 << 20;
    let zeros = vec![0u8; PIECE.min(buf.len())];
    let mut off = 0;
    while off < buf.len() {
        let n = PIECE.min(buf.len() - off);
        stream.upload(&zeros[..n], buf, off)?;
        off += n;
    }
    Ok(())
}

fn words(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
}

impl PageCacheMemory {
    /// A cache of `capacity` bytes (rounded down to whole pages, at least one) of `page_size`
    /// (a power of two, 512 B to 64 KiB) on `gpu`, every frame free.
    pub fn new(gpu: &Gpu, page_size: usize, capacity: usize) -> Result<Self> {
        if !(MIN_PAGE..=MAX_PAGE).contains(&page_size) || !page_size.is_power_of_two() {
            return Err(HalError::InvalidArgument(format!(
                "page size {page_size}: a power of two from {MIN_PAGE} to {MAX_PAGE} bytes"
            )));
        }
        let nframes = capacity / page_size;
        if nframes == 0 || nframes as u64 >= MAX_FRAMES {
            return Err(HalError::InvalidArgument(format!(
                "cache capacity {capacity}: at least one page of {page_size} bytes, fewer than \
                 2^32 pages"
            )));
        }
        let stream = gpu.stream()?;
        let alloc = |len: usize| -> Result<DeviceBuffer> {
            let b = gpu.alloc(len)?;
            zero(&stream, &b)?;
            Ok(b)
        };
        Ok(Self {
            gpu: gpu.clone(),
            page_size,
            nframes,
            // The frames' bytes are only read once a fill wrote them.
            frames: gpu.alloc(nframes * page_size)?,
            owners: alloc(nframes * 8)?,
            refs: alloc(nframes * 4)?,
            slots: alloc(MAX_ARRAYS * size_of::<ArraySlot>())?,
            stats: alloc(MAX_ARRAYS * STAT_WORDS * 8)?,
            clock: alloc(64)?,
            arrays: Mutex::new(vec![None; MAX_ARRAYS]),
        })
    }

    /// The GPU whose memory this is.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Bytes per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Frames.
    pub fn frames(&self) -> usize {
        self.nframes
    }

    /// The frames' memory: register it with the ring's proxy, which writes misses into it
    /// and reads write-backs from it.
    pub fn frame_memory(&self) -> &DeviceBuffer {
        &self.frames
    }

    /// The descriptor kernels receive for the cache, with misses going through `ring`.
    pub fn device(&self, ring: RingDevice) -> CacheDevice {
        CacheDevice {
            ring,
            frames: self.frames.device_addr(),
            owners: self.owners.device_addr(),
            refs: self.refs.device_addr(),
            slots: self.slots.device_addr(),
            stats: self.stats.device_addr(),
            clock: self.clock.device_addr(),
            nframes: self.nframes as u64,
            page_size: self.page_size as u64,
            page_shift: self.page_size.trailing_zeros(),
            version: VERSION,
        }
    }

    /// The descriptor kernels receive for one array.
    pub fn array_device(&self, ring: RingDevice, table: &PageTable) -> ArrayDevice {
        ArrayDevice {
            cache: self.device(ring),
            table: table.entry.table,
            pages: table.entry.pages,
            bytes: table.entry.bytes,
            resource: table.entry.resource,
            slot: table.slot,
            flags: table.entry.flags,
            admit_after: table.admit_after,
        }
    }

    /// Adds an array over `bytes` bytes of ring resource `resource`: takes a free slot and
    /// allocates its page table, every page empty and every counter zero. `in_place`: where
    /// kernels read the source in place (`None`: through the ring), for a read-only array
    /// only, and readable there for the array's life. Call it while no kernel uses the cache.
    pub fn add_array(
        &self,
        bytes: u64,
        resource: u32,
        writable: bool,
        in_place: Option<InPlace>,
    ) -> Result<PageTable> {
        let direct = in_place.map_or(0, |p| p.addr);
        if bytes == 0 {
            return Err(HalError::InvalidArgument(
                "an on-demand array needs at least one byte".into(),
            ));
        }
        if writable && direct != 0 {
            return Err(HalError::InvalidArgument(
                "a writable array's pages go back through the ring: it cannot be read in place"
                    .into(),
            ));
        }
        let pages = bytes.div_ceil(self.page_size as u64);
        if pages >= MAX_PAGES {
            return Err(HalError::InvalidArgument(format!(
                "{bytes} bytes make {pages} pages; at most 2^48 fit"
            )));
        }
        let table_len = usize::try_from(pages * 8)
            .map_err(|_| HalError::InvalidArgument("page table too large".into()))?;
        let slot = {
            let mut arrays = self.arrays.lock_unpoisoned();
            let Some(slot) = arrays.iter().position(Option::is_none) else {
                return Err(HalError::Busy(format!(
                    "the cache already holds {MAX_ARRAYS} arrays"
                )));
            };
            // Reserved; filled in once the table exists.
            arrays[slot] = Some((self.slots.clone(), ArraySlot::default()));
            slot
        };
        let made = (|| {
            let stream = self.gpu.stream()?;
            let table = self.gpu.alloc(table_len)?;
            zero(&stream, &table)?;
            let entry = ArraySlot {
                table: table.device_addr(),
                pages,
                bytes,
                resource,
                flags: ARRAY_LIVE | if writable { ARRAY_WRITABLE } else { 0 },
                error: 0,
                writebacks_begun: 0,
                writebacks_ended: 0,
                direct,
            };
            let zeros = vec![0u8; STAT_WORDS * 8];
            stream.upload(&zeros, &self.stats, slot * STAT_WORDS * 8)?;
            stream.upload(
                &slot_bytes(&entry),
                &self.slots,
                slot * size_of::<ArraySlot>(),
            )?;
            self.arrays.lock_unpoisoned()[slot] = Some((table.clone(), entry));
            Ok(PageTable {
                slot: slot as u32,
                table,
                entry,
                admit_after: in_place.map_or(0, |p| p.admit_after),
            })
        })();
        if made.is_err() {
            self.arrays.lock_unpoisoned()[slot] = None;
        }
        made
    }

    /// Takes an array out: frees the frames its pages hold (their bytes are dropped: flush
    /// dirty pages first) and its slot. Call it while no kernel uses the cache.
    pub fn remove_array(&self, table: PageTable) -> Result<()> {
        let stream = self.gpu.stream()?;
        let mut owners = vec![0u8; self.nframes * 8];
        stream.download(&self.owners, 0, &mut owners)?;
        let mine =
            |o: u64| o & FRAME_OWNED != 0 && ((o >> FRAME_SLOT_SHIFT) & 0xff) as u32 == table.slot;
        // Rewrite only the runs of frames that change.
        let mut f = 0;
        let all: Vec<u64> = words(&owners).collect();
        while f < all.len() {
            if !mine(all[f]) {
                f += 1;
                continue;
            }
            let start = f;
            while f < all.len() && mine(all[f]) {
                f += 1;
            }
            let free = FRAME_FREE.to_le_bytes().repeat(f - start);
            stream.upload(&free, &self.owners, start * 8)?;
        }
        let empty = ArraySlot::default();
        stream.upload(
            &slot_bytes(&empty),
            &self.slots,
            table.slot as usize * size_of::<ArraySlot>(),
        )?;
        self.arrays.lock_unpoisoned()[table.slot as usize] = None;
        Ok(())
    }

    /// An array's counters and miss-latency histogram (a snapshot: kernels may be adding).
    pub fn counters(&self, table: &PageTable) -> Result<ArrayCounters> {
        let stream = self.gpu.stream()?;
        let mut raw = vec![0u8; STAT_WORDS * 8];
        stream.download(&self.stats, table.slot as usize * STAT_WORDS * 8, &mut raw)?;
        let w: Vec<u64> = words(&raw).collect();
        let sum = |c: usize| -> u64 {
            (0..STAT_STRIPES)
                .map(|s| w[s * STAT_COUNTERS + c])
                .fold(0u64, u64::wrapping_add)
        };
        Ok(ArrayCounters {
            hits: sum(STAT_HITS),
            misses: sum(STAT_MISSES),
            waits: sum(STAT_WAITS),
            evictions: sum(STAT_EVICTIONS),
            writebacks: sum(STAT_WRITEBACKS),
            bytes_in: sum(STAT_BYTES_IN),
            bytes_out: sum(STAT_BYTES_OUT),
            failures: sum(STAT_FAILURES),
            direct_reads: sum(STAT_DIRECT),
            direct_bytes: sum(STAT_BYTES_DIRECT),
            miss_latency: w[STAT_STRIPES * STAT_COUNTERS..][..STAT_BUCKETS].to_vec(),
        })
    }

    /// The first error device accesses to the array met since the last call (a negative
    /// `GPUIO_ERROR_*`), cleared. Call it after the kernels that used the array finished.
    pub fn take_error(&self, table: &PageTable) -> Result<Option<i64>> {
        let code = self.recorded_error(table)?;
        if code.is_some() {
            let stream = self.gpu.stream()?;
            stream.upload(&0i64.to_le_bytes(), &self.slots, Self::error_at(table))?;
        }
        Ok(code)
    }

    /// The first error recorded for `table`'s array, left recorded (see
    /// [`take_error`](Self::take_error)).
    pub fn recorded_error(&self, table: &PageTable) -> Result<Option<i64>> {
        let mut raw = [0u8; 8];
        self.gpu
            .stream()?
            .download(&self.slots, Self::error_at(table), &mut raw)?;
        let code = i64::from_le_bytes(raw);
        Ok((code != 0).then_some(code))
    }

    fn error_at(table: &PageTable) -> usize {
        table.slot as usize * size_of::<ArraySlot>() + std::mem::offset_of!(ArraySlot, error)
    }

    /// Brings pages `pages` of `table` in (`flush == false`: a prefetch) or writes back those
    /// of them that are dirty (a flush), misses and write-backs going through `ring`, whose
    /// proxy must be serving it: one GPU thread per page, or on the host backend a few host
    /// threads following the same protocol. Returns once every page is done, with the first
    /// error any access to the array met (since the last such check) if there was one.
    pub fn run_pages(
        self: &Arc<Self>,
        table: &PageTable,
        ring: &Arc<RingMemory>,
        pages: Range<u64>,
        flush: bool,
    ) -> Result<()> {
        if pages.start > pages.end || pages.end > table.pages() {
            return Err(HalError::InvalidArgument(format!(
                "pages {pages:?} of an array of {} pages",
                table.pages()
            )));
        }
        let ran = match self.gpu.backend() {
            Backend::Host => {
                let producer = HostProducer::new(ring.clone())?;
                let acc = HostAccessor::new(self.clone(), table, producer)?;
                let next = AtomicU64::new(pages.start);
                let threads = std::thread::available_parallelism()
                    .map_or(2, |n| n.get())
                    .clamp(1, 8) as u64;
                let threads = threads.min(pages.end - pages.start).max(1);
                std::thread::scope(|s| {
                    let workers: Vec<_> = (0..threads)
                        .map(|_| {
                            s.spawn(|| -> Result<()> {
                                loop {
                                    let p = next.fetch_add(1, Ordering::Relaxed);
                                    if p >= pages.end {
                                        return Ok(());
                                    }
                                    if flush { acc.flush(p)? } else { acc.touch(p)? }
                                }
                            })
                        })
                        .collect();
                    workers
                        .into_iter()
                        .map(|w| {
                            w.join().unwrap_or_else(|_| {
                                Err(HalError::Busy("a page thread panicked".into()))
                            })
                        })
                        .collect::<Result<Vec<()>>>()
                        .map(drop)
                })
            }
            _ => super::ops::pages(&self.gpu.stream()?, self, table, ring, pages, flush),
        };
        let recorded = self.take_error(table)?;
        ran?;
        match recorded {
            Some(code) => Err(HalError::OnDemand { code }),
            None => Ok(()),
        }
    }

    /// The table and slot of the array in `slot`, if one is there (for the host protocol).
    pub(super) fn array(&self, slot: u32) -> Option<(DeviceBuffer, ArraySlot)> {
        self.arrays
            .lock_unpoisoned()
            .get(slot as usize)
            .cloned()
            .flatten()
            .filter(|(_, s)| s.flags & ARRAY_LIVE != 0)
    }
}

fn slot_bytes(s: &ArraySlot) -> Vec<u8> {
    let mut v = Vec::with_capacity(size_of::<ArraySlot>());
    v.extend_from_slice(&s.table.to_le_bytes());
    v.extend_from_slice(&s.pages.to_le_bytes());
    v.extend_from_slice(&s.bytes.to_le_bytes());
    v.extend_from_slice(&s.resource.to_le_bytes());
    v.extend_from_slice(&s.flags.to_le_bytes());
    v.extend_from_slice(&s.error.to_le_bytes());
    for r in [s.writebacks_begun, s.writebacks_ended, s.direct] {
        v.extend_from_slice(&r.to_le_bytes());
    }
    debug_assert_eq!(v.len(), size_of::<ArraySlot>());
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuio_hal::gpu::{BackendPreference, probe};

    fn gpu() -> Gpu {
        probe(BackendPreference::Auto).unwrap().gpus.remove(0)
    }

    #[test]
    fn sizes_are_checked() {
        let g = gpu();
        for (page, cap) in [
            (256, 1 << 20),
            (3000, 1 << 20),
            (128 << 10, 1 << 20),
            (4096, 100),
        ] {
            let e = PageCacheMemory::new(&g, page, cap).unwrap_err();
            assert!(
                matches!(e, HalError::InvalidArgument(_)),
                "{page} {cap}: {e}"
            );
        }
        let m = PageCacheMemory::new(&g, 4096, 10 * 4096 + 5).unwrap();
        assert_eq!(m.frames(), 10);
        let ring = RingDevice {
            header: 0,
            slots: 0,
            claim: 0,
            mask: 0,
            nslots: 0,
            bounce: 0,
            bounce_bytes: 0,
        };
        assert_eq!(m.device(ring).page_shift, 12);
        let e = m.add_array(0, 1, false, None).unwrap_err();
        assert!(matches!(e, HalError::InvalidArgument(_)), "{e}");
        // In-place reads never meet a dirty page: a writable array cannot have them.
        let e = m
            .add_array(
                4096,
                1,
                true,
                Some(InPlace {
                    addr: 0x1000,
                    admit_after: 0,
                }),
            )
            .unwrap_err();
        assert!(matches!(e, HalError::InvalidArgument(_)), "{e}");
    }

    #[test]
    fn slots_run_out_and_come_back() {
        let m = PageCacheMemory::new(&gpu(), 512, 4096).unwrap();
        let mut tables: Vec<PageTable> = (0..MAX_ARRAYS)
            .map(|i| {
                m.add_array(1000 + i as u64, i as u32, i % 2 == 0, None)
                    .unwrap()
            })
            .collect();
        assert_eq!(tables[3].pages(), 2);
        assert!(tables[0].writable() && !tables[1].writable());
        let e = m.add_array(10, 0, false, None).unwrap_err();
        assert!(matches!(e, HalError::Busy(_)), "{e}");
        let t = tables.remove(7);
        assert_eq!(t.slot(), 7);
        m.remove_array(t).unwrap();
        assert_eq!(m.add_array(10, 0, false, None).unwrap().slot(), 7);
        let c = m.counters(&tables[0]).unwrap();
        assert_eq!(
            c,
            ArrayCounters {
                miss_latency: vec![0; STAT_BUCKETS],
                ..ArrayCounters::default()
            }
        );
        assert_eq!(c.miss_quantile_ns(0.5), None);
        assert_eq!(m.take_error(&tables[0]).unwrap(), None);
    }

    #[test]
    fn quantiles_read_the_histogram() {
        let mut c = ArrayCounters {
            miss_latency: vec![0; STAT_BUCKETS],
            ..ArrayCounters::default()
        };
        c.miss_latency[super::super::layout::latency_bucket(5_000)] = 90;
        c.miss_latency[super::super::layout::latency_bucket(80_000)] = 10;
        let p50 = c.miss_quantile_ns(0.5).unwrap();
        let p99 = c.miss_quantile_ns(0.99).unwrap();
        assert!((4_000..=5_000).contains(&p50), "{p50}");
        assert!((65_000..=80_000).contains(&p99), "{p99}");
    }
}
