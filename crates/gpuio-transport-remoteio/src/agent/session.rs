//! One connection: TLS where configured, the HELLO handshake (the client proves its key
//! first), then its requests in order, each within the agent's timeouts.

use super::buffer::Buffer;
use super::gate::{Pending, Progress};
use super::slots::{NoSlot, Slot};
use super::{Counters, Shared, serve};
use crate::auth::{self, Role};
use crate::wire::{HEADER_LEN, Header, MAX_HANDSHAKE_PAYLOAD, Message};
use crate::{RemoteIoError, Result};
use gpuio_hal::ErrorCode;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

/// How long a session may wait for its next request before giving its buffer back.
const KEEP_BUFFER: Duration = Duration::from_millis(100);

/// Serves one accepted connection: TLS first where the agent has a certificate.
pub(super) async fn serve(
    sh: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    mut stop: watch::Receiver<bool>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    pending: Pending,
) {
    let _ = stream.set_nodelay(true);
    // One deadline for the whole handshake, TLS and HELLO together.
    let deadline = tokio::time::Instant::now() + sh.cfg.handshake_timeout;
    // A socket that has sent something gives way after the silent ones; one that closed
    // before a byte is done with (an end of stream is no progress).
    let mut first = [0u8; 1];
    let spoke = tokio::select! {
        r = tokio::time::timeout_at(deadline, stream.peek(&mut first)) => r,
        _ = pending.evicted() => return,
        _ = stop.changed() => return,
    };
    match spoke {
        Ok(Ok(n)) if n > 0 => pending.advance(Progress::Spoke),
        Ok(_) => {
            Counters::add(&sh.counters.refused_sessions, 1);
            return;
        }
        // Silent to the deadline: the handshake below fails at once, saying so.
        Err(_) => {}
    }
    let Some(acceptor) = tls else {
        let (rd, wr) = stream.into_split();
        return serve_session(sh, rd, wr, peer, stop, pending, deadline).await;
    };
    let shake = tokio::time::timeout_at(deadline, acceptor.accept(stream));
    let tls = tokio::select! {
        t = shake => t,
        _ = pending.evicted() => return,
        _ = stop.changed() => return,
    };
    match tls {
        Ok(Ok(tls)) => {
            pending.advance(Progress::Secured);
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

/// Tells a connection accepted with the last spare descriptor that the agent is busy, and
/// closes it (taking the client's HELLO first, so the close does not reset the answer away).
pub(super) async fn refuse_busy(mut stream: TcpStream) {
    let msg = "the agent is out of file descriptors: try again shortly";
    send_error(&mut stream, ErrorCode::Busy, msg, 0).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.shutdown().await;
        let mut sink = [0u8; MAX_HANDSHAKE_PAYLOAD as usize + HEADER_LEN];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
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

/// A session's standing: what its key may do, and its place.
struct Admitted {
    role: Role,
    key: Arc<str>,
    slot: Slot,
}

/// How long a request being served may still run once the agent is told to stop.
const STOP_GRACE: Duration = Duration::from_secs(1);

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
    let shake = handshake(&sh, &mut rd, &mut wr, &pending, deadline);
    let shake = tokio::time::timeout_at(deadline, shake);
    let shaken = tokio::select! {
        s = shake => s,
        _ = pending.evicted() => return,
        // Stopping: a handshake is no request in flight.
        _ = stop.changed() => return,
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
    let slot = &admitted.slot;
    let buffer = Buffer::new(sh.buffers.clone(), admitted.key.clone());
    let mut state = serve::SessionState::new(buffer);
    loop {
        // A stop seen while a request ran (below) fires `changed` no more: the value says it.
        if *stop.borrow() {
            return;
        }
        slot.set_idle(true);
        let holds_links = state.holds_links();
        let first = tokio::select! {
            b = next_request(&sh, &mut rd, &mut state.buffer, holds_links) => b,
            _ = stop.changed() => return,
            // Its place went to a key below its share: close between requests.
            _ = slot.preempted() => return,
        };
        let first = match first {
            Some(Ok(b)) => b,
            Some(Err(_)) | None => return,
        };
        if !slot.set_idle(false) {
            return;
        }
        let served = {
            let served = tokio::time::timeout(sh.cfg.io_timeout, async {
                let header = read_header_rest(&mut rd, first).await?;
                serve::serve_one(&sh, admitted.role, &mut rd, &mut wr, header, &mut state).await?;
                // TLS may hold the answer's last record back until flushed; the client waits
                // for it before it sends another request.
                wr.flush().await?;
                Ok(())
            });
            tokio::pin!(served);
            tokio::select! {
                s = &mut served => s,
                // Stopping: a request on its way gets a moment to finish, a stalled one does
                // not hold the agent up for its whole io_timeout.
                _ = stop.changed() => match tokio::time::timeout(STOP_GRACE, &mut served).await {
                    Ok(s) => s,
                    Err(_) => return,
                },
            }
        };
        match served {
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
/// its buffer back first. A session holding RDMA or NIXL links has no idle timeout: its bytes
/// move on those, with the control connection silent (preemption still closes it).
async fn next_request(
    sh: &Shared,
    rd: &mut (impl AsyncRead + Unpin),
    buffer: &mut Buffer,
    holds_links: bool,
) -> Option<std::io::Result<u8>> {
    let mut b = [0u8; 1];
    // A one-byte read is cancel-safe: a timeout loses no byte.
    let n = match tokio::time::timeout(KEEP_BUFFER, rd.read(&mut b)).await {
        Ok(n) => n,
        Err(_) => {
            buffer.release();
            if holds_links {
                rd.read(&mut b).await
            } else {
                tokio::time::timeout(sh.cfg.idle_timeout, rd.read(&mut b))
                    .await
                    .ok()?
            }
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
async fn handshake(
    sh: &Shared,
    rd: &mut (impl AsyncRead + Unpin),
    wr: &mut (impl AsyncWrite + Unpin),
    pending: &Pending,
    deadline: tokio::time::Instant,
) -> std::result::Result<Admitted, Refused> {
    let hello = read_message(rd, MAX_HANDSHAKE_PAYLOAD).await?;
    let Some((_, Message::Hello { key_id, nonce: cn })) = hello else {
        return Err(refuse("the first message must be HELLO"));
    };
    // It speaks the protocol: its place is kept until the deadline.
    pending.advance(Progress::Hello);
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
    // Waits for a place only where the key is owed one, and leaves time to say `Busy` before
    // the handshake's deadline.
    let wait_until = deadline - sh.cfg.handshake_timeout / 10;
    let slot = sh
        .slots
        .take(&key_id, wait_until)
        .await
        .map_err(|why| Refused {
            code: ErrorCode::Busy,
            message: match why {
                NoSlot::KeyFull => format!("key {key_id:?} holds its maximum of sessions"),
                NoSlot::Full => "the agent serves its maximum of sessions, and this key its \
                                 share of them"
                    .into(),
            },
        })?;
    let proof = auth::server_proof(secret, &cn, &sn).ok_or_else(|| refuse("unusable key"))?;
    let welcome = Message::Welcome {
        proof,
        instance: sh.instance,
    };
    send(wr, &welcome, 0).await?;
    Ok(Admitted {
        role: key.role,
        key: key_id.into(),
        slot,
    })
}

async fn send(wr: &mut (impl AsyncWrite + Unpin), msg: &Message, request_id: u64) -> Result<()> {
    wr.write_all(&msg.encode(request_id)).await?;
    wr.flush().await?;
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
