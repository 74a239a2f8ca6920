//! The two ends of a transfer. [`Source`] and [`Dest`] borrow (for blocking calls: any slice,
//! any buffer); [`Endpoint`] owns handles (for requests that outlive the call: queued,
//! asynchronous, batched).

use crate::error::Result;
use gpuio_hal::{
    DeviceBuffer, HostBuffer, HostRead, HostWrite, MemoryRegion, RangeRead, RangeWrite,
    SharedHostBuffer,
};
use gpuio_transport_localio::FileHandle;
use gpuio_transport_remoteio::{RemoteExport, RemotePeer};
use std::fmt;
use std::sync::Arc;

/// What kind of resource an endpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum EndpointKind {
    /// Host memory (DRAM or CXL).
    Host,
    /// GPU memory.
    Device,
    /// A file or block device.
    File,
    /// Memory or a file another node exports (RemoteIO).
    Remote,
}

impl EndpointKind {
    /// Whether this is local storage (as opposed to memory or another node).
    pub fn is_storage(self) -> bool {
        matches!(self, Self::File)
    }

    /// Whether data comes from or goes to somewhere other than this node's memory: a read
    /// from it, a write to it.
    pub fn is_remote_or_storage(self) -> bool {
        matches!(self, Self::File | Self::Remote)
    }
}

/// An export of another node's agent, reached through a pooled [`RemotePeer`]. Clones share
/// the peer and the export, which remembers the agent instance it first met: once that agent
/// restarts, transfers through this handle fail (`Restarted`) instead of mixing the two
/// instances' bytes; a resource opened again meets the new instance.
#[derive(Clone)]
pub struct RemoteResource {
    inner: Arc<(Arc<RemotePeer>, RemoteExport)>,
}

impl RemoteResource {
    /// Export `export` of the agent behind `peer`.
    pub fn new(peer: Arc<RemotePeer>, export: impl Into<String>) -> Self {
        Self {
            inner: Arc::new((peer, RemoteExport::new(export))),
        }
    }

    /// The peer.
    pub fn peer(&self) -> &RemotePeer {
        &self.inner.0
    }

    /// The export.
    pub fn export(&self) -> &RemoteExport {
        &self.inner.1
    }

    /// Identity of this handle (equal for clones).
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as *const () as usize
    }
}

impl fmt::Debug for RemoteResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for RemoteResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "remoteio://{}/{}",
            self.peer().addr(),
            self.export().name()
        )
    }
}

/// Host memory shared between the caller and queued requests. A request locks the part it
/// touches while it runs (readers share, a writer excludes; requests on different granules —
/// about a sixteenth of the buffer each — run at once), so the caller never sees a
/// half-written range through a reference.
#[derive(Debug, Clone)]
pub struct HostMemory {
    inner: Arc<SharedHostBuffer>,
    /// The length it was made with, known without the lock: submitting a request must never
    /// wait for a buffer the caller (or a running request) holds. The engines check the
    /// buffer itself, under its lock, when they move bytes.
    len: usize,
}

impl HostMemory {
    /// Wraps a buffer.
    pub fn new(buf: HostBuffer) -> Self {
        let len = buf.len();
        Self {
            inner: Arc::new(SharedHostBuffer::new(buf)),
            len,
        }
    }

    /// Shared access to the whole buffer (waits for running requests that write any of it).
    pub fn read(&self) -> HostRead<'_> {
        self.inner.read()
    }

    /// Exclusive access to the whole buffer (waits for running requests that use any of it).
    pub fn write(&self) -> HostWrite<'_> {
        self.inner.write()
    }

    /// Shared access to `len` bytes from `offset` (waits only for writers of nearby bytes);
    /// a range past the end is an error.
    pub fn read_range(&self, offset: usize, len: usize) -> Result<RangeRead<'_>> {
        Ok(self.inner.read_range(offset, len)?)
    }

    /// Exclusive access to `len` bytes from `offset` (waits only for users of nearby bytes).
    pub fn write_range(&self, offset: usize, len: usize) -> Result<RangeWrite<'_>> {
        Ok(self.inner.write_range(offset, len)?)
    }

    /// Length in bytes (as made: a buffer swapped for another through `write` keeps its
    /// handle's length; transfers check the buffer itself).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes the buffer back if this is the last handle.
    pub fn into_inner(self) -> Option<HostBuffer> {
        Arc::into_inner(self.inner).map(SharedHostBuffer::into_inner)
    }

    /// Identity of the shared buffer (equal for clones).
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as *const () as usize
    }

    /// The shared buffer itself, for registrations that must keep it alive.
    pub(crate) fn shared(&self) -> &Arc<SharedHostBuffer> {
        &self.inner
    }
}

/// An owned end of a transfer.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// Host memory at an offset.
    Host {
        /// The memory.
        mem: HostMemory,
        /// Byte offset into it.
        offset: usize,
    },
    /// GPU memory at an offset.
    Device {
        /// The buffer.
        buf: DeviceBuffer,
        /// Byte offset into it.
        offset: usize,
    },
    /// A file at an offset.
    File {
        /// The file.
        file: FileHandle,
        /// Byte offset into it.
        offset: u64,
    },
    /// Another node's export at an offset.
    Remote {
        /// The export.
        res: RemoteResource,
        /// Byte offset into it.
        offset: u64,
    },
}

/// Identifies the resource behind an endpoint (for sorting and coalescing), ignoring offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResourceKey {
    kind: EndpointKind,
    id: usize,
}

impl Endpoint {
    /// Host memory at `offset`.
    pub fn host(mem: &HostMemory, offset: usize) -> Self {
        Self::Host {
            mem: mem.clone(),
            offset,
        }
    }

    /// GPU memory at `offset`.
    pub fn device(buf: &DeviceBuffer, offset: usize) -> Self {
        Self::Device {
            buf: buf.clone(),
            offset,
        }
    }

    /// A file at `offset`.
    pub fn file(file: &FileHandle, offset: u64) -> Self {
        Self::File {
            file: file.clone(),
            offset,
        }
    }

    /// Another node's export at `offset`.
    pub fn remote(res: &RemoteResource, offset: u64) -> Self {
        Self::Remote {
            res: res.clone(),
            offset,
        }
    }

    /// Its kind.
    pub fn kind(&self) -> EndpointKind {
        match self {
            Self::Host { .. } => EndpointKind::Host,
            Self::Device { .. } => EndpointKind::Device,
            Self::File { .. } => EndpointKind::File,
            Self::Remote { .. } => EndpointKind::Remote,
        }
    }

    /// The byte offset.
    pub fn offset(&self) -> u64 {
        match self {
            Self::Host { offset, .. } | Self::Device { offset, .. } => *offset as u64,
            Self::File { offset, .. } | Self::Remote { offset, .. } => *offset,
        }
    }

    /// The same resource `by` bytes further on.
    pub fn advanced(&self, by: usize) -> Self {
        match self {
            Self::Host { mem, offset } => Self::Host {
                mem: mem.clone(),
                offset: offset.saturating_add(by),
            },
            Self::Device { buf, offset } => Self::Device {
                buf: buf.clone(),
                offset: offset.saturating_add(by),
            },
            Self::File { file, offset } => Self::File {
                file: file.clone(),
                offset: offset.saturating_add(by as u64),
            },
            Self::Remote { res, offset } => Self::Remote {
                res: res.clone(),
                offset: offset.saturating_add(by as u64),
            },
        }
    }

    /// The resource it addresses.
    pub fn resource(&self) -> ResourceKey {
        let (kind, id) = match self {
            Self::Host { mem, .. } => (EndpointKind::Host, mem.id()),
            Self::Device { buf, .. } => (EndpointKind::Device, buf.device_addr() as usize),
            Self::File { file, .. } => (EndpointKind::File, file.id()),
            Self::Remote { res, .. } => (EndpointKind::Remote, res.id()),
        };
        ResourceKey { kind, id }
    }

    /// Bytes from here to the end of the memory it names (`None` for files and remote
    /// exports, whose size can change).
    pub fn room(&self) -> Option<usize> {
        match self {
            Self::Host { mem, offset } => Some(mem.len().saturating_sub(*offset)),
            Self::Device { buf, offset } => Some(buf.len().saturating_sub(*offset)),
            Self::File { .. } | Self::Remote { .. } => None,
        }
    }

    /// Whether `len` bytes from here and `len` bytes from `other` share any byte: the same
    /// host buffer, file (however opened) or export at intersecting offsets, or intersecting
    /// device addresses of one GPU (two views of one allocation included).
    pub fn overlaps(&self, other: &Endpoint, len: usize) -> bool {
        let span = |e: &Endpoint| -> (EndpointKind, usize, u64) {
            match e {
                Self::Device { buf, offset } => (
                    EndpointKind::Device,
                    buf.gpu().ordinal() as usize,
                    buf.device_addr().saturating_add(*offset as u64),
                ),
                _ => {
                    let key = e.resource();
                    (key.kind, key.id, e.offset())
                }
            }
        };
        let ((k1, space1, a), (k2, space2, b)) = (span(self), span(other));
        let len = len as u64;
        if k1 != k2 || len == 0 || a >= b.saturating_add(len) || b >= a.saturating_add(len) {
            return false;
        }
        // Two opens of one file (a path twice, a link) are one file: asked of the kernel only
        // once the ranges meet, so a request pays no stat otherwise. A failed stat counts as the
        // same file, which only makes the request run whole.
        match (self, other) {
            (Self::File { file: f, .. }, Self::File { file: g, .. }) if space1 != space2 => {
                f.same_inode(g).unwrap_or(true)
            }
            _ => space1 == space2,
        }
    }

    /// The memory region `len` bytes from here cover (`None` for files or out of range).
    pub fn region(&self, len: usize) -> Option<MemoryRegion> {
        match self {
            Self::Host { mem, offset } => mem.read().region().slice(*offset, len),
            Self::Device { buf, offset } => buf.region().slice(*offset, len),
            Self::File { .. } | Self::Remote { .. } => None,
        }
    }
}

impl Endpoint {
    /// The endpoint as a transfer's source (nothing is locked or cloned).
    pub fn source(&self) -> Source<'_> {
        match self {
            Self::Host { mem, offset } => Source::Memory(mem, *offset),
            Self::Device { buf, offset } => Source::Device(buf, *offset),
            Self::File { file, offset } => Source::File(file, *offset),
            Self::Remote { res, offset } => Source::Remote(res, *offset),
        }
    }

    /// The endpoint `by` bytes further on as a transfer's source; `None` where the offset
    /// overflows.
    pub fn source_at(&self, by: u64) -> Option<Source<'_>> {
        let mem_at = |offset: &usize| usize::try_from(by).ok()?.checked_add(*offset);
        Some(match self {
            Self::Host { mem, offset } => Source::Memory(mem, mem_at(offset)?),
            Self::Device { buf, offset } => Source::Device(buf, mem_at(offset)?),
            Self::File { file, offset } => Source::File(file, offset.checked_add(by)?),
            Self::Remote { res, offset } => Source::Remote(res, offset.checked_add(by)?),
        })
    }

    /// The endpoint as a transfer's destination (nothing is locked or cloned).
    pub fn dest(&self) -> Dest<'_> {
        match self {
            Self::Host { mem, offset } => Dest::Memory(mem, *offset),
            Self::Device { buf, offset } => Dest::Device(buf, *offset),
            Self::File { file, offset } => Dest::File(file, *offset),
            Self::Remote { res, offset } => Dest::Remote(res, *offset),
        }
    }

    /// What a durable write to this endpoint must flush (`fdatasync`) before it completes: the
    /// file, or nothing. Memory has nothing to flush, and the agent protocol has no flush: a
    /// write to another node is as durable as its agent's export. Whoever completes a durable
    /// request flushes it once, however many transfers carried it.
    pub fn durable_file(&self) -> Option<&FileHandle> {
        match self {
            Self::File { file, .. } => Some(file),
            Self::Host { .. } | Self::Device { .. } | Self::Remote { .. } => None,
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Host { offset, .. } => write!(f, "host memory +{offset}"),
            Self::Device { buf, offset } => write!(f, "gpu{} +{offset}", buf.gpu().ordinal()),
            Self::File { file, offset } => write!(f, "{} +{offset}", file.path().display()),
            Self::Remote { res, offset } => write!(f, "{res} +{offset}"),
        }
    }
}

/// A borrowed source of a transfer.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// A caller's host memory (pinned or pageable; MemIO finds out which).
    Host(&'a [u8]),
    /// Shared host memory from an offset, locked by the engine while it reads.
    Memory(&'a HostMemory, usize),
    /// GPU memory from an offset.
    Device(&'a DeviceBuffer, usize),
    /// A file from an offset.
    File(&'a FileHandle, u64),
    /// Another node's export from an offset.
    Remote(&'a RemoteResource, u64),
}

/// A borrowed destination of a transfer.
#[derive(Debug)]
pub enum Dest<'a> {
    /// A caller's host memory.
    Host(&'a mut [u8]),
    /// Shared host memory from an offset, locked by the engine while it writes.
    Memory(&'a HostMemory, usize),
    /// GPU memory from an offset.
    Device(&'a DeviceBuffer, usize),
    /// A file from an offset.
    File(&'a FileHandle, u64),
    /// Another node's export from an offset.
    Remote(&'a RemoteResource, u64),
}

impl Source<'_> {
    /// Its kind.
    pub fn kind(&self) -> EndpointKind {
        match self {
            Self::Host(_) | Self::Memory(..) => EndpointKind::Host,
            Self::Device(..) => EndpointKind::Device,
            Self::File(..) => EndpointKind::File,
            Self::Remote(..) => EndpointKind::Remote,
        }
    }
}

impl Dest<'_> {
    /// Its kind.
    pub fn kind(&self) -> EndpointKind {
        match self {
            Self::Host(_) | Self::Memory(..) => EndpointKind::Host,
            Self::Device(..) => EndpointKind::Device,
            Self::File(..) => EndpointKind::File,
            Self::Remote(..) => EndpointKind::Remote,
        }
    }
}
