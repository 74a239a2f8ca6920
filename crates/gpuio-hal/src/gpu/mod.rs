//! GPU devices behind one interface, with two backends chosen at run time: `host` (always
//! there: "device memory" is host memory, copies are memcpy, device functions run as Rust) and
//! `cuda` (cudarc, loaded at run time).
//!
//! [`probe`] returns [`Gpu`] handles. Every public operation checks its arguments here, once:
//! buffer ownership, ranges and lengths; the backends behind it see only valid raw arguments.
//!
//! This file holds probing, [`Gpu`], host memory pinned for a device and [`DeviceBuffer`];
//! `stream.rs` holds [`Stream`] (the checked copies and kernels), [`Inflight`] and [`Event`].

mod backend;
mod baseline;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dmabuf;
mod gds;
mod host;
mod hot_jobs;
mod hot_rows;
mod info;
mod managed;
mod op;
mod pattern;
mod pieces;
mod resident;
mod rows;
mod stream;
pub mod tiered;

pub use dmabuf::DmaBufExport;
pub use gds::{GdsFile, GdsMode};
pub use hot_jobs::{HOT_MAX_JOBS, HotGather};
pub use hot_rows::{HOT_MAX_POOL_ROWS, HOT_MAX_ROWS, HotRows};
pub use info::{Backend, Capability, DeviceInfo, PcieLink};
pub use managed::ManagedBuffer;
pub use op::{
    Access, CudaRun, DevArg, DeviceOp, HostArg, HostLocks, HostRun, KernelArgs, LaunchShape,
    WaitOnDrop, check_disjoint, device_time, elapsed, report_words, widest_piece,
};
pub use pieces::Piece2d;
pub use resident::{
    RESIDENT_MAX_BYTES, RESIDENT_MAX_ROWS, ResidentJob, ResidentRows, ResidentStats,
};
pub use rows::{RowIndices, RowKernel};
pub use stream::{Event, Inflight, Stream};
// The hot rows refresh their copies through the AI tier's tiered gather.
pub use tiered::{TIER_MAX_HOT_ROWS, TieredRows, TieredSource, tiered_stage_len};

use crate::error::{HalError, Result, check_range};
use crate::memory::mapped::{FileMapping, MappingPin};
use crate::memory::{
    DmaRegistration, HostBuffer, Location, MappingHold, MemoryRegion, SharedHostBuffer,
};
pub(crate) use backend::HostPin;
use backend::{DevRange, DeviceBackend, DeviceMemory};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// Which backend [`probe`] should use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendPreference {
    /// CUDA where a driver and a device are present, otherwise the host backend.
    #[default]
    Auto,
    /// The host backend, even where CUDA is present.
    Host,
    /// CUDA, or an error saying why it cannot run.
    Cuda,
}

impl std::str::FromStr for BackendPreference {
    type Err = HalError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "host" => Ok(Self::Host),
            "cuda" => Ok(Self::Cuda),
            other => Err(HalError::InvalidArgument(format!(
                "unknown backend {other:?} (expected auto, host or cuda)"
            ))),
        }
    }
}

/// What [`probe`] found.
#[derive(Debug, Clone)]
pub struct Probe {
    /// The devices to use, in ordinal order; never empty.
    pub gpus: Vec<Gpu>,
    /// Whether the CUDA backend can run here, and why not where it cannot.
    pub cuda: Capability,
}

impl Probe {
    /// The GPU with this ordinal.
    pub fn gpu(&self, ordinal: u32) -> Result<&Gpu> {
        self.gpus
            .get(ordinal as usize)
            .ok_or_else(|| HalError::NoSuchDevice {
                ordinal,
                count: self.gpus.len(),
                backend: self.gpus.first().map_or("host", |g| g.backend().name()),
            })
    }
}

/// Finds the GPUs to use. With [`BackendPreference::Auto`] this never fails: where CUDA cannot
/// run, the host backend stands in and [`Probe::cuda`] says why.
pub fn probe(pref: BackendPreference) -> Result<Probe> {
    probe_with(pref, 1)
}

/// Like [`probe`], with `host_devices` host-backend devices where the host backend is used
/// (several let multi-device logic such as peer copies run on a machine without GPUs).
pub fn probe_with(pref: BackendPreference, host_devices: u32) -> Result<Probe> {
    let cuda = cuda_devices(pref);
    let host = || {
        (0..host_devices.max(1))
            .map(|i| Gpu::from_backend(Arc::new(host::HostDevice::new(i))))
            .collect::<Vec<_>>()
    };
    match (pref, cuda) {
        (BackendPreference::Host, Ok(gpus)) => {
            drop(gpus);
            Ok(Probe {
                gpus: host(),
                cuda: Capability::yes("present, but the host backend was asked for"),
            })
        }
        (BackendPreference::Host, Err(e)) | (BackendPreference::Auto, Err(e)) => Ok(Probe {
            gpus: host(),
            cuda: Capability::no(match e {
                HalError::CudaUnavailable { reason } => reason,
                other => other.to_string(),
            }),
        }),
        (_, Ok(gpus)) => {
            let detail = format!("{} device(s)", gpus.len());
            Ok(Probe {
                gpus,
                cuda: Capability::yes(detail),
            })
        }
        (BackendPreference::Cuda, Err(e)) => Err(e),
    }
}

#[cfg(feature = "cuda")]
fn cuda_devices(_pref: BackendPreference) -> Result<Vec<Gpu>> {
    Ok(cuda::devices()?
        .into_iter()
        .map(|d| Gpu::from_backend(Arc::new(d)))
        .collect())
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices(_pref: BackendPreference) -> Result<Vec<Gpu>> {
    Err(HalError::CudaUnavailable {
        reason: "gpuio-hal was built without the `cuda` feature".into(),
    })
}

/// A handle to one GPU. Cheap to clone; all clones refer to the same device.
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<dyn DeviceBackend>,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self)
    }
}

impl fmt::Display for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let info = self.info();
        write!(
            f,
            "gpu{} ({}: {})",
            info.ordinal,
            info.backend.name(),
            info.name
        )
    }
}

impl PartialEq for Gpu {
    fn eq(&self, other: &Self) -> bool {
        self.same_device(other)
    }
}

impl Eq for Gpu {}

impl Gpu {
    fn from_backend(inner: Arc<dyn DeviceBackend>) -> Self {
        Self { inner }
    }

    /// What this device is and can do.
    pub fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.info().ordinal
    }

    /// The backend driving it.
    pub fn backend(&self) -> Backend {
        self.info().backend
    }

    /// Whether two handles refer to the same device.
    pub fn same_device(&self, other: &Gpu) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Allocates `len` bytes of device memory (uninitialised contents).
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        // A zero-byte request still gets a real allocation so every buffer has an address.
        let mem = self.inner.alloc(len.max(1))?;
        Ok(DeviceBuffer {
            inner: Arc::new(DeviceAlloc {
                gpu: self.clone(),
                mem,
                len,
            }),
        })
    }

    /// Waits for all work queued on this device, by gpuio or any other library sharing its
    /// primary context (PyTorch, CuPy): what a borrowed buffer's producer queued is then done.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    /// The live allocation holding device address `addr` now, as the driver knows it: an
    /// error where none does (freed memory), `Unsupported` on the host backend, which keeps
    /// no table of them. With [`DeviceBuffer::allocation`], tells whether what was kept about
    /// an allocation still holds.
    pub fn allocation_at(&self, addr: u64) -> Result<Allocation> {
        self.inner.allocation_at(addr)
    }

    /// Makes this device's (primary) context current on the calling thread, for libraries
    /// that act in the thread's context (UCX's CUDA transports under NIXL). A no-op on the
    /// host backend.
    pub fn bind_thread(&self) -> Result<()> {
        self.inner.bind_thread()
    }

    /// A buffer over device memory another library allocated (a PyTorch or CuPy tensor, a
    /// C caller's `cudaMalloc`): `len` bytes at device address `addr`, checked with the driver
    /// to lie inside one live allocation of this GPU. gpuio never frees it; the buffer and
    /// every clone (a queued transfer's) hold `owner`, the object that keeps it allocated
    /// (`()` where the caller vouches for that itself: a freed range only faults the GPU's
    /// copies, it cannot touch host memory). The host backend refuses it (`Unsupported`).
    pub fn borrow_device(
        &self,
        addr: u64,
        len: usize,
        owner: impl std::any::Any + Send + Sync,
    ) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(HalError::InvalidArgument(
                "a borrowed device range needs at least one byte".into(),
            ));
        }
        let mem = self.inner.borrow(addr, len, Box::new(owner))?;
        Ok(DeviceBuffer {
            inner: Arc::new(DeviceAlloc {
                gpu: self.clone(),
                mem,
                len,
            }),
        })
    }

    /// Waits for the work another library queued on its `stream` of this GPU (0: the legacy
    /// default stream), as cuFile's stream calls must before they read or write.
    ///
    /// # Safety
    /// A non-zero `stream` is a live stream handle of this GPU's primary context: the driver
    /// dereferences it.
    pub unsafe fn synchronize_foreign(&self, stream: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.inner.synchronize_foreign(stream) }
    }

    /// [`Gpu::borrow_device`] for an address that may not be device memory at all (a cuFile
    /// caller's buffer): None where the driver does not know it as this GPU's (host memory,
    /// pinned or not, is not), an error where it is but the range leaves its allocation. One
    /// question to the driver either way.
    pub fn borrow_device_if_held(
        &self,
        addr: u64,
        len: usize,
        owner: impl std::any::Any + Send + Sync,
    ) -> Result<Option<DeviceBuffer>> {
        if len == 0 {
            return Err(HalError::InvalidArgument(
                "a borrowed device range needs at least one byte".into(),
            ));
        }
        let held = self.inner.borrow_held(addr, len, Box::new(owner))?;
        Ok(held.map(|mem| DeviceBuffer {
            inner: Arc::new(DeviceAlloc {
                gpu: self.clone(),
                mem,
                len,
            }),
        }))
    }

    /// Creates a stream: an in-order queue of copies and kernels on this device.
    pub fn stream(&self) -> Result<Stream> {
        Ok(Stream {
            gpu: self.clone(),
            inner: self.inner.new_stream()?,
        })
    }

    /// Runs `f` with `mem` page-locked and registered with this device (`cuMemHostRegister`),
    /// and unregisters it afterwards (also if `f` panics). Inside, copies from or to `mem` run
    /// as direct DMA. Scoped rather than a guard, so that no safe code can leave memory
    /// registered after it is freed.
    pub fn with_registered<R>(&self, mem: &mut [u8], f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        if mem.is_empty() {
            return Err(HalError::InvalidArgument(
                "cannot register an empty host range".into(),
            ));
        }
        // SAFETY: `mem` is borrowed for this whole call and the pin is dropped (unregistering)
        // before the call returns or unwinds, so the range stays mapped for the pin's life.
        let pin = unsafe { self.inner.pin(mem.as_mut_ptr(), mem.len())? };
        let out = f(mem);
        drop(pin);
        Ok(out)
    }

    /// Whether `mem` lies inside one page-locked allocation of this device's driver, so that
    /// copies from or to it can run as direct DMA.
    pub fn is_pinned(&self, mem: &[u8]) -> bool {
        !mem.is_empty() && self.inner.is_pinned(mem.as_ptr(), mem.len())
    }

    /// Whether this device can reach `other`'s memory directly (peer-to-peer).
    pub fn can_access_peer(&self, other: &Gpu) -> bool {
        !self.same_device(other) && self.inner.can_access_peer(other.inner.as_ref())
    }

    /// Whether this device's kernels may read and write `buf` now: it is this device's, or
    /// peer access between the two devices of this probe is enabled (when the second of their
    /// contexts was made) and maps `buf`'s allocation (ordinary device memory; not memory of
    /// the virtual memory API or a stream-ordered pool, which only its owner grants).
    pub fn kernels_reach(&self, buf: &DeviceBuffer) -> bool {
        self.same_device(buf.gpu())
            || self
                .inner
                .kernels_reach(buf.gpu().inner.as_ref(), buf.device_addr())
    }

    /// Pins a host buffer for this device; used by [`HostBuffer::pin`].
    pub(crate) fn pin_host(&self, buf: &mut HostBuffer) -> Result<PinGuard> {
        let (ptr, len) = buf.raw_parts_mut();
        // SAFETY: HostBuffer drops its PinGuard before unmapping, so the range stays mapped
        // for the guard's whole life.
        let pin = unsafe { self.inner.pin(ptr, len)? };
        // SAFETY: ptr is the start of the range just registered, and `pin` keeps it so.
        let device_addr = unsafe { self.inner.mapped_addr(ptr)? };
        Ok(PinGuard {
            _pin: pin,
            gpu: self.ordinal(),
            device_addr,
        })
    }

    /// Registers `ptr..ptr+len` with this device, mapped for its kernels: host memory, or
    /// (`io`) device memory mapped into this process, such as an NVMe BAR. The guard
    /// unregisters it when dropped and says where kernels reach `ptr`
    /// ([`PinGuard::device_addr`]).
    ///
    /// # Safety
    /// The range must stay mapped until the guard drops.
    pub unsafe fn pin_mapped(&self, ptr: *mut u8, len: usize, io: bool) -> Result<PinGuard> {
        // SAFETY: the caller keeps the range mapped for the pin's life.
        let pin = unsafe {
            if io {
                self.inner.pin_io(ptr, len)?
            } else {
                self.inner.pin(ptr, len)?
            }
        };
        // SAFETY: `ptr` starts the range just registered with DEVICEMAP, which `pin` keeps.
        let device_addr = unsafe { self.inner.mapped_addr(ptr)? };
        Ok(PinGuard {
            _pin: pin,
            gpu: self.ordinal(),
            device_addr,
        })
    }

    /// Page-locks and registers `offset..offset+len` of a shared host buffer with this device
    /// (`cuMemHostRegister`) until the returned [`SharedPin`] drops. The pin keeps `owner`, so
    /// the memory cannot be freed while registered; the registration itself touches no bytes,
    /// so `owner` stays readable and writable through its guards meanwhile. On CUDA, a range
    /// overlapping another registration is refused (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`).
    /// Waits for writers of that range.
    pub fn pin_shared(
        &self,
        owner: Arc<SharedHostBuffer>,
        offset: usize,
        len: usize,
    ) -> Result<SharedPin> {
        if len == 0 {
            return Err(HalError::InvalidArgument(
                "cannot register an empty host range".into(),
            ));
        }
        // Taken under the range's locks, so the hold is on the buffer whose address we
        // register.
        let (ptr, hold) = owner.hold_range(offset, len)?;
        // SAFETY: the range was checked against the buffer, and `hold` keeps that buffer's
        // mapping from being unmapped (it is leaked if the buffer drops first) until after the
        // pin is dropped: SharedPin declares `_pin` before `_hold`.
        let pin = unsafe { self.inner.pin(ptr, len)? };
        // SAFETY: `ptr` starts the range just registered with DEVICEMAP, which `pin` keeps.
        let device_addr = unsafe { self.inner.mapped_addr(ptr)? };
        Ok(SharedPin {
            _pin: pin,
            _hold: hold,
            owner,
            offset,
            len,
            gpu: self.ordinal(),
            device_addr,
        })
    }

    /// Registers `range` of the wanted bytes of `map` read-only with this device (whole pages:
    /// two ranges of one mapping registered at once must not share a page), so the copy engine
    /// reads the page cache directly. Pages not resident are read in from the file now.
    /// [`HalError::Unsupported`] where the backend cannot: the host backend has no copy
    /// engine, and a CPU copy from a file mapping would fault if the file shrank meanwhile.
    pub fn pin_mapping(&self, map: &Arc<FileMapping>, range: Range<usize>) -> Result<MappingPin> {
        let pages = map.pages(&range)?;
        let first = map.base.wrapping_add(pages.start);
        // SAFETY: the span lies inside the live mapping, which the returned pin keeps alive
        // (it drops the registration before its reference to the mapping).
        let pin = unsafe { self.inner.pin_read_only(first, pages.end - pages.start)? };
        // SAFETY: `first` starts the range just registered (with DEVICEMAP), which `pin` keeps
        // registered.
        let device_first = unsafe { self.inner.mapped_addr(first)? };
        // Where kernels read the first wanted byte of `range`.
        let device_addr = device_first + (map.head + range.start - pages.start) as u64;
        Ok(MappingPin::new(
            pin,
            map.clone(),
            range,
            self.clone(),
            device_addr,
        ))
    }

    fn check_owns(&self, what: &'static str, buf: &DeviceBuffer) -> Result<()> {
        if buf.gpu().same_device(self) {
            Ok(())
        } else {
            Err(HalError::WrongDevice {
                what,
                owner: buf.gpu().to_string(),
                expected: self.to_string(),
            })
        }
    }
}

/// The registration of a [`HostBuffer`] with a device; dropped before the buffer is unmapped.
#[derive(Debug)]
pub struct PinGuard {
    _pin: Box<dyn HostPin>,
    gpu: u32,
    device_addr: u64,
}

impl PinGuard {
    /// The ordinal of the device that registered the memory.
    pub fn gpu(&self) -> u32 {
        self.gpu
    }

    /// Where kernels reach the buffer's first byte (zero-copy access over PCIe).
    pub fn device_addr(&self) -> u64 {
        self.device_addr
    }
}

/// A range of a shared [`HostBuffer`] registered with a device by [`Gpu::pin_shared`];
/// dropping it unregisters the range.
pub struct SharedPin {
    // Field order is drop order: unregister first, then let the mapping go, then the buffer.
    _pin: Box<dyn HostPin>,
    _hold: MappingHold,
    owner: Arc<SharedHostBuffer>,
    offset: usize,
    len: usize,
    gpu: u32,
    device_addr: u64,
}

impl fmt::Debug for SharedPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedPin")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("gpu", &self.gpu)
            .finish_non_exhaustive()
    }
}

impl SharedPin {
    /// The registered range, in bytes of the owner buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }

    /// Where the registering device's kernels read the range's first byte in place (over
    /// the bus), for as long as the pin lives.
    pub fn device_addr(&self) -> u64 {
        self.device_addr
    }

    /// The ordinal of the device that registered the memory.
    pub fn gpu(&self) -> u32 {
        self.gpu
    }

    /// The buffer the range belongs to.
    pub fn owner(&self) -> &Arc<SharedHostBuffer> {
        &self.owner
    }
}

/// Runs `f` with no CUDA context current on the calling thread, then makes the previous one
/// current again. For libraries that act differently under a context: UCX (under NIXL) pins
/// every host range it registers (`cuMemHostRegister`, ~0.3 ms a MiB) when the registering
/// thread has one, which host-to-host transfers do not need. Where CUDA was never set up in
/// this process, just runs `f`.
pub fn without_cuda_context<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "cuda")]
    return cuda::without_context(f);
    #[cfg(not(feature = "cuda"))]
    f()
}

/// Runs `f`, then makes the CUDA context that was current on the calling thread current
/// again if `f` changed it: a framework keys its current device on it (a call that bound
/// GPU 1's context would leave torch's `"cuda"` meaning GPU 1). Where CUDA was never set up
/// in this process, or in a process forked from the one that set it up, just runs `f`.
pub fn keeping_cuda_context<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "cuda")]
    return cuda::keeping_context(f);
    #[cfg(not(feature = "cuda"))]
    f()
}

/// A device allocation as the driver knows it (see [`DeviceBuffer::allocation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Device address of its first byte.
    pub base: u64,
    /// Bytes.
    pub len: usize,
    /// Unique among this process's allocations, past and present.
    pub id: u64,
}

/// Device memory. Cheap to clone; the memory is freed when the last clone is dropped, which
/// cannot happen while device work uses it (an [`Inflight`] holds a clone; every other
/// operation waits before returning). Threads may share a buffer; conflicting concurrent
/// writes leave unspecified bytes, as on a real GPU, but never unsound Rust.
#[derive(Clone)]
pub struct DeviceBuffer {
    inner: Arc<DeviceAlloc>,
}

struct DeviceAlloc {
    gpu: Gpu,
    mem: Box<dyn DeviceMemory>,
    len: usize,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("gpu", &self.inner.gpu.ordinal())
            .field("addr", &format_args!("{:#x}", self.device_addr()))
            .field("len", &self.inner.len)
            .finish()
    }
}

impl DeviceBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The device that owns the memory.
    pub fn gpu(&self) -> &Gpu {
        &self.inner.gpu
    }

    /// The device address of the first byte (for kernel arguments).
    pub fn device_addr(&self) -> u64 {
        self.inner.mem.addr()
    }

    /// Whether two handles refer to the same allocation.
    pub fn same_buffer(&self, other: &DeviceBuffer) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The allocation this buffer lies in: the buffer itself, or for a borrowed one (a
    /// framework's tensor) the allocation its owner made, which may be larger. Its id is
    /// unique within the process and never reused, so a cache of registrations can key on it
    /// and tell a freed allocation from a new one at the same addresses.
    pub fn allocation(&self) -> Result<Allocation> {
        self.inner.gpu.bind_thread()?;
        self.inner.mem.allocation()
    }

    /// Whether another library allocated the memory (a framework's tensor, through
    /// [`Gpu::borrow_device`]): then it may be a slice of a larger allocation.
    pub fn is_borrowed(&self) -> bool {
        self.inner.mem.borrowed()
    }

    /// The region this buffer covers.
    pub fn region(&self) -> MemoryRegion {
        MemoryRegion {
            location: Location::Device {
                gpu: self.inner.gpu.ordinal(),
            },
            addr: self.device_addr(),
            len: self.inner.len,
            registration: DmaRegistration::Pinned,
        }
    }

    fn range(&self, what: &'static str, offset: usize, len: usize) -> Result<DevRange<'_>> {
        check_range(what, offset, len, self.inner.len)?;
        Ok(DevRange {
            mem: self.inner.mem.as_ref(),
            offset,
            len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostAllocOptions;

    fn shared(len: usize) -> Arc<SharedHostBuffer> {
        Arc::new(SharedHostBuffer::new(
            HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap(),
        ))
    }

    #[test]
    fn allocations_have_ids_of_their_own() {
        let gpu = probe(BackendPreference::Auto).unwrap().gpus.remove(0);
        let (a, b) = (gpu.alloc(3 << 20).unwrap(), gpu.alloc(4096).unwrap());
        let (x, y) = (a.allocation().unwrap(), b.allocation().unwrap());
        assert_ne!(x.id, y.id);
        assert_eq!(x, a.clone().allocation().unwrap());
        for (buf, al) in [(&a, x), (&b, y)] {
            assert!(al.base <= buf.device_addr());
            assert!(buf.device_addr() + buf.len() as u64 <= al.base + al.len as u64);
        }
        match gpu.allocation_at(a.device_addr() + 5) {
            Ok(found) => assert_eq!(found, x),
            Err(e) => assert_eq!(e.code(), crate::ErrorCode::Unsupported, "{e}"),
        }
        drop(a);
        let c = gpu.alloc(3 << 20).unwrap();
        assert_ne!(c.allocation().unwrap().id, x.id, "an id is never reused");
        // Freed: the driver knows nothing there, or another allocation.
        if let Ok(now) = gpu.allocation_at(x.base) {
            assert_ne!(now.id, x.id);
        }
    }

    #[test]
    fn pin_shared_checks_its_range() {
        let gpu = probe(BackendPreference::Auto).unwrap().gpus.remove(0);
        let owner = shared(64 << 10);
        let pin = gpu.pin_shared(owner.clone(), 4096, 8192).unwrap();
        assert_eq!(pin.range(), 4096..12288);
        assert_eq!(pin.gpu(), gpu.ordinal());
        assert_ne!(pin.device_addr(), 0);
        assert!(Arc::ptr_eq(pin.owner(), &owner));
        let whole = 64 << 10;
        let err = gpu.pin_shared(owner.clone(), 0, whole + 1).unwrap_err();
        assert!(matches!(err, HalError::OutOfRange { .. }), "{err}");
        let err = gpu.pin_shared(owner.clone(), whole, 1).unwrap_err();
        assert!(matches!(err, HalError::OutOfRange { .. }), "{err}");
        let err = gpu.pin_shared(owner.clone(), usize::MAX, 2).unwrap_err();
        assert!(matches!(err, HalError::OutOfRange { .. }), "{err}");
        let err = gpu.pin_shared(owner.clone(), 0, 0).unwrap_err();
        assert_eq!(err.code(), crate::ErrorCode::InvalidArg, "{err}");
        // The last byte is a valid range.
        drop(gpu.pin_shared(owner.clone(), whole - 1, 1).unwrap());
        drop(pin);
        assert_eq!(Arc::strong_count(&owner), 1, "the pin gave its owner back");
    }

    #[test]
    fn a_buffer_swapped_out_while_pinned_is_leaked_not_unmapped() {
        let gpu = probe(BackendPreference::Auto).unwrap().gpus.remove(0);
        let owner = shared(8192);
        let pin = gpu.pin_shared(owner.clone(), 0, 8192).unwrap();
        // A lock holder replaces the registered buffer and drops it: its pages must stay mapped
        // until the pin is gone, so the old buffer's Drop leaks them.
        let old = std::mem::replace(
            &mut *owner.write(),
            HostBuffer::alloc(4096, &HostAllocOptions::default()).unwrap(),
        );
        drop(old);
        drop(pin);
        assert_eq!(owner.read().len(), 4096);
    }

    #[test]
    fn overlapping_shared_pins_are_refused_on_cuda() {
        let gpu = probe(BackendPreference::Auto).unwrap().gpus.remove(0);
        let page = crate::page_size();
        let owner = shared(8 * page);
        let _first = gpu.pin_shared(owner.clone(), page, 2 * page).unwrap();
        let overlap = gpu.pin_shared(owner.clone(), 2 * page, 2 * page);
        let same_page = gpu
            .pin_shared(owner.clone(), 3 * page + 100, 100)
            .and_then(|a| {
                gpu.pin_shared(owner.clone(), 3 * page + 300, 100)
                    .map(|b| (a, b))
            });
        let adjacent = gpu.pin_shared(owner.clone(), 5 * page, page);
        // What else the driver accepts is printed, not asserted: only overlap refusal matters.
        eprintln!(
            "{:?}: overlap {:?}; two ranges in one page {:?}; adjacent pages {:?}",
            gpu.backend(),
            overlap.as_ref().map(|p| p.range()),
            same_page.as_ref().map(|(a, b)| (a.range(), b.range())),
            adjacent.as_ref().map(|p| p.range()),
        );
        adjacent.unwrap();
        if gpu.backend() == Backend::Cuda {
            let err = overlap.unwrap_err();
            assert!(matches!(err, HalError::Cuda { .. }), "{err}");
        }
    }
}
