//! On-demand arrays read in place, on the host backend: arrays over host memory, where host
//! threads (`HostAccessor`, the GPU protocol's twin) read a page not cached straight from the
//! source until it has had `admit_after` touches, then cache it. Checked: every value, the
//! counters (reads in place, the bytes they moved, admissions), the touch count in the page's
//! entry, that an eviction starts it again, and the cases that must not read in place
//! (writable arrays, unaligned sources, in-place reads off).

use super::ondemand::cache_with;
use gpuio_core::ondemand::{ArrayMode, OnDemandArray};
use gpuio_core::{Endpoint, HostMemory};
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_ring::ondemand::{PAGE_EMPTY, PAGE_VALID, SECTOR_BYTES, page_frame, page_state};
use std::sync::Arc;

const SEED: u64 = 0x1a_91ace;

/// Host memory of `words` pattern words.
fn memory(words: usize) -> HostMemory {
    let mut buf = HostBuffer::alloc(words * 8, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, SEED);
    HostMemory::new(buf)
}

/// The entry of `page` (its state and, while EMPTY, its touches).
fn entry(array: &OnDemandArray<u64>, page: u64) -> u64 {
    let (memory, table, _) = array.hal_parts();
    let mut raw = [0u8; 8];
    let stream = memory.gpu().stream().unwrap();
    stream
        .download(table.table(), page as usize * 8, &mut raw)
        .unwrap();
    u64::from_le_bytes(raw)
}

#[test]
fn a_page_is_read_in_place_until_its_touches_earn_it_a_frame() {
    let mem = memory(4096); // 32 KiB: 64 pages of 512 B
    let cache = cache_with(512, 4, true, 3);
    let array = cache
        .array::<u64>(Endpoint::host(&mem, 0), 4096, ArrayMode::ReadOnly)
        .unwrap();
    assert!(array.reads_in_place(), "{}", array.miss_path());
    assert!(
        array.miss_path().contains("host memory"),
        "{}",
        array.miss_path()
    );
    assert!(
        array.miss_path().contains("first 3 touches"),
        "{}",
        array.miss_path()
    );
    let acc = array.host_accessor().unwrap();
    // Page 1 holds elements 64..128: three touches read in place, counted in its entry.
    for (k, i) in [70u64, 64, 127].into_iter().enumerate() {
        assert_eq!(acc.load_u64(i).unwrap(), pattern::word_at(SEED, i));
        let e = entry(&array, 1);
        assert_eq!(page_state(e), PAGE_EMPTY);
        assert_eq!(page_frame(e), k as u32 + 1, "touches after {}", k + 1);
    }
    let s = array.stats().unwrap();
    assert_eq!((s.direct_reads, s.misses, s.hits), (3, 0, 0), "{s:?}");
    assert_eq!(s.direct_bytes, 3 * SECTOR_BYTES);
    // The fourth caches it; the fifth hits.
    assert_eq!(acc.load_u64(100).unwrap(), pattern::word_at(SEED, 100));
    assert_eq!(page_state(entry(&array, 1)), PAGE_VALID);
    assert_eq!(acc.load_u64(101).unwrap(), pattern::word_at(SEED, 101));
    let s = array.stats().unwrap();
    assert_eq!((s.direct_reads, s.misses, s.hits), (3, 1, 1), "{s:?}");
    assert_eq!(s.bytes_in, 512);
    assert_eq!(s.accesses(), 5);
    // 512 + 3 sectors moved for 5 elements of 8 bytes.
    let moved = s.moved_per_delivered(8).unwrap();
    assert!((moved - (512.0 + 96.0) / 40.0).abs() < 1e-9, "{moved}");
}

#[test]
fn an_evicted_page_earns_its_frame_again() {
    let mem = memory(4096);
    let cache = cache_with(512, 2, true, 1);
    let array = cache
        .array::<u64>(Endpoint::host(&mem, 0), 4096, ArrayMode::ReadOnly)
        .unwrap();
    let acc = array.host_accessor().unwrap();
    // Pages 0, 1, 2 each touched twice: one read in place, then cached; two frames, so
    // page 0 is evicted by page 2.
    for page in 0..3u64 {
        for _ in 0..2 {
            let i = page * 64 + 5;
            assert_eq!(acc.load_u64(i).unwrap(), pattern::word_at(SEED, i));
        }
    }
    let s = array.stats().unwrap();
    assert_eq!((s.direct_reads, s.misses), (3, 3), "{s:?}");
    assert!(s.evictions >= 1, "{s:?}");
    let evicted = (0..3).find(|&p| page_state(entry(&array, p)) == PAGE_EMPTY);
    let page = evicted.expect("two frames cannot hold three pages");
    assert_eq!(
        page_frame(entry(&array, page)),
        0,
        "an eviction clears the count"
    );
    // Its next touch reads in place again.
    assert_eq!(
        acc.load_u64(page * 64).unwrap(),
        pattern::word_at(SEED, page * 64)
    );
    assert_eq!(array.stats().unwrap().direct_reads, 4);
}

#[test]
fn a_prefetch_caches_pages_whatever_their_touches() {
    let mem = memory(4096);
    let cache = cache_with(512, 8, true, 1000);
    let array = cache
        .array::<u64>(Endpoint::host(&mem, 0), 4096, ArrayMode::ReadOnly)
        .unwrap();
    array.prefetch(0, 256).unwrap(); // pages 0..4
    let acc = array.host_accessor().unwrap();
    for i in 0..256 {
        assert_eq!(acc.load_u64(i).unwrap(), pattern::word_at(SEED, i));
    }
    let s = array.stats().unwrap();
    assert_eq!((s.misses, s.direct_reads, s.hits), (4, 0, 256), "{s:?}");
}

#[test]
fn arrays_that_cannot_read_in_place_say_why_and_stay_right() {
    let mem = memory(4096);
    let cache = cache_with(512, 4, true, 3);
    // Writable: its pages go back through the ring.
    let w = cache
        .array::<u64>(Endpoint::host(&mem, 0), 2048, ArrayMode::ReadWrite)
        .unwrap();
    assert!(!w.reads_in_place());
    assert!(w.miss_path().contains("writable"), "{}", w.miss_path());
    // Not 16-aligned: read in place, but every miss caches its page (elements are read
    // where they lie only from an aligned source).
    let odd = cache
        .array::<u64>(Endpoint::host(&mem, 8), 2048, ArrayMode::ReadOnly)
        .unwrap();
    assert!(odd.reads_in_place(), "{}", odd.miss_path());
    assert!(!odd.miss_path().contains("touches"), "{}", odd.miss_path());
    let acc = odd.host_accessor().unwrap();
    assert_eq!(acc.load_u64(10).unwrap(), pattern::word_at(SEED, 11));
    assert_eq!(odd.stats().unwrap().misses, 1);
    // In-place reads off: through the ring.
    let a = cache_with(512, 4, false, 3)
        .array::<u64>(Endpoint::host(&mem, 0), 2048, ArrayMode::ReadOnly)
        .unwrap();
    assert!(!a.reads_in_place());
    assert!(a.miss_path().contains("off"), "{}", a.miss_path());
}

#[test]
fn threads_racing_over_a_thrashing_cache_read_every_value_right() {
    // 64 pages behind 4 frames, admitted on the third touch: reads in place, fills,
    // evictions and hits interleave across four threads.
    let mem = memory(4096);
    let cache = cache_with(512, 4, true, 2);
    let array = Arc::new(
        cache
            .array::<u64>(Endpoint::host(&mem, 0), 4096, ArrayMode::ReadOnly)
            .unwrap(),
    );
    const READS: u64 = 3000;
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let array = array.clone();
            s.spawn(move || {
                let acc = array.host_accessor().unwrap();
                for k in 0..READS {
                    // Skewed: a third of the reads go to the first four pages.
                    let r = pattern::mix64(t << 32 | k);
                    let i = if r.is_multiple_of(3) {
                        r % 256
                    } else {
                        r % 4096
                    };
                    assert_eq!(acc.load_u64(i).unwrap(), pattern::word_at(SEED, i), "{i}");
                }
            });
        }
    });
    let s = array.stats().unwrap();
    assert_eq!(s.accesses(), 4 * READS, "{s:?}");
    assert!(s.direct_reads > 0 && s.misses > 0 && s.hits > 0, "{s:?}");
    assert_eq!(s.bytes_in, s.misses * 512);
    assert_eq!(s.direct_bytes, s.direct_reads * SECTOR_BYTES);
    array.check().unwrap();
}
