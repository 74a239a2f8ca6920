//! The pinned staging memory pool (docs/REFERENCE.md#staging-pool): page-locked host buffers in
//! power-of-two size classes, reused rather than re-pinned, under a hard limit on pinned bytes.
//!
//! Pinning is slow (a `cuMemHostRegister` walks and locks every page) and pinned memory is
//! taken from everything else on the machine, so the pool keeps returned buffers for reuse and
//! never holds more than [`PoolConfig::limit`] bytes. When a class has no free buffer and the
//! limit is reached, idle buffers of other classes are released (least recently returned
//! first) to make room; only when nothing idle is left does a request fail with
//! [`CoreError::Busy`] — or, with [`StagingPool::get`], wait for a buffer to come back.
//!
//! Each buffer is one [`HostBuffer`] (the unit of staging memory), so a pooled
//! buffer serves as a DMA target, an O_DIRECT target or an io_uring fixed buffer alike.

use crate::metrics::{POOL_IN_USE_BYTES, POOL_PINNED_BYTES};
use crate::{CoreError, Result};
use gpuio_hal::sync::{CondvarExt, MutexExt};
use gpuio_hal::{Gpu, HostAllocOptions, HostBuffer};
use metrics::Gauge;
use std::collections::VecDeque;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How a [`StagingPool`] allocates and how much it may hold.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Bytes pinned at most, free and handed out together.
    pub limit: u64,
    /// The smallest size class (a power of two); smaller requests get a buffer of this size.
    pub min_class: usize,
    /// The largest size class (a power of two); larger requests are refused.
    pub max_class: usize,
    /// Bind buffers to this NUMA node.
    pub numa: Option<u32>,
    /// Ask for transparent huge pages (for classes of 2 MiB and more).
    pub huge_pages: bool,
    /// Pin buffers for this GPU; `None` keeps them unpinned host memory (still accounted
    /// against the limit, as it is still memory taken from the machine).
    pub gpu: Option<Gpu>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            limit: 1 << 30,
            min_class: 64 << 10,
            max_class: 64 << 20,
            numa: None,
            huge_pages: true,
            gpu: None,
        }
    }
}

/// Counters and gauges of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct PoolStats {
    /// The configured limit in bytes.
    pub limit: u64,
    /// Bytes held (free and handed out), including allocations under way.
    pub pinned_bytes: u64,
    /// Bytes handed out (whole classes).
    pub in_use_bytes: u64,
    /// The most bytes ever held at once.
    pub peak_pinned_bytes: u64,
    /// Buffers allocated (and pinned).
    pub allocations: u64,
    /// Requests served by a free buffer.
    pub reuses: u64,
    /// Free buffers released to make room for another class.
    pub releases: u64,
    /// Requests that had to wait for a buffer to come back.
    pub waits: u64,
    /// Requests that failed (no room in time, or the allocation failed).
    pub failures: u64,
}

/// A pool of pinned staging buffers. Cheap to clone (clones share the pool); `Sync`.
#[derive(Clone)]
pub struct StagingPool {
    inner: Arc<Inner>,
}

struct Inner {
    config: PoolConfig,
    alloc_opts: HostAllocOptions,
    /// Taken poison-tolerant: every update of the state is completed before anything that
    /// can panic.
    state: Mutex<State>,
    /// Signalled whenever bytes become available: a buffer returned, a reservation undone.
    returned: Condvar,
    pinned_gauge: Gauge,
    in_use_gauge: Gauge,
}

struct State {
    /// Free buffers per class (index: log2(class / min_class)), oldest return first, each with
    /// the tick of its return.
    free: Vec<VecDeque<(u64, HostBuffer)>>,
    tick: u64,
    stats: PoolStats,
}

/// How long a request may wait for room.
#[derive(Clone, Copy)]
enum Wait {
    No,
    Until(Instant),
    Forever,
}

/// What one look at the pool under its lock decided.
enum Step {
    Reused(HostBuffer),
    /// Bytes reserved for a new buffer; allocate it outside the lock.
    Allocate,
    /// Idle buffers taken off the free lists to make room; still counted as pinned until
    /// dropped outside the lock.
    Release(Vec<HostBuffer>),
    NoRoom(String),
}

impl StagingPool {
    /// Creates an empty pool (nothing is allocated until asked for).
    pub fn new(config: PoolConfig) -> Result<Self> {
        let (min, max) = (config.min_class, config.max_class);
        if !min.is_power_of_two() || !max.is_power_of_two() || min > max {
            return Err(CoreError::InvalidRequest(format!(
                "pool size classes must be powers of two with min <= max, not {min}..{max}"
            )));
        }
        if config.limit == 0 {
            return Err(CoreError::InvalidRequest(
                "a pool limit of 0 bytes holds nothing".into(),
            ));
        }
        let classes = (max.trailing_zeros() - min.trailing_zeros()) as usize + 1;
        let alloc_opts = HostAllocOptions {
            numa: config.numa,
            huge_pages: config.huge_pages,
            ..HostAllocOptions::default()
        };
        let pool = Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    free: (0..classes).map(|_| VecDeque::new()).collect(),
                    tick: 0,
                    stats: PoolStats {
                        limit: config.limit,
                        ..PoolStats::default()
                    },
                }),
                config,
                alloc_opts,
                returned: Condvar::new(),
                pinned_gauge: metrics::gauge!(POOL_PINNED_BYTES),
                in_use_gauge: metrics::gauge!(POOL_IN_USE_BYTES),
            }),
        };
        Ok(pool)
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.inner.config
    }

    /// A buffer of `len` bytes, failing with [`CoreError::Busy`] at once when the limit leaves
    /// no room. Its contents are whatever its last user left.
    pub fn try_get(&self, len: usize) -> Result<PooledBuffer> {
        self.acquire(len, Wait::No)
    }

    /// A buffer of `len` bytes, waiting up to `timeout` for one to come back when the limit
    /// leaves no room, then failing with [`CoreError::Busy`].
    pub fn get(&self, len: usize, timeout: Duration) -> Result<PooledBuffer> {
        // A timeout too large for an Instant is as good as forever.
        let wait = Instant::now()
            .checked_add(timeout)
            .map_or(Wait::Forever, Wait::Until);
        self.acquire(len, wait)
    }

    /// The pool's counters now.
    pub fn stats(&self) -> PoolStats {
        self.inner.state.lock_unpoisoned().stats
    }

    /// Releases every free buffer (unpinning and unmapping it); returns the bytes released.
    pub fn trim(&self) -> u64 {
        let victims: Vec<HostBuffer> = {
            let mut st = self.inner.state.lock_unpoisoned();
            st.free
                .iter_mut()
                .flat_map(|list| list.drain(..).map(|(_, b)| b))
                .collect()
        };
        let bytes: u64 = victims.iter().map(|b| b.len() as u64).sum();
        let n = victims.len() as u64;
        drop(victims);
        let mut st = self.inner.state.lock_unpoisoned();
        st.stats.pinned_bytes -= bytes;
        st.stats.releases += n;
        self.inner.publish(&st);
        drop(st);
        self.inner.returned.notify_all();
        bytes
    }

    /// The class index and size for a request, or why it can never be served.
    fn class_of(&self, len: usize) -> Result<(usize, usize)> {
        let c = &self.inner.config;
        if len == 0 {
            return Err(CoreError::InvalidRequest(
                "a staging buffer of 0 bytes".into(),
            ));
        }
        if len > c.max_class {
            return Err(CoreError::InvalidRequest(format!(
                "a staging buffer of {len} bytes is above the largest class ({} bytes)",
                c.max_class
            )));
        }
        let size = len.next_power_of_two().max(c.min_class);
        if size as u64 > c.limit {
            return Err(CoreError::InvalidRequest(format!(
                "a staging buffer of {len} bytes (class {size}) is above the pool limit of {} bytes",
                c.limit
            )));
        }
        let index = (size.trailing_zeros() - c.min_class.trailing_zeros()) as usize;
        Ok((index, size))
    }

    fn acquire(&self, len: usize, wait: Wait) -> Result<PooledBuffer> {
        let (class, size) = self.class_of(len)?;
        let inner = &self.inner;
        let mut waited = false;
        let mut st = inner.state.lock_unpoisoned();
        loop {
            match inner.step(&mut st, class, size) {
                Step::Reused(buf) => {
                    drop(st);
                    return Ok(self.hand_out(buf, len, class));
                }
                Step::Allocate => {
                    drop(st);
                    return match inner.allocate(size) {
                        Ok(buf) => Ok(self.hand_out(buf, len, class)),
                        Err(e) => {
                            let mut st = inner.state.lock_unpoisoned();
                            st.stats.pinned_bytes -= size as u64;
                            st.stats.in_use_bytes -= size as u64;
                            st.stats.failures += 1;
                            inner.publish(&st);
                            drop(st);
                            inner.returned.notify_all();
                            Err(e)
                        }
                    };
                }
                Step::Release(victims) => {
                    drop(st);
                    let bytes: u64 = victims.iter().map(|b| b.len() as u64).sum();
                    let n = victims.len() as u64;
                    // Unpin and unmap outside the lock; the bytes stay counted until gone.
                    drop(victims);
                    st = inner.state.lock_unpoisoned();
                    st.stats.pinned_bytes -= bytes;
                    st.stats.releases += n;
                    inner.publish(&st);
                    // Others may be waiting for the room we did not need.
                    inner.returned.notify_all();
                }
                Step::NoRoom(why) => {
                    let now = Instant::now();
                    let left = match wait {
                        Wait::Until(d) if now < d => Some(Some(d - now)),
                        Wait::Forever => Some(None),
                        _ => None,
                    };
                    match left {
                        Some(left) => {
                            if !waited {
                                waited = true;
                                st.stats.waits += 1;
                            }
                            st = match left {
                                Some(t) => inner.returned.wait_timeout_unpoisoned(st, t).0,
                                None => inner.returned.wait_unpoisoned(st),
                            };
                        }
                        None => {
                            st.stats.failures += 1;
                            let waited = if waited { " after waiting" } else { "" };
                            return Err(CoreError::Busy(format!(
                                "staging pool full{waited}: {len} bytes (class {size}) wanted; {why}"
                            )));
                        }
                    }
                }
            }
        }
    }

    fn hand_out(&self, buf: HostBuffer, len: usize, class: usize) -> PooledBuffer {
        PooledBuffer {
            buf: Some(buf),
            len,
            class,
            pool: self.inner.clone(),
        }
    }
}

impl Inner {
    /// One decision under the lock; the accounting of `Reused` and `Allocate` is done here.
    fn step(&self, st: &mut State, class: usize, size: usize) -> Step {
        let size64 = size as u64;
        // The most recently returned buffer of the class: its pages are the likeliest warm.
        if let Some((_, buf)) = st.free[class].pop_back() {
            st.stats.reuses += 1;
            st.stats.in_use_bytes += size64;
            self.publish(st);
            return Step::Reused(buf);
        }
        let limit = self.config.limit;
        let pinned = st.stats.pinned_bytes;
        if pinned + size64 <= limit {
            st.stats.pinned_bytes += size64;
            st.stats.in_use_bytes += size64;
            st.stats.allocations += 1;
            st.stats.peak_pinned_bytes = st.stats.peak_pinned_bytes.max(st.stats.pinned_bytes);
            self.publish(st);
            return Step::Allocate;
        }
        // Release only if that makes enough room; otherwise keep the free buffers for reuse.
        let idle: u64 = st
            .free
            .iter()
            .flat_map(|l| l.iter().map(|(_, b)| b.len() as u64))
            .sum();
        if pinned - idle + size64 > limit {
            return Step::NoRoom(format!(
                "{pinned} of {limit} bytes pinned, {} handed out, {idle} idle",
                st.stats.in_use_bytes
            ));
        }
        let mut victims = Vec::new();
        let mut freed = 0;
        while pinned - freed + size64 > limit {
            // The least recently returned buffer over all classes: each list's front.
            let oldest = st
                .free
                .iter()
                .enumerate()
                .filter_map(|(i, l)| l.front().map(|(t, _)| (*t, i)))
                .min();
            let Some((_, i)) = oldest else { break };
            if let Some((_, b)) = st.free[i].pop_front() {
                freed += b.len() as u64;
                victims.push(b);
            }
        }
        Step::Release(victims)
    }

    fn allocate(&self, size: usize) -> Result<HostBuffer> {
        let mut buf = HostBuffer::alloc(size, &self.alloc_opts)?;
        if let Some(gpu) = &self.config.gpu {
            buf.pin(gpu)?;
        }
        Ok(buf)
    }

    fn publish(&self, st: &State) {
        self.pinned_gauge.set(st.stats.pinned_bytes as f64);
        self.in_use_gauge.set(st.stats.in_use_bytes as f64);
    }
}

impl fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingPool")
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish()
    }
}

/// A staging buffer from a [`StagingPool`]: derefs to exactly the bytes asked for, and goes
/// back to the pool when dropped.
pub struct PooledBuffer {
    /// Always `Some` until Drop takes it.
    buf: Option<HostBuffer>,
    len: usize,
    class: usize,
    pool: Arc<Inner>,
}

impl PooledBuffer {
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
        let Some(buf) = self.buf.take() else { return };
        let pool = &self.pool;
        let mut st = pool.state.lock_unpoisoned();
        st.stats.in_use_bytes -= buf.len() as u64;
        st.tick += 1;
        let tick = st.tick;
        st.free[self.class].push_back((tick, buf));
        pool.publish(&st);
        drop(st);
        pool.returned.notify_all();
    }
}
