//! A safe io_uring: the ring owns everything the kernel may touch while an operation is in
//! flight. Buffers are [`HostBuffer`]s registered as fixed buffers and owned by the ring (an
//! operation marks its buffer busy until its completion is reaped — several may target ranges
//! of one buffer); files are registered as
//! fixed files and the ring holds them open. Dropping the ring waits for everything in flight.
//!
//! A ring made with [`Ring::with_buffer_table`] instead has a sparse table whose slots register
//! ranges of *shared* buffers (`Arc<SharedHostBuffer>`, which stay usable by others): the slot
//! keeps the buffer, and [`Ring::read_fixed_shared`] holds its write lock while the kernel fills
//! the range.
//!
//! One ring per thread (it is `Send`, not `Sync`): LocalIO runs one per lane.
//!
//! This file holds the ring, its owned fixed buffers and files, submission and completion;
//! `shared.rs` the sparse table of shared buffers.

mod shared;
#[cfg(test)]
mod tests;

use crate::error::{HalError, Result};
use crate::memory::HostBuffer;
use io_uring::{IoUring, opcode, squeue, types};
use shared::SharedSlot;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// Options of a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingOptions {
    /// Submission queue entries (the most operations in flight).
    pub entries: u32,
    /// Use a kernel submission-polling thread that idles after this many milliseconds.
    pub sqpoll_idle_ms: Option<u32>,
    /// Slots for registered files.
    pub file_slots: u32,
}

impl Default for RingOptions {
    fn default() -> Self {
        Self {
            entries: 64,
            sqpoll_idle_ms: None,
            file_slots: 16,
        }
    }
}

/// A registered buffer of a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufSlot(pub usize);

/// A slot of a ring's sparse buffer table, holding a range of a shared buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufIndex(pub u16);

/// A registered file of a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileSlot(pub u32);

/// A finished operation.
#[derive(Debug)]
pub struct Done {
    /// The caller's tag.
    pub tag: u64,
    /// Bytes transferred, or the OS error.
    pub result: std::io::Result<usize>,
    /// The buffer it used, now idle again.
    pub buf: Option<BufSlot>,
}

enum Slot {
    Idle(HostBuffer),
    /// With this many operations in flight (several may target ranges of one buffer).
    Busy(HostBuffer, usize),
    /// Handed out with [`Ring::take_buffer`]; still registered, not usable until put back.
    Lent,
}

/// An io_uring with owned fixed buffers and files.
pub struct Ring {
    ring: IoUring,
    slots: Vec<Slot>,
    files: Vec<Option<Arc<File>>>,
    /// Registered address and length of each buffer slot.
    bases: Vec<(usize, usize)>,
    /// The sparse table of shared buffers ([`Ring::with_buffer_table`]); empty otherwise.
    table: Vec<Option<SharedSlot>>,
    pending: HashMap<u64, (u64, Option<usize>)>,
    /// Completions reaped while waiting for one operation, for the next [`Ring::complete`].
    stash: Vec<Done>,
    next_id: u64,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("buffers", &self.slots.len())
            .field("in_flight", &self.pending.len())
            .finish()
    }
}

fn os(op: &'static str) -> impl FnOnce(std::io::Error) -> HalError {
    move |source| HalError::Os { op, source }
}

impl Ring {
    /// Creates a ring. Fails where io_uring is refused (seccomp, `kernel.io_uring_disabled`,
    /// old kernels): callers fall back to positioned reads and writes.
    pub fn new(opts: RingOptions) -> Result<Self> {
        let mut builder = IoUring::builder();
        if let Some(idle) = opts.sqpoll_idle_ms {
            builder.setup_sqpoll(idle);
        }
        let ring = builder
            .build(opts.entries.max(2))
            .map_err(os("io_uring_setup"))?;
        ring.submitter()
            .register_files_sparse(opts.file_slots.max(1))
            .map_err(os("io_uring_register(files)"))?;
        Ok(Self {
            ring,
            slots: Vec::new(),
            files: vec![None; opts.file_slots.max(1) as usize],
            bases: Vec::new(),
            table: Vec::new(),
            pending: HashMap::new(),
            stash: Vec::new(),
            next_id: 0,
        })
    }

    /// Whether io_uring works here, and why not where it does not.
    pub fn probe() -> crate::Capability {
        match Self::new(RingOptions::default()) {
            Ok(_) => crate::Capability::yes("io_uring rings with fixed buffers and files"),
            Err(e) => crate::Capability::no(e.to_string()),
        }
    }

    /// Registers `buffers` as the ring's fixed buffers (once per ring); the ring owns them.
    pub fn register_buffers(&mut self, buffers: Vec<HostBuffer>) -> Result<()> {
        if !self.slots.is_empty() || !self.table.is_empty() {
            return Err(HalError::InvalidArgument(
                "the ring already has registered buffers".into(),
            ));
        }
        let iovecs: Vec<libc::iovec> = buffers
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.as_slice().as_ptr() as *mut libc::c_void,
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: every iovec describes a live mapping owned by a HostBuffer that the ring keeps
        // (in `slots`) until after it unregisters the buffers, in Drop.
        unsafe { self.ring.submitter().register_buffers(&iovecs) }
            .map_err(os("io_uring_register(buffers)"))?;
        self.bases = buffers
            .iter()
            .map(|b| (b.as_slice().as_ptr() as usize, b.len()))
            .collect();
        self.slots = buffers.into_iter().map(Slot::Idle).collect();
        Ok(())
    }

    /// Registers a file; the ring keeps it open until [`Ring::unregister_file`] or drop.
    pub fn register_file(&mut self, file: Arc<File>) -> Result<FileSlot> {
        let index = self
            .files
            .iter()
            .position(Option::is_none)
            .ok_or_else(|| HalError::InvalidArgument("no free file slot in the ring".into()))?;
        self.ring
            .submitter()
            .register_files_update(index as u32, &[file.as_raw_fd()])
            .map_err(os("io_uring_register(files_update)"))?;
        self.files[index] = Some(file);
        Ok(FileSlot(index as u32))
    }

    /// Releases a file slot (waiting for nothing: the caller must have reaped its operations).
    pub fn unregister_file(&mut self, slot: FileSlot) -> Result<()> {
        self.file(slot)?;
        self.ring
            .submitter()
            .register_files_update(slot.0, &[-1])
            .map_err(os("io_uring_register(files_update)"))?;
        self.files[slot.0 as usize] = None;
        Ok(())
    }

    fn file(&self, slot: FileSlot) -> Result<&Arc<File>> {
        self.files
            .get(slot.0 as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| HalError::InvalidArgument(format!("file slot {} is empty", slot.0)))
    }

    /// Number of registered buffers.
    pub fn buffers(&self) -> usize {
        self.slots.len()
    }

    /// Operations submitted and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// An idle buffer, to read.
    pub fn buffer(&self, slot: BufSlot) -> Result<&HostBuffer> {
        match self.slots.get(slot.0) {
            Some(Slot::Idle(b)) => Ok(b),
            _ => Err(busy(slot)),
        }
    }

    /// An idle buffer, to fill.
    pub fn buffer_mut(&mut self, slot: BufSlot) -> Result<&mut HostBuffer> {
        match self.slots.get_mut(slot.0) {
            Some(Slot::Idle(b)) => Ok(b),
            _ => Err(busy(slot)),
        }
    }

    /// Lends an idle buffer out (e.g. to a DMA that owns it while it runs); the slot takes no
    /// operations until the buffer comes back with [`Ring::put_buffer`].
    pub fn take_buffer(&mut self, slot: BufSlot) -> Result<HostBuffer> {
        match self.slots.get_mut(slot.0) {
            Some(s @ Slot::Idle(_)) => match std::mem::replace(s, Slot::Lent) {
                Slot::Idle(b) => Ok(b),
                _ => Err(busy(slot)),
            },
            _ => Err(busy(slot)),
        }
    }

    /// Returns a lent buffer to its slot; it must be the buffer that was lent.
    pub fn put_buffer(&mut self, slot: BufSlot, buf: HostBuffer) -> Result<()> {
        let same = self.bases.get(slot.0) == Some(&(buf.as_slice().as_ptr() as usize, buf.len()));
        match self.slots.get_mut(slot.0) {
            Some(s @ Slot::Lent) if same => {
                *s = Slot::Idle(buf);
                Ok(())
            }
            _ => Err(HalError::InvalidArgument(format!(
                "buffer does not belong to lent slot {}",
                slot.0
            ))),
        }
    }

    /// Waits for every operation in flight, unregisters the fixed buffers and hands them back
    /// (a buffer lent with [`Ring::take_buffer`] and not put back is not among them), so that
    /// their owner can reuse them elsewhere; the ring then has none and may register others.
    /// On an error the ring keeps them (and frees them when dropped).
    pub fn unregister_buffers(&mut self) -> Result<Vec<HostBuffer>> {
        while !self.pending.is_empty() {
            self.complete(1)?;
        }
        if self.slots.is_empty() {
            return Ok(Vec::new());
        }
        // No operation is in flight, so the kernel touches none of the buffers any more.
        self.ring
            .submitter()
            .unregister_buffers()
            .map_err(os("io_uring_unregister(buffers)"))?;
        self.bases.clear();
        Ok(self
            .slots
            .drain(..)
            .filter_map(|s| match s {
                Slot::Idle(b) | Slot::Busy(b, _) => Some(b),
                Slot::Lent => None,
            })
            .collect())
    }

    /// Marks an idle buffer busy and returns the address of `range` in it.
    fn claim(&mut self, slot: BufSlot, range: &Range<usize>) -> Result<*mut u8> {
        let (base, len) = *self.bases.get(slot.0).ok_or_else(|| busy(slot))?;
        if range.start > range.end || range.end > len || range.len() > u32::MAX as usize {
            return Err(HalError::OutOfRange {
                what: "ring buffer",
                offset: range.start as u64,
                len: range.len() as u64,
                limit: len as u64,
            });
        }
        match self.slots.get_mut(slot.0) {
            Some(Slot::Busy(_, n)) => {
                *n += 1;
                Ok((base + range.start) as *mut u8)
            }
            Some(s @ Slot::Idle(_)) => {
                if let Slot::Idle(b) = std::mem::replace(s, Slot::Lent) {
                    *s = Slot::Busy(b, 1);
                }
                Ok((base + range.start) as *mut u8)
            }
            _ => Err(busy(slot)),
        }
    }

    /// Queues an entry; returns its operation id.
    fn push(&mut self, entry: squeue::Entry, tag: u64, buf: Option<usize>) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let entry = entry.user_data(id);
        loop {
            // SAFETY: the entry's buffer (if any) is a registered buffer the ring owns and has
            // marked busy until this operation's completion is reaped, or a shared table slot
            // whose buffer read_fixed_shared keeps write-locked (and the slot keeps mapped)
            // until then; its file is a registered slot the ring holds open. All outlive the
            // operation (Drop waits for it).
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_ok() {
                break;
            }
            // Submission queue full: hand what is queued to the kernel and try again.
            self.ring.submit().map_err(os("io_uring_enter"))?;
        }
        self.pending.insert(id, (tag, buf));
        Ok(id)
    }

    /// Queues a read of `range` of buffer `buf` from `file` at `offset`.
    pub fn read_fixed(
        &mut self,
        file: FileSlot,
        offset: u64,
        buf: BufSlot,
        range: Range<usize>,
        tag: u64,
    ) -> Result<()> {
        self.file(file)?;
        let ptr = self.claim(buf, &range)?;
        let entry =
            opcode::ReadFixed::new(types::Fixed(file.0), ptr, range.len() as u32, buf.0 as u16)
                .offset(offset)
                .build();
        self.push(entry, tag, Some(buf.0))
            .map(drop)
            .inspect_err(|_| self.release(buf))
    }

    /// Queues a write of `range` of buffer `buf` to `file` at `offset`.
    pub fn write_fixed(
        &mut self,
        file: FileSlot,
        offset: u64,
        buf: BufSlot,
        range: Range<usize>,
        tag: u64,
    ) -> Result<()> {
        self.file(file)?;
        let ptr = self.claim(buf, &range)?;
        let entry =
            opcode::WriteFixed::new(types::Fixed(file.0), ptr, range.len() as u32, buf.0 as u16)
                .offset(offset)
                .build();
        self.push(entry, tag, Some(buf.0))
            .map(drop)
            .inspect_err(|_| self.release(buf))
    }

    /// Queues an `fdatasync` (or `fsync` when `all`) of `file`.
    pub fn fsync(&mut self, file: FileSlot, all: bool, tag: u64) -> Result<()> {
        self.file(file)?;
        let flags = if all {
            types::FsyncFlags::empty()
        } else {
            types::FsyncFlags::DATASYNC
        };
        let entry = opcode::Fsync::new(types::Fixed(file.0))
            .flags(flags)
            .build();
        self.push(entry, tag, None).map(drop)
    }

    fn release(&mut self, buf: BufSlot) {
        match self.slots.get_mut(buf.0) {
            Some(Slot::Busy(_, n)) if *n > 1 => *n -= 1,
            Some(s @ Slot::Busy(..)) => {
                if let Slot::Busy(b, _) = std::mem::replace(s, Slot::Lent) {
                    *s = Slot::Idle(b);
                }
            }
            _ => {}
        }
    }

    /// Submits what is queued and waits until at least `min` operations have completed (0:
    /// do not wait); returns every completion available, with their buffers idle again.
    pub fn complete(&mut self, min: usize) -> Result<Vec<Done>> {
        let mut done = std::mem::take(&mut self.stash);
        let min = min.saturating_sub(done.len());
        match self.reap(min) {
            Ok(more) => done.extend(more.into_iter().map(|(_, d)| d)),
            Err(e) => {
                // Keep what was reaped for the next call.
                self.stash = done;
                return Err(e);
            }
        }
        Ok(done)
    }

    /// Submits and waits for `min` completions; each with its operation id.
    fn reap(&mut self, min: usize) -> Result<Vec<(u64, Done)>> {
        let want = min.min(self.pending.len());
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // The completion queue is full: reap first, then submit again.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => break,
                Err(e) => return Err(os("io_uring_enter")(e)),
            }
        }
        let cqes: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        let mut done = Vec::with_capacity(cqes.len());
        for (id, res) in cqes {
            let Some((tag, buf)) = self.pending.remove(&id) else {
                continue;
            };
            if let Some(b) = buf {
                self.release(BufSlot(b));
            }
            done.push((
                id,
                Done {
                    tag,
                    result: if res < 0 {
                        Err(std::io::Error::from_raw_os_error(-res))
                    } else {
                        Ok(res as usize)
                    },
                    buf: buf.map(BufSlot),
                },
            ));
        }
        Ok(done)
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // The kernel may still write into busy buffers: wait for every operation first. If the
        // ring cannot be waited on, leak the buffers rather than unmap memory under the kernel.
        while !self.pending.is_empty() {
            if self.complete(1).is_err() {
                tracing::error!(
                    "io_uring wait failed with operations in flight; leaking its buffers"
                );
                for slot in self.slots.drain(..) {
                    if let Slot::Idle(b) | Slot::Busy(b, _) = slot {
                        std::mem::forget(b);
                    }
                }
                std::mem::forget(std::mem::take(&mut self.table));
                return;
            }
        }
        // Fields (the shared slots' buffers among them) drop after this.
        let _ = self.ring.submitter().unregister_buffers();
        let _ = self.ring.submitter().unregister_files();
    }
}

fn busy(slot: BufSlot) -> HalError {
    HalError::InvalidArgument(format!("ring buffer {} is in use, lent or absent", slot.0))
}
