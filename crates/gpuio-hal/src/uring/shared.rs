//! A ring's sparse table of fixed buffers ([`Ring::with_buffer_table`]): each slot registers a
//! range of a *shared* buffer (`Arc<SharedHostBuffer>`, usable by others meanwhile) and keeps
//! the buffer, and its pages mapped, until the slot is emptied or the ring drops.
//! [`Ring::read_fixed_shared`] holds the range's write guard while the kernel fills it.

use super::{BufIndex, FileSlot, Ring, RingOptions, os};
use crate::error::{HalError, Result};
use crate::memory::{MappingHold, SharedHostBuffer};
use io_uring::{opcode, types};
use std::ops::Range;
use std::sync::Arc;

/// A range of a shared buffer registered in a sparse table slot.
pub(super) struct SharedSlot {
    owner: Arc<SharedHostBuffer>,
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

impl Ring {
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

    /// Registers `offset..offset+len` of a shared buffer in a free slot of the sparse table
    /// (see [`Ring::with_buffer_table`]). The slot keeps `owner` until
    /// [`Ring::unregister_shared`] or the ring drops; the registration touches no bytes, so the
    /// buffer stays usable through its lock meanwhile. Waits for a writer holding that lock.
    pub fn register_shared(
        &mut self,
        owner: Arc<SharedHostBuffer>,
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
        // Taken under the range's locks, so the hold is on the buffer whose pages we register.
        let (start, hold) = owner.hold_range(offset, len)?;
        let iov = libc::iovec {
            iov_base: start.cast(),
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
            buffer: (start as usize).wrapping_sub(offset),
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
    pub fn shared_range(&self, index: BufIndex) -> Result<(&Arc<SharedHostBuffer>, Range<usize>)> {
        let s = self.shared_slot(index)?;
        Ok((&s.owner, s.offset..s.offset + s.len))
    }

    /// Reads from `file` at `offset` into `range` (relative to the registered range) of the
    /// shared buffer in slot `index`, as a `ReadFixed`. Holds that range's write guard until
    /// the kernel is done (so no reference to the bytes exists while it writes them; other
    /// parts of the buffer stay usable): the call waits for its own completion, which the
    /// next [`Ring::complete`] returns under `tag` like any other. Must not be called while
    /// this thread holds a guard on that buffer.
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
        let replaced = || {
            HalError::InvalidArgument(format!(
                "the buffer registered in slot {} was replaced; register the new one",
                index.0
            ))
        };
        // The range lies inside the registered one, so a guard refused as out of range means a
        // smaller buffer took the registered one's place.
        let guard = match owner.write_range(slot.offset + range.start, range.len()) {
            Ok(g) => g,
            Err(HalError::OutOfRange { .. }) => return Err(replaced()),
            Err(e) => return Err(e),
        };
        if guard.as_ptr() as usize != addr {
            return Err(replaced());
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
}
