//! Backpressure: bytes admitted and not yet completed, bounded per engine and per session.
//!
//! A small request is admitted on the submitting thread and released on a worker, so the
//! budgets are laid out for a per-request cost of no cache line crossing between them:
//! - a count is striped (`StripedCounter`): a worker releases into its own line;
//! - admission reads an upper bound instead of the stripes: the exact sum at its last look
//!   plus everything admitted since, kept under the admission lock on the submitters' lines.
//!   Releases only lower the count, so the bound stays above it; only when the bound says no
//!   does admission sum the stripes (and decides on that sum, as if it had never kept one);
//! - the admission lock and the count of waiting submitters (which every release reads) lie
//!   on lines of their own, and the count is written only by a submitter that has to wait.

use super::ticket::SessionState;
use crate::error::{CoreError, Result};
use crate::route::EngineKind;
use crossbeam_utils::CachePadded;
use gpuio_hal::sync::{CondvarExt, MutexExt, StripedCounter};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// A count read outside the admission lock: a worker's release (in its own slot) can be seen
/// before the admission it undoes (in the submitter's), so the sum may dip below zero for a
/// moment; it reads as zero then. Under the lock every admission is seen, so the sum there is
/// never below the true count.
fn held(c: &StripedCounter) -> u64 {
    (c.get() as i64).max(0) as u64
}

/// Whether `bytes` fit in a budget of `limit` with `held` taken; an idle budget admits
/// anything, so a request larger than the limit still runs (alone).
fn fits(held: u64, limit: u64, bytes: u64) -> bool {
    held == 0 || held.saturating_add(bytes) <= limit
}

/// One budget's count, and admission's bound on it.
#[derive(Debug, Default)]
pub(crate) struct Budget {
    count: StripedCounter,
    /// Changed only under the admission lock (atomic only to be shared).
    bound: CachePadded<AtomicU64>,
}

impl Budget {
    /// Bytes admitted and not yet completed, as a reader outside the admission lock sees them.
    pub fn held(&self) -> u64 {
        held(&self.count)
    }

    /// Whether `bytes` fit under `limit` (the admission lock held): the bound answers when
    /// it can, else the count, which becomes the bound.
    fn admits(&self, limit: u64, bytes: u64) -> bool {
        if fits(self.bound.load(Ordering::Relaxed), limit, bytes) {
            return true;
        }
        let exact = held(&self.count);
        self.bound.store(exact, Ordering::Relaxed);
        fits(exact, limit, bytes)
    }

    /// Takes `bytes` (the admission lock held).
    fn take(&self, bytes: u64) {
        self.count.add(bytes);
        let b = self.bound.load(Ordering::Relaxed);
        self.bound.store(b.saturating_add(bytes), Ordering::Relaxed);
    }

    fn release(&self, bytes: u64) {
        self.count.sub(bytes);
    }
}

/// The engines' budgets and admission (see the module's notes).
pub(crate) struct Budgets {
    engine: [Budget; 3],
    engine_limit: u64,
    /// Admission, and waiting for room.
    lock: CachePadded<Mutex<()>>,
    room: Condvar,
    waiters: CachePadded<AtomicUsize>,
}

impl Budgets {
    pub fn new(engine_limit: u64) -> Self {
        Self {
            engine: Default::default(),
            engine_limit: engine_limit.max(1),
            lock: Default::default(),
            room: Condvar::new(),
            waiters: Default::default(),
        }
    }

    /// Bytes in flight on an engine, as a reader outside the admission lock sees them.
    pub fn in_flight(&self, e: EngineKind) -> u64 {
        self.engine[e as usize].held()
    }

    /// Takes `bytes` from both budgets if they fit (the admission lock held).
    fn try_take(&self, e: EngineKind, s: &SessionState, bytes: u64) -> bool {
        let eb = &self.engine[e as usize];
        if !eb.admits(self.engine_limit, bytes) || !s.in_flight.admits(s.limit, bytes) {
            return false;
        }
        eb.take(bytes);
        s.in_flight.take(bytes);
        true
    }

    /// Admits `bytes`: at once if they fit (or `force`), else waits for room, or with
    /// `wait == false` fails with [`CoreError::Busy`].
    pub fn acquire(
        &self,
        e: EngineKind,
        s: &SessionState,
        bytes: u64,
        wait: bool,
        force: bool,
    ) -> Result<()> {
        let mut g = self.lock.lock_unpoisoned();
        if self.try_take(e, s, bytes) {
            return Ok(());
        }
        if force {
            self.engine[e as usize].take(bytes);
            s.in_flight.take(bytes);
            return Ok(());
        }
        if !wait {
            return Err(CoreError::Busy(format!(
                "{e} has {} in flight (limit {}), the session {} (limit {})",
                self.in_flight(e),
                self.engine_limit,
                s.in_flight.held(),
                s.limit
            )));
        }
        self.waiters.fetch_add(1, Ordering::SeqCst);
        while !self.try_take(e, s, bytes) {
            // Timed, so a release racing with our check cannot strand us.
            g = self
                .room
                .wait_timeout_unpoisoned(g, Duration::from_millis(5))
                .0;
        }
        drop(g);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }

    /// Admits a batch as a whole: every engine's share and the session's total at once, so a
    /// batch never waits for room that only its own, not yet queued, members would free. An
    /// idle budget admits anything, as for one request.
    pub fn acquire_all(
        &self,
        parts: &[(EngineKind, u64)],
        s: &SessionState,
        force: bool,
    ) -> Result<()> {
        let total: u64 = parts.iter().map(|(_, b)| b).sum();
        let fit = || {
            parts
                .iter()
                .all(|&(e, b)| self.engine[e as usize].admits(self.engine_limit, b))
                && s.in_flight.admits(s.limit, total)
        };
        let mut g = self.lock.lock_unpoisoned();
        if !force && !fit() {
            self.waiters.fetch_add(1, Ordering::SeqCst);
            while !fit() {
                g = self
                    .room
                    .wait_timeout_unpoisoned(g, Duration::from_millis(5))
                    .0;
            }
            self.waiters.fetch_sub(1, Ordering::SeqCst);
        }
        for &(e, b) in parts {
            self.engine[e as usize].take(b);
        }
        s.in_flight.take(total);
        drop(g);
        Ok(())
    }

    pub fn release(&self, e: EngineKind, s: &SessionState, bytes: u64) {
        self.engine[e as usize].release(bytes);
        s.in_flight.release(bytes);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock_unpoisoned();
            self.room.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Budget;

    /// The bound answers for the count: admissions past the limit are refused exactly when
    /// the count (not the stale bound) says so, and releases on other threads are seen once
    /// the bound runs out.
    #[test]
    fn the_bound_refuses_only_what_the_count_refuses() {
        let b = Budget::default();
        const LIMIT: u64 = 10 << 12;
        let mut admitted = 0u64;
        for _ in 0..10 {
            assert!(b.admits(LIMIT, 4096));
            b.take(4096);
            admitted += 4096;
        }
        assert!(!b.admits(LIMIT, 4096), "full: the count refuses too");
        // Released elsewhere: the bound does not know, the count does.
        std::thread::scope(|s| {
            s.spawn(|| (0..4).for_each(|_| b.release(4096)));
        });
        admitted -= 4 * 4096;
        for _ in 0..4 {
            assert!(b.admits(LIMIT, 4096), "room freed by the releases");
            b.take(4096);
            admitted += 4096;
        }
        assert_eq!(b.held(), admitted);
        assert!(!b.admits(LIMIT, 1));
        // An idle budget admits anything, a request larger than the limit included.
        std::thread::scope(|s| {
            s.spawn(|| b.release(admitted));
        });
        assert!(b.admits(LIMIT, LIMIT * 4));
    }
}
