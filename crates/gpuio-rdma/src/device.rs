//! An opened RDMA device ([`RdmaDevice`]: context, port 1, a GID, the protection domain) and
//! its completion poller: one thread per device that polls every queue pair's completion queue
//! ([`Cq`]) while work is outstanding and hands each completion to the verb waiting for its work
//! request id ([`Completions`]), so threads sharing a queue pair each get their own. The id
//! bookkeeping is kept apart from the verbs library so that it is tested without a NIC.

use super::rdma_err;
use gpuio_hal::sync::{CondvarExt, MutexExt};
use gpuio_hal::{HalError, Result};
use rdma_sys::*;
use std::collections::HashMap;
use std::ffi::CStr;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h that the bindings leave out).
const LINK_LAYER_ETHERNET: u8 = 2;

/// An opened RDMA device (port 1), its protection domain and its completion-polling thread
/// (started with the first queue pair).
pub struct RdmaDevice {
    pub(super) ctx: NonNull<ibv_context>,
    pub(super) pd: NonNull<ibv_pd>,
    pub(super) poller: Arc<Poller>,
    name: String,
    pub(super) port: u8,
    pub(super) gid_index: u8,
    pub(super) gid: [u8; 16],
    pub(super) lid: u16,
    pub(super) mtu: ibv_mtu::Type,
}

// SAFETY: libibverbs contexts and protection domains may be used from any thread (the library
// locks internally); this type only hands out their pointers to verbs calls.
unsafe impl Send for RdmaDevice {}
// SAFETY: as above; no method mutates the struct itself.
unsafe impl Sync for RdmaDevice {}

impl std::fmt::Debug for RdmaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaDevice")
            .field("name", &self.name)
            .field("port", &self.port)
            .field("lid", &self.lid)
            .finish()
    }
}

/// The names of the RDMA devices present (empty where there are none).
pub fn device_names() -> Result<Vec<String>> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below after its names are copied.
    let list = unsafe { __ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(rdma_err("listing devices"));
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers; their names are C strings owned by
        // the list, copied out before it is freed.
        let name = unsafe { CStr::from_ptr(ibv_get_device_name(*list.add(i))) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: the list came from ibv_get_device_list and is freed once.
    unsafe { ibv_free_device_list(list) };
    Ok(names)
}

impl RdmaDevice {
    /// Opens the device called `name` (the first one when `None`), port 1, GID index
    /// `gid_index` (RoCE: 0 is the link-local address, 1 the first configured one).
    pub fn open(name: Option<&str>, gid_index: u8) -> Result<Arc<Self>> {
        let mut n = 0;
        // SAFETY: as in device_names.
        let list = unsafe { __ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(rdma_err("listing devices"));
        }
        let mut found = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a valid device's name is a C string it owns.
            let dn = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            if name.is_none_or(|want| want == dn) {
                found = Some((dev, dn));
                break;
            }
        }
        let opened = found.map(|(dev, dn)| {
            // SAFETY: `dev` is a valid device of the list, which is still alive here.
            (unsafe { ibv_open_device(dev) }, dn)
        });
        // SAFETY: the list came from ibv_get_device_list; opened contexts outlive it.
        unsafe { ibv_free_device_list(list) };
        let Some((ctx, dev_name)) = opened else {
            return Err(HalError::Unsupported {
                what: "RDMA",
                reason: match name {
                    Some(want) => format!("no RDMA device named {want:?}"),
                    None => "no RDMA device on this machine".into(),
                },
            });
        };
        let ctx = NonNull::new(ctx).ok_or_else(|| rdma_err("opening the device"))?;
        let close = |e: HalError| {
            // SAFETY: the context was opened above and nothing else refers to it yet.
            unsafe { ibv_close_device(ctx.as_ptr()) };
            e
        };
        // SAFETY: a zeroed ibv_port_attr is a valid out-parameter; ctx is open.
        let mut port_attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is open and port_attr is a valid, writable ibv_port_attr.
        if unsafe { ___ibv_query_port(ctx.as_ptr(), 1, &mut port_attr) } != 0 {
            return Err(close(rdma_err("querying port 1")));
        }
        // SAFETY: a zeroed ibv_gid is a valid out-parameter.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is open and gid is a valid, writable ibv_gid.
        if unsafe { ibv_query_gid(ctx.as_ptr(), 1, i32::from(gid_index), &mut gid) } != 0 {
            return Err(close(rdma_err("querying the GID")));
        }
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        let raw = unsafe { gid.raw };
        if raw == [0; 16] && port_attr.link_layer == LINK_LAYER_ETHERNET {
            return Err(close(HalError::Unsupported {
                what: "RDMA",
                reason: format!("GID index {gid_index} of {dev_name} is not configured"),
            }));
        }
        // SAFETY: ctx is open.
        let pd = unsafe { ibv_alloc_pd(ctx.as_ptr()) };
        let pd =
            NonNull::new(pd).ok_or_else(|| close(rdma_err("allocating a protection domain")))?;
        Ok(Arc::new(Self {
            ctx,
            pd,
            poller: Arc::default(),
            name: dev_name,
            port: 1,
            gid_index,
            gid: raw,
            lid: port_attr.lid,
            mtu: port_attr.active_mtu,
        }))
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for RdmaDevice {
    fn drop(&mut self) {
        // No queue pair is left, so the poller polls nothing; it exits on its own (this may
        // run on its thread, so it is not joined).
        self.poller.shut_down();
        // SAFETY: every region and queue pair holds an Arc of this device, so none is left;
        // the PD and the context were created in `open` and are released once, PD first.
        unsafe {
            ibv_dealloc_pd(self.pd.as_ptr());
            ibv_close_device(self.ctx.as_ptr());
        }
    }
}

/// How one work request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Completion {
    pub(super) status: ibv_wc_status::Type,
    pub(super) bytes: u32,
}

/// The completions reaped from one completion queue and not yet taken, by work request id,
/// and the count of work requests still due on it.
#[derive(Default)]
pub(super) struct Completions {
    done: Mutex<HashMap<u64, Completion>>,
    ready: Condvar,
    /// Work requests posted on its queue pair and not reaped yet.
    pending: AtomicUsize,
    /// Polling it failed (an overrun): nothing more will complete.
    broken: AtomicBool,
}

impl Completions {
    /// Hands over reaped completions (at least one) and wakes the waiters.
    fn deliver(&self, reaped: impl IntoIterator<Item = (u64, Completion)>) {
        let mut done = self.done.lock_unpoisoned();
        let mut n = 0;
        for (id, c) in reaped {
            done.insert(id, c);
            n += 1;
        }
        drop(done);
        self.pending.fetch_sub(n, Ordering::AcqRel);
        self.ready.notify_all();
    }

    /// Marks the queue broken (polling it failed) and wakes the waiters: nothing more will
    /// complete.
    fn fail(&self) {
        self.broken.store(true, Ordering::Release);
        self.ready.notify_all();
    }

    /// Waits until work request `id` completes, at most until `deadline`.
    pub(super) fn wait(&self, id: u64, deadline: Instant) -> Option<Completion> {
        let mut done = self.done.lock_unpoisoned();
        loop {
            if let Some(c) = done.remove(&id) {
                return Some(c);
            }
            let now = Instant::now();
            if now >= deadline || self.broken.load(Ordering::Acquire) {
                return None;
            }
            done = self.ready.wait_timeout_unpoisoned(done, deadline - now).0;
        }
    }
}

/// A completion queue and the completions the poller has reaped from it, by work request.
pub(super) struct Cq {
    cq: NonNull<ibv_cq>,
    pub(super) completions: Completions,
}

// SAFETY: a CQ may be polled from any thread; the poller is the only one that polls it (under
// the poller's list lock), and it is destroyed once, in Drop, after leaving that list.
unsafe impl Send for Cq {}
// SAFETY: as above; the rest of its state is behind a mutex or atomics.
unsafe impl Sync for Cq {}

impl Cq {
    /// Takes over a completion queue, to destroy it when dropped.
    ///
    /// # Safety
    /// `cq` was created by `ibv_create_cq`, nothing else destroys it, and its device's
    /// context stays open until the `Cq` drops (its queue pair holds the device).
    pub(super) unsafe fn new(cq: NonNull<ibv_cq>) -> Self {
        Self {
            cq,
            completions: Completions::default(),
        }
    }

    /// The verbs library's handle, for creating its queue pair.
    pub(super) fn as_ptr(&self) -> *mut ibv_cq {
        self.cq.as_ptr()
    }

    /// Moves what completed into `done` and wakes the waiters; returns how many.
    fn reap(&self, wcs: &mut [ibv_wc]) -> usize {
        // SAFETY: the CQ is alive and `wcs` has room for `wcs.len()` completions.
        let n = unsafe { ibv_poll_cq(self.cq.as_ptr(), wcs.len() as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            self.completions.fail();
            return 0;
        }
        let n = n as usize;
        if n > 0 {
            self.completions.deliver(wcs[..n].iter().map(|wc| {
                (
                    wc.wr_id,
                    Completion {
                        status: wc.status,
                        bytes: wc.byte_len,
                    },
                )
            }));
        }
        n
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created by QueuePair::new, destroyed once; its queue pair is destroyed and
        // the poller no longer lists it.
        unsafe { ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

/// A device's completion-polling thread: it polls every queue pair's completion queue while
/// work is outstanding and sleeps while none is; verbs wait for their own completions, which
/// it hands over by work request id. One thread serves all queue pairs of the device, so
/// threads sharing a queue pair each get their own completions.
#[derive(Default)]
pub(super) struct Poller {
    cqs: Mutex<Vec<Arc<Cq>>>,
    /// Work requests posted and not reaped, on every listed queue.
    pending: AtomicUsize,
    /// Whether the thread sleeps (it is woken by a post).
    sleeping: Mutex<bool>,
    wake: Condvar,
    stop: AtomicBool,
    started: Mutex<bool>,
}

impl Poller {
    /// Starts the thread, once.
    pub(super) fn start(self: &Arc<Self>) -> Result<()> {
        let mut started = self.started.lock_unpoisoned();
        if !*started {
            let me = self.clone();
            std::thread::Builder::new()
                .name("gpuio-rdma-cq".into())
                .spawn(move || me.run())
                .map_err(|e| HalError::Os {
                    op: "spawning the RDMA completion thread",
                    source: e,
                })?;
            *started = true;
        }
        Ok(())
    }

    /// Adds a queue to the polled list (its queue pair was just created).
    pub(super) fn add(&self, cq: Arc<Cq>) {
        self.cqs.lock_unpoisoned().push(cq);
    }

    /// Counts a work request about to be posted on `cq` (and wakes the thread if it sleeps).
    pub(super) fn posted(&self, cq: &Completions) {
        cq.pending.fetch_add(1, Ordering::AcqRel);
        self.pending.fetch_add(1, Ordering::AcqRel);
        if *self.sleeping.lock_unpoisoned() {
            self.wake.notify_one();
        }
    }

    /// Takes back the count of a work request that could not be posted after all.
    pub(super) fn unposted(&self, cq: &Completions) {
        cq.pending.fetch_sub(1, Ordering::AcqRel);
        self.pending.fetch_sub(1, Ordering::AcqRel);
    }

    /// Takes a queue out of the polled list (its queue pair is destroyed): its completions
    /// still outstanding will never come.
    pub(super) fn remove(&self, cq: &Arc<Cq>) {
        let mut cqs = self.cqs.lock_unpoisoned();
        cqs.retain(|c| !Arc::ptr_eq(c, cq));
        self.pending.fetch_sub(
            cq.completions.pending.swap(0, Ordering::AcqRel),
            Ordering::AcqRel,
        );
    }

    fn shut_down(&self) {
        self.stop.store(true, Ordering::Release);
        let _sleeping = self.sleeping.lock_unpoisoned();
        self.wake.notify_one();
    }

    fn run(self: Arc<Self>) {
        // SAFETY: ibv_wc is plain integers (and a union of integers): zero is a valid value.
        let mut wcs: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
        let mut idle = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            if self.pending.load(Ordering::Acquire) == 0 {
                let mut sleeping = self.sleeping.lock_unpoisoned();
                *sleeping = true;
                while self.pending.load(Ordering::Acquire) == 0
                    && !self.stop.load(Ordering::Acquire)
                {
                    sleeping = self
                        .wake
                        .wait_timeout_unpoisoned(sleeping, Duration::from_millis(100))
                        .0;
                }
                *sleeping = false;
                continue;
            }
            let mut reaped = 0;
            for cq in self.cqs.lock_unpoisoned().iter() {
                reaped += cq.reap(&mut wcs);
            }
            if reaped > 0 {
                self.pending.fetch_sub(reaped, Ordering::AcqRel);
                idle = 0;
            } else {
                // Spin while completions are due soon; give the core away on a long wait.
                idle += 1;
                if idle > 256 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(bytes: u32) -> Completion {
        Completion {
            status: ibv_wc_status::IBV_WC_SUCCESS,
            bytes,
        }
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn completions_go_to_the_verb_waiting_for_their_id() {
        let poller = Poller::default();
        let c = Completions::default();
        for _ in 0..3 {
            poller.posted(&c);
        }
        assert_eq!(c.pending.load(Ordering::Acquire), 3);
        assert_eq!(poller.pending.load(Ordering::Acquire), 3);
        // Reaped out of order, before anyone waits: each is kept for its own id.
        c.deliver([(12, done(300)), (10, done(100))]);
        assert_eq!(c.pending.load(Ordering::Acquire), 1);
        assert_eq!(c.wait(10, soon()), Some(done(100)));
        assert_eq!(c.wait(12, soon()), Some(done(300)));
        // Taken once: a second wait for the same id gets nothing.
        assert_eq!(c.wait(10, Instant::now()), None);
        // A verb waiting on another thread gets its completion, before or after it waits.
        std::thread::scope(|s| {
            let waiter = s.spawn(|| c.wait(11, soon()));
            c.deliver([(11, done(200))]);
            assert_eq!(waiter.join().unwrap(), Some(done(200)));
        });
        assert_eq!(c.pending.load(Ordering::Acquire), 0);
    }

    #[test]
    fn a_failed_completion_is_handed_over_with_its_status() {
        let c = Completions::default();
        let failed = Completion {
            status: ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
            bytes: 0,
        };
        c.deliver([(5, failed)]);
        assert_eq!(c.wait(5, soon()), Some(failed));
    }

    #[test]
    fn waits_end_at_the_deadline_or_when_the_queue_breaks() {
        let c = Completions::default();
        let start = Instant::now();
        assert_eq!(c.wait(1, start + Duration::from_millis(20)), None);
        assert!(start.elapsed() >= Duration::from_millis(20));
        std::thread::scope(|s| {
            let waiter = s.spawn(|| c.wait(2, soon()));
            std::thread::sleep(Duration::from_millis(10));
            c.fail();
            assert_eq!(waiter.join().unwrap(), None);
        });
        // Broken: a completion in hand is still handed over; any other wait ends at once.
        c.deliver([(3, done(8))]);
        assert_eq!(c.wait(3, soon()), Some(done(8)));
        let start = Instant::now();
        assert_eq!(c.wait(4, soon()), None);
        assert!(start.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn a_request_that_was_not_posted_is_not_waited_for() {
        let poller = Poller::default();
        let c = Completions::default();
        poller.posted(&c);
        poller.posted(&c);
        poller.unposted(&c);
        assert_eq!(c.pending.load(Ordering::Acquire), 1);
        assert_eq!(poller.pending.load(Ordering::Acquire), 1);
    }
}
