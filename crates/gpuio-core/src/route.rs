//! Routing, decided once: [`Transfer::new`] sorts a pair of endpoints into the transfer of the
//! one engine that serves it — anything touching another node to RemoteIO, else anything
//! touching a file to LocalIO, memory to memory to MemIO ([`EngineKind::serving`] is the same
//! table over endpoint kinds, for requests that are queued before they run). Each engine then
//! receives only its own kind of transfer, so no engine has a pair of endpoints to refuse.
//!
//! Host memory reaches an engine unlocked ([`HostSrc::Memory`], [`HostDst::Memory`]): the
//! engine locks it for as long as it touches the bytes, and can first register it by identity
//! (RDMA needs that); a caller's slice ([`HostSrc::Slice`]) is already borrowed for the call.

use crate::endpoint::{Dest, EndpointKind, HostMemory, RemoteResource, Source};
use crate::error::Result;
use gpuio_hal::{DeviceBuffer, HalError, check_range};
use gpuio_transport_localio::FileHandle;
use serde::Serialize;
use std::fmt;

/// The transport that carries a transfer (`gpuio_io_engine_t`; docs/REFERENCE.md#transports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum EngineKind {
    /// Host DRAM / CXL / GPU memory.
    MemIo,
    /// Files and block devices.
    LocalIo,
    /// Other nodes.
    RemoteIo,
}

impl EngineKind {
    /// The engine that serves transfers between these kinds of endpoint.
    pub fn serving(src: EndpointKind, dst: EndpointKind) -> Self {
        use EndpointKind::{File, Remote};
        match (src, dst) {
            (Remote, _) | (_, Remote) => Self::RemoteIo,
            (File, _) | (_, File) => Self::LocalIo,
            _ => Self::MemIo,
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::MemIo => "memio",
            Self::LocalIo => "localio",
            Self::RemoteIo => "remoteio",
        })
    }
}

/// Host bytes a transfer reads.
#[derive(Debug, Clone, Copy)]
pub enum HostSrc<'a> {
    /// A caller's slice, borrowed for the call.
    Slice(&'a [u8]),
    /// Shared host memory from an offset; the engine holds the range's read guard while it
    /// reads.
    Memory(&'a HostMemory, usize),
}

impl HostSrc<'_> {
    /// Runs `f` on the first `len` bytes (locked for the call where they are shared).
    pub fn with<T>(self, len: usize, f: impl FnOnce(&[u8]) -> Result<T>) -> Result<T> {
        match self {
            Self::Slice(s) => {
                check_range("source", 0, len, s.len())?;
                f(&s[..len])
            }
            Self::Memory(mem, offset) => f(&mem
                .shared()
                .read_range(offset, len)
                .map_err(side("source"))?),
        }
    }
}

/// Names the side of a transfer a host-memory range error is on.
pub(crate) fn side(what: &'static str) -> impl FnOnce(HalError) -> HalError {
    move |e| match e {
        HalError::OutOfRange {
            offset, len, limit, ..
        } => HalError::OutOfRange {
            what,
            offset,
            len,
            limit,
        },
        other => other,
    }
}

/// Host bytes a transfer writes.
#[derive(Debug)]
pub enum HostDst<'a> {
    /// A caller's slice, borrowed for the call.
    Slice(&'a mut [u8]),
    /// Shared host memory from an offset; the engine holds the range's write guard while it
    /// writes.
    Memory(&'a HostMemory, usize),
}

impl HostDst<'_> {
    /// Runs `f` on the first `len` bytes (locked for the call where they are shared).
    pub fn with<T>(self, len: usize, f: impl FnOnce(&mut [u8]) -> Result<T>) -> Result<T> {
        match self {
            Self::Slice(s) => {
                check_range("destination", 0, len, s.len())?;
                f(&mut s[..len])
            }
            Self::Memory(mem, offset) => f(&mut mem
                .shared()
                .write_range(offset, len)
                .map_err(side("destination"))?),
        }
    }
}

/// GPU memory from an offset.
#[derive(Debug, Clone, Copy)]
pub struct DeviceAt<'a> {
    /// The buffer.
    pub buf: &'a DeviceBuffer,
    /// Byte offset into it.
    pub offset: usize,
}

/// A file from an offset.
#[derive(Debug, Clone, Copy)]
pub struct FileAt<'a> {
    /// The file.
    pub file: &'a FileHandle,
    /// Byte offset into it.
    pub offset: u64,
}

/// Another node's export from an offset.
#[derive(Debug, Clone, Copy)]
pub struct RemoteAt<'a> {
    /// The export.
    pub res: &'a RemoteResource,
    /// Byte offset into it.
    pub offset: u64,
}

/// What MemIO serves: memory to memory on this node.
#[derive(Debug)]
pub enum MemTransfer<'a> {
    /// Host memory to GPU memory.
    HostToDevice(HostSrc<'a>, DeviceAt<'a>),
    /// GPU memory to host memory.
    DeviceToHost(DeviceAt<'a>, HostDst<'a>),
    /// GPU memory to GPU memory (one device or two).
    DeviceToDevice(DeviceAt<'a>, DeviceAt<'a>),
    /// Host memory to host memory (possibly within one buffer).
    HostToHost(HostSrc<'a>, HostDst<'a>),
}

/// What LocalIO serves: a file and memory, or two files.
#[derive(Debug)]
pub enum LocalTransfer<'a> {
    /// A file into host memory.
    FileToHost(FileAt<'a>, HostDst<'a>),
    /// Host memory into a file.
    HostToFile(HostSrc<'a>, FileAt<'a>),
    /// A file into GPU memory.
    FileToDevice(FileAt<'a>, DeviceAt<'a>),
    /// GPU memory into a file.
    DeviceToFile(DeviceAt<'a>, FileAt<'a>),
    /// A file into a file (possibly the same one).
    FileToFile(FileAt<'a>, FileAt<'a>),
}

/// A local end of a transfer RemoteIO stages through pinned host memory.
#[derive(Debug, Clone, Copy)]
pub enum StagedEnd<'a> {
    /// GPU memory.
    Device(DeviceAt<'a>),
    /// A file.
    File(FileAt<'a>),
    /// Another node's export (a copy between two nodes passes through this one).
    Remote(RemoteAt<'a>),
}

impl StagedEnd<'_> {
    /// The same end `by` bytes further on (saturating: an offset past any file or export then
    /// fails there, with its error).
    pub fn advanced(self, by: usize) -> Self {
        match self {
            Self::Device(d) => Self::Device(DeviceAt {
                offset: d.offset.saturating_add(by),
                ..d
            }),
            Self::File(f) => Self::File(FileAt {
                offset: f.offset.saturating_add(by as u64),
                ..f
            }),
            Self::Remote(r) => Self::Remote(RemoteAt {
                offset: r.offset.saturating_add(by as u64),
                ..r
            }),
        }
    }
}

/// What RemoteIO serves: anything touching another node.
#[derive(Debug)]
pub enum RemoteTransfer<'a> {
    /// Another node's bytes into host memory, in place.
    ToHost(RemoteAt<'a>, HostDst<'a>),
    /// Host memory to another node, in place.
    FromHost(HostSrc<'a>, RemoteAt<'a>),
    /// Another node's bytes into GPU memory, a file or a third node, through pinned staging
    /// buffers.
    StagedRead(RemoteAt<'a>, StagedEnd<'a>),
    /// GPU memory or a file to another node, through pinned staging buffers.
    StagedWrite(StagedEnd<'a>, RemoteAt<'a>),
}

/// A transfer routed to its engine.
#[derive(Debug)]
pub enum Transfer<'a> {
    /// For MemIO.
    Mem(MemTransfer<'a>),
    /// For LocalIO.
    Local(LocalTransfer<'a>),
    /// For RemoteIO.
    Remote(RemoteTransfer<'a>),
}

/// The two ends after the routing step: host sides in one form.
enum End<'a, H> {
    Host(H),
    Device(DeviceAt<'a>),
    File(FileAt<'a>),
    Remote(RemoteAt<'a>),
}

impl<'a> Transfer<'a> {
    /// Routes a transfer: the one place where a pair of endpoints meets an engine.
    pub fn new(src: Source<'a>, dst: Dest<'a>) -> Self {
        use End::*;
        let src = match src {
            Source::Host(s) => Host(HostSrc::Slice(s)),
            Source::Memory(m, offset) => Host(HostSrc::Memory(m, offset)),
            Source::Device(buf, offset) => Device(DeviceAt { buf, offset }),
            Source::File(file, offset) => File(FileAt { file, offset }),
            Source::Remote(res, offset) => Remote(RemoteAt { res, offset }),
        };
        let dst = match dst {
            Dest::Host(s) => Host(HostDst::Slice(s)),
            Dest::Memory(m, offset) => Host(HostDst::Memory(m, offset)),
            Dest::Device(buf, offset) => Device(DeviceAt { buf, offset }),
            Dest::File(file, offset) => File(FileAt { file, offset }),
            Dest::Remote(res, offset) => Remote(RemoteAt { res, offset }),
        };
        match (src, dst) {
            // Another node: RemoteIO.
            (Remote(r), Host(h)) => Self::Remote(RemoteTransfer::ToHost(r, h)),
            (Host(h), Remote(r)) => Self::Remote(RemoteTransfer::FromHost(h, r)),
            (Remote(r), Device(d)) => {
                Self::Remote(RemoteTransfer::StagedRead(r, StagedEnd::Device(d)))
            }
            (Remote(r), File(f)) => Self::Remote(RemoteTransfer::StagedRead(r, StagedEnd::File(f))),
            (Remote(a), Remote(b)) => {
                Self::Remote(RemoteTransfer::StagedRead(a, StagedEnd::Remote(b)))
            }
            (Device(d), Remote(r)) => {
                Self::Remote(RemoteTransfer::StagedWrite(StagedEnd::Device(d), r))
            }
            (File(f), Remote(r)) => {
                Self::Remote(RemoteTransfer::StagedWrite(StagedEnd::File(f), r))
            }
            // A file: LocalIO.
            (File(f), Host(h)) => Self::Local(LocalTransfer::FileToHost(f, h)),
            (Host(h), File(f)) => Self::Local(LocalTransfer::HostToFile(h, f)),
            (File(f), Device(d)) => Self::Local(LocalTransfer::FileToDevice(f, d)),
            (Device(d), File(f)) => Self::Local(LocalTransfer::DeviceToFile(d, f)),
            (File(a), File(b)) => Self::Local(LocalTransfer::FileToFile(a, b)),
            // Memory: MemIO.
            (Host(h), Device(d)) => Self::Mem(MemTransfer::HostToDevice(h, d)),
            (Device(d), Host(h)) => Self::Mem(MemTransfer::DeviceToHost(d, h)),
            (Device(a), Device(b)) => Self::Mem(MemTransfer::DeviceToDevice(a, b)),
            (Host(a), Host(b)) => Self::Mem(MemTransfer::HostToHost(a, b)),
        }
    }

    /// The engine it was routed to.
    pub fn engine(&self) -> EngineKind {
        match self {
            Self::Mem(_) => EngineKind::MemIo,
            Self::Local(_) => EngineKind::LocalIo,
            Self::Remote(_) => EngineKind::RemoteIo,
        }
    }
}
