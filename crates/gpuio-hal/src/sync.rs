//! Locks that go on after a panic: [`MutexExt`], [`RwLockExt`] and [`CondvarExt`] take a
//! `std::sync` lock (or wait on a condition variable) and use the data as it is if a thread
//! panicked while holding the lock, instead of failing with a `PoisonError`.
//!
//! ```
//! use gpuio_hal::sync::MutexExt;
//! use std::sync::Mutex;
//! let idle = Mutex::new(vec![1, 2]);
//! idle.lock_unpoisoned().push(3);
//! assert_eq!(idle.into_inner_unpoisoned(), [1, 2, 3]);
//! ```
//!
//! # Why poison is tolerated
//!
//! A lock is poisoned when its holder panics. Poison protects data a panic can leave half
//! updated; the locks gpuio takes through these traits guard data no panic leaves so:
//!
//! - pools of idle things (streams, lanes, connections, staging buffers, RDMA channels and
//!   devices): a push or a pop is one step, and a thing that was out when its
//!   user panicked is simply not given back;
//! - one-shot slots, first-error slots and batch reports: written in single assignments;
//! - iterators handing out chunks: a chunk taken by a thread that then panicked is lost with
//!   the transfer that panic fails anyway;
//! - hints, counts and tables (the gather path's rates, prefetch predictions, the agent's
//!   pending handshakes and sessions per key, load per resource, the ring proxy's resource
//!   tables, pooled peers, partial files to remove): nothing that can panic runs between the
//!   steps of an update;
//! - state machines whose every update completes before anything that can panic (the staging
//!   pool, the registration cache and its io_uring ring, a scheduler ticket);
//! - locks that guard no data of their own (`()`: the host backend's device memory).
//!
//! Shared host buffers ([`SharedHostBuffer`](crate::SharedHostBuffer)) use `parking_lot`'s
//! raw locks, which have no poison: their bytes hold no invariant a panic could break.
//!
//! One is tolerated on weaker grounds: the scheduler's ready queue updates several structures
//! per push and pop. Only the queue's own code runs under that lock (no engine, no callback),
//! so a panic there is a bug in it, and going on is preferred to failing every later request.
//!
//! Refusing to go on in the cases above would turn one failed request (a panic inside an
//! engine fails its request, not the worker) into every later request failing.
//!
//! Where a panic *can* leave the data inconsistent, do not use these: take the lock with
//! `lock()` and turn poison into an error. The block cache's directory in gpuio-core does
//! that (`the cache directory is poisoned`): a block's entry, its tier's LRU and its slot
//! change in several steps, some around calls into the backing store, which may panic. Only
//! its read-only introspection and the release of a block after its flush take it poisoned.

use std::sync::{
    Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard, WaitTimeoutResult,
};
use std::time::Duration;

/// Poison-tolerant [`Mutex`] access (see the [module](self) for when that is right).
pub trait MutexExt<T: ?Sized> {
    /// [`Mutex::lock`], taking the data as it is if a holder panicked.
    fn lock_unpoisoned(&self) -> MutexGuard<'_, T>;

    /// [`Mutex::get_mut`], taking the data as it is if a holder panicked.
    fn get_mut_unpoisoned(&mut self) -> &mut T;

    /// [`Mutex::into_inner`], taking the data as it is if a holder panicked.
    fn into_inner_unpoisoned(self) -> T
    where
        Self: Sized,
        T: Sized;
}

impl<T: ?Sized> MutexExt<T> for Mutex<T> {
    fn lock_unpoisoned(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get_mut_unpoisoned(&mut self) -> &mut T {
        self.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    fn into_inner_unpoisoned(self) -> T
    where
        T: Sized,
    {
        self.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

/// Poison-tolerant [`RwLock`] access (see the [module](self) for when that is right).
pub trait RwLockExt<T: ?Sized> {
    /// [`RwLock::read`], taking the data as it is if a writer panicked.
    fn read_unpoisoned(&self) -> RwLockReadGuard<'_, T>;

    /// [`RwLock::write`], taking the data as it is if a writer panicked.
    fn write_unpoisoned(&self) -> RwLockWriteGuard<'_, T>;

    /// [`RwLock::into_inner`], taking the data as it is if a writer panicked.
    fn into_inner_unpoisoned(self) -> T
    where
        Self: Sized,
        T: Sized;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_unpoisoned(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_unpoisoned(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(|e| e.into_inner())
    }

    fn into_inner_unpoisoned(self) -> T
    where
        T: Sized,
    {
        self.into_inner().unwrap_or_else(|e| e.into_inner())
    }
}

/// Poison-tolerant [`Condvar`] waits, for mutexes taken with
/// [`MutexExt::lock_unpoisoned`].
pub trait CondvarExt {
    /// [`Condvar::wait`], taking the data as it is if a holder panicked meanwhile.
    fn wait_unpoisoned<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T>;

    /// [`Condvar::wait_timeout`], taking the data as it is if a holder panicked meanwhile.
    fn wait_timeout_unpoisoned<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, WaitTimeoutResult);
}

impl CondvarExt for Condvar {
    fn wait_unpoisoned<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.wait(guard).unwrap_or_else(|e| e.into_inner())
    }

    fn wait_timeout_unpoisoned<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
        self.wait_timeout(guard, timeout)
            .unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{AssertUnwindSafe, catch_unwind};

    fn poison<T>(m: &Mutex<T>) {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            let _g = m.lock().unwrap();
            panic!("poisoning on purpose");
        }));
        assert!(m.is_poisoned());
    }

    #[test]
    fn a_poisoned_mutex_is_still_usable() {
        let m = Mutex::new(1);
        poison(&m);
        *m.lock_unpoisoned() += 1;
        let c = Condvar::new();
        let (g, t) = c.wait_timeout_unpoisoned(m.lock_unpoisoned(), Duration::from_millis(1));
        assert!(t.timed_out());
        assert_eq!(*g, 2);
        drop(g);
        assert_eq!(m.into_inner_unpoisoned(), 2);
    }

    #[test]
    fn a_poisoned_rwlock_is_still_usable() {
        let l = RwLock::new(1);
        let _ = catch_unwind(AssertUnwindSafe(|| {
            let _g = l.write().unwrap();
            panic!("poisoning on purpose");
        }));
        assert!(l.is_poisoned());
        *l.write_unpoisoned() += 1;
        assert_eq!(*l.read_unpoisoned(), 2);
        assert_eq!(l.into_inner_unpoisoned(), 2);
    }
}

/// A counter many threads add to and few read: one cache line per slot, a thread always adds
/// to its own slot, and a read sums them. A plain shared atomic makes every add from a
/// different core take the line from the last one (about 100 ns on a server, per add); here
/// the adds stay in the adding core's cache.
#[derive(Debug)]
pub struct StripedCounter {
    slots: [crossbeam_utils::CachePadded<std::sync::atomic::AtomicU64>; STRIPES],
}

const STRIPES: usize = THREAD_STRIPES;

/// How many stripes [`thread_stripe`] hands out.
pub const THREAD_STRIPES: usize = 16;

impl Default for StripedCounter {
    fn default() -> Self {
        Self::new()
    }
}

thread_local! {
    /// This thread's slot; `usize::MAX` until its first add (a `const` slot costs one load).
    static STRIPE: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// This thread's stripe (below [`THREAD_STRIPES`]), handed out round-robin at its first use:
/// what per-thread counters index, so that a thread's adds stay in its own cache line.
#[inline]
pub fn thread_stripe() -> usize {
    STRIPE.with(|s| {
        let i = s.get();
        if i != usize::MAX {
            return i;
        }
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let i = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % STRIPES;
        s.set(i);
        i
    })
}

impl StripedCounter {
    /// A counter at zero (usable in a `static`).
    pub const fn new() -> Self {
        Self {
            slots: [const { crossbeam_utils::CachePadded::new(std::sync::atomic::AtomicU64::new(0)) };
                STRIPES],
        }
    }

    /// Adds `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.slots[thread_stripe()].fetch_add(n, std::sync::atomic::Ordering::Release);
    }

    /// Takes `n` away (what this thread takes may have been added by another: slots wrap, the
    /// sum does not).
    #[inline]
    pub fn sub(&self, n: u64) {
        self.slots[thread_stripe()].fetch_sub(n, std::sync::atomic::Ordering::Release);
    }

    /// The sum of everything added (adds racing with the read may or may not be in it). An
    /// add seen here brings what its thread did before it (adds release, reads acquire).
    pub fn get(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| s.load(std::sync::atomic::Ordering::Acquire))
            .fold(0, u64::wrapping_add)
    }
}

#[cfg(test)]
mod striped_tests {
    use super::StripedCounter;

    #[test]
    fn adds_from_many_threads_all_count() {
        let c = StripedCounter::default();
        std::thread::scope(|s| {
            for t in 0..24u64 {
                let c = &c;
                s.spawn(move || (0..1000).for_each(|_| c.add(t)));
            }
        });
        assert_eq!(c.get(), 1000 * (0..24).sum::<u64>());
    }
}

/// A one-item mailbox between a thread that waits on it and threads that offer it an `Arc`:
/// the whole exchange is one word, so an offer costs one compare-and-swap on one cache line
/// (a lock beside a state word would make the waiter's polling pull the line back between
/// the offerer's steps). Its states: shut, open (the waiter polls it; an offer may land),
/// or full (the item's pointer).
///
/// ```
/// use gpuio_hal::sync::ArcSlot;
/// use std::sync::Arc;
/// let slot = ArcSlot::default();
/// assert_eq!(slot.offer(Arc::new(1)).map_err(|a| *a), Err(1), "a shut slot refuses");
/// slot.open();
/// assert!(slot.offer(Arc::new(2)).is_ok());
/// assert_eq!(slot.close().map(|a| *a), Some(2), "closing hands over what landed");
/// ```
pub struct ArcSlot<T> {
    word: std::sync::atomic::AtomicPtr<T>,
}

/// The open state's word: no `Arc`'s data pointer is 1 (its counts lie before it).
fn open_word<T>() -> *mut T {
    std::ptr::without_provenance_mut(1)
}

impl<T> Default for ArcSlot<T> {
    fn default() -> Self {
        Self {
            word: std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
        }
    }
}

impl<T> std::fmt::Debug for ArcSlot<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let w = self.word.load(std::sync::atomic::Ordering::Relaxed);
        let state = match () {
            _ if w.is_null() => "shut",
            _ if w == open_word() => "open",
            _ => "full",
        };
        f.debug_struct("ArcSlot").field("state", &state).finish()
    }
}

impl<T> ArcSlot<T> {
    /// The waiter starts polling: offers may land. (An item still in the slot stays.)
    pub fn open(&self) {
        use std::sync::atomic::Ordering;
        let _ = self.word.compare_exchange(
            std::ptr::null_mut(),
            open_word(),
            Ordering::Release,
            Ordering::Relaxed,
        );
    }

    /// Whether an item is in the slot.
    pub fn is_full(&self) -> bool {
        let w = self.word.load(std::sync::atomic::Ordering::Acquire);
        !w.is_null() && w != open_word()
    }

    /// Puts `item` in an open slot, or gives it back if the slot is shut or full.
    pub fn offer(&self, item: std::sync::Arc<T>) -> Result<(), std::sync::Arc<T>> {
        use std::sync::atomic::Ordering;
        let open = open_word();
        // A plain read first: a slot that is not open is left in its owner's cache.
        if self.word.load(Ordering::Relaxed) != open {
            return Err(item);
        }
        let p = std::sync::Arc::into_raw(item).cast_mut();
        match self
            .word
            .compare_exchange(open, p, Ordering::AcqRel, Ordering::Relaxed)
        {
            Ok(_) => Ok(()),
            // SAFETY: `p` came from `Arc::into_raw` just above and was not stored: this turns
            // it back into the one `Arc` it was.
            Err(_) => Err(unsafe { std::sync::Arc::from_raw(p) }),
        }
    }

    /// Takes the item if one is in the slot (the slot is then shut).
    pub fn take(&self) -> Option<std::sync::Arc<T>> {
        use std::sync::atomic::Ordering;
        let w = self.word.load(Ordering::Acquire);
        if w.is_null() || w == open_word() {
            return None;
        }
        self.claim(w)
    }

    /// The waiter stops polling: `None` if nothing landed, else the item that did.
    pub fn close(&self) -> Option<std::sync::Arc<T>> {
        use std::sync::atomic::Ordering;
        match self.word.compare_exchange(
            open_word(),
            std::ptr::null_mut(),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => None,
            Err(w) if w.is_null() => None,
            Err(w) => self.claim(w),
        }
    }

    /// Moves the item at `w` (a full word just read) out of the slot, shutting it.
    fn claim(&self, w: *mut T) -> Option<std::sync::Arc<T>> {
        use std::sync::atomic::Ordering;
        // Only an open word is replaced by an offer, so a full word changes only here; two
        // takers racing for it both compare-and-swap, and one wins.
        self.word
            .compare_exchange(w, std::ptr::null_mut(), Ordering::AcqRel, Ordering::Relaxed)
            .ok()?;
        // SAFETY: `w` was stored by `offer` from `Arc::into_raw`, and the exchange above
        // removed it from the slot, so this is the one place that turns it back into its Arc.
        Some(unsafe { std::sync::Arc::from_raw(w) })
    }
}

impl<T> Drop for ArcSlot<T> {
    fn drop(&mut self) {
        let _ = self.take();
    }
}

#[cfg(test)]
mod arc_slot_tests {
    use super::ArcSlot;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    #[test]
    fn only_an_open_slot_takes_an_item() {
        let s = ArcSlot::default();
        let a = Arc::new(7u32);
        assert!(s.offer(a.clone()).is_err());
        s.open();
        assert!(!s.is_full());
        assert!(s.offer(a.clone()).is_ok());
        assert!(s.is_full());
        assert!(s.offer(a.clone()).is_err(), "a full slot refuses");
        assert_eq!(Arc::strong_count(&a), 2, "the slot holds one");
        assert_eq!(s.take().as_deref(), Some(&7));
        assert!(s.take().is_none() && !s.is_full());
        s.open();
        assert!(s.close().is_none());
        s.open();
        s.offer(a.clone()).unwrap();
        drop(s);
        assert_eq!(
            Arc::strong_count(&a),
            1,
            "dropping a full slot lets go of its item"
        );
    }

    /// A waiter opening, polling and closing while two threads race to offer: every item
    /// offered is taken exactly once or given back, and none leaks. Offerers go on past their
    /// share until some item landed, so the test never passes on refusals alone.
    #[test]
    fn racing_offers_are_each_taken_once() {
        use std::time::{Duration, Instant};
        const N: u64 = 20_000;
        let s = ArcSlot::default();
        let done = AtomicBool::new(false);
        let landed = AtomicU64::new(0);
        let deadline = Instant::now() + Duration::from_secs(20);
        let taken = std::thread::scope(|sc| {
            let waiter = sc.spawn(|| {
                let mut taken = Vec::new();
                while !done.load(Ordering::Acquire) {
                    s.open();
                    for _ in 0..10 {
                        taken.extend(s.take().map(|a| *a));
                        std::hint::spin_loop();
                    }
                    taken.extend(s.close().map(|a| *a));
                }
                taken
            });
            let offerers: Vec<_> = (0..2u64)
                .map(|g| {
                    let (s, landed) = (&s, &landed);
                    sc.spawn(move || {
                        let mut back = Vec::new();
                        let mut i = 0;
                        while i < N
                            || (landed.load(Ordering::Relaxed) == 0 && Instant::now() < deadline)
                        {
                            match s.offer(Arc::new(g << 32 | i)) {
                                Ok(()) => {
                                    landed.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(a) => back.push(Arc::into_inner(a).expect("sole owner")),
                            }
                            i += 1;
                        }
                        (back, i)
                    })
                })
                .collect();
            let mut back = Vec::new();
            let mut offered = Vec::new();
            for (g, o) in offerers.into_iter().enumerate() {
                let (b, n) = o.join().unwrap();
                back.extend(b);
                offered.extend((0..n).map(|i| (g as u64) << 32 | i));
            }
            done.store(true, Ordering::Release);
            let mut taken = waiter.join().unwrap();
            taken.extend(s.take().map(|a| *a));
            back.extend(taken.iter().copied());
            back.sort_unstable();
            offered.sort_unstable();
            assert_eq!(back, offered, "each item once");
            taken
        });
        assert!(!taken.is_empty(), "some items landed");
    }
}
