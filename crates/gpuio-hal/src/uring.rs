//! A safe io_uring: the ring owns everything the kernel may touch while an operation is in
//! flight. Buffers are [`HostBuffer`]s registered as fixed buffers and owned by the ring (an
//! operation marks its buffer busy until its completion is reaped — several may target ranges
//! of one buffer); files are registered as
//! fixed files and the ring holds them open. Dropping the ring waits for everything in flight.
//!
//! A ring made with [`Ring::with_buffer_table`] instead has a sparse table whose slots register
//! ranges of *shared* buffers (`Arc<RwLock<HostBuffer>>`, which stay usable by others): the slot
//! keeps the buffer, and [`Ring::read_fixed_shared`] holds its write lock while the kernel fills
//! the range.
//!
//! One ring per thread (it is `Send`, not `Sync`): LocalIO runs one per lane.

use crate::error::{HalError, Result, check_range};
use crate::memory::{HostBuffer, MappingHold};
use crate::sync::RwLockExt;
use io_uring::{IoUring, opcode, squeue, types};
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::{Arc, RwLock};

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

/// A range of a shared buffer registered in a sparse table slot.
struct SharedSlot {
    owner: Arc<RwLock<HostBuffer>>,
    /// Keeps the registered pages mapped even if a lock holder swaps the buffer out.
    _hold: MappingHold,
    /// The owner buffer's address when registered (to notice a swapped-out buffer).
    buffer: usize,
    offset: usize,
    len: usize,
}

/// The kernel's limit on one fixed buffer (`io_buffer_validate`).
const MAX_FIXED_BUFFER: usize = 1 << 30;
/// The kernel's limit on a buffer table (`IORING_MAX_REG_BUFFERS`).
const MAX_TABLE_SLOTS: u32 = 1 << 14;

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

    /// Creates a ring with a sparse table of `slots` fixed buffers (Linux 5.13+), filled and
    /// emptied one slot at a time with [`Ring::register_shared`] and
    /// [`Ring::unregister_shared`]. Such a ring takes no [`Ring::register_buffers`]. A kernel
    /// without sparse tables gives [`HalError::Unsupported`] with the reason.
    pub fn with_buffer_table(opts: RingOptions, slots: u32) -> Result<Self> {
        if slots == 0 || slots > MAX_TABLE_SLOTS {
            return Err(HalError::InvalidArgument(format!(
                "a buffer table has 1 to {MAX_TABLE_SLOTS} slots, not {slots}"
            )));
        }
        let mut ring = Self::new(opts)?;
        match ring.ring.submitter().register_buffers_sparse(slots) {
            Ok(()) => {}
            // Kernels before 5.13 do not know IORING_REGISTER_BUFFERS2 (EINVAL); seccomp or
            // other filters may answer ENOSYS/EOPNOTSUPP.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)
                ) =>
            {
                return Err(HalError::Unsupported {
                    what: "io_uring sparse fixed-buffer tables",
                    reason: format!(
                        "the kernel refused IORING_REGISTER_BUFFERS2 with the sparse flag ({e}); \
                         Linux 5.13 or later is needed"
                    ),
                });
            }
            Err(e) => return Err(os("io_uring_register(buffers_sparse)")(e)),
        }
        ring.table = (0..slots).map(|_| None).collect();
        Ok(ring)
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

    /// Registers `offset..offset+len` of a shared buffer in a free slot of the sparse table
    /// (see [`Ring::with_buffer_table`]). The slot keeps `owner` until
    /// [`Ring::unregister_shared`] or the ring drops; the registration touches no bytes, so the
    /// buffer stays usable through its lock meanwhile. Waits for a writer holding that lock.
    pub fn register_shared(
        &mut self,
        owner: Arc<RwLock<HostBuffer>>,
        offset: usize,
        len: usize,
    ) -> Result<BufIndex> {
        if self.table.is_empty() {
            return Err(HalError::InvalidArgument(
                "the ring has no sparse buffer table (Ring::with_buffer_table)".into(),
            ));
        }
        if len == 0 || len > MAX_FIXED_BUFFER {
            return Err(HalError::InvalidArgument(format!(
                "a fixed buffer has 1 to {MAX_FIXED_BUFFER} bytes, not {len}"
            )));
        }
        let index =
            self.table.iter().position(Option::is_none).ok_or_else(|| {
                HalError::InvalidArgument("no free slot in the buffer table".into())
            })?;
        let (buffer, hold) = {
            // HostBuffer holds no invariants a panicking writer could break.
            let buf = owner.read_unpoisoned();
            check_range("shared ring buffer", offset, len, buf.len())?;
            // Taken under the lock, so the hold is on the buffer whose pages we register.
            (buf.base_ptr(), buf.hold_mapping())
        };
        let iov = libc::iovec {
            iov_base: buffer.wrapping_add(offset).cast(),
            iov_len: len,
        };
        // SAFETY: the iovec lies inside a live mapping (range checked above) that `hold` keeps
        // mapped, and the slot keeps the hold until the range is unregistered (update to an
        // empty iovec) or the ring's Drop has unregistered every buffer.
        unsafe {
            self.ring
                .submitter()
                .register_buffers_update(index as u32, &[iov], None)
        }
        .map_err(os("io_uring_register(buffers_update)"))?;
        self.table[index] = Some(SharedSlot {
            owner,
            _hold: hold,
            buffer: buffer as usize,
            offset,
            len,
        });
        Ok(BufIndex(index as u16))
    }

    /// Empties a slot of the sparse table, releasing its buffer.
    pub fn unregister_shared(&mut self, index: BufIndex) -> Result<()> {
        self.shared_slot(index)?;
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        // SAFETY: a null, empty iovec registers no memory: it clears the slot.
        unsafe {
            self.ring
                .submitter()
                .register_buffers_update(u32::from(index.0), &[empty], None)
        }
        .map_err(os("io_uring_register(buffers_update)"))?;
        // Only now that the kernel has let the range go may the buffer go.
        self.table[usize::from(index.0)] = None;
        Ok(())
    }

    fn shared_slot(&self, index: BufIndex) -> Result<&SharedSlot> {
        self.table
            .get(usize::from(index.0))
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                HalError::InvalidArgument(format!("buffer table slot {} is empty", index.0))
            })
    }

    /// Slots of the sparse buffer table (0 for a ring without one).
    pub fn table_slots(&self) -> usize {
        self.table.len()
    }

    /// The buffer and range registered in a slot of the sparse table.
    pub fn shared_range(
        &self,
        index: BufIndex,
    ) -> Result<(&Arc<RwLock<HostBuffer>>, Range<usize>)> {
        let s = self.shared_slot(index)?;
        Ok((&s.owner, s.offset..s.offset + s.len))
    }

    /// Reads from `file` at `offset` into `range` (relative to the registered range) of the
    /// shared buffer in slot `index`, as a `ReadFixed`. Holds the buffer's write lock until
    /// the kernel is done (so no reference to the bytes exists while it writes them): the
    /// call waits for its own completion, which the next [`Ring::complete`] returns under
    /// `tag` like any other. Must not be called while this thread holds that buffer's lock.
    pub fn read_fixed_shared(
        &mut self,
        file: FileSlot,
        offset: u64,
        index: BufIndex,
        range: Range<usize>,
        tag: u64,
    ) -> Result<()> {
        self.file(file)?;
        let slot = self.shared_slot(index)?;
        if range.start > range.end || range.end > slot.len || range.len() > u32::MAX as usize {
            return Err(HalError::OutOfRange {
                what: "shared ring buffer",
                offset: range.start as u64,
                len: range.len() as u64,
                limit: slot.len as u64,
            });
        }
        let (owner, registered) = (slot.owner.clone(), slot.buffer);
        let addr = registered + slot.offset + range.start;
        // HostBuffer holds no invariants a panicking writer could break.
        let guard = owner.write_unpoisoned();
        if guard.base_ptr() as usize != registered {
            return Err(HalError::InvalidArgument(format!(
                "the buffer registered in slot {} was replaced; register the new one",
                index.0
            )));
        }
        let entry = opcode::ReadFixed::new(
            types::Fixed(file.0),
            addr as *mut u8,
            range.len() as u32,
            index.0,
        )
        .offset(offset)
        .build();
        let id = self.push(entry, tag, None)?;
        loop {
            match self.reap(1) {
                Ok(done) => {
                    let mut mine = None;
                    for (op, d) in done {
                        if op == id {
                            mine = Some(d);
                        } else {
                            self.stash.push(d);
                        }
                    }
                    if let Some(d) = mine {
                        drop(guard);
                        self.stash.push(d);
                        return Ok(());
                    }
                }
                Err(e) => {
                    // The kernel may still write the range: keep it locked and mapped forever
                    // rather than let anyone see it change under a reference.
                    tracing::error!(error = %e, "io_uring wait failed during a shared read; leaking its buffer");
                    std::mem::forget(guard);
                    std::mem::forget(owner);
                    return Err(e);
                }
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostAllocOptions;

    fn file_with(data: &[u8]) -> (std::path::PathBuf, Arc<File>) {
        let path = std::env::temp_dir().join(format!(
            "gpuio-ring-{}-{}",
            std::process::id(),
            crate::pattern::mix64(data.len() as u64)
        ));
        std::fs::write(&path, data).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        (path, Arc::new(f))
    }

    #[test]
    fn rings_can_move_between_threads() {
        fn is_send<T: Send>() {}
        is_send::<Ring>();
    }

    #[test]
    fn fixed_reads_writes_and_errors() {
        let Ok(mut ring) = Ring::new(RingOptions::default()) else {
            eprintln!("skipped: io_uring unavailable: {}", Ring::probe().detail);
            return;
        };
        let mut data = vec![0u8; 64 << 10];
        crate::pattern::fill(&mut data, 0, 5);
        let (path, file) = file_with(&data);
        let bufs = (0..2)
            .map(|_| HostBuffer::alloc(32 << 10, &HostAllocOptions::default()).unwrap())
            .collect();
        ring.register_buffers(bufs).unwrap();
        let f = ring.register_file(file).unwrap();
        ring.read_fixed(f, 4096, BufSlot(0), 0..8192, 7).unwrap();
        assert!(ring.buffer(BufSlot(0)).is_err(), "busy while in flight");
        ring.read_fixed(f, 60 << 10, BufSlot(1), 0..8192, 8)
            .unwrap();
        let mut done = Vec::new();
        while done.len() < 2 {
            done.extend(ring.complete(1).unwrap());
        }
        done.sort_by_key(|d| d.tag);
        assert_eq!(done[0].result.as_ref().unwrap(), &8192);
        assert_eq!(
            done[1].result.as_ref().unwrap(),
            &4096,
            "short read at end of file"
        );
        let b = ring.buffer(BufSlot(0)).unwrap();
        assert_eq!(crate::pattern::first_deviation(&b[..8192], 4096, 5), None);
        // Write back through a lent-and-returned buffer.
        let lent = ring.take_buffer(BufSlot(1)).unwrap();
        assert!(ring.read_fixed(f, 0, BufSlot(1), 0..10, 9).is_err());
        ring.put_buffer(BufSlot(1), lent).unwrap();
        ring.write_fixed(f, 0, BufSlot(0), 0..100, 10).unwrap();
        ring.fsync(f, false, 11).unwrap();
        let mut n = 0;
        while n < 2 {
            for d in ring.complete(1).unwrap() {
                d.result.unwrap();
                n += 1;
            }
        }
        assert!(
            ring.read_fixed(f, 0, BufSlot(0), 0..(64 << 10), 12)
                .is_err()
        );
        assert!(
            ring.read_fixed(FileSlot(9), 0, BufSlot(0), 0..10, 13)
                .is_err()
        );
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn shared_buffers_in_a_sparse_table() {
        let mut ring = match Ring::with_buffer_table(RingOptions::default(), 4) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("skipped: sparse buffer tables unavailable: {e}");
                return;
            }
        };
        let mut data = vec![0u8; 32 << 10];
        crate::pattern::fill(&mut data, 0, 9);
        let (path, file) = file_with(&data);
        let f = ring.register_file(file).unwrap();
        let owner = Arc::new(RwLock::new(
            HostBuffer::alloc(64 << 10, &HostAllocOptions::default()).unwrap(),
        ));
        assert!(ring.register_shared(owner.clone(), 60 << 10, 8192).is_err());
        assert!(ring.register_shared(owner.clone(), 0, 0).is_err());
        let idx = ring.register_shared(owner.clone(), 8192, 16384).unwrap();
        assert_eq!(ring.shared_range(idx).unwrap().1, 8192..24576);
        assert!(
            ring.register_buffers(vec![
                HostBuffer::alloc(4096, &HostAllocOptions::default()).unwrap()
            ])
            .is_err(),
            "a table ring takes no owned buffers"
        );
        ring.read_fixed_shared(f, 4096, idx, 100..8292, 1).unwrap();
        assert!(ring.read_fixed_shared(f, 0, idx, 0..16385, 2).is_err());
        let done = ring.complete(1).unwrap();
        assert_eq!(done.len(), 1);
        assert_eq!((done[0].tag, *done[0].result.as_ref().unwrap()), (1, 8192));
        {
            let buf = owner.read().unwrap();
            let got = &buf[8192 + 100..8192 + 8292];
            assert_eq!(got, &data[4096..4096 + 8192]);
            assert!(
                buf[..8292].iter().all(|&b| b == 0),
                "nothing written before the range"
            );
        }
        ring.unregister_shared(idx).unwrap();
        assert!(ring.unregister_shared(idx).is_err());
        assert!(ring.read_fixed_shared(f, 0, idx, 0..10, 3).is_err());
        assert_eq!(
            Arc::strong_count(&owner),
            1,
            "the slot gave its buffer back"
        );
        // Slots are reused; a ring dropped with a registered slot releases it.
        let again = ring.register_shared(owner.clone(), 0, 4096).unwrap();
        assert_eq!(again, idx);
        drop(ring);
        assert_eq!(Arc::strong_count(&owner), 1);
        std::fs::remove_file(path).unwrap();
    }
}
