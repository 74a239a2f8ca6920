//! Session configuration (`gpuio_config_t`, docs/REFERENCE.md#configuration): built-in defaults
//! (`default.toml`, embedded), an optional TOML file, then `GPUIO_*` environment overrides.
//!
//! This file holds [`Config`] itself, loading (defaults, file, environment) and the engines'
//! configurations built from it. The sections' types are in `sections.rs`, the bounds every
//! setting is checked against in `validate.rs`, RemoteIO's agent and client configurations in
//! `remote.rs`, the reading of configuration and secret files in `files.rs`, and `[cache]`
//! (its type, overrides, bounds and the block cache's configuration) in `cache.rs`.

mod cache;
mod files;
mod remote;
mod sections;
#[cfg(test)]
mod tests;
mod validate;

pub use cache::{
    CacheSection, MAX_CACHE_BLOCKS, MAX_CACHE_L3, MAX_CACHE_MEMORY, MIN_CACHE_BLOCK, WritePolicy,
};
pub use sections::{
    AgentExport, AgentKey, AgentSection, LocalIoSection, MemIoSection, PoolSize, RemoteSection,
    SchedulerSection,
};

use crate::error::{Error, Result};
use bytesize::ByteSize;
use files::read_small_file;
use gpuio_core::{RetryPolicy, SchedulerConfig};
use gpuio_hal::{BackendPreference, Gpu};
use gpuio_staging::PoolConfig;
use gpuio_transport_localio::{EnginePreference, GdsPolicy, LocalIoConfig, PageCachePolicy};
use gpuio_transport_memio::MemIoConfig;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The built-in configuration file, with a comment on every setting.
pub const DEFAULT_TOML: &str = include_str!("../default.toml");

/// The configuration format this build reads.
pub const API_VERSION: u32 = 1;

/// The largest configuration file read (the built-in one, every comment included, is 9 KiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The largest key secret file read (`gpuio agent keygen` writes 65 bytes).
pub const MAX_SECRET_BYTES: u64 = 4096;

/// A session's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Configuration format version (must be [`API_VERSION`]).
    pub api_version: u32,
    /// Which GPU backend to use.
    pub backend: BackendPreference,
    /// Use at most this many GPUs (0: all).
    pub max_gpus: u32,
    /// Devices the host backend provides.
    pub host_devices: u32,
    /// Log filter (tracing `EnvFilter` syntax).
    pub log_level: String,
    /// Worker threads for asynchronous and batched requests.
    pub workers: usize,
    /// The most pinned staging memory MemIO's and LocalIO's lanes may hold together
    /// (docs/REFERENCE.md#staging-pool).
    pub memory_pool_size: PoolSize,
    /// MemIO tuning.
    pub memio: MemIoSection,
    /// LocalIO tuning.
    pub localio: LocalIoSection,
    /// The request scheduler.
    pub scheduler: SchedulerSection,
    /// Retry policy (docs/REFERENCE.md#retry-policy).
    pub retry: RetryPolicy,
    /// `gpuio agent`: what this node serves to others (RemoteIO).
    pub agent: AgentSection,
    /// RemoteIO clients: the key, connections, the registry.
    pub remote: RemoteSection,
    /// The block cache of files opened with `Session::open_cached`.
    pub cache: CacheSection,
    /// The file this configuration was read from, if any (not a setting).
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        // The embedded file is the single source of the defaults; a unit test keeps it valid.
        // Parsed once per process: each parse is about a millisecond.
        static DEFAULT: std::sync::OnceLock<Config> = std::sync::OnceLock::new();
        DEFAULT
            .get_or_init(|| {
                Self::from_toml(DEFAULT_TOML, None).unwrap_or_else(|e| {
                    tracing::error!(error = %e, "the built-in configuration does not parse");
                    Self::fallback()
                })
            })
            .clone()
    }
}

/// The built-in defaults as a TOML table, which every document is merged over (parsed once).
fn default_table() -> Result<toml::Table> {
    static TABLE: std::sync::OnceLock<std::result::Result<toml::Table, String>> =
        std::sync::OnceLock::new();
    TABLE
        .get_or_init(|| toml::from_str(DEFAULT_TOML).map_err(|e| e.to_string()))
        .clone()
        .map_err(|message| Error::Config {
            source_name: "<built-in>".into(),
            message,
        })
}

impl Config {
    /// Hard-coded values, only used if the embedded file were broken.
    fn fallback() -> Self {
        Self {
            api_version: API_VERSION,
            backend: BackendPreference::Auto,
            max_gpus: 0,
            host_devices: 1,
            log_level: "warn".into(),
            workers: 4,
            memory_pool_size: PoolSize::Auto,
            memio: MemIoSection {
                chunk_size: ByteSize::mib(4),
                threads: 0,
                slots_per_lane: 3,
                pipeline_min: ByteSize::mib(4),
                resident_linger_ms: 0,
            },
            localio: LocalIoSection {
                engine: EnginePreference::Auto,
                lanes: 0,
                host_threads: 0,
                chunk_size: ByteSize::mib(4),
                slots_per_lane: 4,
                sqpoll: false,
                checksum: false,
                gds: GdsPolicy::Auto,
                gds_threshold: ByteSize::mib(1),
                page_cache: PageCachePolicy::Auto,
                page_cache_threshold: ByteSize::mib(64),
                page_cache_threads: 2,
                page_cache_keep: PoolSize::Auto,
            },
            scheduler: SchedulerSection::default(),
            agent: AgentSection {
                listen: "127.0.0.1:7470".into(),
                handshake_timeout_ms: 3000,
                max_handshakes: 512,
                max_handshakes_per_address: 128,
                max_connections: 256,
                max_sessions_per_key: 64,
                io_timeout_ms: 30_000,
                idle_timeout_ms: 120_000,
                buffer_memory: ByteSize::gib(1),
                threads: 2,
                keys: Vec::new(),
                segment: String::new(),
                advertise: String::new(),
                name: String::new(),
                lease_ttl_s: 10,
                tls_cert: String::new(),
                tls_key: String::new(),
                rdma: false,
                nixl: false,
                nixl_tcp: false,
                nixl_publish: Vec::new(),
                exports: Vec::new(),
            },
            remote: RemoteSection {
                key_id: String::new(),
                secret_env: String::new(),
                secret_file: String::new(),
                connections: 4,
                stripe_size: ByteSize::mib(1),
                timeout_ms: 10_000,
                tls_ca: String::new(),
                tls_server_name: String::new(),
                rdma_device: String::new(),
                rdma_gid_index: 1,
                registry: Vec::new(),
                registry_prefix: "/gpuio".into(),
            },
            retry: RetryPolicy::default(),
            cache: CacheSection::default(),
            source: None,
        }
    }

    /// Parses a TOML document. Settings it leaves out keep their defaults.
    pub fn from_toml(text: &str, source: Option<&Path>) -> Result<Self> {
        let name = || source.map_or_else(|| "<built-in>".into(), |p| p.display().to_string());
        let mut merged = default_table()?;
        let user: toml::Table = toml::from_str(text).map_err(|e| Error::Config {
            source_name: name(),
            message: e.to_string(),
        })?;
        merge(&mut merged, user);
        let mut config: Config = merged
            .try_into()
            .map_err(|e: toml::de::Error| Error::Config {
                source_name: name(),
                message: e.to_string(),
            })?;
        config.source = source.map(Path::to_path_buf);
        config.validate(&name())?;
        Ok(config)
    }

    /// Reads a TOML file: a regular file of at most [`MAX_CONFIG_BYTES`] (a FIFO would block
    /// the reader forever, a device such as `/dev/zero` never end).
    pub fn from_file(path: &Path) -> Result<Self> {
        let fail = |message: String| Error::Config {
            source_name: path.display().to_string(),
            message,
        };
        let bytes =
            read_small_file(path, MAX_CONFIG_BYTES, "configuration files", false).map_err(fail)?;
        let text = String::from_utf8(bytes).map_err(|_| fail("is not UTF-8 text".into()))?;
        Self::from_toml(&text, Some(path))
    }

    /// The configuration in effect: `path` (or `$GPUIO_CONFIG`, where set and not empty) if
    /// given, else the defaults, then the `GPUIO_*` environment overrides.
    pub fn load(path: Option<&Path>) -> Result<Self> {
        let env_path = std::env::var_os("GPUIO_CONFIG")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        let mut config = match path.or(env_path.as_deref()) {
            Some(p) => Self::from_file(p)?,
            None => Self::default(),
        };
        config.apply_env(|k| std::env::var(k).ok())?;
        Ok(config)
    }

    /// Applies `GPUIO_*` overrides read through `get` (the environment, or a test's map).
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<()> {
        fn parse<T: std::str::FromStr>(var: &str, v: &str, expected: &str) -> Result<T> {
            v.trim().parse().map_err(|_| Error::ConfigEnv {
                var: var.into(),
                value: v.into(),
                expected: expected.into(),
            })
        }
        if let Some(v) = get("GPUIO_BACKEND") {
            self.backend = parse("GPUIO_BACKEND", &v, "auto, host or cuda")?;
        }
        if let Some(v) = get("GPUIO_MAX_GPUS") {
            self.max_gpus = parse("GPUIO_MAX_GPUS", &v, "a number of GPUs")?;
        }
        if let Some(v) = get("GPUIO_HOST_DEVICES") {
            self.host_devices = parse("GPUIO_HOST_DEVICES", &v, "a number of devices")?;
        }
        if let Some(v) = get("GPUIO_LOG") {
            self.log_level = v;
        }
        if let Some(v) = get("GPUIO_WORKERS") {
            self.workers = parse("GPUIO_WORKERS", &v, "a number of threads")?;
        }
        if let Some(v) = get("GPUIO_MEMORY_POOL_SIZE") {
            self.memory_pool_size =
                parse("GPUIO_MEMORY_POOL_SIZE", &v, "a size such as 4GiB, or auto")?;
        }
        if let Some(v) = get("GPUIO_SCHED_POLICY") {
            self.scheduler.policy = parse(
                "GPUIO_SCHED_POLICY",
                &v,
                "fifo, priority, deadline or adaptive",
            )?;
        }
        if let Some(v) = get("GPUIO_STAGING_CHUNK") {
            self.memio.chunk_size = parse("GPUIO_STAGING_CHUNK", &v, "a size such as 4MiB")?;
        }
        if let Some(v) = get("GPUIO_PIPELINE_MIN") {
            self.memio.pipeline_min = parse("GPUIO_PIPELINE_MIN", &v, "a size such as 4MiB")?;
        }
        if let Some(v) = get("GPUIO_LOCALIO_ENGINE") {
            self.localio.engine = parse("GPUIO_LOCALIO_ENGINE", &v, "auto, uring or posix")?;
        }
        if let Some(v) = get("GPUIO_LOCALIO_GDS") {
            self.localio.gds = parse("GPUIO_LOCALIO_GDS", &v, "auto, on or off")?;
        }
        if let Some(v) = get("GPUIO_RESIDENT_LINGER_MS") {
            self.memio.resident_linger_ms =
                parse("GPUIO_RESIDENT_LINGER_MS", &v, "milliseconds (0: off)")?;
        }
        if let Some(v) = get("GPUIO_PIPELINE_THREADS") {
            self.memio.threads = parse("GPUIO_PIPELINE_THREADS", &v, "a number of threads")?;
        }
        self.cache.apply_env(&get)?;
        self.validate("the environment")
    }

    /// The MemIO engine's configuration.
    pub fn memio_config(&self) -> MemIoConfig {
        let default = MemIoConfig::default();
        MemIoConfig {
            chunk_size: self.memio.chunk_size.as_u64() as usize,
            threads: if self.memio.threads == 0 {
                default.threads
            } else {
                self.memio.threads
            },
            slots_per_lane: self.memio.slots_per_lane,
            pipeline_min: self.memio.pipeline_min.as_u64() as usize,
            parallel_copy_min: default.parallel_copy_min,
            gather_threads: default.gather_threads,
            resident_linger: (self.memio.resident_linger_ms > 0)
                .then(|| std::time::Duration::from_millis(self.memio.resident_linger_ms)),
        }
    }

    /// The staging pool's configuration: the limit `memory_pool_size` gives (resolved now
    /// where it is `auto`), size classes up to both transports' chunks, and buffers pinned for
    /// `gpu` (the transports' lanes pin theirs for their own GPU).
    pub fn pool_config(&self, gpu: Option<Gpu>) -> PoolConfig {
        PoolConfig {
            limit: self.memory_pool_size.bytes(),
            gpu,
            ..pool_classes(&self.memio_config(), &self.localio_config())
        }
    }

    /// The pinned staging one lane needs, MemIO's or LocalIO's whichever is more: the least
    /// `memory_pool_size` may be.
    pub fn lane_staging_bytes(&self) -> u64 {
        let (memio, localio) = (self.memio_config(), self.localio_config());
        let classes = pool_classes(&memio, &localio);
        let memio = memio.lane_staging_bytes(&classes);
        let localio = localio.lane_staging_bytes(&classes);
        memio.max(localio).unwrap_or(u64::MAX)
    }

    /// The scheduler's configuration.
    pub fn scheduler_config(&self) -> SchedulerConfig {
        let sc = &self.scheduler;
        SchedulerConfig {
            workers: self.workers,
            policy: sc.policy,
            max_wait: std::time::Duration::from_micros(sc.max_wait_us),
            lease_linger: std::time::Duration::from_micros(sc.lease_linger_us),
            urgent_window: std::time::Duration::from_micros(sc.urgent_window_us),
            chunk_size: sc.chunk_size.as_u64() as usize,
            engine_in_flight: sc.engine_in_flight.as_u64(),
            session_in_flight: sc.session_in_flight.as_u64(),
            coalesce_max: sc.coalesce_max.as_u64() as usize,
            spin: std::time::Duration::from_micros(sc.spin_us),
            ..SchedulerConfig::default()
        }
    }

    /// The LocalIO engine's configuration.
    pub fn localio_config(&self) -> LocalIoConfig {
        LocalIoConfig {
            engine: self.localio.engine,
            lanes: if self.localio.lanes == 0 {
                LocalIoConfig::default_lanes()
            } else {
                self.localio.lanes
            },
            host_threads: if self.localio.host_threads == 0 {
                gpuio_hal::sys::cpu_count()
            } else {
                self.localio.host_threads
            },
            chunk_size: self.localio.chunk_size.as_u64() as usize,
            slots_per_lane: self.localio.slots_per_lane,
            sqpoll: self.localio.sqpoll,
            checksum: self.localio.checksum,
            gds: self.localio.gds,
            gds_threshold: self.localio.gds_threshold.as_u64().min(usize::MAX as u64) as usize,
            page_cache: self.localio.page_cache,
            page_cache_threshold: self
                .localio
                .page_cache_threshold
                .as_u64()
                .min(usize::MAX as u64) as usize,
            page_cache_threads: self.localio.page_cache_threads,
            page_cache_keep: self.localio.page_cache_keep.bytes(),
        }
    }

    /// This configuration as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render: {e}"))
    }
}

/// The pool's size classes: the default ones, up to the larger transport chunk.
fn pool_classes(memio: &MemIoConfig, localio: &LocalIoConfig) -> PoolConfig {
    let defaults = PoolConfig::default();
    let chunk = memio.chunk_size.max(localio.effective_chunk_size());
    PoolConfig {
        max_class: chunk.next_power_of_two().max(defaults.max_class),
        ..defaults
    }
}

/// Overlays `top` onto `base`, table by table.
fn merge(base: &mut toml::Table, top: toml::Table) {
    for (k, v) in top {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => merge(b, t),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}
