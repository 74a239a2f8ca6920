//! The staging pool and the registration cache on the probed backend (the host backend in CI):
//! the pool against a model of its accounting, waiting and limits; the cache with both
//! registrars (CUDA host registration, io_uring fixed buffers), including a real fixed-buffer
//! read into a registered range.

use gpuio_core::pool::{PoolConfig, StagingPool};
use gpuio_core::regcache::{
    CudaHostRegistrar, RegCacheConfig, Registrar, RegistrationCache, UringRegistrar,
};
use gpuio_core::{CoreError, HostMemory};
use gpuio_hal::uring::RingOptions;
use gpuio_hal::{
    Backend, BackendPreference, Gpu, HalError, HostAllocOptions, HostBuffer, page_size, pattern,
    probe,
};
use proptest::prelude::*;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn gpu() -> Gpu {
    probe(BackendPreference::Auto).unwrap().gpus.remove(0)
}

const MIN: usize = 4 << 10;
const MAX: usize = 64 << 10;

fn small_pool(limit: u64) -> StagingPool {
    StagingPool::new(PoolConfig {
        limit,
        min_class: MIN,
        max_class: MAX,
        huge_pages: false,
        gpu: Some(gpu()),
        ..PoolConfig::default()
    })
    .unwrap()
}

fn class(len: usize) -> usize {
    len.next_power_of_two().max(MIN)
}

/// The pool's policy, restated: per class, free buffers (address, return tick) oldest first.
struct Model {
    limit: u64,
    free: Vec<VecDeque<(usize, u64)>>,
    pinned: u64,
    in_use: u64,
    tick: u64,
    allocations: u64,
    reuses: u64,
    releases: u64,
}

enum Expect {
    Reuse(usize),
    Fresh,
    Busy,
}

impl Model {
    fn idx(c: usize) -> usize {
        (c.trailing_zeros() - MIN.trailing_zeros()) as usize
    }

    fn get(&mut self, c: usize) -> Expect {
        let i = Self::idx(c);
        if let Some((addr, _)) = self.free[i].pop_back() {
            self.reuses += 1;
            self.in_use += c as u64;
            return Expect::Reuse(addr);
        }
        // Without a free buffer of the class, everything not handed out can be released.
        if self.in_use + c as u64 > self.limit {
            return Expect::Busy;
        }
        while self.pinned + c as u64 > self.limit {
            let (_, j) = (0..self.free.len())
                .filter_map(|j| self.free[j].front().map(|(_, t)| (*t, j)))
                .min()
                .unwrap();
            self.free[j].pop_front();
            self.pinned -= (MIN << j) as u64;
            self.releases += 1;
        }
        self.pinned += c as u64;
        self.in_use += c as u64;
        self.allocations += 1;
        Expect::Fresh
    }

    fn put(&mut self, c: usize, addr: usize) {
        self.tick += 1;
        self.in_use -= c as u64;
        self.free[Self::idx(c)].push_back((addr, self.tick));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random gets and drops over several classes: the limit always holds, the accounting
    /// matches the model step by step, free buffers are reused (the very buffer last returned
    /// to the class), and a get that cannot fit fails with Busy.
    #[test]
    fn pool_never_exceeds_its_limit(ops in proptest::collection::vec((any::<bool>(), 1usize..MAX, any::<prop::sample::Index>()), 1..60),
                                     limit_classes in 1u64..6) {
        let limit = limit_classes * MAX as u64 / 2 + MIN as u64;
        let pool = small_pool(limit);
        let mut model = Model {
            limit, free: vec![VecDeque::new(); 5], pinned: 0, in_use: 0, tick: 0,
            allocations: 0, reuses: 0, releases: 0,
        };
        let mut held = Vec::new();
        let mut busy = 0;
        for (get, len, pick) in ops {
            if get || held.is_empty() {
                let c = class(len);
                if c as u64 > limit {
                    prop_assert!(matches!(pool.try_get(len), Err(CoreError::InvalidRequest(_))));
                    continue;
                }
                match (model.get(c), pool.try_get(len)) {
                    (Expect::Busy, Err(CoreError::Busy(_))) => busy += 1,
                    (Expect::Busy, other) => prop_assert!(false, "expected Busy, got {other:?}"),
                    (want, Ok(b)) => {
                        prop_assert_eq!(b.len(), len);
                        prop_assert_eq!(b.capacity(), c);
                        if let Expect::Reuse(addr) = want {
                            prop_assert_eq!(b.host_buffer().as_ptr() as usize, addr, "reuses the last returned");
                        }
                        held.push(b);
                    }
                    (_, Err(e)) => prop_assert!(false, "get({len}) failed: {e}"),
                }
            } else {
                let b = held.swap_remove(pick.index(held.len()));
                model.put(b.capacity(), b.host_buffer().as_ptr() as usize);
                drop(b);
            }
            let s = pool.stats();
            prop_assert!(s.pinned_bytes <= limit, "{s:?}");
            prop_assert!(s.peak_pinned_bytes <= limit, "{s:?}");
            prop_assert_eq!(s.pinned_bytes, model.pinned);
            prop_assert_eq!(s.in_use_bytes, model.in_use);
            prop_assert_eq!(s.in_use_bytes, held.iter().map(|b| b.capacity() as u64).sum::<u64>());
            prop_assert_eq!((s.allocations, s.reuses, s.releases), (model.allocations, model.reuses, model.releases));
            prop_assert_eq!(s.failures, busy);
        }
    }
}

#[test]
fn shared_types_are_send_and_sync() {
    fn both<T: Send + Sync>() {}
    both::<StagingPool>();
    both::<gpuio_core::pool::PooledBuffer>();
    both::<RegistrationCache<CudaHostRegistrar>>();
    both::<RegistrationCache<UringRegistrar>>();
    both::<gpuio_core::regcache::Registered<gpuio_core::regcache::UringBuffer>>();
}

#[test]
fn pool_reuses_releases_and_refuses() {
    let pool = small_pool(MAX as u64);
    // Requests it can never serve are invalid, with the numbers.
    for (len, what) in [(0, "0 bytes"), (MAX + 1, "largest class")] {
        match pool.try_get(len) {
            Err(CoreError::InvalidRequest(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{other:?}"),
        }
    }
    let small = StagingPool::new(PoolConfig {
        limit: 40 << 10,
        min_class: MIN,
        max_class: MAX,
        ..PoolConfig::default()
    })
    .unwrap();
    match small.try_get(33 << 10) {
        Err(CoreError::InvalidRequest(m)) => assert!(m.contains("limit of 40960"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Sizes round up to a class; the slice is exactly the length asked for.
    let mut a = pool.try_get(5000).unwrap();
    assert_eq!((a.len(), a.capacity()), (5000, 8192));
    a.fill(7);
    let addr = a.host_buffer().as_ptr();
    drop(a);
    let b = pool.try_get(8000).unwrap();
    assert_eq!(b.host_buffer().as_ptr(), addr, "same class: reused");
    assert_eq!(b[0], 7, "a reused buffer keeps what its last user left");
    // A whole-limit buffer needs the idle 8 KiB released; with it held, nothing fits.
    drop(b);
    let big = pool.try_get(MAX).unwrap();
    let s = pool.stats();
    assert_eq!((s.allocations, s.reuses, s.releases), (2, 1, 1));
    assert_eq!((s.pinned_bytes, s.in_use_bytes), (MAX as u64, MAX as u64));
    match pool.try_get(1) {
        Err(e @ CoreError::Busy(_)) => assert_eq!(e.code(), gpuio_core::ErrorCode::Busy),
        other => panic!("{other:?}"),
    }
    let t = Instant::now();
    assert!(matches!(
        pool.get(1, Duration::from_millis(30)),
        Err(CoreError::Busy(_))
    ));
    assert!(t.elapsed() >= Duration::from_millis(30));
    drop(big);
    assert_eq!(pool.trim(), MAX as u64);
    let s = pool.stats();
    assert_eq!((s.pinned_bytes, s.waits, s.failures), (0, 1, 2));
    assert_eq!(s.peak_pinned_bytes, MAX as u64);
    fn serializable<T: serde::Serialize>(_: &T) {}
    serializable(&s);
}

#[test]
fn a_waiter_is_served_when_a_buffer_comes_back() {
    let pool = small_pool(MAX as u64);
    let held = pool.try_get(MAX).unwrap();
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let b = pool.get(MAX / 2 + 1, Duration::from_secs(20))?;
                std::thread::sleep(Duration::from_millis(5));
                Ok::<_, CoreError>(b.len())
            })
        })
        .collect();
    // Both are waiting before the buffer comes back.
    let t = Instant::now();
    while pool.stats().waits < 2 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "waiters never waited"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(held);
    for w in waiters {
        assert_eq!(w.join().unwrap().unwrap(), MAX / 2 + 1);
    }
    let s = pool.stats();
    assert_eq!((s.waits, s.failures, s.in_use_bytes), (2, 0, 0));
    assert!(s.pinned_bytes <= MAX as u64);
}

#[test]
fn concurrent_users_never_exceed_the_limit() {
    let limit = 3 * MAX as u64 / 2;
    let pool = small_pool(limit);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let len = MIN << ((pattern::mix64(t * 1000 + i) % 5) as usize);
                    if let Ok(mut b) = pool.get(len, Duration::from_secs(20)) {
                        b[0] = t as u8;
                        let s = pool.stats();
                        assert!(s.pinned_bytes <= limit && s.in_use_bytes <= limit, "{s:?}");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = pool.stats();
    assert_eq!((s.in_use_bytes, s.failures), (0, 0), "{s:?}");
    assert!(s.reuses > 0 && s.peak_pinned_bytes <= limit, "{s:?}");
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
