//! How much host memory the machine can back now: a mapping larger than that would only be
//! met by the OOM killer once its pages are touched (host memory is mapped without reserving
//! swap), so allocations past it are refused up front with a typed error instead.
//!
//! The figure read (`MemAvailable`, free swap, cgroup room) only counts pages already taken,
//! so this process also keeps a reservation of the host memory it has admitted but not yet
//! touched: each allocation is judged against the figure less what is reserved, and adds its
//! own length in the same atomic step (`reserve`), so two threads allocating at once, or
//! several lazily touched buffers, cannot each pass against the same free memory. A
//! `Reservation` gives its bytes back when dropped: a buffer populated at allocation drops
//! it once its pages are in (the figure counts them from then on), a lazily touched one holds
//! it until it is dropped itself.

use crate::error::{HalError, Result};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Allocations from this size up are checked (smaller ones cannot be the problem, and the
/// check reads a few files); smaller ones are still reserved, unchecked.
const CHECKED_FROM: usize = 64 << 20;

/// Host memory this process has admitted but whose pages the figure may not count yet.
#[derive(Debug)]
pub(crate) struct Ledger {
    reserved: AtomicU64,
}

/// The process's ledger.
static LEDGER: Ledger = Ledger::new();

impl Ledger {
    const fn new() -> Self {
        Self {
            reserved: AtomicU64::new(0),
        }
    }

    /// Reserves `len` bytes if, with what is already reserved, they fit in `available` (read
    /// once, only for lengths that are checked; `None`: nothing to judge by, so admitted).
    fn reserve(
        &'static self,
        len: usize,
        available: impl FnOnce() -> Option<u64>,
    ) -> Result<Reservation> {
        let bytes = len as u64;
        let figure = if len < CHECKED_FROM {
            None
        } else {
            available()
        };
        match figure {
            None => {
                self.reserved.fetch_add(bytes, Ordering::AcqRel);
            }
            Some(available) => {
                // A reservation made between the load and the exchange fails the exchange,
                // and the length is judged again with it counted.
                let mut reserved = self.reserved.load(Ordering::Acquire);
                loop {
                    let total = admit(len, reserved, available).inspect_err(|_| {
                        tracing::debug!(
                            len,
                            reserved,
                            available,
                            "host memory refused: reserved and asked exceed what can be backed"
                        );
                    })?;
                    match self.reserved.compare_exchange_weak(
                        reserved,
                        total,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => break,
                        Err(now) => reserved = now,
                    }
                }
            }
        }
        Ok(Reservation {
            ledger: self,
            bytes,
        })
    }

    /// Bytes reserved now.
    #[cfg(test)]
    pub(in crate::memory) fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Acquire)
    }
}

/// Host memory admitted by [`reserve`] and counted against later allocations until dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    ledger: &'static Ledger,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.ledger.reserved.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

/// The decision: `len` bytes fit where, with the `reserved` bytes already admitted, they do
/// not exceed `available`. Gives the new reserved total. The refusal names what is left
/// (`available` less `reserved`) as what the machine can back.
fn admit(len: usize, reserved: u64, available: u64) -> Result<u64> {
    let total = reserved.saturating_add(len as u64);
    if total > available {
        Err(HalError::HostMemoryExceeded {
            len,
            available: available.saturating_sub(reserved),
            reserved,
        })
    } else {
        Ok(total)
    }
}

/// Reserves `len` bytes of host memory, refusing them where the machine cannot back them
/// now beside what this process has already reserved; `swappable` says whether swap may back
/// them (not for memory that will be pinned). Drop the reservation once the pages are
/// touched, or when the memory is freed.
pub(crate) fn reserve(len: usize, swappable: bool) -> Result<Reservation> {
    #[cfg(test)]
    if let Some((ledger, figure)) = test_figure::get() {
        return ledger.reserve(len, || Some(figure));
    }
    LEDGER.reserve(len, || backable_bytes(swappable))
}

/// Refuses `len` bytes of host memory where the machine cannot back them now, beside what
/// this process has reserved; for memory populated right after (it reserves nothing).
pub fn check(len: usize, swappable: bool) -> Result<()> {
    reserve(len, swappable).map(drop)
}

/// A figure and a ledger of the test's own, for this thread's allocations.
#[cfg(test)]
pub(crate) mod test_figure {
    use super::Ledger;
    use std::cell::Cell;

    thread_local! {
        static FIGURE: Cell<Option<(&'static Ledger, u64)>> = const { Cell::new(None) };
    }

    pub(in crate::memory) fn get() -> Option<(&'static Ledger, u64)> {
        FIGURE.with(Cell::get)
    }

    /// Runs `f` with this thread's allocations judged against `figure` bytes and reserved in
    /// a fresh ledger (leaked: a few bytes a test), which `f` is given to read.
    pub(in crate::memory) fn with<T>(figure: u64, f: impl FnOnce(&'static Ledger) -> T) -> T {
        let ledger: &'static Ledger = Box::leak(Box::new(Ledger::new()));
        let before = FIGURE.with(|c| c.replace(Some((ledger, figure))));
        struct Restore(Option<(&'static Ledger, u64)>);
        impl Drop for Restore {
            fn drop(&mut self) {
                FIGURE.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(before);
        f(ledger)
    }
}

/// Bytes of host memory the machine can back now: available RAM (plus free swap where
/// `swappable`), from `/proc/meminfo`, within what this process's memory cgroup and each of
/// its ancestors (v2 or v1) have left. `None` where none of it can be read.
pub fn backable_bytes(swappable: bool) -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let machine = meminfo.as_deref().and_then(|m| {
        let available = meminfo_kib(m, "MemAvailable:")?;
        let swap = if swappable {
            meminfo_kib(m, "SwapFree:").unwrap_or(0)
        } else {
            0
        };
        Some((available + swap) * 1024)
    });
    match (machine, cgroup_room()) {
        (Some(m), Some(c)) => Some(m.min(c)),
        (m, c) => m.or(c),
    }
}

fn meminfo_kib(meminfo: &str, field: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(field))?;
    line[field.len()..].split_whitespace().next()?.parse().ok()
}

/// The least any memory cgroup from this process's up to the root has left below its limit
/// (`None`: no limit anywhere, or none readable). A limit on a parent (a job, a pod, a slice)
/// binds as much as one on the process's own.
fn cgroup_room() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut least: Option<u64> = None;
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (base, limit, usage) = if id == "0" && controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                "/sys/fs/cgroup/memory",
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        // The process's group and each ancestor. In a cgroup namespace the process's own
        // group is mounted at the base, and its path is not found below it.
        let mut dir = Path::new(base).join(path.trim_start_matches('/'));
        loop {
            if let Some(room) = limit_minus_usage(&dir, limit, usage) {
                least = Some(least.map_or(room, |l| l.min(room)));
            }
            if dir == Path::new(base) || !dir.pop() {
                break;
            }
        }
    }
    least
}

/// The room under the limit of the group at `dir` (`None`: no limit, or not readable).
fn limit_minus_usage(dir: &Path, limit: &str, usage: &str) -> Option<u64> {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    // "max" (v2) or a page-rounded i64::MAX (v1): no limit.
    let l = read(limit)?.trim().parse::<u64>().ok()?;
    if l >= 1 << 62 {
        return None;
    }
    Some(l.saturating_sub(read(usage)?.trim().parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_can_back_something_and_not_everything() {
        let n = backable_bytes(true).expect("/proc/meminfo is readable on Linux");
        assert!(n > 0);
        // Without swap no more than with it; the two reads are moments apart on a machine
        // whose free memory moves (a build beside the tests), so within a GiB of churn.
        assert!(backable_bytes(false).unwrap() <= n + (1 << 30));
        assert!(check(1 << 20, true).is_ok());
        let err = check(usize::MAX / 4, false).unwrap_err();
        assert!(matches!(err, HalError::HostMemoryExceeded { .. }), "{err}");
        assert_eq!(err.code(), crate::ErrorCode::NoMem);
        assert_eq!(
            meminfo_kib("MemAvailable:   24124572 kB\n", "MemAvailable:"),
            Some(24124572)
        );
    }

    #[test]
    fn a_second_reservation_is_judged_with_the_first() {
        let gib = 1u64 << 30;
        // Each alone fits in 10 GiB; together they do not.
        let first = admit(6 << 30, 0, 10 * gib).unwrap();
        assert_eq!(first, 6 * gib);
        assert!(admit(6 << 30, 0, 10 * gib).is_ok());
        let err = admit(6 << 30, first, 10 * gib).unwrap_err();
        match err {
            HalError::HostMemoryExceeded {
                len,
                available,
                reserved,
            } => {
                assert_eq!(reserved, 6 * gib);
                assert_eq!(len, 6 << 30);
                assert_eq!(available, 4 * gib, "what is left beside the reservation");
            }
            other => panic!("{other}"),
        }
        assert_eq!(err.code(), crate::ErrorCode::NoMem);
        // Exactly full fits; reserved past the figure (it fell meanwhile) leaves nothing.
        assert_eq!(admit(4 << 30, first, 10 * gib).unwrap(), 10 * gib);
        assert!(matches!(
            admit(CHECKED_FROM, 11 * gib, 10 * gib),
            Err(HalError::HostMemoryExceeded { available: 0, .. })
        ));
    }

    #[test]
    fn a_dropped_reservation_gives_its_bytes_back() {
        let ledger: &'static Ledger = Box::leak(Box::new(Ledger::new()));
        let figure = || Some(3 * CHECKED_FROM as u64);
        let a = ledger.reserve(2 * CHECKED_FROM, figure).unwrap();
        assert_eq!(ledger.reserved(), 2 * CHECKED_FROM as u64);
        assert!(ledger.reserve(2 * CHECKED_FROM, figure).is_err());
        assert_eq!(
            ledger.reserved(),
            2 * CHECKED_FROM as u64,
            "a refusal reserves nothing"
        );
        // Small lengths are reserved without reading the figure.
        let small = ledger.reserve(4096, || panic!("not read")).unwrap();
        assert_eq!(ledger.reserved(), 2 * CHECKED_FROM as u64 + 4096);
        drop(small);
        drop(a);
        assert_eq!(ledger.reserved(), 0);
        let b = ledger.reserve(2 * CHECKED_FROM, figure).unwrap();
        assert_eq!(ledger.reserved(), 2 * CHECKED_FROM as u64);
        drop(b);
        // No figure to judge by: admitted, and still counted.
        let c = ledger.reserve(8 * CHECKED_FROM, || None).unwrap();
        assert_eq!(ledger.reserved(), 8 * CHECKED_FROM as u64);
        drop(c);
        assert_eq!(ledger.reserved(), 0);
    }

    #[test]
    fn threads_reserving_at_once_never_oversubscribe() {
        let ledger: &'static Ledger = Box::leak(Box::new(Ledger::new()));
        let fits = 5;
        let figure = fits * CHECKED_FROM as u64;
        let threads = 16;
        let barrier = std::sync::Barrier::new(threads);
        let admitted: Vec<Reservation> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        ledger.reserve(CHECKED_FROM, || Some(figure)).ok()
                    })
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().unwrap())
                .collect()
        });
        assert_eq!(admitted.len() as u64, fits);
        assert_eq!(ledger.reserved(), figure);
        drop(admitted);
        assert_eq!(ledger.reserved(), 0);
    }
}
