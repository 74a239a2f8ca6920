#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod config;
mod file;
mod gds;
mod host;
mod lane;
mod nvme;
mod page_cache;
mod plan;
mod queue;
mod stripe;

pub use config::{Durability, EnginePreference, GdsPolicy, LocalIoConfig, PageCachePolicy};
pub use file::{FileHandle, OpenOptions};
pub use gpuio_hal::file::{DirectIoAlignment, Extent};
pub use nvme::NvmeDevice;
pub use page_cache::PageCacheStats;
pub use queue::IoEngine;
pub use stripe::StripeSet;

use gpuio_hal::sync::MutexExt;
use gpuio_hal::uring::Ring;
use gpuio_hal::workers::{WorkerPanic, run_workers};
use gpuio_hal::{DeviceBuffer, ErrorCode, GdsMode, Gpu, HalError};
use gpuio_staging::{PoolConfig, StagingPool, auto_limit};
use lane::{BlocksJob, Lane, LanePool, LaneSpec, MAX_BATCH, ReadJob, WriteJob};
use plan::{Piece, Plan};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

/// LocalIO's errors.
#[derive(Debug, thiserror::Error)]
pub enum LocalIoError {
    /// Opening a file failed.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A read or write failed.
    #[error("{op} {path} at offset {offset}: {source}")]
    Io {
        /// `read`, `write`, `sync` or `stat`.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// Where.
        offset: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file ended before the requested range did.
    #[error("{path}: wanted {wanted} bytes at offset {offset} but the file ends after {got}")]
    UnexpectedEof {
        /// The file.
        path: PathBuf,
        /// Start of the read.
        offset: u64,
        /// Bytes asked for.
        wanted: usize,
        /// Bytes there were.
        got: usize,
    },
    /// The filesystem (or the user's quota) is full; `written` bytes of the request reached
    /// the file before it filled up, and the rest did not.
    #[error(
        "{path}: no space left on device after writing {written} of {wanted} bytes at offset {offset}"
    )]
    NoSpace {
        /// The file.
        path: PathBuf,
        /// Start of the write.
        offset: u64,
        /// Bytes asked for.
        wanted: usize,
        /// Bytes written before the disk filled (never reported as success).
        written: usize,
    },
    /// A write to a file opened read-only.
    #[error("{0} was opened read-only")]
    ReadOnly(PathBuf),
    /// A file that cannot be read as a source because its size is unknown: a FIFO, socket,
    /// character device or directory, or a pseudo-file (procfs, sysfs, debugfs) whose size
    /// reads as 0 although it has content. A copy would hang on it or end empty.
    #[error("{path} is {kind}: it cannot be sized, so it cannot be read as a source")]
    Unsized {
        /// The file.
        path: PathBuf,
        /// What it is, e.g. `a FIFO`.
        kind: String,
    },
    /// A copy to or from GPU memory failed.
    #[error(transparent)]
    Hal(#[from] HalError),
    /// A transfer's data does not match the checksum it should have.
    #[error("{}", match actual {
        Some(a) => format!("crc32c mismatch: expected {expected:08x}, the data has {a:08x}"),
        None => format!("crc32c {expected:08x} cannot be verified: checksums are off"),
    })]
    Checksum {
        /// The checksum the data should have.
        expected: u32,
        /// The checksum it has (`None`: none was computed).
        actual: Option<u32>,
    },
    /// A broken internal invariant (reported, never a panic).
    #[error("internal LocalIO error: {0}")]
    Internal(String),
}

impl LocalIoError {
    /// This error's code (docs/REFERENCE.md#error-codes).
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Open { source, .. } | Self::Io { source, .. } => ErrorCode::from_io(source),
            Self::UnexpectedEof { .. } => ErrorCode::InvalidArg,
            Self::NoSpace { .. } => ErrorCode::Io,
            Self::ReadOnly(_) => ErrorCode::Permission,
            Self::Unsized { .. } => ErrorCode::InvalidArg,
            Self::Checksum { .. } => ErrorCode::Io,
            Self::Hal(e) => e.code(),
            Self::Internal(_) => ErrorCode::General,
        }
    }
}

impl From<WorkerPanic> for LocalIoError {
    fn from(p: WorkerPanic) -> Self {
        Self::Internal(p.to_string())
    }
}

/// The block cuFile writes are cut to (the largest O_DIRECT alignment in use).
const GDS_BLOCK: u64 = 4096;

/// LocalIO's result type.
pub type Result<T, E = LocalIoError> = std::result::Result<T, E>;

/// What a transfer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    /// Bytes moved.
    pub bytes: u64,
    /// The engine that moved them.
    pub engine: IoEngine,
    /// Lanes used.
    pub lanes: usize,
    /// The crc32c of the bytes, in device order, as read from the file (reads) or from GPU
    /// memory (writes); kept when [`LocalIoConfig::checksum`] is on.
    pub crc32c: Option<u32>,
    /// Bytes the copy engine read straight from the page cache ([`IoEngine::PageCache`]); the
    /// rest went through the lanes.
    pub page_cache_bytes: u64,
}

impl Transfer {
    /// Checks the transfer's checksum against `expected` (end-to-end verification against a
    /// checksum stored with the data); [`LocalIoError::Checksum`] if they differ or none was
    /// kept.
    pub fn verify_crc32c(&self, expected: u32) -> Result<()> {
        match self.crc32c {
            Some(actual) if actual == expected => Ok(()),
            actual => Err(LocalIoError::Checksum { expected, actual }),
        }
    }
}

impl std::fmt::Display for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.engine {
            IoEngine::Gds(_) | IoEngine::HostCopy => {
                write!(f, "{} x {} thread(s)", self.engine, self.lanes)
            }
            IoEngine::PageCache if self.page_cache_bytes < self.bytes => write!(
                f,
                "{}% {} ({} registering thread(s)), the rest through the staged lanes",
                self.page_cache_bytes * 100 / self.bytes.max(1),
                self.engine,
                self.lanes
            ),
            IoEngine::PageCache if self.lanes == 0 => {
                write!(f, "{}, registration kept from an earlier read", self.engine)
            }
            IoEngine::PageCache => {
                write!(f, "{} ({} registering thread(s))", self.engine, self.lanes)
            }
            _ => write!(
                f,
                "{} x {} lane(s), pinned staging + DMA",
                self.engine, self.lanes
            ),
        }
    }
}

/// The LocalIO engine. Thread-safe; share it behind an `Arc`.
pub struct LocalIo {
    config: LocalIoConfig,
    engine: IoEngine,
    engine_reason: String,
    pool: rayon::ThreadPool,
    staging: StagingPool,
    lanes: Mutex<Vec<(Gpu, Arc<LanePool>)>>,
    kept: Arc<page_cache::KeptFiles>,
}

impl Drop for LocalIo {
    fn drop(&mut self) {
        self.kept.close();
    }
}

impl std::fmt::Debug for LocalIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalIo")
            .field("engine", &self.engine)
            .field("config", &self.config)
            .finish()
    }
}

impl LocalIo {
    /// A new engine with a staging pool of its own, sized automatically ([`auto_limit`]);
    /// probes io_uring once. [`with_pool`](Self::with_pool) shares a pool.
    pub fn new(config: LocalIoConfig) -> Result<Self> {
        let defaults = PoolConfig::default();
        let staging = StagingPool::new(PoolConfig {
            limit: auto_limit(),
            max_class: config
                .effective_chunk_size()
                .next_power_of_two()
                .max(defaults.max_class),
            ..defaults
        })?;
        Self::with_pool(config, staging)
    }

    /// A new engine whose lanes take their pinned staging slots from `staging` (shared with
    /// MemIO in a session); probes io_uring once. The pool's largest class must take a chunk,
    /// and its limit at least one lane ([`LocalIoConfig::lane_staging_bytes`]); else
    /// transfers fail with the pool's error.
    pub fn with_pool(config: LocalIoConfig, staging: StagingPool) -> Result<Self> {
        let config = LocalIoConfig {
            lanes: config.lanes.clamp(1, 256),
            host_threads: config.host_threads.clamp(1, 256),
            chunk_size: config.effective_chunk_size(),
            slots_per_lane: config.slots_per_lane.clamp(2, 64),
            ..config
        };
        let uring = Ring::probe();
        let (engine, engine_reason) = match (config.engine, uring.available) {
            (EnginePreference::Posix, _) => {
                (IoEngine::Posix, "asked for in the configuration".into())
            }
            (_, true) => (IoEngine::Uring, uring.detail),
            (EnginePreference::Auto, false) => (
                IoEngine::Posix,
                format!(
                    "io_uring is unavailable ({}); using pread/pwrite",
                    uring.detail
                ),
            ),
            (EnginePreference::Uring, false) => {
                return Err(LocalIoError::Hal(HalError::Unsupported {
                    what: "io_uring",
                    reason: uring.detail,
                }));
            }
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(config.lanes.max(config.host_threads))
            .thread_name(|i| format!("gpuio-localio-{i}"))
            .build()
            .map_err(|e| LocalIoError::Internal(format!("starting IO threads: {e}")))?;
        Ok(Self {
            kept: Arc::new(page_cache::KeptFiles::new(config.page_cache_keep)),
            config,
            engine,
            engine_reason,
            pool,
            staging,
            lanes: Mutex::new(Vec::new()),
        })
    }

    /// The pool the lanes take their pinned staging slots from.
    pub fn staging_pool(&self) -> &StagingPool {
        &self.staging
    }

    /// Pinned staging memory currently held by idle lanes (all GPUs).
    pub fn staging_bytes(&self) -> u64 {
        let pools = self.lanes.lock_unpoisoned();
        pools.iter().map(|(_, p)| p.staged_bytes()).sum()
    }

    /// The engine's configuration.
    pub fn config(&self) -> &LocalIoConfig {
        &self.config
    }

    /// The engine transfers use, and why.
    pub fn engine(&self) -> (IoEngine, &str) {
        (self.engine, &self.engine_reason)
    }

    /// Opens a file.
    pub fn open(&self, path: impl AsRef<Path>, opts: OpenOptions) -> Result<FileHandle> {
        FileHandle::open(path, opts)
    }

    fn lane_pool(&self, gpu: &Gpu) -> Arc<LanePool> {
        let mut pools = self.lanes.lock_unpoisoned();
        if let Some((_, p)) = pools.iter().find(|(g, _)| g.same_device(gpu)) {
            return p.clone();
        }
        let spec = LaneSpec {
            engine: self.engine,
            slot_len: self.config.chunk_size,
            slots: self.config.slots_per_lane,
            sqpoll: self.config.sqpoll,
        };
        let p = lane::lane_pool(gpu.clone(), spec, self.staging.clone());
        pools.push((gpu.clone(), p.clone()));
        p
    }

    /// Whether a transfer of `len` bytes between `files` and `gpu` goes through cuFile, and in
    /// which mode: the files' own [`OpenOptions::gds`] first, then [`LocalIoConfig::gds`].
    fn use_gds(&self, files: &[&FileHandle], gpu: &Gpu, len: usize) -> Result<Option<GdsMode>> {
        let forced = files.iter().any(|f| f.gds() == Some(true));
        if forced {
            if self.config.checksum {
                return Err(LocalIoError::Hal(HalError::Unsupported {
                    what: "crc32c checksums with gds=1",
                    reason: "cuFile moves the bytes without host staging to checksum".into(),
                }));
            }
            return Ok(Some(gpu.gds()?.0));
        }
        if files.iter().any(|f| f.gds() == Some(false))
            || self.config.gds == GdsPolicy::Off
            || self.config.checksum
            || len < self.config.gds_threshold
        {
            return Ok(None);
        }
        // Native GDS reads the device, never the page cache: AUTO keeps it to files opened
        // O_DIRECT, whose readers asked to bypass the cache anyway. Nothing else takes cuFile
        // under AUTO, so nothing else opens its driver: that costs ~0.5 s, which a process's
        // first transfer would pay for a library it does not use (the probe's `gds` says
        // whether nvidia-fs is there without opening it).
        let direct = files.iter().all(|f| f.is_direct());
        if self.config.gds == GdsPolicy::Auto && !(direct && gpu.info().gds.available) {
            return Ok(None);
        }
        Ok(match (gpu.gds(), self.config.gds) {
            (Ok((GdsMode::Native, _)), GdsPolicy::Auto) if direct => Some(GdsMode::Native),
            (Ok((GdsMode::Native, _)), GdsPolicy::On) => Some(GdsMode::Native),
            (Ok((GdsMode::Compat, _)), GdsPolicy::On) => Some(GdsMode::Compat),
            _ => None,
        })
    }

    /// How this engine moves transfers of `gpu`'s memory, for `gpuio info`: the lanes'
    /// engine, and whether and when cuFile takes over.
    pub fn explain(&self, gpu: &Gpu) -> String {
        let lanes = format!(
            "{} {} lanes, {} x {} pinned staging each",
            self.config.lanes,
            self.engine,
            self.config.slots_per_lane,
            human_size(self.config.chunk_size)
        );
        let from = human_size(self.config.gds_threshold);
        let gds = match (gpu.gds(), self.config.gds) {
            (_, GdsPolicy::Off) => "cuFile off in the configuration".to_string(),
            (Err(e), _) => format!("no cuFile ({e}): gds=1 transfers fail"),
            (Ok((GdsMode::Native, lib)), GdsPolicy::Auto) => {
                format!("O_DIRECT transfers from {from} up go through cuFile ({lib}, native GDS)")
            }
            (Ok((GdsMode::Native, lib)), GdsPolicy::On) => {
                format!("transfers from {from} up go through cuFile ({lib}, native GDS)")
            }
            (Ok((GdsMode::Compat, lib)), GdsPolicy::On) => {
                format!(
                    "transfers from {from} up go through cuFile ({lib}, compat mode), as configured"
                )
            }
            (Ok((GdsMode::Compat, lib)), GdsPolicy::Auto) => format!(
                "cuFile ({lib}) runs only in compat mode here (no nvidia-fs), which the lanes outrun: \
                 used only for gds=1"
            ),
        };
        let page_cache = match (self.config.page_cache, &gpu.info().page_cache_dma) {
            (PageCachePolicy::Off, _) => "page cache reads off in the configuration".to_string(),
            (PageCachePolicy::Auto, c) if !c.available => {
                format!(
                    "no page cache reads ({}): warm files are staged too",
                    c.detail
                )
            }
            (PageCachePolicy::Auto, _) => format!(
                "a file read from {} up a second time, unchanged (or read more than once over \
                 in smaller reads), is registered whole in the background while no GPU transfer \
                 runs, and kept, up to {} in all; reads of any size come straight from its \
                 pinned pages once that is done, and through the lanes until then (O_DIRECT and \
                 checksummed reads always staged)",
                human_size(self.config.page_cache_threshold),
                human_size(self.config.page_cache_keep.min(usize::MAX as u64) as usize)
            ),
        };
        let host = format!(
            "file <-> host memory: pread/pwrite in place on up to {} threads",
            self.config.host_threads
        );
        format!("{lanes}; {gds}; {page_cache}; {host}")
    }

    /// Cuts `pieces` of `files` into chunks of one staging slot each.
    fn plan(&self, files: &[&FileHandle], pieces: &[Piece], pool: &LanePool) -> Result<Plan> {
        if let Some(f) = files
            .iter()
            .find(|f| f.required_alignment() > pool.buffer_len())
        {
            return Err(LocalIoError::Hal(HalError::Unsupported {
                what: "O_DIRECT on this file",
                reason: format!(
                    "{} needs {}-byte alignment, above the {}-byte staging",
                    f.path().display(),
                    f.required_alignment(),
                    pool.buffer_len()
                ),
            }));
        }
        Ok(Plan::new(
            files,
            pieces,
            pool.buffer_len() as u64,
            self.config.checksum,
            self.config.lanes,
        ))
    }

    /// Runs `work` on every worker (a lane, or a cuFile thread's nothing) at once on the IO
    /// threads ([`run_workers`]: the calling thread takes the first, the others are handed to
    /// the pool together); the first failure, or a worker's panic, stops the rest and is
    /// returned.
    fn run_workers<W: Send>(
        &self,
        workers: &mut [W],
        work: impl Fn(&mut W, &AtomicBool) -> Result<()> + Sync,
    ) -> Result<()> {
        run_workers(&self.pool, workers, work)
    }

    /// Runs `work` on up to `wanted` (at most `lanes`, at least one) of `pool`'s lanes, those
    /// still being made joining as they are ready; returns how many ran and their IO engine.
    fn on_lanes(
        &self,
        pool: &Arc<LanePool>,
        wanted: usize,
        work: impl Fn(&mut Lane, &AtomicBool) -> Result<()> + Sync,
    ) -> Result<(usize, IoEngine)> {
        let engine = std::sync::OnceLock::new();
        let n = pool.run(
            wanted.clamp(1, self.config.lanes),
            &self.pool,
            |lane, abort| {
                engine.get_or_init(|| lane.engine());
                work(lane, abort)
            },
        )?;
        Ok((n, engine.get().copied().unwrap_or(self.engine)))
    }

    /// Reads `len` bytes of `file` at `offset` into `dst` at `dst_offset`. A file shorter than
    /// the range is [`LocalIoError::UnexpectedEof`], never a short success.
    pub fn read_to_device(
        &self,
        file: &FileHandle,
        offset: u64,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<Transfer> {
        // Hot files' registrations wait while GPU transfers run (the driver serializes them).
        let _busy = self.kept.busy();
        file_range(offset, len as u64)?;
        gpuio_hal::check_range("file read destination", dst_offset, len, dst.len())?;
        if let Some(t) = self.read_from_page_cache(file, offset, dst, dst_offset, len)? {
            return Ok(t);
        }
        let pieces = plan::end_to_end([(0, offset, len as u64)]);
        self.read_pieces(&[file], &pieces, dst, dst_offset, len)
    }

    /// Reads `len` bytes of the striped stream `set` from `offset` into `dst` at
    /// `dst_offset`, from all its files at once.
    pub fn read_striped_to_device(
        &self,
        set: &StripeSet,
        offset: u64,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<Transfer> {
        let _busy = self.kept.busy();
        file_range(offset, len as u64)?;
        let files: Vec<&FileHandle> = set.files().iter().collect();
        let pieces = plan::end_to_end(set.pieces(offset, len as u64));
        self.read_pieces(&files, &pieces, dst, dst_offset, len)
    }

    fn read_pieces(
        &self,
        files: &[&FileHandle],
        pieces: &[Piece],
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<Transfer> {
        gpuio_hal::check_range("file read destination", dst_offset, len, dst.len())?;
        if files.iter().any(|f| f.nvme_device().is_some()) {
            return self.nvme_read_pieces(files, pieces, dst, dst_offset);
        }
        if let Some(mode) = self.use_gds(files, dst.gpu(), len)? {
            let chunk = self.config.chunk_size as u64;
            let plan = Plan::new(files, pieces, chunk, false, self.config.lanes);
            let regs = gds::register(files, dst.gpu())?;
            let n = plan.count().clamp(1, self.config.lanes);
            self.run_workers(&mut vec![(); n], |(), abort| {
                gds::read(files, &regs, &plan, dst, dst_offset, abort)
            })?;
            return Ok(Transfer {
                bytes: len as u64,
                engine: IoEngine::Gds(mode),
                lanes: n,
                crc32c: None,
                page_cache_bytes: 0,
            });
        }
        let pool = self.lane_pool(dst.gpu());
        let plan = self.plan(files, pieces, &pool)?;
        let job = ReadJob {
            files,
            plan: &plan,
            dst,
            dst_offset,
        };
        let (n, engine) =
            self.on_lanes(&pool, plan.count(), |lane, abort| lane.read(&job, abort))?;
        Ok(Transfer {
            bytes: len as u64,
            engine,
            lanes: n,
            crc32c: plan.crc32c(),
            page_cache_bytes: 0,
        })
    }

    /// Reads `block`-byte blocks at `offsets` of `file` into consecutive blocks of `dst` from
    /// `dst_offset` (block `k` lands at `dst_offset + k * block`): random reads gathered into
    /// GPU memory, many in flight per lane and one DMA per batch of blocks.
    pub fn read_blocks_to_device(
        &self,
        file: &FileHandle,
        offsets: &[u64],
        block: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<Transfer> {
        let _busy = self.kept.busy();
        let total = offsets.len().checked_mul(block).ok_or_else(|| {
            LocalIoError::Hal(HalError::InvalidArgument(
                "block gather size overflows".into(),
            ))
        })?;
        gpuio_hal::check_range("block gather destination", dst_offset, total, dst.len())?;
        let pool = self.lane_pool(dst.gpu());
        if block == 0 || block > pool.buffer_len() {
            return Err(LocalIoError::Hal(HalError::InvalidArgument(format!(
                "block size {block} must be 1 to {} bytes",
                pool.buffer_len()
            ))));
        }
        for &o in offsets {
            file_range(o, block as u64)?;
        }
        if file.nvme_device().is_some() {
            let pieces: Vec<Piece> = (offsets.iter().enumerate())
                .map(|(k, &offset)| Piece {
                    file: 0,
                    offset,
                    len: block as u64,
                    dev_off: (k * block) as u64,
                })
                .collect();
            return self.nvme_read_pieces(&[file], &pieces, dst, dst_offset);
        }
        let align = file.required_alignment();
        if align > 1
            && (!block.is_multiple_of(align) || offsets.iter().any(|o| o % align as u64 != 0))
        {
            return Err(LocalIoError::Hal(HalError::InvalidArgument(format!(
                "{} is O_DIRECT: blocks and offsets must be multiples of {align} bytes",
                file.path().display()
            ))));
        }
        let job = BlocksJob {
            file,
            offsets,
            block,
            batch: (pool.buffer_len() / block).clamp(1, MAX_BATCH),
            dst,
            dst_offset,
            next: AtomicUsize::new(0),
        };
        let wanted = offsets.len().div_ceil(job.batch);
        let (n, engine) =
            self.on_lanes(&pool, wanted, |lane, abort| lane.read_blocks(&job, abort))?;
        Ok(Transfer {
            bytes: total as u64,
            engine,
            lanes: n,
            // Scattered blocks have no single byte stream to checksum.
            crc32c: None,
            page_cache_bytes: 0,
        })
    }

    /// Writes `len` bytes of `src` from `src_offset` to `file` at `offset`, durable as asked.
    /// A full disk is [`LocalIoError::NoSpace`] naming the bytes that did reach the file.
    pub fn write_from_device(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        file: &FileHandle,
        offset: u64,
        len: usize,
        durability: Durability,
    ) -> Result<Transfer> {
        let _busy = self.kept.busy();
        file_range(offset, len as u64)?;
        let pieces = plan::end_to_end([(0, offset, len as u64)]);
        self.write_pieces(src, src_offset, &[file], &pieces, len, durability)
    }

    /// Writes `len` bytes of `src` from `src_offset` to the striped stream `set` at `offset`,
    /// to all its files at once, durable as asked.
    pub fn write_striped_from_device(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        set: &StripeSet,
        offset: u64,
        len: usize,
        durability: Durability,
    ) -> Result<Transfer> {
        let _busy = self.kept.busy();
        file_range(offset, len as u64)?;
        let files: Vec<&FileHandle> = set.files().iter().collect();
        let pieces = plan::end_to_end(set.pieces(offset, len as u64));
        self.write_pieces(src, src_offset, &files, &pieces, len, durability)
    }

    fn write_pieces(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        files: &[&FileHandle],
        pieces: &[Piece],
        len: usize,
        durability: Durability,
    ) -> Result<Transfer> {
        gpuio_hal::check_range("file write source", src_offset, len, src.len())?;
        if let Some(f) = files.iter().find(|f| !f.is_writable()) {
            return Err(LocalIoError::ReadOnly(f.path().to_path_buf()));
        }
        if files.iter().any(|f| f.nvme_device().is_some()) {
            return self.nvme_write_pieces(src, src_offset, files, pieces, durability);
        }
        let Some(mode) = self.use_gds(files, src.gpu(), len)? else {
            return self.write_staged(src, src_offset, files, pieces, durability);
        };
        // cuFile gets whole blocks only, so that no two of its threads ever share one (on an
        // O_DIRECT descriptor cuFile writes a partial block by read-modify-write, which two
        // threads would race on); partial blocks at the edges go through the lanes, which keep
        // what the file holds around them.
        let (bodies, edges) = plan::split_at_blocks(pieces, GDS_BLOCK);
        if !edges.is_empty() {
            self.write_staged(src, src_offset, files, &edges, Durability::None)?;
        }
        let chunk = self.config.chunk_size as u64;
        let plan = Plan::new(files, &bodies, chunk, false, self.config.lanes);
        let regs = gds::register(files, src.gpu())?;
        let n = plan.count().clamp(1, self.config.lanes);
        let written = AtomicUsize::new(0);
        self.run_workers(&mut vec![(); n], |(), abort| {
            gds::write(files, &regs, &plan, src, src_offset, &written, abort)
        })?;
        if durability == Durability::DataSync {
            for file in files {
                file.sync_data()?;
            }
        }
        Ok(Transfer {
            bytes: len as u64,
            engine: IoEngine::Gds(mode),
            lanes: n,
            crc32c: None,
            page_cache_bytes: 0,
        })
    }

    /// Writes `pieces` through the lanes: GPU → pinned staging → file.
    fn write_staged(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        files: &[&FileHandle],
        pieces: &[Piece],
        durability: Durability,
    ) -> Result<Transfer> {
        let pool = self.lane_pool(src.gpu());
        let plan = self.plan(files, pieces, &pool)?;
        let old_lens = files.iter().map(|f| f.len()).collect::<Result<Vec<_>>>()?;
        let written = AtomicUsize::new(0);
        let job = WriteJob {
            files,
            plan: &plan,
            src,
            src_offset,
            old_lens: &old_lens,
            written: &written,
            writeback: durability == Durability::DataSync,
        };
        let (n, engine) =
            self.on_lanes(&pool, plan.count(), |lane, abort| lane.write(&job, abort))?;
        // O_DIRECT writes whole blocks: trim the padding a write past the end left.
        let mut ends = old_lens.clone();
        for c in plan.chunks() {
            ends[c.file] = ends[c.file].max(c.start() + c.len as u64);
        }
        for ((file, old), end) in files.iter().zip(&old_lens).zip(ends) {
            if file.is_direct() && end > *old {
                file.set_len(end)?;
            }
        }
        if durability == Durability::DataSync {
            for file in files {
                file.sync_data()?;
            }
        }
        Ok(Transfer {
            bytes: pieces.iter().map(|p| p.len).sum(),
            engine,
            lanes: n,
            crc32c: plan.crc32c(),
            page_cache_bytes: 0,
        })
    }
}

/// `4 MiB`, `512 KiB`, `100 B`, `2.5 GiB`.
fn human_size(n: usize) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

/// Refuses a file range that ends past the largest file offset (`i64::MAX`): nothing can be
/// there, and the plan's arithmetic must not overflow.
fn file_range(offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= i64::MAX as u64 => Ok(()),
        _ => Err(LocalIoError::Hal(HalError::InvalidArgument(format!(
            "file range {offset}+{len} ends past the largest file offset"
        )))),
    }
}
