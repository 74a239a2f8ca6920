//! A session's request buffer: where a request's bytes wait between the socket and an export
//! that cannot take them in place (a write received whole before it is applied, a file or
//! GPU read, a TLS answer). Buffers are counted in units of [`BUFFER_UNIT`] bytes against the
//! agent's `buffer_memory` and against a quarter of it per key, so no one key's sessions can
//! hold everyone else's room.

use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The grain in which request buffers are counted.
pub(super) const BUFFER_UNIT: usize = 1 << 20;

/// Room taken from the budgets: the key's and the agent's.
type Room = (OwnedSemaphorePermit, OwnedSemaphorePermit);

/// A session's buffer: it grows (waiting for room) to the largest request, and is given back
/// whole when the session goes idle.
pub(super) struct Buffer {
    bytes: Vec<u8>,
    room: Option<Room>,
    key_budget: Arc<Semaphore>,
    budget: Arc<Semaphore>,
}

/// A buffer lent to a blocking thread with its room: if the request is abandoned (timed out)
/// while the thread still works, the room goes back only when the thread is done with it.
pub(super) struct Lent {
    pub(super) bytes: Vec<u8>,
    room: Option<Room>,
}

impl Buffer {
    pub(super) fn new(key_budget: Arc<Semaphore>, budget: Arc<Semaphore>) -> Self {
        Self {
            bytes: Vec::new(),
            room: None,
            key_budget,
            budget,
        }
    }

    /// The buffer, `len` bytes long (room for it taken first). The bytes are whatever an
    /// earlier request left.
    pub(super) async fn get(&mut self, len: usize) -> &mut Vec<u8> {
        let units = len.div_ceil(BUFFER_UNIT) as u32;
        let held = self
            .room
            .as_ref()
            .map_or(0, |(_, p)| p.num_permits() as u32);
        if units > held {
            // Give back what is held before waiting for the whole, and take the key's room
            // before the agent's, always in that order: no session holds room while it waits,
            // so sessions never wait on each other in a cycle. The semaphores are never
            // closed, so this only waits (within the request's time).
            self.release();
            let key = self.key_budget.clone().acquire_many_owned(units).await;
            let all = self.budget.clone().acquire_many_owned(units).await;
            self.room = key.ok().zip(all.ok());
        }
        self.bytes.resize(len, 0);
        &mut self.bytes
    }

    /// Lends the bytes, `len` long, and their room to a blocking thread.
    pub(super) async fn lend(&mut self, len: usize) -> Lent {
        self.get(len).await;
        Lent {
            bytes: std::mem::take(&mut self.bytes),
            room: self.room.take(),
        }
    }

    /// Takes back what [`lend`](Self::lend) lent.
    pub(super) fn restore(&mut self, lent: Lent) {
        self.bytes = lent.bytes;
        self.room = lent.room;
    }

    /// Gives the memory and its room back.
    pub(super) fn release(&mut self) {
        self.bytes = Vec::new();
        self.room = None;
    }
}
