//! Admission of connections that have not yet proven a key.
//!
//! Every accepted connection is admitted at once (nothing waits in the listen queue behind a
//! stranger), but strangers share a small budget of their own, `total` places. Sources are
//! counted at four levels of aggregation — an IPv4 /16, /20, /24 and address; an IPv6 /32,
//! /48, /56 and /64 (one host commonly holds a whole /64) — and a prefix may hold
//! `per_address` places per level below it and its own: an address `per_address`, its /24
//! twice that, and so on. A newcomer past a bound, or past the total, evicts one pending
//! handshake: within the finest prefix it overflows, or overall, the one whose prefixes hold
//! the most places, coarsest level first, and among those the one that has made the least
//! progress (a silent socket before one that has spoken), oldest first.
//!
//! A handshake that has made progress that costs its client a round trip — TLS completed, or
//! a HELLO received — is protected: it gives way only to a newcomer from a smaller prefix
//! than its own, and never within its own prefix (the newcomer is refused instead). So a
//! flood from many addresses evicts its own sockets, not a slow client elsewhere that is
//! getting through its handshake; no prefix, however many addresses it spans and however
//! many HELLOs it sends, holds more than its share; and progress cannot be bought by one
//! prefix to keep the others out.

use gpuio_hal::sync::MutexExt;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// Levels of aggregation a source is counted at, coarsest first.
const LEVELS: usize = 4;
/// Prefix lengths of each level, for IPv4 and IPv6.
const V4_BITS: [u8; LEVELS] = [16, 20, 24, 32];
const V6_BITS: [u8; LEVELS] = [32, 48, 56, 64];

/// How far a pending handshake has got, least first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Progress {
    /// Nothing received.
    Silent,
    /// Some bytes received (a TLS ClientHello, part of a HELLO).
    Spoke,
    /// TLS completed: protected until the deadline.
    Secured,
    /// A well-formed HELLO received: protected until the deadline.
    Hello,
}

impl Progress {
    fn protected(self) -> bool {
        self >= Self::Secured
    }
}

/// A source at one level: the level and the address with the bits past its prefix cleared
/// (IPv4 as an IPv4-mapped IPv6 address, so both families share one map).
type Prefix = (u8, u128);

/// The pending handshakes and their bounds.
pub(super) struct Gate {
    state: Mutex<State>,
    per_address: usize,
    total: usize,
}

#[derive(Default)]
struct State {
    next: u64,
    /// By ticket: oldest first.
    pending: BTreeMap<u64, Entry>,
    /// Places held under each prefix, at every level. Each entry shares its prefixes'
    /// counters, so that choosing whom to evict reads them without a lookup (only ever
    /// changed under the gate's lock).
    held: HashMap<Prefix, Arc<AtomicUsize>>,
    evicted: u64,
    refused: u64,
}

struct Entry {
    prefixes: [Prefix; LEVELS],
    counts: [Arc<AtomicUsize>; LEVELS],
    progress: Progress,
    evict: Arc<Notify>,
}

/// A connection's place among the pending handshakes; given back when dropped (the handshake
/// ended, one way or the other).
pub(super) struct Pending {
    gate: Arc<Gate>,
    ticket: u64,
    evict: Arc<Notify>,
}

impl Gate {
    pub(super) fn new(per_address: usize, total: usize) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            per_address: per_address.max(1),
            total: total.max(1),
        })
    }

    /// The most places the prefix at `level` may hold.
    fn bound(&self, level: usize) -> usize {
        self.per_address
            .saturating_mul(LEVELS - level)
            .min(self.total)
    }

    /// Admits a connection from `addr`, evicting a pending handshake where a bound is
    /// reached; `None` when every handshake that could give way is protected (the newcomer is
    /// refused).
    pub(super) fn admit(self: &Arc<Self>, addr: IpAddr) -> Option<Pending> {
        let prefixes = prefixes(addr);
        let mut s = self.state.lock_unpoisoned();
        // The finest prefix at its bound gives way within itself; that frees a place in
        // every coarser one too. Past the total, the whole gate gives way.
        let full = (0..LEVELS)
            .rev()
            .find(|&l| s.count(&prefixes[l]) >= self.bound(l));
        let room = match full {
            // Its own prefix at its bound gives way within itself, progressed places kept.
            Some(l) => s.evict(Some((l, prefixes[l])), false),
            None if s.pending.len() >= self.total => s.evict_for(&prefixes),
            None => true,
        };
        if !room {
            s.refused += 1;
            return None;
        }
        let ticket = s.next;
        s.next += 1;
        let evict = Arc::new(Notify::new());
        let counts = prefixes.map(|p| {
            let n = s.held.entry(p).or_default();
            n.fetch_add(1, Ordering::Relaxed);
            n.clone()
        });
        s.pending.insert(
            ticket,
            Entry {
                prefixes,
                counts,
                progress: Progress::Silent,
                evict: evict.clone(),
            },
        );
        Some(Pending {
            gate: self.clone(),
            ticket,
            evict,
        })
    }

    /// Pending handshakes closed to make room for newer ones, so far.
    pub(super) fn evicted(&self) -> u64 {
        self.state.lock_unpoisoned().evicted
    }

    /// Connections refused because every place that could give way was protected.
    pub(super) fn refused(&self) -> u64 {
        self.state.lock_unpoisoned().refused
    }

    /// Closes the pending handshake that would give way first, if one has made no progress
    /// that protects it (the process ran out of file descriptors: a stranger's socket gives
    /// way to the next connection). False if none could.
    pub(super) fn make_room(&self) -> bool {
        self.state.lock_unpoisoned().evict(None, false)
    }
}

/// `addr` at every level, coarsest first.
fn prefixes(addr: IpAddr) -> [Prefix; LEVELS] {
    let (bits, value) = match addr {
        IpAddr::V4(v4) => (V4_BITS, u128::from(v4.to_ipv6_mapped())),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => (V4_BITS, u128::from(v4.to_ipv6_mapped())),
            None => (V6_BITS, u128::from(v6)),
        },
    };
    // IPv4 prefixes count from bit 96 of the mapped form.
    let base = if bits == V4_BITS { 96 } else { 0 };
    std::array::from_fn(|l| {
        let keep = base + u32::from(bits[l]);
        let mask = u128::MAX.checked_shl(128 - keep).unwrap_or(0);
        (l as u8, value & mask)
    })
}

impl State {
    /// Places held under `prefix`.
    fn count(&self, prefix: &Prefix) -> usize {
        self.held
            .get(prefix)
            .map_or(0, |n| n.load(Ordering::Relaxed))
    }

    /// The handshake that gives way first among those under `within` (a level and its
    /// prefix; `None`: all), protected ones only if `protected` and after every other: its
    /// prefixes holding the most, coarsest level first; then not protected; the least
    /// progress; the oldest. Its ticket, its prefixes' places and whether it is protected.
    fn victim(
        &self,
        within: Option<(usize, Prefix)>,
        protected: bool,
    ) -> Option<(u64, [usize; LEVELS], bool)> {
        // A plain loop: it runs for every admission into a full gate.
        let mut best: Option<(u64, [usize; LEVELS], Progress)> = None;
        for (&ticket, e) in &self.pending {
            if within.is_some_and(|(l, p)| e.prefixes[l] != p)
                || (!protected && e.progress.protected())
            {
                continue;
            }
            let sizes = [
                e.counts[0].load(Ordering::Relaxed),
                e.counts[1].load(Ordering::Relaxed),
                e.counts[2].load(Ordering::Relaxed),
                e.counts[3].load(Ordering::Relaxed),
            ];
            let better = best.as_ref().is_none_or(|(t, s, p)| {
                sizes.cmp(s).then_with(|| {
                    // Not protected first, then the least progress, then the oldest.
                    (p.protected().cmp(&e.progress.protected()))
                        .then(p.cmp(&e.progress))
                        .then(t.cmp(&ticket))
                }) == std::cmp::Ordering::Greater
            });
            if better {
                best = Some((ticket, sizes, e.progress));
            }
        }
        best.map(|(ticket, sizes, progress)| (ticket, sizes, progress.protected()))
    }

    /// Evicts the handshake that gives way first under `within` (see [`Self::victim`]);
    /// false if none may.
    fn evict(&mut self, within: Option<(usize, Prefix)>, protected: bool) -> bool {
        match self.victim(within, protected) {
            Some((ticket, _, _)) => {
                self.evict_ticket(ticket);
                true
            }
            None => false,
        }
    }

    /// Makes room in a full gate for a newcomer from `newcomer`: the handshake of the largest
    /// prefixes gives way, progressed or not — unless the newcomer's own prefix would then be
    /// the largest, in which case it gives way within that prefix, progressed places kept. So
    /// no prefix holds more than its share by sending HELLOs, and protection only ever
    /// shields a place from a prefix no larger than its own.
    fn evict_for(&mut self, newcomer: &[Prefix; LEVELS]) -> bool {
        let Some((ticket, sizes, _)) = self.victim(None, true) else {
            return false;
        };
        let mine: [usize; LEVELS] = std::array::from_fn(|l| self.count(&newcomer[l]) + 1);
        if mine >= sizes {
            let level = (0..LEVELS)
                .find(|&l| mine[l] != sizes[l])
                .unwrap_or(LEVELS - 1);
            return self.evict(Some((level, newcomer[level])), false);
        }
        self.evict_ticket(ticket);
        true
    }

    /// Removes `ticket` and tells its connection to close.
    fn evict_ticket(&mut self, ticket: u64) {
        if let Some(e) = self.remove(ticket) {
            e.evict.notify_one();
            self.evicted += 1;
        }
    }

    fn remove(&mut self, ticket: u64) -> Option<Entry> {
        let e = self.pending.remove(&ticket)?;
        for (p, n) in e.prefixes.iter().zip(&e.counts) {
            if n.fetch_sub(1, Ordering::Relaxed) == 1 {
                self.held.remove(p);
            }
        }
        Some(e)
    }
}

impl Pending {
    /// Resolves when a newer connection took this one's place.
    pub(super) async fn evicted(&self) {
        self.evict.notified().await
    }

    /// Records how far the handshake has got (never backwards).
    pub(super) fn advance(&self, to: Progress) {
        let mut s = self.gate.state.lock_unpoisoned();
        if let Some(e) = s.pending.get_mut(&self.ticket) {
            e.progress = e.progress.max(to);
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.gate.state.lock_unpoisoned().remove(self.ticket);
    }
}

#[cfg(test)]
mod tests;
