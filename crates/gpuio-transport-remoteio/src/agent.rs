//! The gpuio agent: serves named exports of host memory and files to authenticated clients.
//!
//! One task per connection. A connection first completes the HELLO handshake (within
//! `handshake_timeout`), then its requests are served in order (clients pipeline them). Every
//! request is checked against its export (exists, inside its bounds) and the key's role and
//! the export's access (writes need both to allow them); a refused request gets an ERROR and
//! the connection goes on. A protocol violation (a corrupt, truncated, oversized or unexpected
//! message) gets an ERROR and ends that connection only. Shutdown stops accepting, lets every
//! connection finish the request it is serving, and returns what was served.
//!
//! Memory exports are served without copies on this side: a read is sent straight from the
//! export (under its read lock), a write is received straight into it (under its write lock).
//! Each request must finish within `io_timeout`, so a stalled client cannot hold a lock.
//!
//! Limits per client: one request in flight per connection (at most [`MAX_DATA`] bytes), and
//! at most `max_sessions_per_key` connections per key; more are refused with `Busy`.

use crate::auth::{self, Key, Role};
use crate::tls::TlsServer;
use crate::wire::{self, HEADER_LEN, Header, MAX_DATA, Message, MsgType, WireError, WriteHead};
use crate::{RemoteIoError, Result};
use gpuio_hal::{DeviceBuffer, ErrorCode, HostBuffer};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::RwLock;
use tokio::sync::watch;

/// Whether an export may be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Reads only.
    ReadOnly,
    /// Reads and writes (by keys whose role allows writes).
    ReadWrite,
}

/// Host memory an agent exports, shared with the exporting program. Requests hold its lock
/// while their bytes cross the network; the program takes it with `blocking_read` /
/// `blocking_write` (outside async code) or `read().await` / `write().await`.
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
    /// A file. Reads stop at its length; writes may extend it up to `max_len` (default: its
    /// length when the agent starts).
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

/// How an agent runs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Where to listen (port 0: any free port; see [`Agent::local_addr`]).
    pub listen: SocketAddr,
    /// The keys clients may present.
    pub keys: Vec<Key>,
    /// What is served.
    pub exports: Vec<Export>,
    /// How long a new connection has to complete the handshake.
    pub handshake_timeout: Duration,
    /// Connections served at once; more wait to be accepted.
    pub max_connections: usize,
    /// Connections one key may hold at once; more are refused with `Busy`.
    pub max_sessions_per_key: usize,
    /// Time one request (its bytes in and out included) may take before its connection is
    /// closed.
    pub io_timeout: Duration,
    /// Runtime threads.
    pub threads: usize,
    /// TLS: the agent's certificate (`None`: plain TCP).
    pub tls: Option<TlsServer>,
    /// RDMA: the device to serve memory exports over (`None`: TCP only).
    #[cfg(feature = "rdma")]
    pub rdma: Option<crate::rdma::RdmaOptions>,
}

impl AgentConfig {
    /// A configuration listening on `listen` with no keys or exports yet.
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            keys: Vec::new(),
            exports: Vec::new(),
            handshake_timeout: Duration::from_secs(5),
            max_connections: 256,
            max_sessions_per_key: 64,
            io_timeout: Duration::from_secs(30),
            threads: 2,
            tls: None,
            #[cfg(feature = "rdma")]
            rdma: None,
        }
    }
}

/// What an agent has served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentStats {
    /// Connections that completed the handshake.
    pub sessions: u64,
    /// Connections refused in the handshake.
    pub refused_sessions: u64,
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

enum Source {
    Memory(SharedMemory),
    Device(DeviceBuffer),
    File {
        file: Arc<std::fs::File>,
        max_len: u64,
    },
}

struct Served {
    source: Source,
    access: Access,
}

struct Shared {
    keys: HashMap<String, Key>,
    exports: HashMap<String, Served>,
    handshake_timeout: Duration,
    io_timeout: Duration,
    max_sessions_per_key: usize,
    sessions_per_key: Mutex<HashMap<String, usize>>,
    counters: Counters,
    #[cfg(feature = "rdma")]
    rdma: Option<Arc<gpuio_hal::rdma::RdmaDevice>>,
}

/// A running agent. Dropping it shuts it down (as [`shutdown`](Self::shutdown) does).
pub struct Agent {
    runtime: Option<tokio::runtime::Runtime>,
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    accept: Option<tokio::task::JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("addr", &self.addr)
            .field("exports", &self.shared.exports.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// A refusal or failure to report to the client.
struct Refusal {
    code: ErrorCode,
    message: String,
}

impl Refusal {
    fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl Agent {
    /// Opens the exports, binds the listener and starts serving.
    pub fn start(cfg: AgentConfig) -> Result<Self> {
        let mut keys = HashMap::new();
        for k in cfg.keys {
            if k.secret.len() < 16 {
                return Err(RemoteIoError::InvalidArgument(format!(
                    "key {:?} is shorter than 16 bytes",
                    k.id
                )));
            }
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
                    let file = std::fs::OpenOptions::new()
                        .read(true)
                        .write(e.access == Access::ReadWrite)
                        .open(&path)?;
                    let len = file.metadata()?.len();
                    Source::File {
                        file: Arc::new(file),
                        max_len: max_len.unwrap_or(len),
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
        let shared = Arc::new(Shared {
            keys,
            exports,
            handshake_timeout: cfg.handshake_timeout,
            io_timeout: cfg.io_timeout,
            max_sessions_per_key: cfg.max_sessions_per_key.max(1),
            sessions_per_key: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            #[cfg(feature = "rdma")]
            rdma: match &cfg.rdma {
                Some(o) => Some(o.open()?),
                None => None,
            },
        });
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.threads.clamp(1, 64))
            .thread_name("gpuio-agent")
            .enable_io()
            .enable_time()
            .build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind(cfg.listen))?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = watch::channel(false);
        let limit = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections.max(1)));
        let tls = cfg.tls.map(|t| tokio_rustls::TlsAcceptor::from(t.config));
        let sh = shared.clone();
        let accept = runtime.spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            let mut stop_rx = stopped.clone();
            loop {
                let permit = tokio::select! {
                    p = limit.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                    _ = stop_rx.changed() => break,
                };
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = stop_rx.changed() => break,
                };
                match accepted {
                    Ok((stream, peer)) => {
                        let (sh, stop, tls) = (sh.clone(), stopped.clone(), tls.clone());
                        conns.spawn(async move {
                            let _permit = permit;
                            serve(sh, stream, peer, stop, tls).await;
                        });
                    }
                    Err(e) => tracing::warn!(error = %e, "accepting a connection failed"),
                }
                // Reap finished connections as we go.
                while conns.try_join_next().is_some() {}
            }
            // Every connection finishes the request it is serving, then closes.
            while conns.join_next().await.is_some() {}
        });
        Ok(Self {
            runtime: Some(runtime),
            addr,
            stop,
            accept: Some(accept),
            shared,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it has served so far.
    pub fn stats(&self) -> AgentStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        AgentStats {
            sessions: get(&c.sessions),
            refused_sessions: get(&c.refused_sessions),
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

/// Why a connection ends.
enum Fatal {
    /// The client broke the protocol: it gets an ERROR, then the connection closes.
    Protocol(RemoteIoError),
    /// The network failed or the client left: just close.
    Gone,
}

impl From<std::io::Error> for Fatal {
    fn from(_: std::io::Error) -> Self {
        Self::Gone
    }
}

impl From<WireError> for Fatal {
    fn from(e: WireError) -> Self {
        Self::Protocol(e.into())
    }
}

/// Reads a header; `Ok(None)` at a clean end of stream between messages.
async fn read_header(rd: &mut (impl AsyncRead + Unpin)) -> Result<Option<Header>> {
    let mut h = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        let n = rd.read(&mut h[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(WireError::Malformed {
                what: "header",
                why: format!("stream ended after {got} of {HEADER_LEN} bytes"),
            }
            .into());
        }
        got += n;
    }
    Ok(Some(Header::decode(&h)?))
}

/// Reads and decodes the payload of a message whose header was read.
async fn read_payload(rd: &mut (impl AsyncRead + Unpin), header: &Header) -> Result<Message> {
    // Bounded by Header::decode (MAX_PAYLOAD).
    let mut payload = vec![0u8; header.payload_len as usize];
    rd.read_exact(&mut payload).await?;
    Ok(Message::decode(header, &payload)?)
}

/// Reads one whole message; `Ok(None)` at a clean end of stream.
async fn read_message(rd: &mut (impl AsyncRead + Unpin)) -> Result<Option<(Header, Message)>> {
    let Some(header) = read_header(rd).await? else {
        return Ok(None);
    };
    let msg = read_payload(rd, &header).await?;
    Ok(Some((header, msg)))
}

async fn send(wr: &mut (impl AsyncWrite + Unpin), msg: &Message, request_id: u64) -> Result<()> {
    wr.write_all(&msg.encode(request_id)).await?;
    Ok(())
}

async fn send_error(
    wr: &mut (impl AsyncWrite + Unpin),
    code: ErrorCode,
    message: &str,
    request_id: u64,
) {
    let msg = Message::Error {
        code: code.as_i32(),
        message: message.into(),
    };
    // Best effort: the peer may already be gone.
    let _ = send(wr, &msg, request_id).await;
}

/// A key's hold on one of its sessions; released when the connection ends.
struct SessionSlot<'a> {
    sh: &'a Shared,
    key: String,
}

impl Drop for SessionSlot<'_> {
    fn drop(&mut self) {
        let mut per_key = self
            .sh
            .sessions_per_key
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = per_key.get_mut(&self.key) {
            *n = n.saturating_sub(1);
        }
    }
}

impl Shared {
    fn take_session(&self, key: &str) -> Option<SessionSlot<'_>> {
        let mut per_key = self
            .sessions_per_key
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let n = per_key.entry(key.to_string()).or_insert(0);
        if *n >= self.max_sessions_per_key {
            return None;
        }
        *n += 1;
        Some(SessionSlot {
            sh: self,
            key: key.to_string(),
        })
    }
}

/// Serves one accepted connection: plain, or TLS first where the agent has a certificate.
async fn serve(
    sh: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    stop: watch::Receiver<bool>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let _ = stream.set_nodelay(true);
    let Some(acceptor) = tls else {
        let (rd, wr) = stream.into_split();
        return serve_session(sh, rd, wr, peer, stop).await;
    };
    match tokio::time::timeout(sh.handshake_timeout, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => {
            let (rd, wr) = tokio::io::split(tls);
            serve_session(sh, rd, wr, peer, stop).await;
        }
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "TLS handshake refused");
            sh.counters.refused_sessions.fetch_add(1, Ordering::Relaxed);
        }
        Err(_) => {
            tracing::info!(%peer, "TLS handshake timed out");
            sh.counters.refused_sessions.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Serves a connection's session: the HELLO handshake, then its requests in order.
async fn serve_session(
    sh: Arc<Shared>,
    mut rd: impl AsyncRead + Unpin,
    mut wr: impl AsyncWrite + Unpin,
    peer: SocketAddr,
    mut stop: watch::Receiver<bool>,
) {
    let shake = tokio::time::timeout(sh.handshake_timeout, handshake(&sh, &mut rd, &mut wr));
    let (role, _slot) = match shake.await {
        Ok(Ok(accepted)) => {
            sh.counters.sessions.fetch_add(1, Ordering::Relaxed);
            accepted
        }
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "handshake refused");
            sh.counters.refused_sessions.fetch_add(1, Ordering::Relaxed);
            send_error(&mut wr, e.code(), &e.to_string(), 0).await;
            return;
        }
        Err(_) => {
            sh.counters.refused_sessions.fetch_add(1, Ordering::Relaxed);
            send_error(&mut wr, ErrorCode::Timeout, "handshake timed out", 0).await;
            return;
        }
    };
    let mut state = SessionState::default();
    loop {
        let next = tokio::select! {
            h = read_header(&mut rd) => h,
            _ = stop.changed() => return,
        };
        let header = match next {
            Ok(Some(h)) => h,
            Ok(None) => return,
            Err(e) => return protocol_error(&sh, &mut wr, peer, e).await,
        };
        let served = tokio::time::timeout(
            sh.io_timeout,
            serve_one(&sh, role, &mut rd, &mut wr, header, &mut state),
        );
        match served.await {
            Ok(Ok(())) => {}
            Ok(Err(Fatal::Protocol(e))) => return protocol_error(&sh, &mut wr, peer, e).await,
            Ok(Err(Fatal::Gone)) => return,
            Err(_) => {
                tracing::info!(%peer, "closing a connection whose request timed out");
                return;
            }
        }
    }
}

async fn protocol_error(
    sh: &Shared,
    wr: &mut (impl AsyncWrite + Unpin),
    peer: SocketAddr,
    e: RemoteIoError,
) {
    sh.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
    tracing::info!(%peer, error = %e, "closing a connection that broke the protocol");
    send_error(wr, ErrorCode::InvalidArg, &e.to_string(), 0).await;
}

/// Serves one request whose header was read, answering it (with its result or a refusal).
async fn serve_one(
    sh: &Shared,
    role: Role,
    rd: &mut (impl AsyncRead + Unpin),
    wr: &mut (impl AsyncWrite + Unpin),
    header: Header,
    state: &mut SessionState,
) -> std::result::Result<(), Fatal> {
    let id = header.request_id;
    let scratch = &mut state.scratch;
    let result = if header.msg_type == MsgType::WriteReq {
        let mut name_len = [0u8; 2];
        rd.read_exact(&mut name_len).await?;
        let mut prefix = vec![0u8; 2 + WriteHead::rest_len(name_len)];
        prefix[..2].copy_from_slice(&name_len);
        if prefix.len() as u64 > header.payload_len {
            return Err(WireError::Malformed {
                what: "WRITE_REQ",
                why: "a name longer than the payload".into(),
            }
            .into());
        }
        rd.read_exact(&mut prefix[2..]).await?;
        let head = WriteHead::decode(&header, &prefix)?;
        write(sh, role, rd, head, scratch).await?
    } else {
        match read_payload(rd, &header).await.map_err(Fatal::Protocol)? {
            Message::ReadReq {
                export,
                offset,
                len,
            } => return read(sh, wr, id, &export, offset, len, scratch).await,
            Message::StatReq { export } => stat(sh, role, &export).await,
            Message::RdmaRequest { info, export } => {
                rdma_link(sh, role, &export, &info, state).await
            }
            other => {
                let why = format!("unexpected {other:?} after the handshake");
                return Err(Fatal::Protocol(RemoteIoError::InvalidArgument(why)));
            }
        }
    };
    answer(sh, wr, id, result).await
}

/// What a session keeps between its requests.
#[derive(Default)]
struct SessionState {
    /// Reused for file exports (whose bytes pass through memory on this side).
    scratch: Vec<u8>,
    /// RDMA links to this client (they live as long as the session).
    #[cfg(feature = "rdma")]
    links: Vec<crate::rdma::Link>,
}

/// Answers a client's RDMA_INFO request: exposes the memory export to its queue pair with the
/// session's rights.
#[cfg(feature = "rdma")]
async fn rdma_link(
    sh: &Shared,
    role: Role,
    name: &str,
    client: &wire::RdmaInfo,
    state: &mut SessionState,
) -> std::result::Result<Message, Refusal> {
    let Some(dev) = &sh.rdma else {
        return Err(Refusal::new(
            ErrorCode::Unsupported,
            "this agent serves no RDMA device",
        ));
    };
    let ex = export(sh, name)?;
    let Source::Memory(mem) = &ex.source else {
        return Err(Refusal::new(
            ErrorCode::Unsupported,
            format!(
                "export {name:?} is not host memory: RDMA reaches host memory exports only \
                 (GPU memory would need GPUDirect RDMA)"
            ),
        ));
    };
    let buf = mem.read().await;
    let (link, answer) = crate::rdma::accept(dev, &buf, may_write(ex, role), client)
        .map_err(|e| Refusal::new(e.code(), e.to_string()))?;
    state.links.push(link);
    Ok(Message::RdmaInfo(answer))
}

#[cfg(not(feature = "rdma"))]
async fn rdma_link(
    _sh: &Shared,
    _role: Role,
    _name: &str,
    _client: &wire::RdmaInfo,
    _state: &mut SessionState,
) -> std::result::Result<Message, Refusal> {
    Err(Refusal::new(
        ErrorCode::Unsupported,
        "this agent was built without RDMA (cargo feature `rdma`)",
    ))
}

/// Sends a small answer or a refusal, counting it.
async fn answer(
    sh: &Shared,
    wr: &mut (impl AsyncWrite + Unpin),
    id: u64,
    result: std::result::Result<Message, Refusal>,
) -> std::result::Result<(), Fatal> {
    let msg = match result {
        Ok(m) => {
            sh.counters.served.fetch_add(1, Ordering::Relaxed);
            m
        }
        Err(r) => {
            sh.counters.refused.fetch_add(1, Ordering::Relaxed);
            Message::Error {
                code: r.code.as_i32(),
                message: r.message,
            }
        }
    };
    wr.write_all(&msg.encode(id)).await?;
    Ok(())
}

/// The HELLO exchange; the key's role and its session slot on success.
async fn handshake<'a>(
    sh: &'a Shared,
    rd: &mut (impl AsyncRead + Unpin),
    wr: &mut (impl AsyncWrite + Unpin),
) -> Result<(Role, SessionSlot<'a>)> {
    let refuse = |why: &str| RemoteIoError::Auth(why.into());
    let Some((_, Message::Hello { key_id, nonce: cn })) = read_message(rd).await? else {
        return Err(refuse("the first message must be HELLO"));
    };
    let Some(key) = sh.keys.get(&key_id) else {
        return Err(refuse("unknown key"));
    };
    let sn = auth::nonce()?;
    let proof = auth::server_proof(&key.secret, &cn, &sn).ok_or_else(|| refuse("bad key"))?;
    send(wr, &Message::Challenge { nonce: sn, proof }, 0).await?;
    let Some((_, Message::Proof { proof })) = read_message(rd).await? else {
        return Err(refuse("expected the client's proof"));
    };
    if !auth::check_client(&key.secret, &cn, &sn, &proof) {
        return Err(refuse("wrong key"));
    }
    let slot = sh
        .take_session(&key_id)
        .ok_or_else(|| RemoteIoError::Remote {
            code: ErrorCode::Busy,
            message: format!(
                "key {key_id:?} already holds {} sessions",
                sh.max_sessions_per_key
            ),
        })?;
    send(wr, &Message::Welcome, 0).await?;
    Ok((key.role, slot))
}

fn export<'a>(sh: &'a Shared, name: &str) -> std::result::Result<&'a Served, Refusal> {
    sh.exports
        .get(name)
        .ok_or_else(|| Refusal::new(ErrorCode::NotFound, format!("no export named {name:?}")))
}

fn may_write(ex: &Served, role: Role) -> bool {
    ex.access == Access::ReadWrite && role == Role::ReadWrite
}

/// `offset..offset+len` inside `size` bytes, or a refusal naming the export.
fn in_bounds(
    name: &str,
    offset: u64,
    len: u64,
    size: u64,
) -> std::result::Result<std::ops::Range<usize>, Refusal> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(offset as usize..end as usize),
        _ => Err(Refusal::new(
            ErrorCode::InvalidArg,
            format!("{offset}+{len} is outside export {name:?} ({size} bytes)"),
        )),
    }
}

fn io_refusal(e: std::io::Error) -> Refusal {
    Refusal::new(ErrorCode::from_io(&e), e.to_string())
}

async fn stat(sh: &Shared, role: Role, name: &str) -> std::result::Result<Message, Refusal> {
    let ex = export(sh, name)?;
    let size = match &ex.source {
        Source::Memory(mem) => mem.read().await.len() as u64,
        Source::Device(buf) => buf.len() as u64,
        Source::File { file, .. } => file.metadata().map_err(io_refusal)?.len(),
    };
    Ok(Message::StatResp {
        size,
        writable: may_write(ex, role),
    })
}

/// Serves a read: the data goes out straight from a memory export, or through `scratch` from
/// a file.
async fn read(
    sh: &Shared,
    wr: &mut (impl AsyncWrite + Unpin),
    id: u64,
    name: &str,
    offset: u64,
    len: u64,
    scratch: &mut Vec<u8>,
) -> std::result::Result<(), Fatal> {
    let ex = match export(sh, name) {
        Ok(ex) => ex,
        Err(r) => return answer(sh, wr, id, Err(r)).await,
    };
    let sent = match &ex.source {
        Source::Memory(mem) => {
            let buf = mem.read().await;
            let range = match in_bounds(name, offset, len, buf.len() as u64) {
                Ok(r) => r,
                Err(r) => return answer(sh, wr, id, Err(r)).await,
            };
            wr.write_all(&wire::read_resp_head(id, range.len())).await?;
            wr.write_all(&buf[range]).await?;
            Some(len)
        }
        // GPU memory and files: through the session's buffer, on a blocking thread.
        Source::Device(buf) => {
            let buf = buf.clone();
            let filled = match in_bounds(name, offset, len, buf.len() as u64) {
                Ok(_) => {
                    through_scratch(scratch, len as usize, move |data| {
                        buf.gpu()
                            .stream()
                            .and_then(|s| s.download(&buf, offset as usize, data))
                            .map_err(hal_refusal)
                    })
                    .await
                }
                Err(r) => Err(r),
            };
            send_scratch(sh, wr, id, filled, scratch).await?
        }
        Source::File { file, .. } => {
            let file = file.clone();
            let size = file.metadata().map(|m| m.len()).map_err(io_refusal);
            let filled = match size.and_then(|size| in_bounds(name, offset, len, size)) {
                Ok(_) => {
                    through_scratch(scratch, len as usize, move |data| {
                        file.read_exact_at(data, offset).map_err(io_refusal)
                    })
                    .await
                }
                Err(r) => Err(r),
            };
            send_scratch(sh, wr, id, filled, scratch).await?
        }
    };
    let Some(sent) = sent else {
        return Ok(());
    };
    sh.counters.served.fetch_add(1, Ordering::Relaxed);
    sh.counters.bytes_read.fetch_add(sent, Ordering::Relaxed);
    Ok(())
}

/// Runs `op` on a blocking thread over `scratch` (sized to `len` first); the buffer comes
/// back whatever happens.
async fn through_scratch(
    scratch: &mut Vec<u8>,
    len: usize,
    op: impl FnOnce(&mut [u8]) -> std::result::Result<(), Refusal> + Send + 'static,
) -> std::result::Result<(), Refusal> {
    let mut data = std::mem::take(scratch);
    data.resize(len, 0);
    let done = tokio::task::spawn_blocking(move || {
        let r = op(&mut data);
        (r, data)
    })
    .await;
    match done {
        Ok((r, data)) => {
            *scratch = data;
            r
        }
        Err(e) => Err(Refusal::new(ErrorCode::General, e.to_string())),
    }
}

/// Answers a read whose bytes are in `scratch` (or its refusal); the bytes sent, if any.
async fn send_scratch(
    sh: &Shared,
    wr: &mut (impl AsyncWrite + Unpin),
    id: u64,
    filled: std::result::Result<(), Refusal>,
    scratch: &[u8],
) -> std::result::Result<Option<u64>, Fatal> {
    if let Err(r) = filled {
        answer(sh, wr, id, Err(r)).await?;
        return Ok(None);
    }
    wr.write_all(&wire::read_resp_head(id, scratch.len()))
        .await?;
    wr.write_all(scratch).await?;
    Ok(Some(scratch.len() as u64))
}

fn hal_refusal(e: gpuio_hal::HalError) -> Refusal {
    Refusal::new(e.code(), e.to_string())
}

/// Serves a write whose fields were read: its data is received straight into a memory
/// export, or through `scratch` into a file. A refused write's data is read and dropped, so
/// the connection stays in step.
async fn write<R: AsyncRead + Unpin>(
    sh: &Shared,
    role: Role,
    rd: &mut R,
    head: WriteHead,
    scratch: &mut Vec<u8>,
) -> std::result::Result<std::result::Result<Message, Refusal>, Fatal> {
    let WriteHead {
        export: name,
        offset,
        len,
    } = head;
    let refuse = async |rd: &mut R, r: Refusal| {
        let skipped = tokio::io::copy(&mut (&mut *rd).take(len), &mut tokio::io::sink()).await?;
        if skipped < len {
            return Err(Fatal::Gone);
        }
        Ok(Err(r))
    };
    let ex = match export(sh, &name) {
        Ok(ex) => ex,
        Err(r) => return refuse(rd, r).await,
    };
    if !may_write(ex, role) {
        let r = Refusal::new(
            ErrorCode::Permission,
            format!("writing export {name:?} is not permitted"),
        );
        return refuse(rd, r).await;
    }
    match &ex.source {
        Source::Memory(mem) => {
            // Straight into the export when nobody else holds it; otherwise (striped writes
            // from several connections) receive into this session's buffer first and hold the
            // lock only for the copy, so the connections' receives overlap.
            if let Ok(mut buf) = mem.try_write() {
                let range = match in_bounds(&name, offset, len, buf.len() as u64) {
                    Ok(r) => r,
                    Err(r) => {
                        drop(buf);
                        return refuse(rd, r).await;
                    }
                };
                rd.read_exact(&mut buf.as_mut_slice()[range]).await?;
            } else {
                // A shared buffer's length never changes, so the range checked now holds later.
                let size = mem.read().await.len() as u64;
                let range = match in_bounds(&name, offset, len, size) {
                    Ok(r) => r,
                    Err(r) => return refuse(rd, r).await,
                };
                scratch.resize(len as usize, 0);
                rd.read_exact(scratch).await?;
                mem.write().await.as_mut_slice()[range].copy_from_slice(scratch);
            }
        }
        // GPU memory and files: received into the session's buffer, then moved on a
        // blocking thread.
        Source::Device(buf) => {
            if let Err(r) = in_bounds(&name, offset, len, buf.len() as u64) {
                return refuse(rd, r).await;
            }
            scratch.resize(len as usize, 0);
            rd.read_exact(scratch).await?;
            let buf = buf.clone();
            let moved = through_scratch(scratch, len as usize, move |data| {
                buf.gpu()
                    .stream()
                    .and_then(|s| s.upload(data, &buf, offset as usize))
                    .map_err(hal_refusal)
            });
            if let Err(r) = moved.await {
                return Ok(Err(r));
            }
        }
        Source::File { file, max_len } => {
            if let Err(r) = in_bounds(&name, offset, len, *max_len) {
                return refuse(rd, r).await;
            }
            scratch.resize(len as usize, 0);
            rd.read_exact(scratch).await?;
            let file = file.clone();
            let moved = through_scratch(scratch, len as usize, move |data| {
                file.write_all_at(data, offset).map_err(io_refusal)
            });
            if let Err(r) = moved.await {
                return Ok(Err(r));
            }
        }
    }
    sh.counters.bytes_written.fetch_add(len, Ordering::Relaxed);
    debug_assert!(len <= MAX_DATA as u64);
    Ok(Ok(Message::WriteResp { written: len }))
}
