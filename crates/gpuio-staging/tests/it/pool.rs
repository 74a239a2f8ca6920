//! The staging pool on the probed backend (the host backend in CI): against a model of its
//! accounting, waiting and limits; leases (several buffers at once, all or none, owned as plain
//! host buffers), shelves, holders of idle buffers and the observer.

use gpuio_hal::sync::MutexExt;
use gpuio_hal::{BackendPreference, ErrorCode, Gpu, HalError, HostBuffer, pattern, probe};
use gpuio_staging::{
    PoolConfig, PoolStats, PooledBuffer, StagingHolder, StagingLease, StagingPool,
};
use proptest::prelude::*;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};
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
                    prop_assert!(matches!(pool.try_get(len), Err(HalError::InvalidArgument(_))));
                    continue;
                }
                match (model.get(c), pool.try_get(len)) {
                    (Expect::Busy, Err(HalError::Busy(_))) => busy += 1,
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
    both::<PooledBuffer>();
    both::<StagingLease>();
}

#[test]
fn pool_reuses_releases_and_refuses() {
    let pool = small_pool(MAX as u64);
    // Requests it can never serve are invalid, with the numbers.
    for (len, what) in [(0, "0 bytes"), (MAX + 1, "largest class")] {
        match pool.try_get(len) {
            Err(HalError::InvalidArgument(m)) => assert!(m.contains(what), "{m}"),
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
        Err(HalError::InvalidArgument(m)) => assert!(m.contains("limit of 40960"), "{m}"),
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
        Err(e @ HalError::Busy(_)) => assert_eq!(e.code(), ErrorCode::Busy),
        other => panic!("{other:?}"),
    }
    let t = Instant::now();
    assert!(matches!(
        pool.get(1, Duration::from_millis(30)),
        Err(HalError::Busy(_))
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
                Ok::<_, HalError>(b.len())
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
    assert!(pool.is_waited_on());
    drop(held);
    for w in waiters {
        assert_eq!(w.join().unwrap().unwrap(), MAX / 2 + 1);
    }
    let s = pool.stats();
    assert_eq!((s.waits, s.failures, s.in_use_bytes), (2, 0, 0));
    assert!(s.pinned_bytes <= MAX as u64);
    assert!(!pool.is_waited_on());
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

#[test]
fn leases_are_all_or_nothing_and_their_buffers_come_back() {
    let gpu = gpu();
    let pool = small_pool(4 * MAX as u64);
    // Refused outright: none, or more than the limit could ever hold.
    for (count, what) in [(0, "no staging buffers"), (5, "above the pool limit")] {
        match pool.try_lease_for(&gpu, MAX, count) {
            Err(HalError::InvalidArgument(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{other:?}"),
        }
    }
    let (bufs, lease) = pool.try_lease_for(&gpu, MAX - 100, 3).unwrap();
    assert_eq!(bufs.len(), 3);
    assert!(bufs.iter().all(|b| b.len() == MAX && b.is_pinned()));
    assert_eq!(
        (lease.buffers(), lease.buffer_len(), lease.bytes()),
        (3, MAX, 3 * MAX as u64)
    );
    // Two more do not fit beside three: nothing is taken.
    match pool.try_lease_for(&gpu, MAX, 2) {
        Err(HalError::Busy(m)) => assert!(m.contains("2 x 65536 bytes"), "{m}"),
        other => panic!("{other:?}"),
    }
    let s = pool.stats();
    assert_eq!(
        (s.in_use_bytes, s.pinned_bytes, s.failures),
        (3 * MAX as u64, 3 * MAX as u64, 1)
    );
    // The buffers come back in any order; a stranger is not taken.
    let addrs: Vec<usize> = bufs.iter().map(|b| b.as_ptr() as usize).collect();
    let stranger = HostBuffer::alloc(MAX, &Default::default()).unwrap();
    lease.give_back(bufs.into_iter().rev().chain([stranger]));
    let s = pool.stats();
    assert_eq!((s.in_use_bytes, s.pinned_bytes), (0, 3 * MAX as u64));
    // A new lease reuses them (the most recently returned first) and allocates the rest.
    let (again, lease) = pool.try_lease_for(&gpu, MAX, 4).unwrap();
    let reused = again
        .iter()
        .filter(|b| addrs.contains(&(b.as_ptr() as usize)))
        .count();
    assert_eq!(reused, 3);
    let s = pool.stats();
    assert_eq!((s.allocations, s.reuses), (4, 3));
    assert_eq!(s.peak_pinned_bytes, 4 * MAX as u64);
    // Buffers that never come back are forgotten when the lease goes.
    let mut again = again;
    drop(again.pop());
    lease.give_back(again);
    let s = pool.stats();
    assert_eq!((s.in_use_bytes, s.pinned_bytes), (0, 3 * MAX as u64));
    let (lost, lease) = pool.try_lease_for(&gpu, MAX, 2).unwrap();
    drop((lost, lease));
    let s = pool.stats();
    assert_eq!((s.in_use_bytes, s.pinned_bytes), (0, MAX as u64));
}

#[test]
fn shelves_keep_placements_apart() {
    let gpu = gpu();
    // The default placement is unpinned here; leases for a GPU are pinned.
    let pool = StagingPool::new(PoolConfig {
        limit: 3 * MAX as u64,
        min_class: MIN,
        max_class: MAX,
        huge_pages: false,
        ..PoolConfig::default()
    })
    .unwrap();
    let plain = pool.try_get(MAX).unwrap();
    assert!(!plain.host_buffer().is_pinned());
    let plain_at = plain.host_buffer().as_ptr() as usize;
    drop(plain);
    // A free unpinned buffer does not serve a pinned lease: a fresh one is allocated.
    let (bufs, lease) = pool.try_lease_for(&gpu, MAX, 1).unwrap();
    assert!(bufs[0].is_pinned());
    assert_ne!(bufs[0].as_ptr() as usize, plain_at);
    lease.give_back(bufs);
    // At the limit, idle buffers of the other shelf are released to make room.
    let (bufs, lease) = pool.try_lease_for(&gpu, MAX, 3).unwrap();
    let s = pool.stats();
    assert_eq!((s.allocations, s.reuses, s.releases), (4, 1, 1), "{s:?}");
    assert_eq!(s.pinned_bytes, 3 * MAX as u64);
    lease.give_back(bufs);
}

/// A holder of idle buffers, as a transport's cached lanes are.
struct Lanes {
    pool: StagingPool,
    idle: Mutex<Vec<(Vec<HostBuffer>, StagingLease)>>,
}

impl StagingHolder for Lanes {
    fn release_idle(&self, wanted: u64) -> u64 {
        let mut bytes = 0;
        while bytes < wanted {
            let Some((bufs, lease)) = self.idle.lock_unpoisoned().pop() else {
                break;
            };
            bytes += lease.bytes();
            lease.give_back(bufs);
        }
        bytes
    }
}

impl Lanes {
    fn new(pool: &StagingPool) -> Arc<Self> {
        let lanes = Arc::new(Self {
            pool: pool.clone(),
            idle: Mutex::new(Vec::new()),
        });
        let weak: Weak<dyn StagingHolder> = Arc::downgrade(&lanes) as Weak<Lanes>;
        pool.add_holder(weak);
        lanes
    }

    /// Keeps a lane idle, and gives the idle ones back when someone is waiting for room
    /// (asked after parking: a request counts itself a waiter before it asks holders).
    fn park(&self, lane: (Vec<HostBuffer>, StagingLease)) {
        self.idle.lock_unpoisoned().push(lane);
        if self.pool.is_waited_on() {
            self.release_idle(u64::MAX);
        }
    }
}

#[test]
fn holders_let_idle_buffers_go_when_room_is_needed() {
    let gpu = gpu();
    let pool = small_pool(2 * MAX as u64);
    let a = Lanes::new(&pool);
    let b = Lanes::new(&pool);
    a.park(pool.try_lease_for(&gpu, MAX, 2).unwrap());
    // A spare request takes only room there is: it asks no holder and fails nothing.
    assert!(pool.lease_spare_for(&gpu, MAX / 2, 2).unwrap().is_none());
    let s = pool.stats();
    assert_eq!((s.reclaimed_bytes, s.failures), (0, 0), "{s:?}");
    assert_eq!(a.idle.lock_unpoisoned().len(), 1);
    // b's lane needs the room a keeps idle: a is asked, and its buffers are reused.
    let lane = pool.try_lease_for(&gpu, MAX / 2, 2).unwrap();
    let s = pool.stats();
    assert_eq!(s.reclaimed_bytes, 2 * MAX as u64, "{s:?}");
    assert!(a.idle.lock_unpoisoned().is_empty());
    assert_eq!(s.releases, 1, "one idle 64 KiB buffer made room: {s:?}");
    b.park(lane);
    // With room, a spare request is served like any other.
    let (bufs, lease) = pool.lease_spare_for(&gpu, MAX / 2, 1).unwrap().unwrap();
    assert_eq!(bufs[0].len(), MAX / 2);
    lease.give_back(bufs);
    // A holder that goes takes its idle buffers with it (and is not asked again).
    // (Left: the spare buffer, free.)
    drop(b);
    assert_eq!(pool.stats().pinned_bytes, MAX as u64 / 2);

    // A waiter: the lanes in use come back to the pool instead of going idle.
    let busy = pool.try_lease_for(&gpu, MAX, 2).unwrap();
    let waiter = {
        let (pool, gpu) = (pool.clone(), gpu.clone());
        std::thread::spawn(move || pool.lease_for(&gpu, MAX, 1, Duration::from_secs(20)))
    };
    let t = Instant::now();
    while pool.stats().waits == 0 {
        assert!(t.elapsed() < Duration::from_secs(20), "never waited");
        std::thread::sleep(Duration::from_millis(1));
    }
    a.park(busy);
    let (bufs, lease) = waiter.join().unwrap().unwrap();
    assert!(
        a.idle.lock_unpoisoned().is_empty(),
        "given back, not parked"
    );
    lease.give_back(bufs);
    let s = pool.stats();
    assert_eq!((s.in_use_bytes, s.failures), (0, 0), "{s:?}");
}

#[test]
fn the_observer_sees_every_change_in_order() {
    let seen: Arc<Mutex<Vec<PoolStats>>> = Arc::default();
    let log = seen.clone();
    let pool = StagingPool::with_observer(
        PoolConfig {
            limit: MAX as u64,
            min_class: MIN,
            max_class: MAX,
            huge_pages: false,
            ..PoolConfig::default()
        },
        move |s| log.lock_unpoisoned().push(*s),
    )
    .unwrap();
    assert_eq!(
        seen.lock_unpoisoned()[0].limit,
        MAX as u64,
        "published at once"
    );
    let a = pool.try_get(MAX).unwrap();
    assert!(pool.try_get(1).is_err());
    drop(a);
    pool.trim();
    let seen = seen.lock_unpoisoned();
    let in_use: Vec<u64> = seen.iter().map(|s| s.in_use_bytes).collect();
    assert_eq!(in_use, [0, MAX as u64, MAX as u64, 0, 0]);
    assert_eq!(seen.last().copied(), Some(pool.stats()));
    assert_eq!(seen.last().unwrap().failures, 1);
}
