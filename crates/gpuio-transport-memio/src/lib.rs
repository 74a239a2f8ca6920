#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod gather;
mod pipeline;
mod placement;

pub use gather::{
    GatherIndices, GatherOptions, GatherPlan, GatherReport, GatherStrategy, HotLookup, IndexPlace,
};
pub use placement::HostPlacement;

use gpuio_hal::sync::{MutexExt, StripedCounter};
use gpuio_hal::workers::{WorkerPanic, run_workers};
use gpuio_hal::{
    Backend, DeviceBuffer, ErrorCode, Gpu, HalError, HostBuffer, NumaTopology, Stream,
};
use gpuio_staging::{PoolConfig, StagingPool, auto_limit};
use pipeline::LanePool;
use rayon::prelude::*;
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};

/// MemIO's errors.
#[derive(Debug, thiserror::Error)]
pub enum MemIoError {
    /// The HAL failed (driver error, bad range, allocation failure, ...).
    #[error(transparent)]
    Hal(#[from] HalError),
    /// A CXL expander that is not there.
    #[error("CXL memory device {device} not found ({found} CPU-less NUMA node(s) on this machine)")]
    NoCxlDevice {
        /// The device asked for.
        device: u32,
        /// How many memory-only NUMA nodes exist.
        found: usize,
    },
    /// Source and destination lengths differ.
    #[error("copy source has {src} bytes but its destination has {dst}")]
    LengthMismatch {
        /// Source length.
        src: usize,
        /// Destination length.
        dst: usize,
    },
    /// A GPU this engine was not built with.
    #[error("{0} is not one of this MemIO engine's devices")]
    UnknownGpu(String),
    /// A broken internal invariant (reported, never a panic).
    #[error("internal MemIO error: {0}")]
    Internal(String),
}

impl MemIoError {
    /// This error's code (docs/REFERENCE.md#error-codes).
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Hal(e) => e.code(),
            Self::NoCxlDevice { .. } => ErrorCode::NotFound,
            Self::LengthMismatch { .. } | Self::UnknownGpu(_) => ErrorCode::InvalidArg,
            Self::Internal(_) => ErrorCode::General,
        }
    }
}

impl From<WorkerPanic> for MemIoError {
    fn from(p: WorkerPanic) -> Self {
        Self::Internal(p.to_string())
    }
}

/// MemIO's result type.
pub type Result<T, E = MemIoError> = std::result::Result<T, E>;

/// How a copy is carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Pinned host memory and the device: a single DMA.
    DirectDma,
    /// Pageable host memory through `lanes` lanes of pinned `chunk`-byte staging buffers.
    StagedPipeline {
        /// Parallel lanes.
        lanes: usize,
        /// Bytes per staging chunk.
        chunk: usize,
    },
    /// Small pageable copies: the driver's own staging is fastest.
    DriverStaged,
    /// Within one device.
    DeviceCopy,
    /// Between two devices; `direct` when peer access is enabled, else staged by the driver.
    PeerCopy {
        /// Direct peer-to-peer.
        direct: bool,
    },
    /// CPU copies on `threads` threads (host to host, and everything on the host backend).
    HostCopy {
        /// Threads used.
        threads: usize,
    },
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DirectDma => write!(f, "direct DMA (pinned memory)"),
            Self::StagedPipeline { lanes, chunk } => write!(
                f,
                "staged pipeline ({lanes} lanes x {} KiB pinned chunks)",
                chunk >> 10
            ),
            Self::DriverStaged => write!(f, "driver-staged copy (small pageable)"),
            Self::DeviceCopy => write!(f, "device copy"),
            Self::PeerCopy { direct: true } => write!(f, "peer-to-peer copy"),
            Self::PeerCopy { direct: false } => write!(f, "peer copy staged by the driver"),
            Self::HostCopy { threads } => write!(f, "CPU copy on {threads} thread(s)"),
        }
    }
}

/// Most copy threads (and lanes) an engine starts.
pub const MAX_THREADS: usize = 256;
/// Largest staging chunk.
pub const MAX_CHUNK: usize = 1 << 30;

/// Tuning of the MemIO engine (clamped to sane bounds by [`MemIo::new`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemIoConfig {
    /// Bytes per pinned staging buffer: the largest chunk a transfer uses. Transfers too small
    /// to give every lane several chunks use smaller ones (see [`MemIo::chunk_for`]).
    pub chunk_size: usize,
    /// Threads (and pipeline lanes per transfer).
    pub threads: usize,
    /// Staging buffers per lane (at least 2, so a CPU copy overlaps a DMA).
    pub slots_per_lane: usize,
    /// Pageable copies smaller than this go through the driver's staging.
    pub pipeline_min: usize,
    /// Host copies smaller than this run on one thread.
    pub parallel_copy_min: usize,
    /// Threads (and staging lanes) of a CPU-staged gather: random row reads are bound by
    /// memory latency, so every core helps.
    pub gather_threads: usize,
    /// Serve small zero-copy gathers (host index lists of up to
    /// [`RESIDENT_MAX_ROWS`](gpuio_hal::RESIDENT_MAX_ROWS) rows) by a block resident on each
    /// GPU ([`Gpu::resident_rows`](gpuio_hal::Gpu::resident_rows)), which leaves after this
    /// long without one. `None`: every gather launches its kernels.
    pub resident_linger: Option<std::time::Duration>,
}

impl MemIoConfig {
    /// The pinned staging one pipeline lane holds: its staging buffers, each of the staging
    /// pool's class for [`chunk_size`](Self::chunk_size) (as [`MemIo::new`] clamps them);
    /// `None` where the chunk is above the pool's largest class. A staging pool must hold at
    /// least this much.
    pub fn lane_staging_bytes(&self, pool: &PoolConfig) -> Option<u64> {
        let chunk = self.chunk_size.clamp(4096, MAX_CHUNK);
        let class = pool.class_size(chunk)? as u64;
        Some(self.slots_per_lane.clamp(2, 64) as u64 * class)
    }
}

impl Default for MemIoConfig {
    fn default() -> Self {
        let cores = gpuio_hal::sys::cpu_count();
        Self {
            chunk_size: 4 << 20,
            threads: cores.clamp(1, 8),
            slots_per_lane: 3,
            pipeline_min: 4 << 20,
            parallel_copy_min: 4 << 20,
            gather_threads: cores,
            resident_linger: None,
        }
    }
}

/// Bytes moved, by kind (the `gpuio_memio_engine_t` statistics; docs/REFERENCE.md#memio).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemIoStats {
    /// Host to device.
    pub host_to_device: u64,
    /// Device to host.
    pub device_to_host: u64,
    /// Device to device (same or peer).
    pub device_to_device: u64,
    /// Host to host.
    pub host_to_host: u64,
    /// Of the above, bytes that went through the staging pipeline.
    pub staged: u64,
}

/// Bytes moved, by direction: added on every copy by whichever thread runs it, so striped.
#[derive(Default)]
struct Counters {
    h2d: StripedCounter,
    d2h: StripedCounter,
    d2d: StripedCounter,
    h2h: StripedCounter,
    staged: StripedCounter,
}

/// Per-device state: pooled streams and staging lanes.
struct DeviceState {
    gpu: Gpu,
    streams: Mutex<Vec<Stream>>,
    /// Registered with the staging pool as a holder of idle buffers.
    lanes: Arc<LanePool>,
    /// Pinned and device buffers for gather index lists, reused across calls.
    index_stages: Mutex<Vec<gather::IndexStage>>,
    /// The resident row server, made on its first call where configured.
    resident: OnceLock<gpuio_hal::ResidentRows>,
}

/// The MemIO engine. Thread-safe; share it behind an `Arc`.
pub struct MemIo {
    devices: Vec<DeviceState>,
    config: MemIoConfig,
    pool: rayon::ThreadPool,
    staging: StagingPool,
    topology: NumaTopology,
    counters: Counters,
    /// Which gather path is faster, per shape, as measured.
    planner: gather::Planner,
    /// The CPU-staged gather's threads, started on first use.
    gather_pool: OnceLock<std::result::Result<rayon::ThreadPool, String>>,
}

impl fmt::Debug for MemIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemIo")
            .field(
                "gpus",
                &self.devices.iter().map(|d| &d.gpu).collect::<Vec<_>>(),
            )
            .field("config", &self.config)
            .finish()
    }
}

impl MemIo {
    /// An engine over `gpus` (from [`gpuio_hal::probe`]) with a staging pool of its own, sized
    /// automatically ([`auto_limit`]); [`with_pool`](Self::with_pool) shares one.
    pub fn new(gpus: Vec<Gpu>, config: MemIoConfig) -> Result<Self> {
        let defaults = PoolConfig::default();
        let staging = StagingPool::new(PoolConfig {
            limit: auto_limit(),
            max_class: config
                .chunk_size
                .clamp(4096, MAX_CHUNK)
                .next_power_of_two()
                .max(defaults.max_class),
            gpu: gpus.first().cloned(),
            ..defaults
        })?;
        Self::with_pool(gpus, config, staging)
    }

    /// An engine over `gpus` whose pipeline lanes take their pinned staging buffers from
    /// `staging` (shared with LocalIO in a session). Its largest class must take a staging
    /// chunk, and its limit at least one lane
    /// ([`MemIoConfig::lane_staging_bytes`]); else transfers fail with the pool's error.
    pub fn with_pool(gpus: Vec<Gpu>, config: MemIoConfig, staging: StagingPool) -> Result<Self> {
        let config = MemIoConfig {
            threads: config.threads.clamp(1, MAX_THREADS),
            gather_threads: config.gather_threads.clamp(1, MAX_THREADS),
            chunk_size: config.chunk_size.clamp(4096, MAX_CHUNK),
            slots_per_lane: config.slots_per_lane.clamp(2, 64),
            ..config
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(config.threads)
            .thread_name(|i| format!("gpuio-memio-{i}"))
            .build()
            .map_err(|e| MemIoError::Internal(format!("starting copy threads: {e}")))?;
        let devices = gpus
            .into_iter()
            .map(|gpu| {
                let lanes = pipeline::lane_pool(
                    gpu.clone(),
                    config.chunk_size,
                    config.slots_per_lane,
                    staging.clone(),
                );
                DeviceState {
                    lanes,
                    gpu,
                    streams: Mutex::new(Vec::new()),
                    index_stages: Mutex::new(Vec::new()),
                    resident: OnceLock::new(),
                }
            })
            .collect();
        Ok(Self {
            devices,
            config,
            pool,
            staging,
            topology: NumaTopology::detect(),
            counters: Counters::default(),
            planner: gather::Planner::default(),
            gather_pool: OnceLock::new(),
        })
    }

    /// The devices this engine copies to and from.
    pub fn gpus(&self) -> impl Iterator<Item = &Gpu> {
        self.devices.iter().map(|d| &d.gpu)
    }

    /// The GPU with this ordinal.
    pub fn gpu(&self, ordinal: u32) -> Result<&Gpu> {
        self.devices
            .get(ordinal as usize)
            .map(|d| &d.gpu)
            .ok_or_else(|| MemIoError::UnknownGpu(format!("gpu{ordinal}")))
    }

    /// The engine's configuration.
    pub fn config(&self) -> &MemIoConfig {
        &self.config
    }

    /// The host's NUMA topology as seen at start.
    pub fn topology(&self) -> &NumaTopology {
        &self.topology
    }

    /// Bytes moved so far.
    pub fn stats(&self) -> MemIoStats {
        let c = &self.counters;
        MemIoStats {
            host_to_device: c.h2d.get(),
            device_to_host: c.d2h.get(),
            device_to_device: c.d2d.get(),
            host_to_host: c.h2h.get(),
            staged: c.staged.get(),
        }
    }

    /// The pool the pipeline lanes take their pinned staging buffers from.
    pub fn staging_pool(&self) -> &StagingPool {
        &self.staging
    }

    /// Pinned staging memory currently held by idle pipeline lanes.
    pub fn staging_bytes(&self) -> usize {
        let bytes: u64 = self.devices.iter().map(|d| d.lanes.staged_bytes()).sum();
        bytes as usize
    }

    /// Allocates host memory on a tier, pinned for DMA when `pinned` (registered with the
    /// first device; pinned memory is portable across devices).
    pub fn alloc_host(
        &self,
        placement: HostPlacement,
        len: usize,
        pinned: bool,
    ) -> Result<HostBuffer> {
        let opts = placement.resolve(&self.topology)?;
        let mut buf = HostBuffer::alloc(len, &opts)?;
        if pinned && let Some(d) = self.devices.first() {
            buf.pin(&d.gpu)?;
        }
        Ok(buf)
    }

    /// What `gpu`'s resident row server has done, once one serves this engine's gathers
    /// ([`MemIoConfig::resident_linger`]).
    pub fn resident_stats(&self, gpu: &Gpu) -> Option<gpuio_hal::ResidentStats> {
        let server = self.device(gpu).ok()?.resident.get()?;
        Some(server.stats())
    }

    fn device(&self, gpu: &Gpu) -> Result<&DeviceState> {
        self.devices
            .get(gpu.ordinal() as usize)
            .filter(|d| d.gpu.same_device(gpu))
            .ok_or_else(|| MemIoError::UnknownGpu(gpu.to_string()))
    }

    fn with_stream<T>(&self, gpu: &Gpu, f: impl FnOnce(&Stream) -> Result<T>) -> Result<T> {
        let dev = self.device(gpu)?;
        let stream = match dev.streams.lock_unpoisoned().pop() {
            Some(s) => s,
            None => dev.gpu.stream()?,
        };
        let out = f(&stream);
        dev.streams.lock_unpoisoned().push(stream);
        out
    }

    /// The route a copy between host memory `host` and device `gpu` takes.
    pub fn route_host_device(&self, gpu: &Gpu, host: &[u8]) -> Route {
        if gpu.backend() == Backend::Host {
            // Host-backend device memory is locked per buffer: one copy, one thread.
            Route::HostCopy { threads: 1 }
        } else if gpu.is_pinned(host) {
            Route::DirectDma
        } else if host.len() < self.config.pipeline_min {
            Route::DriverStaged
        } else {
            let schedule = self.schedule_for(host.len());
            Route::StagedPipeline {
                lanes: schedule.count(host.len()).min(self.config.threads),
                chunk: self.chunk_for(host.len()),
            }
        }
    }

    /// The chunk schedule of a pipelined transfer of `len` bytes: one small chunk per lane at
    /// each end (at most 512 KiB), and between them chunks of `len / (4 * lanes)`, from 1 MiB up
    /// to the staging buffer size.
    fn schedule_for(&self, len: usize) -> pipeline::Schedule {
        const STEP: usize = 64 << 10;
        let max = self.config.chunk_size;
        let small = (512 << 10).min(max);
        let large = len
            .div_ceil(self.config.threads * 4)
            .saturating_add(STEP - 1)
            / STEP
            * STEP;
        let large = large.clamp((1 << 20).min(max), max);
        pipeline::Schedule {
            small,
            large,
            ramp: self.config.threads,
        }
    }

    /// The largest chunk a pipelined transfer of `len` bytes uses.
    pub fn chunk_for(&self, len: usize) -> usize {
        let s = self.schedule_for(len);
        if len <= 2 * s.small * s.ramp {
            s.small
        } else {
            s.large
        }
    }

    /// The route of a device-to-device copy.
    pub fn route_device_device(&self, src: &Gpu, dst: &Gpu) -> Route {
        if src.same_device(dst) {
            Route::DeviceCopy
        } else {
            Route::PeerCopy {
                direct: src.can_access_peer(dst),
            }
        }
    }

    fn copy_threads(&self, len: usize) -> usize {
        if len < self.config.parallel_copy_min {
            1
        } else {
            len.div_ceil(self.config.parallel_copy_min)
                .min(self.config.threads)
        }
    }

    /// Runs `work` on every lane at once on the copy threads ([`run_workers`]: the calling
    /// thread takes the first lane, the pool's threads wake together for the others); the
    /// first failure, or a lane's panic, stops the others and is returned.
    fn run_lanes(
        &self,
        lanes: &mut [pipeline::Lane],
        work: impl Fn(&mut pipeline::Lane, &AtomicBool) -> Result<()> + Sync,
    ) -> Result<()> {
        run_workers(&self.pool, lanes, work)
    }

    fn gather_threads(&self) -> usize {
        self.config.gather_threads
    }

    fn gather_pool(&self) -> Result<&rayon::ThreadPool> {
        let threads = self.config.gather_threads;
        self.gather_pool
            .get_or_init(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("gpuio-gather-{i}"))
                    .build()
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| MemIoError::Internal(format!("starting gather threads: {e}")))
    }

    fn count_h2d(&self, bytes: usize) {
        self.counters.h2d.add(bytes as u64);
    }

    fn count_d2h(&self, bytes: usize) {
        self.counters.d2h.add(bytes as u64);
    }

    /// Copies host memory (pinned or pageable) into `dst` at `dst_offset`; returns the route.
    pub fn upload(&self, src: &[u8], dst: &DeviceBuffer, dst_offset: usize) -> Result<Route> {
        gpuio_hal::check_range("upload destination", dst_offset, src.len(), dst.len())?;
        let gpu = dst.gpu();
        let route = self.route_host_device(gpu, src);
        match route {
            Route::DirectDma | Route::DriverStaged | Route::HostCopy { .. } => {
                self.with_stream(gpu, |s| Ok(s.upload(src, dst, dst_offset)?))?
            }
            Route::StagedPipeline { .. } => return self.upload_staged(src, dst, dst_offset),
            Route::DeviceCopy | Route::PeerCopy { .. } => {
                return Err(MemIoError::Internal(format!("{route} for a host source")));
            }
        }
        self.counters.h2d.add(src.len() as u64);
        Ok(route)
    }

    /// Copies host memory into `dst` through the staging pipeline, whatever the memory is.
    /// [`upload`](Self::upload) picks this route for large pageable sources on its own.
    pub fn upload_staged(
        &self,
        src: &[u8],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<Route> {
        gpuio_hal::check_range("upload destination", dst_offset, src.len(), dst.len())?;
        let pool = &self.device(dst.gpu())?.lanes;
        let schedule = self.schedule_for(src.len());
        let mut taken = pool.take(schedule.count(src.len()).clamp(1, self.config.threads))?;
        let lanes = taken.len();
        let work = Mutex::new(schedule.pieces(src));
        let res = self.run_lanes(&mut taken, |lane, abort| {
            lane.upload(&work, abort, dst, dst_offset)
        });
        pool.give_back(taken);
        res?;
        let n = src.len() as u64;
        self.counters.staged.add(n);
        self.counters.h2d.add(n);
        Ok(Route::StagedPipeline {
            lanes,
            chunk: self.chunk_for(src.len()),
        })
    }

    /// Copies `dst.len()` bytes of `src` from `src_offset` into host memory; returns the route.
    pub fn download(&self, src: &DeviceBuffer, src_offset: usize, dst: &mut [u8]) -> Result<Route> {
        gpuio_hal::check_range("download source", src_offset, dst.len(), src.len())?;
        let gpu = src.gpu();
        let route = self.route_host_device(gpu, dst);
        let len = dst.len();
        match route {
            Route::DirectDma | Route::DriverStaged | Route::HostCopy { .. } => {
                self.with_stream(gpu, |s| Ok(s.download(src, src_offset, dst)?))?
            }
            Route::StagedPipeline { .. } => return self.download_staged(src, src_offset, dst),
            Route::DeviceCopy | Route::PeerCopy { .. } => {
                return Err(MemIoError::Internal(format!(
                    "{route} for a host destination"
                )));
            }
        }
        self.counters.d2h.add(len as u64);
        Ok(route)
    }

    /// Copies device memory into host memory through the staging pipeline, whatever the
    /// memory is. [`download`](Self::download) picks this route for large pageable
    /// destinations on its own.
    pub fn download_staged(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &mut [u8],
    ) -> Result<Route> {
        gpuio_hal::check_range("download source", src_offset, dst.len(), src.len())?;
        let pool = &self.device(src.gpu())?.lanes;
        let len = dst.len();
        let schedule = self.schedule_for(len);
        let chunk = self.chunk_for(len);
        let mut taken = pool.take(schedule.count(len).clamp(1, self.config.threads))?;
        let lanes = taken.len();
        let work = Mutex::new(schedule.pieces_mut(dst));
        let res = self.run_lanes(&mut taken, |lane, abort| {
            lane.download(&work, abort, src, src_offset)
        });
        pool.give_back(taken);
        res?;
        self.counters.staged.add(len as u64);
        self.counters.d2h.add(len as u64);
        Ok(Route::StagedPipeline { lanes, chunk })
    }

    /// Copies `len` bytes between device buffers (same device or peers); returns the route.
    pub fn copy_device(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<Route> {
        let route = self.route_device_device(src.gpu(), dst.gpu());
        self.with_stream(dst.gpu(), |s| {
            Ok(s.copy_device(src, src_offset, dst, dst_offset, len)?)
        })?;
        self.counters.d2d.add(len as u64);
        Ok(route)
    }

    /// Copies host memory to host memory (DRAM, CXL), in parallel for large copies.
    pub fn copy_host(&self, src: &[u8], dst: &mut [u8]) -> Result<Route> {
        if src.len() != dst.len() {
            return Err(MemIoError::LengthMismatch {
                src: src.len(),
                dst: dst.len(),
            });
        }
        let threads = self.copy_threads(src.len());
        if threads == 1 {
            dst.copy_from_slice(src);
        } else {
            let seg = src.len().div_ceil(threads);
            self.pool.install(|| {
                dst.par_chunks_mut(seg)
                    .zip(src.par_chunks(seg))
                    .for_each(|(d, s)| d.copy_from_slice(s))
            });
        }
        self.counters.h2h.add(src.len() as u64);
        Ok(Route::HostCopy { threads })
    }
}
