//! What a finished transfer reports: its bytes, its engine, and the way the bytes went, typed
//! ([`Route`]) so that callers can match on it and layers above add facts ([`Outcome::coalesced`],
//! [`Outcome::failover`]) instead of text.

use crate::route::EngineKind;
use gpuio_transport_localio::Transfer as LocalIoReport;
use gpuio_transport_memio::Route as MemIoRoute;
use std::fmt;
use std::net::SocketAddr;

/// How RemoteIO moved host memory's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteVia {
    /// Through the connection's own buffers.
    Connection,
    /// In place: the memory was registered with the peer's RDMA device.
    Registered,
    /// Through pinned staging buffers (GPU memory, files, a third node).
    Staged,
    /// GPU memory to GPU memory over NIXL (`cuda_ipc` on one host, GPUDirect RDMA).
    GpuToGpu,
}

/// The way a transfer's bytes went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// A MemIO copy (DMA, staged pipeline, CPU copy, device or peer copy).
    Mem(MemIoRoute),
    /// A move within one host buffer.
    HostMove,
    /// LocalIO read a file into host memory.
    FileToHost(LocalIoReport),
    /// LocalIO wrote host memory to a file.
    HostToFile(LocalIoReport),
    /// File to file through a host buffer.
    FileCopy,
    /// LocalIO read a file into GPU memory.
    FileToDevice(LocalIoReport),
    /// LocalIO wrote GPU memory to a file.
    DeviceToFile(LocalIoReport),
    /// RemoteIO read from another node.
    RemoteRead {
        /// The node.
        peer: SocketAddr,
        /// How.
        via: RemoteVia,
    },
    /// RemoteIO wrote to another node.
    RemoteWrite {
        /// The node.
        peer: SocketAddr,
        /// How.
        via: RemoteVia,
    },
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let via = |via: &RemoteVia| match via {
            RemoteVia::Connection => "",
            RemoteVia::Registered => " in place (RDMA-registered)",
            RemoteVia::Staged => " staged through pinned memory",
            RemoteVia::GpuToGpu => " GPU to GPU (NIXL)",
        };
        match self {
            Self::Mem(r) => write!(f, "{r}"),
            Self::HostMove => f.write_str("move within one host buffer"),
            Self::FileToHost(t) => write!(f, "read: {t}"),
            Self::HostToFile(t) => write!(f, "write: {t}"),
            Self::FileCopy => f.write_str("pread + pwrite through host memory"),
            Self::FileToDevice(t) => write!(f, "read: {t}"),
            Self::DeviceToFile(t) => write!(f, "write: {t}"),
            Self::RemoteRead { peer, via: v } => write!(f, "read from {peer}{}", via(v)),
            Self::RemoteWrite { peer, via: v } => write!(f, "write to {peer}{}", via(v)),
        }
    }
}

/// What a finished transfer reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Bytes moved.
    pub bytes: usize,
    /// The engine that moved them.
    pub engine: EngineKind,
    /// How.
    pub route: Route,
    /// Requests this transfer carried: more than one when the scheduler merged adjacent
    /// requests into it.
    pub coalesced: usize,
    /// The alternate source that served it after the source failed (its display form).
    pub failover: Option<String>,
}

impl Outcome {
    /// `bytes` moved by `engine` by way of `route`, for one request from its own source.
    pub fn new(bytes: usize, engine: EngineKind, route: Route) -> Self {
        Self {
            bytes,
            engine,
            route,
            coalesced: 1,
            failover: None,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.route)?;
        if self.coalesced > 1 {
            write!(f, " ({} requests coalesced)", self.coalesced)?;
        }
        if let Some(src) = &self.failover {
            write!(f, " (failover to {src})")?;
        }
        Ok(())
    }
}
