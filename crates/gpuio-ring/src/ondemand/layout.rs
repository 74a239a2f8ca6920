//! The page cache's shared layout: the bits of a page-table entry and of a frame's owner word,
//! the per-array slot and statistics blocks in device memory, and the descriptors kernels
//! receive by value. `kernels/gpuio_array.cuh` mirrors every constant and struct here; the
//! const asserts below and the `static_assert`s there pin the same sizes and offsets, and the
//! GPU test compares the constants the device compiler sees (`gpuio_array_layout`).

use crate::RingDevice;
use std::mem::{offset_of, size_of};

/// Version of this layout; bumped with any change to it (and to `gpuio_array.cuh`).
pub const VERSION: u32 = 4;

// ---- Page-table entry: one u64 per page of an array ------------------------------------------

/// Bits 0..32: the frame holding the page (meaningful in FILLING, VALID and EVICTING). While
/// the page is EMPTY in an array that reads in place with admission on
/// ([`ArrayDevice::admit_after`]), they count its touches instead.
pub const PAGE_FRAME_MASK: u64 = 0xFFFF_FFFF;
/// One pin: bits 32..56 count the threads using the page's frame now. A page is evicted only
/// when this count is zero, which one compare-and-swap of the whole entry checks.
pub const PAGE_PIN_ONE: u64 = 1 << 32;
/// The pin count's bits.
pub const PAGE_PIN_MASK: u64 = 0x00FF_FFFF << 32;
/// The frame holds bytes the source does not have yet.
pub const PAGE_DIRTY: u64 = 1 << 58;
/// The state's first bit (two bits: 60 and 61).
pub const PAGE_STATE_SHIFT: u32 = 60;
/// The state's bits.
pub const PAGE_STATE_MASK: u64 = 3 << PAGE_STATE_SHIFT;
/// Not cached (the entry is zero but for transient pins and the touch count).
pub const PAGE_EMPTY: u64 = 0;
/// One thread is reading the page into its frame; others wait.
pub const PAGE_FILLING: u64 = 1;
/// Cached and readable: pin, use the frame, unpin.
pub const PAGE_VALID: u64 = 2;
/// Being written back (for an eviction, or by a flush); others wait.
pub const PAGE_EVICTING: u64 = 3;

/// An entry's state (`PAGE_EMPTY` .. `PAGE_EVICTING`).
pub const fn page_state(entry: u64) -> u64 {
    (entry & PAGE_STATE_MASK) >> PAGE_STATE_SHIFT
}

/// An entry's frame.
pub const fn page_frame(entry: u64) -> u32 {
    (entry & PAGE_FRAME_MASK) as u32
}

/// An entry's pin count.
pub const fn page_pins(entry: u64) -> u64 {
    (entry & PAGE_PIN_MASK) >> 32
}

// ---- Frame owner: one u64 per frame ----------------------------------------------------------

/// A frame no page uses.
pub const FRAME_FREE: u64 = 0;
/// Set while one thread decides the frame's fate (evicting it, filling it).
pub const FRAME_LOCKED: u64 = 1 << 63;
/// Set in the word of a frame that holds (or is being filled with) a page.
pub const FRAME_OWNED: u64 = 1 << 62;
/// The array slot's first bit in an owner word (bits 48..56).
pub const FRAME_SLOT_SHIFT: u32 = 48;
/// The page number's bits in an owner word.
pub const FRAME_PAGE_MASK: u64 = (1 << 48) - 1;

/// The owner word of a frame holding `page` of the array in `slot`.
pub const fn frame_owner(slot: u32, page: u64) -> u64 {
    FRAME_OWNED | ((slot as u64) << FRAME_SLOT_SHIFT) | (page & FRAME_PAGE_MASK)
}

// ---- Arrays ----------------------------------------------------------------------------------

/// Arrays one cache can hold at once.
pub const MAX_ARRAYS: usize = 64;
/// Most pages one array can have (the owner word's page bits).
pub const MAX_PAGES: u64 = 1 << 48;
/// Most frames one cache can have (the entry's frame bits).
pub const MAX_FRAMES: u64 = 1 << 32;
/// Smallest page.
pub const MIN_PAGE: usize = 512;
/// Largest page.
pub const MAX_PAGE: usize = 64 << 10;

/// `ArraySlot::flags`: the array is in use.
pub const ARRAY_LIVE: u32 = 1;
/// `ArraySlot::flags`: kernels may store into it (pages become dirty and are written back).
pub const ARRAY_WRITABLE: u32 = 2;

/// Error results an access publishes besides the ring's (`GPUIO_ERROR_*`, see
/// [`gpuio_hal::ErrorCode`]): an index past the end, a store to a read-only array, no frame
/// could be freed (every one pinned or being filled: the cache is too small for the threads
/// using it).
pub const RESULT_OUT_OF_RANGE: i64 = -3;
/// See [`RESULT_OUT_OF_RANGE`].
pub const RESULT_READ_ONLY: i64 = -9;
/// See [`RESULT_OUT_OF_RANGE`].
pub const RESULT_NO_FRAME: i64 = -10;

/// One array's entry in the cache's slot table (device memory): what a thread evicting one
/// of its pages for another array needs to write it back.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArraySlot {
    /// Device address of the page table (`pages` u64 entries).
    pub table: u64,
    /// Pages of the array.
    pub pages: u64,
    /// Bytes of the source (the last page may be short).
    pub bytes: u64,
    /// The source's ring resource handle.
    pub resource: u32,
    /// `ARRAY_*` flags.
    pub flags: u32,
    /// The first error a device access met (0: none), a negative `GPUIO_ERROR_*`; the host
    /// reads and clears it.
    pub error: i64,
    /// Write-backs of the array's pages begun (counted before each is posted).
    pub writebacks_begun: u64,
    /// Write-backs of the array's pages ended, well or not (counted after each completes).
    /// An asynchronous read (`get_async`) trusts bytes it fetched without claiming the page
    /// only where no write-back was in flight when it was posted and none began since.
    pub writebacks_ended: u64,
    /// Where kernels read the source in place (its first byte's device address: a read-only
    /// array over a file whose page cache pages are registered with the device), so that a
    /// miss is one copy by the warp, with no ring round trip; 0: misses go through the ring.
    pub direct: u64,
}

// ---- Statistics: per array, striped so that threads on different SMs add to different lines --

/// Stripes of the counters.
pub const STAT_STRIPES: usize = 16;
/// Counters per stripe (two 64-byte lines: the hit path's counters in the first).
pub const STAT_COUNTERS: usize = 16;
/// Accesses that found their page cached.
pub const STAT_HITS: usize = 0;
/// Pages read from the source.
pub const STAT_MISSES: usize = 1;
/// Accesses that waited for another thread's fill or write-back.
pub const STAT_WAITS: usize = 2;
/// Pages of this array evicted.
pub const STAT_EVICTIONS: usize = 3;
/// Dirty pages written back (by evictions and flushes).
pub const STAT_WRITEBACKS: usize = 4;
/// Bytes read from the source.
pub const STAT_BYTES_IN: usize = 5;
/// Bytes written back to the source.
pub const STAT_BYTES_OUT: usize = 6;
/// Fills and write-backs that failed.
pub const STAT_FAILURES: usize = 7;
/// Accesses served in place from the source, not through the cache (a page not admitted yet).
pub const STAT_DIRECT: usize = 8;
/// Bytes those moved over the bus, in whole sectors ([`SECTOR_BYTES`]).
pub const STAT_BYTES_DIRECT: usize = 9;
/// What the bus moves at least per read in place: a GPU reads host memory in 32-byte sectors.
pub const SECTOR_BYTES: u64 = 32;
/// Buckets of the miss-latency histogram (quarter octaves of nanoseconds, [`latency_bucket`]).
pub const STAT_BUCKETS: usize = 128;
/// u64 words of one array's statistics block.
pub const STAT_WORDS: usize = STAT_STRIPES * STAT_COUNTERS + STAT_BUCKETS;

/// The histogram bucket of a latency of `ns` nanoseconds: exact below 4, then four buckets
/// per power of two (the two bits after the leading one), the last one open-ended.
pub const fn latency_bucket(ns: u64) -> usize {
    if ns < 4 {
        return ns as usize;
    }
    let msb = 63 - ns.leading_zeros();
    let b = (msb as usize - 1) * 4 + ((ns >> (msb - 2)) & 3) as usize;
    if b < STAT_BUCKETS {
        b
    } else {
        STAT_BUCKETS - 1
    }
}

/// The smallest latency (ns) that falls into bucket `b`.
pub const fn bucket_floor(b: usize) -> u64 {
    if b < 4 {
        return b as u64;
    }
    let msb = (b / 4 + 1) as u32;
    ((4 + (b % 4)) as u64) << (msb - 2)
}

// ---- Descriptors kernels receive by value ----------------------------------------------------

/// A page cache (`struct gpuio_cache`): the ring its misses go through, and the device
/// addresses of its frames and tables.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheDevice {
    /// The ring misses and write-backs are posted to.
    pub ring: RingDevice,
    /// Frame 0 (`nframes * page_size` bytes).
    pub frames: u64,
    /// Owner words (`nframes` u64).
    pub owners: u64,
    /// Reference bits (`nframes` u32): set by accesses, cleared by the clock.
    pub refs: u64,
    /// The slot table (`MAX_ARRAYS` [`ArraySlot`]s).
    pub slots: u64,
    /// Statistics blocks (`MAX_ARRAYS` × `STAT_WORDS` u64).
    pub stats: u64,
    /// The clock hand (a u64 counter).
    pub clock: u64,
    /// Frames.
    pub nframes: u64,
    /// Bytes per page (a power of two, `MIN_PAGE`..=`MAX_PAGE`).
    pub page_size: u64,
    /// log2 of `page_size`.
    pub page_shift: u32,
    /// [`VERSION`].
    pub version: u32,
}

/// One array (`struct gpuio_array_desc`): its cache, and its slot's fields copied so that a
/// hit reads nothing but the page table and the frame.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArrayDevice {
    /// The cache.
    pub cache: CacheDevice,
    /// Device address of the page table.
    pub table: u64,
    /// Pages.
    pub pages: u64,
    /// Bytes of the source.
    pub bytes: u64,
    /// The source's ring resource handle.
    pub resource: u32,
    /// The array's slot in the cache.
    pub slot: u32,
    /// `ARRAY_*` flags.
    pub flags: u32,
    /// For an array read in place ([`ArraySlot::direct`]): touches of a page not cached,
    /// each served from the source without the cache, before the next one brings the page
    /// in. 0: a miss brings its page in at once.
    pub admit_after: u32,
}

impl ArrayDevice {
    /// The descriptor's bytes as `struct gpuio_array_desc` lays them out (little-endian, as
    /// every GPU gpuio supports is): for a kernel launched by another library, which takes
    /// the descriptor by value or from device memory.
    pub fn to_bytes(&self) -> [u8; size_of::<ArrayDevice>()] {
        let (c, r) = (&self.cache, &self.cache.ring);
        // Every field in order; the C layout has no padding (the const asserts below).
        let words: [(u64, usize); 24] = [
            (r.header, 8),
            (r.slots, 8),
            (r.claim, 8),
            (r.mask as u64, 4),
            (r.nslots as u64, 4),
            (r.bounce, 8),
            (r.bounce_bytes, 8),
            (c.frames, 8),
            (c.owners, 8),
            (c.refs, 8),
            (c.slots, 8),
            (c.stats, 8),
            (c.clock, 8),
            (c.nframes, 8),
            (c.page_size, 8),
            (c.page_shift as u64, 4),
            (c.version as u64, 4),
            (self.table, 8),
            (self.pages, 8),
            (self.bytes, 8),
            (self.resource as u64, 4),
            (self.slot as u64, 4),
            (self.flags as u64, 4),
            (self.admit_after as u64, 4),
        ];
        let mut out = [0u8; size_of::<ArrayDevice>()];
        let mut at = 0;
        for (v, n) in words {
            out[at..at + n].copy_from_slice(&v.to_le_bytes()[..n]);
            at += n;
        }
        debug_assert_eq!(at, out.len());
        out
    }
}

/// A read-only array held in its cache (`struct gpuio_resident_desc`, for
/// `gpuio_resident_array<T>`): every page keeps one pin while it is held, so the frame table
/// does not change and a read needs neither pin nor check.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResidentDevice {
    /// Device address of the frame table (a `u32` frame per page).
    pub frames: u64,
    /// Device address of the cache's frame 0.
    pub base: u64,
    /// Bytes of the array.
    pub bytes: u64,
    /// Device address of the cache's slot table (where an out-of-range read is recorded).
    pub slots: u64,
    /// log2 of the page size.
    pub page_shift: u32,
    /// The array's slot.
    pub slot: u32,
}

impl ResidentDevice {
    /// The descriptor's bytes as `struct gpuio_resident_desc` lays them out (little-endian),
    /// for a kernel launched by another library.
    pub fn to_bytes(&self) -> [u8; size_of::<ResidentDevice>()] {
        let mut out = [0u8; size_of::<ResidentDevice>()];
        let words = [self.frames, self.base, self.bytes, self.slots];
        for (k, w) in words.iter().enumerate() {
            out[k * 8..k * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        out[32..36].copy_from_slice(&self.page_shift.to_le_bytes());
        out[36..40].copy_from_slice(&self.slot.to_le_bytes());
        out
    }
}

const _: () = {
    assert!(size_of::<RingDevice>() == 48);
    assert!(size_of::<ArraySlot>() == 64);
    assert!(offset_of!(ArraySlot, table) == 0);
    assert!(offset_of!(ArraySlot, pages) == 8);
    assert!(offset_of!(ArraySlot, bytes) == 16);
    assert!(offset_of!(ArraySlot, resource) == 24);
    assert!(offset_of!(ArraySlot, flags) == 28);
    assert!(offset_of!(ArraySlot, error) == 32);
    assert!(offset_of!(ArraySlot, writebacks_begun) == 40);
    assert!(offset_of!(ArraySlot, writebacks_ended) == 48);
    assert!(offset_of!(ArraySlot, direct) == 56);

    assert!(size_of::<CacheDevice>() == 120);
    assert!(offset_of!(CacheDevice, ring) == 0);
    assert!(offset_of!(CacheDevice, frames) == 48);
    assert!(offset_of!(CacheDevice, owners) == 56);
    assert!(offset_of!(CacheDevice, refs) == 64);
    assert!(offset_of!(CacheDevice, slots) == 72);
    assert!(offset_of!(CacheDevice, stats) == 80);
    assert!(offset_of!(CacheDevice, clock) == 88);
    assert!(offset_of!(CacheDevice, nframes) == 96);
    assert!(offset_of!(CacheDevice, page_size) == 104);
    assert!(offset_of!(CacheDevice, page_shift) == 112);
    assert!(offset_of!(CacheDevice, version) == 116);

    assert!(size_of::<ArrayDevice>() == 160);
    assert!(offset_of!(ArrayDevice, cache) == 0);
    assert!(offset_of!(ArrayDevice, table) == 120);
    assert!(offset_of!(ArrayDevice, pages) == 128);
    assert!(offset_of!(ArrayDevice, bytes) == 136);
    assert!(offset_of!(ArrayDevice, resource) == 144);
    assert!(offset_of!(ArrayDevice, slot) == 148);
    assert!(offset_of!(ArrayDevice, flags) == 152);
    assert!(offset_of!(ArrayDevice, admit_after) == 156);

    assert!(size_of::<ResidentDevice>() == 40);
    assert!(offset_of!(ResidentDevice, frames) == 0);
    assert!(offset_of!(ResidentDevice, base) == 8);
    assert!(offset_of!(ResidentDevice, bytes) == 16);
    assert!(offset_of!(ResidentDevice, slots) == 24);
    assert!(offset_of!(ResidentDevice, page_shift) == 32);
    assert!(offset_of!(ResidentDevice, slot) == 36);

    // The fields of an entry do not overlap.
    assert!(PAGE_FRAME_MASK & PAGE_PIN_MASK == 0);
    assert!((PAGE_FRAME_MASK | PAGE_PIN_MASK) & (PAGE_DIRTY | PAGE_STATE_MASK) == 0);
    assert!(PAGE_DIRTY & PAGE_STATE_MASK == 0);
    assert!((MAX_ARRAYS as u64) <= 1 << (62 - FRAME_SLOT_SHIFT));
    assert!(latency_bucket(u64::MAX) == STAT_BUCKETS - 1);
};

/// The constants a kernel compiler must agree on, in the order `gpuio_array_layout` (in
/// `kernels/array_test.cu`) reports them.
pub fn constants() -> Vec<(&'static str, u64)> {
    vec![
        ("VERSION", VERSION as u64),
        ("PAGE_PIN_ONE", PAGE_PIN_ONE),
        ("PAGE_PIN_MASK", PAGE_PIN_MASK),
        ("PAGE_DIRTY", PAGE_DIRTY),
        ("PAGE_STATE_SHIFT", PAGE_STATE_SHIFT as u64),
        ("FRAME_LOCKED", FRAME_LOCKED),
        ("FRAME_OWNED", FRAME_OWNED),
        ("FRAME_SLOT_SHIFT", FRAME_SLOT_SHIFT as u64),
        ("MAX_ARRAYS", MAX_ARRAYS as u64),
        ("STAT_STRIPES", STAT_STRIPES as u64),
        ("STAT_WORDS", STAT_WORDS as u64),
        ("sizeof(ArraySlot)", size_of::<ArraySlot>() as u64),
        ("sizeof(CacheDevice)", size_of::<CacheDevice>() as u64),
        ("sizeof(ArrayDevice)", size_of::<ArrayDevice>() as u64),
        ("sizeof(ResidentDevice)", size_of::<ResidentDevice>() as u64),
        ("latency_bucket(1000)", latency_bucket(1000) as u64),
        (
            "latency_bucket(123456789)",
            latency_bucket(123_456_789) as u64,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_are_quarter_octaves_and_floors_invert_them() {
        for b in 0..STAT_BUCKETS {
            let floor = bucket_floor(b);
            assert_eq!(latency_bucket(floor), b, "bucket {b} floor {floor}");
            if b + 1 < STAT_BUCKETS {
                assert_eq!(
                    latency_bucket(bucket_floor(b + 1) - 1),
                    b,
                    "bucket {b} ceiling"
                );
            }
        }
        // 1000 ns = 0b1111101000: leading bit 9, next two bits 11.
        assert_eq!(latency_bucket(1000), 35);
    }

    #[test]
    fn descriptor_bytes_put_each_field_at_its_offset() {
        let ring = RingDevice {
            header: 0x1111,
            slots: 0x2222,
            claim: 0x3333,
            mask: 1023,
            nslots: 1024,
            bounce: 0x4444,
            bounce_bytes: 4096,
        };
        let d = ArrayDevice {
            cache: CacheDevice {
                ring,
                frames: 0x5555,
                owners: 0x6666,
                refs: 0x7777,
                slots: 0x8888,
                stats: 0x9999,
                clock: 0xaaaa,
                nframes: 4096,
                page_size: 4096,
                page_shift: 12,
                version: VERSION,
            },
            table: 0xbbbb,
            pages: 99,
            bytes: 99 * 4096 - 5,
            resource: 7,
            slot: 3,
            flags: ARRAY_LIVE | ARRAY_WRITABLE,
            admit_after: 17,
        };
        let b = d.to_bytes();
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        assert_eq!(u64_at(offset_of!(RingDevice, claim)), 0x3333);
        assert_eq!(u32_at(offset_of!(RingDevice, nslots)), 1024);
        assert_eq!(u64_at(offset_of!(RingDevice, bounce_bytes)), 4096);
        assert_eq!(u64_at(offset_of!(CacheDevice, clock)), 0xaaaa);
        assert_eq!(u32_at(offset_of!(CacheDevice, page_shift)), 12);
        assert_eq!(u32_at(offset_of!(CacheDevice, version)), VERSION);
        assert_eq!(u64_at(offset_of!(ArrayDevice, table)), 0xbbbb);
        assert_eq!(u64_at(offset_of!(ArrayDevice, bytes)), 99 * 4096 - 5);
        assert_eq!(u32_at(offset_of!(ArrayDevice, slot)), 3);
        assert_eq!(
            u32_at(offset_of!(ArrayDevice, flags)),
            ARRAY_LIVE | ARRAY_WRITABLE
        );
        assert_eq!(u32_at(offset_of!(ArrayDevice, admit_after)), 17);
    }

    #[test]
    fn resident_descriptor_bytes_put_each_field_at_its_offset() {
        let d = ResidentDevice {
            frames: 0x1111,
            base: 0x2222,
            bytes: 0x3333,
            slots: 0x4444,
            page_shift: 12,
            slot: 9,
        };
        let b = d.to_bytes();
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        assert_eq!(u64_at(offset_of!(ResidentDevice, frames)), 0x1111);
        assert_eq!(u64_at(offset_of!(ResidentDevice, base)), 0x2222);
        assert_eq!(u64_at(offset_of!(ResidentDevice, bytes)), 0x3333);
        assert_eq!(u64_at(offset_of!(ResidentDevice, slots)), 0x4444);
        assert_eq!(u32_at(offset_of!(ResidentDevice, page_shift)), 12);
        assert_eq!(u32_at(offset_of!(ResidentDevice, slot)), 9);
    }

    #[test]
    fn entry_fields_decode() {
        let e = (PAGE_VALID << PAGE_STATE_SHIFT) | PAGE_DIRTY | (3 * PAGE_PIN_ONE) | 77;
        assert_eq!(page_state(e), PAGE_VALID);
        assert_eq!(page_pins(e), 3);
        assert_eq!(page_frame(e), 77);
        let o = frame_owner(5, 123);
        assert_eq!(o & FRAME_PAGE_MASK, 123);
        assert_eq!((o >> FRAME_SLOT_SHIFT) & 0xff, 5);
        assert!(o & FRAME_OWNED != 0 && o & FRAME_LOCKED == 0);
    }
}
