//! Request buffers: where a request's bytes wait between the socket and an export that cannot
//! take them in place (a write received whole before it is applied, a piece of a file or GPU
//! read, a TLS answer).
//!
//! Buffers are counted in units of [`BUFFER_UNIT`] bytes against the agent's
//! `buffer_memory`, shared among the keys that hold buffers now: a key may hold its part of
//! the whole (the whole divided among them, the asking key included), and always one request's
//! worth, so no key's sessions can hold everyone else's room however few keys there are.
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
    /// Units each key holds or is about to take.
    held: Mutex<HashMap<Arc<str>, usize>>,
    /// Told whenever a key gives units back.
    changed: Notify,
}

impl Budget {
    pub(super) fn new(bytes: usize) -> Arc<Self> {
        let units = (bytes / BUFFER_UNIT).max(1);
        Arc::new(Self {
            free: Arc::new(Semaphore::new(units)),
            units,
            held: Mutex::new(HashMap::new()),
            changed: Notify::new(),
        })
    }

    /// Takes `units` for `key`: first within the key's part (waiting for its own sessions or
    /// other keys to give back), then from what is free.
    async fn take(self: &Arc<Self>, key: &Arc<str>, units: usize) -> Room {
        loop {
            // Created before looking: a release in between still wakes it.
            let changed = self.changed.notified();
            {
                let mut held = self.held.lock_unpoisoned();
                let mine = held.get(key).copied().unwrap_or(0);
                let keys = held.len() + usize::from(mine == 0);
                let part = (self.units / keys).max(units);
                if mine + units <= part {
                    *held.entry(key.clone()).or_insert(0) += units;
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
            _free: None,
        };
        // Never closed, so this only waits; `units` never exceeds the whole (one request's
        // worth fits, as the configuration check ensures).
        room._free = self
            .free
            .clone()
            .acquire_many_owned(units.min(self.units) as u32)
            .await
            .ok();
        room
    }

    /// Units held by every key together (for tests and stats).
    #[cfg(test)]
    fn taken(&self) -> usize {
        self.units - self.free.available_permits()
    }
}

/// Units taken from the budget, given back when dropped.
struct Room {
    budget: Arc<Budget>,
    key: Arc<str>,
    units: usize,
    _free: Option<OwnedSemaphorePermit>,
}

impl Drop for Room {
    fn drop(&mut self) {
        let mut held = self.budget.held.lock_unpoisoned();
        if let Some(n) = held.get_mut(&self.key) {
            *n = n.saturating_sub(self.units);
            if *n == 0 {
                held.remove(&self.key);
            }
        }
        drop(held);
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
        match &mut self.bytes {
            Some(b) => &mut b.as_mut_slice()[..self.len],
            None => &mut [],
        }
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

    /// The buffer, `len` bytes long (room for it taken first). The bytes are whatever an
    /// earlier request left. Fails only where the machine cannot back the memory.
    pub(super) async fn get(&mut self, len: usize) -> Result<&mut [u8], HalError> {
        let units = len.div_ceil(BUFFER_UNIT);
        let held = self.room.as_ref().map_or(0, |r| r.units);
        if units > held || self.bytes.is_none() && len > 0 {
            // Give back what is held before waiting for the whole: no session holds room
            // while it waits, so sessions never wait on each other in a cycle.
            self.release();
            let room = self.budget.take(&self.key, units).await;
            self.bytes = Some(HostBuffer::alloc(
                units * BUFFER_UNIT,
                &HostAllocOptions::default(),
            )?);
            self.room = Some(room);
        }
        self.len = len;
        Ok(match &mut self.bytes {
            Some(b) => &mut b.as_mut_slice()[..len],
            None => &mut [],
        })
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
}
