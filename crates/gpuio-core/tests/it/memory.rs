//! The registration cache on the probed backend (the host backend in CI), with both registrars
//! (CUDA host registration, io_uring fixed buffers), including a real fixed-buffer read into a
//! registered range. (The staging pool's tests are gpuio-hal's `tests/pool.rs`, with the pool.)

use gpuio_core::regcache::{
    CudaHostRegistrar, RegCacheConfig, Registrar, RegistrationCache, UringRegistrar,
};
use gpuio_core::{CoreError, HostMemory};
use gpuio_hal::uring::RingOptions;
use gpuio_hal::{
    Backend, BackendPreference, Gpu, HalError, HostAllocOptions, HostBuffer, page_size, pattern,
    probe,
};
use std::sync::Arc;

fn gpu() -> Gpu {
    probe(BackendPreference::Auto).unwrap().gpus.remove(0)
}

#[test]
fn shared_types_are_send_and_sync() {
    fn both<T: Send + Sync>() {}
    both::<RegistrationCache<CudaHostRegistrar>>();
    both::<RegistrationCache<UringRegistrar>>();
    both::<gpuio_core::regcache::Registered<gpuio_core::regcache::UringBuffer>>();
}

fn memory(len: usize) -> HostMemory {
    HostMemory::new(HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap())
}

/// The cache's behaviour, whatever the registrar; ranges in pages so that both registrars'
/// granularities give the same entries.
fn exercise<R: Registrar>(make: impl Fn(RegCacheConfig) -> RegistrationCache<R>) {
    let p = page_size();
    let cache = make(RegCacheConfig::default());
    let a = memory(16 * p);

    // Miss, then a hit on the same range and on a sub-range; bad ranges are refused.
    let r = cache.get(&a, 0, 4 * p).unwrap();
    assert_eq!(r.range(), 0..4 * p);
    drop(r);
    assert_eq!(cache.get(&a, 0, 4 * p).unwrap().range(), 0..4 * p);
    let sub = cache.get(&a, p + 10, p).unwrap();
    assert_eq!(
        sub.range(),
        0..4 * p,
        "a sub-range is served by the whole registration"
    );
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.entries), (2, 1, 1));
    assert_eq!(s.registered_bytes, 4 * p as u64);
    for (off, len) in [(0, 0), (15 * p, 2 * p), (usize::MAX, 2)] {
        assert!(matches!(
            cache.get(&a, off, len),
            Err(CoreError::InvalidRequest(_))
        ));
    }

    // In use: an overlapping miss is Busy, a touching one registers beside it.
    let busy = cache.get(&a, 3 * p, 2 * p).unwrap_err();
    assert!(matches!(busy, CoreError::Busy(_)), "{busy}");
    let beside = cache.get(&a, 4 * p, p).unwrap();
    assert_eq!(beside.range(), 4 * p..5 * p);
    assert_eq!(
        cache.entries_of(&a),
        vec![(0..4 * p, true), (4 * p..5 * p, true)]
    );
    drop((sub, beside));

    // Idle: overlapping and touching entries merge into one covering the union.
    let merged = cache.get(&a, 3 * p, 3 * p).unwrap();
    assert_eq!(merged.range(), 0..6 * p);
    assert_eq!(cache.entries_of(&a), vec![(0..6 * p, true)]);
    drop(merged);
    let far = cache.get(&a, 8 * p, p).unwrap();
    drop(far);
    let touching = cache.get(&a, 6 * p, 2 * p).unwrap();
    assert_eq!(touching.range(), 0..9 * p, "touches both neighbours");
    drop(touching);
    let s = cache.stats();
    assert_eq!(
        (s.hits, s.misses, s.merges, s.entries),
        (2, 6, 4, 1),
        "{s:?}"
    );
    assert_eq!(s.registered_bytes, 9 * p as u64);

    // Entries keep their memory: the caller's last handle cannot take the buffer back.
    let b = memory(4 * p);
    drop(cache.get(&b, 0, p).unwrap());
    assert!(b.clone().into_inner().is_none());
    assert_eq!(cache.purge(&b), 1);
    assert!(b.into_inner().is_some(), "purged: the cache let go");

    // A cache deregisters what it holds when it goes; another cache registering the same
    // memory meanwhile would be refused by CUDA (registrations are per process).
    drop(cache);

    // LRU eviction under max_entries, skipping entries in use.
    let cache = make(RegCacheConfig {
        max_entries: 2,
        ..RegCacheConfig::default()
    });
    let m: Vec<HostMemory> = (0..4).map(|_| memory(2 * p)).collect();
    drop(cache.get(&m[0], 0, p).unwrap());
    drop(cache.get(&m[1], 0, p).unwrap());
    drop(cache.get(&m[0], 0, p).unwrap()); // m[0] is now the most recently used
    drop(cache.get(&m[2], 0, p).unwrap());
    assert!(
        cache.entries_of(&m[1]).is_empty(),
        "least recently used goes"
    );
    assert_eq!(cache.entries_of(&m[0]).len(), 1);
    let pinned = cache.get(&m[0], 0, p).unwrap(); // in use (and most recent)
    drop(cache.get(&m[2], 0, p).unwrap()); // m[2] most recent, m[0] in use
    let third = cache.get(&m[3], 0, p).unwrap();
    // Over by one: m[0] is older but in use, so m[2] goes.
    assert_eq!(cache.entries_of(&m[0]), vec![(0..p, true)]);
    assert!(cache.entries_of(&m[2]).is_empty());
    let also = cache.get(&m[1], 0, p).unwrap();
    // Three entries, all in use: none can go, so the cache stays over its limit for now.
    assert_eq!(cache.stats().entries, 3);
    drop((pinned, third, also));
    assert_eq!(cache.trim(), 1);
    let s = cache.stats();
    assert_eq!(
        (s.hits, s.misses, s.evictions, s.entries),
        (3, 5, 3, 2),
        "{s:?}"
    );
    assert_eq!(s.registered_bytes, 2 * p as u64);

    // And under max_bytes.
    drop(cache);
    let cache = make(RegCacheConfig {
        max_entries: 100,
        max_bytes: 3 * p as u64,
    });
    drop(cache.get(&m[0], 0, 2 * p).unwrap());
    drop(cache.get(&m[1], 0, 2 * p).unwrap());
    assert!(cache.entries_of(&m[0]).is_empty());
    assert_eq!(cache.stats().registered_bytes, 2 * p as u64);
    assert_eq!(cache.stats().evictions, 1);
}

#[test]
fn registration_cache_with_cuda_host_registration() {
    let gpu = gpu();
    exercise(|cfg| RegistrationCache::new(CudaHostRegistrar { gpu: gpu.clone() }, cfg));

    // The handle is the driver registration of exactly the entry's range.
    let cache = RegistrationCache::new(
        CudaHostRegistrar { gpu: gpu.clone() },
        RegCacheConfig::default(),
    );
    let p = page_size();
    let mem = memory(8 * p);
    let r = cache.get(&mem, p + 100, 200).unwrap();
    assert_eq!(r.range(), p..2 * p, "rounded out to whole pages");
    assert_eq!(r.handle().range(), r.range());
    assert_eq!(r.handle().gpu(), gpu.ordinal());
    // Registered memory stays usable, and copies run from it.
    pattern::fill(&mut mem.write()[p..2 * p], 0, 3);
    let dev = gpu.alloc(p).unwrap();
    let stream = gpu.stream().unwrap();
    stream.upload(&mem.read()[p..2 * p], &dev, 0).unwrap();
    let mut back = vec![0u8; p];
    stream.download(&dev, 0, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 0, 3), None);

    // A second cache over the same memory: CUDA refuses the overlapping registration, and the
    // driver's error comes through.
    let other = RegistrationCache::new(
        CudaHostRegistrar { gpu: gpu.clone() },
        RegCacheConfig::default(),
    );
    let second = other.get(&mem, p, p);
    match gpu.backend() {
        Backend::Cuda => match second {
            Err(CoreError::Hal(e @ HalError::Cuda { .. })) => eprintln!("refused: {e}"),
            other => panic!("expected the driver's refusal, got {other:?}"),
        },
        Backend::Host => drop(second.unwrap()),
    }
}

fn uring(slots: u32) -> Option<UringRegistrar> {
    match UringRegistrar::new(RingOptions::default(), slots) {
        Ok(r) => Some(r),
        Err(e @ CoreError::Unsupported { .. }) => {
            eprintln!("skipped: io_uring fixed-buffer tables unavailable here: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn registration_cache_with_io_uring_fixed_buffers() {
    if uring(1).is_none() {
        return;
    }
    exercise(|cfg| RegistrationCache::new(uring(16).unwrap(), cfg));

    // Slots are handed back when entries go.
    let cache = RegistrationCache::new(uring(2).unwrap(), RegCacheConfig::default());
    let p = page_size();
    let mems: Vec<HostMemory> = (0..3).map(|_| memory(p)).collect();
    let held: Vec<_> = mems[..2]
        .iter()
        .map(|m| cache.get(m, 0, p).unwrap())
        .collect();
    assert!(cache.get(&mems[2], 0, p).is_err(), "both slots in use");
    drop(held);
    assert_eq!(cache.purge(&mems[0]), 1);
    cache.get(&mems[2], 0, p).unwrap();
}

#[test]
fn io_uring_reads_a_file_into_a_registered_sub_range() {
    let Some(registrar) = uring(4) else { return };
    let cache = RegistrationCache::new(registrar, RegCacheConfig::default());
    let p = page_size();
    let mut data = vec![0u8; 8 * p];
    pattern::fill(&mut data, 0, 11);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("src");
    std::fs::write(&path, &data).unwrap();
    let file = Arc::new(std::fs::File::open(&path).unwrap());

    let mem = memory(16 * p);
    mem.write().fill(0xee);
    // Register a range, then ask for a sub-range of it: a hit on the same slot.
    let whole = cache.get(&mem, 2 * p, 8 * p).unwrap();
    let (off, len) = (3 * p + 17, 3 * p + 5);
    let sub = cache.get(&mem, off, len).unwrap();
    assert_eq!(sub.range(), whole.range());
    assert_eq!(sub.handle().index(), whole.handle().index());
    assert_eq!(cache.stats().hits, 1);
    let rel = off - sub.range().start;
    {
        let mut ring = cache.registrar().ring().lock().unwrap();
        let f = ring.register_file(file).unwrap();
        ring.read_fixed_shared(f, 100, sub.handle().index(), rel..rel + len, 42)
            .unwrap();
        let done = ring.complete(1).unwrap();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].tag, 42);
        assert_eq!(*done[0].result.as_ref().unwrap(), len);
        // Beyond the registered range is refused.
        let reg_len = sub.range().len();
        assert!(
            ring.read_fixed_shared(f, 0, sub.handle().index(), 0..reg_len + 1, 43)
                .is_err()
        );
        ring.unregister_file(f).unwrap();
    }
    let buf = mem.read();
    assert_eq!(
        &buf[off..off + len],
        &data[100..100 + len],
        "the file's bytes"
    );
    assert!(buf[..off].iter().all(|&b| b == 0xee), "nothing before");
    assert!(buf[off + len..].iter().all(|&b| b == 0xee), "nothing after");
}
