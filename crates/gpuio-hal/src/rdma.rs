//! RDMA verbs (libibverbs through rdma-sys, cargo feature `rdma`): a device with its
//! protection domain, memory regions, and reliable-connected queue pairs with their
//! completions, behind safe types. Every verb here blocks until its completion arrives.
//!
//! Two kinds of registered memory:
//! - [`RdmaBuffer`] owns its host memory: local ends of reads, writes, sends, receives and
//!   atomics. Operations that let the NIC write it take `&mut`, so no Rust reference can
//!   observe the bytes while the NIC writes them.
//! - [`ExposedRegion`] exposes part of a shared [`HostBuffer`] to remote peers (an agent's
//!   memory export). Remote NICs read and write it whenever they are permitted to, like a GPU
//!   writing mapped pinned memory: its bytes can change under a reader, and gpuio only ever
//!   copies them, never interprets them. The region keeps the mapping alive until it is
//!   deregistered.

use crate::error::{ErrorCode, HalError, Result};
use crate::memory::{HostAllocOptions, HostBuffer, MappingHold};
use rdma_sys::*;
use std::ffi::CStr;
use std::ptr::NonNull;
use std::sync::Arc;
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

/// An opened RDMA device (port 1) and its protection domain.
pub struct RdmaDevice {
    ctx: NonNull<ibv_context>,
    pd: NonNull<ibv_pd>,
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
        let len = u32::try_from(len).map_err(|_| {
            HalError::InvalidArgument(format!("an RDMA transfer of {len} bytes (limit 4 GiB)"))
        })?;
        Ok(ibv_sge {
            addr: self.buf.base_ptr() as u64 + offset as u64,
            length: len,
            lkey: self.reg.lkey(),
        })
    }
}

/// Part of a shared host buffer exposed to remote peers' one-sided verbs.
pub struct ExposedRegion {
    // Declared first: deregistered before the mapping hold is released.
    reg: Registration,
    _hold: MappingHold,
    addr: u64,
    len: usize,
}

impl std::fmt::Debug for ExposedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExposedRegion")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .finish()
    }
}

impl ExposedRegion {
    /// Exposes `buf` (all of it) to remote peers with `access`. The mapping stays alive until
    /// the region drops, even if `buf` is dropped first (its pages are then leaked).
    pub fn new(dev: &Arc<RdmaDevice>, buf: &HostBuffer, access: RdmaAccess) -> Result<Self> {
        let hold = buf.hold_mapping();
        // SAFETY: `hold` keeps the mapping until after the registration drops (field order).
        // Remote writes race local readers of the bytes; the module docs say why that is
        // accepted (plain bytes, only copied, as with GPU-written mapped memory).
        let reg = unsafe { Registration::new(dev, buf.base_ptr(), buf.len(), access)? };
        Ok(Self {
            reg,
            _hold: hold,
            addr: buf.base_ptr() as u64,
            len: buf.len(),
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

/// A reliable-connected queue pair with its own completion queue. One verb at a time
/// (`&mut self`); each blocks until its completion.
pub struct QueuePair {
    qp: NonNull<ibv_qp>,
    cq: NonNull<ibv_cq>,
    dev: Arc<RdmaDevice>,
    timeout: Duration,
    next_wr: u64,
}

// SAFETY: a QP and its CQ may be used from any thread, one at a time (&mut self).
unsafe impl Send for QueuePair {}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("endpoint", &self.endpoint())
            .finish()
    }
}

/// Work requests a queue pair holds at once.
const DEPTH: u32 = 64;

impl QueuePair {
    /// A queue pair on `dev` in the INIT state; `timeout` bounds each verb's wait.
    pub fn new(dev: &Arc<RdmaDevice>, timeout: Duration) -> Result<Self> {
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
        let cq = NonNull::new(cq).ok_or_else(|| rdma_err("creating a completion queue"))?;
        // SAFETY: a zeroed ibv_qp_init_attr is valid; the fields that matter are set below.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.as_ptr();
        init.recv_cq = cq.as_ptr();
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = DEPTH;
        init.cap.max_recv_wr = DEPTH;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.sq_sig_all = 1;
        // SAFETY: the PD is alive and `init` is a valid attribute block.
        let qp = unsafe { ibv_create_qp(dev.pd.as_ptr(), &mut init) };
        let Some(qp) = NonNull::new(qp) else {
            let e = rdma_err("creating a queue pair");
            // SAFETY: created above, unused elsewhere.
            unsafe { ibv_destroy_cq(cq.as_ptr()) };
            return Err(e);
        };
        let this = Self {
            qp,
            cq,
            dev: dev.clone(),
            timeout,
            next_wr: 1,
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

    /// Reads `len` bytes of the peer's `remote` region at `remote_off` into `local` at
    /// `local_off`.
    pub fn read(
        &mut self,
        local: &mut RdmaBuffer,
        local_off: usize,
        remote: &RemoteRegion,
        remote_off: u64,
        len: usize,
    ) -> Result<()> {
        let sge = local.sge(local_off, len)?;
        let addr = remote.at(remote_off, len)?;
        self.post_one(sge, ibv_wr_opcode::IBV_WR_RDMA_READ, |wr| {
            wr.wr.rdma = rdma_t {
                remote_addr: addr,
                rkey: remote.rkey,
            };
        })
        .map(|_| ())
    }

    /// Writes `len` bytes of `local` at `local_off` to the peer's `remote` region at
    /// `remote_off`.
    pub fn write(
        &mut self,
        local: &RdmaBuffer,
        local_off: usize,
        remote: &RemoteRegion,
        remote_off: u64,
        len: usize,
    ) -> Result<()> {
        let sge = local.sge(local_off, len)?;
        let addr = remote.at(remote_off, len)?;
        self.post_one(sge, ibv_wr_opcode::IBV_WR_RDMA_WRITE, |wr| {
            wr.wr.rdma = rdma_t {
                remote_addr: addr,
                rkey: remote.rkey,
            };
        })
        .map(|_| ())
    }

    /// Atomic compare-and-swap of the 8-byte word at `remote_off` (8-aligned): if it holds
    /// `expect`, it becomes `swap`. Returns the word it held.
    pub fn compare_swap(
        &mut self,
        scratch: &mut RdmaBuffer,
        remote: &RemoteRegion,
        remote_off: u64,
        expect: u64,
        swap: u64,
    ) -> Result<u64> {
        let op = ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
        self.atomic(scratch, remote, remote_off, op, |wr, addr, rkey| {
            wr.wr.atomic = atomic_t {
                remote_addr: addr,
                compare_add: expect,
                swap,
                rkey,
            };
        })
    }

    /// Atomic fetch-and-add on the 8-byte word at `remote_off` (8-aligned). Returns the word it
    /// held.
    pub fn fetch_add(
        &mut self,
        scratch: &mut RdmaBuffer,
        remote: &RemoteRegion,
        remote_off: u64,
        add: u64,
    ) -> Result<u64> {
        let op = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
        self.atomic(scratch, remote, remote_off, op, |wr, addr, rkey| {
            wr.wr.atomic = atomic_t {
                remote_addr: addr,
                compare_add: add,
                swap: 0,
                rkey,
            };
        })
    }

    fn atomic(
        &mut self,
        scratch: &mut RdmaBuffer,
        remote: &RemoteRegion,
        remote_off: u64,
        opcode: ibv_wr_opcode::Type,
        fill: impl FnOnce(&mut ibv_send_wr, u64, u32),
    ) -> Result<u64> {
        if remote_off % 8 != 0 {
            return Err(HalError::InvalidArgument(format!(
                "an atomic needs an 8-byte aligned offset, not {remote_off}"
            )));
        }
        let sge = scratch.sge(0, 8)?;
        let addr = remote.at(remote_off, 8)?;
        let rkey = remote.rkey;
        self.post_one(sge, opcode, |wr| fill(wr, addr, rkey))?;
        let mut word = [0u8; 8];
        word.copy_from_slice(&scratch.as_slice()[..8]);
        // Atomics return the old value in the host's byte order.
        Ok(u64::from_ne_bytes(word))
    }

    /// Sends `len` bytes of `local` at `local_off` (the peer must have a receive posted).
    pub fn send(&mut self, local: &RdmaBuffer, local_off: usize, len: usize) -> Result<()> {
        let sge = local.sge(local_off, len)?;
        self.post_one(sge, ibv_wr_opcode::IBV_WR_SEND, |_| {})
            .map(|_| ())
    }

    /// Posts a receive into `local` at `local_off` (up to `len` bytes) and waits for the
    /// message; returns its length.
    pub fn recv(&mut self, local: &mut RdmaBuffer, local_off: usize, len: usize) -> Result<usize> {
        let mut sge = local.sge(local_off, len)?;
        let id = self.wr_id();
        // SAFETY: a zeroed ibv_recv_wr is valid; it points at `sge`, alive until posted.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is alive; `wr` and its SGE are valid for the call; the buffer is
        // borrowed mutably until the completion is reaped below.
        let rc = unsafe { ibv_post_recv(self.qp.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(rc_err("posting a receive", rc));
        }
        self.wait(id, "receive")
    }

    fn wr_id(&mut self) -> u64 {
        let id = self.next_wr;
        self.next_wr += 1;
        id
    }

    /// Posts one signaled work request and waits for its completion; returns its byte count.
    fn post_one(
        &mut self,
        mut sge: ibv_sge,
        opcode: ibv_wr_opcode::Type,
        fill: impl FnOnce(&mut ibv_send_wr),
    ) -> Result<usize> {
        let id = self.wr_id();
        // SAFETY: a zeroed ibv_send_wr is valid; the fields that matter are set here.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = opcode;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        fill(&mut wr);
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is alive; `wr` and its SGE are valid for the call; the local buffer
        // stays borrowed by the caller until the completion is reaped below.
        let rc = unsafe { ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(rc_err("posting a work request", rc));
        }
        self.wait(id, "work request")
    }

    /// Polls the completion queue until work request `id` completes.
    fn wait(&mut self, id: u64, what: &'static str) -> Result<usize> {
        let deadline = Instant::now() + self.timeout;
        loop {
            // SAFETY: a zeroed ibv_wc is a valid out-parameter.
            let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
            // SAFETY: the CQ is alive and `wc` has room for one completion.
            let n = unsafe { ibv_poll_cq(self.cq.as_ptr(), 1, &mut wc) };
            if n < 0 {
                return Err(rc_err("polling completions", n));
            }
            if n == 1 {
                if wc.wr_id != id {
                    // An older request's completion (one that timed out), whatever its status:
                    // not this request's outcome. (A failure leaves the queue pair in error,
                    // so this request then completes with a flush error of its own.)
                    continue;
                }
                if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
                    // SAFETY: ibv_wc_status_str returns a static C string for any status.
                    let why = unsafe { CStr::from_ptr(ibv_wc_status_str(wc.status)) };
                    let code = match wc.status {
                        ibv_wc_status::IBV_WC_REM_ACCESS_ERR
                        | ibv_wc_status::IBV_WC_LOC_PROT_ERR => ErrorCode::Permission,
                        ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => ErrorCode::InvalidArg,
                        ibv_wc_status::IBV_WC_RETRY_EXC_ERR
                        | ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => ErrorCode::Network,
                        _ => ErrorCode::Io,
                    };
                    return Err(HalError::Rdma {
                        op: what,
                        message: why.to_string_lossy().into_owned(),
                        code,
                    });
                }
                return Ok(wc.byte_len as usize);
            }
            if Instant::now() > deadline {
                return Err(HalError::TimedOut {
                    what,
                    after: self.timeout,
                });
            }
            std::hint::spin_loop();
        }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once, the QP before its CQ.
        unsafe {
            ibv_destroy_qp(self.qp.as_ptr());
            ibv_destroy_cq(self.cq.as_ptr());
        }
    }
}
