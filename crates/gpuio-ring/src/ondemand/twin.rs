//! The cache protocol on host threads ([`HostAccessor`]), step for step what a GPU thread does
//! in `kernels/gpuio_array.cuh`, with misses and write-backs posted to the request ring by a
//! [`HostProducer`]: CI runs the protocol, and gpuio-core's ring proxy behind it, without a
//! GPU. It works on the host backend only, where device memory is host memory at its device
//! address. Reads in place (`ArraySlot::direct`) and their admission run here as on a GPU
//! where the owner of the source hands the accessor a [`SourceReader`] (gpuio-core does for
//! host memory, reading under the memory's own locks; the host backend pins no page cache
//! pages, so a file is read through the ring). `get_async` has no twin (a kernel API over the
//! same protocol, tested on the GPU machine).
//!
//! Every word of the tables is a Rust atomic on a view of that memory. A frame's bytes are
//! read and written as `u64` atomics too (relaxed): the protocol orders them (a fill's bytes
//! before its page turns VALID, a store before its unpin), so that two threads of a test
//! racing on one element see one value or the other, never unsoundness.

use super::layout::{
    FRAME_FREE, FRAME_LOCKED, FRAME_OWNED, FRAME_PAGE_MASK, FRAME_SLOT_SHIFT, PAGE_DIRTY,
    PAGE_EMPTY, PAGE_EVICTING, PAGE_FILLING, PAGE_FRAME_MASK, PAGE_PIN_MASK, PAGE_PIN_ONE,
    PAGE_STATE_MASK, PAGE_STATE_SHIFT, PAGE_VALID, RESULT_NO_FRAME, RESULT_OUT_OF_RANGE,
    RESULT_READ_ONLY, SECTOR_BYTES, STAT_BYTES_DIRECT, STAT_BYTES_IN, STAT_BYTES_OUT,
    STAT_COUNTERS, STAT_DIRECT, STAT_EVICTIONS, STAT_FAILURES, STAT_HITS, STAT_MISSES,
    STAT_STRIPES, STAT_WAITS, STAT_WORDS, STAT_WRITEBACKS, frame_owner, latency_bucket, page_frame,
    page_pins, page_state,
};
use super::memory::PageCacheMemory;
use super::{InPlace, PageTable};
use crate::HostProducer;
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::gpu::{Backend, DeviceBuffer};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

/// How long a miss looks for a frame before it gives up with `RESULT_NO_FRAME`: frames
/// locked by fills in progress come free as those finish, so only a cache whose every frame
/// stays pinned (threads holding pages while they wait) runs into it.
const NO_FRAME_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

/// How host threads read an array's source in place: the 8 bytes at a byte offset of the
/// array (the stand-in for a GPU's load over the bus). It keeps the source alive.
pub type SourceReader = Arc<dyn Fn(u64) -> Result<u64> + Send + Sync>;

/// One array of a [`PageCacheMemory`], accessed by host threads through the cache protocol.
/// Share it between threads (`&self` everywhere).
pub struct HostAccessor {
    cache: Arc<PageCacheMemory>,
    /// The array's own page table (kept alive here).
    table: DeviceBuffer,
    slot: u32,
    pages: u64,
    bytes: u64,
    resource: u32,
    writable: bool,
    /// When a page read in place is admitted, and how the source is read in place (both
    /// set, or loads go through the cache).
    in_place: Option<(InPlace, SourceReader)>,
    producer: HostProducer,
}

impl std::fmt::Debug for HostAccessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostAccessor")
            .field("slot", &self.slot)
            .field("pages", &self.pages)
            .finish_non_exhaustive()
    }
}

/// A word of host-backend device memory.
///
/// # Safety
/// `addr` must be 8-aligned and lie inside device memory of the host backend that stays
/// allocated for `'a`, accessed only atomically while the view is in use.
unsafe fn word<'a>(addr: u64) -> &'a AtomicU64 {
    // SAFETY: the caller's contract: on the host backend a device address is the address of
    // host memory, aligned and alive for 'a.
    unsafe { AtomicU64::from_ptr(addr as *mut u64) }
}

/// The u64 at `index` of `buf` (bounds-checked).
fn word_in(buf: &DeviceBuffer, index: u64) -> &AtomicU64 {
    assert!(
        index
            .checked_mul(8)
            .is_some_and(|b| b + 8 <= buf.len() as u64),
        "word {index} outside a buffer of {} bytes",
        buf.len()
    );
    // SAFETY: the index is inside the buffer (checked above), device allocations are at least
    // 8-aligned, the buffer is host-backend memory (HostAccessor::new checks the backend) and
    // `buf` is borrowed for the view's lifetime; the protocol touches these words only
    // atomically.
    unsafe { word(buf.device_addr() + index * 8) }
}

impl HostAccessor {
    /// An accessor of the array `table` of `cache`, posting misses through `producer` (a
    /// producer of the ring whose proxy registered the array's resource and the cache's
    /// frames). Refused on any backend but the host's.
    pub fn new(
        cache: Arc<PageCacheMemory>,
        table: &PageTable,
        producer: HostProducer,
    ) -> Result<Self> {
        if cache.gpu().backend() != Backend::Host {
            return Err(HalError::Unsupported {
                what: "the host accessor of an on-demand array",
                reason: "device memory is host memory only on the host backend; GPU threads \
                         use gpuio_array.cuh"
                    .into(),
            });
        }
        Ok(Self {
            table: table.table().clone(),
            slot: table.slot(),
            pages: table.pages(),
            bytes: table.bytes(),
            resource: table.resource(),
            writable: table.writable(),
            in_place: None,
            cache,
            producer,
        })
    }

    /// Reads pages not admitted yet in place through `reader`, as the array's kernels do
    /// (where the array reads in place at all: [`PageTable::in_place`]).
    pub fn reading_in_place(mut self, table: &PageTable, reader: SourceReader) -> Self {
        self.in_place = table.in_place().map(|p| (p, reader));
        self
    }

    /// Elements of 8 bytes.
    pub fn len_u64(&self) -> u64 {
        self.bytes / 8
    }

    /// Pages.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Reads the 8-byte element `index`: through the cache, or in place from the source
    /// while its page has not earned a frame ([`InPlace::admit_after`]).
    pub fn load_u64(&self, index: u64) -> Result<u64> {
        let (page, at) = self.locate(index)?;
        let admit_after = self.in_place.as_ref().map_or(0, |p| p.0.admit_after);
        match (self.pin(page, admit_after)?, &self.in_place) {
            (Some(frame), _) => {
                let v = self.frame_word(frame, at).load(Ordering::Relaxed);
                self.unpin(page);
                Ok(v)
            }
            (None, Some((src, read))) => {
                let byte = page * self.cache.page_size() as u64 + at * 8;
                let v = read(byte).map_err(|e| self.fail_with(e))?;
                // The sectors the word spans at its device address, as a GPU counts them.
                let first = (src.addr + byte) / SECTOR_BYTES;
                let end = (src.addr + byte + 8).div_ceil(SECTOR_BYTES);
                self.count(self.slot, STAT_DIRECT, 1);
                self.count(self.slot, STAT_BYTES_DIRECT, (end - first) * SECTOR_BYTES);
                Ok(v)
            }
            (None, None) => Err(self.fail(RESULT_NO_FRAME)),
        }
    }

    /// Writes the 8-byte element `index` (the page becomes dirty; an eviction or
    /// [`flush`](Self::flush) writes it back).
    pub fn store_u64(&self, index: u64, value: u64) -> Result<()> {
        let (page, at) = self.locate(index)?;
        if !self.writable {
            return Err(self.fail(RESULT_READ_ONLY));
        }
        let frame = self.pin_frame(page)?;
        let e = word_in(&self.table, page);
        if e.load(Ordering::Relaxed) & PAGE_DIRTY == 0 {
            e.fetch_or(PAGE_DIRTY, Ordering::AcqRel);
        }
        self.frame_word(frame, at).store(value, Ordering::Relaxed);
        // The unpin releases the store: a write-back that sees no pins sees the bytes.
        self.unpin(page);
        Ok(())
    }

    /// Brings `page` into the cache (a prefetch: pin and unpin).
    pub fn touch(&self, page: u64) -> Result<()> {
        if page >= self.pages {
            return Err(self.fail(RESULT_OUT_OF_RANGE));
        }
        self.pin_frame(page)?;
        self.unpin(page);
        Ok(())
    }

    /// Holds `page` in the cache (brought in if needed): it keeps one pin, so it is neither
    /// evicted nor moved, until [`let_go`](Self::let_go). Returns its frame.
    pub fn hold(&self, page: u64) -> Result<u32> {
        if page >= self.pages {
            return Err(self.fail(RESULT_OUT_OF_RANGE));
        }
        self.pin_frame(page)
    }

    /// Takes off the pin [`hold`](Self::hold) left on `page`.
    pub fn let_go(&self, page: u64) {
        if page < self.pages {
            self.unpin(page);
        }
    }

    /// Writes `page` back if it is cached and dirty, leaving it cached and clean. Waits for
    /// threads that have it pinned.
    pub fn flush(&self, page: u64) -> Result<()> {
        if page >= self.pages {
            return Err(self.fail(RESULT_OUT_OF_RANGE));
        }
        let e = word_in(&self.table, page);
        let mut spins = 0u32;
        loop {
            let cur = e.load(Ordering::Acquire);
            if page_state(cur) != PAGE_VALID || cur & PAGE_DIRTY == 0 {
                // Not cached, clean, or being filled or written back by another thread.
                return Ok(());
            }
            if page_pins(cur) == 0 {
                let evicting =
                    (cur & !(PAGE_STATE_MASK | PAGE_DIRTY)) | (PAGE_EVICTING << PAGE_STATE_SHIFT);
                if e.compare_exchange(cur, evicting, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let to_valid = (PAGE_EVICTING - PAGE_VALID) << PAGE_STATE_SHIFT;
                    return match self.write_back(
                        self.slot,
                        self.resource,
                        self.bytes,
                        page,
                        page_frame(cur),
                    ) {
                        Ok(()) => {
                            e.fetch_sub(to_valid, Ordering::AcqRel);
                            Ok(())
                        }
                        Err(err) => {
                            // Still dirty: a later flush or eviction tries again.
                            e.fetch_sub(to_valid, Ordering::AcqRel);
                            e.fetch_or(PAGE_DIRTY, Ordering::AcqRel);
                            Err(err)
                        }
                    };
                }
            }
            pause(&mut spins);
        }
    }

    /// The page and the word index within it of element `index`.
    fn locate(&self, index: u64) -> Result<(u64, u64)> {
        match index.checked_mul(8) {
            Some(b) if b + 8 <= self.bytes => {
                let ps = self.cache.page_size() as u64;
                Ok((b / ps, (b % ps) / 8))
            }
            _ => Err(self.fail(RESULT_OUT_OF_RANGE)),
        }
    }

    fn frame_word(&self, frame: u32, at: u64) -> &AtomicU64 {
        let words_per_page = self.cache.page_size() as u64 / 8;
        word_in(
            self.cache.frame_memory(),
            frame as u64 * words_per_page + at,
        )
    }

    /// Pins `page`, filling it first if it is not cached; returns its frame.
    fn pin_frame(&self, page: u64) -> Result<u32> {
        // With nothing held back, every visit ends in a frame or an error.
        self.pin(page, 0)?.ok_or_else(|| self.fail(RESULT_NO_FRAME))
    }

    /// Pins `page`, filling it first if it is not cached, and returns its frame; or `None`:
    /// read the source in place (the page has had fewer than `admit_after` touches while not
    /// cached, counted in its empty entry's frame bits, or another thread fills or evicts
    /// it). `admit_after` 0: never `None`.
    fn pin(&self, page: u64, admit_after: u32) -> Result<Option<u32>> {
        let e = word_in(&self.table, page);
        let mut waited = false;
        let mut spins = 0u32;
        loop {
            let old = e.fetch_add(PAGE_PIN_ONE, Ordering::AcqRel);
            if page_state(old) == PAGE_VALID {
                let frame = page_frame(old);
                self.reference(frame);
                self.count(self.slot, if waited { STAT_WAITS } else { STAT_HITS }, 1);
                return Ok(Some(frame));
            }
            e.fetch_sub(PAGE_PIN_ONE, Ordering::AcqRel);
            let cur = e.load(Ordering::Acquire);
            let empty = page_state(cur) == PAGE_EMPTY;
            if admit_after != 0 && (!empty || (cur & PAGE_FRAME_MASK) < admit_after as u64) {
                if empty {
                    // A count lost to a racing thread only delays the admission.
                    let _ = e.compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Relaxed);
                }
                return Ok(None);
            }
            if empty {
                let filling = (cur & !PAGE_FRAME_MASK) | (PAGE_FILLING << PAGE_STATE_SHIFT);
                if e.compare_exchange(cur, filling, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return self.fill(page).map(Some);
                }
                continue;
            }
            // Another thread fills or writes it back: wait for it.
            waited = true;
            pause(&mut spins);
        }
    }

    fn unpin(&self, page: u64) {
        word_in(&self.table, page).fetch_sub(PAGE_PIN_ONE, Ordering::AcqRel);
    }

    /// Reads `page` (claimed FILLING by this thread) into a frame; returns it pinned.
    fn fill(&self, page: u64) -> Result<u32> {
        let start = Instant::now();
        let e = word_in(&self.table, page);
        let frame = match self.take_frame(page) {
            Ok(f) => f,
            Err(err) => {
                e.fetch_and(PAGE_PIN_MASK, Ordering::AcqRel);
                return Err(err);
            }
        };
        e.fetch_or(frame as u64, Ordering::AcqRel);
        let ps = self.cache.page_size() as u64;
        let len = (self.bytes - page * ps).min(ps);
        let dst = self.cache.frame_memory().device_addr() + frame as u64 * ps;
        let owner = word_in(&self.cache.owners, frame as u64);
        match self.producer.read(self.resource, page * ps, len, dst, None) {
            Ok(_) => {
                owner.store(frame_owner(self.slot, page), Ordering::Release);
                self.reference(frame);
                let to_valid = ((PAGE_VALID - PAGE_FILLING) << PAGE_STATE_SHIFT) + PAGE_PIN_ONE;
                e.fetch_add(to_valid, Ordering::AcqRel);
                self.count(self.slot, STAT_MISSES, 1);
                self.count(self.slot, STAT_BYTES_IN, len);
                let ns = start.elapsed().as_nanos().min(u64::MAX as u128) as u64;
                self.stat(self.slot, STAT_STRIPES * STAT_COUNTERS + latency_bucket(ns))
                    .fetch_add(1, Ordering::Relaxed);
                Ok(frame)
            }
            Err(err) => {
                owner.store(FRAME_FREE, Ordering::Release);
                e.fetch_and(PAGE_PIN_MASK, Ordering::AcqRel);
                self.count(self.slot, STAT_FAILURES, 1);
                Err(self.fail_with(err))
            }
        }
    }

    /// A frame for `page`: a free one, or one whose page can be evicted (unpinned, not
    /// referenced since the clock last passed), written back first if dirty. Returned locked
    /// and owned by `page`.
    fn take_frame(&self, page: u64) -> Result<u32> {
        let nframes = self.cache.frames() as u64;
        let (owners, refs) = (&self.cache.owners, &self.cache.refs);
        let clock = word_in(&self.cache.clock, 0);
        let start = Instant::now();
        let mut spins = 0u32;
        for attempt in 0u64.. {
            if attempt > 0 && attempt % nframes == 0 {
                // A sweep found nothing: let the fills in progress finish.
                if start.elapsed() > NO_FRAME_AFTER {
                    break;
                }
                pause(&mut spins);
            }
            let f = clock.fetch_add(1, Ordering::Relaxed) % nframes;
            // CLOCK: a frame used since the hand last passed gets a second chance.
            let r = self.ref_bit(refs, f);
            if r.load(Ordering::Relaxed) != 0 {
                r.store(0, Ordering::Relaxed);
                continue;
            }
            let o = word_in(owners, f);
            let cur = o.load(Ordering::Acquire);
            if cur & FRAME_LOCKED != 0
                || o.compare_exchange(cur, cur | FRAME_LOCKED, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
            {
                continue;
            }
            if cur & FRAME_OWNED != 0 && !self.evict(f as u32, cur)? {
                o.store(cur, Ordering::Release);
                continue;
            }
            o.store(
                FRAME_LOCKED | frame_owner(self.slot, page),
                Ordering::Release,
            );
            return Ok(f as u32);
        }
        Err(self.fail(RESULT_NO_FRAME))
    }

    /// Evicts the page that frame `f` (locked by this thread) holds: false where it cannot be
    /// now (pinned, or in another state), an error where its write-back failed (the page
    /// stays cached and dirty).
    fn evict(&self, f: u32, owner: u64) -> Result<bool> {
        let slot = ((owner >> FRAME_SLOT_SHIFT) & 0xff) as u32;
        let page = owner & FRAME_PAGE_MASK;
        // The victim's array, as the host knows it (never an address read from the device).
        let Some((table, info)) = self.cache.array(slot) else {
            // Its array was removed: the frame is free.
            return Ok(true);
        };
        if page >= info.pages || (page + 1) * 8 > table.len() as u64 {
            return Ok(true);
        }
        let e = word_in(&table, page);
        let cur = e.load(Ordering::Acquire);
        if page_state(cur) != PAGE_VALID || page_pins(cur) != 0 || page_frame(cur) != f {
            return Ok(false);
        }
        let evicting = (cur & !PAGE_STATE_MASK) | (PAGE_EVICTING << PAGE_STATE_SHIFT);
        if e.compare_exchange(cur, evicting, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Ok(false);
        }
        if cur & PAGE_DIRTY != 0
            && let Err(err) = self.write_back(slot, info.resource, info.bytes, page, f)
        {
            e.fetch_sub(
                (PAGE_EVICTING - PAGE_VALID) << PAGE_STATE_SHIFT,
                Ordering::AcqRel,
            );
            return Err(err);
        }
        // Empty, clean and frameless; transient pins stay counted until their owners undo them.
        e.fetch_and(PAGE_PIN_MASK, Ordering::AcqRel);
        self.count(slot, STAT_EVICTIONS, 1);
        Ok(true)
    }

    /// Writes frame `f`, holding `page` of the array in `slot`, back to its source.
    fn write_back(&self, slot: u32, resource: u32, bytes: u64, page: u64, f: u32) -> Result<()> {
        let ps = self.cache.page_size() as u64;
        let len = (bytes - page * ps).min(ps);
        // Begun before the write is posted, ended after it completes (as a GPU thread counts
        // them, for the device's asynchronous reads).
        let begun = std::mem::offset_of!(super::ArraySlot, writebacks_begun);
        let ended = std::mem::offset_of!(super::ArraySlot, writebacks_ended);
        self.slot_word(slot, begun).fetch_add(1, Ordering::AcqRel);
        let written = self.write_page(resource, page, len, f);
        self.slot_word(slot, ended).fetch_add(1, Ordering::AcqRel);
        match written {
            Ok(_) => {
                self.count(slot, STAT_WRITEBACKS, 1);
                self.count(slot, STAT_BYTES_OUT, len);
                Ok(())
            }
            Err(err) => {
                self.count(slot, STAT_FAILURES, 1);
                Err(self.fail_with(err))
            }
        }
    }

    /// Writes `len` bytes of frame `f` to `resource` at `page`'s offset, through the ring.
    fn write_page(&self, resource: u32, page: u64, len: u64, f: u32) -> Result<u64> {
        let ps = self.cache.page_size() as u64;
        // Staged through the slot's bounce buffer where it fits, as a GPU thread does.
        let staged = (len as usize) <= self.producer.ring().bounce_bytes();
        if staged {
            let words_per_page = ps / 8;
            let mut bytes: Vec<u8> = (0..len.div_ceil(8))
                .flat_map(|w| {
                    let word = word_in(self.cache.frame_memory(), f as u64 * words_per_page + w);
                    word.load(Ordering::Relaxed).to_le_bytes()
                })
                .collect();
            bytes.truncate(len as usize);
            self.producer
                .write_staged(resource, page * ps, &bytes, None)
        } else {
            let src = self.cache.frame_memory().device_addr() + f as u64 * ps;
            self.producer.write(resource, page * ps, len, src, None)
        }
    }

    fn ref_bit<'a>(&self, refs: &'a DeviceBuffer, f: u64) -> &'a AtomicU32 {
        assert!(
            (f + 1) * 4 <= refs.len() as u64,
            "frame {f} outside the reference bits"
        );
        // SAFETY: inside the buffer (checked above), 4-aligned, host-backend memory kept
        // alive by the cache (borrowed for 'a), touched only atomically.
        unsafe { AtomicU32::from_ptr((refs.device_addr() + f * 4) as *mut u32) }
    }

    /// Marks frame `f` recently used (written only when clear, to spare the line).
    fn reference(&self, f: u32) {
        let r = self.ref_bit(&self.cache.refs, f as u64);
        if r.load(Ordering::Relaxed) == 0 {
            r.store(1, Ordering::Relaxed);
        }
    }

    fn stat(&self, slot: u32, word: usize) -> &AtomicU64 {
        word_in(
            &self.cache.stats,
            (slot as usize * STAT_WORDS + word) as u64,
        )
    }

    fn count(&self, slot: u32, counter: usize, n: u64) {
        // This thread's counter stripe (as a GPU thread's is its SM's).
        let stripe = gpuio_hal::sync::thread_stripe() % STAT_STRIPES;
        self.stat(slot, stripe * STAT_COUNTERS + counter)
            .fetch_add(n, Ordering::Relaxed);
    }

    /// Records `code` as the array's first error (as a GPU thread does) and returns it.
    fn fail(&self, code: i64) -> HalError {
        self.record(code);
        HalError::OnDemand { code }
    }

    /// Records a ring failure as the array's first error and passes it on.
    fn fail_with(&self, err: HalError) -> HalError {
        let code = match &err {
            HalError::RingRequest { code } => *code,
            HalError::RingShutDown => crate::RESULT_SHUT_DOWN,
            other => other.code() as i64,
        };
        self.record(code);
        err
    }

    fn record(&self, code: i64) {
        // The word holds an i64; zero means no error yet.
        let _ = self
            .slot_word(self.slot, std::mem::offset_of!(super::ArraySlot, error))
            .compare_exchange(0, code as u64, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// The u64 at byte `field` of the slot table's entry `slot`.
    fn slot_word(&self, slot: u32, field: usize) -> &AtomicU64 {
        let at = slot as usize * size_of::<super::ArraySlot>() + field;
        word_in(&self.cache.slots, at as u64 / 8)
    }
}

/// Spins a little, then yields: the thread waited for holds no lock, only a page's state.
fn pause(spins: &mut u32) {
    *spins += 1;
    if *spins < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}
