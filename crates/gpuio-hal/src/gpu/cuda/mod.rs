//! The CUDA backend, on cudarc with run-time loading: the binary builds with no CUDA installed,
//! and the device probe checks for libcuda (and every driver symbol gpuio calls) before the first
//! call, because cudarc panics where a library or symbol is missing.
//!
//! Contexts are the devices' primary contexts (shared with the CUDA runtime, PyTorch, CuPy).
//! Every operation binds the context to the calling thread first, so any thread may use any
//! device.

mod cufile;
mod nvrtc;
mod probe;

pub use nvrtc::{compile_ptx, compile_ptx_for};

use super::GdsMode;
use super::RowKernel;
use super::backend::{
    BaselineCopy, DevRange, DeviceBackend, DeviceMemory, EventBackend, GdsFileBackend, HostPin,
    RingLaunch, RowHooks, RowJob, RowMem, RowsDone, StreamBackend,
};
use super::info::{Backend, DeviceInfo, PcieLink, cxl_capability, pci_numa_node};
use crate::error::{ErrorCode, HalError, Result};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg,
    result, sys,
};
use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// Converts a driver error into the HAL's error, naming the operation.
pub(crate) fn cuda_err(op: &'static str) -> impl FnOnce(DriverError) -> HalError {
    move |e: DriverError| {
        use sys::cudaError_enum as E;
        let code = match e.0 {
            E::CUDA_ERROR_OUT_OF_MEMORY => ErrorCode::NoMem,
            E::CUDA_ERROR_INVALID_VALUE
            | E::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
            | E::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
            | E::CUDA_ERROR_INVALID_DEVICE => ErrorCode::InvalidArg,
            E::CUDA_ERROR_NOT_SUPPORTED => ErrorCode::Unsupported,
            E::CUDA_ERROR_NOT_READY => ErrorCode::Busy,
            E::CUDA_ERROR_NO_DEVICE | E::CUDA_ERROR_NOT_FOUND => ErrorCode::NotFound,
            _ => ErrorCode::General,
        };
        HalError::Cuda {
            op,
            name: e.error_name().map_or_else(
                |_| format!("{:?}", e.0),
                |s| s.to_string_lossy().into_owned(),
            ),
            message: e
                .error_string()
                .map_or_else(|_| String::new(), |s| s.to_string_lossy().into_owned()),
            code,
        }
    }
}

/// State shared by a device and its streams.
#[derive(Debug)]
struct Shared {
    ctx: Arc<CudaContext>,
    compute_capability: (u32, u32),
    multiprocessors: u32,
    /// The compiled `kernels/pattern.cu`, built on first use.
    pattern: OnceLock<std::result::Result<PatternKernels, String>>,
    /// The compiled `kernels/gather.cu`, in `kernels::GATHER.functions` order.
    rows: OnceLock<std::result::Result<Vec<CudaFunction>, String>>,
    /// The compiled `kernels/ring_bench.cu`, in `kernels::RING_BENCH.functions` order.
    ring: OnceLock<std::result::Result<Vec<CudaFunction>, String>>,
}

#[derive(Debug)]
struct PatternKernels {
    fill: CudaFunction,
    mismatch: CudaFunction,
}

impl Shared {
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))
    }

    fn pattern(&self) -> Result<&PatternKernels> {
        let src = &crate::kernels::PATTERN;
        self.pattern
            .get_or_init(|| {
                let f = self.load(src)?;
                Ok(PatternKernels {
                    fill: f[0].clone(),
                    mismatch: f[1].clone(),
                })
            })
            .as_ref()
            .map_err(|log| HalError::Compile {
                kernel: src.name.into(),
                log: log.clone(),
            })
    }

    fn row_kernels(&self) -> Result<&[CudaFunction]> {
        let src = &crate::kernels::GATHER;
        self.rows
            .get_or_init(|| self.load(src))
            .as_deref()
            .map_err(|log| HalError::Compile {
                kernel: src.name.into(),
                log: log.clone(),
            })
    }

    fn ring_kernels(&self) -> Result<&[CudaFunction]> {
        let src = &crate::kernels::RING_BENCH;
        self.ring
            .get_or_init(|| self.load(src))
            .as_deref()
            .map_err(|log| HalError::Compile {
                kernel: src.name.into(),
                log: log.clone(),
            })
    }

    /// Compiles a source for this device and loads its functions, in the source's order.
    fn load(
        &self,
        src: &crate::kernels::KernelSource,
    ) -> std::result::Result<Vec<CudaFunction>, String> {
        let ptx = compile_ptx(src, Some(self.compute_capability)).map_err(|e| e.to_string())?;
        let module = self
            .ctx
            .load_module(ptx)
            .map_err(|e| cuda_err("cuModuleLoadData")(e).to_string())?;
        src.functions
            .iter()
            .map(|name| {
                module
                    .load_function(name)
                    .map_err(|e| cuda_err("cuModuleGetFunction")(e).to_string())
            })
            .collect()
    }

    /// A grid-stride launch shape for `items` work items.
    fn launch_config(&self, items: u64) -> LaunchConfig {
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
    shared: Arc<Shared>,
    info: DeviceInfo,
}

/// Probes the driver and returns every CUDA device, with peer access enabled between the pairs
/// that support it.
pub(crate) fn devices() -> Result<Vec<CudaDevice>> {
    probe::check_driver()?;
    let count = CudaContext::device_count().map_err(cuda_err("cuDeviceGetCount"))?;
    if count <= 0 {
        return Err(HalError::CudaUnavailable {
            reason: "the CUDA driver reports no devices".into(),
        });
    }
    let driver_version = probe::driver_version();
    let devices = (0..count as usize)
        .map(|ordinal| CudaDevice::open(ordinal, driver_version))
        .collect::<Result<Vec<_>>>()?;
    for a in &devices {
        for b in &devices {
            if !std::ptr::eq(a, b) && a.can_access_peer(b) {
                a.enable_peer_access(b);
            }
        }
    }
    Ok(devices)
}

impl CudaDevice {
    fn open(ordinal: usize, driver_version: Option<(u32, u32)>) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
        let attr = |a| ctx.attribute(a).map_err(cuda_err("cuDeviceGetAttribute"));
        use sys::CUdevice_attribute as A;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("cuDeviceGetAttribute"))?;
        let multiprocessors = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let can_map_host_memory = attr(A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)? != 0;
        let bus_id = format!(
            "{:04x}:{:02x}:{:02x}.0",
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        let gdr_attr = attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED)? != 0;
        let info = DeviceInfo {
            ordinal: ordinal as u32,
            backend: Backend::Cuda,
            vendor: "NVIDIA".into(),
            name: ctx.name().map_err(cuda_err("cuDeviceGetName"))?,
            total_memory: ctx.total_mem().map_err(cuda_err("cuDeviceTotalMem"))? as u64,
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
        };
        Ok(Self {
            shared: Arc::new(Shared {
                ctx,
                compute_capability: (major as u32, minor as u32),
                multiprocessors,
                pattern: OnceLock::new(),
                rows: OnceLock::new(),
                ring: OnceLock::new(),
            }),
            info,
        })
    }

    fn enable_peer_access(&self, peer: &CudaDevice) {
        let result = self.shared.bind().and_then(|()| {
            // SAFETY: both contexts are live primary contexts; enabling access changes only
            // the driver's mapping state. "Already enabled" is not an error worth reporting.
            let rc = unsafe { sys::cuCtxEnablePeerAccess(peer.shared.ctx.cu_ctx(), 0) };
            match rc {
                sys::CUresult::CUDA_SUCCESS
                | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
                other => Err(cuda_err("cuCtxEnablePeerAccess")(DriverError(other))),
            }
        });
        if let Err(e) = result {
            tracing::warn!(gpu = self.info.ordinal, peer = peer.info.ordinal, error = %e,
                "peer access not enabled; peer copies will be staged by the driver");
        }
    }
}

#[derive(Debug)]
struct CudaMemory {
    shared: Arc<Shared>,
    ptr: sys::CUdeviceptr,
}

impl DeviceMemory for CudaMemory {
    fn addr(&self) -> u64 {
        self.ptr
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        let freed = self.shared.bind().and_then(|()| {
            // SAFETY: ptr came from cuMemAlloc in this context and is freed once, here. No
            // queued work can still use it: async operations (Inflight) hold the DeviceBuffer
            // until they complete, and every other operation waits before returning.
            unsafe { result::free_sync(self.ptr) }.map_err(cuda_err("cuMemFree"))
        });
        if let Err(e) = freed {
            tracing::error!(error = %e, "freeing device memory failed");
        }
    }
}

#[derive(Debug)]
struct CudaPin {
    shared: Arc<Shared>,
    ptr: *mut u8,
}

// SAFETY: the pointer is only an identifier handed back to cuMemHostUnregister; it is never
// dereferenced here.
unsafe impl Send for CudaPin {}
// SAFETY: as above.
unsafe impl Sync for CudaPin {}

impl HostPin for CudaPin {}

impl Drop for CudaPin {
    fn drop(&mut self) {
        let done = self.shared.bind().and_then(|()| {
            // SAFETY: ptr was registered by cuMemHostRegister and is still mapped (the pin's
            // contract), and is unregistered exactly once.
            unsafe { sys::cuMemHostUnregister(self.ptr.cast()) }
                .result()
                .map_err(cuda_err("cuMemHostUnregister"))
        });
        if let Err(e) = done {
            tracing::error!(error = %e, "unregistering host memory failed");
        }
    }
}

impl DeviceBackend for CudaDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn DeviceMemory>> {
        self.shared.bind()?;
        // SAFETY: cuMemAlloc in the bound context; the pointer is owned by CudaMemory.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(|e| match e.0 {
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => HalError::OutOfMemory {
                what: "device memory",
                len,
            },
            _ => cuda_err("cuMemAlloc")(e),
        })?;
        Ok(Box::new(CudaMemory {
            shared: self.shared.clone(),
            ptr,
        }))
    }

    fn new_stream(&self) -> Result<Box<dyn StreamBackend>> {
        self.shared.bind()?;
        let stream = self
            .shared
            .ctx
            .new_stream()
            .map_err(cuda_err("cuStreamCreate"))?;
        Ok(Box::new(CudaStreamBackend {
            shared: self.shared.clone(),
            stream,
            events: Arc::new(EventPool::default()),
            scratch: Mutex::new(None),
            order: Mutex::new(OrderScratch::default()),
        }))
    }

    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<Box<dyn HostPin>> {
        self.shared.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller keeps ptr..ptr+len mapped until the returned CudaPin drops, which
        // unregisters it.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) }
            .result()
            .map_err(cuda_err("cuMemHostRegister"))?;
        Ok(Box::new(CudaPin {
            shared: self.shared.clone(),
            ptr,
        }))
    }

    unsafe fn mapped_addr(&self, ptr: *mut u8) -> Result<u64> {
        self.shared.bind()?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: ptr lies in memory registered with DEVICEMAP (caller's contract); the call
        // writes one device pointer.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, ptr.cast(), 0) }
            .result()
            .map_err(cuda_err("cuMemHostGetDevicePointer"))?;
        Ok(dptr)
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
        let mut can = 0;
        // SAFETY: both are valid device handles; the call writes one int.
        let rc = unsafe {
            sys::cuDeviceCanAccessPeer(
                &mut can,
                self.shared.ctx.cu_device(),
                other.shared.ctx.cu_device(),
            )
        };
        rc == sys::CUresult::CUDA_SUCCESS && can != 0
    }

    unsafe fn baseline_copy(&self, copy: BaselineCopy<'_>) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: the device ranges are checked ranges of live allocations and the host pointer
        // is valid for the call (caller's contract). These are the synchronous legacy-stream
        // copies cudaMemcpy makes; D2D returns before the copy ends, so the context is
        // synchronized after it.
        unsafe {
            match copy {
                BaselineCopy::HostToDevice { src, dst } => {
                    sys::cuMemcpyHtoD_v2(dst.addr(), src as *const c_void, dst.len).result()
                }
                BaselineCopy::DeviceToHost { src, dst } => {
                    sys::cuMemcpyDtoH_v2(dst as *mut c_void, src.addr(), src.len).result()
                }
                BaselineCopy::DeviceToDevice { src, dst } => {
                    sys::cuMemcpyDtoD_v2(dst.addr(), src.addr(), dst.len)
                        .result()
                        .and_then(|()| sys::cuCtxSynchronize().result())
                }
            }
        }
        .map_err(cuda_err("cudaMemcpy (baseline)"))
    }

    fn gds(&self) -> Result<(GdsMode, String)> {
        self.shared.bind()?;
        cufile::open()
    }

    fn gds_register(&self, file: Arc<std::fs::File>) -> Result<Box<dyn GdsFileBackend>> {
        self.gds()?;
        Ok(Box::new(CudaGdsFile {
            shared: self.shared.clone(),
            registration: cufile::Registration::new(file)?,
        }))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A file registered with cuFile, doing IO in this device's context.
struct CudaGdsFile {
    shared: Arc<Shared>,
    registration: cufile::Registration,
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

struct CudaStreamBackend {
    shared: Arc<Shared>,
    stream: Arc<CudaStream>,
    /// Idle events, reused: creating and destroying one per copy doubled the driver calls of
    /// the staging pipeline, whose lanes contend for the driver's context lock.
    events: Arc<EventPool>,
    /// Device memory for the row kernels' error reports (`REPORT_BYTES`), allocated on first use
    /// (cuMemFree synchronizes the device: not something to do per call).
    scratch: Mutex<Option<sys::CUdeviceptr>>,
    /// Device memory for sorting index lists (sorted gathers), kept at its largest size.
    order: Mutex<OrderScratch>,
}

/// A stream's row-kernel report words: one per piece of a row job.
const REPORT_BYTES: usize = super::rows::MAX_PIECES * 8;

/// Positions of the row kernels in `kernels::GATHER.functions`.
mod row_fn {
    /// `gpuio_gather_{16,8,4,1}`, by piece width slot.
    pub(super) const GATHER: usize = 0;
    /// `gpuio_scatter_{16,8,4,1}`.
    pub(super) const SCATTER: usize = 4;
    pub(super) const NAIVE: usize = 8;
    /// `gpuio_gather_ordered_{16,8,4,1}`.
    pub(super) const GATHER_ORDERED: usize = 9;
    pub(super) const ORDER_COUNT: usize = 13;
    pub(super) const ORDER_SCAN_BLOCKS: usize = 14;
    pub(super) const ORDER_SCAN_SUMS: usize = 15;
    pub(super) const ORDER_PLACE: usize = 16;
}

/// How a sorted gather orders its index list: a counting sort over buckets of `2^shift`
/// pool bytes. Buckets of at least 128 B (a read request's span: a finer order buys
/// nothing), about two per row, at most 2 Mi of them (8 MiB of counts).
struct Ordering {
    shift: u32,
    buckets: u32,
    /// Blocks of `gpuio_order_scan_blocks` (4096 counts each).
    scan_blocks: u32,
    count: usize,
    /// Scratch bytes: pairs (16 B per row), ranks (4 B per row), counts, block sums.
    bytes: usize,
}

/// Line slots per row for an ordered gather dealt out by pool line (gather.cu's
/// `gpuio_rows_by_line`): how many 128-byte lines a row of `row_bytes` can touch in a pool at
/// `pool`, or 0 to deal the pieces out densely, where that would idle more than half the
/// lanes (short rows, rows in narrow pieces: measured only for 16-byte pieces).
fn line_slots(pool: u64, row_bytes: u64, width: u64) -> u32 {
    if width != 16 || row_bytes == 0 {
        return 0;
    }
    // Rows start at pool + k * row_bytes: 128-byte offsets step by gcd(row_bytes, 128) from
    // the pool's own, so the furthest a row starts into a line is 128 - step + the pool's
    // offset within a step.
    let step = 1u64 << row_bytes.trailing_zeros().min(7);
    let furthest = 128 - step + (pool % 128) % step;
    let lines = (row_bytes + furthest).div_ceil(128);
    match u32::try_from(lines) {
        Ok(l) if lines * 128 <= 2 * row_bytes => l,
        _ => 0,
    }
}

/// Where an [`Ordering`]'s arrays lie in the sorting scratch.
struct OrderAt {
    pairs: u64,
    rank: u64,
    counts: u64,
    sums: u64,
}

impl Ordering {
    fn new(job: &RowJob<'_>) -> Self {
        const MAX_BUCKETS: u64 = 1 << 21;
        let pool = job.pool.len() as u64;
        let target = (2 * job.count as u64).clamp(1, MAX_BUCKETS);
        let mut shift = 7;
        while pool >> shift > target {
            shift += 1;
        }
        let buckets = pool.div_ceil(1 << shift).max(1);
        let scan_blocks = buckets.div_ceil(4096);
        Self {
            shift,
            buckets: buckets as u32,
            scan_blocks: scan_blocks as u32,
            count: job.count,
            bytes: job.count * 20 + (buckets + scan_blocks) as usize * 4,
        }
    }

    fn layout(&self, base: u64) -> OrderAt {
        let n = self.count as u64;
        let counts = base + n * 20;
        OrderAt {
            pairs: base,
            rank: base + n * 16,
            counts,
            sums: counts + u64::from(self.buckets) * 4,
        }
    }
}

/// A stream's sorting scratch: grown to the largest sorted gather so far, never shrunk (a
/// free synchronizes the device).
#[derive(Default)]
struct OrderScratch {
    mem: Option<(sys::CUdeviceptr, usize)>,
}

impl OrderScratch {
    /// At least `bytes` of scratch (its device address), reallocated if smaller.
    fn reserve(&mut self, shared: &Shared, bytes: usize) -> Result<u64> {
        if let Some((ptr, len)) = self.mem
            && len >= bytes
        {
            return Ok(ptr);
        }
        self.release(shared);
        let len = bytes.next_power_of_two();
        // SAFETY: a fresh allocation owned by this scratch, freed in `release`.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(cuda_err("cuMemAlloc"))?;
        self.mem = Some((ptr, len));
        Ok(ptr)
    }

    /// Frees the scratch (no work may use it any more: every user synchronized).
    fn release(&mut self, shared: &Shared) {
        if let Some((ptr, _)) = self.mem.take() {
            let freed = shared.bind().and_then(|()| {
                // SAFETY: allocated by cuMemAlloc in this context, freed once; the jobs that
                // used it synchronized before returning.
                unsafe { result::free_sync(ptr) }.map_err(cuda_err("cuMemFree"))
            });
            if let Err(e) = freed {
                tracing::error!(error = %e, "freeing a stream's sorting scratch failed");
            }
        }
    }
}

/// Waits for a stream's work on every path out of a scope (errors and panics included)
/// unless [`WaitOnDrop::wait`] already did.
struct WaitOnDrop<'a>(Option<&'a CudaStreamBackend>);

impl WaitOnDrop<'_> {
    /// Waits now, reporting an error the work ran into.
    fn wait(mut self) -> Result<()> {
        self.0.take().map_or(Ok(()), |s| s.synchronize())
    }
}

impl Drop for WaitOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.0.map(|s| s.synchronize()) {
            tracing::error!(error = %e, "waiting for a row kernel failed");
        }
    }
}

impl Drop for CudaStreamBackend {
    fn drop(&mut self) {
        // Work queued on this stream may still use its scratch: drain first.
        if let Err(e) = self.shared.bind() {
            tracing::error!(error = %e, "binding a stream's context to free its scratch failed");
            return;
        }
        let _ = self.stream.synchronize();
        self.order
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .release(&self.shared);
        let scratch = self
            .scratch
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(ptr) = scratch {
            // SAFETY: allocated by cuMemAlloc in this context, freed once, unused now.
            if let Err(e) = unsafe { result::free_sync(ptr) }.map_err(cuda_err("cuMemFree")) {
                tracing::error!(error = %e, "freeing a stream's scratch memory failed");
            }
        }
    }
}

/// Idle events of one stream, by timing capability.
#[derive(Default)]
struct EventPool {
    plain: Mutex<Vec<CudaEvent>>,
    timing: Mutex<Vec<CudaEvent>>,
}

impl EventPool {
    fn list(&self, timing: bool) -> &Mutex<Vec<CudaEvent>> {
        if timing { &self.timing } else { &self.plain }
    }
}

impl CudaStreamBackend {
    fn raw(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// The row kernels' report words (`REPORT_BYTES` of device memory), allocated on first use.
    fn report_scratch(&self) -> Result<sys::CUdeviceptr> {
        let mut s = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = *s {
            return Ok(p);
        }
        // SAFETY: a fresh allocation owned by this stream, freed in its Drop.
        let p = unsafe { result::malloc_sync(REPORT_BYTES) }.map_err(cuda_err("cuMemAlloc"))?;
        *s = Some(p);
        Ok(p)
    }
}

impl StreamBackend for CudaStreamBackend {
    unsafe fn copy_h2d(&self, src: *const u8, dst: DevRange<'_>) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: the caller keeps src readable and dst's allocation live until completion.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst.addr(), src.cast::<c_void>(), dst.len, self.raw()) }
            .result()
            .map_err(cuda_err("cuMemcpyHtoDAsync"))
    }

    unsafe fn copy_d2h(&self, src: DevRange<'_>, dst: *mut u8) -> Result<()> {
        self.shared.bind()?;
        // SAFETY: the caller keeps dst writable and untouched, and src's allocation live, until
        // completion.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src.addr(), src.len, self.raw()) }
            .result()
            .map_err(cuda_err("cuMemcpyDtoHAsync"))
    }

    unsafe fn copy_d2d(
        &self,
        src_dev: &dyn DeviceBackend,
        src: DevRange<'_>,
        dst_dev: &dyn DeviceBackend,
        dst: DevRange<'_>,
    ) -> Result<()> {
        self.shared.bind()?;
        let ctx_of = |d: &dyn DeviceBackend| {
            d.as_any()
                .downcast_ref::<CudaDevice>()
                .map(|d| d.shared.ctx.clone())
                .ok_or_else(|| HalError::InvalidArgument("peer is not a CUDA device".into()))
        };
        let (sctx, dctx) = (ctx_of(src_dev)?, ctx_of(dst_dev)?);
        if sctx.cu_ctx() == dctx.cu_ctx() {
            // SAFETY: both are live, non-overlapping ranges of this context (caller's contract).
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst.addr(), src.addr(), dst.len, self.raw()) }
                .result()
                .map_err(cuda_err("cuMemcpyDtoDAsync"))
        } else {
            // SAFETY: both are live ranges of their contexts (caller's contract).
            unsafe {
                sys::cuMemcpyPeerAsync(
                    dst.addr(),
                    dctx.cu_ctx(),
                    src.addr(),
                    sctx.cu_ctx(),
                    dst.len,
                    self.raw(),
                )
            }
            .result()
            .map_err(cuda_err("cuMemcpyPeerAsync"))
        }
    }

    fn fill_pattern(&self, dst: DevRange<'_>, first: u64, seed: u64) -> Result<()> {
        let kernels = self.shared.pattern()?;
        self.shared.bind()?;
        let (addr, len) = (dst.addr(), dst.len as u64);
        let words = (first + len).div_ceil(8) - first / 8;
        let cfg = self.shared.launch_config(words);
        let mut launch = self.stream.launch_builder(&kernels.fill);
        launch.arg(&addr).arg(&len).arg(&first).arg(&seed);
        // SAFETY: the argument list matches gpuio_fill_pattern(u8*, u64, u64, u64); dst is a
        // checked range of a live allocation, which the caller's borrow keeps alive until the
        // synchronize below; the kernel writes only inside it.
        unsafe { launch.launch(cfg) }.map_err(cuda_err("cuLaunchKernel(gpuio_fill_pattern)"))?;
        self.synchronize()
    }

    fn find_mismatch(&self, a: DevRange<'_>, b: DevRange<'_>) -> Result<Option<u64>> {
        let kernels = self.shared.pattern()?;
        self.shared.bind()?;
        // SAFETY: an 8-byte allocation owned by this function and freed below.
        let out = unsafe { result::malloc_sync(8) }.map_err(cuda_err("cuMemAlloc"))?;
        let run = || -> Result<u64> {
            // SAFETY: out is 8 live bytes of this context.
            unsafe { sys::cuMemsetD8Async(out, 0xff, 8, self.raw()) }
                .result()
                .map_err(cuda_err("cuMemsetD8Async"))?;
            let (pa, pb, len) = (a.addr(), b.addr(), a.len as u64);
            let cfg = self.shared.launch_config(len.div_ceil(16));
            let mut launch = self.stream.launch_builder(&kernels.mismatch);
            launch.arg(&pa).arg(&pb).arg(&len).arg(&out);
            // SAFETY: arguments match gpuio_find_mismatch(const u8*, const u8*, u64, u64*); the
            // ranges are checked and live for this call, which synchronizes before returning;
            // the kernel writes only *out.
            unsafe { launch.launch(cfg) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_find_mismatch)"))?;
            let mut first = [0u8; 8];
            // SAFETY: `first` is 8 writable bytes; we synchronize before reading it.
            unsafe { sys::cuMemcpyDtoHAsync_v2(first.as_mut_ptr().cast(), out, 8, self.raw()) }
                .result()
                .map_err(cuda_err("cuMemcpyDtoHAsync"))?;
            self.synchronize()?;
            Ok(u64::from_le_bytes(first))
        };
        let first = run();
        // A failed run may have left the kernel queued: drain before freeing its output.
        let _ = self.synchronize();
        // SAFETY: out was allocated above and no queued work uses it any more.
        if let Err(e) = unsafe { result::free_sync(out) } {
            tracing::error!(error = %cuda_err("cuMemFree")(e), "freeing compare scratch failed");
        }
        Ok(Some(first?).filter(|&i| i != u64::MAX))
    }

    unsafe fn rows(&self, job: RowJob<'_>, hooks: RowHooks<'_>) -> Result<RowsDone> {
        let kernels = self.shared.row_kernels()?;
        self.shared.bind()?;
        let pool = job.pool.addr();
        let (rows_addr, idx) = (job.rows.addr(), job.idx.addr());
        let rb = job.row_bytes as u64;
        // The widest piece that divides the row size and both base addresses.
        let (slot, width) = [(0, 16u64), (1, 8), (2, 4), (3, 1)]
            .into_iter()
            .find(|(_, w)| rb.is_multiple_of(*w) && pool.is_multiple_of(*w) && rows_addr % w == 0)
            .unwrap_or((3, 1));
        let func = match job.kernel {
            RowKernel::Naive => &kernels[row_fn::NAIVE],
            RowKernel::Sorted => &kernels[row_fn::GATHER_ORDERED + slot],
            RowKernel::Tuned if job.scatter => &kernels[row_fn::SCATTER + slot],
            RowKernel::Tuned => &kernels[row_fn::GATHER + slot],
        };
        // A sorted gather's rows are dealt out by pool line where that wastes at most half
        // the lanes (see gather.cu's gpuio_rows_by_line).
        let lines = match job.kernel {
            RowKernel::Sorted => line_slots(pool, rb, width),
            _ => 0,
        };
        let config = |rows: u64| {
            if job.kernel == RowKernel::Naive {
                self.shared.launch_config(rows * 32)
            } else if lines > 0 {
                // GPUIO_LINE_UNROLL (8) loads in flight per thread.
                let items = rows * u64::from(lines) * (128 / width);
                self.shared.launch_config(items.div_ceil(8))
            } else {
                // Each thread keeps GPUIO_UNROLL (4) loads in flight.
                self.shared.launch_config((rows * (rb / width)).div_ceil(4))
            }
        };
        let launches = job.pieces.len().clamp(1, super::rows::MAX_PIECES);
        // One report word per launch of the row kernel: the first out-of-range index
        // position within its piece (a sorted job's single launch reports positions in the
        // whole list).
        let ordering = (job.kernel == RowKernel::Sorted).then(|| Ordering::new(&job));
        let words = if ordering.is_some() { 1 } else { launches };
        let report = self.report_scratch()?;
        // Held for the call: the sorting scratch is this job's until it is done.
        let mut order_scratch = self.order.lock().unwrap_or_else(|e| e.into_inner());
        let order = match &ordering {
            Some(o) => Some(o.layout(order_scratch.reserve(&self.shared, o.bytes)?)),
            None => None,
        };
        let pool_rows = (job.pool.len() as u64) / rb;
        // SAFETY: `words` report words fit the report scratch of this stream.
        unsafe { sys::cuMemsetD8Async(report, 0xff, words * 8, self.raw()) }
            .result()
            .map_err(cuda_err("cuMemsetD8Async"))?;
        if let (Some(o), Some(at)) = (&ordering, &order) {
            // SAFETY: the bucket counts lie inside the reserved sorting scratch.
            unsafe { sys::cuMemsetD32Async(at.counts, 0, o.buckets as usize, self.raw()) }
                .result()
                .map_err(cuda_err("cuMemsetD32Async"))?;
        }
        let RowHooks { mut stage, timed } = hooks;
        // Events bracket the launches when the device's time is asked for.
        let start = timed.then(|| self.record(true)).transpose()?;
        // From the first launch on, kernels may be running: every way out (an error, a panic
        // in `stage`) waits for them before the borrows of the pool and buffers end.
        let running = WaitOnDrop(Some(self));
        for (k, piece) in job.pieces.iter().take(launches).enumerate() {
            if let Some(stage) = stage.as_mut() {
                stage(k);
            }
            // The last launch takes any pieces beyond MAX_PIECES (never made by rows.rs).
            let end = if k + 1 == launches {
                job.count
            } else {
                piece.end
            };
            let (start_row, n) = (piece.start as u64, (end - piece.start) as u64);
            if let (Some(src), RowMem::Device(dst)) = (job.idx_upload, job.idx) {
                let part = dst.part(piece.start * 8, (end - piece.start) * 8)?;
                // SAFETY: the staged indices are pinned host memory borrowed for the call
                // (which synchronizes before returning), this piece's part written by
                // `stage` already; `part` is a checked part of a live device range.
                unsafe { self.copy_h2d(src.wrapping_add(piece.start * 8), part)? };
            }
            let idx = idx + start_row * 8;
            if let (Some(o), Some(at)) = (&ordering, &order) {
                // A sorted job counts each piece's buckets as it arrives; the rows move once
                // the whole list is ordered, after the loop.
                let rank = at.rank + start_row * 4;
                let mut launch = self.stream.launch_builder(&kernels[row_fn::ORDER_COUNT]);
                launch.arg(&idx).arg(&n).arg(&pool_rows).arg(&rb);
                launch
                    .arg(&o.shift)
                    .arg(&o.buckets)
                    .arg(&at.counts)
                    .arg(&rank);
                // SAFETY: the arguments match gpuio_order_count(const u64*, u64, u64, u64,
                // u32, u32, u32*, u32*); it reads this piece of the checked device index
                // range and writes its ranks and the bucket counts, all inside the sorting
                // scratch reserved (and locked) for this call, which synchronizes before
                // returning.
                unsafe { launch.launch(self.shared.launch_config(n)) }
                    .map_err(cuda_err("cuLaunchKernel(gpuio_order_count)"))?;
                continue;
            }
            let dense = rows_addr + start_row * rb;
            let report = report + 8 * k as u64;
            // Gathers take (pool, .., dense); scatters (dense source, .., pool).
            let (first, last) = if job.scatter {
                (dense, pool)
            } else {
                (pool, dense)
            };
            let mut launch = self.stream.launch_builder(func);
            launch
                .arg(&first)
                .arg(&pool_rows)
                .arg(&rb)
                .arg(&idx)
                .arg(&n)
                .arg(&last)
                .arg(&report);
            // SAFETY: the arguments match every row kernel's (pool, rows, row_bytes, idx, n,
            // dense, err) signature. The kernel touches only pool rows below `pool_rows` (it
            // checks each index), this piece's part of the checked idx and dense ranges, and
            // its report word; the host pool is registered and valid until this call returns
            // (caller's contract), this piece's indices were written (`stage`) before the
            // launch, and we synchronize before returning.
            unsafe { launch.launch(config(n)) }
                .map_err(cuda_err("cuLaunchKernel(gpuio row kernel)"))?;
        }
        if let (Some(o), Some(at)) = (&ordering, &order) {
            let count = job.count as u64;
            let block = |blocks: u32| LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = self
                .stream
                .launch_builder(&kernels[row_fn::ORDER_SCAN_BLOCKS]);
            launch.arg(&at.counts).arg(&o.buckets).arg(&at.sums);
            // SAFETY: matches gpuio_order_scan_blocks(u32*, u32, u32*); one block per 4096
            // counts, all inside the reserved scratch, as are the `scan_blocks` sums.
            unsafe { launch.launch(block(o.scan_blocks)) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_order_scan_blocks)"))?;
            let mut launch = self
                .stream
                .launch_builder(&kernels[row_fn::ORDER_SCAN_SUMS]);
            launch.arg(&at.sums).arg(&o.scan_blocks);
            // SAFETY: matches gpuio_order_scan_sums(u32*, u32): the sums written just before.
            unsafe { launch.launch(block(1)) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_order_scan_sums)"))?;
            let mut launch = self.stream.launch_builder(&kernels[row_fn::ORDER_PLACE]);
            launch.arg(&idx).arg(&count).arg(&pool_rows).arg(&rb);
            launch
                .arg(&o.shift)
                .arg(&o.buckets)
                .arg(&at.counts)
                .arg(&at.sums);
            launch.arg(&at.rank).arg(&at.pairs);
            // SAFETY: matches gpuio_order_place(const u64*, u64, u64, u64, u32, u32, const
            // u32*, const u32*, const u32*, ulonglong2*): it reads the whole checked index
            // range and the scratch, and writes each of the `count` pairs once (a bucket's
            // start plus a rank below its count).
            unsafe { launch.launch(self.shared.launch_config(count)) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_order_place)"))?;
            let mut launch = self.stream.launch_builder(func);
            launch.arg(&pool).arg(&pool_rows).arg(&rb).arg(&at.pairs);
            launch.arg(&count).arg(&rows_addr).arg(&report).arg(&lines);
            // SAFETY: matches gpuio_gather_ordered_W(pool, rows, row_bytes, pairs, n, dense,
            // err, lines): it reads the pairs just placed, pool rows below `pool_rows`
            // (checked per pair; by line it reads only the pieces inside the row), writes each
            // pair's position of the checked dense range and report word 0; the pool stays
            // registered until this call returns, and we synchronize first.
            unsafe { launch.launch(config(count)) }
                .map_err(cuda_err("cuLaunchKernel(gpuio_gather_ordered)"))?;
        }
        let end = start.is_some().then(|| self.record(true)).transpose()?;
        // A copy into pageable memory returns only when it is done (so when the kernels
        // are): issue it after everything else is queued.
        let mut words_back = [0u8; REPORT_BYTES];
        // SAFETY: `words_back` holds `words * 8` writable bytes; we synchronize before reading.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                words_back.as_mut_ptr().cast(),
                report,
                words * 8,
                self.raw(),
            )
        }
        .result()
        .map_err(cuda_err("cuMemcpyDtoHAsync"))?;
        // This also reports an error a kernel ran into.
        running.wait()?;
        drop(order_scratch);
        let device_time = match (start, end) {
            (Some(start), Some(end)) => {
                let ms = end.elapsed_ms_since(start.as_ref())?;
                Some(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
            }
            _ => None,
        };
        let word = |k: usize| {
            let at = words_back[8 * k..8 * k + 8].try_into().unwrap_or([0xff; 8]);
            Some(u64::from_le_bytes(at)).filter(|&at| at != u64::MAX)
        };
        let bad_index = if ordering.is_some() {
            word(0)
        } else {
            (0..words).find_map(|k| {
                let start = job.pieces.get(k).map_or(0, |p| p.start as u64);
                word(k).map(|at| start + at)
            })
        };
        Ok(RowsDone {
            bad_index,
            device_time,
        })
    }

    unsafe fn ring_kernel(&self, launch: RingLaunch<'_>) -> Result<()> {
        let kernels = self.shared.ring_kernels()?;
        self.shared.bind()?;
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        match launch {
            RingLaunch::ReadBlocks {
                ring,
                resource,
                offsets,
                count,
                block,
                dst,
                results,
                threads,
            } => {
                const BLOCK: u32 = 128;
                let cfg = LaunchConfig {
                    grid_dim: (threads.div_ceil(BLOCK).max(1), 1, 1),
                    block_dim: (BLOCK, 1, 1),
                    shared_mem_bytes: 0,
                };
                let (o, d, r) = (offsets.addr(), dst.addr(), results.addr());
                let mut l = self.stream.launch_builder(&kernels[0]);
                l.arg(&ring.header).arg(&ring.slots).arg(&ring.claim);
                l.arg(&ring.mask).arg(&ring.nslots);
                l.arg(&ring.bounce).arg(&ring.bounce_bytes).arg(&resource);
                l.arg(&o).arg(&count).arg(&block).arg(&d).arg(&r);
                // SAFETY: the arguments match gpuio_ring_read_blocks; the kernel reads the
                // checked offsets range, writes the checked results range, and touches the
                // ring's memory, which stays mapped until this call returns (caller's
                // contract) because we synchronize below. dst is written by the host proxy,
                // not by the kernel.
                unsafe { l.launch(cfg) }
                    .map_err(cuda_err("cuLaunchKernel(gpuio_ring_read_blocks)"))?;
            }
            RingLaunch::Ping {
                ring,
                resource,
                iters,
                len,
                dst,
                ns,
            } => {
                let (d, n) = (dst.addr(), ns.addr());
                let mut l = self.stream.launch_builder(&kernels[1]);
                l.arg(&ring.header).arg(&ring.slots).arg(&ring.claim);
                l.arg(&ring.mask).arg(&ring.nslots);
                l.arg(&ring.bounce).arg(&ring.bounce_bytes).arg(&resource);
                l.arg(&iters).arg(&len).arg(&d).arg(&n);
                // SAFETY: as for ReadBlocks; the kernel writes only the checked ns range.
                unsafe { l.launch(one) }.map_err(cuda_err("cuLaunchKernel(gpuio_ring_ping)"))?;
            }
            RingLaunch::Layout { out } => {
                let o = out.addr();
                let mut l = self.stream.launch_builder(&kernels[2]);
                l.arg(&o);
                // SAFETY: the kernel writes RingLayout::words().len() u64s at `out`, a range
                // checked to hold them.
                unsafe { l.launch(one) }.map_err(cuda_err("cuLaunchKernel(gpuio_ring_layout)"))?;
            }
        }
        self.synchronize()
    }

    fn record(&self, timing: bool) -> Result<Box<dyn EventBackend>> {
        let pooled = self
            .events
            .list(timing)
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        let event = match pooled {
            Some(e) => e,
            None => {
                let flags = if timing {
                    sys::CUevent_flags::CU_EVENT_DEFAULT
                } else {
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
                };
                self.shared
                    .ctx
                    .new_event(Some(flags))
                    .map_err(cuda_err("cuEventCreate"))?
            }
        };
        event
            .record(&self.stream)
            .map_err(cuda_err("cuEventRecord"))?;
        Ok(Box::new(CudaEventBackend {
            event: Some(event),
            timing,
            pool: Arc::downgrade(&self.events),
        }))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))
    }
}

/// A recorded event; when dropped it goes back to its stream's pool (if the stream is still
/// there) instead of being destroyed.
struct CudaEventBackend {
    /// Always `Some` until dropped.
    event: Option<CudaEvent>,
    timing: bool,
    pool: Weak<EventPool>,
}

impl CudaEventBackend {
    fn event(&self) -> Result<&CudaEvent> {
        self.event
            .as_ref()
            .ok_or_else(|| HalError::InvalidArgument("event already released".into()))
    }
}

impl Drop for CudaEventBackend {
    fn drop(&mut self) {
        if let (Some(event), Some(pool)) = (self.event.take(), self.pool.upgrade()) {
            pool.list(self.timing)
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(event);
        }
    }
}

impl EventBackend for CudaEventBackend {
    fn synchronize(&self) -> Result<()> {
        self.event()?
            .synchronize()
            .map_err(cuda_err("cuEventSynchronize"))
    }

    fn is_complete(&self) -> Result<bool> {
        self.event()?
            .try_is_complete()
            .map_err(cuda_err("cuEventQuery"))
    }

    fn elapsed_ms_since(&self, start: &dyn EventBackend) -> Result<f32> {
        let start = start
            .as_any()
            .downcast_ref::<CudaEventBackend>()
            .ok_or_else(|| HalError::InvalidArgument("events of different backends".into()))?;
        start
            .event()?
            .elapsed_ms(self.event()?)
            .map_err(cuda_err("cuEventElapsedTime"))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::line_slots;

    #[test]
    fn line_slots_cover_every_line_a_row_can_touch() {
        // 656-byte rows start 16-byte steps into a line: up to 112 bytes in, 6 lines.
        assert_eq!(line_slots(0, 656, 16), 6);
        // 64-byte rows of an aligned pool never cross a line; 160-byte rows touch two.
        assert_eq!(line_slots(4096, 64, 16), 1);
        assert_eq!(line_slots(0, 160, 16), 2);
        // A pool 16 bytes into a line shifts 64-byte rows across line boundaries.
        assert_eq!(
            line_slots(16, 64, 16),
            0,
            "2 lines for 64 bytes idles over half"
        );
        assert_eq!(line_slots(16, 4096, 16), 33);
        assert_eq!(line_slots(0, 4096, 16), 32);
        // Short rows and narrow pieces keep the dense order.
        assert_eq!(line_slots(0, 16, 16), 0);
        assert_eq!(line_slots(0, 656, 8), 0);
        assert_eq!(line_slots(0, 0, 16), 0);
        // Brute force: the slots reach the last byte of every row of a few pools.
        for pool in [0u64, 16, 48, 112] {
            for rb in (16..2048).step_by(16) {
                let lines = u64::from(line_slots(pool, rb, 16));
                if lines == 0 {
                    continue;
                }
                for k in 0..256 {
                    let start = pool + k * rb;
                    assert!(
                        start + rb <= (start & !127) + lines * 128,
                        "{pool} {rb} {k}"
                    );
                }
            }
        }
    }
}
