//! Request buffers: where a request's bytes wait between the socket and an export that cannot
//! take them in place (a write received whole before it is applied, a piece of a file or GPU
//! read, a TLS answer).
//!
//! Buffers are counted in units of [`BUFFER_UNIT`] bytes against the agent's
//! `buffer_memory`, shared among the keys that hold buffers or wait for them: a key may take
//! its part of the whole (the whole divided among them, the asking key included), and always
//! one request's worth; a key holding more than its part while another waits gives its
//! sessions' buffers back between requests. So no key's sessions can keep everyone else's
//! room, however few keys there are or however busy they stay.
//! Buffers are mapped memory (not the heap): what is given back leaves the process at once, so
//! its resident memory follows the budget.

use gpuio_hal::sync::MutexExt;
use gpuio_hal::{HalError, HostAllocOptions, HostBuffer};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// The grain in which request buffers are counted.
pub(super) const BUFFER_UNIT: usize = 1 << 20;

/// The agent's buffer memory and what each key holds of it.
pub(super) struct Budget {
    /// Units not taken (FIFO among waiters).
    free: Arc<Semaphore>,
    units: usize,
    shares: Mutex<Shares>,
    /// Told whenever a key gives units back or stops waiting.
    changed: Notify,
}

/// Who holds and who waits.
#[derive(Default)]
struct Shares {
    /// Units each key holds or is about to take.
    held: HashMap<Arc<str>, usize>,
    /// Requests of each key waiting for room.
    waiting: HashMap<Arc<str>, usize>,
}

impl Shares {
    /// `key`'s part of `units`: divided among the keys holding or waiting, `key` included.
    fn part(&self, units: usize, key: &Arc<str>) -> usize {
        let others = self
            .held
            .keys()
            .chain(self.waiting.keys().filter(|k| !self.held.contains_key(*k)))
            .filter(|k| *k != key)
            .count();
        units / (others + 1)
    }
}

impl Budget {
    pub(super) fn new(bytes: usize) -> Arc<Self> {
        let units = (bytes / BUFFER_UNIT).max(1);
        Arc::new(Self {
            free: Arc::new(Semaphore::new(units)),
            units,
            shares: Mutex::new(Shares::default()),
            changed: Notify::new(),
        })
    }

    /// Whether `key` holds more than its part while another key waits: its sessions then
    /// give their buffers back between requests, so that no key keeps the room it took
    /// while it was alone.
    fn over_part(&self, key: &Arc<str>) -> bool {
        let s = self.shares.lock_unpoisoned();
        s.waiting.keys().any(|k| k != key)
            && s.held.get(key).copied().unwrap_or(0) > s.part(self.units, key)
    }

    /// Takes `units` for `key`: first within the key's part (waiting for its own sessions or
    /// other keys to give back), then from what is free. Other keys see it waiting
    /// throughout.
    async fn take(self: &Arc<Self>, key: &Arc<str>, units: usize) -> Room {
        let _waiting = Waiting::new(self, key);
        loop {
            // Created before looking: a release in between still wakes it.
            let changed = self.changed.notified();
            {
                let mut s = self.shares.lock_unpoisoned();
                let mine = s.held.get(key).copied().unwrap_or(0);
                if mine + units <= s.part(self.units, key).max(units) {
                    *s.held.entry(key.clone()).or_insert(0) += units;
                    break;
                }
            }
            changed.await;
        }
        // Counted for the key from here: given back if this wait is abandoned.
        let mut room = Room {
            budget: self.clone(),
            key: key.clone(),
            units,
            permit: None,
        };
        // Never closed, so this only waits; `units` never exceeds the whole (one request's
        // worth fits, as the configuration check ensures).
        room.permit = self
            .free
            .clone()
            .acquire_many_owned(units.min(self.units) as u32)
            .await
            .ok();
        room
    }

    /// Units held by every key together (for tests).
    #[cfg(test)]
    fn taken(&self) -> usize {
        self.units - self.free.available_permits()
    }
}

/// A request of `key` waiting for room, for as long as it lives.
struct Waiting<'a> {
    budget: &'a Budget,
    key: &'a Arc<str>,
}

impl<'a> Waiting<'a> {
    fn new(budget: &'a Budget, key: &'a Arc<str>) -> Self {
        *budget
            .shares
            .lock_unpoisoned()
            .waiting
            .entry(key.clone())
            .or_insert(0) += 1;
        Self { budget, key }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut s = self.budget.shares.lock_unpoisoned();
        if let Some(n) = s.waiting.get_mut(self.key) {
            *n -= 1;
            if *n == 0 {
                s.waiting.remove(self.key);
            }
        }
        drop(s);
        // One key fewer to share among: the others' parts grow.
        self.budget.changed.notify_waiters();
    }
}

/// Units taken from the budget, given back when dropped.
struct Room {
    budget: Arc<Budget>,
    key: Arc<str>,
    units: usize,
    permit: Option<OwnedSemaphorePermit>,
}

impl Drop for Room {
    fn drop(&mut self) {
        let mut s = self.budget.shares.lock_unpoisoned();
        if let Some(n) = s.held.get_mut(&self.key) {
            *n = n.saturating_sub(self.units);
            if *n == 0 {
                s.held.remove(&self.key);
            }
        }
        drop(s);
        self.budget.changed.notify_waiters();
    }
}

/// A session's buffer: it grows (waiting for room) to the largest request, and is given back
/// whole when the session goes idle.
pub(super) struct Buffer {
    bytes: Option<HostBuffer>,
    len: usize,
    room: Option<Room>,
    budget: Arc<Budget>,
    key: Arc<str>,
}

/// A buffer lent to a blocking thread with its room: if the request is abandoned (timed out)
/// while the thread still works, the room goes back only when the thread is done with it.
pub(super) struct Lent {
    bytes: Option<HostBuffer>,
    len: usize,
    room: Option<Room>,
}

impl Lent {
    /// The bytes lent.
    pub(super) fn bytes(&mut self) -> &mut [u8] {
        first(&mut self.bytes, self.len)
    }
}

/// The first `len` bytes of a buffer (none where there is no buffer).
fn first(bytes: &mut Option<HostBuffer>, len: usize) -> &mut [u8] {
    match bytes {
        Some(b) => &mut b.as_mut_slice()[..len],
        None => &mut [],
    }
}

impl Buffer {
    pub(super) fn new(budget: Arc<Budget>, key: Arc<str>) -> Self {
        Self {
            bytes: None,
            len: 0,
            room: None,
            budget,
            key,
        }
    }

    /// The buffer, `len` bytes long (room for it taken first, and taken again where the key
    /// holds more than its part while another key waits). Its bytes are whatever an earlier
    /// request left, or zeros. Fails where the memory cannot be mapped.
    pub(super) async fn get(&mut self, len: usize) -> Result<&mut [u8], HalError> {
        let units = len.div_ceil(BUFFER_UNIT);
        let held = self.room.as_ref().map_or(0, |r| r.units);
        let yield_room = held > 0 && self.budget.over_part(&self.key);
        if units > held || self.bytes.is_none() && len > 0 || yield_room {
            // Give back what is held before waiting for the whole: no session holds room
            // while it waits, so sessions never wait on each other in a cycle.
            self.release();
            let room = self.budget.take(&self.key, units).await;
            // No huge pages: buffers come and go with requests, and a huge page fault may
            // stall on compaction where small pages would not.
            let opts = HostAllocOptions {
                huge_pages: false,
                ..HostAllocOptions::default()
            };
            self.bytes = Some(HostBuffer::alloc(units * BUFFER_UNIT, &opts)?);
            self.room = Some(room);
        }
        self.len = len;
        Ok(self.held())
    }

    /// The bytes the last [`get`](Self::get) or [`lend`](Self::lend) asked for, as they are:
    /// what a request put there (never taken again from the budget, so never lost).
    pub(super) fn held(&mut self) -> &mut [u8] {
        first(&mut self.bytes, self.len)
    }

    /// Lends the bytes, `len` long, and their room to a blocking thread.
    pub(super) async fn lend(&mut self, len: usize) -> Result<Lent, HalError> {
        self.get(len).await?;
        Ok(Lent {
            bytes: self.bytes.take(),
            len,
            room: self.room.take(),
        })
    }

    /// Lends what the buffer holds (see [`held`](Self::held)) and its room, as it is.
    pub(super) fn lend_held(&mut self) -> Lent {
        Lent {
            bytes: self.bytes.take(),
            len: self.len,
            room: self.room.take(),
        }
    }

    /// Takes back what [`lend`](Self::lend) lent.
    pub(super) fn restore(&mut self, lent: Lent) {
        self.bytes = lent.bytes;
        self.len = lent.len;
        self.room = lent.room;
    }

    /// Gives the memory and its room back.
    pub(super) fn release(&mut self) {
        self.bytes = None;
        self.len = 0;
        self.room = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn each_key_holds_its_part_of_the_whole_and_one_request_at_least() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let budget = Budget::new(8 * BUFFER_UNIT);
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        let soon = |f| {
            rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(20), f)
                    .await
                    .ok()
            })
        };
        // Alone, a key may take the whole.
        let a1 = soon(budget.take(&a, 6)).unwrap();
        let a2 = soon(budget.take(&a, 2)).unwrap();
        assert_eq!(budget.taken(), 8);
        drop(a2);
        // With a second key asking, each part is half: "b" gets its 4 once "a" is within
        // its own half, and "a" gets no more meanwhile.
        assert!(soon(budget.take(&b, 4)).is_none());
        drop(a1);
        let b1 = soon(budget.take(&b, 4)).unwrap();
        let a3 = soon(budget.take(&a, 4)).unwrap();
        assert!(soon(budget.take(&a, 1)).is_none());
        // One request's worth is always a key's part, even past the half.
        drop((b1, a3));
        let _b2 = soon(budget.take(&b, 2)).unwrap();
        assert!(soon(budget.take(&a, 7)).is_none());
        assert!(soon(budget.take(&a, 6)).is_some());
    }

    #[test]
    fn a_busy_key_gives_back_what_it_took_alone_when_another_key_waits() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let budget = Budget::new(8 * BUFFER_UNIT);
        let mut a = Buffer::new(budget.clone(), "a".into());
        rt.block_on(a.get(8 * BUFFER_UNIT)).unwrap();
        let mut b = Buffer::new(budget.clone(), "b".into());
        let waiter = rt.spawn(async move { b.get(4 * BUFFER_UNIT).await.map(|d| d.len()) });
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(10)).await });
        assert!(!waiter.is_finished());
        // "a" asks again for what already fits: over its part while "b" waits, it gives its
        // room back and takes only what it asks for.
        rt.block_on(a.get(BUFFER_UNIT)).unwrap();
        let got =
            rt.block_on(async { tokio::time::timeout(Duration::from_millis(100), waiter).await });
        assert_eq!(got.unwrap().unwrap().unwrap(), 4 * BUFFER_UNIT);
        // "b"'s buffer went with its task; "a" holds what it asked for.
        assert_eq!(budget.taken(), 1);
    }
}
