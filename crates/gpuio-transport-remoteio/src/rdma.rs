//! RemoteIO over RDMA verbs (cargo feature `rdma`): one-sided reads and writes and remote
//! atomics on an agent's memory export, after a TCP control connection has authenticated the
//! client and exchanged queue pair information (RDMA_INFO).
//!
//! The agent exposes the export to the client's queue pair with exactly the rights the session
//! has: remote reads always, remote writes and atomics only where both the export and the key
//! allow writing. The NIC enforces both the rights and the bounds (the memory region is the
//! export, nothing more). The queue pair and the registration live as long as the TCP session.
//!
//! The client's side, an [`RdmaChannel`], reads and writes in place where the caller's memory
//! is registered (a [`HostRegion`], from the core's registration cache), and through a
//! registered staging buffer of its own otherwise. One device (and protection domain) serves
//! the whole process, so every channel can use every registration.

use crate::connection::Connection;
use crate::wire::RdmaInfo;
use crate::{RemoteIoError, Result};
use gpuio_hal::HostBuffer;
use gpuio_hal::sync::MutexExt;
use gpuio_rdma::{
    HostRegion, QueuePair, RdmaAccess, RdmaBuffer, RdmaDevice, RdmaEndpoint, RemoteRegion,
};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// Which RDMA device an agent or client uses.
#[derive(Debug, Clone, Default)]
pub struct RdmaOptions {
    /// The device's name (`None`: the first one).
    pub device: Option<String>,
    /// The GID index on port 1 (RoCE: 1 is usually the first configured address).
    pub gid_index: u8,
}

/// The devices this process has open, by options: memory registered with one protection
/// domain serves only queue pairs of that domain, so peers and registration caches share them.
type OpenDevices = Vec<((Option<String>, u8), Weak<RdmaDevice>)>;
static DEVICES: Mutex<OpenDevices> = Mutex::new(Vec::new());

impl RdmaOptions {
    /// The device: the one this process already has open with these options, or opened now.
    pub fn open(&self) -> Result<Arc<RdmaDevice>> {
        let key = (self.device.clone(), self.gid_index);
        let mut open = DEVICES.lock_unpoisoned();
        open.retain(|(_, d)| d.strong_count() > 0);
        if let Some(d) = open
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, d)| d.upgrade())
        {
            return Ok(d);
        }
        let d = RdmaDevice::open(self.device.as_deref(), self.gid_index)?;
        open.push((key, Arc::downgrade(&d)));
        Ok(d)
    }
}

fn endpoint(info: &RdmaInfo) -> RdmaEndpoint {
    RdmaEndpoint {
        qp_num: info.qp_num,
        lid: info.lid,
        gid: info.gid,
    }
}

/// The agent's side of one client's RDMA link: kept by the session until it ends.
#[derive(Debug)]
pub(crate) struct Link {
    _qp: QueuePair,
    _region: HostRegion,
}

/// Exposes `mem` to the client's queue pair `client` with `writable` rights; returns the link
/// to keep and the answer to send.
pub(crate) fn accept(
    dev: &Arc<RdmaDevice>,
    mem: &HostBuffer,
    writable: bool,
    client: &RdmaInfo,
) -> Result<(Link, RdmaInfo)> {
    let region = HostRegion::new(
        dev,
        mem,
        0..mem.len(),
        RdmaAccess {
            remote_read: true,
            remote_write: writable,
            remote_atomic: writable,
        },
    )?;
    let mut qp = QueuePair::new(dev, Duration::from_secs(10))?;
    qp.connect(&endpoint(client))?;
    let ours = qp.endpoint();
    let remote = region.remote();
    let answer = RdmaInfo {
        qp_num: ours.qp_num,
        lid: ours.lid,
        gid: ours.gid,
        rkey: remote.rkey,
        vaddr: remote.addr,
    };
    Ok((
        Link {
            _qp: qp,
            _region: region,
        },
        answer,
    ))
}

/// A client's RDMA channel to one memory export.
#[derive(Debug)]
pub struct RdmaChannel {
    // The QP first: destroyed while the control connection (which keeps the agent's side
    // alive) still stands.
    qp: QueuePair,
    staging: RdmaBuffer,
    scratch: RdmaBuffer,
    remote: RemoteRegion,
    /// Keeps the agent's side alive; names the instance.
    control: Connection,
}

impl RdmaChannel {
    /// Opens a channel to `export` over the authenticated `control` connection: learns the
    /// export's size, exchanges queue pairs, connects. `staging` bytes move per work request.
    pub fn open(
        mut control: Connection,
        dev: &Arc<RdmaDevice>,
        export: &str,
        staging: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let size = control.stat(export)?.size;
        let mut qp = QueuePair::new(dev, timeout)?;
        let ours = qp.endpoint();
        let theirs = control.rdma_exchange(
            export,
            &RdmaInfo {
                qp_num: ours.qp_num,
                lid: ours.lid,
                gid: ours.gid,
                rkey: 0,
                vaddr: 0,
            },
        )?;
        qp.connect(&endpoint(&theirs))?;
        Ok(Self {
            qp,
            staging: RdmaBuffer::new(dev, staging.max(4096))?,
            scratch: RdmaBuffer::new(dev, 8)?,
            remote: RemoteRegion {
                addr: theirs.vaddr,
                len: size,
                rkey: theirs.rkey,
            },
            control,
        })
    }

    /// The agent instance the channel reaches (its control connection's).
    pub fn instance(&self) -> u64 {
        self.control.instance()
    }

    /// The export's size.
    pub fn len(&self) -> u64 {
        self.remote.len
    }

    /// Whether the export is empty.
    pub fn is_empty(&self) -> bool {
        self.remote.len == 0
    }

    /// Reads `buf.len()` bytes at `offset` into `buf`, which lies in `region`: one-sided RDMA
    /// reads straight into it.
    pub fn read_into(&self, offset: u64, region: &HostRegion, buf: &mut [u8]) -> Result<()> {
        Ok(self.qp.read_into(region, buf, &self.remote, offset)?)
    }

    /// Writes `data`, which lies in `region`, at `offset`: one-sided RDMA writes straight from
    /// it.
    pub fn write_from(&self, offset: u64, region: &HostRegion, data: &[u8]) -> Result<()> {
        Ok(self.qp.write_from(region, data, &self.remote, offset)?)
    }

    /// Reads `buf.len()` bytes at `offset` (one-sided RDMA reads through the staging buffer).
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let step = self.staging.len();
        for (i, chunk) in buf.chunks_mut(step).enumerate() {
            let at = offset
                .checked_add((i * step) as u64)
                .ok_or_else(|| RemoteIoError::InvalidArgument("offset overflows".into()))?;
            self.qp
                .read(&mut self.staging, 0, &self.remote, at, chunk.len())?;
            chunk.copy_from_slice(&self.staging.as_slice()[..chunk.len()]);
        }
        Ok(())
    }

    /// Writes `data` at `offset` (one-sided RDMA writes through the staging buffer).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let step = self.staging.len();
        for (i, chunk) in data.chunks(step).enumerate() {
            let at = offset
                .checked_add((i * step) as u64)
                .ok_or_else(|| RemoteIoError::InvalidArgument("offset overflows".into()))?;
            self.staging.as_mut_slice()[..chunk.len()].copy_from_slice(chunk);
            self.qp
                .write(&self.staging, 0, &self.remote, at, chunk.len())?;
        }
        Ok(())
    }

    /// Atomic compare-and-swap of the 8-byte word at `offset`; returns the word it held.
    pub fn compare_swap(&mut self, offset: u64, expect: u64, swap: u64) -> Result<u64> {
        Ok(self
            .qp
            .compare_swap(&mut self.scratch, &self.remote, offset, expect, swap)?)
    }

    /// Atomic fetch-and-add on the 8-byte word at `offset`; returns the word it held.
    pub fn fetch_add(&mut self, offset: u64, add: u64) -> Result<u64> {
        Ok(self
            .qp
            .fetch_add(&mut self.scratch, &self.remote, offset, add)?)
    }
}

/// A peer's RDMA device and channels, pooled per export.
#[derive(Debug, Default)]
pub(crate) struct ChannelPool {
    device: OnceLock<Arc<RdmaDevice>>,
    channels: crate::channels::ChannelPool<RdmaChannel>,
}

impl ChannelPool {
    /// The device (opened on first use).
    pub(crate) fn device(&self, opts: &RdmaOptions) -> Result<Arc<RdmaDevice>> {
        if let Some(d) = self.device.get() {
            return Ok(d.clone());
        }
        let d = opts.open()?;
        Ok(self.device.get_or_init(|| d).clone())
    }

    /// Runs `f` on an idle channel to `export`, or on one `open` makes
    /// ([`crate::channels::ChannelPool::run`]).
    pub(crate) fn run<T>(
        &self,
        export: &str,
        f: impl FnOnce(&mut RdmaChannel) -> Result<T>,
        open: impl FnOnce() -> Result<RdmaChannel>,
    ) -> Option<Result<T>> {
        self.channels.run(export, f, open)
    }
}

impl crate::channels::Channel for RdmaChannel {
    const TRANSPORT: &'static str = "RDMA";

    fn control(&self) -> &Connection {
        &self.control
    }

    /// A range refused before anything was posted leaves the queue pair usable; a failed or
    /// timed-out work request leaves it in the error state.
    fn reusable<T>(&self, _: &Result<T>) -> bool {
        !self.qp.is_failed()
    }
}
