//! On-demand arrays on the host backend: host threads follow the GPU's cache protocol
//! (`HostAccessor`) against a real ring proxy and real files. A proptest runs random mixes of
//! reads, writes, prefetches and flushes from several threads over a cache a sixteenth of the
//! array (every access thrashes) and checks every value read, and the file after
//! `synchronize`, against a plain model; other tests attack the edges (indices past the end,
//! read-only stores, a short source, a full cache, shutdown in the middle of misses). The GPU
//! side is in `ondemand_gpu.rs`.

use gpuio_core::ondemand::{ArrayMode, OnDemandArray, PageCache, PageCacheConfig};
use gpuio_core::ring::RingConfig;
use gpuio_core::{Endpoint, Engines};
use gpuio_hal::{BackendPreference, ErrorCode, HalError, pattern, probe};
use gpuio_ring::ondemand::{PAGE_VALID, page_frame, page_pins, page_state};
use gpuio_transport_localio::{FileHandle, LocalIo, LocalIoConfig, OpenOptions};
use gpuio_transport_memio::{MemIo, MemIoConfig};
use proptest::prelude::*;
use std::path::Path;
use std::sync::Arc;

const SEED: u64 = 0xa11a;

fn cache(page: usize, frames: usize) -> PageCache {
    // Every miss brings its page in: what these tests count (admission has its own tests).
    cache_with(page, frames, true, 0)
}

/// A cache of `frames` pages on the host backend, reading in place where it can (`in_place`)
/// and admitting a page read so after `admit_after` touches.
pub(crate) fn cache_with(
    page: usize,
    frames: usize,
    in_place: bool,
    admit_after: u32,
) -> PageCache {
    let gpus = probe(BackendPreference::Host).unwrap().gpus;
    let gpu = gpus[0].clone();
    let engines = Engines::new(
        Arc::new(MemIo::new(gpus, MemIoConfig::default()).unwrap()),
        Arc::new(LocalIo::new(LocalIoConfig::default()).unwrap()),
    );
    let cfg = PageCacheConfig {
        page_size: page,
        capacity: page * frames,
        ring: RingConfig {
            slots: 16,
            threads: 2,
            ..RingConfig::default()
        },
        in_place,
        admit_after,
    };
    PageCache::new(engines, &gpu, cfg).unwrap()
}

/// A file of `words` pattern words, opened read-write.
fn file(dir: &Path, words: u64) -> FileHandle {
    let path = dir.join("array.bin");
    let mut data = vec![0u8; (words * 8) as usize];
    pattern::fill(&mut data, 0, SEED);
    std::fs::write(&path, &data).unwrap();
    FileHandle::open(
        &path,
        OpenOptions {
            write: true,
            ..OpenOptions::READ
        },
    )
    .unwrap()
}

fn file_words(path: &Path) -> Vec<u64> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Read(u64),
    Write(u64, u64),
    Prefetch(u64),
    Flush,
}

fn op(owned: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..owned).prop_map(Op::Read),
        4 => (0..owned, any::<u64>()).prop_map(|(i, v)| Op::Write(i, v)),
        1 => (0..owned).prop_map(Op::Prefetch),
        1 => Just(Op::Flush),
    ]
}

const THREADS: u64 = 4;
const WORDS: u64 = 4096; // 32 KiB: 64 pages of 512 B behind 4 frames

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn concurrent_accesses_match_a_plain_model(
        ops in prop::collection::vec(prop::collection::vec(op(WORDS / THREADS), 1..120), THREADS as usize),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let f = file(dir.path(), WORDS);
        let cache = cache(512, 4);
        let array: Arc<OnDemandArray<u64>> = Arc::new(
            cache.array(Endpoint::file(&f, 0), WORDS, ArrayMode::ReadWrite).unwrap(),
        );
        // Thread k owns the elements i with i % THREADS == k: it alone writes them, so its
        // own model says what every read of them must return. Pages mix all four threads.
        let models: Vec<Vec<(u64, u64)>> = std::thread::scope(|s| {
            let handles: Vec<_> = ops.iter().enumerate().map(|(k, ops)| {
                let array = array.clone();
                s.spawn(move || {
                    let acc = array.host_accessor().unwrap();
                    let mut model = std::collections::BTreeMap::new();
                    for op in ops {
                        match *op {
                            Op::Read(j) => {
                                let i = j * THREADS + k as u64;
                                let want = *model.get(&i).unwrap_or(&pattern::word_at(SEED, i));
                                assert_eq!(acc.load_u64(i).unwrap(), want, "element {i}");
                            }
                            Op::Write(j, v) => {
                                let i = j * THREADS + k as u64;
                                acc.store_u64(i, v).unwrap();
                                model.insert(i, v);
                            }
                            Op::Prefetch(j) => {
                                let i = j * THREADS + k as u64;
                                array.prefetch(i, 1).unwrap();
                            }
                            Op::Flush => array.synchronize().unwrap(),
                        }
                    }
                    model.into_iter().collect()
                })
            }).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        array.synchronize().unwrap();
        let stats = array.stats().unwrap();
        let mut want: Vec<u64> = (0..WORDS).map(|i| pattern::word_at(SEED, i)).collect();
        for (i, v) in models.into_iter().flatten() {
            want[i as usize] = v;
        }
        prop_assert_eq!(file_words(&dir.path().join("array.bin")), want);
        prop_assert!(stats.misses >= 1 && stats.failures == 0, "{:?}", stats);
        let array = Arc::into_inner(array).unwrap();
        array.close().unwrap();
    }
}

#[test]
fn misses_say_why_they_are_not_read_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let f = file(dir.path(), 4096);
    let c = cache(4096, 4);
    // The host backend pins no page cache pages for a device: the ring, with the reason.
    let a = c
        .array::<u64>(Endpoint::file(&f, 0), 4096, ArrayMode::ReadOnly)
        .unwrap();
    assert!(!a.reads_in_place());
    assert!(
        a.miss_path().starts_with("through the ring ("),
        "{}",
        a.miss_path()
    );
    let w = c
        .array::<u64>(Endpoint::file(&f, 0), 4096, ArrayMode::ReadWrite)
        .unwrap();
    assert!(w.miss_path().contains("writable"), "{}", w.miss_path());
    // Reads are right either way.
    let acc = a.host_accessor().unwrap();
    assert_eq!(acc.load_u64(77).unwrap(), pattern::word_at(SEED, 77));
}

#[test]
fn a_small_cache_thrashes_but_every_read_is_right() {
    let dir = tempfile::tempdir().unwrap();
    let f = file(dir.path(), 1 << 15);
    let cache = cache(4096, 2);
    let array = cache
        .array::<u64>(Endpoint::file(&f, 0), 1 << 15, ArrayMode::ReadOnly)
        .unwrap();
    let acc = array.host_accessor().unwrap();
    for k in 0..2000u64 {
        let i = pattern::mix64(k) % (1 << 15);
        assert_eq!(acc.load_u64(i).unwrap(), pattern::word_at(SEED, i));
    }
    let s = array.stats().unwrap();
    assert_eq!(s.hits + s.misses + s.waits, 2000);
    assert!(s.misses > 1000 && s.evictions >= s.misses - 2, "{s:?}");
    assert_eq!(s.bytes_in, s.misses * 4096);
    assert!(
        s.miss_quantile_ns(0.5).is_some() && s.miss_quantile_ns(0.99) >= s.miss_quantile_ns(0.5),
        "{s:?}"
    );
    // A prefetch of the first pages, then hits only.
    array.prefetch(0, 512).unwrap();
    let before = array.stats().unwrap();
    for i in 0..512 {
        assert_eq!(acc.load_u64(i).unwrap(), pattern::word_at(SEED, i));
    }
    let after = array.stats().unwrap();
    assert_eq!(after.misses, before.misses);
    assert_eq!(after.hits - before.hits, 512);
}

#[test]
fn bad_accesses_fail_with_typed_errors_and_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let f = file(dir.path(), 1024);
    let cache = cache(512, 4);
    let ro = cache
        .array::<u64>(Endpoint::file(&f, 0), 1024, ArrayMode::ReadOnly)
        .unwrap();
    let acc = ro.host_accessor().unwrap();
    let e = acc.load_u64(1024).unwrap_err();
    assert!(matches!(e, HalError::OnDemand { code: -3 }), "{e}");
    assert_eq!(e.code(), ErrorCode::InvalidArg);
    let e = ro.check().unwrap_err();
    assert!(e.to_string().contains("past the array's end"), "{e}");
    ro.check().unwrap(); // reported once
    let e = acc.store_u64(3, 1).unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
    assert_eq!(e.code(), ErrorCode::Permission);
    assert_eq!(
        acc.load_u64(3).unwrap(),
        pattern::word_at(SEED, 3),
        "nothing was stored"
    );
    let e = ro.prefetch(1000, 25).unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
    ro.check().unwrap_err();

    // A source shorter than the array: the missing page fails, it does not read as zeros.
    let short = cache
        .array::<u64>(Endpoint::file(&f, 0), 2048, ArrayMode::ReadOnly)
        .unwrap();
    let acc = short.host_accessor().unwrap();
    assert_eq!(acc.load_u64(1000).unwrap(), pattern::word_at(SEED, 1000));
    let e = acc.load_u64(1500).unwrap_err();
    assert!(
        matches!(e, HalError::RingRequest { .. }),
        "the read failed: {e}"
    );
    assert!(short.check().is_err());
    assert_eq!(short.stats().unwrap().failures, 1);

    // A read-write array over a read-only file is refused up front.
    let ro_file = FileHandle::open(dir.path().join("array.bin"), OpenOptions::READ).unwrap();
    let e = cache
        .array::<u64>(Endpoint::file(&ro_file, 0), 1024, ArrayMode::ReadWrite)
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");

    // Memory sources are checked up front.
    let mem = super::common::host(4096, 1);
    let e = cache
        .array::<u64>(Endpoint::host(&mem, 8), 512, ArrayMode::ReadOnly)
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
    let e = cache
        .array::<u32>(Endpoint::host(&mem, 0), 0, ArrayMode::ReadOnly)
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
}

#[test]
fn a_cache_holds_64_arrays_sharing_its_frames() {
    let mem = super::common::host(64 << 10, 9);
    let cache = cache(512, 8);
    let arrays: Vec<OnDemandArray<u64>> = (0..64)
        .map(|k| {
            cache
                .array(Endpoint::host(&mem, k * 1024), 128, ArrayMode::ReadWrite)
                .unwrap()
        })
        .collect();
    let e = cache
        .array::<u8>(Endpoint::host(&mem, 0), 1, ArrayMode::ReadOnly)
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::Busy, "{e}");
    // Every array through 8 frames: pages of one evict pages of another, dirty ones written
    // back to the right array.
    for (k, a) in arrays.iter().enumerate() {
        a.host_accessor().unwrap().store_u64(5, k as u64).unwrap();
    }
    for (k, a) in arrays.iter().enumerate() {
        assert_eq!(a.host_accessor().unwrap().load_u64(5).unwrap(), k as u64);
        a.synchronize().unwrap();
    }
    let g = mem.read();
    for k in 0..64usize {
        let at = k * 1024 + 40;
        assert_eq!(
            u64::from_le_bytes(g[at..at + 8].try_into().unwrap()),
            k as u64
        );
    }
    drop(g);
    drop(arrays);
    // Slots come back when arrays go.
    cache
        .array::<u8>(Endpoint::host(&mem, 0), 1, ArrayMode::ReadOnly)
        .unwrap();
}

#[test]
fn shutdown_in_the_middle_of_misses_completes_or_fails_every_access() {
    let dir = tempfile::tempdir().unwrap();
    let f = file(dir.path(), 1 << 16);
    let cache = cache(512, 4);
    let array = cache
        .array::<u64>(Endpoint::file(&f, 0), 1 << 16, ArrayMode::ReadOnly)
        .unwrap();
    let results = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let acc = array.host_accessor().unwrap();
                s.spawn(move || {
                    let (mut ok, mut failed) = (0u64, 0u64);
                    for k in 0..4000u64 {
                        let i = pattern::mix64(t << 32 | k) % (1 << 16);
                        match acc.load_u64(i) {
                            Ok(v) => {
                                assert_eq!(v, pattern::word_at(SEED, i));
                                ok += 1;
                            }
                            Err(_) => failed += 1,
                        }
                    }
                    (ok, failed)
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(20));
        cache.shutdown().unwrap();
        workers
            .into_iter()
            .map(|w| w.join().unwrap())
            .collect::<Vec<_>>()
    });
    let failed: u64 = results.iter().map(|r| r.1).sum();
    assert!(
        failed > 0,
        "the shutdown came after every access: {results:?}"
    );
}

/// The frame table of a hold and the entries of its array (over the file from word `first`):
/// every page pinned `pins` times, and where held, in the frame the table names, holding the
/// source's bytes.
fn check_held(array: &OnDemandArray<u64>, first: u64, frames: &[u32], pins: u64) {
    let (memory, table, _) = array.hal_parts();
    let stream = memory.gpu().stream().unwrap();
    let mut raw = vec![0u8; table.pages() as usize * 8];
    stream.download(table.table(), 0, &mut raw).unwrap();
    for (page, e) in raw.chunks_exact(8).enumerate() {
        let e = u64::from_le_bytes(e.try_into().unwrap());
        assert_eq!(page_pins(e), pins, "page {page}");
        if pins > 0 {
            assert_eq!(page_frame(e), frames[page], "page {page}");
            assert_eq!(page_state(e), PAGE_VALID, "page {page}");
        }
    }
    if pins == 0 {
        return;
    }
    let per_page = memory.page_size() as u64 / 8;
    for i in (0..array.len()).step_by(97) {
        let at = frames[(i / per_page) as usize] as usize * memory.page_size()
            + (i % per_page) as usize * 8;
        let mut word = [0u8; 8];
        stream
            .download(memory.frame_memory(), at, &mut word)
            .unwrap();
        let want = pattern::word_at(SEED, first + i);
        assert_eq!(u64::from_le_bytes(word), want, "element {i}");
    }
}

#[test]
fn a_resident_array_stays_in_its_frames_while_others_thrash() {
    let dir = tempfile::tempdir().unwrap();
    let f = file(dir.path(), 1 << 13);
    let cache = cache(4096, 12);
    // 8 of the 12 frames held; another array of 16 pages thrashes through the other 4.
    let held = cache
        .array::<u64>(Endpoint::file(&f, 0), 4096, ArrayMode::ReadOnly)
        .unwrap();
    let resident = held.resident().unwrap();
    let frames = resident.held().frames().unwrap();
    assert_eq!(frames.len(), 8);
    let mut distinct = frames.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 8, "{frames:?}");
    assert!(frames.iter().all(|&f| (f as usize) < cache.frames()));
    check_held(&held, 0, &frames, 1);
    let e = resident.device().unwrap_err();
    assert_eq!(e.code(), ErrorCode::Unsupported, "{e}");

    let other = cache
        .array::<u64>(Endpoint::file(&f, 0), 1 << 13, ArrayMode::ReadOnly)
        .unwrap();
    let acc = other.host_accessor().unwrap();
    for k in 0..1000u64 {
        let i = pattern::mix64(k) % (1 << 13);
        assert_eq!(acc.load_u64(i).unwrap(), pattern::word_at(SEED, i));
    }
    assert!(other.stats().unwrap().evictions > 100);
    assert_eq!(resident.held().frames().unwrap(), frames);
    check_held(&held, 0, &frames, 1);

    // Refused: a writable array, and one larger than the cache.
    let rw = cache
        .array::<u64>(Endpoint::file(&f, 0), 512, ArrayMode::ReadWrite)
        .unwrap();
    assert_eq!(rw.resident().unwrap_err().code(), ErrorCode::InvalidArg);
    assert_eq!(other.resident().unwrap_err().code(), ErrorCode::InvalidArg);
    // Fits the cache, not the frames left free: the pages it got are let go again.
    let second = cache
        .array::<u64>(Endpoint::file(&f, 32 << 10), 4096, ArrayMode::ReadOnly)
        .unwrap();
    let e = second.resident().unwrap_err();
    check_held(&second, 4096, &[], 0);
    // The failure stays recorded for check, as a kernel's failed access would.
    assert_eq!(second.check().unwrap_err().code(), e.code(), "{e}");
    for k in 0..200u64 {
        let i = pattern::mix64(k) % (1 << 13);
        assert_eq!(acc.load_u64(i).unwrap(), pattern::word_at(SEED, i));
    }

    // Let go: no pins left; the second array fits now.
    resident.release().unwrap();
    check_held(&held, 0, &[], 0);
    let again = second.resident().unwrap();
    check_held(&second, 4096, &again.held().frames().unwrap(), 1);
}

#[test]
fn a_shared_resident_view_keeps_its_array_and_lets_go_first() {
    let dir = tempfile::tempdir().unwrap();
    let f = file(dir.path(), 1 << 13);
    let cache = cache(4096, 12);
    let array = Arc::new(
        cache
            .array::<u64>(Endpoint::file(&f, 0), 4096, ArrayMode::ReadOnly)
            .unwrap(),
    );
    let resident = array.resident_shared().unwrap();
    let frames = resident.held().frames().unwrap();
    assert_eq!(frames.len(), 8);
    check_held(&array, 0, &frames, 1);
    // The view is the last handle: dropping it lets the pages go, then closes the array, so
    // every frame is free for an array of the whole cache's size.
    drop(array);
    check_held(resident.array(), 0, &frames, 1);
    drop(resident);
    let whole = cache
        .array::<u64>(Endpoint::file(&f, 0), 12 * 512, ArrayMode::ReadOnly)
        .unwrap();
    let again = whole.resident().unwrap();
    check_held(&whole, 0, &again.held().frames().unwrap(), 1);
}
