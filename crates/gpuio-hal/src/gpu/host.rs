//! The host backend: always available. "Device memory" is host memory, copies are memcpy done
//! at enqueue time (so every event is already complete), and device functions run as Rust.
//! It runs gpuio's logic for real on machines without a GPU (CI); it simulates no PCIe.

use super::GdsMode;
use super::backend::{
    BaselineCopy, DevRange, DeviceBackend, DeviceMemory, EventBackend, GdsFileBackend, HostPin,
    Owner, RowHooks, RowJob, RowMem, RowsDone, StreamBackend, StreamTarget,
};
use super::info::{Backend, Capability, DeviceInfo, cxl_capability};
use crate::error::{HalError, Result};
use crate::kernels::{KernelLoad, KernelOrigin, KernelPath, KernelSource};
use crate::memory::{HostAllocOptions, HostBuffer};
use crate::sync::RwLockExt;
use crate::sys;
use std::any::Any;
use std::fs::File;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

#[derive(Debug)]
pub(crate) struct HostDevice {
    info: DeviceInfo,
}

impl HostDevice {
    pub(crate) fn new(ordinal: u32) -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        let total_memory = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with("MemTotal:"))?.to_owned();
                line.split_whitespace().nth(1)?.parse::<u64>().ok()
            })
            .map_or(0, |kb| kb * 1024);
        Self {
            info: DeviceInfo {
                ordinal,
                backend: Backend::Host,
                vendor: "host".into(),
                name: "host memory (no GPU)".into(),
                total_memory,
                compute_capability: None,
                multiprocessors: threads,
                copy_engines: 0,
                pci_bus_id: None,
                numa_node: None,
                pcie: None,
                driver_version: None,
                can_map_host_memory: true,
                gds: Capability::no("host backend: no GPU to DMA into"),
                gdr: Capability::no("host backend: no GPU to DMA into"),
                cxl: cxl_capability(true),
                page_cache_dma: Capability::no(HOST_NO_PAGE_CACHE_DMA),
                dma_buf: Capability::no("the host backend's memory is no device's to export"),
            },
        }
    }
}

const HOST_NO_PAGE_CACHE_DMA: &str = "the host backend has no copy engine: its copies run on \
    the CPU, which a file shrinking under the mapping would fault";

/// Host memory standing in for device memory. Device buffers are shared handles that several
/// threads may use at once, so every operation locks the allocations it touches (readers
/// share, a writer excludes): no two threads ever touch the same bytes unsynchronised, and a
/// slice over device memory exists only while its lock is held.
#[derive(Debug)]
struct HostDeviceMemory {
    buf: HostBuffer,
    lock: RwLock<()>,
    /// Unique among this process's allocations, like the CUDA driver's buffer ids.
    id: u64,
}

impl DeviceMemory for HostDeviceMemory {
    fn addr(&self) -> u64 {
        self.buf.as_slice().as_ptr() as u64
    }

    fn allocation(&self) -> Result<crate::gpu::Allocation> {
        Ok(crate::gpu::Allocation {
            base: self.addr(),
            len: self.buf.len(),
            id: self.id,
        })
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn memory<'a>(r: &DevRange<'a>) -> Result<&'a HostDeviceMemory> {
    r.mem
        .as_any()
        .downcast_ref::<HostDeviceMemory>()
        .ok_or_else(|| HalError::InvalidArgument("not host-backend device memory".into()))
}

fn read_lock(m: &HostDeviceMemory) -> RwLockReadGuard<'_, ()> {
    // The lock guards no data of its own; a panic while it was held leaves nothing to repair.
    m.lock.read_unpoisoned()
}

fn write_lock(m: &HostDeviceMemory) -> RwLockWriteGuard<'_, ()> {
    m.lock.write_unpoisoned()
}

/// Runs `f` with `src` readable and `dst` writable: one exclusive lock when they share an
/// allocation, otherwise both locks taken in address order (so that two copies in opposite
/// directions cannot deadlock).
fn with_pair<T>(src: &DevRange<'_>, dst: &DevRange<'_>, f: impl FnOnce() -> T) -> Result<T> {
    let (s, d) = (memory(src)?, memory(dst)?);
    if src.same_allocation(dst) {
        let _w = write_lock(d);
        return Ok(f());
    }
    if s.addr() < d.addr() {
        let _r = read_lock(s);
        let _w = write_lock(d);
        Ok(f())
    } else {
        let _w = write_lock(d);
        let _r = read_lock(s);
        Ok(f())
    }
}

#[derive(Debug)]
struct NoPin;

impl HostPin for NoPin {}

impl DeviceBackend for HostDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn alloc(&self, len: usize) -> Result<Box<dyn DeviceMemory>> {
        let opts = HostAllocOptions {
            populate: false,
            ..HostAllocOptions::default()
        };
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Ok(Box::new(HostDeviceMemory {
            buf: HostBuffer::alloc(len, &opts)?,
            lock: RwLock::new(()),
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }))
    }

    fn new_stream(&self) -> Result<Box<dyn StreamBackend>> {
        Ok(Box::new(HostStream))
    }

    unsafe fn pin(&self, _ptr: *mut u8, _len: usize) -> Result<Box<dyn HostPin>> {
        // Host memory is already where "device" memory is; there is nothing to lock.
        Ok(Box::new(NoPin))
    }

    fn synchronize(&self) -> Result<()> {
        // Every host-backend operation is done when it returns.
        Ok(())
    }

    unsafe fn synchronize_foreign(&self, _stream: u64) -> Result<()> {
        // No other library queues work on a host device.
        Ok(())
    }

    fn borrow(&self, _addr: u64, _len: usize, _owner: Owner) -> Result<Box<dyn DeviceMemory>> {
        Err(HalError::Unsupported {
            what: "device memory allocated outside gpuio",
            reason: "the host backend has no GPU whose memory another library could own".into(),
        })
    }

    fn borrow_held(
        &self,
        _addr: u64,
        _len: usize,
        _owner: Owner,
    ) -> Result<Option<Box<dyn DeviceMemory>>> {
        Ok(None)
    }

    unsafe fn pin_read_only(&self, _ptr: *mut u8, _len: usize) -> Result<Box<dyn HostPin>> {
        Err(HalError::Unsupported {
            what: "registering a file mapping for DMA",
            reason: HOST_NO_PAGE_CACHE_DMA.into(),
        })
    }

    unsafe fn pin_io(&self, _ptr: *mut u8, _len: usize) -> Result<Box<dyn HostPin>> {
        Err(HalError::Unsupported {
            what: "registering device memory (a BAR) for kernels",
            reason: "the host backend runs no kernels on a device".into(),
        })
    }

    unsafe fn mapped_addr(&self, ptr: *mut u8) -> Result<u64> {
        // The host backend's "kernels" run on the CPU, in this address space.
        Ok(ptr as u64)
    }

    fn is_pinned(&self, _ptr: *const u8, _len: usize) -> bool {
        false
    }

    fn can_access_peer(&self, other: &dyn DeviceBackend) -> bool {
        other.as_any().is::<HostDevice>()
    }

    fn kernels_reach(&self, other: &dyn DeviceBackend, _addr: u64) -> bool {
        self.can_access_peer(other)
    }

    unsafe fn baseline_copy(&self, copy: BaselineCopy<'_>) -> Result<()> {
        let stream = HostStream;
        // SAFETY: forwarded from the caller's contract on the host pointer; the device ranges
        // were checked by the public types.
        unsafe {
            match copy {
                BaselineCopy::HostToDevice { src, dst } => stream.copy_h2d(src, dst),
                BaselineCopy::DeviceToHost { src, dst } => stream.copy_d2h(src, dst),
                BaselineCopy::DeviceToDevice { src, dst } => stream.copy_d2d(self, src, self, dst),
            }
        }
    }

    fn load_kernels(&self, _src: &'static KernelSource) -> Result<KernelOrigin> {
        Err(no_modules())
    }

    fn time_kernel_load(&self, _src: &KernelSource, _path: KernelPath) -> Result<KernelLoad> {
        Err(no_modules())
    }

    fn gds(&self) -> Result<(GdsMode, String)> {
        Err(no_gds())
    }

    fn export_dmabuf(&self, _addr: u64, _len: usize) -> Result<std::os::fd::OwnedFd> {
        Err(HalError::Unsupported {
            what: "dma-buf export of device memory",
            reason: self.info.dma_buf.detail.clone(),
        })
    }

    fn gds_register(&self, _file: Arc<File>) -> Result<Box<dyn GdsFileBackend>> {
        Err(no_gds())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn no_modules() -> HalError {
    HalError::Unsupported {
        what: "kernel modules",
        reason: "the host backend runs its kernels as Rust".into(),
    }
}

fn no_gds() -> HalError {
    HalError::Unsupported {
        what: "GPUDirect Storage (cuFile)",
        reason: "the host backend has no GPU memory for cuFile to reach".into(),
    }
}

struct HostStream;

impl StreamBackend for HostStream {
    fn target(&self) -> StreamTarget<'_> {
        StreamTarget::Host
    }

    unsafe fn copy_h2d(&self, src: *const u8, dst: DevRange<'_>) -> Result<()> {
        let _w = write_lock(memory(&dst)?);
        // SAFETY: src is readable for dst.len bytes (caller's contract); dst is a checked range
        // of a live allocation that we hold exclusively; a separate mapping, so no overlap.
        unsafe { sys::copy_raw(src, dst.addr() as *mut u8, dst.len) };
        Ok(())
    }

    unsafe fn copy_d2h(&self, src: DevRange<'_>, dst: *mut u8) -> Result<()> {
        let _r = read_lock(memory(&src)?);
        // SAFETY: as for copy_h2d, with the source allocation locked for reading.
        unsafe { sys::copy_raw(src.addr() as *const u8, dst, src.len) };
        Ok(())
    }

    unsafe fn copy_d2d(
        &self,
        _src_dev: &dyn DeviceBackend,
        src: DevRange<'_>,
        _dst_dev: &dyn DeviceBackend,
        dst: DevRange<'_>,
    ) -> Result<()> {
        with_pair(&src, &dst, || {
            // SAFETY: both are checked ranges of live allocations, locked by with_pair; ranges
            // of one allocation never overlap (checked by the public types).
            unsafe { sys::copy_raw(src.addr() as *const u8, dst.addr() as *mut u8, dst.len) }
        })
    }

    fn record(&self, _timing: bool) -> Result<Box<dyn EventBackend>> {
        Ok(Box::new(HostEvent { at: Instant::now() }))
    }

    fn wait_for(&self, event: &dyn EventBackend) -> Result<()> {
        // Work here is done when its call returns: the event's work is done already.
        match event.as_any().downcast_ref::<HostEvent>() {
            Some(_) => Ok(()),
            None => Err(HalError::InvalidArgument(
                "a stream waits for an event of another backend".into(),
            )),
        }
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

impl HostStream {
    /// Runs a row job on the CPU.
    ///
    /// # Safety
    /// As for `StreamBackend::rows`.
    unsafe fn rows_now<'a>(&self, job: RowJob<'a>) -> Result<Option<u64>> {
        if let (Some(src), RowMem::Device(idx)) = (job.idx_upload, job.idx) {
            // SAFETY: the staged indices are borrowed by the caller for the call and hold at
            // least the checked range's length.
            unsafe { self.copy_h2d(src, idx)? };
        }
        // Lock every allocation involved once, in address order, exclusively where written.
        let mut mems = vec![(memory(&job.rows)?, !job.scatter)];
        let mut cpu_ptr = |m: RowMem<'a>, write: bool| -> Result<*mut u8> {
            Ok(match m {
                RowMem::Host { ptr, .. } => ptr,
                RowMem::Device(r) => {
                    mems.push((memory(&r)?, write));
                    r.addr() as *mut u8
                }
            })
        };
        let pool = cpu_ptr(job.pool, job.scatter)?;
        let idx_ptr = cpu_ptr(job.idx, false)?;
        if let Some(h) = job.hot {
            mems.push((memory(&h.rows)?, false));
            mems.push((memory(&h.index)?, false));
        }
        let _guards = lock_all(mems);
        let hot = job.hot.map(|h| {
            // SAFETY: the index range starts its allocation (page-aligned host memory, so the
            // u64s are aligned) and is locked for reading above until we return.
            let words = unsafe {
                std::slice::from_raw_parts(h.index.addr() as *const u64, h.index.len / 8)
            };
            (h, words)
        });
        let rb = job.row_bytes;
        let rows = (job.pool.len() / rb) as u64;
        // SAFETY: a checked range of a live allocation locked for reading above, or pinned host
        // memory valid for the call (caller's contract).
        let idx = unsafe { std::slice::from_raw_parts(idx_ptr as *const u8, job.idx.len()) };
        let dense = job.rows.addr() as *mut u8;
        let mut bad = None;
        for (i, word) in idx.chunks_exact(8).take(job.count).enumerate() {
            let row = u64::from_le_bytes(word.try_into().unwrap_or_default());
            if row >= rows {
                bad = bad.or(Some(i as u64));
                continue;
            }
            // A kept row is read from its copy, as the hot gather kernel reads it.
            let kept = hot.and_then(|(h, words)| {
                let slot = super::hot_rows::hot_slot(words, h.probes, h.hot_rows, row)?;
                Some((h.rows.addr() as *mut u8).wrapping_add(slot as usize * rb))
            });
            let (p, d) = (
                kept.unwrap_or_else(|| pool.wrapping_add(row as usize * rb)),
                dense.wrapping_add(i * rb),
            );
            // SAFETY: row < rows keeps p..p+rb inside the pool, or slot < hot_rows inside the
            // checked kept rows; i < count keeps d..d+rb inside the checked dense range; all
            // are locked (or, for a host pool, valid and, for a scatter, exclusive by the
            // caller's contract) and in different allocations.
            unsafe {
                if job.scatter {
                    sys::copy_raw(d, p, rb);
                } else {
                    sys::copy_raw(p, d, rb);
                }
            }
        }
        Ok(bad)
    }
}

/// Runs a row job on the CPU, with its hooks: the host side of `rows::RowsOp`.
///
/// # Safety
/// A host pool (and a host index list) is valid for its length until the call returns
/// (writable, and touched by nothing else, for a scatter).
pub(crate) unsafe fn run_rows(job: RowJob<'_>, hooks: RowHooks<'_>) -> Result<RowsDone> {
    // Every piece's indices are written before the rows move: this thread does both.
    if let Some(stage) = hooks.stage {
        (0..job.pieces.len()).for_each(stage);
    }
    let t = Instant::now();
    // SAFETY: forwarded from the caller's contract.
    let bad = unsafe { HostStream.rows_now(job) };
    Ok(RowsDone {
        bad_index: bad?,
        device_time: hooks.timed.then(|| t.elapsed()),
    })
}

/// Runs hot gathers of several pools on the CPU, one after another, after the staged list's
/// copy: the host side of `hot_jobs::HotJobsOp`. The first bad index is reported at its
/// position in the whole list.
///
/// # Safety
/// The host pools, a host index list and the upload's source are valid for their lengths
/// until the call returns.
pub(crate) unsafe fn run_hot_jobs(
    jobs: &[RowJob<'_>],
    upload: Option<super::hot_jobs::Upload<'_>>,
    timed: bool,
) -> Result<RowsDone> {
    let t = Instant::now();
    if let Some(u) = upload {
        // SAFETY: the caller keeps the source readable for the range's length.
        unsafe { HostStream.copy_h2d(u.from, u.to)? };
    }
    let mut bad_index = None;
    let mut start = 0u64;
    for &job in jobs {
        // SAFETY: forwarded from the caller's contract.
        let bad = unsafe { HostStream.rows_now(job) }?;
        bad_index = bad_index.or(bad.map(|at| start + at));
        start += job.count as u64;
    }
    Ok(RowsDone {
        bad_index,
        device_time: timed.then(|| t.elapsed()),
    })
}

/// Locks the allocations of checked ranges (`true`: written) for an op's host side
/// (`HostRun::lock`).
pub(crate) fn lock_ranges<'a>(
    uses: impl Iterator<Item = (DevRange<'a>, bool)>,
) -> Result<Vec<HeldLock<'a>>> {
    let mems = uses
        .map(|(r, write)| Ok((memory(&r)?, write)))
        .collect::<Result<Vec<_>>>()?;
    Ok(lock_all(mems))
}

/// Locks every allocation once, in address order, exclusively where any use writes it.
fn lock_all(mut mems: Vec<(&HostDeviceMemory, bool)>) -> Vec<HeldLock<'_>> {
    mems.sort_by_key(|(m, _)| m.addr());
    mems.dedup_by(|next, kept| {
        let same = std::ptr::eq(next.0, kept.0);
        kept.1 |= same && next.1;
        same
    });
    mems.iter()
        .map(|&(m, write)| {
            if write {
                HeldLock::Write(write_lock(m))
            } else {
                HeldLock::Read(read_lock(m))
            }
        })
        .collect()
}

/// A lock `lock_all` holds.
pub(crate) enum HeldLock<'a> {
    Read(#[allow(dead_code)] RwLockReadGuard<'a, ()>),
    Write(#[allow(dead_code)] RwLockWriteGuard<'a, ()>),
}

struct HostEvent {
    at: Instant,
}

impl EventBackend for HostEvent {
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn is_complete(&self) -> Result<bool> {
        Ok(true)
    }

    fn elapsed_ms_since(&self, start: &dyn EventBackend) -> Result<f32> {
        let start = start
            .as_any()
            .downcast_ref::<HostEvent>()
            .ok_or_else(|| HalError::InvalidArgument("events of different backends".into()))?;
        Ok(self.at.duration_since(start.at).as_secs_f32() * 1e3)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
