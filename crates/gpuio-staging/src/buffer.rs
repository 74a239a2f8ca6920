//! What a [`StagingPool`](crate::StagingPool) hands out: a [`PooledBuffer`] (one buffer that
//! goes back when dropped) or a [`StagingLease`] (several buffers owned as plain
//! [`HostBuffer`]s, given back together).

use crate::Inner;
use gpuio_hal::HostBuffer;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// A staging buffer from a [`StagingPool`](crate::StagingPool): derefs to exactly the bytes
/// asked for, and goes back to the pool when dropped.
pub struct PooledBuffer {
    /// Always `Some` until Drop takes it.
    buf: Option<HostBuffer>,
    len: usize,
    shelf: usize,
    class: usize,
    pool: Arc<Inner>,
}

impl PooledBuffer {
    pub(crate) fn new(
        buf: HostBuffer,
        len: usize,
        shelf: usize,
        class: usize,
        pool: Arc<Inner>,
    ) -> Self {
        Self {
            buf: Some(buf),
            len,
            shelf,
            class,
            pool,
        }
    }

    /// The whole underlying buffer (its class size, at least the length asked for).
    pub fn host_buffer(&self) -> &HostBuffer {
        self.buf.as_ref().expect("present until drop")
    }

    /// The size of the buffer's class.
    pub fn capacity(&self) -> usize {
        self.host_buffer().len()
    }
}

impl Deref for PooledBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.host_buffer()[..self.len]
    }
}

impl DerefMut for PooledBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.buf.as_mut().expect("present until drop")[..len]
    }
}

impl fmt::Debug for PooledBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledBuffer")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.put_back(self.shelf, self.class, vec![buf]);
        }
    }
}

/// Buffers of one class taken together from a pool
/// ([`StagingPool::try_lease_for`](crate::StagingPool::try_lease_for)) and owned by their
/// holder as plain [`HostBuffer`]s; the lease keeps them counted as handed out. Give them back
/// with [`give_back`](Self::give_back). Those that do not come back (a lane that lost a buffer
/// to a failed copy) are taken as gone when the lease drops: neither held nor in use any more.
pub struct StagingLease {
    pool: Arc<Inner>,
    shelf: usize,
    class: usize,
    size: usize,
    /// Addresses of the buffers still out.
    out: Vec<usize>,
}

impl StagingLease {
    pub(crate) fn new(
        bufs: &[HostBuffer],
        shelf: usize,
        class: usize,
        size: usize,
        pool: Arc<Inner>,
    ) -> Self {
        Self {
            pool,
            shelf,
            class,
            size,
            out: bufs.iter().map(|b| b.as_ptr() as usize).collect(),
        }
    }

    /// Buffers still out.
    pub fn buffers(&self) -> usize {
        self.out.len()
    }

    /// The size of each buffer (its class).
    pub fn buffer_len(&self) -> usize {
        self.size
    }

    /// Bytes still out.
    pub fn bytes(&self) -> u64 {
        (self.out.len() * self.size) as u64
    }

    /// Returns `bufs` to the pool's free list for reuse, with one lock of the pool. A buffer
    /// that is not one of this lease's is dropped (a caller's mistake, logged); the lease's
    /// buffers not among `bufs` are taken as gone.
    pub fn give_back(mut self, bufs: impl IntoIterator<Item = HostBuffer>) {
        let mut back = Vec::new();
        for b in bufs {
            let at = b.as_ptr() as usize;
            match self.out.iter().position(|&a| a == at) {
                Some(i) if b.len() == self.size => {
                    self.out.swap_remove(i);
                    back.push(b);
                }
                _ => tracing::warn!(
                    len = b.len(),
                    "a buffer given back to a staging lease it does not belong to; dropped"
                ),
            }
        }
        if !back.is_empty() {
            self.pool.put_back(self.shelf, self.class, back);
        }
    }
}

impl fmt::Debug for StagingLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingLease")
            .field("buffers", &self.out.len())
            .field("buffer_len", &self.size)
            .finish()
    }
}

impl Drop for StagingLease {
    fn drop(&mut self) {
        if !self.out.is_empty() {
            self.pool.forget(self.bytes());
        }
    }
}
