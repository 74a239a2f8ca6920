//! One CUDA device: its primary context and kernel modules ([`Shared`], which its streams and
//! allocations hold too; `module.rs` loads them), what it reports about itself
//! ([`DeviceInfo`]), and the [`DeviceBackend`] it implements — allocations, streams, host
//! pinning, peer access, kernel loading, the baseline copies and GPUDirect Storage. Driver calls
//! go through [`driver`].

use super::driver::{self, cuda_err};
use super::memory::{CudaMemory, CudaPin, ForeignMemory};
use super::module::{self, Loaded};
use super::resident::send_home;
use super::stream::CudaStreamBackend;
use super::{cufile, probe};
use crate::error::{ErrorCode, HalError, Result};
use crate::gpu::GdsMode;
use crate::gpu::backend::{
    BaselineCopy, DevRange, DeviceBackend, DeviceMemory, GdsFileBackend, HostPin, Owner,
    StreamBackend,
};
use crate::gpu::info::{Backend, Capability, DeviceInfo, PcieLink, cxl_capability, pci_numa_node};
use crate::kernels::{Kernel, KernelLoad, KernelOrigin, KernelPath, KernelSource};
use crate::sync::MutexExt;
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, sys};
use std::any::Any;
use std::sync::{Arc, Mutex, OnceLock};

/// State shared by a device and its streams.
#[derive(Debug)]
pub(super) struct Shared {
    ordinal: usize,
    pub(super) device: sys::CUdevice,
    /// The device's primary context, retained on first use: a process that uses one GPU of
    /// several makes (~0.15-0.2 s) and holds memory on that one alone.
    ctx: OnceLock<Arc<CudaContext>>,
    /// Held while the context is being made, so that it is made once.
    making: Mutex<()>,
    /// The probe's devices, for peer access between those with contexts.
    set: Arc<DeviceSet>,
    compute_capability: (u32, u32),
    multiprocessors: u32,
    /// The kernel modules used on this device, each loaded on first use (or the reason it
    /// could not be, kept for every later caller), by the address of its static.
    modules: Mutex<Vec<(usize, ModuleSlot)>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let modules = std::mem::take(self.modules.get_mut_unpoisoned());
        let ctx = self.ctx.take();
        if super::probe::driver_forked() {
            // The context and the modules loaded in it are the parent's: never released here.
            std::mem::forget((modules, ctx));
            return;
        }
        // Unloading a module or releasing the context binds it; the caller's stays current.
        let own = ctx.as_ref().map(|c| (self.device, c.cu_ctx() as usize));
        super::releasing(own.as_slice(), || drop((modules, ctx)));
    }
}

/// The devices of one probe whose contexts exist: each context made enables peer access
/// both ways with every one made before it, where the pair supports it.
#[derive(Debug, Default)]
struct DeviceSet {
    opened: Mutex<Opened>,
}

#[derive(Debug, Default)]
struct Opened {
    contexts: Vec<(usize, sys::CUdevice, Arc<CudaContext>)>,
    /// The (from, to) ordinals whose peer access was enabled: where a kernel of `from` may
    /// touch `to`'s memory.
    reach: Vec<(usize, usize)>,
}

impl DeviceSet {
    /// Records `ctx`, device `ordinal`'s new context, enabling peer access with the others.
    fn join(&self, ordinal: usize, device: sys::CUdevice, ctx: &Arc<CudaContext>) {
        let mut opened = self.opened.lock_unpoisoned();
        let Opened { contexts, reach } = &mut *opened;
        for (other, other_device, other_ctx) in contexts.iter() {
            let pairs = [
                ((ordinal, device, ctx), (*other, *other_device, other_ctx)),
                ((*other, *other_device, other_ctx), (ordinal, device, ctx)),
            ];
            for ((from, from_device, from_ctx), (to, to_device, to_ctx)) in pairs {
                if !matches!(
                    driver::device_can_access_peer(from_device, to_device),
                    Ok(true)
                ) {
                    continue;
                }
                let enabled = from_ctx
                    .bind_to_thread()
                    .map_err(cuda_err("cuCtxSetCurrent"))
                    .and_then(|()| {
                        // SAFETY: `to_ctx` is a live primary context (an Arc of it is held
                        // here); enabling access changes only the driver's mapping state.
                        unsafe { driver::ctx_enable_peer_access(to_ctx.cu_ctx()) }
                    });
                match enabled {
                    Ok(()) => reach.push((from, to)),
                    Err(e) => tracing::warn!(gpu = from, peer = to, error = %e,
                        "peer access not enabled; peer copies will be staged by the driver"),
                }
            }
        }
        contexts.push((ordinal, device, ctx.clone()));
    }

    /// Whether a kernel of device `from` may touch device `to`'s memory.
    fn reaches(&self, from: usize, to: usize) -> bool {
        self.opened.lock_unpoisoned().reach.contains(&(from, to))
    }
}

impl Drop for DeviceSet {
    fn drop(&mut self) {
        let contexts = std::mem::take(&mut self.opened.get_mut_unpoisoned().contexts);
        if super::probe::driver_forked() {
            // The parent's contexts: never released here.
            std::mem::forget(contexts);
            return;
        }
        let released: Vec<_> = contexts
            .iter()
            .map(|(_, device, ctx)| (*device, ctx.cu_ctx() as usize))
            .collect();
        super::releasing(&released, || drop(contexts));
    }
}

/// A module's place on a device: loaded once, by whichever caller comes first.
type ModuleSlot = Arc<OnceLock<std::result::Result<Arc<Loaded>, String>>>;

impl Shared {
    /// The device's primary context, made (retained) on first use.
    pub(super) fn ctx(&self) -> Result<&Arc<CudaContext>> {
        if let Some(ctx) = self.ctx.get() {
            return Ok(ctx);
        }
        let _making = self.making.lock_unpoisoned();
        if let Some(ctx) = self.ctx.get() {
            return Ok(ctx);
        }
        probe::check_driver()?; // no driver call in a forked child
        let ctx = CudaContext::new(self.ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        self.set.join(self.ordinal, self.device, &ctx);
        Ok(self.ctx.get_or_init(|| ctx))
    }

    /// Makes the device's context current on the calling thread.
    pub(super) fn bind(&self) -> Result<()> {
        self.ctx()?
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))
    }

    /// A kernel module, loaded on first use (`module.rs`: embedded PTX, or NVRTC).
    pub(super) fn module(&self, src: &'static KernelSource) -> Result<Arc<Loaded>> {
        let key = std::ptr::from_ref(src) as usize;
        let slot = {
            let mut modules = self.modules.lock_unpoisoned();
            match modules.iter().find(|(k, _)| *k == key) {
                Some((_, slot)) => slot.clone(),
                None => {
                    let slot = ModuleSlot::default();
                    modules.push((key, slot.clone()));
                    slot
                }
            }
        };
        let loaded = slot.get_or_init(|| {
            let ctx = self.ctx().map_err(|e| e.to_string())?;
            module::load(ctx, self.compute_capability, src).map(Arc::new)
        });
        loaded.clone().map_err(|reason| HalError::KernelLoad {
            kernel: src.name.into(),
            reason,
        })
    }

    /// A kernel, its module loaded on first use.
    pub(super) fn function<K: Kernel>(&self, kernel: K) -> Result<CudaFunction> {
        let module = self.module(K::module())?;
        module
            .functions
            .get(kernel.index())
            .cloned()
            .ok_or_else(|| HalError::KernelLoad {
                kernel: K::module().name.into(),
                reason: format!("{} is not among its functions", kernel.name()),
            })
    }

    /// Whether a launch of `config` has at most a block per multiprocessor: a short kernel,
    /// which tells its end itself (gather.cu's `gpuio_signal_end`). A larger grid would pay a
    /// barrier and a count per block for an end seen 1-2 µs sooner in milliseconds.
    pub(super) fn block_per_sm(&self, config: &LaunchConfig) -> bool {
        let (x, y, z) = config.grid_dim;
        u64::from(x) * u64::from(y) * u64::from(z) <= u64::from(self.multiprocessors)
    }

    /// A grid-stride launch shape for `items` work items.
    pub(super) fn launch_config(&self, items: u64) -> LaunchConfig {
        const BLOCK: u32 = 256;
        let max_blocks = self.multiprocessors.max(1) * 32;
        let blocks = items.div_ceil(BLOCK as u64).clamp(1, max_blocks as u64) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// One CUDA device.
#[derive(Debug)]
pub(crate) struct CudaDevice {
    pub(super) shared: Arc<Shared>,
    info: DeviceInfo,
}

/// Probes the driver and returns every CUDA device. No context is made here: each device
/// makes its own on first use, and enables peer access with the devices that have one.
pub(crate) fn devices() -> Result<Vec<CudaDevice>> {
    probe::check_driver()?;
    let count = CudaContext::device_count().map_err(cuda_err("cuDeviceGetCount"))?;
    if count <= 0 {
        return Err(HalError::CudaUnavailable {
            reason: "the CUDA driver reports no devices".into(),
        });
    }
    let driver_version = probe::driver_version();
    let set = Arc::new(DeviceSet::default());
    (0..count as usize)
        .map(|ordinal| CudaDevice::open(ordinal, driver_version, set.clone()))
        .collect()
}

impl CudaDevice {
    fn open(
        ordinal: usize,
        driver_version: Option<(u32, u32)>,
        set: Arc<DeviceSet>,
    ) -> Result<Self> {
        let device = driver::device_get(ordinal)?;
        let attr = |a| driver::device_attribute(device, a);
        use sys::CUdevice_attribute as A;
        let (major, minor) = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let multiprocessors = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let can_map_host_memory = attr(A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)? != 0;
        let bus_id = format!(
            "{:04x}:{:02x}:{:02x}.0",
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        let gdr_attr = attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)? != 0;
        let (name, total_memory) = driver::device_name_and_memory(device)?;
        let info = DeviceInfo {
            ordinal: ordinal as u32,
            backend: Backend::Cuda,
            vendor: "NVIDIA".into(),
            name,
            total_memory: total_memory as u64,
            compute_capability: Some((major as u32, minor as u32)),
            multiprocessors,
            copy_engines: attr(A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)? as u32,
            numa_node: pci_numa_node(&bus_id),
            pcie: PcieLink::read(&bus_id),
            pci_bus_id: Some(bus_id),
            driver_version,
            can_map_host_memory,
            gds: probe::gds_capability(),
            gdr: probe::gdr_capability(gdr_attr),
            cxl: cxl_capability(can_map_host_memory),
            page_cache_dma: if attr(A::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)? != 0
            {
                Capability::yes("read-only host registration of file mappings")
            } else {
                Capability::no("the device cannot register read-only host memory")
            },
            dma_buf: if attr(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? != 0 {
                Capability::yes("device memory exports as dma-bufs (cuMemGetHandleForAddressRange)")
            } else {
                Capability::no(
                    "the driver does not export dma-bufs (NVIDIA's open kernel modules do, from \
                     release 515)",
                )
            },
        };
        Ok(Self {
            shared: Arc::new(Shared {
                ordinal,
                device,
                ctx: OnceLock::new(),
                making: Mutex::new(()),
                set,
                compute_capability: (major as u32, minor as u32),
                multiprocessors,
                modules: Mutex::default(),
            }),
            info,
        })
    }
}

/// `len` bytes at `addr` of the device allocation `r` (the driver's answer for `addr`),
/// checked to lie inside it.
fn foreign(
    r: &driver::PointerRange,
    addr: u64,
    len: usize,
    owner: Owner,
) -> Result<Box<dyn DeviceMemory>> {
    let end = addr.checked_add(len as u64);
    if addr < r.start || end.is_none_or(|e| e > r.start + r.size as u64) {
        return Err(HalError::InvalidArgument(format!(
            "{addr:#x}+{len}: outside its allocation ({:#x}+{})",
            r.start, r.size
        )));
    }
    Ok(Box::new(ForeignMemory {
        ptr: addr,
        _owner: owner,
    }))
}

impl DeviceBackend for CudaDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc_managed(&self, len: usize) -> Result<Box<dyn DeviceMemory>> {
        self.shared.bind()?;
        let ptr = driver::mem_alloc_managed(len)?;
        // SAFETY: a fresh allocation in this (bound) context, owned by CudaMemory alone;
        // cuMemFree frees managed memory as it does device memory.
        Ok(Box::new(unsafe {
            CudaMemory::new(self.shared.clone(), ptr)
        }))
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn DeviceMemory>> {
        self.shared.bind()?;
        // Only CUDA_ERROR_OUT_OF_MEMORY maps to NoMem.
        let ptr = driver::mem_alloc(len).map_err(|e| match e {
            HalError::Cuda {
                code: ErrorCode::NoMem,
                ..
            } => HalError::OutOfMemory {
                what: "device memory",
                len,
            },
            other => other,
        })?;
        // SAFETY: a fresh cuMemAlloc in this (bound) context, owned by CudaMemory alone.
        Ok(Box::new(unsafe {
            CudaMemory::new(self.shared.clone(), ptr)
        }))
    }

    fn synchronize(&self) -> Result<()> {
        // A device no one in the process has made a context on has no work to wait for:
        // waiting would make one (~0.15 s, and memory on a GPU the caller never used).
        if self.shared.ctx.get().is_none() && !driver::primary_context_active(self.shared.device)? {
            return Ok(());
        }
        self.shared.bind()?;
        let _waiting = send_home(self.shared.device);
        driver::ctx_synchronize()
    }

    fn bind_thread(&self) -> Result<()> {
        self.shared.bind()
    }

    fn allocation_at(&self, addr: u64) -> Result<crate::gpu::Allocation> {
        self.shared.bind()?;
        driver::allocation(addr)
    }

    fn borrow(&self, addr: u64, len: usize, owner: Owner) -> Result<Box<dyn DeviceMemory>> {
        self.shared.bind()?;
        let r = driver::pointer_range(addr)?;
        let invalid = |why: String| HalError::InvalidArgument(format!("{addr:#x}+{len}: {why}"));
        if r.mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(invalid("not device memory the CUDA driver knows".into()));
        }
        if r.ordinal != self.info.ordinal as i32 {
            return Err(invalid(format!(
                "memory of GPU {}, not GPU {}",
                r.ordinal, self.info.ordinal
            )));
        }
        foreign(&r, addr, len, owner)
    }

    fn borrow_held(
        &self,
        addr: u64,
        len: usize,
        owner: Owner,
    ) -> Result<Option<Box<dyn DeviceMemory>>> {
        self.shared.bind()?;
        let r = driver::pointer_range(addr)?;
        if r.mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
            || r.ordinal != self.info.ordinal as i32
        {
            return Ok(None);
        }
        foreign(&r, addr, len, owner).map(Some)
    }

    unsafe fn synchronize_foreign(&self, stream: u64) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: the caller's contract: 0 or a live stream of this (current) context.
        unsafe { driver::stream_synchronize(stream as sys::CUstream) }
    }

    fn new_stream(&self) -> Result<Box<dyn StreamBackend>> {
        self.shared.bind()?;
        Ok(Box::new(CudaStreamBackend::new(self.shared.clone())?))
    }

    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<Box<dyn HostPin>> {
        self.shared.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller keeps ptr..ptr+len mapped until the returned CudaPin drops, which
        // unregisters it.
        unsafe { driver::mem_host_register(ptr, len, flags)? };
        // SAFETY: registered just above in this context; the pin alone unregisters it, and the
        // caller keeps the range mapped until the pin drops.
        Ok(Box::new(unsafe { CudaPin::new(self.shared.clone(), ptr) }))
    }

    unsafe fn pin_read_only(&self, ptr: *mut u8, len: usize) -> Result<Box<dyn HostPin>> {
        self.shared.bind()?;
        // READ_ONLY is what lets the driver pin pages of a read-only mapping (without it the
        // registration fails); PORTABLE makes the pin good for every context, so every device
        // can copy from it (`MappingPin::copy_to_device` relies on that); DEVICEMAP gives
        // kernels an address to read it at (`MappingPin::device_addr`).
        let flags = sys::CU_MEMHOSTREGISTER_READ_ONLY
            | sys::CU_MEMHOSTREGISTER_PORTABLE
            | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller keeps ptr..ptr+len mapped until the returned CudaPin drops, which
        // unregisters it.
        unsafe { driver::mem_host_register(ptr, len, flags)? };
        // SAFETY: registered just above in this context; the pin alone unregisters it.
        Ok(Box::new(unsafe { CudaPin::new(self.shared.clone(), ptr) }))
    }

    unsafe fn pin_io(&self, ptr: *mut u8, len: usize) -> Result<Box<dyn HostPin>> {
        self.shared.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_IOMEMORY | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller keeps ptr..ptr+len mapped until the returned CudaPin drops, which
        // unregisters it.
        unsafe { driver::mem_host_register(ptr, len, flags)? };
        // SAFETY: registered just above in this context; the pin alone unregisters it.
        Ok(Box::new(unsafe { CudaPin::new(self.shared.clone(), ptr) }))
    }

    unsafe fn mapped_addr(&self, ptr: *mut u8) -> Result<u64> {
        self.shared.bind()?;
        // SAFETY: ptr lies in memory registered with DEVICEMAP (caller's contract).
        unsafe { driver::mem_host_get_device_pointer(ptr) }
    }

    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        if self.shared.bind().is_err() {
            return false;
        }
        probe::host_range_is_pinned(ptr, len)
    }

    fn can_access_peer(&self, other: &dyn DeviceBackend) -> bool {
        let Some(other) = other.as_any().downcast_ref::<CudaDevice>() else {
            return false;
        };
        if probe::driver_forked() {
            return false; // no driver call in a forked child
        }
        matches!(
            driver::device_can_access_peer(self.shared.device, other.shared.device),
            Ok(true)
        )
    }

    fn kernels_reach(&self, other: &dyn DeviceBackend, addr: u64) -> bool {
        other
            .as_any()
            .downcast_ref::<CudaDevice>()
            .is_some_and(|other| {
                Arc::ptr_eq(&self.shared.set, &other.shared.set)
                    && self
                        .shared
                        .set
                        .reaches(self.shared.ordinal, other.shared.ordinal)
                    && self.shared.bind().is_ok()
                    && matches!(driver::is_ordinary_allocation(addr), Ok(true))
            })
    }

    unsafe fn baseline_copy(&self, copy: BaselineCopy<'_>) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: the device ranges are checked ranges of live allocations and the host pointer
        // is valid for the call (caller's contract). These are the synchronous legacy-stream
        // copies cudaMemcpy makes; D2D returns before the copy ends, so the context is
        // synchronized after it (while the caller's borrows keep both ranges live).
        unsafe {
            match copy {
                BaselineCopy::HostToDevice { src, dst } => {
                    driver::memcpy_htod(dst.addr(), src, dst.len)
                }
                BaselineCopy::DeviceToHost { src, dst } => {
                    driver::memcpy_dtoh(dst, src.addr(), src.len)
                }
                BaselineCopy::DeviceToDevice { src, dst } => {
                    driver::memcpy_dtod(dst.addr(), src.addr(), dst.len).and_then(|()| {
                        let _waiting = send_home(self.shared.device);
                        driver::ctx_synchronize()
                    })
                }
            }
        }
        .map_err(driver::renamed("cudaMemcpy (baseline)"))
    }

    fn load_kernels(&self, src: &'static KernelSource) -> Result<KernelOrigin> {
        Ok(self.shared.module(src)?.origin)
    }

    fn time_kernel_load(&self, src: &KernelSource, path: KernelPath) -> Result<KernelLoad> {
        let shared = &self.shared;
        module::time_load(shared.ctx()?, shared.compute_capability, src, path)
    }

    fn export_dmabuf(&self, addr: u64, len: usize) -> Result<std::os::fd::OwnedFd> {
        if !self.info.dma_buf.available {
            return Err(HalError::Unsupported {
                what: "dma-buf export of device memory",
                reason: self.info.dma_buf.detail.clone(),
            });
        }
        self.shared.bind()?;
        // SAFETY: the caller (`DeviceBuffer::export_dmabuf`) passes a range of a live
        // allocation of this device, kept alive by the export it returns.
        unsafe { driver::mem_dmabuf_fd(addr, len) }
    }

    fn gds(&self) -> Result<(GdsMode, String)> {
        self.shared.bind()?;
        cufile::open()
    }

    fn gds_register(&self, file: Arc<std::fs::File>) -> Result<Box<dyn GdsFileBackend>> {
        self.gds()?;
        Ok(Box::new(CudaGdsFile {
            shared: self.shared.clone(),
            registration: cufile::FileRegistration::new(file)?,
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A file registered with cuFile, doing IO in this device's context.
struct CudaGdsFile {
    shared: Arc<Shared>,
    registration: cufile::FileRegistration,
}

impl GdsFileBackend for CudaGdsFile {
    fn read(&self, dst: DevRange<'_>, offset: u64) -> Result<usize> {
        self.shared.bind()?;
        // SAFETY: `dst` is a checked range of a live allocation of this context (the public
        // type checked ownership and bounds, and borrows the buffer for the call).
        unsafe { self.registration.read(dst.addr(), dst.len, offset) }
    }

    fn write(&self, src: DevRange<'_>, offset: u64) -> Result<usize> {
        self.shared.bind()?;
        // SAFETY: as for `read`.
        unsafe { self.registration.write(src.addr(), src.len, offset) }
    }
}
