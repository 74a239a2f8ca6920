//! Session configuration (`gpuio_config_t`, docs/REFERENCE.md#configuration): built-in defaults
//! (`default.toml`, embedded), an optional TOML file, then `GPUIO_*` environment overrides.

use crate::error::{Error, Result};
use bytesize::ByteSize;
use gpuio_core::{Policy, RetryPolicy, SchedulerConfig};
use gpuio_hal::BackendPreference;
use gpuio_transport_localio::{EnginePreference, GdsPolicy, LocalIoConfig};
use gpuio_transport_memio::MemIoConfig;
use gpuio_transport_remoteio::wire::MAX_DATA;
use gpuio_transport_remoteio::{
    Access, AgentConfig, Credentials, Export, ExportSource, Key, PeerConfig, RegistryConfig, Role,
    TlsClient, TlsServer,
};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The built-in configuration file, with a comment on every setting.
pub const DEFAULT_TOML: &str = include_str!("default.toml");

/// The configuration format this build reads.
pub const API_VERSION: u32 = 1;

/// The largest configuration file read (the built-in one, every comment included, is 8 KiB).
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
    /// The file this configuration was read from, if any (not a setting).
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// `[memio]`: the staging pipeline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemIoSection {
    /// Largest staging chunk.
    pub chunk_size: ByteSize,
    /// Copy threads and lanes (0: min(cores, 8)).
    pub threads: usize,
    /// Staging buffers per lane.
    pub slots_per_lane: usize,
    /// Pageable copies below this size use the driver's staging.
    pub pipeline_min: ByteSize,
}

/// `[localio]`: the file engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalIoSection {
    /// io_uring, pread/pwrite, or automatic.
    pub engine: EnginePreference,
    /// Lanes per transfer (0: min(cores, 8)).
    pub lanes: usize,
    /// Chunk and staging slot size.
    pub chunk_size: ByteSize,
    /// Staging slots per lane.
    pub slots_per_lane: usize,
    /// io_uring submission polling.
    pub sqpoll: bool,
    /// crc32c of every sequential transfer, computed in staging.
    pub checksum: bool,
    /// When transfers go through cuFile.
    pub gds: GdsPolicy,
    /// Smallest transfer sent through cuFile.
    pub gds_threshold: ByteSize,
}

/// `[agent]`: the RemoteIO agent (`gpuio agent`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSection {
    /// Address to listen on (`host:port`; port 0 picks a free one).
    pub listen: String,
    /// Milliseconds a new connection has to authenticate.
    pub handshake_timeout_ms: u64,
    /// Connections still in their handshake, at most (the oldest gives way to a newcomer).
    pub max_handshakes: usize,
    /// Connections in their handshake from one source address, at most.
    pub max_handshakes_per_address: usize,
    /// Authenticated sessions served at once.
    pub max_connections: usize,
    /// Sessions one key may hold at once.
    pub max_sessions_per_key: usize,
    /// Milliseconds one request may take, from its first byte to its answer's last.
    pub io_timeout_ms: u64,
    /// Milliseconds a session may stay silent before it is closed.
    pub idle_timeout_ms: u64,
    /// Bytes all sessions' request buffers may hold together.
    pub buffer_memory: ByteSize,
    /// Runtime threads.
    pub threads: usize,
    /// Keys clients may present.
    pub keys: Vec<AgentKey>,
    /// The segment to register as serving (empty: no registration).
    pub segment: String,
    /// The address clients should use (empty: the listening address).
    pub advertise: String,
    /// This agent's name within the segment (empty: the advertised address).
    pub name: String,
    /// Seconds a registration outlives an agent that died without revoking it.
    pub lease_ttl_s: u64,
    /// TLS certificate chain, PEM (empty: plain TCP).
    pub tls_cert: String,
    /// TLS private key, PEM.
    pub tls_key: String,
    /// Serve memory exports over RDMA too.
    pub rdma: bool,
    /// What is served.
    pub exports: Vec<AgentExport>,
}

/// `[remote]`: RemoteIO clients.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteSection {
    /// The key to present (empty: remoteio:// URIs are refused).
    pub key_id: String,
    /// Environment variable holding the key's secret.
    pub secret_env: String,
    /// File holding the key's secret.
    pub secret_file: String,
    /// Connections per agent.
    pub connections: usize,
    /// Stripe of a large transfer.
    pub stripe_size: ByteSize,
    /// Milliseconds to connect, and to wait for any answer.
    pub timeout_ms: u64,
    /// TLS: CA certificates to trust, PEM (empty: plain TCP).
    pub tls_ca: String,
    /// TLS: the name agents' certificates carry (empty: their IP address).
    pub tls_server_name: String,
    /// RDMA device (empty: the first).
    pub rdma_device: String,
    /// RDMA GID index on port 1.
    pub rdma_gid_index: u8,
    /// etcd endpoints resolving segment names (empty: none).
    pub registry: Vec<String>,
    /// Key prefix in etcd.
    pub registry_prefix: String,
}

/// `[[agent.keys]]`: a pre-shared key. The secret is read from the environment or a file,
/// never written in the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentKey {
    /// The name clients send.
    pub id: String,
    /// `"read-only"` or `"read-write"`.
    pub role: String,
    /// Environment variable holding the secret.
    #[serde(default)]
    pub secret_env: Option<String>,
    /// File holding the secret (its bytes, trailing newline removed).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
}

/// `[[agent.exports]]`: a file or a region of host memory served under a name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentExport {
    /// The name clients ask for.
    pub name: String,
    /// `"read-only"` or `"read-write"`.
    pub access: String,
    /// A file to serve.
    #[serde(default)]
    pub file: Option<PathBuf>,
    /// For a file: the size writes may grow it to (default: its size at start).
    #[serde(default)]
    pub max_size: Option<ByteSize>,
    /// Memory of this size to serve (zeroed at start): host memory, or GPU memory with `gpu`.
    #[serde(default)]
    pub memory: Option<ByteSize>,
    /// Serve `memory` from this GPU instead of host memory.
    #[serde(default)]
    pub gpu: Option<u32>,
}

/// `[scheduler]`: ordering, preemption points, backpressure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerSection {
    /// fifo, priority, deadline or adaptive.
    pub policy: Policy,
    /// Starvation bound, microseconds.
    pub max_wait_us: u64,
    /// ADAPTIVE: deadlines this close (microseconds) go first.
    pub urgent_window_us: u64,
    /// Requests above this size are queued as chunks of it.
    pub chunk_size: ByteSize,
    /// Bytes in flight per engine.
    pub engine_in_flight: ByteSize,
    /// Bytes in flight per session.
    pub session_in_flight: ByteSize,
    /// Adjacent small requests merge into transfers up to this size.
    pub coalesce_max: ByteSize,
    /// Idle workers spin this long (microseconds) before sleeping.
    pub spin_us: u64,
}

impl Default for SchedulerSection {
    fn default() -> Self {
        let d = SchedulerConfig::default();
        Self {
            policy: d.policy,
            max_wait_us: d.max_wait.as_micros() as u64,
            urgent_window_us: d.urgent_window.as_micros() as u64,
            chunk_size: ByteSize::b(d.chunk_size as u64),
            engine_in_flight: ByteSize::b(d.engine_in_flight),
            session_in_flight: ByteSize::b(d.session_in_flight),
            coalesce_max: ByteSize::b(d.coalesce_max as u64),
            spin_us: d.spin.as_micros() as u64,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        // The embedded file is the single source of the defaults; a unit test keeps it valid.
        Self::from_toml(DEFAULT_TOML, None).unwrap_or_else(|e| {
            tracing::error!(error = %e, "the built-in configuration does not parse");
            Self::fallback()
        })
    }
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
            memio: MemIoSection {
                chunk_size: ByteSize::mib(4),
                threads: 0,
                slots_per_lane: 3,
                pipeline_min: ByteSize::mib(4),
            },
            localio: LocalIoSection {
                engine: EnginePreference::Auto,
                lanes: 0,
                chunk_size: ByteSize::mib(4),
                slots_per_lane: 4,
                sqpoll: false,
                checksum: false,
                gds: GdsPolicy::Auto,
                gds_threshold: ByteSize::mib(1),
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
            source: None,
        }
    }

    /// Parses a TOML document. Settings it leaves out keep their defaults.
    pub fn from_toml(text: &str, source: Option<&Path>) -> Result<Self> {
        let name = || source.map_or_else(|| "<built-in>".into(), |p| p.display().to_string());
        let mut merged: toml::Table = toml::from_str(DEFAULT_TOML).map_err(|e| Error::Config {
            source_name: "<built-in>".into(),
            message: e.to_string(),
        })?;
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

    /// The configuration in effect: `path` (or `$GPUIO_CONFIG`) if given, else the defaults,
    /// then the `GPUIO_*` environment overrides.
    pub fn load(path: Option<&Path>) -> Result<Self> {
        let env_path = std::env::var_os("GPUIO_CONFIG").map(PathBuf::from);
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
        if let Some(v) = get("GPUIO_PIPELINE_THREADS") {
            self.memio.threads = parse("GPUIO_PIPELINE_THREADS", &v, "a number of threads")?;
        }
        self.validate("the environment")
    }

    fn validate(&self, source_name: &str) -> Result<()> {
        let bad = |message: String| {
            Err(Error::Config {
                source_name: source_name.into(),
                message,
            })
        };
        if self.api_version != API_VERSION {
            return bad(format!(
                "api_version {} is not supported (this build reads version {API_VERSION})",
                self.api_version
            ));
        }
        if !(1..=1024).contains(&self.workers) {
            return bad(format!("workers = {}: must be 1 to 1024", self.workers));
        }
        if self.memio.threads > gpuio_transport_memio::MAX_THREADS {
            return bad(format!(
                "memio.threads = {}: at most {}",
                self.memio.threads,
                gpuio_transport_memio::MAX_THREADS
            ));
        }
        let chunk_ok =
            |c: ByteSize| (4096..=gpuio_transport_memio::MAX_CHUNK as u64).contains(&c.as_u64());
        if !chunk_ok(self.memio.chunk_size) || !chunk_ok(self.localio.chunk_size) {
            return bad("staging chunk sizes must be from 4 KiB to 1 GiB".into());
        }
        if !(2..=64).contains(&self.memio.slots_per_lane)
            || !(2..=64).contains(&self.localio.slots_per_lane)
        {
            return bad("slots_per_lane must be 2 to 64".into());
        }
        if self.localio.lanes > 256 {
            return bad(format!(
                "localio.lanes = {}: at most 256",
                self.localio.lanes
            ));
        }
        let sc = &self.scheduler;
        if !(4096..=(1u64 << 30)).contains(&sc.chunk_size.as_u64()) {
            return bad("scheduler.chunk_size must be from 4 KiB to 1 GiB".into());
        }
        if sc.engine_in_flight.as_u64() < 4096 || sc.session_in_flight.as_u64() < 4096 {
            return bad("scheduler in-flight budgets must be at least 4 KiB".into());
        }
        if sc.coalesce_max.as_u64() > (1u64 << 30) {
            return bad("scheduler.coalesce_max must be at most 1 GiB".into());
        }
        if sc.max_wait_us > 60_000_000 || sc.urgent_window_us > 60_000_000 || sc.spin_us > 10_000 {
            return bad(
                "scheduler: max_wait_us and urgent_window_us at most 60 s, spin_us at most 10 ms"
                    .into(),
            );
        }
        if !(1..=64).contains(&self.host_devices) {
            return bad("host_devices must be 1 to 64".into());
        }
        self.validate_retry_and_remote().or_else(bad)
    }

    /// The settings of `[retry]`, `[agent]` and `[remote]`: a zero that would hang (no
    /// connection ever served, a timeout that has always expired, a lease that is gone before
    /// it is renewed) or an unbounded count is refused, naming the key.
    fn validate_retry_and_remote(&self) -> std::result::Result<(), String> {
        fn within<T: PartialOrd + std::fmt::Display>(
            key: &str,
            value: T,
            range: std::ops::RangeInclusive<T>,
            unit: &str,
        ) -> std::result::Result<(), String> {
            if range.contains(&value) {
                return Ok(());
            }
            Err(format!(
                "{key} = {value}: must be {} to {}{unit}",
                range.start(),
                range.end()
            ))
        }
        // Timeouts: from a millisecond to an hour.
        const MAX_TIMEOUT_MS: u64 = 3_600_000;
        let r = &self.retry;
        within("retry.max_retries", r.max_retries, 0..=100, "")?;
        within(
            "retry.max_backoff_us",
            r.max_backoff_us,
            0..=60_000_000,
            " (microseconds)",
        )?;
        within(
            "retry.initial_backoff_us",
            r.initial_backoff_us,
            0..=r.max_backoff_us,
            " (microseconds, at most max_backoff_us)",
        )?;
        if !(r.backoff_multiplier.is_finite() && (1.0..=1000.0).contains(&r.backoff_multiplier)) {
            return Err(format!(
                "retry.backoff_multiplier = {}: must be a number from 1 to 1000",
                r.backoff_multiplier
            ));
        }
        let a = &self.agent;
        within(
            "agent.handshake_timeout_ms",
            a.handshake_timeout_ms,
            1..=MAX_TIMEOUT_MS,
            " (milliseconds)",
        )?;
        within("agent.max_connections", a.max_connections, 1..=65_536, "")?;
        within("agent.max_handshakes", a.max_handshakes, 1..=65_536, "")?;
        within(
            "agent.max_handshakes_per_address",
            a.max_handshakes_per_address,
            1..=65_536,
            "",
        )?;
        within(
            "agent.max_sessions_per_key",
            a.max_sessions_per_key,
            1..=65_536,
            "",
        )?;
        for (key, ms) in [
            ("agent.io_timeout_ms", a.io_timeout_ms),
            ("agent.idle_timeout_ms", a.idle_timeout_ms),
        ] {
            within(key, ms, 1..=MAX_TIMEOUT_MS, " (milliseconds)")?;
        }
        if !(MAX_DATA as u64..=1 << 40).contains(&a.buffer_memory.as_u64()) {
            return Err(format!(
                "agent.buffer_memory = {}: must hold one message ({}) and be at most 1 TiB",
                a.buffer_memory,
                ByteSize::b(MAX_DATA as u64).display().iec()
            ));
        }
        within("agent.threads", a.threads, 1..=64, "")?;
        // Renewed every third of it; etcd's leases need a couple of seconds.
        within("agent.lease_ttl_s", a.lease_ttl_s, 2..=86_400, " (seconds)")?;
        for e in &a.exports {
            if e.memory.is_some_and(|m| m.as_u64() == 0) {
                return Err(format!(
                    "agent.exports {:?}: memory = 0: nothing would be served",
                    e.name
                ));
            }
        }
        let rm = &self.remote;
        within("remote.connections", rm.connections, 1..=256, "")?;
        within(
            "remote.timeout_ms",
            rm.timeout_ms,
            1..=MAX_TIMEOUT_MS,
            " (milliseconds)",
        )?;
        if !(4096..=MAX_DATA as u64).contains(&rm.stripe_size.as_u64()) {
            return Err(format!(
                "remote.stripe_size = {}: must be from 4 KiB to {} (a request's largest payload)",
                rm.stripe_size,
                ByteSize::b(MAX_DATA as u64).display().iec()
            ));
        }
        Ok(())
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
        }
    }

    /// The agent's configuration: addresses parsed, secrets read, memory exports allocated.
    pub fn agent_config(&self) -> Result<AgentConfig> {
        let a = &self.agent;
        let bad = |message: String| Error::Config {
            source_name: self
                .source
                .as_ref()
                .map_or_else(|| "<built-in>".into(), |p| p.display().to_string()),
            message,
        };
        let listen = a
            .listen
            .parse()
            .map_err(|_| bad(format!("agent.listen {:?} is not host:port", a.listen)))?;
        let mut cfg = AgentConfig::new(listen);
        let ms = std::time::Duration::from_millis;
        cfg.handshake_timeout = ms(a.handshake_timeout_ms);
        cfg.max_handshakes = a.max_handshakes;
        cfg.max_handshakes_per_address = a.max_handshakes_per_address;
        cfg.max_connections = a.max_connections;
        cfg.max_sessions_per_key = a.max_sessions_per_key;
        cfg.io_timeout = ms(a.io_timeout_ms);
        cfg.idle_timeout = ms(a.idle_timeout_ms);
        cfg.buffer_memory = a.buffer_memory.as_u64() as usize;
        cfg.threads = a.threads;
        cfg.tls = match (a.tls_cert.is_empty(), a.tls_key.is_empty()) {
            (true, true) => None,
            (false, false) => Some(
                TlsServer::from_pem_files(Path::new(&a.tls_cert), Path::new(&a.tls_key))
                    .map_err(|e| bad(format!("agent TLS: {e}")))?,
            ),
            _ => return Err(bad("agent.tls_cert and agent.tls_key go together".into())),
        };
        if a.rdma {
            #[cfg(feature = "rdma")]
            {
                cfg.rdma = Some(self.rdma_options());
            }
            #[cfg(not(feature = "rdma"))]
            return Err(bad(
                "agent.rdma: this build has no RDMA verbs (cargo feature `rdma`)".into(),
            ));
        }
        for k in &a.keys {
            let role = match k.role.as_str() {
                "read-only" => Role::ReadOnly,
                "read-write" => Role::ReadWrite,
                other => {
                    return Err(bad(format!(
                        "key {:?}: role {other:?} is not read-only or read-write",
                        k.id
                    )));
                }
            };
            let secret = read_secret(&k.id, k.secret_env.as_deref(), k.secret_file.as_deref())
                .map_err(bad)?;
            cfg.keys.push(Key {
                id: k.id.clone(),
                secret,
                role,
            });
        }
        for e in &a.exports {
            let access = match e.access.as_str() {
                "read-only" => Access::ReadOnly,
                "read-write" => Access::ReadWrite,
                other => {
                    return Err(bad(format!(
                        "export {:?}: access {other:?} is not read-only or read-write",
                        e.name
                    )));
                }
            };
            if e.gpu.is_some() && e.memory.is_none() {
                return Err(bad(format!(
                    "export {:?}: gpu goes with memory (its size)",
                    e.name
                )));
            }
            let source = match (&e.file, e.memory) {
                (Some(path), None) => ExportSource::File {
                    path: path.clone(),
                    max_len: e.max_size.map(|s| s.as_u64()),
                },
                (None, Some(size)) => {
                    let len = usize::try_from(size.as_u64())
                        .map_err(|_| bad(format!("export {:?}: too large", e.name)))?;
                    match e.gpu {
                        None => {
                            let buf = gpuio_hal::HostBuffer::alloc(len, &Default::default())?;
                            ExportSource::Memory(gpuio_transport_remoteio::shared_memory(buf))
                        }
                        Some(n) => {
                            let probe = gpuio_hal::probe_with(self.backend, self.host_devices)?;
                            let gpu = probe.gpus.get(n as usize).ok_or_else(|| {
                                bad(format!(
                                    "export {:?}: gpu {n}, but this machine has {} GPUs",
                                    e.name,
                                    probe.gpus.len()
                                ))
                            })?;
                            let buf = gpu.alloc(len)?;
                            // Zeroed, like a host memory export.
                            let zeros = vec![0u8; len.min(64 << 20)];
                            let stream = gpu.stream()?;
                            let mut at = 0;
                            while at < len {
                                let n = (len - at).min(zeros.len());
                                stream.upload(&zeros[..n], &buf, at)?;
                                at += n;
                            }
                            ExportSource::Device(buf)
                        }
                    }
                }
                _ => {
                    return Err(bad(format!(
                        "export {:?}: give exactly one of file, memory",
                        e.name
                    )));
                }
            };
            cfg.exports.push(Export {
                name: e.name.clone(),
                source,
                access,
            });
        }
        Ok(cfg)
    }

    fn config_error(&self, message: String) -> Error {
        Error::Config {
            source_name: self
                .source
                .as_ref()
                .map_or_else(|| "<built-in>".into(), |p| p.display().to_string()),
            message,
        }
    }

    /// The credentials RemoteIO clients present (`None`: no `[remote] key_id`).
    pub fn remote_credentials(&self) -> Result<Option<Credentials>> {
        let r = &self.remote;
        if r.key_id.is_empty() {
            return Ok(None);
        }
        let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        let file = nonempty(&r.secret_file).map(PathBuf::from);
        let secret = read_secret(
            &r.key_id,
            nonempty(&r.secret_env).as_deref(),
            file.as_deref(),
        )
        .map_err(|m| self.config_error(format!("[remote] {m}")))?;
        Ok(Some(Credentials {
            key_id: r.key_id.clone(),
            secret,
        }))
    }

    /// How RemoteIO clients connect to the agent at `addr` (the TLS trust read here), over
    /// RDMA verbs for memory exports when `rdma`.
    pub fn peer_config(
        &self,
        addr: SocketAddr,
        credentials: Credentials,
        rdma: bool,
    ) -> Result<PeerConfig> {
        let r = &self.remote;
        let mut cfg = PeerConfig::new(addr, credentials);
        // Checked when the configuration was loaded; the clamps keep a hand-built one sane.
        cfg.connections = r.connections.max(1);
        cfg.stripe_bytes = (r.stripe_size.as_u64() as usize).clamp(4096, MAX_DATA);
        cfg.timeout = std::time::Duration::from_millis(r.timeout_ms.max(1));
        if !r.tls_ca.is_empty() {
            cfg.tls = Some(
                TlsClient::from_ca_pem_file(Path::new(&r.tls_ca))
                    .map_err(|e| self.config_error(format!("[remote] tls_ca: {e}")))?,
            );
        }
        if !r.tls_server_name.is_empty() {
            cfg.server_name = Some(r.tls_server_name.clone());
        }
        if rdma {
            cfg = self.with_rdma(cfg)?;
        }
        Ok(cfg)
    }

    #[cfg(feature = "rdma")]
    fn with_rdma(&self, mut cfg: PeerConfig) -> Result<PeerConfig> {
        cfg.rdma = Some(self.rdma_options());
        Ok(cfg)
    }

    #[cfg(not(feature = "rdma"))]
    fn with_rdma(&self, _cfg: PeerConfig) -> Result<PeerConfig> {
        Err(Error::Unsupported {
            what: "RemoteIO over RDMA".into(),
            reason: "this build has no RDMA verbs (cargo feature `rdma`); use transport=tcp".into(),
        })
    }

    /// The RDMA device `[remote]` names.
    #[cfg(feature = "rdma")]
    pub fn rdma_options(&self) -> gpuio_transport_remoteio::rdma::RdmaOptions {
        let r = &self.remote;
        gpuio_transport_remoteio::rdma::RdmaOptions {
            device: (!r.rdma_device.is_empty()).then(|| r.rdma_device.clone()),
            gid_index: r.rdma_gid_index,
        }
    }

    /// The registry's configuration (`None`: no `[remote] registry`).
    pub fn registry_config(&self) -> Option<RegistryConfig> {
        let r = &self.remote;
        (!r.registry.is_empty()).then(|| RegistryConfig {
            endpoints: r.registry.clone(),
            prefix: r.registry_prefix.clone(),
            timeout: std::time::Duration::from_millis(r.timeout_ms.clamp(100, 10_000)),
        })
    }

    /// The scheduler's configuration.
    pub fn scheduler_config(&self) -> SchedulerConfig {
        let sc = &self.scheduler;
        SchedulerConfig {
            workers: self.workers,
            policy: sc.policy,
            max_wait: std::time::Duration::from_micros(sc.max_wait_us),
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
        let default = LocalIoConfig::default();
        LocalIoConfig {
            engine: self.localio.engine,
            lanes: if self.localio.lanes == 0 {
                default.lanes
            } else {
                self.localio.lanes
            },
            chunk_size: self.localio.chunk_size.as_u64() as usize,
            slots_per_lane: self.localio.slots_per_lane,
            sqpoll: self.localio.sqpoll,
            checksum: self.localio.checksum,
            gds: self.localio.gds,
            gds_threshold: self.localio.gds_threshold.as_u64().min(usize::MAX as u64) as usize,
        }
    }

    /// This configuration as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render: {e}"))
    }
}

/// A key's secret, from exactly one of an environment variable and a file (whose trailing
/// newline is dropped). The file must be a regular file of at most [`MAX_SECRET_BYTES`] that
/// only its owner can read or write, as ssh requires of private keys.
fn read_secret(
    key: &str,
    env: Option<&str>,
    file: Option<&Path>,
) -> std::result::Result<Vec<u8>, String> {
    match (env, file) {
        (Some(var), None) => std::env::var(var)
            .map(String::into_bytes)
            .map_err(|_| format!("key {key:?}: ${var} is not set")),
        (None, Some(path)) => {
            let mut bytes = read_small_file(path, MAX_SECRET_BYTES, "secret files", true)
                .map_err(|e| format!("key {key:?}: {}: {e}", path.display()))?;
            while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                bytes.pop();
            }
            Ok(bytes)
        }
        _ => Err(format!(
            "key {key:?}: give exactly one of secret_env, secret_file"
        )),
    }
}

/// What a file is, for an error that refuses it.
fn file_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// Reads a regular file of at most `cap` bytes (`what` names such files in the error). A
/// special file is refused before it is opened (opening a device can have effects of its
/// own); the open itself does not block (O_NONBLOCK: a FIFO swapped in meanwhile would wait
/// for a writer forever) and its type is checked again on the open file. A `private` file
/// (a secret) must not be readable or writable by group or others.
fn read_small_file(
    path: &Path,
    cap: u64,
    what: &str,
    private: bool,
) -> std::result::Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let regular = |meta: &std::fs::Metadata| {
        if meta.is_file() {
            Ok(())
        } else {
            Err(format!(
                "is {}, and {what} must be regular files",
                file_kind(meta.file_type())
            ))
        }
    };
    regular(&std::fs::metadata(path).map_err(|e| e.to_string())?)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    regular(&meta)?;
    if private {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "is readable or writable by others (mode {mode:04o}): {what} must be private \
                 to their owner; run `chmod 600 {}`",
                path.display()
            ));
        }
    }
    if meta.len() > cap {
        return Err(format!(
            "is {} bytes; {what} are at most {cap} bytes",
            meta.len()
        ));
    }
    let mut bytes = Vec::new();
    // The size can change after the check: never read more than the cap.
    file.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > cap {
        return Err(format!(
            "is larger than {cap} bytes, the most {what} may be"
        ));
    }
    Ok(bytes)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn the_embedded_defaults_parse() {
        let c = Config::from_toml(DEFAULT_TOML, None).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.memio.chunk_size, ByteSize::mib(4));
        assert_eq!(c.retry, RetryPolicy::default());
        let round = Config::from_toml(&c.to_toml(), None).unwrap();
        assert_eq!(round, c);
    }

    #[test]
    fn files_override_only_what_they_name() {
        let c = Config::from_toml("workers = 9\n[memio]\nchunk_size = \"2MiB\"\n", None).unwrap();
        assert_eq!(c.workers, 9);
        assert_eq!(c.memio.chunk_size, ByteSize::mib(2));
        assert_eq!(c.memio.slots_per_lane, 3);
        assert_eq!(c.localio, Config::default().localio);
    }

    #[test]
    fn bad_files_name_the_problem() {
        let e = Config::from_toml("wrokers = 2", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("wrokers"), "{e}");
        let e = Config::from_toml("workers = \"many\"", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("workers"), "{e}");
        let e = Config::from_toml("api_version = 7", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("api_version 7"), "{e}");
        let e = Config::from_toml("[memio]\nslots_per_lane = 1", None).unwrap_err();
        assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg);
        for bad in [
            "workers = 100000",
            "[memio]\nthreads = 5000",
            "[localio]\nchunk_size = \"8 GiB\"",
        ] {
            assert!(Config::from_toml(bad, None).is_err(), "{bad}");
        }
        let e = Config::from_file(Path::new("/nonexistent/gpuio.toml")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/gpuio.toml"));
    }

    #[test]
    fn environment_overrides_and_rejects_garbage() {
        let env: HashMap<&str, &str> = [
            ("GPUIO_BACKEND", "host"),
            ("GPUIO_STAGING_CHUNK", "8MiB"),
            ("GPUIO_WORKERS", "2"),
        ]
        .into();
        let mut c = Config::default();
        c.apply_env(|k| env.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(c.backend, BackendPreference::Host);
        assert_eq!(c.memio.chunk_size, ByteSize::mib(8));
        assert_eq!(c.workers, 2);
        let err = c
            .apply_env(|k| (k == "GPUIO_MAX_GPUS").then(|| "lots".to_string()))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("GPUIO_MAX_GPUS") && err.contains("lots"),
            "{err}"
        );
    }

    #[test]
    fn settings_that_would_hang_or_overflow_are_refused_naming_the_key() {
        let cases = [
            (
                "[agent]\nhandshake_timeout_ms = 0",
                "agent.handshake_timeout_ms",
            ),
            (
                "[agent]\nhandshake_timeout_ms = 9000000000",
                "agent.handshake_timeout_ms",
            ),
            ("[agent]\nmax_connections = 0", "agent.max_connections"),
            ("[agent]\nmax_handshakes = 0", "agent.max_handshakes"),
            (
                "[agent]\nmax_handshakes_per_address = 0",
                "agent.max_handshakes_per_address",
            ),
            (
                "[agent]\nmax_sessions_per_key = 0",
                "agent.max_sessions_per_key",
            ),
            ("[agent]\nio_timeout_ms = 0", "agent.io_timeout_ms"),
            ("[agent]\nidle_timeout_ms = 0", "agent.idle_timeout_ms"),
            ("[agent]\nbuffer_memory = \"1 MiB\"", "agent.buffer_memory"),
            ("[agent]\nthreads = 0", "agent.threads"),
            ("[agent]\nthreads = 65", "agent.threads"),
            ("[agent]\nlease_ttl_s = 0", "agent.lease_ttl_s"),
            (
                "[agent]\nlease_ttl_s = 9223372036854775807",
                "agent.lease_ttl_s",
            ),
            (
                "[[agent.exports]]\nname = \"m\"\naccess = \"read-only\"\nmemory = \"0 B\"",
                "memory = 0",
            ),
            ("[remote]\nconnections = 0", "remote.connections"),
            ("[remote]\nconnections = 100000", "remote.connections"),
            ("[remote]\ntimeout_ms = 0", "remote.timeout_ms"),
            ("[remote]\nstripe_size = \"0 B\"", "remote.stripe_size"),
            ("[remote]\nstripe_size = \"1 GiB\"", "remote.stripe_size"),
            ("[retry]\nmax_retries = 4000000000", "retry.max_retries"),
            (
                "[retry]\nmax_backoff_us = 9223372036854775807",
                "retry.max_backoff_us",
            ),
            (
                "[retry]\ninitial_backoff_us = 200000",
                "retry.initial_backoff_us",
            ),
            (
                "[retry]\nbackoff_multiplier = nan",
                "retry.backoff_multiplier",
            ),
            (
                "[retry]\nbackoff_multiplier = inf",
                "retry.backoff_multiplier",
            ),
            (
                "[retry]\nbackoff_multiplier = -2.0",
                "retry.backoff_multiplier",
            ),
        ];
        for (text, key) in cases {
            let e = Config::from_toml(text, None).expect_err(text);
            assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg, "{text}");
            assert!(e.to_string().contains(key), "{text}: {e}");
        }
        // The edges of each range are taken.
        let fine = "[agent]\nhandshake_timeout_ms = 1\nmax_connections = 1\nthreads = 64\n\
                    lease_ttl_s = 2\n[remote]\nconnections = 1\ntimeout_ms = 3600000\n\
                    stripe_size = \"16 MiB\"\n[retry]\nmax_retries = 0\nbackoff_multiplier = 1.0";
        Config::from_toml(fine, None).unwrap();
    }

    /// Runs `f` on its own thread, failing if it does not return in 20 s (a FIFO read blocks).
    fn within_20s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(f()));
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("blocked: a special file was opened or read as if it were regular")
    }

    fn mkfifo(path: &Path) {
        let ok = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mkfifo {}", path.display());
    }

    #[test]
    fn configuration_files_must_be_small_regular_files() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.toml");
        mkfifo(&fifo);
        let big = dir.path().join("big.toml");
        // Valid TOML (comments) just over the cap.
        let line = format!("# {}\n", "x".repeat(1021));
        std::fs::write(&big, line.repeat((MAX_CONFIG_BYTES / 1024) as usize + 1)).unwrap();
        let exact = dir.path().join("exact.toml");
        let mut text = "workers = 3\n".to_string();
        text += &"#".repeat(MAX_CONFIG_BYTES as usize - text.len());
        std::fs::write(&exact, text).unwrap();
        assert_eq!(Config::from_file(&exact).unwrap().workers, 3);
        let cases = [
            (fifo, "a FIFO"),
            (PathBuf::from("/dev/zero"), "a character device"),
            (dir.path().to_path_buf(), "a directory"),
            (big, "bytes"),
        ];
        for (path, kind) in cases {
            let e = within_20s(move || Config::from_file(&path).map(|_| ()));
            let e = e.unwrap_err();
            assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg);
            assert!(e.to_string().contains(kind), "{e}");
        }
    }

    #[test]
    fn secret_files_must_be_small_private_regular_files() {
        use std::os::unix::fs::PermissionsExt;
        const SECRET: &str = "4d1f0c9a7e3b52d86a0f1e9c3b7d5a2e8c6f4b1a9d3e7c5f2b8a6d4e1c9f7b3a";
        let dir = tempfile::tempdir().unwrap();
        let key = |path: &Path| -> Result<Vec<u8>> {
            let text = format!(
                "[[agent.keys]]\nid = \"k\"\nrole = \"read-only\"\nsecret_file = {:?}\n\
                 [remote]\nkey_id = \"k\"\nsecret_file = {:?}",
                path.display().to_string(),
                path.display().to_string()
            );
            let c = Config::from_toml(&text, None)?;
            let from_remote = c.remote_credentials()?.map(|k| k.secret);
            let from_agent = c.agent_config()?.keys[0].secret.clone();
            assert_eq!(from_remote.as_ref(), Some(&from_agent));
            Ok(from_agent)
        };
        let file = dir.path().join("key");
        std::fs::write(&file, format!("{SECRET}\n")).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(key(&file).unwrap(), SECRET.as_bytes());
        for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o660] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = key(&file).unwrap_err().to_string();
            assert!(
                e.contains("chmod 600") && e.contains("key \"k\""),
                "{mode:o}: {e}"
            );
        }
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'a'; MAX_SECRET_BYTES as usize + 1]).unwrap();
        std::fs::set_permissions(&big, std::fs::Permissions::from_mode(0o600)).unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        std::fs::set_permissions(&fifo, std::fs::Permissions::from_mode(0o600)).unwrap();
        for (path, kind) in [
            (big, "at most"),
            (fifo, "a FIFO"),
            (PathBuf::from("/dev/zero"), "a character device"),
        ] {
            let e = within_20s(move || key(&path).map(|_| ())).unwrap_err();
            assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg);
            assert!(e.to_string().contains(kind), "{e}");
        }
    }
}
