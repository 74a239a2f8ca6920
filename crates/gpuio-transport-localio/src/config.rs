//! LocalIO's configuration: which queue engine the lanes run ([`EnginePreference`]), when
//! cuFile takes over ([`GdsPolicy`]), when warm reads skip staging ([`PageCachePolicy`]), when written data must be durable ([`Durability`]), and
//! the tuning of the engine ([`LocalIoConfig`]).

use crate::{LocalIoError, Result};
use gpuio_staging::PoolConfig;

/// Which engine [`LocalIo`](crate::LocalIo) should use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnginePreference {
    /// io_uring where the kernel allows it, else positioned reads and writes.
    #[default]
    Auto,
    /// io_uring, or an error saying why not.
    Uring,
    /// Positioned reads and writes.
    Posix,
}

impl std::str::FromStr for EnginePreference {
    type Err = LocalIoError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "uring" | "io_uring" => Ok(Self::Uring),
            "posix" => Ok(Self::Posix),
            other => Err(LocalIoError::Internal(format!(
                "unknown LocalIO engine {other:?} (expected auto, uring or posix)"
            ))),
        }
    }
}

/// When transfers go through cuFile (GPUDirect Storage) instead of the staged lanes. A file
/// opened with [`OpenOptions::gds`](crate::OpenOptions::gds) set overrides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GdsPolicy {
    /// cuFile where it is real GPUDirect Storage (nvidia-fs loaded), for O_DIRECT files and
    /// transfers of at least [`LocalIoConfig::gds_threshold`]; the lanes otherwise (they serve
    /// the page cache, and beat cuFile's compat mode).
    #[default]
    Auto,
    /// cuFile wherever it runs, compat mode included, from the threshold up.
    On,
    /// Never.
    Off,
}

impl std::str::FromStr for GdsPolicy {
    type Err = LocalIoError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "on" | "1" | "true" => Ok(Self::On),
            "off" | "0" | "false" => Ok(Self::Off),
            other => Err(LocalIoError::Internal(format!(
                "unknown GDS policy {other:?} (expected auto, on or off)"
            ))),
        }
    }
}

/// When reads into GPU memory take a warm file's pages straight from the page cache: the
/// file's mapping registered read-only with the device, read by its copy engine, no CPU copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PageCachePolicy {
    /// Where the device can ([`DeviceInfo::page_cache_dma`](gpuio_hal::DeviceInfo)), for reads
    /// from files not opened O_DIRECT, with checksums off: the resident chunks so, the cold
    /// ones through the lanes (below [`LocalIoConfig::page_cache_threshold`], only from kept
    /// registrations).
    #[default]
    Auto,
    /// Never: every read goes through the lanes (or cuFile).
    Off,
}

impl std::str::FromStr for PageCachePolicy {
    type Err = LocalIoError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "off" | "0" | "false" => Ok(Self::Off),
            other => Err(LocalIoError::Internal(format!(
                "unknown page cache policy {other:?} (expected auto or off)"
            ))),
        }
    }
}

/// When written data must be durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// When the kernel gets to it.
    #[default]
    None,
    /// `fdatasync` once the whole transfer is written; writeback of each chunk starts as soon
    /// as it is written, so the flush overlaps the rest of the transfer. (For every write to be
    /// durable as it happens, open the file with
    /// [`OpenOptions::dsync`](crate::OpenOptions::dsync).)
    DataSync,
}

/// Tuning of the LocalIO engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalIoConfig {
    /// The engine.
    pub engine: EnginePreference,
    /// Lanes (threads) per transfer.
    pub lanes: usize,
    /// Threads copying between files and host memory, at most, per transfer (the CPU does
    /// that copy, about 8 GB/s a thread: one per core is the default).
    pub host_threads: usize,
    /// Bytes per chunk (and per pinned staging slot).
    pub chunk_size: usize,
    /// Staging slots per lane: IO in flight per lane (at least 2, so IO overlaps DMA).
    pub slots_per_lane: usize,
    /// Kernel-side submission polling for io_uring (costs a kernel thread per lane).
    pub sqpoll: bool,
    /// Compute the crc32c of every sequential transfer's bytes as they pass through staging
    /// ([`Transfer::crc32c`](crate::Transfer::crc32c)); costs a pass over the data on the lane
    /// threads, and keeps transfers off cuFile (whose bytes never touch host memory).
    pub checksum: bool,
    /// When cuFile is used.
    pub gds: GdsPolicy,
    /// Smallest transfer the policy sends through cuFile (smaller ones go through the lanes,
    /// like kvikio's `gds_threshold`).
    pub gds_threshold: usize,
    /// When reads take warm pages straight from the page cache.
    pub page_cache: PageCachePolicy,
    /// Smallest read [`PageCachePolicy::Auto`] registers page cache pages for (registering
    /// costs about a millisecond per 40 MB, so small reads are faster staged); smaller reads
    /// take a hot file's kept registration, and count towards keeping one (of 32 MiB or more).
    pub page_cache_threshold: usize,
    /// Threads registering the next chunks while the calling thread copies (each registers
    /// about 40 GB/s of pages; the copy engine reads about 55).
    pub page_cache_threads: usize,
    /// Pinned bytes the registrations kept for hot files may hold (0: none kept). A file read
    /// from the page cache a second time, unchanged, keeps its registration; later reads are
    /// one copy from pinned pages.
    pub page_cache_keep: u64,
}

impl LocalIoConfig {
    /// The chunk (and staging slot) size [`LocalIo::new`](crate::LocalIo::new) makes of
    /// [`chunk_size`](Self::chunk_size): 64 KiB to 1 GiB, a multiple of 4 KiB.
    pub fn effective_chunk_size(&self) -> usize {
        self.chunk_size
            .clamp(64 << 10, 1 << 30)
            .next_multiple_of(4096)
    }

    /// The pinned staging one lane holds: its slots, each of the staging pool's class for the
    /// chunk size (as [`LocalIo::new`](crate::LocalIo::new) clamps them); `None` where the
    /// chunk is above the pool's largest class. A staging pool must hold at least this.
    pub fn lane_staging_bytes(&self, pool: &PoolConfig) -> Option<u64> {
        let class = pool.class_size(self.effective_chunk_size())? as u64;
        Some(self.slots_per_lane.clamp(2, 64) as u64 * class)
    }

    /// The lanes a configuration that names none runs: one per CPU, 1 to 8.
    pub fn default_lanes() -> usize {
        gpuio_hal::sys::cpu_count().clamp(1, 8)
    }
}

impl Default for LocalIoConfig {
    fn default() -> Self {
        Self {
            engine: EnginePreference::Auto,
            lanes: Self::default_lanes(),
            host_threads: gpuio_hal::sys::cpu_count(),
            chunk_size: 4 << 20,
            slots_per_lane: 2,
            sqpoll: false,
            checksum: false,
            gds: GdsPolicy::Auto,
            gds_threshold: 1 << 20,
            page_cache: PageCachePolicy::Auto,
            page_cache_threshold: 64 << 20,
            page_cache_threads: 2,
            page_cache_keep: gpuio_staging::auto_limit(),
        }
    }
}
