//! The contract a GPU backend implements. Crate-private: the public types in [`super`] check
//! every argument (ownership, ranges, lengths) once, so a backend only ever sees valid ranges
//! of live allocations and valid host pointers.

use super::{DeviceInfo, GdsMode};
use crate::error::{HalError, Result};
use crate::kernels::{KernelLoad, KernelOrigin, KernelPath, KernelSource};
use std::any::Any;
use std::fmt;
use std::fs::File;
use std::sync::Arc;

/// What keeps a borrowed allocation alive (a framework's tensor, a DLPack capsule).
pub(crate) type Owner = Box<dyn Any + Send + Sync>;

/// One GPU (or, for the host backend, the CPU standing in for one).
pub(crate) trait DeviceBackend: Send + Sync + fmt::Debug {
    fn info(&self) -> &DeviceInfo;

    /// Allocates `len` bytes of device memory (`len > 0`).
    fn alloc(&self, len: usize) -> Result<Box<dyn DeviceMemory>>;

    /// Allocates `len` bytes of managed memory (`len > 0`): one address for the host and
    /// the device, pages migrating to whichever touches them.
    fn alloc_managed(&self, _len: usize) -> Result<Box<dyn DeviceMemory>> {
        Err(HalError::Unsupported {
            what: "managed memory",
            reason: "a CUDA driver feature; this backend has no device to migrate pages to".into(),
        })
    }

    /// Waits for all work queued on the device, by gpuio or any other library.
    fn synchronize(&self) -> Result<()>;

    /// The live allocation holding `addr`, as the driver knows it now (`Unsupported` where
    /// the backend cannot tell).
    fn allocation_at(&self, _addr: u64) -> Result<crate::gpu::Allocation> {
        Err(HalError::Unsupported {
            what: "looking up allocations by address",
            reason: "the host backend keeps no table of them".into(),
        })
    }

    /// Makes the device's context current on the calling thread (a no-op where there is
    /// none).
    fn bind_thread(&self) -> Result<()> {
        Ok(())
    }

    /// Waits for the work queued on another library's stream of this device (0: the
    /// legacy default stream).
    ///
    /// # Safety
    /// A non-zero `stream` is a live stream handle of this device's primary context.
    unsafe fn synchronize_foreign(&self, stream: u64) -> Result<()>;

    /// Device memory another library allocated, at `addr..addr + len` (`len > 0`), checked
    /// to lie inside one live allocation of this device; never freed by gpuio, and holding
    /// `owner` (what keeps it allocated) for as long as it lives.
    fn borrow(&self, addr: u64, len: usize, owner: Owner) -> Result<Box<dyn DeviceMemory>>;

    /// As `borrow`, with one question to the driver, where `addr` may not be device memory
    /// at all: None where the driver does not know it as this device's (host memory, pinned
    /// or not, another device's, unknown addresses); an error where it is, but the range
    /// leaves its allocation.
    fn borrow_held(
        &self,
        addr: u64,
        len: usize,
        owner: Owner,
    ) -> Result<Option<Box<dyn DeviceMemory>>>;

    fn new_stream(&self) -> Result<Box<dyn StreamBackend>>;

    /// Page-locks and registers host memory for DMA; the guard unregisters it when dropped.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped until the returned guard is dropped.
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<Box<dyn HostPin>>;

    /// Registers `ptr..ptr+len` (whole pages of a read-only file mapping) read-only, for the
    /// copy engine to read; unregistered when the returned pin drops.
    ///
    /// # Safety
    /// The range must stay mapped until the returned pin is dropped.
    unsafe fn pin_read_only(&self, ptr: *mut u8, len: usize) -> Result<Box<dyn HostPin>>;

    /// Registers `ptr..ptr+len`, device memory mapped into this process (an NVMe BAR), as IO
    /// memory (`CU_MEMHOSTREGISTER_IOMEMORY`) mapped for kernels; unregistered when the pin
    /// drops.
    ///
    /// # Safety
    /// The range must stay mapped until the returned pin is dropped.
    unsafe fn pin_io(&self, ptr: *mut u8, len: usize) -> Result<Box<dyn HostPin>>;

    /// The address under which this device's kernels reach pinned host memory at `ptr`
    /// (zero-copy access).
    ///
    /// # Safety
    /// `ptr` must lie in memory registered by [`pin`](Self::pin) and still registered.
    unsafe fn mapped_addr(&self, ptr: *mut u8) -> Result<u64>;

    /// Whether `ptr..ptr+len` lies inside one page-locked host allocation known to the driver.
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool;

    /// Whether this device can read and write `other`'s memory directly.
    fn can_access_peer(&self, other: &dyn DeviceBackend) -> bool;

    /// Whether this device's kernels may read and write `other`'s allocation at `addr` now:
    /// peer access is enabled between the two (which needs both devices' contexts made) and
    /// maps that allocation.
    fn kernels_reach(&self, other: &dyn DeviceBackend, addr: u64) -> bool;

    /// The plain synchronous driver copy (what `cudaMemcpy` does; a memcpy for the host
    /// backend): the peer that benchmarks measure gpuio against.
    ///
    /// # Safety
    /// The host pointer of `copy` must be valid for the range's length (readable for a source,
    /// writable and otherwise untouched for a destination) until the call returns.
    unsafe fn baseline_copy(&self, copy: BaselineCopy<'_>) -> Result<()>;

    /// Loads a kernel module for this device's kernels to use (kept), and says
    /// where its code came from.
    fn load_kernels(&self, src: &'static KernelSource) -> Result<KernelOrigin>;

    /// Loads a fresh copy of a module by `path` alone (no fallback), times it, and unloads it.
    fn time_kernel_load(&self, src: &KernelSource, path: KernelPath) -> Result<KernelLoad>;

    /// cuFile on this device: its mode and library, or why it cannot run here.
    fn gds(&self) -> Result<(GdsMode, String)>;

    /// A dma-buf of `len` bytes of device memory at `addr` (a range of a live allocation of
    /// this device, host-page aligned).
    fn export_dmabuf(&self, addr: u64, len: usize) -> Result<std::os::fd::OwnedFd>;

    /// Registers an open file with cuFile for IO to and from this device's memory.
    fn gds_register(&self, file: Arc<File>) -> Result<Box<dyn GdsFileBackend>>;

    fn as_any(&self) -> &dyn Any;
}

/// A file registered with cuFile. IO is synchronous: done when the call returns.
pub(crate) trait GdsFileBackend: Send + Sync {
    /// Reads into `dst` from file `offset`; the count, short only at end of file.
    fn read(&self, dst: DevRange<'_>, offset: u64) -> Result<usize>;

    /// Writes `src` at file `offset`; the count written.
    fn write(&self, src: DevRange<'_>, offset: u64) -> Result<usize>;
}

/// A synchronous baseline copy, by direction.
pub(crate) enum BaselineCopy<'a> {
    HostToDevice {
        src: *const u8,
        dst: DevRange<'a>,
    },
    DeviceToHost {
        src: DevRange<'a>,
        dst: *mut u8,
    },
    DeviceToDevice {
        src: DevRange<'a>,
        dst: DevRange<'a>,
    },
}

/// A range of one device allocation, checked against its length by the public types.
/// Backends that need to (the host backend) lock the allocation through `mem` while they touch
/// it.
#[derive(Clone, Copy)]
pub(crate) struct DevRange<'a> {
    pub(crate) mem: &'a dyn DeviceMemory,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl DevRange<'_> {
    /// The device address of the range's first byte.
    pub(crate) fn addr(&self) -> u64 {
        self.mem.addr() + self.offset as u64
    }

    /// `len` bytes of this range from `offset`, checked.
    pub(crate) fn part(&self, offset: usize, len: usize) -> Result<Self> {
        crate::check_range("device range part", offset, len, self.len)?;
        Ok(Self {
            mem: self.mem,
            offset: self.offset + offset,
            len,
        })
    }

    /// Whether both ranges lie in the same allocation.
    pub(crate) fn same_allocation(&self, other: &DevRange<'_>) -> bool {
        std::ptr::addr_eq(
            self.mem as *const dyn DeviceMemory,
            other.mem as *const dyn DeviceMemory,
        )
    }
}

/// Where a row job's pool or index list lives.
#[derive(Clone, Copy)]
pub(crate) enum RowMem<'a> {
    /// Pinned host memory: `ptr` for the CPU, `addr` for the device's kernels.
    Host {
        ptr: *mut u8,
        addr: u64,
        len: usize,
    },
    Device(DevRange<'a>),
}

impl RowMem<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Host { len, .. } => *len,
            Self::Device(r) => r.len,
        }
    }

    /// The address the device's kernels use.
    pub(crate) fn addr(&self) -> u64 {
        match self {
            Self::Host { addr, .. } => *addr,
            Self::Device(r) => r.addr(),
        }
    }
}

/// A checked row job: `count` rows of `row_bytes` between `pool` rows `idx[i]` and the dense
/// device range `rows` (`count * row_bytes` bytes); `idx` holds `count` little-endian u64s.
/// A gather reads the pool and writes `rows`; a scatter the reverse.
#[derive(Clone, Copy)]
pub(crate) struct RowJob<'a> {
    pub(crate) pool: RowMem<'a>,
    pub(crate) row_bytes: usize,
    pub(crate) count: usize,
    pub(crate) idx: RowMem<'a>,
    /// Copy these pinned host bytes into `idx` (device memory), each piece's part just
    /// before the piece, in stream order.
    pub(crate) idx_upload: Option<*const u8>,
    pub(crate) rows: DevRange<'a>,
    pub(crate) scatter: bool,
    /// Which kernel moves the rows (`Naive` and `Sorted` gather only; `Sorted` has its
    /// indices in device memory).
    pub(crate) kernel: super::RowKernel,
    /// Consecutive ranges of the `count` rows, moved one after another (one launch each);
    /// at most `rows::MAX_PIECES`.
    pub(crate) pieces: &'a [std::ops::Range<usize>],
    /// Rows kept in device memory, read there instead of from the pool (gathers with the
    /// `Tuned` kernel only).
    pub(crate) hot: Option<super::hot_rows::HotRefs<'a>>,
}

/// What a row job does besides moving the rows.
pub(crate) struct RowHooks<'a> {
    /// Called with piece `k` before the device reads that piece's indices: writes them.
    pub(crate) stage: Option<&'a mut dyn FnMut(usize)>,
    /// Time the device's work (events around the launches).
    pub(crate) timed: bool,
}

/// What a row job reports.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RowsDone {
    /// The position of the first index outside the pool (those rows were skipped).
    pub(crate) bad_index: Option<u64>,
    /// How long the device worked on the job, when asked (`RowHooks::timed`).
    pub(crate) device_time: Option<std::time::Duration>,
}

/// An allocation of device memory; dropping it frees the memory.
pub(crate) trait DeviceMemory: Send + Sync + fmt::Debug {
    /// The device address of the first byte.
    fn addr(&self) -> u64;

    /// The allocation this memory lies in (for borrowed memory, the owner's, which may be
    /// larger), with the device's context current.
    fn allocation(&self) -> Result<crate::gpu::Allocation>;

    /// Whether another library allocated it (gpuio only borrows it).
    fn borrowed(&self) -> bool {
        false
    }

    fn as_any(&self) -> &dyn Any;
}

/// A host registration; dropping it unregisters the memory.
pub(crate) trait HostPin: Send + Sync + fmt::Debug {}

/// Which backend a stream is, for running a `DeviceOp` there.
pub(crate) enum StreamTarget<'a> {
    Host,
    #[cfg(feature = "cuda")]
    Cuda(&'a super::cuda::CudaStreamBackend),
    #[cfg(not(feature = "cuda"))]
    #[allow(dead_code)]
    Never(std::convert::Infallible, std::marker::PhantomData<&'a ()>),
}

/// An in-order queue of device work. `fill_pattern` and `find_mismatch` are done when they
/// return, as is everything on the host backend.
pub(crate) trait StreamBackend: Send + Sync {
    /// The backend, for running a `DeviceOp`.
    fn target(&self) -> StreamTarget<'_>;

    /// Enqueues a host-to-device copy of `dst.len` bytes.
    ///
    /// # Safety
    /// `src` must be readable for `dst.len` bytes until the copy completes, and `dst`'s
    /// allocation must live until then.
    unsafe fn copy_h2d(&self, src: *const u8, dst: DevRange<'_>) -> Result<()>;

    /// Enqueues a device-to-host copy of `src.len` bytes.
    ///
    /// # Safety
    /// `dst` must be writable for `src.len` bytes, and touched by nothing else, until the copy
    /// completes; `src`'s allocation must live until then.
    unsafe fn copy_d2h(&self, src: DevRange<'_>, dst: *mut u8) -> Result<()>;

    /// Enqueues a copy between two device ranges of equal length, which may be on different
    /// devices of this backend (a peer copy). Two ranges of one allocation never overlap.
    ///
    /// # Safety
    /// Both allocations must live until the copy completes.
    unsafe fn copy_d2d(
        &self,
        src_dev: &dyn DeviceBackend,
        src: DevRange<'_>,
        dst_dev: &dyn DeviceBackend,
        dst: DevRange<'_>,
    ) -> Result<()>;

    /// Records an event after the work enqueued so far.
    fn record(&self, timing: bool) -> Result<Box<dyn EventBackend>>;

    /// Makes the work enqueued from now on wait for the work before `event` (an event of
    /// this backend, from any of its streams), without blocking the host.
    fn wait_for(&self, event: &dyn EventBackend) -> Result<()>;

    /// Blocks until all enqueued work is done.
    fn synchronize(&self) -> Result<()>;
}

/// A point in a stream's work.
pub(crate) trait EventBackend: Send + Sync {
    /// Blocks until the work before the event is done.
    fn synchronize(&self) -> Result<()>;

    /// Whether the work before the event is done.
    fn is_complete(&self) -> Result<bool>;

    /// Milliseconds between `start` and this event (both timing events of one backend).
    fn elapsed_ms_since(&self, start: &dyn EventBackend) -> Result<f32>;

    fn as_any(&self) -> &dyn Any;
}
