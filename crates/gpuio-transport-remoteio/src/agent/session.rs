//! One connection: TLS where configured, the HELLO handshake (the client proves its key
//! first), then its requests in order, each within the agent's timeouts.

use super::buffer::Buffer;
use super::gate::Pending;
use super::{Counters, Shared, serve};
use crate::auth::{self, Role};
use crate::wire::{HEADER_LEN, Header, MAX_HANDSHAKE_PAYLOAD, Message};
use crate::{RemoteIoError, Result};
use gpuio_hal::ErrorCode;
use gpuio_hal::sync::MutexExt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, watch};

/// How long a session may wait for its next request before giving its buffer back.
const KEEP_BUFFER: Duration = Duration::from_millis(100);

/// Serves one accepted connection: TLS first where the agent has a certificate.
pub(super) async fn serve(
    sh: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    stop: watch::Receiver<bool>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    pending: Pending,
) {
    let _ = stream.set_nodelay(true);
    // One deadline for the whole handshake, TLS and HELLO together.
    let deadline = tokio::time::Instant::now() + sh.cfg.handshake_timeout;
    let Some(acceptor) = tls else {
        let (rd, wr) = stream.into_split();
        return serve_session(sh, rd, wr, peer, stop, pending, deadline).await;
    };
    let shake = tokio::time::timeout_at(deadline, acceptor.accept(stream));
    let tls = tokio::select! {
        t = shake => t,
        _ = pending.evicted() => {
            Counters::add(&sh.counters.refused_sessions, 1);
            return;
        }
    };
    match tls {
        Ok(Ok(tls)) => {
            let (rd, wr) = tokio::io::split(tls);
            serve_session(sh, rd, wr, peer, stop, pending, deadline).await;
        }
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "TLS handshake refused");
            Counters::add(&sh.counters.refused_sessions, 1);
        }
        Err(_) => {
            tracing::info!(%peer, "TLS handshake timed out");
            Counters::add(&sh.counters.refused_sessions, 1);
        }
    }
}

/// A refused handshake: what the client is told (its code and a message without prefix).
struct Refused {
    code: ErrorCode,
    message: String,
}

impl From<RemoteIoError> for Refused {
    fn from(e: RemoteIoError) -> Self {
        Self {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

impl From<std::io::Error> for Refused {
    fn from(e: std::io::Error) -> Self {
        RemoteIoError::from(e).into()
    }
}

fn refuse(message: &str) -> Refused {
    Refused {
        code: ErrorCode::Permission,
        message: message.into(),
    }
}

/// A session's places: one of the agent's sessions, one of its key's.
struct Admitted<'a> {
    role: Role,
    _session: OwnedSemaphorePermit,
    key: KeySlot<'a>,
}

/// Serves a connection's session: the handshake (while it holds its pending place), then its
/// requests.
async fn serve_session(
    sh: Arc<Shared>,
    mut rd: impl AsyncRead + Unpin,
    mut wr: impl serve::Answers,
    peer: SocketAddr,
    mut stop: watch::Receiver<bool>,
    pending: Pending,
    deadline: tokio::time::Instant,
) {
    let shake = tokio::time::timeout_at(deadline, handshake(&sh, &mut rd, &mut wr));
    let shaken = tokio::select! {
        s = shake => s,
        _ = pending.evicted() => {
            Counters::add(&sh.counters.refused_sessions, 1);
            return;
        }
    };
    drop(pending);
    let admitted = match shaken {
        Ok(Ok(admitted)) => {
            Counters::add(&sh.counters.sessions, 1);
            admitted
        }
        Ok(Err(r)) => {
            tracing::info!(%peer, reason = %r.message, "handshake refused");
            Counters::add(&sh.counters.refused_sessions, 1);
            send_error(&mut wr, r.code, &r.message, 0).await;
            return;
        }
        Err(_) => {
            Counters::add(&sh.counters.refused_sessions, 1);
            send_error(&mut wr, ErrorCode::Timeout, "handshake timed out", 0).await;
            return;
        }
    };
    // Every key has its budget (made from the same keys); the agent's whole is the fallback.
    let key_budget = sh
        .key_buffers
        .get(&admitted.key.key)
        .cloned()
        .unwrap_or_else(|| sh.buffers.clone());
    let mut state = serve::SessionState::new(Buffer::new(key_budget, sh.buffers.clone()));
    loop {
        let first = tokio::select! {
            b = next_request(&sh, &mut rd, &mut state.buffer) => b,
            _ = stop.changed() => return,
        };
        let first = match first {
            Some(Ok(b)) => b,
            Some(Err(_)) | None => return,
        };
        let served = tokio::time::timeout(sh.cfg.io_timeout, async {
            let header = read_header_rest(&mut rd, first).await?;
            serve::serve_one(&sh, admitted.role, &mut rd, &mut wr, header, &mut state).await
        });
        match served.await {
            Ok(Ok(())) => {}
            Ok(Err(serve::Fatal::Protocol(e))) => {
                Counters::add(&sh.counters.protocol_errors, 1);
                tracing::info!(%peer, error = %e, "closing a connection that broke the protocol");
                send_error(&mut wr, ErrorCode::InvalidArg, &e.to_string(), 0).await;
                return;
            }
            Ok(Err(serve::Fatal::Gone)) => return,
            Err(_) => {
                tracing::info!(%peer, "closing a connection whose request timed out");
                return;
            }
        }
    }
}

/// Waits for the first byte of the next request: `None` when the connection ends cleanly or
/// stays silent past the idle timeout. A session that waits longer than [`KEEP_BUFFER`] gives
/// its buffer back first.
async fn next_request(
    sh: &Shared,
    rd: &mut (impl AsyncRead + Unpin),
    buffer: &mut Buffer,
) -> Option<std::io::Result<u8>> {
    let mut b = [0u8; 1];
    // A one-byte read is cancel-safe: a timeout loses no byte.
    let n = match tokio::time::timeout(KEEP_BUFFER, rd.read(&mut b)).await {
        Ok(n) => n,
        Err(_) => {
            buffer.release();
            tokio::time::timeout(sh.cfg.idle_timeout, rd.read(&mut b))
                .await
                .ok()?
        }
    };
    match n {
        Ok(0) => None,
        Ok(_) => Some(Ok(b[0])),
        Err(e) => Some(Err(e)),
    }
}

/// Reads the rest of a header whose first byte is `first`.
async fn read_header_rest(
    rd: &mut (impl AsyncRead + Unpin),
    first: u8,
) -> std::result::Result<Header, serve::Fatal> {
    let mut h = [0u8; HEADER_LEN];
    h[0] = first;
    rd.read_exact(&mut h[1..]).await?;
    Ok(Header::decode(&h)?)
}

/// Reads one whole message of at most `limit` payload bytes; `Ok(None)` at a clean end.
pub(super) async fn read_message(
    rd: &mut (impl AsyncRead + Unpin),
    limit: u64,
) -> Result<Option<(Header, Message)>> {
    let mut h = [0u8; HEADER_LEN];
    match rd.read(&mut h[..1]).await? {
        0 => return Ok(None),
        _ => rd.read_exact(&mut h[1..]).await?,
    };
    let header = Header::decode(&h)?;
    header.check_payload(limit)?;
    let msg = read_payload(rd, &header).await?;
    Ok(Some((header, msg)))
}

/// Reads and decodes the payload of a message whose header was read and its size checked.
pub(super) async fn read_payload(
    rd: &mut (impl AsyncRead + Unpin),
    header: &Header,
) -> Result<Message> {
    let mut payload = vec![0u8; header.payload_len as usize];
    rd.read_exact(&mut payload).await?;
    Ok(Message::decode(header, &payload)?)
}

/// The HELLO exchange. The client proves its key over both nonces before the agent proves
/// anything, so a stranger learns nothing to test guesses against; an unknown key id gets a
/// challenge just like a known one and is refused with the same words after the proof, so key
/// ids cannot be told apart either.
async fn handshake<'a>(
    sh: &'a Shared,
    rd: &mut (impl AsyncRead + Unpin),
    wr: &mut (impl AsyncWrite + Unpin),
) -> std::result::Result<Admitted<'a>, Refused> {
    let hello = read_message(rd, MAX_HANDSHAKE_PAYLOAD).await?;
    let Some((_, Message::Hello { key_id, nonce: cn })) = hello else {
        return Err(refuse("the first message must be HELLO"));
    };
    let sn = auth::nonce()?;
    send(wr, &Message::Challenge { nonce: sn }, 0).await?;
    let Some((_, Message::Proof { proof })) = read_message(rd, MAX_HANDSHAKE_PAYLOAD).await? else {
        return Err(refuse("expected the client's proof"));
    };
    let key = sh.keys.get(&key_id);
    let secret = key.map_or(&sh.dummy_secret[..], |k| &k.secret[..]);
    let proven = auth::check_client(secret, &cn, &sn, &proof);
    let Some(key) = key.filter(|_| proven) else {
        return Err(refuse("wrong key or unknown key id"));
    };
    let busy = |message: String| Refused {
        code: ErrorCode::Busy,
        message,
    };
    let session = sh.sessions.clone().try_acquire_owned().map_err(|_| {
        busy(format!(
            "the agent serves its maximum of {} sessions",
            sh.cfg.max_connections
        ))
    })?;
    let slot = KeySlot::take(sh, &key_id).ok_or_else(|| {
        busy(format!(
            "key {key_id:?} already holds {} sessions",
            sh.cfg.max_sessions_per_key
        ))
    })?;
    let proof = auth::server_proof(secret, &cn, &sn).ok_or_else(|| refuse("unusable key"))?;
    let welcome = Message::Welcome {
        proof,
        instance: sh.instance,
    };
    send(wr, &welcome, 0).await?;
    Ok(Admitted {
        role: key.role,
        _session: session,
        key: slot,
    })
}

async fn send(wr: &mut (impl AsyncWrite + Unpin), msg: &Message, request_id: u64) -> Result<()> {
    wr.write_all(&msg.encode(request_id)).await?;
    Ok(())
}

/// Best effort: the peer may already be gone, or never read (then a second is all it gets).
async fn send_error(wr: &mut (impl AsyncWrite + Unpin), code: ErrorCode, message: &str, id: u64) {
    let msg = Message::Error {
        code: code.as_i32(),
        message: message.into(),
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), send(wr, &msg, id)).await;
}

/// A key's hold on one of its sessions; released when the connection ends.
struct KeySlot<'a> {
    sh: &'a Shared,
    key: String,
}

impl<'a> KeySlot<'a> {
    fn take(sh: &'a Shared, key: &str) -> Option<Self> {
        let mut per_key = sh.sessions_per_key.lock_unpoisoned();
        let n = per_key.entry(key.to_string()).or_insert(0);
        if *n >= sh.cfg.max_sessions_per_key {
            return None;
        }
        *n += 1;
        Some(Self {
            sh,
            key: key.to_string(),
        })
    }
}

impl Drop for KeySlot<'_> {
    fn drop(&mut self) {
        let mut per_key = self.sh.sessions_per_key.lock_unpoisoned();
        if let Some(n) = per_key.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                per_key.remove(&self.key);
            }
        }
    }
}
