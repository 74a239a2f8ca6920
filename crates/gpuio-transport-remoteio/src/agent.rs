//! The gpuio agent: serves named exports of host memory and files to authenticated clients.
//!
//! One task per connection. A connection first completes the HELLO handshake (within
//! `handshake_timeout`), then sends requests one at a time. Every request is checked against
//! its export (exists, inside its bounds) and the key's role and the export's access (writes
//! need both to allow them); a refused request gets an ERROR and the connection goes on. A
//! protocol violation (a corrupt, truncated, oversized or unexpected message) gets an ERROR and
//! ends that connection only. Shutdown stops accepting, lets every connection finish the
//! request it is serving, and returns what was served.

use crate::auth::{self, Key, Role};
use crate::wire::{HEADER_LEN, Header, Message, WireError};
use crate::{RemoteIoError, Result};
use gpuio_hal::{ErrorCode, HostBuffer};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::watch;

/// Whether an export may be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Reads only.
    ReadOnly,
    /// Reads and writes (by keys whose role allows writes).
    ReadWrite,
}

/// What an export serves.
#[derive(Debug, Clone)]
pub enum ExportSource {
    /// Host memory, shared with the exporting program.
    Memory(Arc<RwLock<HostBuffer>>),
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
    /// Runtime threads.
    pub threads: usize,
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
            threads: 2,
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
    Memory(Arc<RwLock<HostBuffer>>),
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
    counters: Counters,
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
            counters: Counters::default(),
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
                        let (sh, stop) = (sh.clone(), stopped.clone());
                        conns.spawn(async move {
                            let _permit = permit;
                            serve(sh, stream, peer, stop).await;
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

/// Reads one message; `Ok(None)` at a clean end of stream between messages.
async fn read_message(rd: &mut OwnedReadHalf) -> Result<Option<(Header, Message)>> {
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
    let header = Header::decode(&h)?;
    // Bounded by Header::decode (MAX_PAYLOAD).
    let mut payload = vec![0u8; header.payload_len as usize];
    rd.read_exact(&mut payload).await?;
    Ok(Some((header, Message::decode(&header, &payload)?)))
}

async fn send(wr: &mut OwnedWriteHalf, msg: &Message, request_id: u64) -> Result<()> {
    wr.write_all(&msg.encode(request_id)).await?;
    Ok(())
}

async fn send_error(wr: &mut OwnedWriteHalf, code: ErrorCode, message: &str, request_id: u64) {
    let msg = Message::Error {
        code: code.as_i32(),
        message: message.into(),
    };
    // Best effort: the peer may already be gone.
    let _ = send(wr, &msg, request_id).await;
}

async fn serve(
    sh: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let role =
        match tokio::time::timeout(sh.handshake_timeout, handshake(&sh, &mut rd, &mut wr)).await {
            Ok(Ok(role)) => {
                sh.counters.sessions.fetch_add(1, Ordering::Relaxed);
                role
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
    loop {
        let next = tokio::select! {
            m = read_message(&mut rd) => m,
            _ = stop.changed() => return,
        };
        let (header, msg) = match next {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(e) => {
                sh.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                tracing::info!(%peer, error = %e, "closing a connection that broke the protocol");
                send_error(&mut wr, ErrorCode::InvalidArg, &e.to_string(), 0).await;
                return;
            }
        };
        let id = header.request_id;
        let reply = match msg {
            Message::ReadReq {
                export,
                offset,
                len,
            } => read(&sh, &export, offset, len).await.map(|data| {
                sh.counters
                    .bytes_read
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                Message::ReadResp { data }
            }),
            Message::WriteReq {
                export,
                offset,
                data,
            } => write(&sh, role, &export, offset, data)
                .await
                .map(|written| {
                    sh.counters
                        .bytes_written
                        .fetch_add(written, Ordering::Relaxed);
                    Message::WriteResp { written }
                }),
            other => {
                sh.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
                let why = format!("unexpected {other:?} after the handshake");
                send_error(&mut wr, ErrorCode::InvalidArg, &why, id).await;
                return;
            }
        };
        let sent = match reply {
            Ok(m) => {
                sh.counters.served.fetch_add(1, Ordering::Relaxed);
                send(&mut wr, &m, id).await
            }
            Err(r) => {
                sh.counters.refused.fetch_add(1, Ordering::Relaxed);
                send(
                    &mut wr,
                    &Message::Error {
                        code: r.code.as_i32(),
                        message: r.message,
                    },
                    id,
                )
                .await
            }
        };
        if sent.is_err() {
            return;
        }
    }
}

/// The HELLO exchange; the key's role on success.
async fn handshake(sh: &Shared, rd: &mut OwnedReadHalf, wr: &mut OwnedWriteHalf) -> Result<Role> {
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
    send(wr, &Message::Welcome, 0).await?;
    Ok(key.role)
}

fn export<'a>(sh: &'a Shared, name: &str) -> std::result::Result<&'a Served, Refusal> {
    sh.exports
        .get(name)
        .ok_or_else(|| Refusal::new(ErrorCode::NotFound, format!("no export named {name:?}")))
}

fn out_of_bounds(name: &str, offset: u64, len: u64, size: u64) -> Refusal {
    Refusal::new(
        ErrorCode::InvalidArg,
        format!("{offset}+{len} is outside export {name:?} ({size} bytes)"),
    )
}

fn io_refusal(e: std::io::Error) -> Refusal {
    Refusal::new(ErrorCode::from_io(&e), e.to_string())
}

async fn read(
    sh: &Shared,
    name: &str,
    offset: u64,
    len: u64,
) -> std::result::Result<Vec<u8>, Refusal> {
    let ex = export(sh, name)?;
    match &ex.source {
        Source::Memory(mem) => {
            let buf = mem.read().unwrap_or_else(|e| e.into_inner());
            let size = buf.len() as u64;
            let end = offset
                .checked_add(len)
                .filter(|&e| e <= size)
                .ok_or_else(|| out_of_bounds(name, offset, len, size))?;
            Ok(buf[offset as usize..end as usize].to_vec())
        }
        Source::File { file, .. } => {
            let size = file.metadata().map_err(io_refusal)?.len();
            if offset.checked_add(len).is_none_or(|e| e > size) {
                return Err(out_of_bounds(name, offset, len, size));
            }
            let file = file.clone();
            tokio::task::spawn_blocking(move || {
                let mut data = vec![0u8; len as usize];
                file.read_exact_at(&mut data, offset).map(|()| data)
            })
            .await
            .map_err(|e| Refusal::new(ErrorCode::General, e.to_string()))?
            .map_err(io_refusal)
        }
    }
}

async fn write(
    sh: &Shared,
    role: Role,
    name: &str,
    offset: u64,
    data: Vec<u8>,
) -> std::result::Result<u64, Refusal> {
    let ex = export(sh, name)?;
    if ex.access != Access::ReadWrite || role != Role::ReadWrite {
        return Err(Refusal::new(
            ErrorCode::Permission,
            format!("writing export {name:?} is not permitted"),
        ));
    }
    let len = data.len() as u64;
    match &ex.source {
        Source::Memory(mem) => {
            let mut buf = mem.write().unwrap_or_else(|e| e.into_inner());
            let size = buf.len() as u64;
            let end = offset
                .checked_add(len)
                .filter(|&e| e <= size)
                .ok_or_else(|| out_of_bounds(name, offset, len, size))?;
            buf.as_mut_slice()[offset as usize..end as usize].copy_from_slice(&data);
            Ok(len)
        }
        Source::File { file, max_len } => {
            if offset.checked_add(len).is_none_or(|e| e > *max_len) {
                return Err(out_of_bounds(name, offset, len, *max_len));
            }
            let file = file.clone();
            tokio::task::spawn_blocking(move || file.write_all_at(&data, offset).map(|()| len))
                .await
                .map_err(|e| Refusal::new(ErrorCode::General, e.to_string()))?
                .map_err(io_refusal)
        }
    }
}
