//! gpuio's pinned staging memory pool (docs/REFERENCE.md#staging-pool): page-locked host
//! buffers in power-of-two size classes, reused rather than re-pinned, under a hard limit on
//! pinned bytes. MemIO's and LocalIO's lanes take their staging buffers from it; the session
//! makes one pool and shares it between them.
//!
//! It sits between the HAL and the transports and holds no `unsafe`: the buffers are
//! [`gpuio_hal::HostBuffer`]s (mapped, NUMA-bound and pinned by the HAL), and its errors are
//! the HAL's ([`HalError`], [`gpuio_hal::Result`]).
//!
//! # What it pins, and the limit
//!
//! Pinning is slow (a `cuMemHostRegister` walks and locks every page) and pinned memory is
//! taken from everything else on the machine, so the pool keeps returned buffers for reuse and
//! never holds more than [`PoolConfig::limit`] bytes, free and handed out together
//! ([`auto_limit`] sizes it from the memory the machine can back). A request is rounded up to
//! its class ([`PoolConfig::class_size`]); one above the largest class or the limit is refused
//! outright. When a class has no free buffer and the limit is reached, idle buffers of other
//! classes are released (least recently returned first) to make room; then the registered
//! [`StagingHolder`]s (a transport's cached lanes) are asked to let go of as many idle bytes as
//! are missing; only when nothing idle is left does a request fail with [`HalError::Busy`] —
//! or, with [`StagingPool::get`], wait for a buffer to come back. A *spare* request
//! ([`StagingPool::lease_spare_for`]: a transfer's extra lanes) takes only room there is: it
//! asks no holder and never counts as a failure, so that transports short of room run on fewer
//! lanes instead of tearing down each other's.
//!
//! Buffers are kept per *shelf*: the NUMA node their pages are bound to, and whether they are
//! pinned. A request names its shelf (the configured one, or a GPU's node for
//! [`StagingPool::try_lease_for`]), so a buffer bound to one socket never serves a GPU on the
//! other. Pins are portable (`CU_MEMHOSTREGISTER_PORTABLE`): a buffer pinned through one GPU
//! serves every GPU of the driver.
//!
//! # Leases
//!
//! Two ways to take buffers: a [`PooledBuffer`] (one buffer, back to the pool when dropped), or
//! a [`StagingLease`] of several buffers taken at once, all or none, handed out as plain
//! [`HostBuffer`]s for owners that must own them (an asynchronous copy takes its host memory by
//! value, an io_uring ring registers the buffers it owns). Buffers of a lease that never come
//! back are counted as gone when it drops: neither held nor in use.
//!
//! # Lanes
//!
//! A transport's lane holds a lease for its whole life and gives it back when it goes, so the
//! transfers themselves never touch the pool: no lock and no allocation per chunk or per
//! transfer. [`LaneSet`] keeps one GPU's idle lanes (of the transport's [`StagingLane`] type)
//! between transfers and is the [`StagingHolder`] the pool asks for them; a transfer's first
//! lane may wait for room (up to [`LANE_WAIT`]), the rest are made only from spare room.
//!
//! The buffer types (`PooledBuffer`, `StagingLease`) are in `buffer.rs`; the lanes in
//! `lanes.rs`.

#![forbid(unsafe_code)]

mod buffer;
mod lanes;

pub use buffer::{PooledBuffer, StagingLease};
pub use lanes::{LANE_WAIT, LaneSet, StagingLane};

use gpuio_hal::memory::backing::backable_bytes;
use gpuio_hal::sync::{CondvarExt, MutexExt};
use gpuio_hal::{Gpu, HalError, HostAllocOptions, HostBuffer, Result};
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

/// The smallest limit [`auto_limit`] picks.
pub const MIN_AUTO_LIMIT: u64 = 1 << 30;

/// The limit of a pool sized automatically: a quarter of the host memory the machine can back
/// without swap now (available memory within this process's memory cgroups), and at least
/// [`MIN_AUTO_LIMIT`]. A bound, not a reservation: a pool pins only what its users ask for.
pub fn auto_limit() -> u64 {
    auto_limit_of(backable_bytes(false))
}

/// [`auto_limit`] from a reading of `backable_bytes(false)` the caller has already taken.
pub fn auto_limit_of(backable: Option<u64>) -> u64 {
    backable.map_or(MIN_AUTO_LIMIT, |b| (b / 4).max(MIN_AUTO_LIMIT))
}

/// How a [`StagingPool`] allocates and how much it may hold.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Bytes pinned at most, free and handed out together.
    pub limit: u64,
    /// The smallest size class (a power of two); smaller requests get a buffer of this size.
    pub min_class: usize,
    /// The largest size class (a power of two); larger requests are refused.
    pub max_class: usize,
    /// Bind buffers to this NUMA node (requests through [`StagingPool::try_lease_for`] use
    /// their GPU's node instead).
    pub numa: Option<u32>,
    /// Ask for transparent huge pages (for classes of 2 MiB and more).
    pub huge_pages: bool,
    /// Pin buffers for this GPU; `None` keeps them unpinned host memory (still accounted
    /// against the limit, as it is still memory taken from the machine). Requests through
    /// [`StagingPool::try_lease_for`] are pinned for their GPU whatever this says.
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

impl PoolConfig {
    /// The size of the class a buffer of `len` bytes comes from (`len` rounded up to a power
    /// of two, at least [`min_class`](Self::min_class)), or `None` where it is above
    /// [`max_class`](Self::max_class). What a user of `n` such buffers holds is `n` times it.
    pub fn class_size(&self, len: usize) -> Option<usize> {
        (len <= self.max_class).then(|| len.max(1).next_power_of_two().max(self.min_class))
    }
}

/// Counters and gauges of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct PoolStats {
    /// The configured limit in bytes.
    pub limit: u64,
    /// Bytes held (free and handed out), including allocations under way.
    pub pinned_bytes: u64,
    /// Bytes handed out (whole classes), leases included.
    pub in_use_bytes: u64,
    /// The most bytes ever held at once (the high-water mark).
    pub peak_pinned_bytes: u64,
    /// Buffers allocated (and pinned).
    pub allocations: u64,
    /// Requests served by a free buffer (counted per buffer).
    pub reuses: u64,
    /// Free buffers released to make room for another class.
    pub releases: u64,
    /// Bytes [`StagingHolder`]s let go of when asked for room.
    pub reclaimed_bytes: u64,
    /// Requests that had to wait for a buffer to come back.
    pub waits: u64,
    /// Requests that failed (no room in time, or the allocation failed).
    pub failures: u64,
}

/// Something that keeps buffers of a pool while they are idle — a transport's cached lanes —
/// and lets them go when the pool needs room. Registered with [`StagingPool::add_holder`].
pub trait StagingHolder: Send + Sync {
    /// Gives back idle buffers of at least `wanted` bytes where it holds that many (else all
    /// it holds idle), dropping the lanes that hold them; returns the bytes given back. Called
    /// without any lock of the pool held.
    fn release_idle(&self, wanted: u64) -> u64;
}

/// Called with the pool's counters after every change, under the pool's lock (so in order):
/// it must be quick and must not call the pool.
type Observer = Box<dyn Fn(&PoolStats) + Send + Sync>;

/// A pool of pinned staging buffers. Cheap to clone (clones share the pool); `Sync`.
#[derive(Clone)]
pub struct StagingPool {
    inner: Arc<Inner>,
}

struct Inner {
    config: PoolConfig,
    /// Taken poison-tolerant: every update of the state is completed before anything that
    /// can panic.
    state: Mutex<State>,
    /// Signalled whenever bytes become available: a buffer returned, a reservation undone.
    returned: Condvar,
    /// Requests that found no room and may wait: holders give their buffers back instead of
    /// keeping them idle while this is not zero.
    waiters: AtomicUsize,
    observer: Option<Observer>,
}

struct State {
    shelves: Vec<Shelf>,
    tick: u64,
    stats: PoolStats,
    holders: Vec<Weak<dyn StagingHolder>>,
}

/// The free buffers of one placement.
struct Shelf {
    numa: Option<u32>,
    pinned: bool,
    /// Free buffers per class (index: log2(class / min_class)), oldest return first, each
    /// with the tick of its return.
    free: Vec<VecDeque<(u64, HostBuffer)>>,
}

/// How long a request may wait for room.
#[derive(Clone, Copy)]
enum Wait {
    No,
    Until(Instant),
    Forever,
}

/// How a request goes about getting room.
#[derive(Clone, Copy)]
enum Mode {
    /// Releases idle buffers, asks holders, and waits as `Wait` allows.
    Need(Wait),
    /// Takes only the room there is (releasing idle buffers of the pool's own free lists):
    /// asks no holder, waits for nothing, and finding none is no failure.
    Spare,
}

/// What a request asks for: `count` buffers of `len` bytes on one shelf.
struct Want<'a> {
    len: usize,
    count: usize,
    class: usize,
    size: usize,
    numa: Option<u32>,
    /// The GPU to pin for (`None`: unpinned).
    pin: Option<&'a Gpu>,
}

/// What one look at the pool under its lock decided.
enum Step {
    /// The request is accounted: `reused` buffers taken off the shelf, `fresh` more to
    /// allocate outside the lock.
    Take {
        shelf: usize,
        reused: Vec<HostBuffer>,
        fresh: usize,
    },
    /// Idle buffers taken off the free lists to make room; still counted as pinned until
    /// dropped outside the lock.
    Release(Vec<HostBuffer>),
    /// No room: why, and how many bytes are missing.
    NoRoom(String, u64),
}

/// Counts a request among the pool's waiters while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(waiters: &'a AtomicUsize) -> Self {
        waiters.fetch_add(1, Ordering::SeqCst);
        Self(waiters)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl StagingPool {
    /// Creates an empty pool (nothing is allocated until asked for).
    pub fn new(config: PoolConfig) -> Result<Self> {
        Self::build(config, None)
    }

    /// [`new`](Self::new), with `observer` called with the counters at once and after every
    /// change, under the pool's lock (so in order): it must be quick (it publishes metrics) and
    /// must not call the pool.
    pub fn with_observer(
        config: PoolConfig,
        observer: impl Fn(&PoolStats) + Send + Sync + 'static,
    ) -> Result<Self> {
        Self::build(config, Some(Box::new(observer)))
    }

    fn build(config: PoolConfig, observer: Option<Observer>) -> Result<Self> {
        let (min, max) = (config.min_class, config.max_class);
        if !min.is_power_of_two() || !max.is_power_of_two() || min > max {
            return Err(HalError::InvalidArgument(format!(
                "pool size classes must be powers of two with min <= max, not {min}..{max}"
            )));
        }
        if config.limit == 0 {
            return Err(HalError::InvalidArgument(
                "a pool limit of 0 bytes holds nothing".into(),
            ));
        }
        let mut state = State {
            shelves: Vec::new(),
            tick: 0,
            stats: PoolStats {
                limit: config.limit,
                ..PoolStats::default()
            },
            holders: Vec::new(),
        };
        state.shelf(config.numa, config.gpu.is_some(), Self::classes(&config));
        let inner = Inner {
            state: Mutex::new(state),
            config,
            returned: Condvar::new(),
            waiters: AtomicUsize::new(0),
            observer,
        };
        inner.publish(&inner.state.lock_unpoisoned());
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    fn classes(config: &PoolConfig) -> usize {
        (config.max_class.trailing_zeros() - config.min_class.trailing_zeros()) as usize + 1
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.inner.config
    }

    /// A buffer of `len` bytes, failing with [`HalError::Busy`] at once when the limit leaves
    /// no room. Its contents are whatever its last user left.
    pub fn try_get(&self, len: usize) -> Result<PooledBuffer> {
        self.get_placed(len, Wait::No)
    }

    /// A buffer of `len` bytes, waiting up to `timeout` for one to come back when the limit
    /// leaves no room, then failing with [`HalError::Busy`].
    pub fn get(&self, len: usize, timeout: Duration) -> Result<PooledBuffer> {
        self.get_placed(len, deadline(timeout))
    }

    fn get_placed(&self, len: usize, wait: Wait) -> Result<PooledBuffer> {
        let c = &self.inner.config;
        let want = self.want(len, 1, c.numa, c.gpu.as_ref())?;
        let none = || HalError::InvalidArgument("the staging pool handed out no buffer".into());
        let (shelf, mut bufs) = self.acquire(&want, Mode::Need(wait))?.ok_or_else(none)?;
        let buf = bufs.pop().ok_or_else(none)?;
        Ok(PooledBuffer::new(
            buf,
            len,
            shelf,
            want.class,
            self.inner.clone(),
        ))
    }

    /// `count` buffers of at least `len` bytes each (their class), all or none, on `gpu`'s NUMA
    /// node and pinned for it, as plain [`HostBuffer`]s with the [`StagingLease`] that gives
    /// them back; fails with [`HalError::Busy`] at once when the limit leaves no room for all.
    pub fn try_lease_for(
        &self,
        gpu: &Gpu,
        len: usize,
        count: usize,
    ) -> Result<(Vec<HostBuffer>, StagingLease)> {
        self.lease_needed(gpu, len, count, Wait::No)
    }

    /// [`try_lease_for`](Self::try_lease_for), waiting up to `timeout` for room.
    pub fn lease_for(
        &self,
        gpu: &Gpu,
        len: usize,
        count: usize,
        timeout: Duration,
    ) -> Result<(Vec<HostBuffer>, StagingLease)> {
        self.lease_needed(gpu, len, count, deadline(timeout))
    }

    /// [`try_lease_for`](Self::try_lease_for) where the pool has the room now, `None` where it
    /// has not: the holders' idle buffers are not asked for, and no failure is counted. For
    /// buffers that are worth having only if they cost nobody else theirs (a transfer's lanes
    /// beyond its first).
    pub fn lease_spare_for(
        &self,
        gpu: &Gpu,
        len: usize,
        count: usize,
    ) -> Result<Option<(Vec<HostBuffer>, StagingLease)>> {
        self.lease_placed(gpu, len, count, Mode::Spare)
    }

    fn lease_needed(
        &self,
        gpu: &Gpu,
        len: usize,
        count: usize,
        wait: Wait,
    ) -> Result<(Vec<HostBuffer>, StagingLease)> {
        self.lease_placed(gpu, len, count, Mode::Need(wait))?
            .ok_or_else(|| HalError::InvalidArgument("the staging pool leased nothing".into()))
    }

    fn lease_placed(
        &self,
        gpu: &Gpu,
        len: usize,
        count: usize,
        mode: Mode,
    ) -> Result<Option<(Vec<HostBuffer>, StagingLease)>> {
        let want = self.want(len, count, gpu.info().numa_node, Some(gpu))?;
        let Some((shelf, bufs)) = self.acquire(&want, mode)? else {
            return Ok(None);
        };
        let lease = StagingLease::new(&bufs, shelf, want.class, want.size, self.inner.clone());
        Ok(Some((bufs, lease)))
    }

    /// The pool's counters now.
    pub fn stats(&self) -> PoolStats {
        self.inner.state.lock_unpoisoned().stats
    }

    /// Whether a request is waiting for room (or about to): a holder should then give buffers
    /// back rather than keep them idle. A holder asks after making buffers idle, never
    /// before: a request counts itself a waiter before it asks the holders, so either it finds
    /// those buffers or the holder sees it.
    pub fn is_waited_on(&self) -> bool {
        self.inner.waiters.load(Ordering::SeqCst) > 0
    }

    /// Registers a holder of idle buffers, asked to let them go when a request finds no room.
    /// The pool keeps it weakly: a holder that is gone is forgotten.
    pub fn add_holder(&self, holder: Weak<dyn StagingHolder>) {
        let mut st = self.inner.state.lock_unpoisoned();
        st.holders.retain(|h| h.strong_count() > 0);
        st.holders.push(holder);
    }

    /// Releases every free buffer (unpinning and unmapping it); returns the bytes released.
    pub fn trim(&self) -> u64 {
        let victims: Vec<HostBuffer> = {
            let mut st = self.inner.state.lock_unpoisoned();
            st.shelves
                .iter_mut()
                .flat_map(|s| s.free.iter_mut())
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

    /// The request for `count` buffers of `len` bytes, or why it can never be served.
    fn want<'a>(
        &self,
        len: usize,
        count: usize,
        numa: Option<u32>,
        pin: Option<&'a Gpu>,
    ) -> Result<Want<'a>> {
        let c = &self.inner.config;
        if len == 0 {
            return Err(HalError::InvalidArgument(
                "a staging buffer of 0 bytes".into(),
            ));
        }
        let Some(size) = c.class_size(len) else {
            return Err(HalError::InvalidArgument(format!(
                "a staging buffer of {len} bytes is above the largest class ({} bytes)",
                c.max_class
            )));
        };
        if size as u64 > c.limit {
            return Err(HalError::InvalidArgument(format!(
                "a staging buffer of {len} bytes (class {size}) is above the pool limit of {} bytes",
                c.limit
            )));
        }
        if count == 0 {
            return Err(HalError::InvalidArgument(
                "a lease of no staging buffers".into(),
            ));
        }
        if (count as u64).saturating_mul(size as u64) > c.limit {
            return Err(HalError::InvalidArgument(format!(
                "{count} staging buffers of {len} bytes (class {size}) are above the pool limit \
                 of {} bytes",
                c.limit
            )));
        }
        let class = (size.trailing_zeros() - c.min_class.trailing_zeros()) as usize;
        Ok(Want {
            len,
            count,
            class,
            size,
            numa,
            pin,
        })
    }

    /// Takes what `want` asks for: the shelf and the buffers (`None`: a spare request found
    /// no room).
    fn acquire(&self, want: &Want<'_>, mode: Mode) -> Result<Option<(usize, Vec<HostBuffer>)>> {
        let inner = &*self.inner;
        let wait = match mode {
            Mode::Need(wait) => wait,
            Mode::Spare => Wait::No,
        };
        // Registered as a waiter before holders are asked to let go, so that a holder giving
        // lanes back after being asked sees it and returns them to the pool.
        let mut waiting: Option<Waiting<'_>> = None;
        let mut waited = false;
        let mut reclaimed = matches!(mode, Mode::Spare);
        let mut st = inner.state.lock_unpoisoned();
        loop {
            match inner.step(&mut st, want) {
                Step::Take {
                    shelf,
                    reused,
                    fresh,
                } => {
                    drop(st);
                    return inner
                        .finish(want, shelf, reused, fresh)
                        .map(|b| Some((shelf, b)));
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
                Step::NoRoom(_, _) if matches!(mode, Mode::Spare) => return Ok(None),
                Step::NoRoom(why, short) => {
                    let now = Instant::now();
                    let left = match wait {
                        Wait::Until(d) if now < d => Some(Some(d - now)),
                        Wait::Forever => Some(None),
                        _ => None,
                    };
                    if left.is_some() && waiting.is_none() {
                        waiting = Some(Waiting::new(&inner.waiters));
                    }
                    if !reclaimed {
                        reclaimed = true;
                        let holders: Vec<Arc<dyn StagingHolder>> =
                            st.holders.iter().filter_map(Weak::upgrade).collect();
                        if !holders.is_empty() {
                            drop(st);
                            let mut bytes = 0;
                            for h in &holders {
                                if bytes >= short {
                                    break;
                                }
                                bytes += h.release_idle(short - bytes);
                            }
                            // The last reference to a holder may go here: outside the lock.
                            drop(holders);
                            st = inner.state.lock_unpoisoned();
                            if bytes > 0 {
                                st.stats.reclaimed_bytes += bytes;
                                inner.publish(&st);
                            }
                            continue;
                        }
                    }
                    match left {
                        Some(left) => {
                            if !waited {
                                waited = true;
                                st.stats.waits += 1;
                                inner.publish(&st);
                            }
                            st = match left {
                                Some(t) => inner.returned.wait_timeout_unpoisoned(st, t).0,
                                None => inner.returned.wait_unpoisoned(st),
                            };
                            // Something came back (or time passed): holders may have idle
                            // buffers again.
                            reclaimed = false;
                        }
                        None => {
                            st.stats.failures += 1;
                            inner.publish(&st);
                            let waited = if waited { " after waiting" } else { "" };
                            let (len, size, count) = (want.len, want.size, want.count);
                            let what = if count == 1 {
                                format!("{len} bytes (class {size})")
                            } else {
                                format!("{count} x {len} bytes (class {size})")
                            };
                            return Err(HalError::Busy(format!(
                                "staging pool full{waited}: {what} wanted; {why}"
                            )));
                        }
                    }
                }
            }
        }
    }
}

/// How long a request with `timeout` may wait (a timeout too large for an `Instant` is as
/// good as forever).
fn deadline(timeout: Duration) -> Wait {
    Instant::now()
        .checked_add(timeout)
        .map_or(Wait::Forever, Wait::Until)
}

impl State {
    /// The index of the shelf for `numa` and `pinned`, made if missing.
    fn shelf(&mut self, numa: Option<u32>, pinned: bool, classes: usize) -> usize {
        if let Some(i) = self
            .shelves
            .iter()
            .position(|s| s.numa == numa && s.pinned == pinned)
        {
            return i;
        }
        self.shelves.push(Shelf {
            numa,
            pinned,
            free: (0..classes).map(|_| VecDeque::new()).collect(),
        });
        self.shelves.len() - 1
    }

    /// Bytes of free buffers, all shelves and classes.
    fn idle_bytes(&self) -> u64 {
        self.shelves
            .iter()
            .flat_map(|s| s.free.iter())
            .flat_map(|l| l.iter().map(|(_, b)| b.len() as u64))
            .sum()
    }
}

impl Inner {
    /// One decision under the lock; the accounting of `Take` is done here.
    fn step(&self, st: &mut State, want: &Want<'_>) -> Step {
        let classes = StagingPool::classes(&self.config);
        let shelf = st.shelf(want.numa, want.pin.is_some(), classes);
        let size = want.size as u64;
        let free_here = st.shelves[shelf].free[want.class].len();
        let reuse = free_here.min(want.count);
        let fresh = want.count - reuse;
        let need = fresh as u64 * size;
        let limit = self.config.limit;
        let pinned = st.stats.pinned_bytes;
        if pinned + need <= limit {
            // The most recently returned buffers of the class: their pages are the likeliest
            // warm.
            let list = &mut st.shelves[shelf].free[want.class];
            let reused: Vec<HostBuffer> = (0..reuse)
                .filter_map(|_| list.pop_back().map(|(_, b)| b))
                .collect();
            let s = &mut st.stats;
            s.reuses += reuse as u64;
            s.in_use_bytes += want.count as u64 * size;
            s.pinned_bytes += need;
            s.allocations += fresh as u64;
            s.peak_pinned_bytes = s.peak_pinned_bytes.max(s.pinned_bytes);
            self.publish(st);
            return Step::Take {
                shelf,
                reused,
                fresh,
            };
        }
        // Fresh buffers are needed, so every free one of the class is among those taken: only
        // idle buffers elsewhere can make room. Release only if that makes enough; otherwise
        // keep the free buffers for reuse.
        let idle = st.idle_bytes();
        let elsewhere = idle - free_here as u64 * size;
        if pinned - elsewhere + need > limit {
            return Step::NoRoom(
                format!(
                    "{pinned} of {limit} bytes pinned, {} handed out, {idle} idle",
                    st.stats.in_use_bytes
                ),
                pinned - elsewhere + need - limit,
            );
        }
        let mut victims = Vec::new();
        let mut freed = 0;
        while pinned - freed + need > limit {
            // The least recently returned buffer over every other list: each list's front.
            let oldest = st
                .shelves
                .iter()
                .enumerate()
                .flat_map(|(s, shelf)| shelf.free.iter().enumerate().map(move |(c, l)| (s, c, l)))
                .filter(|&(s, c, _)| (s, c) != (shelf, want.class))
                .filter_map(|(s, c, l)| l.front().map(|(t, _)| (*t, s, c)))
                .min();
            let Some((_, s, c)) = oldest else { break };
            if let Some((_, b)) = st.shelves[s].free[c].pop_front() {
                freed += b.len() as u64;
                victims.push(b);
            }
        }
        Step::Release(victims)
    }

    /// Allocates the `fresh` buffers a `Take` reserved, outside the lock. If one fails, what
    /// was taken goes back to the free list and the rest of the reservation is undone.
    fn finish(
        &self,
        want: &Want<'_>,
        shelf: usize,
        mut bufs: Vec<HostBuffer>,
        fresh: usize,
    ) -> Result<Vec<HostBuffer>> {
        let size = want.size as u64;
        for made in 0..fresh {
            match self.allocate(want) {
                Ok(b) => bufs.push(b),
                Err(e) => {
                    let mut st = self.state.lock_unpoisoned();
                    st.stats.pinned_bytes -= (fresh - made) as u64 * size;
                    st.stats.in_use_bytes -= want.count as u64 * size;
                    st.stats.failures += 1;
                    for b in bufs {
                        st.tick += 1;
                        let tick = st.tick;
                        st.shelves[shelf].free[want.class].push_back((tick, b));
                    }
                    self.publish(&st);
                    drop(st);
                    self.returned.notify_all();
                    return Err(e);
                }
            }
        }
        Ok(bufs)
    }

    fn allocate(&self, want: &Want<'_>) -> Result<HostBuffer> {
        let started = std::time::Instant::now();
        let opts = HostAllocOptions {
            numa: want.numa,
            huge_pages: self.config.huge_pages,
            ..HostAllocOptions::default()
        };
        let buffer = match want.pin {
            // Checked against what memory alone can back: pinned pages cannot be swapped out.
            Some(gpu) => HostBuffer::alloc_pinned(want.size, &opts, gpu),
            None => HostBuffer::alloc(want.size, &opts),
        };
        tracing::trace!(
            bytes = want.size,
            pinned = want.pin.is_some(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "staging buffer allocated"
        );
        buffer
    }

    /// Puts buffers handed out from `shelf`, class `class`, back on its free list.
    fn put_back(&self, shelf: usize, class: usize, bufs: Vec<HostBuffer>) {
        let mut st = self.state.lock_unpoisoned();
        for b in bufs {
            st.stats.in_use_bytes -= b.len() as u64;
            st.tick += 1;
            let tick = st.tick;
            st.shelves[shelf].free[class].push_back((tick, b));
        }
        self.publish(&st);
        drop(st);
        self.returned.notify_all();
    }

    /// Forgets `bytes` handed out that will not come back (their buffers were dropped by
    /// their holder): they are neither held nor in use any more.
    fn forget(&self, bytes: u64) {
        let mut st = self.state.lock_unpoisoned();
        st.stats.in_use_bytes -= bytes;
        st.stats.pinned_bytes -= bytes;
        self.publish(&st);
        drop(st);
        self.returned.notify_all();
    }

    fn publish(&self, st: &State) {
        if let Some(observe) = &self.observer {
            observe(&st.stats);
        }
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
