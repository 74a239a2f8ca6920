//! Memory a controller reaches by DMA, the registers it exposes, and the IO address space that
//! joins the two.
//!
//! A device may write [`DmaMemory`] at any time, so Rust never holds a reference into it: the
//! driver reads and writes it only by copies and volatile accesses through raw pointers. The
//! same holds for [`Mmio`], a register file (a mapped BAR0, or the software controller's
//! register page).

use super::peer::PeerBuffer;
use super::spec::PAGE;
use gpuio_hal::error::{HalError, Result, check_range};
use std::any::Any;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Page-aligned, zeroed host memory for DMA: queues, PRP lists and data buffers. Anonymous
/// memory the process maps, or memory a kernel module allocated and mapped in (its owner
/// frees it after the mapping goes).
pub struct DmaMemory {
    ptr: NonNull<u8>,
    len: usize,
    /// Dropped after the mapping is unmapped: what gives kernel-allocated memory back.
    owner: Option<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for DmaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaMemory").field("len", &self.len).finish()
    }
}

// SAFETY: the memory is only ever accessed through raw pointers (copies and volatile
// accesses), never through references, so sharing the pointer between threads creates no
// aliasing Rust relies on; concurrent writers can at worst leave mixed bytes, as a device can.
unsafe impl Send for DmaMemory {}
// SAFETY: as above.
unsafe impl Sync for DmaMemory {}

impl DmaMemory {
    /// `len` bytes (rounded up to whole 4 KiB pages), zeroed and populated.
    pub fn new(len: usize) -> Result<Self> {
        let len = len
            .max(1)
            .checked_next_multiple_of(PAGE)
            .ok_or(HalError::OutOfMemory {
                what: "DMA memory",
                len,
            })?;
        gpuio_hal::memory::backing::check(len, false)?;
        let ptr = gpuio_hal::sys::map_anonymous(len, PAGE)?;
        let mem = Self {
            ptr,
            len,
            owner: None,
        };
        // Touch every page so the device never meets an unpopulated one.
        for page in (0..len).step_by(PAGE) {
            mem.store(page, 0u8)?;
        }
        Ok(mem)
    }

    /// Memory mapped in from a device file (a kernel module's DMA buffer): `len` bytes at
    /// `offset` of `fd`, unmapped on drop, after which `owner` drops.
    pub(crate) fn map_device_file(
        fd: std::os::fd::RawFd,
        offset: u64,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<Self> {
        let ptr = gpuio_hal::sys::map_shared(fd, offset, len)?;
        Ok(Self {
            ptr,
            len,
            owner: Some(owner),
        })
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of byte `offset`, for the HAL's own device-side code.
    pub(crate) fn addr(&self, offset: usize) -> *mut u8 {
        self.ptr.as_ptr().wrapping_add(offset)
    }

    /// Copies `data` in at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        check_range("DMA memory write", offset, data.len(), self.len)?;
        // SAFETY: the range lies inside the live mapping (checked above); no reference into
        // the mapping exists, so the copy aliases nothing Rust tracks.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.addr(offset), data.len()) };
        Ok(())
    }

    /// Copies `out.len()` bytes out from `offset`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range("DMA memory read", offset, out.len(), self.len)?;
        // SAFETY: as in `write`; `out` is the caller's own buffer, distinct from the mapping.
        unsafe { std::ptr::copy_nonoverlapping(self.addr(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// A volatile store of `value` at `offset` (aligned for `T`).
    pub(crate) fn store<T: Copy>(&self, offset: usize, value: T) -> Result<()> {
        self.check_typed::<T>(offset)?;
        // SAFETY: in bounds and aligned (checked); volatile, so the store is not elided or
        // merged with the device-visible accesses around it.
        unsafe { std::ptr::write_volatile(self.addr(offset).cast::<T>(), value) };
        Ok(())
    }

    /// A volatile load of a `T` at `offset` (aligned for `T`).
    pub(crate) fn load<T: Copy>(&self, offset: usize) -> Result<T> {
        self.check_typed::<T>(offset)?;
        // SAFETY: in bounds and aligned (checked); `T` is plain data (every use is an integer
        // or a queue entry of integers), so any bytes are a valid value.
        Ok(unsafe { std::ptr::read_volatile(self.addr(offset).cast::<T>()) })
    }

    fn check_typed<T>(&self, offset: usize) -> Result<()> {
        check_range("DMA memory access", offset, size_of::<T>(), self.len)?;
        if !offset.is_multiple_of(align_of::<T>()) {
            return Err(HalError::InvalidArgument(format!(
                "DMA memory access at {offset} is not aligned to {}",
                align_of::<T>()
            )));
        }
        Ok(())
    }
}

impl Drop for DmaMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping `new` or `map_device_file` made, and this is its
        // only owner.
        unsafe { gpuio_hal::sys::unmap(self.ptr, self.len) };
        drop(self.owner.take());
    }
}

/// A controller's register file: 32-bit volatile accesses at byte offsets. It keeps whatever
/// backs the registers (a BAR mapping and the device it belongs to) alive.
pub struct Mmio {
    base: NonNull<u8>,
    len: usize,
    /// Device memory (a BAR), not host memory: registered with a GPU as IO memory.
    io_memory: bool,
    owner: Arc<dyn Any + Send + Sync>,
}

// SAFETY: register accesses are volatile reads and writes through a raw pointer that `_owner`
// keeps mapped; registers are meant to be accessed from any thread.
unsafe impl Send for Mmio {}
// SAFETY: as above.
unsafe impl Sync for Mmio {}

impl std::fmt::Debug for Mmio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mmio").field("len", &self.len).finish()
    }
}

impl Mmio {
    /// Registers at `base`, `len` bytes, mapped for as long as `owner` lives; `io_memory`
    /// where they are a device's memory (a BAR) rather than host memory.
    ///
    /// # Safety
    /// `base..base+len` must stay mapped and readable and writable with 32-bit accesses for
    /// as long as `owner` is alive, and nothing may hold a Rust reference into it.
    pub(crate) unsafe fn new(
        base: NonNull<u8>,
        len: usize,
        io_memory: bool,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        Self {
            base,
            len,
            io_memory,
            owner,
        }
    }

    /// The registers' address, length, whether they are device memory, and what keeps them
    /// mapped.
    pub(crate) fn parts(&self) -> (*mut u8, usize, bool, Arc<dyn Any + Send + Sync>) {
        (
            self.base.as_ptr(),
            self.len,
            self.io_memory,
            self.owner.clone(),
        )
    }

    /// Registers in host memory (the software controller's register page).
    pub(crate) fn over(mem: Arc<DmaMemory>) -> Self {
        let (base, len) = (mem.ptr, mem.len);
        // SAFETY: `mem` is kept alive by the owner handle and is accessed only through raw
        // pointers.
        unsafe { Self::new(base, len, false, mem) }
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it maps nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn at(&self, offset: usize) -> Result<*mut u32> {
        check_range("NVMe register", offset, 4, self.len)?;
        if !offset.is_multiple_of(4) {
            return Err(HalError::InvalidArgument(format!(
                "NVMe register offset {offset:#x} is not dword-aligned"
            )));
        }
        Ok(self.base.as_ptr().wrapping_add(offset).cast())
    }

    /// Reads the 32-bit register at `offset`.
    pub fn read32(&self, offset: usize) -> Result<u32> {
        let at = self.at(offset)?;
        // SAFETY: in bounds and aligned (checked); the owner keeps it mapped.
        Ok(unsafe { std::ptr::read_volatile(at) })
    }

    /// Writes the 32-bit register at `offset`.
    pub fn write32(&self, offset: usize, value: u32) -> Result<()> {
        let at = self.at(offset)?;
        // SAFETY: in bounds and aligned (checked); the owner keeps it mapped.
        unsafe { std::ptr::write_volatile(at, value) };
        Ok(())
    }

    /// Reads a 64-bit register as two dword reads, low first (as controllers accept).
    pub fn read64(&self, offset: usize) -> Result<u64> {
        Ok(self.read32(offset)? as u64 | (self.read32(offset + 4)? as u64) << 32)
    }

    /// Writes a 64-bit register as two dword writes, low first.
    pub fn write64(&self, offset: usize, value: u64) -> Result<()> {
        self.write32(offset, value as u32)?;
        self.write32(offset + 4, (value >> 32) as u32)
    }
}

/// Makes host memory reachable by a controller, at an IO virtual address (an IOMMU mapping
/// under VFIO; a translation table the software controller consults; a bus address a kernel
/// module allocated).
///
/// Use it through [`DmaBuffer`], which keeps memory and mapping together: a device may reach
/// mapped memory until it is unmapped, so memory freed first would be memory a device writes.
pub trait DmaMapper: Send + Sync {
    /// Maps all of `mem` for the device's reads and writes; returns its IO address.
    ///
    /// # Safety
    /// `mem` must stay allocated until [`unmap`](Self::unmap) has removed the mapping.
    unsafe fn map(&self, mem: &DmaMemory) -> Result<u64>;

    /// Removes a mapping `map` made (`iova`, `len` as it returned and `mem.len()`); once it
    /// returns, the device no longer reaches the memory through it.
    fn unmap(&self, iova: u64, len: usize);

    /// `len` bytes of zeroed DMA memory and its IO address: anonymous memory mapped with
    /// [`map`](Self::map), unless the mapper must allocate the memory itself.
    ///
    /// # Safety
    /// The memory must stay allocated until [`unmap`](Self::unmap) has removed the mapping.
    unsafe fn alloc(&self, len: usize) -> Result<(DmaMemory, u64)> {
        let mem = DmaMemory::new(len)?;
        // SAFETY: the caller keeps `mem` until the mapping is removed (this function's
        // contract).
        let iova = unsafe { self.map(&mem)? };
        Ok((mem, iova))
    }

    /// Maps the dma-buf `fd` (another device's memory) for the controller, peer to peer.
    /// Only gpuio's kernel module can; other mappers refuse with the reason.
    fn import_dmabuf(&self, fd: BorrowedFd<'_>) -> Result<PeerBuffer> {
        let _ = fd;
        Err(HalError::Unsupported {
            what: "dma-buf imports (Tier 2: data in GPU memory)",
            reason: "only a controller bound to gpuio's kernel module takes them: VFIO maps \
                     process memory only, and the software controller has no bus"
                .into(),
        })
    }
}

/// Memory a controller moves data to or from: a [`DmaBuffer`] (one run of IO addresses) or a
/// [`PeerBuffer`] (another device's memory, a run per contiguous piece).
pub trait DmaTarget {
    /// Its size in bytes.
    fn target_len(&self) -> usize;

    /// The IO address of byte `offset`, and how many bytes from there are contiguous; `None`
    /// past the end.
    fn bus_run(&self, offset: usize) -> Option<(u64, usize)>;

    /// The mapper its addresses belong to: they mean something to that controller only.
    fn mapped_by(&self) -> *const ();
}

/// The identity of a mapper, as [`DmaTarget::mapped_by`] gives it.
pub(crate) fn mapper_id(mapper: &Arc<dyn DmaMapper>) -> *const () {
    Arc::as_ptr(mapper) as *const ()
}

impl DmaTarget for DmaBuffer {
    fn target_len(&self) -> usize {
        self.len()
    }

    fn bus_run(&self, offset: usize) -> Option<(u64, usize)> {
        (offset < self.len()).then(|| (self.iova + offset as u64, self.len() - offset))
    }

    fn mapped_by(&self) -> *const () {
        mapper_id(&self.mapper)
    }
}

/// DMA memory mapped for one controller; unmapped before it is freed.
pub struct DmaBuffer {
    iova: u64,
    mapper: Arc<dyn DmaMapper>,
    mem: DmaMemory,
}

impl std::fmt::Debug for DmaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuffer")
            .field("iova", &format_args!("{:#x}", self.iova))
            .field("len", &self.mem.len)
            .finish()
    }
}

impl DmaBuffer {
    /// `len` bytes (whole pages), zeroed, mapped through `mapper`.
    pub fn new(len: usize, mapper: Arc<dyn DmaMapper>) -> Result<Self> {
        // SAFETY: the buffer owns the memory and unmaps it in its drop, before the memory
        // (a field) is freed.
        let (mem, iova) = unsafe { mapper.alloc(len)? };
        Ok(Self { iova, mapper, mem })
    }

    /// The IO address of byte 0.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// The memory.
    pub fn memory(&self) -> &DmaMemory {
        &self.mem
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.mem.len
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }

    /// Copies `data` in at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.mem.write(offset, data)
    }

    /// Copies bytes out from `offset`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.mem.read(offset, out)
    }
}

impl Drop for DmaBuffer {
    fn drop(&mut self) {
        self.mapper.unmap(self.iova, self.mem.len);
    }
}

/// IO virtual addresses handed out page-aligned from a base, never reused: a controller's
/// mappings live as long as its buffers, and 2^39 bytes of IO space (the smallest IOMMU
/// address width) outlast any realistic run. Running out is an error, not a wrap.
#[derive(Debug)]
pub struct IovaSpace {
    next: AtomicU64,
    end: u64,
}

impl IovaSpace {
    /// Addresses from `base` up to (not including) `end`.
    pub fn new(base: u64, end: u64) -> Self {
        Self {
            next: AtomicU64::new(base.next_multiple_of(PAGE as u64)),
            end,
        }
    }

    /// `len` bytes of IO space, page-aligned.
    pub fn take(&self, len: usize) -> Result<u64> {
        let len = (len as u64).next_multiple_of(PAGE as u64);
        let at = self.next.fetch_add(len, Ordering::Relaxed);
        match at.checked_add(len) {
            Some(end) if end <= self.end => Ok(at),
            _ => Err(HalError::OutOfMemory {
                what: "IO virtual address space",
                len: len as usize,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dma_memory_copies_and_checks_bounds() {
        let m = DmaMemory::new(100).unwrap();
        assert_eq!(m.len(), PAGE);
        m.write(10, b"hello").unwrap();
        let mut out = [0u8; 5];
        m.read(10, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(m.write(PAGE - 2, b"abc").is_err());
        assert!(m.load::<u32>(2).is_err(), "unaligned");
        m.store(8, 0xdead_beefu32).unwrap();
        assert_eq!(m.load::<u32>(8).unwrap(), 0xdead_beef);
    }

    #[test]
    fn mmio_checks_offsets() {
        let regs = Mmio::over(Arc::new(DmaMemory::new(PAGE).unwrap()));
        regs.write64(0x28, 0x1234_5678_9abc_def0).unwrap();
        assert_eq!(regs.read64(0x28).unwrap(), 0x1234_5678_9abc_def0);
        assert_eq!(regs.read32(0x28).unwrap(), 0x9abc_def0);
        assert!(regs.read32(PAGE).is_err());
        assert!(regs.write32(2, 0).is_err());
    }

    #[test]
    fn iova_space_runs_out_instead_of_wrapping() {
        let s = IovaSpace::new(0x1000, 0x4000);
        assert_eq!(s.take(1).unwrap(), 0x1000);
        assert_eq!(s.take(PAGE + 1).unwrap(), 0x2000);
        assert!(s.take(1).is_err());
    }
}
