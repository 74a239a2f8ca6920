//! A NIXL agent with its UCX backend: metadata out and in, registrations, and one-sided reads
//! and writes that return only when NIXL is done with the local bytes.

use crate::memory::{NixlRegion, NixlRemote, Span};
use crate::nixl_err;
use crate::registrations::{DeviceRegistrations, HostRegistrations};
use gpuio_hal::{BufferInfo, DeviceBuffer, HalError, HostBuffer, Result};
use nixl_sys::{Agent, AgentConfig, ThreadSync, XferDescList, XferOp, XferStatus};
use std::ops::Range;
use std::time::{Duration, Instant};

/// How long the agent's progress thread sleeps between rounds. It serves peers' transfers
/// where the transport needs the target to take part (UCX's TCP); NIXL's default, none, spins
/// a core per agent even when idle (measured: a whole core; 2% with this delay).
const PROGRESS_DELAY: Duration = Duration::from_micros(100);

/// How often a transfer that is still running says so.
pub const WAIT_REPORT: Duration = Duration::from_secs(10);

/// A NIXL agent (its own name, its UCX backend and progress thread). Calls on it may come from
/// any thread: the agent serializes them (NIXL's strict thread sync).
pub struct NixlAgent {
    // Declared first: deregistered before the agent goes.
    device_regs: DeviceRegistrations,
    host_regs: HostRegistrations,
    agent: Agent,
    name: String,
}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent")
            .field("name", &self.name)
            .finish()
    }
}

/// A peer whose metadata an agent loaded: transfers name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlPeer {
    name: String,
}

impl NixlPeer {
    /// The peer agent's name, as its metadata gives it.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl NixlAgent {
    /// An agent named `name` with the UCX backend (UCX picks its transports at run time:
    /// shared memory, TCP, RDMA, `cuda_ipc`; `UCX_TLS` narrows them). `Unsupported` where
    /// this process has no NIXL.
    pub fn new(name: &str) -> Result<Self> {
        crate::library()?;
        let cfg = AgentConfig {
            thread_sync: ThreadSync::Strict,
            pthr_delay_us: PROGRESS_DELAY.as_micros() as u64,
            // NIXL's listener thread hands the agent's metadata (every registration's keys) to
            // whoever connects to its port: never. Metadata goes only where the caller sends it.
            enable_listen_thread: false,
            ..AgentConfig::default()
        };
        let agent =
            Agent::new_configured(name, &cfg).map_err(|e| nixl_err("creating an agent", e))?;
        let (_, params) = agent
            .get_plugin_params("UCX")
            .map_err(|e| nixl_err("reading the UCX plugin's parameters", e))?;
        agent
            .create_backend("UCX", &params)
            .map_err(|e| nixl_err("creating the UCX backend", e))?;
        Ok(Self {
            device_regs: DeviceRegistrations::default(),
            host_regs: HostRegistrations::default(),
            agent,
            name: name.to_string(),
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This agent's metadata: its connection information and every registration's keys. It
    /// is a bearer credential: whoever loads it can read and write every registered region.
    pub fn metadata(&self) -> Result<Vec<u8>> {
        self.agent
            .get_local_md()
            .map_err(|e| nixl_err("reading the agent's metadata", e))
    }

    /// Loads a peer's metadata (from [`NixlAgent::metadata`] there, or NIXL's own API).
    pub fn connect(&self, metadata: &[u8]) -> Result<NixlPeer> {
        let name = self
            .agent
            .load_remote_md(metadata)
            .map_err(|e| nixl_err("loading a peer's metadata", e))?;
        Ok(NixlPeer { name })
    }

    /// Forgets a peer's metadata (its connection and keys). It takes the agent exclusively:
    /// no transfer of this agent's is running meanwhile (NIXL would lose track of it).
    pub fn forget(&mut self, peer: &NixlPeer) -> Result<()> {
        self.agent
            .invalidate_remote_md(&peer.name)
            .map_err(|e| nixl_err("forgetting a peer", e))
    }

    /// Registers `range` of `buf`; peers reach it after loading this agent's metadata anew.
    pub fn register(&self, buf: &HostBuffer, range: Range<usize>) -> Result<NixlRegion> {
        self.host_regs.purge();
        NixlRegion::new(&self.agent, buf, range)
    }

    /// Registers `range` of the device buffer `buf` (GPU memory, which UCX moves with its
    /// CUDA transports; the host backend's stand-in devices register as host memory).
    pub fn register_device(&self, buf: &DeviceBuffer, range: Range<usize>) -> Result<NixlRegion> {
        NixlRegion::device(&self.agent, buf, range)
    }

    /// Reads `dst.len()` bytes at `remote_off` of the peer's `remote` region into `dst`, a
    /// slice inside `region`; returns when they have landed.
    pub fn read_into(
        &self,
        region: &NixlRegion,
        dst: &mut [u8],
        peer: &NixlPeer,
        remote: &NixlRemote,
        remote_off: u64,
    ) -> Result<()> {
        let local = region.span_of(dst)?;
        let far = remote.span_at(remote_off, dst.len())?;
        self.transfer(XferOp::Read, local, peer, far)
    }

    /// Writes `src`, a slice inside `region`, at `remote_off` of the peer's `remote` region;
    /// returns when the peer's memory holds it.
    pub fn write_from(
        &self,
        region: &NixlRegion,
        src: &[u8],
        peer: &NixlPeer,
        remote: &NixlRemote,
        remote_off: u64,
    ) -> Result<()> {
        let local = region.span_of(src)?;
        let far = remote.span_at(remote_off, src.len())?;
        self.transfer(XferOp::Write, local, peer, far)
    }

    /// Reads `range.len()` bytes at `remote_off` of the peer's `remote` region into `range`
    /// of `region` (offsets into it; host or GPU memory, registered once).
    pub fn read_region(
        &self,
        region: &NixlRegion,
        range: Range<usize>,
        peer: &NixlPeer,
        remote: &NixlRemote,
        remote_off: u64,
    ) -> Result<()> {
        let far = remote.span_at(remote_off, range.len())?;
        let local = region.span_in(range)?;
        self.transfer(XferOp::Read, local, peer, far)
    }

    /// Writes `range` of `region` (offsets into it) at `remote_off` of the peer's `remote`
    /// region.
    pub fn write_region(
        &self,
        region: &NixlRegion,
        range: Range<usize>,
        peer: &NixlPeer,
        remote: &NixlRemote,
        remote_off: u64,
    ) -> Result<()> {
        let far = remote.span_at(remote_off, range.len())?;
        let local = region.span_in(range)?;
        self.transfer(XferOp::Write, local, peer, far)
    }

    /// Reads `dst.len()` bytes at `remote_off` of the peer's `remote` region straight into
    /// `dst`, which no registration covers: it is registered for this call alone (worth its
    /// cost for large transfers; a [`NixlRegion`] serves repeated ones).
    pub fn read_direct(
        &self,
        dst: &mut [u8],
        peer: &NixlPeer,
        remote: &NixlRemote,
        remote_off: u64,
    ) -> Result<()> {
        let far = remote.span_at(remote_off, dst.len())?;
        let local = Span::of(dst);
        let _reg = self.register_for_call(local)?;
        self.transfer(XferOp::Read, local, peer, far)
    }

    /// Writes `src`, which no registration covers, at `remote_off` of the peer's `remote`
    /// region: registered for this call alone, as for [`NixlAgent::read_direct`].
    pub fn write_direct(
        &self,
        src: &[u8],
        peer: &NixlPeer,
        remote: &NixlRemote,
        remote_off: u64,
    ) -> Result<()> {
        let far = remote.span_at(remote_off, src.len())?;
        let local = Span::of(src);
        let _reg = self.register_for_call(local)?;
        self.transfer(XferOp::Write, local, peer, far)
    }

    /// Reads `dst.len()` bytes at `remote_off` of the peer's `remote` region straight into
    /// `dst`, which lies in the host buffer `buf` (named by the guard that lends `dst`,
    /// [`RangeGuard::buffer`](gpuio_hal::RangeGuard::buffer)). The whole buffer is registered
    /// on first use and kept (a few per agent): later transfers anywhere in it cost no
    /// registration. A buffer too large to keep, or `dst` outside it, is registered for the
    /// call.
    pub fn read_kept(
        &self,
        buf: &BufferInfo,
        dst: &mut [u8],
        peer: &NixlPeer,
        remote: &NixlRemote,
        remote_off: u64,
    ) -> Result<()> {
        let far = remote.span_at(remote_off, dst.len())?;
        self.kept_transfer(XferOp::Read, buf, Span::of(dst), peer, far)
    }

    /// Writes `src`, which lies in the host buffer `buf`, at `remote_off` of the peer's
    /// `remote` region, the buffer kept registered as for [`NixlAgent::read_kept`].
    pub fn write_kept(
        &self,
        buf: &BufferInfo,
        src: &[u8],
        peer: &NixlPeer,
        remote: &NixlRemote,
        remote_off: u64,
    ) -> Result<()> {
        let far = remote.span_at(remote_off, src.len())?;
        self.kept_transfer(XferOp::Write, buf, Span::of(src), peer, far)
    }

    /// Host buffers kept registered by [`NixlAgent::read_kept`] and
    /// [`NixlAgent::write_kept`].
    pub fn host_registrations(&self) -> usize {
        self.host_regs.len()
    }

    fn kept_transfer(
        &self,
        op: XferOp,
        buf: &BufferInfo,
        local: Span,
        peer: &NixlPeer,
        far: Span,
    ) -> Result<()> {
        let inside = local.addr >= buf.addr()
            && local.addr.saturating_add(local.len) <= buf.addr().saturating_add(buf.len());
        // Both held until the transfer is done.
        let kept = if inside && local.len > 0 {
            self.host_regs.covering(&self.agent, buf)?
        } else {
            None
        };
        let _for_call = match &kept {
            Some(_) => None,
            None => self.register_for_call(local)?,
        };
        self.transfer(op, local, peer, far)
    }

    /// Reads `range.len()` bytes at `remote_off` of the peer's `remote` region straight into
    /// `range` of the device buffer `dst`. The allocation `dst` lies in is registered on first
    /// use and kept (a few per agent): later transfers into it cost no registration.
    pub fn read_device(
        &self,
        dst: &DeviceBuffer,
        range: Range<usize>,
        peer: &NixlPeer,
        remote: &NixlRemote,
        remote_off: u64,
    ) -> Result<()> {
        let far = remote.span_at(remote_off, range.len())?;
        let local = Span::of_device(dst, range)?;
        if local.len == 0 {
            return Ok(());
        }
        let _reg = self.device_regs.covering(&self.agent, dst)?;
        self.transfer(XferOp::Read, local, peer, far)
    }

    /// Writes `range` of the device buffer `src` at `remote_off` of the peer's `remote`
    /// region (its allocation registered as for [`NixlAgent::read_device`]).
    pub fn write_device(
        &self,
        src: &DeviceBuffer,
        range: Range<usize>,
        peer: &NixlPeer,
        remote: &NixlRemote,
        remote_off: u64,
    ) -> Result<()> {
        let far = remote.span_at(remote_off, range.len())?;
        let local = Span::of_device(src, range)?;
        if local.len == 0 {
            return Ok(());
        }
        let _reg = self.device_regs.covering(&self.agent, src)?;
        self.transfer(XferOp::Write, local, peer, far)
    }

    /// Device allocations kept registered by [`NixlAgent::read_device`] and
    /// [`NixlAgent::write_device`].
    pub fn device_registrations(&self) -> usize {
        self.device_regs.len()
    }

    /// Registers `span` until the handle drops (before the caller's borrow ends). A peer that
    /// loaded this agent's metadata meanwhile could reach it: the direct calls are for agents
    /// whose metadata is never handed out (a client's).
    fn register_for_call(&self, span: Span) -> Result<Option<nixl_sys::RegistrationHandle>> {
        if span.len == 0 {
            return Ok(None);
        }
        self.host_regs.purge();
        crate::memory::register_span(&self.agent, span).map(Some)
    }

    /// Posts one transfer and waits until NIXL is done with it, whatever that takes: a
    /// caller's slice is never written after this returns, and NIXL cannot stop a transfer in
    /// flight (forgetting the peer only hides its status). A peer that died is UCX's to
    /// detect (NIXL runs UCX with peer error handling: its keepalive fails what is in flight);
    /// a long wait is logged every [`WAIT_REPORT`].
    fn transfer(&self, op: XferOp, local: Span, peer: &NixlPeer, far: Span) -> Result<()> {
        if local.len == 0 {
            return Ok(());
        }
        if local.mem == crate::NixlMem::Host {
            self.host_regs.purge();
        }
        let what = match op {
            XferOp::Read => "read",
            XferOp::Write => "write",
        };
        let list = |s: Span| {
            let mut l = XferDescList::new(s.mem.mem_type())
                .map_err(|e| nixl_err("making a descriptor list", e))?;
            l.add_desc(s.addr, s.len, s.mem.device_id());
            Ok::<_, HalError>(l)
        };
        let (mine, theirs) = (list(local)?, list(far)?);
        let req = self
            .agent
            .create_xfer_req(op, &mine, &theirs, &peer.name, None)
            .map_err(|e| nixl_err("creating a transfer", e))?;
        let running = self
            .agent
            .post_xfer_req(&req, None)
            .map_err(|e| transfer_err(what, e))?;
        if !running {
            return Ok(());
        }
        let start = Instant::now();
        let mut reported = start;
        let mut spins = 0u32;
        loop {
            match self.agent.get_xfer_status(&req) {
                Ok(XferStatus::Success) => return Ok(()),
                Err(e) => return Err(transfer_err(what, e)),
                Ok(XferStatus::InProgress) => {}
            }
            if reported.elapsed() > WAIT_REPORT {
                reported = Instant::now();
                tracing::warn!(
                    peer = %peer.name,
                    waited = ?start.elapsed(),
                    "a NIXL {what} of {} bytes is still running",
                    local.len
                );
            }
            // Spin first (a small transfer lands in microseconds), then yield the core.
            spins = spins.saturating_add(1);
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

/// A transfer NIXL failed: the peer or the path to it (`Network`), or a bad request.
fn transfer_err(what: &'static str, e: nixl_sys::NixlError) -> HalError {
    let op = if what == "read" {
        "one-sided read"
    } else {
        "one-sided write"
    };
    match e {
        nixl_sys::NixlError::BackendError => HalError::Nixl {
            op,
            message: "the transfer failed (the peer or the path to it)".into(),
            code: gpuio_hal::ErrorCode::Network,
        },
        e => nixl_err(op, e),
    }
}

/// The plugins NIXL can load, listed by a throwaway agent with no backend.
pub(crate) fn available_plugins() -> Result<Vec<String>> {
    let cfg = AgentConfig {
        enable_prog_thread: false,
        ..AgentConfig::default()
    };
    let agent =
        Agent::new_configured("gpuio-probe", &cfg).map_err(|e| nixl_err("creating an agent", e))?;
    let list = agent
        .get_available_plugins()
        .map_err(|e| nixl_err("listing plugins", e))?;
    let mut names = list
        .iter()
        .map(|s| s.map(str::to_string))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| nixl_err("listing plugins", e))?;
    names.sort();
    Ok(names)
}
