//! Session places, shared fairly among keys.
//!
//! The agent serves at most `total` sessions, and one key at most `per_key`. Below the total
//! a session is admitted at once. At the total, a key holding fewer than its fair share (the
//! total divided among the keys holding sessions, the newcomer's included) takes a place from
//! the key most over its share: that key's session idle the longest is closed (between
//! requests, so nothing acknowledged is lost) and its place handed over. When every session
//! of the keys over their share is busy, the newcomer waits — within its handshake's deadline
//! — for one to go idle. A key at or over its share is refused `Busy`: no one owes it a place.
//! So a keep-alive cannot hold a place against a key that waits, and no key can hold more
//! than its share while another key asks for one.

use gpuio_hal::sync::MutexExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;

/// The agent's session places.
pub(super) struct Slots {
    state: Mutex<State>,
    /// Told whenever a session goes idle or a place is given back.
    changed: Notify,
    total: usize,
    per_key: usize,
}

#[derive(Default)]
struct State {
    next: u64,
    /// Sessions by key, then by number.
    keys: HashMap<String, BTreeMap<u64, Session>>,
    held: usize,
    preempted: u64,
}

struct Session {
    /// Since when it waits for its next request (`None`: serving one).
    idle_since: Option<Instant>,
    close: Arc<Notify>,
}

/// Why a key gets no place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoSlot {
    /// The key holds its maximum.
    KeyFull,
    /// The agent holds its maximum, and the key its fair share (or more).
    Full,
}

/// A session's place; given back when dropped.
pub(super) struct Slot {
    slots: Arc<Slots>,
    key: String,
    id: u64,
    close: Arc<Notify>,
}

/// What one attempt found.
enum Attempt {
    Taken(Slot),
    Refused(NoSlot),
    /// The key is owed a place, but every session that could give one is busy.
    Wait,
}

impl Slots {
    pub(super) fn new(total: usize, per_key: usize) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            total: total.max(1),
            per_key: per_key.max(1),
        })
    }

    /// A place for a session of `key`, waiting until `deadline` for a session of a key over
    /// its share to go idle where that is what it takes.
    pub(super) async fn take(
        self: &Arc<Self>,
        key: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Slot, NoSlot> {
        loop {
            // Registered before looking, so a change in between is not missed.
            let changed = self.changed.notified();
            match self.try_take(key) {
                Attempt::Taken(slot) => return Ok(slot),
                Attempt::Refused(why) => return Err(why),
                Attempt::Wait => {
                    if tokio::time::timeout_at(deadline, changed).await.is_err() {
                        return Err(NoSlot::Full);
                    }
                }
            }
        }
    }

    fn try_take(self: &Arc<Self>, key: &str) -> Attempt {
        let mut s = self.state.lock_unpoisoned();
        let mine = s.keys.get(key).map_or(0, BTreeMap::len);
        if mine >= self.per_key {
            return Attempt::Refused(NoSlot::KeyFull);
        }
        if s.held >= self.total {
            let holders = s.keys.len() + usize::from(mine == 0);
            let share = (self.total / holders).max(1);
            if mine >= share {
                return Attempt::Refused(NoSlot::Full);
            }
            // Of the keys over their share, the one holding the most gives up its session
            // idle the longest.
            let mut over_share = false;
            let victim = s
                .keys
                .iter()
                .filter(|(_, sessions)| sessions.len() > share)
                .inspect(|_| over_share = true)
                .filter_map(|(k, sessions)| {
                    let (since, id) = sessions
                        .iter()
                        .filter_map(|(id, sess)| Some((sess.idle_since?, *id)))
                        .min()?;
                    Some((sessions.len(), std::cmp::Reverse(since), k.clone(), id))
                })
                .max();
            let Some((_, _, over, id)) = victim else {
                // Over-share keys whose sessions are all busy: one goes idle soon. Everyone
                // within their share: places free up only as sessions end.
                return if over_share {
                    Attempt::Wait
                } else {
                    Attempt::Refused(NoSlot::Full)
                };
            };
            if let Some(sessions) = s.keys.get_mut(&over) {
                if let Some(sess) = sessions.remove(&id) {
                    sess.close.notify_one();
                }
                if sessions.is_empty() {
                    s.keys.remove(&over);
                }
            }
            s.held -= 1;
            s.preempted += 1;
        }
        let id = s.next;
        s.next += 1;
        let close = Arc::new(Notify::new());
        s.keys.entry(key.to_string()).or_default().insert(
            id,
            Session {
                idle_since: None,
                close: close.clone(),
            },
        );
        s.held += 1;
        Attempt::Taken(Slot {
            slots: self.clone(),
            key: key.to_string(),
            id,
            close,
        })
    }

    /// Idle sessions closed to give their places to keys below their share, so far.
    pub(super) fn preempted(&self) -> u64 {
        self.state.lock_unpoisoned().preempted
    }
}

impl Slot {
    /// Marks the session idle (waiting for its next request) or busy. False when busy is
    /// asked of a session whose place was already handed over: it must close.
    pub(super) fn set_idle(&self, idle: bool) -> bool {
        let mut s = self.slots.state.lock_unpoisoned();
        let Some(sess) = s.keys.get_mut(&self.key).and_then(|m| m.get_mut(&self.id)) else {
            return false;
        };
        sess.idle_since = idle.then(Instant::now);
        drop(s);
        if idle {
            self.slots.changed.notify_waiters();
        }
        true
    }

    /// Resolves when the session's place was handed to another key: close it.
    pub(super) async fn preempted(&self) {
        self.close.notified().await
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.slots.state.lock_unpoisoned();
        let Some(sessions) = s.keys.get_mut(&self.key) else {
            return;
        };
        if sessions.remove(&self.id).is_none() {
            // Handed over already: its place was counted out then.
            return;
        }
        if sessions.is_empty() {
            s.keys.remove(&self.key);
        }
        s.held -= 1;
        drop(s);
        self.slots.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    fn soon() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_millis(50)
    }

    #[test]
    fn a_new_key_takes_an_idle_place_from_the_key_most_over_its_share() {
        let rt = rt();
        let slots = Slots::new(4, 4);
        let a: Vec<Slot> = (0..4)
            .map(|_| rt.block_on(slots.take("a", soon())).unwrap())
            .collect();
        // Every session of "a" is busy: "b" waits, then is refused at its deadline.
        assert_eq!(
            rt.block_on(slots.take("b", soon())).err(),
            Some(NoSlot::Full)
        );
        // A keep-alive's session is idle between requests: it gives its place.
        a[2].set_idle(true);
        a[1].set_idle(true);
        let b1 = rt.block_on(slots.take("b", soon())).unwrap();
        let closed = |s: &Slot| {
            rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(2), s.preempted())
                    .await
                    .is_ok()
            })
        };
        // The longest idle went.
        assert!(closed(&a[2]) && !closed(&a[1]) && !closed(&a[0]));
        assert!(!a[2].set_idle(false), "a handed-over place must close");
        // "b" takes up to its share (2 of 4), not more.
        let _b2 = rt.block_on(slots.take("b", soon())).unwrap();
        assert!(closed(&a[1]));
        a[0].set_idle(true);
        assert_eq!(
            rt.block_on(slots.take("b", soon())).err(),
            Some(NoSlot::Full)
        );
        assert_eq!(slots.preempted(), 2);
        // A third key's share is 4/3 = 1: "a" (2) is over it, "b" (2) too.
        let _c = rt.block_on(slots.take("c", soon())).unwrap();
        assert!(closed(&a[0]));
        drop(b1);
        let s = slots.state.lock().unwrap();
        assert_eq!(s.held, 3);
    }

    #[test]
    fn a_waiting_key_gets_the_place_when_a_session_goes_idle() {
        let rt = rt();
        let slots = Slots::new(2, 2);
        let a: Vec<Slot> = (0..2)
            .map(|_| rt.block_on(slots.take("a", soon())).unwrap())
            .collect();
        let waiter = {
            let slots = slots.clone();
            rt.spawn(async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
                slots.take("b", deadline).await.map(|_| ())
            })
        };
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(20)).await });
        a[0].set_idle(true);
        assert_eq!(rt.block_on(waiter).unwrap(), Ok(()));
    }

    #[test]
    fn a_key_at_its_own_bound_is_refused_at_once() {
        let rt = rt();
        let slots = Slots::new(8, 2);
        let _a = [
            rt.block_on(slots.take("a", soon())).unwrap(),
            rt.block_on(slots.take("a", soon())).unwrap(),
        ];
        assert_eq!(
            rt.block_on(slots.take("a", soon())).err(),
            Some(NoSlot::KeyFull)
        );
    }
}
