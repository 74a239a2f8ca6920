//! RDMA verbs (libibverbs through rdma-sys, cargo feature `rdma`): a device with its
//! protection domain and completion-polling thread, memory regions, and reliable-connected
//! queue pairs, behind safe types. Every verb blocks until its work requests complete; the
//! device's polling thread reaps the completions and hands each to the verb waiting for it.
//!
//! Two kinds of registered memory:
//! - [`RdmaBuffer`] owns its host memory: local ends of reads, writes, sends, receives and
//!   atomics.
//! - [`HostRegion`] registers a range of a [`HostBuffer`]: exposed to remote peers (an agent's
//!   memory export), and the local end of verbs on borrowed slices inside it. Remote NICs read
//!   and write an exposed region whenever they are permitted to, like a GPU writing mapped
//!   pinned memory: its bytes can change under a reader, and gpuio only ever copies them,
//!   never interprets them. The region keeps the mapping alive until it is deregistered.
//!
//! Verbs that let the NIC write local memory take it by `&mut`, so no Rust reference can
//! observe the bytes while the NIC writes them, and they return only when the NIC is done.

use crate::error::{ErrorCode, HalError, Result};
use crate::memory::{HostAllocOptions, HostBuffer, MappingHold};
use rdma_sys::*;
use std::collections::HashMap;
use std::ffi::CStr;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A verb that failed with `errno` set.
fn rdma_err(op: &'static str) -> HalError {
    let e = std::io::Error::last_os_error();
    HalError::Rdma {
        op,
        code: ErrorCode::from_io(&e),
        message: e.to_string(),
    }
}

/// A verb that failed with a return code (an errno value).
fn rc_err(op: &'static str, rc: i32) -> HalError {
    let e = std::io::Error::from_raw_os_error(rc.abs());
    HalError::Rdma {
        op,
        code: ErrorCode::from_io(&e),
        message: e.to_string(),
    }
}

/// `IBV_LINK_LAYER_ETHERNET` (an anonymous enum in verbs.h that the bindings leave out).
const LINK_LAYER_ETHERNET: u8 = 2;

/// How a peer's NIC may use a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RdmaAccess {
    /// One-sided reads.
    pub remote_read: bool,
    /// One-sided writes.
    pub remote_write: bool,
    /// Atomic compare-and-swap and fetch-and-add.
    pub remote_atomic: bool,
}

impl RdmaAccess {
    fn flags(self) -> u32 {
        let mut f = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if self.remote_read {
            f |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        if self.remote_write {
            f |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if self.remote_atomic {
            f |= ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        }
        f
    }
}

/// An opened RDMA device (port 1), its protection domain and its completion-polling thread
/// (started with the first queue pair).
pub struct RdmaDevice {
    ctx: NonNull<ibv_context>,
    pd: NonNull<ibv_pd>,
    poller: Arc<Poller>,
    name: String,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    lid: u16,
    mtu: ibv_mtu::Type,
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

/// A memory registration; deregistered on drop.
struct Registration {
    mr: NonNull<ibv_mr>,
    _dev: Arc<RdmaDevice>,
}

// SAFETY: a memory region is a handle the NIC uses; deregistering it from any thread is allowed.
unsafe impl Send for Registration {}
// SAFETY: no method mutates it.
unsafe impl Sync for Registration {}

impl Registration {
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    /// The range must stay mapped until the registration drops.
    unsafe fn new(
        dev: &Arc<RdmaDevice>,
        addr: *mut u8,
        len: usize,
        access: RdmaAccess,
    ) -> Result<Self> {
        // SAFETY: the PD is alive (dev), and the caller keeps the range mapped.
        let mr = unsafe { __ibv_reg_mr(dev.pd.as_ptr(), addr.cast(), len, access.flags(), 0) };
        let mr = NonNull::new(mr).ok_or_else(|| rdma_err("registering memory"))?;
        Ok(Self {
            mr,
            _dev: dev.clone(),
        })
    }

    fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered until drop.
        unsafe { self.mr.as_ref().lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { self.mr.as_ref().rkey }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: registered in `new`, deregistered once; the memory is still mapped (the
        // owners drop their memory or mapping hold after this).
        unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

/// The scatter-gather entry of `len` bytes at `addr` under `lkey`.
fn sge_at(addr: u64, len: usize, lkey: u32) -> Result<ibv_sge> {
    let length = u32::try_from(len).map_err(|_| {
        HalError::InvalidArgument(format!("an RDMA work request of {len} bytes (limit 4 GiB)"))
    })?;
    Ok(ibv_sge { addr, length, lkey })
}

/// Host memory of its own, registered with a device: the local end of verbs.
pub struct RdmaBuffer {
    // Declared first: deregistered before the memory goes.
    reg: Registration,
    buf: HostBuffer,
}

impl std::fmt::Debug for RdmaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaBuffer")
            .field("len", &self.buf.len())
            .finish()
    }
}

impl RdmaBuffer {
    /// `len` bytes of host memory registered with `dev` for local use.
    pub fn new(dev: &Arc<RdmaDevice>, len: usize) -> Result<Self> {
        let buf = HostBuffer::alloc(len.max(8), &HostAllocOptions::default())?;
        // SAFETY: the registration is dropped before `buf` (field order), which keeps the
        // memory mapped until then.
        let reg =
            unsafe { Registration::new(dev, buf.base_ptr(), buf.len(), RdmaAccess::default())? };
        Ok(Self { reg, buf })
    }

    /// Its bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf
    }

    /// Its bytes, to fill before a write or send.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether it is empty (never: at least 8 bytes).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    fn sge(&self, offset: usize, len: usize) -> Result<ibv_sge> {
        crate::check_range("RDMA local buffer", offset, len, self.buf.len())?;
        sge_at(
            self.buf.base_ptr() as u64 + offset as u64,
            len,
            self.reg.lkey(),
        )
    }
}

/// A range of a [`HostBuffer`] registered with a device: exposed to peers' one-sided verbs
/// (an agent's memory export), and the local end of verbs on slices that lie inside it (the
/// core's registration cache hands these out for callers' memory, so transfers land in place
/// with no staging copy).
///
/// The region keeps the buffer's mapping alive (its pages leak if the buffer drops first), so
/// the registered addresses can never belong to another mapping: a slice inside the range is
/// memory this registration covers.
pub struct HostRegion {
    // Declared first: deregistered before the mapping hold is released.
    reg: Registration,
    _hold: MappingHold,
    addr: u64,
    len: usize,
}

impl std::fmt::Debug for HostRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegion")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .finish()
    }
}

impl HostRegion {
    /// Registers `range` of `buf` with `dev`, permitting peers `access` (none: local use
    /// only).
    pub fn new(
        dev: &Arc<RdmaDevice>,
        buf: &HostBuffer,
        range: Range<usize>,
        access: RdmaAccess,
    ) -> Result<Self> {
        crate::check_range("RDMA region", range.start, range.len(), buf.len())?;
        if range.is_empty() {
            return Err(HalError::InvalidArgument(
                "an RDMA region needs at least one byte".into(),
            ));
        }
        let hold = buf.hold_mapping();
        let start = buf.base_ptr().wrapping_add(range.start);
        // SAFETY: `hold` keeps the mapping until after the registration drops (field order).
        // Remote writes race local readers of the bytes of an exposed region; the module docs
        // say why that is accepted (plain bytes, only copied, as with GPU-written mapped
        // memory).
        let reg = unsafe { Registration::new(dev, start, range.len(), access)? };
        Ok(Self {
            reg,
            _hold: hold,
            addr: start as u64,
            len: range.len(),
        })
    }

    /// What a peer needs to reach it.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr,
            len: self.len as u64,
            rkey: self.reg.rkey(),
        }
    }

    /// Whether `bytes` lie inside the registered range.
    pub fn contains(&self, bytes: &[u8]) -> bool {
        let start = bytes.as_ptr() as u64;
        start >= self.addr && start + bytes.len() as u64 <= self.addr + self.len as u64
    }

    /// The entry for `len` bytes of a slice at `addr`, after checking they lie inside.
    fn sge(&self, bytes: &[u8]) -> Result<ibv_sge> {
        if !self.contains(bytes) {
            return Err(HalError::InvalidArgument(format!(
                "{} bytes at {:#x} are outside the registered region {:#x}+{}",
                bytes.len(),
                bytes.as_ptr() as u64,
                self.addr,
                self.len
            )));
        }
        sge_at(bytes.as_ptr() as u64, bytes.len(), self.reg.lkey())
    }
}

/// A region of a peer: its virtual address, length and remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Virtual address of its first byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// The key its owner's NIC checks.
    pub rkey: u32,
}

impl RemoteRegion {
    fn at(&self, offset: u64, len: usize) -> Result<u64> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(self.addr + offset),
            _ => Err(HalError::InvalidArgument(format!(
                "{offset}+{len} is outside the remote region ({} bytes)",
                self.len
            ))),
        }
    }
}

/// What a peer needs to connect a queue pair to ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaEndpoint {
    /// Queue pair number.
    pub qp_num: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID (RoCE).
    pub gid: [u8; 16],
}

/// How one work request ended.
#[derive(Debug, Clone, Copy)]
struct Completion {
    status: ibv_wc_status::Type,
    bytes: u32,
}

/// A completion queue and the completions the poller has reaped from it, by work request.
struct Cq {
    cq: NonNull<ibv_cq>,
    done: Mutex<HashMap<u64, Completion>>,
    ready: Condvar,
    /// Work requests posted on its queue pair and not reaped yet.
    pending: AtomicUsize,
    /// Polling it failed (an overrun): nothing more will complete.
    broken: AtomicBool,
}

// SAFETY: a CQ may be polled from any thread; the poller is the only one that polls it (under
// the poller's list lock), and it is destroyed once, in Drop, after leaving that list.
unsafe impl Send for Cq {}
// SAFETY: as above; the rest of its state is behind a mutex or atomics.
unsafe impl Sync for Cq {}

impl Cq {
    /// Moves what completed into `done` and wakes the waiters; returns how many.
    fn reap(&self, wcs: &mut [ibv_wc]) -> usize {
        // SAFETY: the CQ is alive and `wcs` has room for `wcs.len()` completions.
        let n = unsafe { ibv_poll_cq(self.cq.as_ptr(), wcs.len() as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            self.broken.store(true, Ordering::Release);
            self.ready.notify_all();
            return 0;
        }
        let n = n as usize;
        if n > 0 {
            let mut done = lock(&self.done);
            for wc in &wcs[..n] {
                done.insert(
                    wc.wr_id,
                    Completion {
                        status: wc.status,
                        bytes: wc.byte_len,
                    },
                );
            }
            drop(done);
            self.pending.fetch_sub(n, Ordering::AcqRel);
            self.ready.notify_all();
        }
        n
    }

    /// Waits until work request `id` completes, at most until `deadline`.
    fn wait(&self, id: u64, deadline: Instant) -> Option<Completion> {
        let mut done = lock(&self.done);
        loop {
            if let Some(c) = done.remove(&id) {
                return Some(c);
            }
            let now = Instant::now();
            if now >= deadline || self.broken.load(Ordering::Acquire) {
                return None;
            }
            done = self
                .ready
                .wait_timeout(done, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created by QueuePair::new, destroyed once; its queue pair is destroyed and
        // the poller no longer lists it.
        unsafe { ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

/// The poisoning-tolerant lock: every update under these locks completes before anything
/// that can panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A device's completion-polling thread: it polls every queue pair's completion queue while
/// work is outstanding and sleeps while none is; verbs wait for their own completions, which
/// it hands over by work request id. One thread serves all queue pairs of the device, so
/// threads sharing a queue pair each get their own completions.
#[derive(Default)]
struct Poller {
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
    fn start(self: &Arc<Self>) -> Result<()> {
        let mut started = lock(&self.started);
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

    fn posted(&self, cq: &Cq) {
        cq.pending.fetch_add(1, Ordering::AcqRel);
        self.pending.fetch_add(1, Ordering::AcqRel);
        if *lock(&self.sleeping) {
            self.wake.notify_one();
        }
    }

    /// Takes a queue out of the polled list (its queue pair is destroyed): its completions
    /// still outstanding will never come.
    fn remove(&self, cq: &Arc<Cq>) {
        let mut cqs = lock(&self.cqs);
        cqs.retain(|c| !Arc::ptr_eq(c, cq));
        self.pending
            .fetch_sub(cq.pending.swap(0, Ordering::AcqRel), Ordering::AcqRel);
    }

    fn shut_down(&self) {
        self.stop.store(true, Ordering::Release);
        let _sleeping = lock(&self.sleeping);
        self.wake.notify_one();
    }

    fn run(self: Arc<Self>) {
        // SAFETY: ibv_wc is plain integers (and a union of integers): zero is a valid value.
        let mut wcs: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
        let mut idle = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            if self.pending.load(Ordering::Acquire) == 0 {
                let mut sleeping = lock(&self.sleeping);
                *sleeping = true;
                while self.pending.load(Ordering::Acquire) == 0
                    && !self.stop.load(Ordering::Acquire)
                {
                    sleeping = self
                        .wake
                        .wait_timeout(sleeping, Duration::from_millis(100))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                *sleeping = false;
                continue;
            }
            let mut reaped = 0;
            for cq in lock(&self.cqs).iter() {
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

/// Bytes one work request moves at most; longer transfers are several requests.
const MAX_WORK_BYTES: usize = 1 << 30;

/// Work requests of one call posted before waiting for them.
const WINDOW: usize = 16;

/// What one work request does.
#[derive(Clone, Copy)]
enum Op {
    Read {
        addr: u64,
        rkey: u32,
    },
    Write {
        addr: u64,
        rkey: u32,
    },
    CompareSwap {
        addr: u64,
        rkey: u32,
        expect: u64,
        swap: u64,
    },
    FetchAdd {
        addr: u64,
        rkey: u32,
        add: u64,
    },
    Send,
    Recv,
}

/// A reliable-connected queue pair with its own completion queue, polled by the device's
/// completion thread. Verbs take `&self`: threads may share a queue pair, each waiting for its
/// own work requests. Each verb returns once its work requests have completed, or once the
/// queue pair has been moved to the error state after a timeout, so the NIC is done with the
/// memory a verb borrows before the borrow ends.
pub struct QueuePair {
    qp: NonNull<ibv_qp>,
    cq: Arc<Cq>,
    dev: Arc<RdmaDevice>,
    timeout: Duration,
    next_wr: AtomicU64,
    /// In the error state (a work request failed, or a verb timed out): every later verb
    /// fails.
    failed: AtomicBool,
}

// SAFETY: libibverbs verbs are thread-safe; the QP is only posted to (the poller polls its
// CQ), and destroyed once in Drop.
unsafe impl Send for QueuePair {}
// SAFETY: as above; its own state is atomics.
unsafe impl Sync for QueuePair {}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("endpoint", &self.endpoint())
            .finish()
    }
}

/// Work requests a queue pair holds at once, per direction.
const DEPTH: u32 = 64;

impl QueuePair {
    /// A queue pair on `dev` in the INIT state; `timeout` bounds each verb's wait.
    pub fn new(dev: &Arc<RdmaDevice>, timeout: Duration) -> Result<Self> {
        dev.poller.start()?;
        // SAFETY: the context is open; no completion channel, no vector.
        let cq = unsafe {
            ibv_create_cq(
                dev.ctx.as_ptr(),
                DEPTH as i32 * 2,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        let cq = Arc::new(Cq {
            cq: NonNull::new(cq).ok_or_else(|| rdma_err("creating a completion queue"))?,
            done: Mutex::new(HashMap::new()),
            ready: Condvar::new(),
            pending: AtomicUsize::new(0),
            broken: AtomicBool::new(false),
        });
        // SAFETY: a zeroed ibv_qp_init_attr is valid; the fields that matter are set below.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq.as_ptr();
        init.recv_cq = cq.cq.as_ptr();
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = DEPTH;
        init.cap.max_recv_wr = DEPTH;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.sq_sig_all = 1;
        // SAFETY: the PD is alive and `init` is a valid attribute block.
        let qp = unsafe { ibv_create_qp(dev.pd.as_ptr(), &mut init) };
        // On failure the CQ drops (destroyed) with `cq`; it was never listed.
        let qp = NonNull::new(qp).ok_or_else(|| rdma_err("creating a queue pair"))?;
        lock(&dev.poller.cqs).push(cq.clone());
        let this = Self {
            qp,
            cq,
            dev: dev.clone(),
            timeout,
            next_wr: AtomicU64::new(1),
            failed: AtomicBool::new(false),
        };
        // SAFETY: zeroed attributes are valid; INIT needs these four.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = dev.port;
        attr.qp_access_flags = RdmaAccess {
            remote_read: true,
            remote_write: true,
            remote_atomic: true,
        }
        .flags();
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        this.modify(&mut attr, mask, "moving a queue pair to INIT")?;
        Ok(this)
    }

    fn modify(
        &self,
        attr: &mut ibv_qp_attr,
        mask: ibv_qp_attr_mask,
        op: &'static str,
    ) -> Result<()> {
        // SAFETY: the QP is alive and `attr` is a valid attribute block for `mask`.
        let rc = unsafe { ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as i32) };
        if rc != 0 {
            return Err(rc_err(op, rc));
        }
        Ok(())
    }

    /// What the peer needs to connect to this queue pair.
    pub fn endpoint(&self) -> RdmaEndpoint {
        RdmaEndpoint {
            // SAFETY: the QP is alive until drop.
            qp_num: unsafe { self.qp.as_ref().qp_num },
            lid: self.dev.lid,
            gid: self.dev.gid,
        }
    }

    /// Connects to the peer's queue pair: INIT → RTR → RTS.
    pub fn connect(&mut self, peer: &RdmaEndpoint) -> Result<()> {
        // SAFETY: zeroed attributes are valid; RTR needs the fields set here.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = self.dev.mtu;
        attr.dest_qp_num = peer.qp_num;
        attr.rq_psn = 0;
        attr.max_dest_rd_atomic = 16;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = peer.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = self.dev.port;
        if peer.gid != [0; 16] {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = peer.gid;
            attr.ah_attr.grh.sgid_index = self.dev.gid_index;
            attr.ah_attr.grh.hop_limit = 64;
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, mask, "moving a queue pair to RTR")?;
        // SAFETY: as above, for RTS.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.sq_psn = 0;
        attr.max_rd_atomic = 16;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask, "moving a queue pair to RTS")
    }

    /// Whether it is in the error state (a work request failed or a verb timed out): every
    /// verb now fails, and only a new queue pair serves the peer again.
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Reads `len` bytes of the peer's `remote` region at `remote_off` into `local` at
    /// `local_off`.
    pub fn read(
        &self,
        local: &mut RdmaBuffer,
        local_off: usize,
        remote: &RemoteRegion,
        remote_off: u64,
        len: usize,
    ) -> Result<()> {
        let sge = local.sge(local_off, len)?;
        let addr = remote.at(remote_off, len)?;
        let rkey = remote.rkey;
        self.run(&[(sge, Op::Read { addr, rkey })], "RDMA read")
            .map(|_| ())
    }

    /// Writes `len` bytes of `local` at `local_off` to the peer's `remote` region at
    /// `remote_off`.
    pub fn write(
        &self,
        local: &RdmaBuffer,
        local_off: usize,
        remote: &RemoteRegion,
        remote_off: u64,
        len: usize,
    ) -> Result<()> {
        let sge = local.sge(local_off, len)?;
        let addr = remote.at(remote_off, len)?;
        let rkey = remote.rkey;
        self.run(&[(sge, Op::Write { addr, rkey })], "RDMA write")
            .map(|_| ())
    }

    /// Reads `dst.len()` bytes of the peer's `remote` region at `remote_off` straight into
    /// `dst`, which must lie inside `region` (no staging copy).
    pub fn read_into(
        &self,
        region: &HostRegion,
        dst: &mut [u8],
        remote: &RemoteRegion,
        remote_off: u64,
    ) -> Result<()> {
        let work = one_sided(region, dst, remote, remote_off, |addr, rkey| Op::Read {
            addr,
            rkey,
        })?;
        self.run(&work, "RDMA read").map(|_| ())
    }

    /// Writes `src` to the peer's `remote` region at `remote_off` straight from `src`, which
    /// must lie inside `region`.
    pub fn write_from(
        &self,
        region: &HostRegion,
        src: &[u8],
        remote: &RemoteRegion,
        remote_off: u64,
    ) -> Result<()> {
        let work = one_sided(region, src, remote, remote_off, |addr, rkey| Op::Write {
            addr,
            rkey,
        })?;
        self.run(&work, "RDMA write").map(|_| ())
    }

    /// Atomic compare-and-swap of the 8-byte word at `remote_off` (8-aligned): if it holds
    /// `expect`, it becomes `swap`. Returns the word it held.
    pub fn compare_swap(
        &self,
        scratch: &mut RdmaBuffer,
        remote: &RemoteRegion,
        remote_off: u64,
        expect: u64,
        swap: u64,
    ) -> Result<u64> {
        self.atomic(scratch, remote, remote_off, |addr, rkey| Op::CompareSwap {
            addr,
            rkey,
            expect,
            swap,
        })
    }

    /// Atomic fetch-and-add on the 8-byte word at `remote_off` (8-aligned). Returns the word it
    /// held.
    pub fn fetch_add(
        &self,
        scratch: &mut RdmaBuffer,
        remote: &RemoteRegion,
        remote_off: u64,
        add: u64,
    ) -> Result<u64> {
        self.atomic(scratch, remote, remote_off, |addr, rkey| Op::FetchAdd {
            addr,
            rkey,
            add,
        })
    }

    fn atomic(
        &self,
        scratch: &mut RdmaBuffer,
        remote: &RemoteRegion,
        remote_off: u64,
        op: impl FnOnce(u64, u32) -> Op,
    ) -> Result<u64> {
        if !remote_off.is_multiple_of(8) {
            return Err(HalError::InvalidArgument(format!(
                "an atomic needs an 8-byte aligned offset, not {remote_off}"
            )));
        }
        let sge = scratch.sge(0, 8)?;
        let addr = remote.at(remote_off, 8)?;
        self.run(&[(sge, op(addr, remote.rkey))], "RDMA atomic")?;
        let mut word = [0u8; 8];
        word.copy_from_slice(&scratch.as_slice()[..8]);
        // Atomics return the old value in the host's byte order.
        Ok(u64::from_ne_bytes(word))
    }

    /// Sends `len` bytes of `local` at `local_off` (the peer must have a receive posted).
    pub fn send(&self, local: &RdmaBuffer, local_off: usize, len: usize) -> Result<()> {
        let sge = local.sge(local_off, len)?;
        self.run(&[(sge, Op::Send)], "send").map(|_| ())
    }

    /// Posts a receive into `local` at `local_off` (up to `len` bytes) and waits for the
    /// message; returns its length.
    pub fn recv(&self, local: &mut RdmaBuffer, local_off: usize, len: usize) -> Result<usize> {
        let sge = local.sge(local_off, len)?;
        self.run(&[(sge, Op::Recv)], "receive")
    }

    /// Posts `work` (in windows of [`WINDOW`]) and waits for all of it; returns the bytes the
    /// last request completed with. The memory the entries point at is borrowed by the
    /// caller until this returns, and this returns only when the NIC is done with it: every
    /// posted request completed, or the queue pair was moved to the error state.
    fn run(&self, work: &[(ibv_sge, Op)], what: &'static str) -> Result<usize> {
        if self.is_failed() {
            return Err(HalError::Rdma {
                op: what,
                message: "the queue pair failed earlier (a work request failed or timed out)"
                    .into(),
                code: ErrorCode::Network,
            });
        }
        let mut bytes = 0;
        for window in work.chunks(WINDOW) {
            let mut ids = Vec::with_capacity(window.len());
            let mut first_err = None;
            for (sge, op) in window {
                match self.post(*sge, *op) {
                    Ok(id) => ids.push(id),
                    Err(e) => {
                        first_err = Some(e);
                        break;
                    }
                }
            }
            let deadline = Instant::now() + self.timeout;
            for (i, &id) in ids.iter().enumerate() {
                let Some(c) = self.cq.wait(id, deadline) else {
                    self.abort(&ids[i..]);
                    return Err(HalError::TimedOut {
                        what,
                        after: self.timeout,
                    });
                };
                if c.status != ibv_wc_status::IBV_WC_SUCCESS {
                    // A failed request puts the queue pair in the error state: the rest of the
                    // window completes as flushed; keep waiting for it.
                    self.failed.store(true, Ordering::Release);
                    first_err.get_or_insert_with(|| completion_err(what, c.status));
                }
                bytes = c.bytes as usize;
            }
            if let Some(e) = first_err {
                return Err(e);
            }
        }
        Ok(bytes)
    }

    /// Posts one signaled work request; returns its id.
    fn post(&self, mut sge: ibv_sge, op: Op) -> Result<u64> {
        let id = self.next_wr.fetch_add(1, Ordering::Relaxed);
        let mut bad_send = std::ptr::null_mut();
        let mut bad_recv = std::ptr::null_mut();
        let rc = if let Op::Recv = op {
            // SAFETY: a zeroed ibv_recv_wr is valid; it points at `sge`, alive for the call.
            let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = id;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            self.dev.poller.posted(&self.cq);
            // SAFETY: the QP is alive; `wr` and its SGE are valid for the call; the caller
            // keeps the memory borrowed until the completion is reaped (`run`).
            unsafe { ibv_post_recv(self.qp.as_ptr(), &mut wr, &mut bad_recv) }
        } else {
            // SAFETY: a zeroed ibv_send_wr is valid; the fields that matter are set here.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = id;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            let (opcode, remote) = match op {
                Op::Read { addr, rkey } => (ibv_wr_opcode::IBV_WR_RDMA_READ, Some((addr, rkey))),
                Op::Write { addr, rkey } => (ibv_wr_opcode::IBV_WR_RDMA_WRITE, Some((addr, rkey))),
                Op::CompareSwap {
                    addr,
                    rkey,
                    expect,
                    swap,
                } => {
                    wr.wr.atomic = atomic_t {
                        remote_addr: addr,
                        compare_add: expect,
                        swap,
                        rkey,
                    };
                    (ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP, None)
                }
                Op::FetchAdd { addr, rkey, add } => {
                    wr.wr.atomic = atomic_t {
                        remote_addr: addr,
                        compare_add: add,
                        swap: 0,
                        rkey,
                    };
                    (ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD, None)
                }
                Op::Send | Op::Recv => (ibv_wr_opcode::IBV_WR_SEND, None),
            };
            wr.opcode = opcode;
            if let Some((remote_addr, rkey)) = remote {
                wr.wr.rdma = rdma_t { remote_addr, rkey };
            }
            self.dev.poller.posted(&self.cq);
            // SAFETY: the QP is alive; `wr` and its SGE are valid for the call; the caller
            // keeps the memory borrowed until the completion is reaped (`run`).
            unsafe { ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad_send) }
        };
        if rc != 0 {
            // Nothing was posted: take back the count (the poller would wait for it).
            self.cq.pending.fetch_sub(1, Ordering::AcqRel);
            self.dev.poller.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(rc_err("posting a work request", rc));
        }
        Ok(id)
    }

    /// After a timeout: moves the queue pair to the error state, which stops the NIC
    /// processing its work requests (they complete as flushed), and collects those flush
    /// completions of `ids`.
    fn abort(&self, ids: &[u64]) {
        self.failed.store(true, Ordering::Release);
        // SAFETY: zeroed attributes are valid; the state alone moves a QP to ERR.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        if let Err(e) = self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE,
            "moving a queue pair to ERR",
        ) {
            tracing::error!(error = %e, "a timed-out queue pair could not be stopped");
        }
        let deadline = Instant::now() + self.timeout;
        for &id in ids {
            if self.cq.wait(id, deadline).is_none() {
                tracing::warn!(id, "no flush completion for a timed-out work request");
            }
        }
    }
}

/// The work requests moving `bytes` (inside `region`) from or to the peer's `remote` region at
/// `remote_off`: one per [`MAX_WORK_BYTES`], each made by `op` from its remote address and key.
fn one_sided(
    region: &HostRegion,
    bytes: &[u8],
    remote: &RemoteRegion,
    remote_off: u64,
    op: impl Fn(u64, u32) -> Op,
) -> Result<Vec<(ibv_sge, Op)>> {
    let start = remote.at(remote_off, bytes.len())?;
    bytes
        .chunks(MAX_WORK_BYTES)
        .enumerate()
        .map(|(i, piece)| {
            let addr = start + (i * MAX_WORK_BYTES) as u64;
            Ok((region.sge(piece)?, op(addr, remote.rkey)))
        })
        .collect()
}

/// The error of a completion that did not succeed.
fn completion_err(what: &'static str, status: ibv_wc_status::Type) -> HalError {
    // SAFETY: ibv_wc_status_str returns a static C string for any status.
    let why = unsafe { CStr::from_ptr(ibv_wc_status_str(status)) };
    let code = match status {
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR | ibv_wc_status::IBV_WC_LOC_PROT_ERR => {
            ErrorCode::Permission
        }
        ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => ErrorCode::InvalidArg,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR | ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => {
            ErrorCode::Network
        }
        _ => ErrorCode::Io,
    };
    HalError::Rdma {
        op: what,
        message: why.to_string_lossy().into_owned(),
        code,
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; after this the NIC processes none of its
        // work requests. The CQ is destroyed when its last Arc (this one, once the poller has
        // let go of it below) drops.
        unsafe { ibv_destroy_qp(self.qp.as_ptr()) };
        self.dev.poller.remove(&self.cq);
    }
}
