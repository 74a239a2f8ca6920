//! The sections of a [`Config`](super::Config): `[memio]`, `[localio]`, `[scheduler]`,
//! `[agent]` (with its `[[agent.keys]]` and `[[agent.exports]]`) and `[remote]`, as they are
//! written in TOML, and the top-level `memory_pool_size` ([`PoolSize`]). What they become for
//! the engines is built in `mod.rs` and `remote.rs`.

use bytesize::ByteSize;
use gpuio_core::{Policy, SchedulerConfig};
use gpuio_transport_localio::{EnginePreference, GdsPolicy, PageCachePolicy};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// `memory_pool_size`: the most pinned staging memory (MemIO's and LocalIO's lanes together)
/// the session's staging pool may hold — a size, or `"auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoolSize {
    /// A quarter of the host memory the machine can back without swap when the session starts,
    /// and at least 1 GiB ([`gpuio_staging::auto_limit`]): a bound on what staging
    /// may pin, never a reservation — the pool pins only what the lanes ask for.
    #[default]
    Auto,
    /// This many bytes.
    Bytes(ByteSize),
}

impl PoolSize {
    /// The limit in bytes (for `Auto`, what this machine gives now).
    pub fn bytes(self) -> u64 {
        match self {
            Self::Auto => gpuio_staging::auto_limit(),
            Self::Bytes(b) => b.as_u64(),
        }
    }
}

impl std::fmt::Display for PoolSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Bytes(b) => write!(f, "{}", b.display().iec()),
        }
    }
}

impl std::str::FromStr for PoolSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        s.trim().parse().map(Self::Bytes)
    }
}

impl Serialize for PoolSize {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => ser.serialize_str("auto"),
            Self::Bytes(b) => exact_size(b, ser),
        }
    }
}

/// A size as written in TOML, exactly: in the largest binary unit that divides it (`4 MiB`),
/// else in bytes. `ByteSize`'s own text rounds to a tenth of its unit, so a configuration
/// rendered with it would not read back the same (1000000000 bytes as 1000026931).
pub(super) fn exact_size<S: serde::Serializer>(size: &ByteSize, ser: S) -> Result<S::Ok, S::Error> {
    let n = size.as_u64();
    let units = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
    let text = units
        .iter()
        .find(|(shift, _)| n >= 1 << shift && n.trailing_zeros() >= *shift)
        .map_or_else(
            || format!("{n} B"),
            |(shift, unit)| format!("{} {unit}", n >> shift),
        );
    ser.serialize_str(&text)
}

/// [`exact_size`] of a size that may be absent (absent sizes are left out of the TOML).
pub(super) fn exact_size_opt<S: serde::Serializer>(
    size: &Option<ByteSize>,
    ser: S,
) -> Result<S::Ok, S::Error> {
    match size {
        Some(s) => exact_size(s, ser),
        None => ser.serialize_none(),
    }
}

impl<'de> Deserialize<'de> for PoolSize {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        /// What TOML may hold there: a size as a string (or `"auto"`), or a number of bytes.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Bytes(u64),
        }
        match Raw::deserialize(de)? {
            Raw::Text(t) => t.parse().map_err(|e| {
                serde::de::Error::custom(format!(
                    "memory_pool_size {t:?}: expected a size such as \"4 GiB\" or \"auto\" ({e})"
                ))
            }),
            Raw::Bytes(n) => Ok(Self::Bytes(ByteSize::b(n))),
        }
    }
}

/// `[memio]`: the staging pipeline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemIoSection {
    /// Largest staging chunk.
    #[serde(serialize_with = "exact_size")]
    pub chunk_size: ByteSize,
    /// Copy threads and lanes (0: min(cores, 8)).
    pub threads: usize,
    /// Staging buffers per lane.
    pub slots_per_lane: usize,
    /// Pageable copies below this size use the driver's staging.
    #[serde(serialize_with = "exact_size")]
    pub pipeline_min: ByteSize,
    /// Small zero-copy gathers served by a block resident on each GPU, which leaves after
    /// this many milliseconds without one (0: off; else at least 1).
    pub resident_linger_ms: u64,
}

/// `[localio]`: the file engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalIoSection {
    /// io_uring, pread/pwrite, or automatic.
    pub engine: EnginePreference,
    /// Lanes per transfer (0: min(cores, 8)).
    pub lanes: usize,
    /// Threads copying between files and host memory (0: one per core).
    pub host_threads: usize,
    /// Chunk and staging slot size.
    #[serde(serialize_with = "exact_size")]
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
    #[serde(serialize_with = "exact_size")]
    pub gds_threshold: ByteSize,
    /// Whether warm reads into GPU memory come straight from the page cache (auto or off).
    pub page_cache: PageCachePolicy,
    /// Smallest read that registers page cache pages (smaller ones use only kept ones).
    #[serde(serialize_with = "exact_size")]
    pub page_cache_threshold: ByteSize,
    /// Threads registering page cache chunks ahead of the copy.
    pub page_cache_threads: usize,
    /// Pinned bytes kept registered for hot files (a size, 0 for none, or `"auto"`: a quarter
    /// of the memory the machine can back, like `memory_pool_size`).
    pub page_cache_keep: PoolSize,
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
    #[serde(serialize_with = "exact_size")]
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
    /// Offer memory exports over NIXL too (to keys that may write them).
    pub nixl: bool,
    /// Let NIXL use UCX's TCP transport, which checks no keys (trusted networks only).
    pub nixl_tcp: bool,
    /// Exports whose NIXL metadata is published in the registry (trusted fabrics only).
    pub nixl_publish: Vec<String>,
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
    #[serde(serialize_with = "exact_size")]
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
    #[serde(serialize_with = "exact_size_opt")]
    pub max_size: Option<ByteSize>,
    /// Memory of this size to serve (zeroed at start): host memory, or GPU memory with `gpu`.
    #[serde(default)]
    #[serde(serialize_with = "exact_size_opt")]
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
    /// Less urgent leases wait this long (microseconds) after a more urgent class's last.
    pub lease_linger_us: u64,
    /// ADAPTIVE: deadlines this close (microseconds) go first.
    pub urgent_window_us: u64,
    /// Requests above this size are queued as chunks of it.
    #[serde(serialize_with = "exact_size")]
    pub chunk_size: ByteSize,
    /// Bytes in flight per engine.
    #[serde(serialize_with = "exact_size")]
    pub engine_in_flight: ByteSize,
    /// Bytes in flight per session.
    #[serde(serialize_with = "exact_size")]
    pub session_in_flight: ByteSize,
    /// Adjacent small requests merge into transfers up to this size.
    #[serde(serialize_with = "exact_size")]
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
            lease_linger_us: d.lease_linger.as_micros() as u64,
            urgent_window_us: d.urgent_window.as_micros() as u64,
            chunk_size: ByteSize::b(d.chunk_size as u64),
            engine_in_flight: ByteSize::b(d.engine_in_flight),
            session_in_flight: ByteSize::b(d.session_in_flight),
            coalesce_max: ByteSize::b(d.coalesce_max as u64),
            spin_us: d.spin.as_micros() as u64,
        }
    }
}
