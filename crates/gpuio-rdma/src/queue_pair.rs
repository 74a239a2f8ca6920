//! Reliable-connected queue pairs ([`QueuePair`]): INIT → RTR → RTS, and the verbs — read,
//! write (also in place in a [`HostRegion`], cut into work requests of at most 1 GiB posted
//! together), send/receive, compare-and-swap, fetch-and-add. Each verb checks its ranges, posts
//! its work requests in windows, and waits for their completions by id (handed over by the
//! device's poller); a failed completion maps to an error code and a timed-out verb moves the queue
//! pair to the error state before it returns, so the NIC is done with the memory a verb borrows
//! before the borrow ends. What one work request is, and how a verb becomes several, is
//! `work.rs`.

use super::device::{Cq, RdmaDevice};
use super::memory::{HostRegion, RdmaAccess, RdmaBuffer, RemoteRegion};
use super::work::{Op, completion_err, one_sided, recv_wr, send_wr};
use super::{rc_err, rdma_err};
use gpuio_hal::{ErrorCode, HalError, Result};
use rdma_sys::*;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

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

/// Work requests of one call posted before waiting for them.
const WINDOW: usize = 16;

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
        let cq = NonNull::new(cq).ok_or_else(|| rdma_err("creating a completion queue"))?;
        // SAFETY: just created on the device's context and destroyed only by the Cq, which
        // drops before the device: the queue pair built below holds both (and until then the
        // caller's `dev` does).
        let cq = Arc::new(unsafe { Cq::new(cq) });
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
        // On failure the CQ drops (destroyed) with `cq`; it was never listed.
        let qp = NonNull::new(qp).ok_or_else(|| rdma_err("creating a queue pair"))?;
        dev.poller.add(cq.clone());
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
                let Some(c) = self.cq.completions.wait(id, deadline) else {
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
        let rc = if let Op::Recv = op {
            let mut wr = recv_wr(id, &mut sge);
            let mut bad = std::ptr::null_mut();
            self.dev.poller.posted(&self.cq.completions);
            // SAFETY: the QP is alive; `wr` and its SGE are valid for the call; the caller
            // keeps the memory borrowed until the completion is reaped (`run`).
            unsafe { ibv_post_recv(self.qp.as_ptr(), &mut wr, &mut bad) }
        } else {
            let mut wr = send_wr(id, &mut sge, op);
            let mut bad = std::ptr::null_mut();
            self.dev.poller.posted(&self.cq.completions);
            // SAFETY: the QP is alive; `wr` and its SGE are valid for the call; the caller
            // keeps the memory borrowed until the completion is reaped (`run`).
            unsafe { ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) }
        };
        if rc != 0 {
            // Nothing was posted: take back the count (the poller would wait for it).
            self.dev.poller.unposted(&self.cq.completions);
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
            if self.cq.completions.wait(id, deadline).is_none() {
                tracing::warn!(id, "no flush completion for a timed-out work request");
            }
        }
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
