//! Admission of connections that have not yet proven a key.
//!
//! Every accepted connection is admitted at once (nothing waits in the listen queue behind a
//! stranger), but strangers share a small budget of their own: at most `per_address` pending
//! handshakes per source (an IPv4 address, an IPv6 /64) and `total` altogether. A newcomer
//! past its source's bound evicts that source's oldest pending handshake; past the total, the
//! oldest of the source holding the most places gives way. An idle socket cannot hold a place
//! against a client that completes its handshake in a round trip, and a flood from a few
//! sources evicts its own sockets, not the handshakes of the sources it does not control.

use gpuio_hal::sync::MutexExt;
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// The pending handshakes and their bounds.
pub(super) struct Gate {
    state: Mutex<State>,
    per_address: usize,
    total: usize,
}

#[derive(Default)]
struct State {
    next: u64,
    /// Oldest first.
    pending: VecDeque<Entry>,
    per_address: HashMap<IpAddr, usize>,
    evicted: u64,
}

struct Entry {
    ticket: u64,
    addr: IpAddr,
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

    /// Admits a connection from `addr`, evicting a pending handshake where a bound is
    /// reached: the oldest of its own source, or past the total, the oldest of the source that
    /// holds the most.
    pub(super) fn admit(self: &Arc<Self>, addr: IpAddr) -> Pending {
        let addr = source(addr);
        let mut s = self.state.lock_unpoisoned();
        let mine = s.per_address.get(&addr).copied().unwrap_or(0);
        if mine >= self.per_address {
            s.evict_oldest_of(addr);
        } else if s.pending.len() >= self.total {
            s.evict_from_largest();
        }
        let ticket = s.next;
        s.next += 1;
        let evict = Arc::new(Notify::new());
        s.pending.push_back(Entry {
            ticket,
            addr,
            evict: evict.clone(),
        });
        *s.per_address.entry(addr).or_insert(0) += 1;
        Pending {
            gate: self.clone(),
            ticket,
            evict,
        }
    }

    /// Pending handshakes closed to make room for newer ones, so far.
    pub(super) fn evicted(&self) -> u64 {
        self.state.lock_unpoisoned().evicted
    }

    /// Closes a pending handshake of the source holding the most (the process ran out of file
    /// descriptors: a stranger's socket gives way to the next connection).
    pub(super) fn make_room(&self) {
        self.state.lock_unpoisoned().evict_from_largest();
    }
}

/// The source a connection is counted under: an IPv4 address, or an IPv6 /64 (one host
/// commonly holds a whole /64, so counting its addresses apart would bound nothing).
fn source(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut o = v6.octets();
                o[8..].fill(0);
                IpAddr::V6(o.into())
            }
        },
        v4 => v4,
    }
}

impl State {
    fn evict_oldest_of(&mut self, addr: IpAddr) {
        if let Some(i) = self.pending.iter().position(|e| e.addr == addr) {
            self.evict(i);
        }
    }

    /// Evicts the oldest pending handshake of the source holding the most places (the oldest
    /// overall among sources that hold as many).
    fn evict_from_largest(&mut self) {
        let most = self.per_address.values().copied().max().unwrap_or(0);
        if let Some(i) = self
            .pending
            .iter()
            .position(|e| self.per_address.get(&e.addr) == Some(&most))
        {
            self.evict(i);
        }
    }

    /// Removes entry `i` and tells its connection to close.
    fn evict(&mut self, i: usize) {
        if let Some(e) = self.remove(i) {
            e.evict.notify_one();
            self.evicted += 1;
        }
    }

    fn remove(&mut self, i: usize) -> Option<Entry> {
        let e = self.pending.remove(i)?;
        if let Some(n) = self.per_address.get_mut(&e.addr) {
            *n -= 1;
            if *n == 0 {
                self.per_address.remove(&e.addr);
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
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut s = self.gate.state.lock_unpoisoned();
        if let Some(i) = s.pending.iter().position(|e| e.ticket == self.ticket) {
            s.remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn the_oldest_gives_way_per_address_then_overall() {
        let gate = Gate::new(2, 3);
        let a1 = gate.admit(ip(1));
        let a2 = gate.admit(ip(1));
        // A third from the same address evicts its oldest, not another address's.
        let b1 = gate.admit(ip(2));
        let a3 = gate.admit(ip(1));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let evicted = |p: &Pending| {
            rt.block_on(async {
                tokio::time::timeout(std::time::Duration::from_millis(5), p.evicted())
                    .await
                    .is_ok()
            })
        };
        assert!(evicted(&a1));
        assert!(!evicted(&a2) && !evicted(&b1) && !evicted(&a3));
        // Past the total, the source holding the most (10.0.0.1, with a2 and a3) gives its
        // oldest; b1, older but alone from its source, stays.
        let c1 = gate.admit(ip(3));
        assert!(evicted(&a2));
        assert!(!evicted(&b1) && !evicted(&c1) && !evicted(&a3));
        assert_eq!(gate.evicted(), 2);
        // IPv6 addresses of one /64 are one source; a mapped IPv4 address is that address.
        assert_eq!(
            source("2001:db8::1".parse().unwrap()),
            source("2001:db8::ffff:2".parse().unwrap())
        );
        assert_ne!(
            source("2001:db8::1".parse().unwrap()),
            source("2001:db8:0:1::1".parse().unwrap())
        );
        assert_eq!(source("::ffff:10.0.0.1".parse().unwrap()), ip(1));
        // Places come back when handshakes end.
        drop((a1, a2, b1, a3, c1));
        let s = gate.state.lock().unwrap();
        assert!(s.pending.is_empty() && s.per_address.is_empty());
    }
}
