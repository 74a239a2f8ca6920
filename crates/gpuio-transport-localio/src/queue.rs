//! The IO queue of one lane: a set of pinned staging slots and the operations that fill and
//! drain them. Two engines with one interface — io_uring (fixed buffers and files, many
//! operations in flight) and positioned reads/writes (the fallback where io_uring is
//! refused; each operation completes as it is queued).

use crate::{LocalIoError, Result};
use gpuio_hal::uring::{BufSlot, Done, FileSlot, Ring, RingOptions};
use gpuio_hal::{GdsMode, HostBuffer};
use std::collections::VecDeque;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

/// Which IO engine moved a transfer (what fio calls the `ioengine`): the queue a lane runs,
/// or cuFile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum IoEngine {
    /// io_uring with fixed buffers and files, through pinned staging.
    Uring,
    /// `pread`/`pwrite` on the lane's thread, through pinned staging.
    Posix,
    /// cuFile (GPUDirect Storage), in the mode the machine allows.
    Gds(GdsMode),
    /// The page cache itself: the file's mapping registered read-only with the device, read by
    /// its copy engine (no CPU copy).
    PageCache,
    /// gpuio's own NVMe driver (`nvme://`), through pinned host memory.
    Nvme,
    /// `pread`/`pwrite` straight into and out of host memory, on the IO threads (no staging).
    HostCopy,
}

impl std::fmt::Display for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Uring => "io_uring",
            Self::Posix => "pread/pwrite",
            Self::Gds(GdsMode::Native) => "cuFile (GDS)",
            Self::Gds(GdsMode::Compat) => "cuFile (compat mode)",
            Self::PageCache => "page cache, registered read-only (zero-copy DMA)",
            Self::Nvme => "gpuio's NVMe driver (user space), staged through pinned memory",
            Self::HostCopy => "pread/pwrite in place",
        })
    }
}

/// A file attached to a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileId(u32);

/// A lane's queue.
pub(crate) enum IoQueue {
    Uring(Box<Ring>),
    Posix(PosixQueue),
}

/// Positioned reads and writes, completing at once.
pub(crate) struct PosixQueue {
    slots: Vec<Option<HostBuffer>>,
    files: Vec<Option<Arc<File>>>,
    done: VecDeque<Done>,
}

fn io_err(e: gpuio_hal::HalError) -> LocalIoError {
    LocalIoError::Hal(e)
}

impl IoQueue {
    /// A queue of `buffers` slots; io_uring unless `engine` says otherwise or it is refused.
    pub(crate) fn new(
        engine: IoEngine,
        buffers: Vec<HostBuffer>,
        depth: u32,
        sqpoll: bool,
    ) -> Result<Self> {
        if engine == IoEngine::Uring {
            let opts = RingOptions {
                entries: depth.max(buffers.len() as u32).max(8),
                sqpoll_idle_ms: sqpoll.then_some(50),
                file_slots: crate::StripeSet::MAX_FILES as u32,
            };
            let mut ring = Ring::new(opts).map_err(io_err)?;
            ring.register_buffers(buffers).map_err(io_err)?;
            return Ok(Self::Uring(Box::new(ring)));
        }
        Ok(Self::Posix(PosixQueue {
            slots: buffers.into_iter().map(Some).collect(),
            files: Vec::new(),
            done: VecDeque::new(),
        }))
    }

    pub(crate) fn engine(&self) -> IoEngine {
        match self {
            Self::Uring(_) => IoEngine::Uring,
            Self::Posix(_) => IoEngine::Posix,
        }
    }

    pub(crate) fn slots(&self) -> usize {
        match self {
            Self::Uring(r) => r.buffers(),
            Self::Posix(p) => p.slots.len(),
        }
    }

    pub(crate) fn attach(&mut self, file: Arc<File>) -> Result<FileId> {
        match self {
            Self::Uring(r) => Ok(FileId(r.register_file(file).map_err(io_err)?.0)),
            Self::Posix(p) => {
                let i = match p.files.iter().position(Option::is_none) {
                    Some(i) => i,
                    None => {
                        p.files.push(None);
                        p.files.len() - 1
                    }
                };
                p.files[i] = Some(file);
                Ok(FileId(i as u32))
            }
        }
    }

    pub(crate) fn detach(&mut self, file: FileId) {
        match self {
            Self::Uring(r) => {
                let _ = r.unregister_file(FileSlot(file.0));
            }
            Self::Posix(p) => {
                if let Some(f) = p.files.get_mut(file.0 as usize) {
                    *f = None;
                }
            }
        }
    }

    pub(crate) fn buffer_mut(&mut self, slot: usize) -> Result<&mut HostBuffer> {
        match self {
            Self::Uring(r) => r.buffer_mut(BufSlot(slot)).map_err(io_err),
            Self::Posix(p) => p
                .slots
                .get_mut(slot)
                .and_then(Option::as_mut)
                .ok_or_else(|| lent(slot)),
        }
    }

    pub(crate) fn take(&mut self, slot: usize) -> Result<HostBuffer> {
        match self {
            Self::Uring(r) => r.take_buffer(BufSlot(slot)).map_err(io_err),
            Self::Posix(p) => p
                .slots
                .get_mut(slot)
                .and_then(Option::take)
                .ok_or_else(|| lent(slot)),
        }
    }

    pub(crate) fn put(&mut self, slot: usize, buf: HostBuffer) -> Result<()> {
        match self {
            Self::Uring(r) => r.put_buffer(BufSlot(slot), buf).map_err(io_err),
            Self::Posix(p) => match p.slots.get_mut(slot) {
                Some(s @ None) => {
                    *s = Some(buf);
                    Ok(())
                }
                _ => Err(lent(slot)),
            },
        }
    }

    /// Queues a read of `range` of `slot` from `file` at `offset`.
    pub(crate) fn read(
        &mut self,
        file: FileId,
        offset: u64,
        slot: usize,
        range: Range<usize>,
        tag: u64,
    ) -> Result<()> {
        match self {
            Self::Uring(r) => r
                .read_fixed(FileSlot(file.0), offset, BufSlot(slot), range, tag)
                .map_err(io_err),
            Self::Posix(p) => p.run(file, slot, range, tag, |f, buf| read_full(f, buf, offset)),
        }
    }

    /// Queues a write of `range` of `slot` to `file` at `offset`.
    pub(crate) fn write(
        &mut self,
        file: FileId,
        offset: u64,
        slot: usize,
        range: Range<usize>,
        tag: u64,
    ) -> Result<()> {
        match self {
            Self::Uring(r) => r
                .write_fixed(FileSlot(file.0), offset, BufSlot(slot), range, tag)
                .map_err(io_err),
            Self::Posix(p) => p.run(file, slot, range, tag, |f, buf| write_full(f, buf, offset)),
        }
    }

    /// Completions, waiting for at least `min` of the operations in flight.
    pub(crate) fn complete(&mut self, min: usize) -> Result<Vec<Done>> {
        match self {
            Self::Uring(r) => r.complete(min).map_err(io_err),
            Self::Posix(p) => Ok(p.done.drain(..).collect()),
        }
    }

    /// Waits for what is in flight and hands the staging buffers back (those not lent out),
    /// unregistered; the queue has none afterwards. Where the ring cannot be waited on or
    /// unregistered, it keeps them (and its drop frees them): none come back.
    pub(crate) fn release_buffers(&mut self) -> Vec<HostBuffer> {
        match self {
            Self::Uring(r) => r.unregister_buffers().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "staging buffers not returned from an io_uring");
                Vec::new()
            }),
            Self::Posix(p) => {
                p.done.clear();
                p.slots.drain(..).flatten().collect()
            }
        }
    }

    pub(crate) fn in_flight(&self) -> usize {
        match self {
            Self::Uring(r) => r.in_flight(),
            Self::Posix(p) => p.done.len(),
        }
    }
}

impl PosixQueue {
    /// Runs one positioned IO on `range` of `slot` now and queues its completion.
    fn run(
        &mut self,
        file: FileId,
        slot: usize,
        range: Range<usize>,
        tag: u64,
        io: impl FnOnce(&File, &mut [u8]) -> std::io::Result<usize>,
    ) -> Result<()> {
        let f = self.file(file)?;
        let buf = self
            .slots
            .get_mut(slot)
            .and_then(Option::as_mut)
            .ok_or_else(|| lent(slot))?;
        let bytes = buf.get_mut(range).ok_or_else(|| bad_range(slot))?;
        let result = io(&f, bytes);
        self.done.push_back(Done {
            tag,
            result,
            buf: Some(BufSlot(slot)),
        });
        Ok(())
    }

    fn file(&self, id: FileId) -> Result<Arc<File>> {
        self.files
            .get(id.0 as usize)
            .and_then(Option::clone)
            .ok_or_else(|| LocalIoError::Internal(format!("no file attached as {}", id.0)))
    }
}

/// `pread` until `buf` is full or the file ends (as io_uring reports: the count, short at end
/// of file), retrying on EINTR.
fn read_full(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// `pwrite` all of `buf`, or report how far it got by the error.
fn write_full(f: &File, buf: &[u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.write_at(&buf[done..], offset + done as u64) {
            Ok(0) => return Ok(done),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if done > 0 => {
                tracing::debug!(error = %e, done, "short write");
                return Ok(done);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

fn lent(slot: usize) -> LocalIoError {
    LocalIoError::Internal(format!("staging slot {slot} is lent or absent"))
}

fn bad_range(slot: usize) -> LocalIoError {
    LocalIoError::Internal(format!("range outside staging slot {slot}"))
}
