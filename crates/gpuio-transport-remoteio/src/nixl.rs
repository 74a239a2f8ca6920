//! RemoteIO over NIXL (cargo feature `nixl`): one-sided NIXL reads and writes of an agent's
//! memory export, after the TCP control connection has authenticated the client and the agent
//! has handed it the export's NIXL metadata (NIXL_INFO). NIXL's metadata travels only there,
//! inside gpuio's authenticated session, never on a port of its own.
//!
//! A memory export may be host or GPU memory: NIXL moves GPU memory GPU to GPU where UCX can
//! (`cuda_ipc` between processes of one host, GPUDirect RDMA between hosts).
//!
//! What NIXL can enforce decides what the agent offers. Whoever holds a NIXL agent's metadata
//! can read and write every region that agent registered: there are no per-peer or read-only
//! rights. So each link gets a NIXL agent of its own that registers the one export and nothing
//! else, lives as long as the session, and is offered only where the session may write the
//! export (its key's role and the export's mode). A read-only session, a file export or an
//! empty one is refused with `Unsupported`, and the client reads it over TCP, as over RDMA.
//! The one-export bound holds where the transport checks keys (RDMA, `cuda_ipc`); UCX's
//! software paths (TCP, and shared memory and CMA within one user on one host) copy at any
//! address a peer names. So the agent refuses NIXL while UCX may use TCP, unless told the
//! network is trusted (`AgentConfig::nixl_tcp`). NIXL's bytes do not go through TLS.
//!
//! The client's side, a [`NixlChannel`], moves a transfer of 256 KiB or more straight from or
//! into the caller's memory (registered for the call) and a smaller one through a registered
//! staging buffer of its own; a transfer in or out of a shared host buffer (the engine's
//! memory) moves in place, the buffer kept registered by the channel's agent. UCX picks the
//! transport (shared memory, CMA or `cuda_ipc` on one host, TCP, RDMA). The peer runs a
//! transfer's stripes on several channels side by side.

use crate::connection::Connection;
use crate::wire::{MAX_NIXL_METADATA, Message};
use crate::{RemoteIoError, Result};
use gpuio_hal::{BufferInfo, DeviceBuffer, ErrorCode, HostAllocOptions, HostBuffer};
use gpuio_nixl::{NixlAgent, NixlMem, NixlPeer, NixlRegion, NixlRemote};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// A NIXL agent name no other agent of this process, or likely of any other, has: NIXL
/// keys what it loaded by name.
fn agent_name(role: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nonce = crate::auth::nonce().map_or(0, |n| {
        u64::from_le_bytes([n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7]])
    });
    format!(
        "gpuio-{role}-{}-{}-{nonce:016x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Transfers from this size on are registered in place for the call (a registration costs
/// less than copying them through the staging buffer); smaller ones are staged.
const DIRECT_FROM: usize = 256 << 10;

/// The agent's side of one client's NIXL link: kept by the session until it ends.
pub(crate) struct Link {
    // The registration first: released before its agent.
    _region: NixlRegion,
    _agent: NixlAgent,
    export: String,
    metadata: Vec<u8>,
    remote: NixlRemote,
}

impl Link {
    /// The export it reaches.
    pub(crate) fn export(&self) -> &str {
        &self.export
    }

    /// The export's bytes (all of them are registered).
    pub(crate) fn len(&self) -> u64 {
        self.remote.len
    }

    /// What a NIXL peer needs to reach the export.
    pub(crate) fn offer(&self) -> crate::NixlOffer {
        crate::NixlOffer {
            metadata: self.metadata.clone(),
            addr: self.remote.addr,
            gpu: match self.remote.mem {
                NixlMem::Gpu(n) => Some(n),
                NixlMem::Host => None,
            },
        }
    }

    /// The NIXL_INFO answer that hands it to the client.
    pub(crate) fn answer(&self) -> Message {
        let o = self.offer();
        Message::NixlInfo {
            metadata: o.metadata,
            addr: o.addr,
            gpu: o.gpu,
        }
    }
}

/// An export's memory, as a link registers it.
pub(crate) enum ExportMemory<'a> {
    Host(&'a HostBuffer),
    Device(&'a DeviceBuffer),
}

impl ExportMemory<'_> {
    /// Why NIXL must not reach this memory, if it must not: an empty export has nothing to
    /// register, and GPU memory borrowed from another library may be a slice of a larger
    /// allocation, all of which UCX's `cuda_ipc` would map into the peer (its key is the
    /// allocation's IPC handle, base and length).
    pub(crate) fn refusal(&self) -> Option<String> {
        match self {
            Self::Host(b) if b.is_empty() => Some("an empty export has nothing to register".into()),
            Self::Host(_) => None,
            Self::Device(b) if b.is_empty() => {
                Some("an empty export has nothing to register".into())
            }
            Self::Device(b) if b.is_borrowed() => match b.allocation() {
                Ok(a) if a.base == b.device_addr() && a.len == b.len() => None,
                Ok(_) => Some(
                    "GPU memory borrowed from a larger allocation: cuda_ipc would expose all \
                     of it"
                        .into(),
                ),
                Err(e) => Some(format!("its allocation is unknown: {e}")),
            },
            Self::Device(_) => None,
        }
    }
}

/// Exposes `mem` (the export `name`, which the session may write, at least one byte) to the
/// client through a NIXL agent of its own.
pub(crate) fn accept(name: &str, mem: ExportMemory<'_>) -> Result<Link> {
    let agent = NixlAgent::new(&agent_name("export"))?;
    let region = match mem {
        ExportMemory::Host(buf) => agent.register(buf, 0..buf.len())?,
        ExportMemory::Device(buf) => agent.register_device(buf, 0..buf.len())?,
    };
    let metadata = agent.metadata()?;
    if metadata.len() > MAX_NIXL_METADATA {
        return Err(RemoteIoError::InvalidArgument(format!(
            "NIXL's metadata is {} bytes, over the {MAX_NIXL_METADATA} a NIXL_INFO carries",
            metadata.len()
        )));
    }
    Ok(Link {
        remote: region.remote(),
        _region: region,
        _agent: agent,
        export: name.to_string(),
        metadata,
    })
}

/// A client's NIXL channel to one memory export.
pub struct NixlChannel {
    agent: NixlAgent,
    peer: NixlPeer,
    remote: NixlRemote,
    // The registration before its buffer (it holds the buffer's mapping either way).
    region: NixlRegion,
    staging: HostBuffer,
    /// The GPU whose memory this channel's agent moves (NIXL binds an agent to one CUDA
    /// context); `None` until the first device transfer.
    gpu: Option<u32>,
    /// Keeps the agent's side alive; names the instance.
    control: Connection,
}

impl std::fmt::Debug for NixlChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlChannel")
            .field("agent", &self.agent)
            .field("peer", &self.peer)
            .field("remote", &self.remote)
            .finish()
    }
}

impl NixlChannel {
    /// Opens a channel to `export` over the authenticated `control` connection: learns the
    /// export's size and its NIXL metadata, loads it. The staging buffer holds the small
    /// transfers (`staging` bytes, at least 256 KiB, the size from which transfers go in place).
    pub fn open(mut control: Connection, export: &str, staging: usize) -> Result<Self> {
        let size = control.stat(export)?.size;
        let offer = control.nixl_exchange(export)?;
        let agent = NixlAgent::new(&agent_name("client"))?;
        let peer = agent.connect(&offer.metadata)?;
        let staging = HostBuffer::alloc(staging.max(DIRECT_FROM), &HostAllocOptions::default())?;
        let region = agent.register(&staging, 0..staging.len())?;
        Ok(Self {
            agent,
            peer,
            remote: NixlRemote {
                addr: offer.addr,
                len: size,
                mem: offer.gpu.map_or(NixlMem::Host, NixlMem::Gpu),
            },
            region,
            staging,
            gpu: None,
            control,
        })
    }

    /// The agent instance the channel reaches (its control connection's).
    pub fn instance(&self) -> u64 {
        self.control.instance()
    }

    /// Reads `buf.len()` bytes at `offset`: a large read lands straight in `buf` (registered
    /// for the call) in one NIXL transfer, a small one goes through the staging buffer.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        if buf.len() >= DIRECT_FROM {
            return Ok(self
                .agent
                .read_direct(buf, &self.peer, &self.remote, offset)?);
        }
        let staged = &mut self.staging.as_mut_slice()[..buf.len()];
        self.agent
            .read_into(&self.region, staged, &self.peer, &self.remote, offset)?;
        buf.copy_from_slice(staged);
        Ok(())
    }

    /// Writes `data` at `offset`: a large write goes straight from `data` (registered for
    /// the call) in one NIXL transfer, a small one through the staging buffer.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        if data.len() >= DIRECT_FROM {
            return Ok(self
                .agent
                .write_direct(data, &self.peer, &self.remote, offset)?);
        }
        let staged = &mut self.staging.as_mut_slice()[..data.len()];
        staged.copy_from_slice(data);
        self.agent
            .write_from(&self.region, staged, &self.peer, &self.remote, offset)?;
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset` straight into `buf`, which lies in the host
    /// buffer `whole` (its guard's [`buffer`](gpuio_hal::RangeGuard::buffer)): the channel's
    /// agent keeps that buffer registered.
    pub fn read_kept(&mut self, offset: u64, whole: &BufferInfo, buf: &mut [u8]) -> Result<()> {
        Ok(self
            .agent
            .read_kept(whole, buf, &self.peer, &self.remote, offset)?)
    }

    /// Writes `data`, which lies in the host buffer `whole`, at `offset`, the buffer kept
    /// registered as for [`NixlChannel::read_kept`].
    pub fn write_kept(&mut self, offset: u64, whole: &BufferInfo, data: &[u8]) -> Result<()> {
        Ok(self
            .agent
            .write_kept(whole, data, &self.peer, &self.remote, offset)?)
    }

    /// Whether this channel moves `buf`'s memory GPU to GPU: the export is GPU memory, `buf`
    /// is a CUDA device's, and the one this channel's agent works with (or it has none yet).
    fn serves(&mut self, buf: &DeviceBuffer) -> bool {
        match (self.remote.mem, NixlMem::of_device(buf)) {
            (NixlMem::Gpu(_), NixlMem::Gpu(g)) if self.gpu.is_none_or(|b| b == g) => {
                self.gpu = Some(g);
                true
            }
            _ => false,
        }
    }

    /// Reads `range.len()` bytes at `offset` straight into `range` of the device buffer
    /// `dst` (its allocation kept registered by the channel's agent), GPU to GPU; `false`
    /// where this channel does not serve `dst` ([`NixlChannel::serves`]).
    fn read_device(
        &mut self,
        offset: u64,
        dst: &DeviceBuffer,
        range: Range<usize>,
    ) -> Result<bool> {
        if !self.serves(dst) {
            return Ok(false);
        }
        self.agent
            .read_device(dst, range, &self.peer, &self.remote, offset)?;
        Ok(true)
    }

    /// Writes `range` of the device buffer `src` at `offset`, GPU to GPU, as
    /// [`NixlChannel::read_device`] reads.
    fn write_device(
        &mut self,
        offset: u64,
        src: &DeviceBuffer,
        range: Range<usize>,
    ) -> Result<bool> {
        if !self.serves(src) {
            return Ok(false);
        }
        self.agent
            .write_device(src, range, &self.peer, &self.remote, offset)?;
        Ok(true)
    }
}

/// Device memory over NIXL, GPU to GPU.
impl crate::RemotePeer {
    /// Reads `range.len()` bytes of `export` at `offset` straight into `range` of the device
    /// buffer `dst` over NIXL: `cuda_ipc` between processes of one host, GPUDirect RDMA
    /// between hosts. `None` where that path does not serve and the caller stages through
    /// host memory: the peer does not use NIXL, the agent does not offer the export over it,
    /// the export is host memory, `dst` is the host backend's, or the pooled channel's NIXL
    /// agent works with another GPU (NIXL binds an agent to one CUDA context).
    pub fn read_device(
        &self,
        export: &crate::RemoteExport,
        offset: u64,
        dst: &DeviceBuffer,
        range: Range<usize>,
    ) -> Option<Result<()>> {
        let len = range.len() as u64;
        let moved = self.on_gpu(export, |ch| ch.read_device(offset, dst, range))?;
        if moved.is_ok() {
            self.bytes_read.fetch_add(len, Ordering::Relaxed);
        }
        Some(moved)
    }

    /// Writes `range` of the device buffer `src` to `export` at `offset` over NIXL, GPU to
    /// GPU; `None` where that path does not serve ([`read_device`](Self::read_device)). A
    /// write the export cannot take whole is refused before any byte moves.
    pub fn write_device(
        &self,
        export: &crate::RemoteExport,
        offset: u64,
        src: &DeviceBuffer,
        range: Range<usize>,
    ) -> Option<Result<()>> {
        let len = range.len();
        if !self.config().nixl {
            return None;
        }
        if let Err(e) = self
            .pin(export)
            .and_then(|p| crate::peer::check_write(export, &p, offset, len))
        {
            return Some(Err(e));
        }
        let moved = self.on_gpu(export, |ch| ch.write_device(offset, src, range))?;
        if moved.is_ok() {
            self.bytes_written.fetch_add(len as u64, Ordering::Relaxed);
        }
        Some(moved)
    }

    /// Runs `f` on a pooled NIXL channel to `export`; `None` where there is none or it does
    /// not serve the device memory (`f` answered `false`). A transfer NIXL fails (no UCX
    /// transport reaches this GPU memory: another host without GPUDirect RDMA, memory
    /// `cuda_ipc` cannot export) turns NIXL off for the export, and `None` has the caller
    /// stage it over TCP (a read or write may be repeated); a refused range or a restarted
    /// agent is the caller's error.
    fn on_gpu(
        &self,
        export: &crate::RemoteExport,
        f: impl FnOnce(&mut NixlChannel) -> Result<bool>,
    ) -> Option<Result<()>> {
        if !self.config().nixl {
            return None;
        }
        let pinned = match self.pin(export) {
            Ok(p) => p,
            Err(e) => return Some(Err(e)),
        };
        match self.over_nixl(export, &pinned, f)? {
            Ok(true) => Some(Ok(())),
            Ok(false) => None,
            Err(e)
                if e.code() == ErrorCode::InvalidArg
                    || matches!(e, RemoteIoError::Restarted { .. }) =>
            {
                Some(Err(e))
            }
            Err(e) => {
                tracing::warn!(export = export.name(), error = %e, "NIXL failed GPU memory: served over TCP from now on");
                self.nixl.serve_over_tcp(export.name());
                None
            }
        }
    }
}

/// A peer's NIXL channels, pooled per export.
pub(crate) type ChannelPool = crate::channels::ChannelPool<NixlChannel>;

impl crate::channels::Channel for NixlChannel {
    const TRANSPORT: &'static str = "NIXL";

    fn control(&self) -> &Connection {
        &self.control
    }

    /// A range refused before anything was posted leaves the channel usable; after a failed
    /// transfer it is dropped (its peer may be gone).
    fn reusable<T>(&self, r: &Result<T>) -> bool {
        !matches!(r, Err(e) if e.code() != ErrorCode::InvalidArg)
    }
}
