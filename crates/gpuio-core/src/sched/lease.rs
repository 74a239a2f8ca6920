//! Leases: IO that runs outside the workers — a device gather on the caller's thread, a
//! scatter or prefetch on a side thread — held in its priority class so that the classes
//! arbitrate it with the queued requests (docs/REFERENCE.md#scheduling).
//!
//! While a lease of class C is held (policies other than FIFO):
//! - a lease of a less urgent class waits to be admitted until no more urgent one is held;
//! - the workers start no queued unit of a less urgent class (those already taken run on);
//! - both go on waiting `lease_linger` after the more urgent class's last lease ends: it is
//!   likely to be back at once (a decode step's next layer), and should find the bus free;
//! - either waits at most `max_wait` (for a held-back class: it gets a unit at least that
//!   often, the starvation bound the queue keeps for classes).
//!
//! Leases do not nest: a thread holding one that takes a less urgent one waits `max_wait`
//! for itself.
//!
//! So a decode step's KV load (realtime) runs with the bus to itself but for what was already
//! running, an Engram prefetch (background) goes between decode steps, and a checkpoint's
//! chunks wait for both. Under FIFO (classes off) leases are only counted.

use super::Shared;
use super::queue::Policy;
use crate::request::Priority;
use gpuio_hal::sync::{CondvarExt, MutexExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Classes there are.
const CLASSES: usize = Priority::ALL.len();

/// No lease is held: the floor is below every class.
const NO_FLOOR: u8 = CLASSES as u8;

/// The leases held, per class, and the most urgent class among them.
pub(super) struct Gate {
    held: std::sync::Mutex<[usize; CLASSES]>,
    /// The most urgent class with a lease held (`NO_FLOOR` when none): read by the workers
    /// on every take from the queue.
    floor: FloorCell,
    /// The class whose last lease ended last and the end of its linger, microseconds from
    /// `epoch` (56 bits: millennia): `until << 8 | class`, or `NO_FLOOR` when none lingers.
    linger: AtomicU64,
    epoch: Instant,
    released: std::sync::Condvar,
    /// Acquirers waiting on `released` (changed only under `held`'s lock): a lease's end
    /// wakes them only if there are any, since a wake is a system call every time, a
    /// microsecond of every small call's wall time.
    waiting: AtomicUsize,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            held: Default::default(),
            floor: FloorCell::default(),
            linger: AtomicU64::new(u64::from(NO_FLOOR)),
            epoch: Instant::now(),
            released: Default::default(),
            waiting: AtomicUsize::new(0),
        }
    }
}

/// The floor, `NO_FLOOR` by default.
pub(super) struct FloorCell(AtomicU8);

impl Default for FloorCell {
    fn default() -> Self {
        Self(AtomicU8::new(NO_FLOOR))
    }
}

impl Gate {
    /// The most urgent class a lease holds now, if any: queued units of less urgent classes
    /// wait (unless they have waited `max_wait`).
    pub(super) fn floor(&self) -> Option<Priority> {
        let held = self.floor.0.load(Ordering::Acquire);
        let f = match self.lingering() {
            Some((class, _)) if class < held => class,
            _ => held,
        };
        Priority::from_index(f)
    }

    /// The class lingering now and the end of its linger (µs from `epoch`), if one does. The
    /// clock is read only while one is set; an expired one is cleared.
    fn lingering(&self) -> Option<(u8, u64)> {
        let word = self.linger.load(Ordering::Acquire);
        let class = (word & 0xff) as u8;
        if class >= NO_FLOOR {
            return None;
        }
        let until = word >> 8;
        if self.now_us() < until {
            return Some((class, until));
        }
        // Unless a newer linger was set meanwhile.
        let _ = self.linger.compare_exchange(
            word,
            u64::from(NO_FLOOR),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
        None
    }

    /// Class `class` just had its last lease end: it lingers for `linger`, unless a more
    /// urgent class lingers already.
    fn linger_after(&self, class: u8, linger: Duration) {
        if linger.is_zero() || self.lingering().is_some_and(|(c, _)| c < class) {
            return;
        }
        let until = self.now_us().saturating_add(linger.as_micros() as u64);
        self.linger
            .store(until << 8 | u64::from(class), Ordering::Release);
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Until when a lease of class `c` waits for more urgent classes (given `held`): while
    /// one is held, `limit`; while one lingers, the end of its linger; `None`: it may go.
    fn hold_until(&self, held: &[usize; CLASSES], c: usize, limit: Instant) -> Option<Instant> {
        if held[..c].iter().any(|&n| n > 0) {
            return Some(limit);
        }
        let (_, until) = self.lingering().filter(|&(k, _)| usize::from(k) < c)?;
        Some((self.epoch + Duration::from_micros(until)).min(limit))
    }

    fn set_floor(&self, held: &[usize; CLASSES]) -> u8 {
        let f = held
            .iter()
            .position(|&n| n > 0)
            .map_or(NO_FLOOR, |i| i as u8);
        self.floor.0.store(f, Ordering::Release);
        f
    }
}

/// IO of one class running outside the workers: while it is held, less urgent leases and
/// queued units wait (bounded by `max_wait`). Dropping it ends it; a deadline it was given
/// counts as met or missed then, in the scheduler's statistics.
#[must_use = "the lease ends when it is dropped"]
pub struct Lease {
    shared: Arc<Shared>,
    class: Priority,
    deadline: Option<Instant>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("class", &self.class)
            .field("deadline", &self.deadline)
            .finish()
    }
}

/// What leases are taken from: a cheap handle on a scheduler, kept by structures that do IO
/// outside it (the AI tier's pools and tables) without holding a session.
#[derive(Clone)]
pub struct Lessor {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Lessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lessor").finish_non_exhaustive()
    }
}

impl Lessor {
    pub(super) fn new(shared: &Arc<Shared>) -> Self {
        Self {
            shared: shared.clone(),
        }
    }

    /// Holds `class` ([`super::SchedSession::lease`]).
    pub fn lease(&self, class: Priority, deadline: Option<Instant>) -> Lease {
        Lease::acquire(&self.shared, class, deadline)
    }
}

impl Lease {
    /// Waits for admission (no more urgent lease held, or `max_wait` passed), then holds
    /// `class`.
    pub(super) fn acquire(
        shared: &Arc<Shared>,
        class: Priority,
        deadline: Option<Instant>,
    ) -> Self {
        let gate = &shared.gate;
        let c = class as usize;
        let mut held = gate.held.lock_unpoisoned();
        if shared.cfg.policy != Policy::Fifo {
            let limit = Instant::now() + shared.cfg.max_wait;
            loop {
                let now = Instant::now();
                match gate.hold_until(&held, c, limit) {
                    Some(t) if t > now => {
                        gate.waiting.fetch_add(1, Ordering::Relaxed);
                        held = gate.released.wait_timeout_unpoisoned(held, t - now).0;
                        gate.waiting.fetch_sub(1, Ordering::Relaxed);
                    }
                    _ => break,
                }
            }
        }
        held[c] += 1;
        // Under FIFO (classes off) nothing is held back: the floor stays unset.
        if shared.cfg.policy != Policy::Fifo {
            gate.set_floor(&held);
        }
        Self {
            shared: shared.clone(),
            class,
            deadline,
        }
    }

    /// Its class.
    pub fn class(&self) -> Priority {
        self.class
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let sh = &self.shared;
        if let Some(d) = self.deadline {
            let c = &sh.acct.counters;
            if Instant::now() > d {
                c.deadline_missed.add(1);
            } else {
                c.deadline_met.add(1);
            }
        }
        let (before, after, wake) = {
            let mut held = sh.gate.held.lock_unpoisoned();
            let c = self.class as usize;
            held[c] -= 1;
            if sh.cfg.policy == Policy::Fifo {
                return;
            }
            if held[c] == 0 {
                sh.gate.linger_after(c as u8, sh.cfg.lease_linger);
            }
            (
                sh.gate.floor.0.load(Ordering::Acquire),
                sh.gate.set_floor(&held),
                // Read under the lock: an acquirer that starts waiting after it is let go
                // sees the counts above first.
                sh.gate.waiting.load(Ordering::Relaxed) > 0,
            )
        };
        if wake {
            sh.gate.released.notify_all();
        }
        // The floor's store must be seen before the counts are read: a worker that counted
        // nothing eligible and went to sleep is then woken here.
        std::sync::atomic::fence(Ordering::SeqCst);
        if after > before
            && sh.queued.load(Ordering::Acquire) > 0
            && sh.sleepers.load(Ordering::Acquire) > 0
        {
            // Units the floor held back may run now, or once the linger ends: wake the
            // workers that slept on them (they spin through a short linger).
            let _st = sh.state.lock_unpoisoned();
            sh.work.notify_all();
        }
    }
}
