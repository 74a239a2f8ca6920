//! Host buffers: anonymous mappings, huge-page backed where available, optionally bound to a
//! NUMA node, and optionally pinned for a GPU. The unit of staging memory in gpuio: one such buffer serves as a DMA target, an O_DIRECT target, an io_uring fixed buffer
//! and an RDMA memory region (gpuio-rdma) or a VFIO one.

use super::backing::{self, Reservation};
use super::{DmaRegistration, Location, MemoryRegion, MemoryTier};
use crate::error::{HalError, Result};
use crate::gpu::{Gpu, PinGuard};
use crate::sys;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// How to allocate a [`HostBuffer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostAllocOptions {
    /// Bind the pages to this NUMA node (first touch happens there).
    pub numa: Option<u32>,
    /// DRAM or a CXL expander; recorded in the buffer's [`Location`].
    pub tier: MemoryTier,
    /// Ask for transparent huge pages (`MADV_HUGEPAGE` on a 2 MiB-aligned mapping) for
    /// buffers of at least 2 MiB. Advisory.
    pub huge_pages: bool,
    /// Fault every page in at allocation, so copies never pay page faults later. A buffer
    /// left unpopulated keeps its host memory reserved in this process until it is dropped
    /// (see [`HostBuffer::alloc`]).
    pub populate: bool,
}

impl Default for HostAllocOptions {
    fn default() -> Self {
        Self {
            numa: None,
            tier: MemoryTier::Dram,
            huge_pages: true,
            populate: true,
        }
    }
}

impl HostAllocOptions {
    /// Options binding to NUMA node `node`.
    pub fn on_node(node: u32) -> Self {
        Self {
            numa: Some(node),
            ..Self::default()
        }
    }
}

/// The next [`HostBuffer::id`].
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Page-aligned host memory owned by gpuio. Read and write it through
/// [`as_slice`](Self::as_slice) and [`as_mut_slice`](Self::as_mut_slice); pin it for a GPU with
/// [`pin`](Self::pin) so copies run as direct DMA.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    location: Location,
    huge_pages: bool,
    /// The GPU registration; Drop releases it before unmapping.
    pin: Option<PinGuard>,
    /// Registrations that hold the buffer by `Arc<SharedHostBuffer>` rather than by borrow
    /// ([`Gpu::pin_shared`], shared io_uring buffers). A holder of the lock could swap the
    /// buffer out and drop it while they live; Drop then leaks the mapping instead of unmapping
    /// registered memory.
    holds: Arc<AtomicUsize>,
    /// A number no other buffer of this process has had (registrations kept past a call
    /// are keyed by it: an address can come to belong to another buffer, an id cannot).
    id: u64,
    /// The host memory reserved for the pages while not all are touched (`None` once
    /// populated: from then on the machine's available memory counts them).
    reservation: Option<Reservation>,
}

/// Keeps a [`HostBuffer`]'s mapping from being unmapped while alive (see `HostBuffer::holds`):
/// a buffer dropped while any hold of it lives leaks its pages instead of unmapping them, so
/// an address inside it can never come to belong to another mapping. Made by
/// [`HostBuffer::hold_mapping`].
///
/// It is what a registration of the buffer's memory with a device or the kernel (a GPU pin of
/// a shared buffer, an io_uring buffer table, an RDMA memory region in gpuio-rdma) keeps beside
/// the registration, dropping the registration first: the memory then stays mapped for as
/// long as the device may reach it, however the buffer's owner lets it go.
#[derive(Debug)]
#[must_use = "the mapping is held only while the hold lives"]
pub struct MappingHold {
    holds: Arc<AtomicUsize>,
}

impl Drop for MappingHold {
    fn drop(&mut self) {
        // Release: the registration dropped before this is visible to the buffer's Drop.
        self.holds.fetch_sub(1, Ordering::Release);
    }
}

/// A [`HostBuffer`] as a registration cache keys it ([`HostBuffer::info`]): its id, its
/// addresses, and whether its mapping may still be in place. It holds no memory.
#[derive(Debug, Clone)]
pub struct BufferInfo {
    id: u64,
    addr: usize,
    len: usize,
    /// The buffer's hold count, which lives as long as the buffer or a [`MappingHold`] of it:
    /// once gone, the mapping is unmapped (or leaked for good) and its addresses may come to
    /// belong to another buffer.
    mapped: std::sync::Weak<AtomicUsize>,
}

impl BufferInfo {
    /// The buffer's [`HostBuffer::id`].
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Its first byte's address.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the buffer (or a hold on its mapping) is still alive: `false` once its
    /// addresses may belong to another.
    pub fn is_mapped(&self) -> bool {
        self.mapped.strong_count() > 0
    }
}

// SAFETY: HostBuffer exclusively owns its mapping (like a Box<[u8]>): shared access goes
// through &self and mutation through &mut self, so it may move and be shared across threads.
unsafe impl Send for HostBuffer {}
// SAFETY: see Send; &HostBuffer only hands out shared slices.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` bytes (zeroed). More than the machine can back now (available memory
    /// and swap, within the cgroup's limit) beside the host memory this process has reserved
    /// is refused before any page is touched. The length stays reserved until the pages are
    /// populated, or, without [`HostAllocOptions::populate`], until the buffer is dropped, so
    /// concurrent or lazily touched allocations cannot each count on the same free memory.
    pub fn alloc(len: usize, opts: &HostAllocOptions) -> Result<Self> {
        Self::alloc_backed(len, opts, true)
    }

    /// [`alloc`](Self::alloc), judged against memory alone where not `swappable`.
    fn alloc_backed(len: usize, opts: &HostAllocOptions, swappable: bool) -> Result<Self> {
        let reservation = backing::reserve(len, swappable)?;
        let huge = opts.huge_pages && len >= sys::HUGE_PAGE;
        let align = if huge {
            sys::HUGE_PAGE
        } else {
            sys::page_size()
        };
        let map_len = len.max(1);
        let ptr = sys::map_anonymous(map_len, align)?;
        let mut buf = Self {
            ptr,
            len,
            location: Location::Host {
                numa: opts.numa,
                tier: opts.tier,
            },
            huge_pages: huge && sys::advise_huge_pages(ptr, map_len),
            pin: None,
            holds: Arc::new(AtomicUsize::new(0)),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            reservation: Some(reservation),
        };
        if let Some(node) = opts.numa {
            let topo = super::numa::NumaTopology::detect();
            topo.node(node)?;
            match sys::bind_to_node(ptr, map_len, node) {
                Ok(()) => {}
                // A kernel without NUMA, or a sandbox refusing mbind: with one node the
                // pages land on it anyway, so there is nothing to bind.
                Err(HalError::Os { source, .. })
                    if topo.nodes.len() == 1
                        && matches!(source.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) =>
                {
                    tracing::debug!(error = %source, "mbind refused on a single-node machine");
                }
                Err(e) => return Err(e),
            }
        }
        if opts.populate {
            sys::populate(ptr, map_len)?;
            // The pages are taken: available memory counts them now.
            buf.reservation = None;
        }
        // Nothing to undo on the error paths above: `buf` unmaps on drop.
        Ok(buf)
    }

    /// Allocates `len` bytes and pins them for `gpu`.
    pub fn alloc_pinned(len: usize, opts: &HostAllocOptions, gpu: &Gpu) -> Result<Self> {
        // Pinned pages cannot be swapped out: only memory backs them.
        let mut buf = Self::alloc_backed(len, opts, false)?;
        buf.pin(gpu)?;
        Ok(buf)
    }

    /// Pins (page-locks and registers) the buffer for `gpu`. Pinned memory is portable: any
    /// device of the same driver can DMA to and from it. Pinning twice is a no-op.
    pub fn pin(&mut self, gpu: &Gpu) -> Result<()> {
        if self.pin.is_none() {
            self.pin = Some(gpu.pin_host(self)?);
        }
        Ok(())
    }

    /// Undoes [`pin`](Self::pin).
    pub fn unpin(&mut self) {
        self.pin = None;
    }

    /// Whether the buffer is pinned for DMA.
    pub fn is_pinned(&self) -> bool {
        self.pin.is_some()
    }

    /// The registration, while pinned: which device, and the address under which its
    /// kernels reach this buffer's first byte (zero-copy access).
    pub fn pinned(&self) -> Option<&PinGuard> {
        self.pin.as_ref()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether transparent huge pages were requested for it (and accepted by `madvise`).
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is a live mapping of at least len bytes owned by self; &self forbids
        // concurrent mutation through this type.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for as_slice, and &mut self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer as native-endian u64s (the first `len / 8` bytes' worth): index lists
    /// read and written in place, without a copy.
    pub fn as_u64s(&self) -> &[u64] {
        // SAFETY: the mapping is page-aligned (so 8-aligned) and holds len / 8 whole words;
        // every bit pattern is a valid u64; &self forbids concurrent mutation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u64>(), self.len / 8) }
    }

    /// [`as_u64s`](Self::as_u64s), mutably.
    pub fn as_u64s_mut(&mut self) -> &mut [u64] {
        // SAFETY: as for as_u64s, and &mut self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<u64>(), self.len / 8) }
    }

    /// The region this buffer covers.
    pub fn region(&self) -> MemoryRegion {
        MemoryRegion {
            location: self.location,
            addr: self.ptr.as_ptr() as u64,
            len: self.len,
            registration: if self.is_pinned() {
                DmaRegistration::Pinned
            } else {
                DmaRegistration::Pageable
            },
        }
    }

    /// The NUMA node of (a sample of up to `samples`) resident pages, as the kernel reports
    /// them (`move_pages`); a negative value is an errno for a page not yet faulted in.
    pub fn page_nodes(&self, samples: usize) -> Result<Vec<i32>> {
        sys::page_nodes(self.ptr, self.len.max(1), samples)
    }

    pub(crate) fn raw_parts_mut(&mut self) -> (*mut u8, usize) {
        (self.ptr.as_ptr(), self.len.max(1))
    }

    /// A number no other buffer of this process has had, nor will have.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Who it is, where it lies, and a way to tell later whether its mapping is gone.
    pub fn info(&self) -> BufferInfo {
        BufferInfo {
            id: self.id,
            addr: self.ptr.as_ptr() as usize,
            len: self.len,
            mapped: Arc::downgrade(&self.holds),
        }
    }

    /// The first byte's address, for memory shared with a device (a request ring, a page
    /// cache's tables) and registrations that outlive a borrow (gpuio-rdma's memory regions:
    /// pair it with [`hold_mapping`](Self::hold_mapping)). Whoever writes through it must not
    /// race with slices of this buffer (shared memory is touched through atomics).
    pub fn base_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Keeps this mapping alive (leaked if the buffer drops first) until the hold drops: for
    /// registrations that outlive a borrow of the buffer (see [`MappingHold`]).
    pub fn hold_mapping(&self) -> MappingHold {
        self.holds.fetch_add(1, Ordering::Relaxed);
        MappingHold {
            holds: self.holds.clone(),
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // Unregister before the pages go away.
        self.pin = None;
        // Acquire: pairs with MappingHold's Release, so its registration is already gone.
        if self.holds.load(Ordering::Acquire) > 0 {
            // Swapped out of its shared lock and dropped while still registered elsewhere:
            // leak the pages rather than unmap memory a device or the kernel may still use.
            tracing::error!(
                len = self.len,
                "host buffer dropped while registered; leaking its mapping"
            );
            return;
        }
        // SAFETY: ptr/len.max(1) is the mapping made in alloc; nothing borrows it any more.
        unsafe { sys::unmap(self.ptr, self.len.max(1)) };
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .field("location", &self.location)
            .field("huge_pages", &self.huge_pages)
            .field("pinned", &self.pin.as_ref().map(|p| p.gpu()))
            .field("reserved", &self.reservation.is_some())
            .finish()
    }
}

impl std::ops::Deref for HostBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for HostBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_typed_errors() {
        let err = HostBuffer::alloc(usize::MAX - 10, &HostAllocOptions::default()).unwrap_err();
        assert_eq!(err.code(), crate::ErrorCode::NoMem, "{err}");
    }

    #[test]
    fn a_buffers_info_names_it_and_sees_it_go() {
        let a = HostBuffer::alloc(8192, &HostAllocOptions::default()).unwrap();
        let b = HostBuffer::alloc(8192, &HostAllocOptions::default()).unwrap();
        let (ia, ib) = (a.info(), b.info());
        assert_ne!(ia.id(), ib.id());
        assert_eq!((ia.addr(), ia.len()), (a.base_ptr() as usize, 8192));
        assert!(ia.is_mapped() && ib.is_mapped());
        drop(a);
        assert!(!ia.is_mapped() && ib.is_mapped());
    }

    #[test]
    fn zero_length_buffers_work() {
        let b = HostBuffer::alloc(0, &HostAllocOptions::default()).unwrap();
        assert!(b.is_empty());
        assert_eq!(b.as_slice(), &[] as &[u8]);
    }

    #[test]
    fn numa_binding_places_pages_on_the_node() {
        let b = HostBuffer::alloc(4 << 20, &HostAllocOptions::on_node(0)).unwrap();
        match b.page_nodes(16) {
            Ok(nodes) => assert!(nodes.iter().all(|&n| n == 0), "pages on nodes {nodes:?}"),
            Err(e) => eprintln!("skipped page placement check: {e}"),
        }
        assert_eq!(
            b.region().location,
            Location::Host {
                numa: Some(0),
                tier: MemoryTier::Dram
            }
        );
    }

    #[test]
    fn a_missing_numa_node_is_a_typed_error() {
        let err = HostBuffer::alloc(4096, &HostAllocOptions::on_node(999)).unwrap_err();
        assert!(matches!(err, HalError::NoSuchNumaNode { node: 999, .. }));
        assert_eq!(err.code(), crate::ErrorCode::NotFound);
    }

    /// Lazily touched buffers judged against a figure of the test's own (not the machine's):
    /// each fits alone, their sum does not, and dropping one makes room again.
    #[test]
    fn lazy_buffers_reserve_until_dropped() {
        const MIB64: usize = 64 << 20;
        let lazy = HostAllocOptions {
            populate: false,
            ..HostAllocOptions::default()
        };
        backing::test_figure::with(100 << 20, |ledger| {
            let a = HostBuffer::alloc(MIB64, &lazy).unwrap();
            assert_eq!(ledger.reserved(), MIB64 as u64);
            let err = HostBuffer::alloc(MIB64, &lazy).unwrap_err();
            match &err {
                HalError::HostMemoryExceeded { len, available, .. } => {
                    assert_eq!(*len, MIB64);
                    assert_eq!(*available, (100 - 64) << 20);
                }
                other => panic!("{other}"),
            }
            assert_eq!(err.code(), crate::ErrorCode::NoMem);
            assert_eq!(
                ledger.reserved(),
                MIB64 as u64,
                "a refusal reserves nothing"
            );
            drop(a);
            assert_eq!(ledger.reserved(), 0);
            let b = HostBuffer::alloc(MIB64, &lazy).unwrap();
            assert_eq!(ledger.reserved(), MIB64 as u64);
            drop(b);
        });
    }

    /// A populated buffer holds its reservation only until its pages are in.
    #[test]
    fn populated_buffers_give_their_reservation_back() {
        const MIB64: usize = 64 << 20;
        backing::test_figure::with(100 << 20, |ledger| {
            let a = HostBuffer::alloc(MIB64, &HostAllocOptions::default()).unwrap();
            assert_eq!(ledger.reserved(), 0);
            let lazy = HostAllocOptions {
                populate: false,
                ..HostAllocOptions::default()
            };
            let b = HostBuffer::alloc(MIB64, &lazy).unwrap();
            assert_eq!(ledger.reserved(), MIB64 as u64);
            drop((a, b));
            assert_eq!(ledger.reserved(), 0);
        });
    }

    #[test]
    fn huge_buffers_ask_for_huge_pages() {
        let b = HostBuffer::alloc(8 << 20, &HostAllocOptions::default()).unwrap();
        assert_eq!(b.as_slice().as_ptr() as usize % sys::HUGE_PAGE, 0);
        let mut b = b;
        b[123] = 9;
        assert_eq!(b[123], 9);
    }
}
