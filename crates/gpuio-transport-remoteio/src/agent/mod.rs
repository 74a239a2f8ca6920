//! The gpuio agent: serves named exports of host memory, GPU memory and files to clients that
//! prove they hold a key.
//!
//! One task per connection. A connection is accepted at once and admitted among the pending
//! handshakes (`gate.rs`: a small budget of their own, bounded per source prefix, the least
//! advanced giving way to newcomers), then must complete the HELLO handshake — the client
//! proves its key first — within `handshake_timeout`, reading at most a HELLO's worth of
//! bytes. Only then does it take one of `max_connections` session places, shared fairly among
//! keys (`slots.rs`), and its requests are served in order (`session.rs`): each must arrive
//! and be answered within `io_timeout`, and a connection idle for `idle_timeout` is closed.
//! Every request is checked against its export and the key's role (`serve.rs`); a refused
//! request gets an ERROR and the connection goes on; a protocol violation ends that
//! connection only.
//!
//! No export lock is ever held across socket IO: reads copy from exports into the session's
//! buffer a piece at a time, writes are received whole into it and then copied in. The
//! buffers of all sessions together are bounded by `buffer_memory`, shared fairly among keys
//! (`buffer.rs`), and an idle session gives its buffer back.
//!
//! Every agent draws a random instance number when it starts and tells it to clients (in the
//! welcome and in STAT answers), so a client can tell a restarted agent — whose memory exports
//! start afresh — from the one it was talking to.

mod buffer;
mod gate;
mod serve;
mod session;
mod slots;

use crate::auth::{self, Key};
use crate::tls::TlsServer;
use crate::{RemoteIoError, Result};
use gpuio_hal::{DeviceBuffer, HostBuffer};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{RwLock, watch};

/// Whether an export may be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Reads only.
    ReadOnly,
    /// Reads and writes (by keys whose role allows writes).
    ReadWrite,
}

/// Host memory an agent exports, shared with the exporting program. The agent holds its lock
/// only while it copies bytes between the export and its own buffers, never while they cross
/// the network; the program takes it with `blocking_read` / `blocking_write` (outside async
/// code) or `read().await` / `write().await`.
pub type SharedMemory = Arc<RwLock<HostBuffer>>;

/// Shares `buf` for export.
pub fn shared_memory(buf: HostBuffer) -> SharedMemory {
    Arc::new(RwLock::new(buf))
}

/// What an export serves.
#[derive(Debug, Clone)]
pub enum ExportSource {
    /// Host memory, shared with the exporting program.
    Memory(SharedMemory),
    /// GPU memory (moved through the agent's host memory by the GPU's copy engines; RDMA
    /// cannot reach it without GPUDirect).
    Device(DeviceBuffer),
    /// A regular file. Reads stop at its length; writes may extend it up to `max_len`
    /// (default: its length when the agent starts).
    File {
        /// The file.
        path: PathBuf,
        /// The largest size writes may grow it to.
        max_len: Option<u64>,
    },
}

/// A named export.
#[derive(Debug, Clone)]
pub struct Export {
    /// The name clients ask for.
    pub name: String,
    /// What it serves.
    pub source: ExportSource,
    /// Whether it may be written.
    pub access: Access,
}

/// How an agent runs. Every count and duration must be positive.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Where to listen (port 0: any free port; see [`Agent::local_addr`]).
    pub listen: SocketAddr,
    /// The keys clients may present (each secret must pass [`auth::check_secret`]).
    pub keys: Vec<Key>,
    /// What is served.
    pub exports: Vec<Export>,
    /// How long a new connection has to complete the handshake (TLS included).
    pub handshake_timeout: Duration,
    /// Connections still in their handshake, at most; past it one gives way (see the gate:
    /// the least advanced of the prefix holding the most).
    pub max_handshakes: usize,
    /// Connections in their handshake from one source address (an IPv6 /64), at most; its
    /// /24 (/56) may hold twice that, its /20 (/48) three times, its /16 (/32) four times.
    pub max_handshakes_per_address: usize,
    /// Authenticated sessions served at once; more are refused with `Busy`.
    pub max_connections: usize,
    /// Sessions one key may hold at once; more are refused with `Busy`.
    pub max_sessions_per_key: usize,
    /// Time one request may take, from its first byte to its answer's last, before its
    /// connection is closed.
    pub io_timeout: Duration,
    /// Time a session may stay silent between requests before it is closed (clients
    /// reconnect on their next request).
    pub idle_timeout: Duration,
    /// Bytes all sessions' request buffers may hold together (at least one message's,
    /// [`MAX_DATA`](crate::wire::MAX_DATA)); a request waits for room.
    pub buffer_memory: usize,
    /// Runtime threads.
    pub threads: usize,
    /// TLS: the agent's certificate (`None`: plain TCP).
    pub tls: Option<TlsServer>,
    /// RDMA: the device to serve memory exports over (`None`: TCP only).
    #[cfg(feature = "rdma")]
    pub rdma: Option<crate::rdma::RdmaOptions>,
    /// NIXL: offer memory exports over NIXL to sessions that may write them (the agent does
    /// not start where this process has no NIXL).
    #[cfg(feature = "nixl")]
    pub nixl: bool,
    /// NIXL over UCX's TCP transport, which checks no keys: any peer that reaches the
    /// process's UCX ports can read and write its memory. Without this the agent does not
    /// start with NIXL while `UCX_TLS` lets UCX use TCP (set it to `^tcp`, or to transports
    /// that check keys: RDMA, `cuda_ipc`; shared memory and CMA stay within the same user).
    #[cfg(feature = "nixl")]
    pub nixl_tcp: bool,
    /// NIXL: exports given a NIXL link of their own at start, living as long as the agent,
    /// whose metadata [`Agent::nixl_published`] hands out for publishing (trusted fabrics:
    /// whoever holds it can read and write the export). Read-write memory exports; needs
    /// `nixl`.
    #[cfg(feature = "nixl")]
    pub nixl_publish: Vec<String>,
}

impl AgentConfig {
    /// A configuration listening on `listen` with no keys or exports yet.
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            keys: Vec::new(),
            exports: Vec::new(),
            handshake_timeout: Duration::from_secs(3),
            max_handshakes: 512,
            // A client node opens many connections at once (several per GPU worker).
            max_handshakes_per_address: 128,
            max_connections: 256,
            max_sessions_per_key: 64,
            io_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(120),
            buffer_memory: 1 << 30,
            threads: 2,
            tls: None,
            #[cfg(feature = "rdma")]
            rdma: None,
            #[cfg(feature = "nixl")]
            nixl: false,
            #[cfg(feature = "nixl")]
            nixl_tcp: false,
            #[cfg(feature = "nixl")]
            nixl_publish: Vec::new(),
        }
    }

    /// Refuses settings that would hang, refuse everyone or leave the agent unbounded.
    fn check(&self) -> Result<()> {
        let zero = |what: &str| {
            RemoteIoError::InvalidArgument(format!("the agent's {what} must be positive"))
        };
        for (what, d) in [
            ("handshake_timeout", self.handshake_timeout),
            ("io_timeout", self.io_timeout),
            ("idle_timeout", self.idle_timeout),
        ] {
            if d.is_zero() {
                return Err(zero(what));
            }
        }
        for (what, n) in [
            ("max_handshakes", self.max_handshakes),
            (
                "max_handshakes_per_address",
                self.max_handshakes_per_address,
            ),
            ("max_connections", self.max_connections),
            ("max_sessions_per_key", self.max_sessions_per_key),
            ("threads", self.threads),
        ] {
            if n == 0 {
                return Err(zero(what));
            }
        }
        if self.buffer_memory < crate::wire::MAX_DATA {
            return Err(RemoteIoError::InvalidArgument(format!(
                "the agent's buffer_memory ({} bytes) must hold one message ({} bytes)",
                self.buffer_memory,
                crate::wire::MAX_DATA
            )));
        }
        Ok(())
    }
}

/// What an agent has served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentStats {
    /// Connections that completed the handshake.
    pub sessions: u64,
    /// Connections refused in the handshake (wrong key, timed out, closed early, busy, or no
    /// pending handshake could give way to them).
    pub refused_sessions: u64,
    /// Connections closed in their handshake to make room for newer ones.
    pub evicted_handshakes: u64,
    /// Idle sessions closed to give their places to keys below their fair share.
    pub preempted_sessions: u64,
    /// Requests served.
    pub served: u64,
    /// Requests refused (unknown export, out of bounds, not permitted, IO error).
    pub refused: u64,
    /// Connections ended for breaking the protocol.
    pub protocol_errors: u64,
    /// Bytes sent to clients.
    pub bytes_read: u64,
    /// Bytes written for clients.
    pub bytes_written: u64,
}

#[derive(Default)]
struct Counters {
    sessions: AtomicU64,
    refused_sessions: AtomicU64,
    served: AtomicU64,
    refused: AtomicU64,
    protocol_errors: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// An export as the agent serves it.
enum Source {
    Memory(SharedMemory),
    Device(DeviceBuffer),
    File {
        file: Arc<std::fs::File>,
        max_len: u64,
        /// One SYNC or RESERVE at a time: they run on blocking threads that a timed-out
        /// request cannot stop, so a client that times out and asks again must not pile
        /// them up.
        flush: Arc<tokio::sync::Semaphore>,
    },
}

struct Served {
    source: Source,
    access: Access,
}

/// What every connection task shares.
struct Shared {
    instance: u64,
    keys: HashMap<String, Key>,
    /// Checked against unknown key ids, so that they take as long as wrong secrets.
    dummy_secret: Vec<u8>,
    exports: HashMap<String, Served>,
    cfg: Limits,
    /// Session places, shared among keys.
    slots: Arc<slots::Slots>,
    /// Request buffers of all sessions, shared among keys.
    buffers: Arc<buffer::Budget>,
    counters: Counters,
    #[cfg(feature = "rdma")]
    rdma: Option<Arc<gpuio_rdma::RdmaDevice>>,
    /// Whether memory exports are offered over NIXL.
    #[cfg(feature = "nixl")]
    nixl: bool,
}

/// The timing and limits every connection follows.
#[derive(Clone, Copy)]
struct Limits {
    handshake_timeout: Duration,
    io_timeout: Duration,
    idle_timeout: Duration,
}

/// A running agent. Dropping it shuts it down (as [`shutdown`](Self::shutdown) does).
pub struct Agent {
    runtime: Option<tokio::runtime::Runtime>,
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    accept: Option<tokio::task::JoinHandle<()>>,
    shared: Arc<Shared>,
    gate: Arc<gate::Gate>,
    /// The links of the exports published over NIXL (`nixl_publish`).
    #[cfg(feature = "nixl")]
    published: Vec<crate::nixl::Link>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("addr", &self.addr)
            .field("instance", &format_args!("{:#018x}", self.shared.instance))
            .field("exports", &self.shared.exports.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Agent {
    /// Checks the configuration and the keys' secrets, opens the exports, binds the listener
    /// and starts serving.
    pub fn start(cfg: AgentConfig) -> Result<Self> {
        cfg.check()?;
        let mut keys = HashMap::new();
        for k in cfg.keys {
            auth::check_secret(&k.id, &k.secret).map_err(RemoteIoError::InvalidArgument)?;
            if keys.insert(k.id.clone(), k).is_some() {
                return Err(RemoteIoError::InvalidArgument(
                    "two keys share a name".into(),
                ));
            }
        }
        let mut exports = HashMap::new();
        for e in cfg.exports {
            let source = match e.source {
                ExportSource::Memory(m) => Source::Memory(m),
                ExportSource::Device(d) => Source::Device(d),
                ExportSource::File { path, max_len } => {
                    let file = open_export_file(&e.name, &path, e.access)?;
                    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
                    Source::File {
                        file: Arc::new(file),
                        max_len: max_len.unwrap_or(len),
                        flush: Arc::new(tokio::sync::Semaphore::new(1)),
                    }
                }
            };
            let served = Served {
                source,
                access: e.access,
            };
            if exports.insert(e.name.clone(), served).is_some() {
                return Err(RemoteIoError::InvalidArgument(format!(
                    "two exports are named {:?}",
                    e.name
                )));
            }
        }
        let random = auth::nonce()?;
        let instance = u64::from_le_bytes(random[..8].try_into().unwrap_or_default());
        // As long as a generated secret (64 bytes), so that an unknown key id costs the HMAC
        // the same work as most real keys.
        let dummy_secret = [auth::nonce()?, auth::nonce()?].concat();
        let shared = Arc::new(Shared {
            instance,
            keys,
            dummy_secret,
            exports,
            cfg: Limits {
                handshake_timeout: cfg.handshake_timeout,
                io_timeout: cfg.io_timeout,
                idle_timeout: cfg.idle_timeout,
            },
            slots: slots::Slots::new(cfg.max_connections, cfg.max_sessions_per_key),
            buffers: buffer::Budget::new(cfg.buffer_memory),
            counters: Counters::default(),
            #[cfg(feature = "rdma")]
            rdma: match &cfg.rdma {
                Some(o) => Some(o.open()?),
                None => None,
            },
            #[cfg(feature = "nixl")]
            nixl: cfg.nixl && nixl_ready(cfg.nixl_tcp)?,
        });
        #[cfg(feature = "nixl")]
        let published = published_links(&shared, &cfg.nixl_publish)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.threads.clamp(1, 64))
            .thread_name("gpuio-agent")
            .enable_io()
            .enable_time()
            .build()?;
        let listener = runtime.block_on(listen(cfg.listen))?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = watch::channel(false);
        let gate = gate::Gate::new(cfg.max_handshakes_per_address, cfg.max_handshakes);
        let tls = cfg.tls.map(|t| tokio_rustls::TlsAcceptor::from(t.config));
        let accept = runtime.spawn(accept_loop(
            listener,
            shared.clone(),
            gate.clone(),
            tls,
            stopped,
        ));
        Ok(Self {
            runtime: Some(runtime),
            addr,
            stop,
            accept: Some(accept),
            shared,
            gate,
            #[cfg(feature = "nixl")]
            published,
        })
    }

    /// The exports published over NIXL (`nixl_publish`): each one's name and the JSON line a
    /// NIXL program needs ([`NixlOffer::to_json`](crate::NixlOffer::to_json)).
    #[cfg(feature = "nixl")]
    pub fn nixl_published(&self) -> Vec<(String, String)> {
        self.published
            .iter()
            .map(|l| (l.export().to_string(), l.offer().to_json(l.len())))
            .collect()
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The random number this run of the agent tells its clients.
    pub fn instance(&self) -> u64 {
        self.shared.instance
    }

    /// What it has served so far.
    pub fn stats(&self) -> AgentStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        AgentStats {
            sessions: get(&c.sessions),
            refused_sessions: get(&c.refused_sessions) + self.gate.refused(),
            evicted_handshakes: self.gate.evicted(),
            preempted_sessions: self.shared.slots.preempted(),
            served: get(&c.served),
            refused: get(&c.refused),
            protocol_errors: get(&c.protocol_errors),
            bytes_read: get(&c.bytes_read),
            bytes_written: get(&c.bytes_written),
        }
    }

    /// Stops accepting, waits for the requests being served, closes every connection.
    pub fn shutdown(mut self) -> AgentStats {
        self.stop_and_wait();
        self.stats()
    }

    fn stop_and_wait(&mut self) {
        let _ = self.stop.send(true);
        if let (Some(rt), Some(accept)) = (self.runtime.as_ref(), self.accept.take())
            && let Err(e) = rt.block_on(accept)
        {
            tracing::error!(error = %e, "the agent's accept task failed");
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop_and_wait();
    }
}

/// Opens a file export: it must exist and be a regular file (a typed error names it if not).
/// The open does not block (a FIFO would wait for a writer forever) and cannot make a device
/// the agent's terminal; the type is checked on the open file.
fn open_export_file(name: &str, path: &std::path::Path, access: Access) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let fail = |source: std::io::Error| RemoteIoError::Export {
        export: name.to_string(),
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(access == Access::ReadWrite)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(fail)?;
    let meta = file.metadata().map_err(fail)?;
    if !meta.is_file() {
        return Err(fail(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        )));
    }
    Ok(file)
}

/// Accepts connections until told to stop, then lets every connection finish the request it
/// is serving.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    sh: Arc<Shared>,
    gate: Arc<gate::Gate>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    stopped: watch::Receiver<bool>,
) {
    let mut conns = tokio::task::JoinSet::new();
    let mut stop_rx = stopped.clone();
    // A descriptor held back for when the process runs out and no stranger's socket can give
    // way: it is given up to accept the waiting client and tell it `Busy`, rather than leave
    // it in the queue until it gives up.
    let mut spare = std::fs::File::open("/dev/null").ok();
    loop {
        // Reap finished connections as we go.
        while conns.try_join_next().is_some() {}
        if spare.is_none() {
            spare = std::fs::File::open("/dev/null").ok();
        }
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop_rx.changed() => break,
        };
        // A connection let in, and its place among the pending handshakes (`None`: it is
        // told `Busy`).
        let (stream, peer, pending) = match accepted {
            Ok((stream, peer)) => match gate.admit(peer.ip()) {
                Some(pending) => (stream, peer, Some(pending)),
                // Every place it could take is held by a handshake getting through.
                None => continue,
            },
            // Out of descriptors or memory: `accept` says so whether or not a client waits
            // (which stays queued). The spare lets one in: a stranger's pending socket gives
            // way to it if one can, else it is told `Busy`. The next try waits a moment
            // instead of spinning.
            Err(e) if e.raw_os_error().is_some_and(is_resource_shortage) => {
                tracing::warn!(error = %e, "accepting a connection failed");
                let waiting = Duration::from_millis(10);
                // Closed before `accept`, so that its descriptor is the one given out.
                let spared = match spare.take().map(drop) {
                    Some(()) => tokio::time::timeout(waiting, listener.accept())
                        .await
                        .ok()
                        .and_then(Result::ok),
                    None => None,
                };
                tokio::time::sleep(waiting).await;
                let Some((stream, peer)) = spared else {
                    continue;
                };
                let pending = gate.make_room().then(|| gate.admit(peer.ip())).flatten();
                (stream, peer, pending)
            }
            // A connection that failed before it was accepted (reset, unreachable): nothing
            // to wait for.
            Err(e) => {
                tracing::debug!(error = %e, "a connection failed before it was accepted");
                continue;
            }
        };
        match pending {
            Some(pending) => {
                let (sh, stop, tls) = (sh.clone(), stopped.clone(), tls.clone());
                conns.spawn(session::serve(sh, stream, peer, stop, tls, pending))
            }
            None => conns.spawn(session::refuse_busy(stream)),
        };
    }
    // Refuse new clients at once while the connections drain.
    drop(listener);
    while conns.join_next().await.is_some() {}
}

/// Whether an `accept` error number means the process is short of descriptors or memory.
fn is_resource_shortage(errno: i32) -> bool {
    matches!(
        errno,
        libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM
    )
}

/// Connections the kernel may hold ready for `accept` (capped by `net.core.somaxconn`). A
/// flood of strangers' connects must not fill the queue and make a good client's SYN wait
/// for its one-second retransmit: tokio's default is 1024.
const LISTEN_BACKLOG: u32 = 4096;

/// A listening socket on `addr`, as `TcpListener::bind` makes one (address reuse on), with
/// [`LISTEN_BACKLOG`].
async fn listen(addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// NIXL links of their own for the exports in `names` (`nixl_publish`): read-write memory
/// exports with at least one byte, on an agent that serves NIXL.
#[cfg(feature = "nixl")]
fn published_links(shared: &Shared, names: &[String]) -> Result<Vec<crate::nixl::Link>> {
    use crate::nixl::ExportMemory;
    if !names.is_empty() && !shared.nixl {
        return Err(RemoteIoError::InvalidArgument(
            "nixl_publish needs nixl = true".into(),
        ));
    }
    let mut links = Vec::new();
    for name in names {
        let bad = |why: &str| {
            RemoteIoError::InvalidArgument(format!("nixl_publish: export {name:?} {why}"))
        };
        let ex = shared
            .exports
            .get(name)
            .ok_or_else(|| bad("does not exist"))?;
        if ex.access != Access::ReadWrite {
            return Err(bad("is read-only, and NIXL cannot hold a peer to reading"));
        }
        let host;
        let mem = match &ex.source {
            // No session holds it yet; its owner might (a library user's clone): wait for it,
            // unless called on an async runtime, where waiting would block a worker.
            Source::Memory(m) => {
                host = match tokio::runtime::Handle::try_current() {
                    Err(_) => m.blocking_read(),
                    Ok(_) => m.try_read().map_err(|_| bad("is locked by its owner"))?,
                };
                ExportMemory::Host(&host)
            }
            Source::Device(d) => ExportMemory::Device(d),
            Source::File { .. } => return Err(bad("is a file: NIXL reaches memory exports only")),
        };
        if let Some(why) = mem.refusal() {
            return Err(bad(&why));
        }
        if links.iter().any(|l: &crate::nixl::Link| l.export() == name) {
            return Err(bad("is listed twice"));
        }
        links.push(crate::nixl::accept(name, mem)?);
    }
    Ok(links)
}

/// Whether the agent may serve NIXL: the library is there, and UCX cannot use its TCP
/// transport unless `tcp` accepts what that means.
#[cfg(feature = "nixl")]
fn nixl_ready(tcp: bool) -> Result<bool> {
    gpuio_nixl::library()?;
    if gpuio_nixl::ucx_tcp_enabled() && !tcp {
        return Err(RemoteIoError::InvalidArgument(
            "NIXL over UCX's TCP transport checks no keys: any peer that reaches this \
             process's UCX ports could read and write its memory. Set UCX_TLS to transports \
             that check keys (UCX_TLS=^tcp keeps RDMA, cuda_ipc and, within one user on one \
             host, shared memory), or nixl_tcp = true on a network you trust"
                .into(),
        ));
    }
    Ok(true)
}
