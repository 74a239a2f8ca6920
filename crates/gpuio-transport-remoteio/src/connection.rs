//! One authenticated, blocking TCP connection to an agent: the HELLO handshake (the client
//! proves its key first, then checks the agent's proof and learns which instance of the agent
//! it reached), then pipelined reads and writes. Data never passes through
//! an intermediate buffer on this side: a read's bytes are received straight into the
//! caller's slice, a write's bytes are sent straight from it.
//!
//! A connection keeps up to [`PIPELINE_DEPTH`] requests in flight, so the agent always has
//! the next request while the network carries the last answer. A refusal (an ERROR for one
//! request) leaves the connection usable: the answers still in flight are drained first. A
//! network or protocol failure marks it [`broken`](Connection::is_broken).

use crate::auth;
use crate::tls::TlsClient;
use crate::wire::{
    self, HEADER_LEN, Header, MAX_DATA, MAX_MESSAGE, Message, MsgType, READ_RESP_HEAD, RdmaInfo,
    WireError,
};
use crate::{RemoteIoError, Result, code_from_i32};
use std::collections::VecDeque;
use std::fmt;
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The largest answer taken from an agent before it has proven the key: a refusal (a code and
/// a message) is the longest it may send.
const HANDSHAKE_REPLY: u64 = 6 + MAX_MESSAGE as u64;

/// Requests a connection keeps in flight.
pub const PIPELINE_DEPTH: usize = 4;

/// A key to authenticate with: its name, and the secret that never crosses the wire.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The key's name, as the agent knows it.
    pub key_id: String,
    /// The shared secret.
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials {{ key_id: {:?} }}", self.key_id)
    }
}

/// An export's size and whether this session may write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    /// Bytes readable now.
    pub size: u64,
    /// The most bytes writes may reach: the size of a memory export, the limit a file
    /// export may grow to.
    pub capacity: u64,
    /// Whether writes are permitted (by the export and the key's role).
    pub writable: bool,
    /// Whether [`Connection::sync`] makes written bytes durable (a file export; memory
    /// starts afresh when the agent restarts).
    pub durable: bool,
    /// The agent instance that answered (see [`Connection::instance`]).
    pub instance: u64,
}

/// The bytes under a connection: plain TCP, or TLS over it.
enum Stream {
    Plain(Tcp),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, Tcp>>),
}

/// A TCP stream whose reads and writes can be held to a deadline: each waits at most until
/// it, so a peer that trickles a byte now and then cannot stretch the wait past it (a
/// socket's own timeout bounds each read alone).
#[derive(Debug)]
struct Tcp {
    stream: TcpStream,
    deadline: Option<Instant>,
}

impl Tcp {
    /// Sets the socket's timeouts to what is left before the deadline, if there is one.
    fn arm(&self) -> std::io::Result<()> {
        let Some(deadline) = self.deadline else {
            return Ok(());
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.set_write_timeout(Some(left))
    }
}

impl Read for Tcp {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.arm()?;
        self.stream.read(buf)
    }
}

impl Write for Tcp {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.arm()?;
        self.stream.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        self.arm()?;
        self.stream.write_vectored(bufs)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

impl Stream {
    fn tcp(&mut self) -> &mut Tcp {
        match self {
            Self::Plain(s) => s,
            Self::Tls(s) => &mut s.sock,
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Self::Plain(s) => s.read(buf),
            Self::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Plain(s) => s.write(buf),
            Self::Tls(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        match self {
            Self::Plain(s) => s.write_vectored(bufs),
            Self::Tls(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Self::Plain(s) => s.flush(),
            Self::Tls(s) => s.flush(),
        }
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Plain(_) => "tcp",
            Self::Tls(_) => "tls",
        })
    }
}

/// An agent's answer to a NIXL request: the metadata of the NIXL agent that registered the
/// export (a bearer credential for its bytes), the export's address in the agent's process,
/// and whether it is GPU memory (of that CUDA device) or host memory.
#[derive(Clone, PartialEq, Eq)]
pub struct NixlOffer {
    /// The NIXL agent's metadata.
    pub metadata: Vec<u8>,
    /// The export's first byte, in the agent's address space.
    pub addr: u64,
    /// `Some(ordinal)`: GPU memory of that CUDA device; `None`: host memory.
    pub gpu: Option<u32>,
}

impl NixlOffer {
    /// One JSON line for a program that speaks NIXL with its own API: `metadata` (hex),
    /// `addr`, `len` (the export's `len` bytes) and `gpu` (the CUDA device, null for host
    /// memory: NIXL's `VRAM` or `DRAM`).
    pub fn to_json(&self, len: u64) -> String {
        let hex: String = self.metadata.iter().map(|b| format!("{b:02x}")).collect();
        let gpu = self.gpu.map_or("null".to_string(), |g| g.to_string());
        format!(
            "{{\"metadata\": \"{hex}\", \"addr\": {}, \"len\": {len}, \"gpu\": {gpu}}}",
            self.addr
        )
    }
}

impl fmt::Debug for NixlOffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The metadata is a credential: its size only.
        f.debug_struct("NixlOffer")
            .field("metadata_bytes", &self.metadata.len())
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("gpu", &self.gpu)
            .finish()
    }
}

/// A connection to an agent.
#[derive(Debug)]
pub struct Connection {
    stream: Stream,
    next_id: u64,
    broken: bool,
    instance: u64,
}

/// One piece of a pipelined transfer: an offset in the export and the caller's bytes.
type Piece<'a, B> = (u64, B);

impl Connection {
    /// Connects to the agent at `addr` over plain TCP and authenticates. `timeout` bounds
    /// the connect and every later wait for the agent.
    pub fn connect(addr: SocketAddr, creds: &Credentials, timeout: Duration) -> Result<Self> {
        Self::connect_with(addr, creds, timeout, None)
    }

    /// Like [`connect`](Self::connect), over TLS when `tls` names the trust and the agent's
    /// name (as its certificate has it).
    pub fn connect_with(
        addr: SocketAddr,
        creds: &Credentials,
        timeout: Duration,
        tls: Option<(&TlsClient, &str)>,
    ) -> Result<Self> {
        // The whole handshake, TLS included, within `timeout` of the start: an agent that
        // answers a byte at a time cannot hold the client longer.
        let deadline = Instant::now() + timeout;
        let tcp = TcpStream::connect_timeout(&addr, timeout)?;
        tcp.set_nodelay(true)?;
        let tcp = Tcp {
            stream: tcp,
            deadline: Some(deadline),
        };
        let stream = match tls {
            None => Stream::Plain(tcp),
            Some((client, name)) => Stream::Tls(Box::new(rustls::StreamOwned::new(
                client.session(name)?,
                tcp,
            ))),
        };
        let mut c = Self {
            stream,
            next_id: 1,
            broken: false,
            instance: 0,
        };
        c.handshake(creds)?;
        // From here each wait for the agent is bounded by `timeout` on its own.
        let tcp = c.stream.tcp();
        tcp.deadline = None;
        tcp.stream.set_read_timeout(Some(timeout))?;
        tcp.stream.set_write_timeout(Some(timeout))?;
        Ok(c)
    }

    /// The HELLO exchange, on a fresh connection.
    fn handshake(&mut self, creds: &Credentials) -> Result<()> {
        let c = self;
        // The client proves its key first: an agent answers a HELLO with a bare challenge, so
        // nobody without the key gets anything to test guesses against.
        let cn = auth::nonce()?;
        c.send(
            &Message::Hello {
                key_id: creds.key_id.clone(),
                nonce: cn,
            },
            0,
        )?;
        // Until the agent has proven the key, it is a stranger: no more than a handshake
        // message's bytes (or a refusal's) are taken from it.
        let sn = match c.recv_at_most(HANDSHAKE_REPLY)?.1 {
            Message::Challenge { nonce } => nonce,
            other => return Err(refused(other)),
        };
        let proof = auth::client_proof(&creds.secret, &cn, &sn)
            .ok_or_else(|| RemoteIoError::Auth("unusable key".into()))?;
        c.send(&Message::Proof { proof }, 0)?;
        let (proof, instance) = match c.recv_at_most(HANDSHAKE_REPLY)?.1 {
            Message::Welcome { proof, instance } => (proof, instance),
            other => return Err(refused(other)),
        };
        if !auth::check_server(&creds.secret, &cn, &sn, &proof) {
            return Err(RemoteIoError::Auth(
                "the agent could not prove it holds the key".into(),
            ));
        }
        c.instance = instance;
        Ok(())
    }

    /// Which instance of the agent this connection reached: drawn at random when the agent
    /// starts, so a restarted agent (whose memory exports start afresh) has another.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// Whether an idle connection can still carry a request: not broken, and the agent has
    /// neither closed it (it closes idle connections) nor sent anything unasked. Asked of the
    /// socket without blocking.
    pub fn is_alive(&self) -> bool {
        if self.broken {
            return false;
        }
        use std::os::fd::AsFd;
        let tcp = match &self.stream {
            Stream::Plain(s) => &s.stream,
            Stream::Tls(s) => &s.get_ref().stream,
        };
        matches!(
            gpuio_hal::peek_nonblocking(tcp.as_fd()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
        )
    }

    /// Whether the connection failed (network or protocol) and must not be used again.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// The size of `export` and whether this session may write it.
    pub fn stat(&mut self, export: &str) -> Result<ExportInfo> {
        self.guard(|c| {
            let id = c.id();
            c.send(
                &Message::StatReq {
                    export: export.into(),
                },
                id,
            )?;
            match c.response(id)? {
                Message::StatResp {
                    size,
                    capacity,
                    writable,
                    durable,
                    instance,
                } => Ok(ExportInfo {
                    size,
                    capacity,
                    writable,
                    durable,
                    instance,
                }),
                other => Err(unexpected(&other)),
            }
        })
    }

    /// Makes the bytes written to `export` durable (the agent `fdatasync`s a file export);
    /// refused for memory, which starts afresh when the agent restarts.
    pub fn sync(&mut self, export: &str) -> Result<()> {
        self.done(&Message::SyncReq {
            export: export.into(),
        })
    }

    /// Reserves room for the first `len` bytes of `export` before any is written (a file
    /// export's blocks are allocated): a copy the agent's disk cannot hold is refused before
    /// it overwrites anything.
    pub fn reserve(&mut self, export: &str, len: u64) -> Result<()> {
        self.done(&Message::ReserveReq {
            export: export.into(),
            len,
        })
    }

    /// Sends a request answered by DONE.
    fn done(&mut self, req: &Message) -> Result<()> {
        self.guard(|c| {
            let id = c.id();
            c.send(req, id)?;
            match c.response(id)? {
                Message::Done => Ok(()),
                other => Err(unexpected(&other)),
            }
        })
    }

    /// Asks the agent to reach `export` over RDMA from the queue pair `ours`; returns the
    /// agent's queue pair and the export's region.
    pub fn rdma_exchange(&mut self, export: &str, ours: &RdmaInfo) -> Result<RdmaInfo> {
        self.guard(|c| {
            let id = c.id();
            let req = Message::RdmaRequest {
                info: *ours,
                export: export.into(),
            };
            c.send(&req, id)?;
            match c.response(id)? {
                Message::RdmaInfo(info) => Ok(info),
                other => Err(unexpected(&other)),
            }
        })
    }

    /// Asks the agent to reach `export` over NIXL; returns the NIXL metadata of the agent's
    /// side, the export's address there and where it lies.
    pub fn nixl_exchange(&mut self, export: &str) -> Result<NixlOffer> {
        self.guard(|c| {
            let id = c.id();
            let req = Message::NixlRequest {
                export: export.into(),
            };
            c.send(&req, id)?;
            match c.response(id)? {
                Message::NixlInfo {
                    metadata,
                    addr,
                    gpu,
                } => Ok(NixlOffer {
                    metadata,
                    addr,
                    gpu,
                }),
                other => Err(unexpected(&other)),
            }
        })
    }

    /// Reads `buf.len()` bytes of `export` at `offset`, in messages of at most `chunk` bytes.
    pub fn read(&mut self, export: &str, offset: u64, buf: &mut [u8], chunk: usize) -> Result<()> {
        let pieces = split_mut(offset, buf, chunk)?;
        self.read_pieces(export, pieces)
    }

    /// Writes `data` to `export` at `offset`, in messages of at most `chunk` bytes.
    pub fn write(&mut self, export: &str, offset: u64, data: &[u8], chunk: usize) -> Result<()> {
        let pieces = split(offset, data, chunk)?;
        self.write_pieces(export, pieces)
    }

    /// Reads every piece (each at most [`MAX_DATA`] bytes) of `export`, pipelined.
    pub fn read_pieces(&mut self, export: &str, pieces: Vec<Piece<'_, &mut [u8]>>) -> Result<()> {
        self.guard(|c| {
            let mut todo = pieces.into_iter();
            let mut in_flight: VecDeque<(u64, &mut [u8])> = VecDeque::new();
            let mut first_refusal = None;
            loop {
                while in_flight.len() < PIPELINE_DEPTH
                    && let Some((offset, buf)) = todo.next()
                {
                    let id = c.id();
                    let req = Message::ReadReq {
                        export: export.into(),
                        offset,
                        len: buf.len() as u64,
                    };
                    c.send(&req, id)?;
                    in_flight.push_back((id, buf));
                }
                let Some((id, buf)) = in_flight.pop_front() else {
                    break;
                };
                if let Err(e) = c.receive_read(id, buf) {
                    if !matches!(e, RemoteIoError::Remote { .. }) {
                        return Err(e);
                    }
                    // Refused: stop sending, collect what is in flight, report the refusal.
                    first_refusal.get_or_insert(e);
                    for _ in todo.by_ref() {}
                }
            }
            first_refusal.map_or(Ok(()), Err)
        })
    }

    /// Writes every piece (each at most [`MAX_DATA`] bytes) to `export`, pipelined.
    pub fn write_pieces(&mut self, export: &str, pieces: Vec<Piece<'_, &[u8]>>) -> Result<()> {
        self.guard(|c| {
            let mut todo = pieces.into_iter();
            let mut in_flight: VecDeque<(u64, usize)> = VecDeque::new();
            let mut first_refusal = None;
            loop {
                while in_flight.len() < PIPELINE_DEPTH
                    && let Some((offset, data)) = todo.next()
                {
                    let id = c.id();
                    let head = wire::write_req_head(id, export, offset, data.len());
                    write_all_vectored(&mut c.stream, &head, data)?;
                    in_flight.push_back((id, data.len()));
                }
                let Some((id, n)) = in_flight.pop_front() else {
                    break;
                };
                let answer = c.response(id).and_then(|m| match m {
                    Message::WriteResp { written } if written == n as u64 => Ok(()),
                    Message::WriteResp { written } => Err(malformed(
                        "WRITE_RESP",
                        format!("{written} bytes written of {n}"),
                    )),
                    other => Err(unexpected(&other)),
                });
                if let Err(e) = answer {
                    if !matches!(e, RemoteIoError::Remote { .. }) {
                        return Err(e);
                    }
                    first_refusal.get_or_insert(e);
                    for _ in todo.by_ref() {}
                }
            }
            first_refusal.map_or(Ok(()), Err)
        })
    }

    /// Sends raw bytes (tests use it to break the protocol on purpose).
    #[doc(hidden)]
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream.write_all(bytes)?;
        Ok(())
    }

    /// Runs `f`, marking the connection broken when it fails for any reason but a refusal.
    fn guard<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.broken {
            return Err(RemoteIoError::Network(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "the connection failed earlier",
            )));
        }
        let r = f(self);
        if let Err(e) = &r
            && !matches!(e, RemoteIoError::Remote { .. })
        {
            self.broken = true;
        }
        r
    }

    fn id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Receives the answer to read `id` straight into `buf`.
    fn receive_read(&mut self, id: u64, buf: &mut [u8]) -> Result<()> {
        let mut head = [0u8; READ_RESP_HEAD];
        self.stream
            .read_exact(&mut head[..HEADER_LEN])
            .map_err(timeouts)?;
        let header = Header::decode(head[..HEADER_LEN].try_into().unwrap_or(&[0; HEADER_LEN]))?;
        if header.msg_type != MsgType::ReadResp {
            let msg = self.payload(&header)?;
            return Err(answer_error(&header, msg, id));
        }
        check_id(&header, id)?;
        self.stream
            .read_exact(&mut head[HEADER_LEN..])
            .map_err(timeouts)?;
        let len: [u8; 8] = head[HEADER_LEN..].try_into().unwrap_or([0; 8]);
        wire::check_read_resp(&header, len, buf.len())?;
        self.stream.read_exact(buf).map_err(timeouts)
    }

    /// The answer to request `id`: an ERROR becomes [`RemoteIoError::Remote`].
    fn response(&mut self, id: u64) -> Result<Message> {
        let (header, msg) = self.recv()?;
        if matches!(msg, Message::Error { .. }) {
            return Err(answer_error(&header, msg, id));
        }
        check_id(&header, id)?;
        Ok(msg)
    }

    fn send(&mut self, msg: &Message, id: u64) -> Result<()> {
        self.stream.write_all(&msg.encode(id))?;
        Ok(())
    }

    fn recv(&mut self) -> Result<(Header, Message)> {
        self.recv_at_most(wire::MAX_PAYLOAD)
    }

    fn recv_at_most(&mut self, limit: u64) -> Result<(Header, Message)> {
        let mut h = [0u8; HEADER_LEN];
        self.stream.read_exact(&mut h).map_err(timeouts)?;
        let header = Header::decode(&h)?;
        header.check_payload(limit)?;
        let msg = self.payload(&header)?;
        Ok((header, msg))
    }

    fn payload(&mut self, header: &Header) -> Result<Message> {
        // Bounded by Header::decode (MAX_PAYLOAD).
        let mut payload = vec![0u8; header.payload_len as usize];
        self.stream.read_exact(&mut payload).map_err(timeouts)?;
        Ok(Message::decode(header, &payload)?)
    }
}

/// `data` as pieces of at most `chunk` (and [`MAX_DATA`]) bytes with their export offsets.
pub(crate) fn split(offset: u64, data: &[u8], chunk: usize) -> Result<Vec<Piece<'_, &[u8]>>> {
    let chunk = chunk.clamp(1, MAX_DATA);
    data.chunks(chunk)
        .enumerate()
        .map(|(i, c)| Ok((advance(offset, i * chunk)?, c)))
        .collect()
}

/// `buf` as pieces of at most `chunk` (and [`MAX_DATA`]) bytes with their export offsets.
pub(crate) fn split_mut(
    offset: u64,
    buf: &mut [u8],
    chunk: usize,
) -> Result<Vec<Piece<'_, &mut [u8]>>> {
    let chunk = chunk.clamp(1, MAX_DATA);
    buf.chunks_mut(chunk)
        .enumerate()
        .map(|(i, c)| Ok((advance(offset, i * chunk)?, c)))
        .collect()
}

fn advance(offset: u64, by: usize) -> Result<u64> {
    offset
        .checked_add(by as u64)
        .ok_or_else(|| RemoteIoError::InvalidArgument(format!("offset {offset}+{by} overflows")))
}

/// Writes `head` then `data` with as few system calls as the socket allows.
fn write_all_vectored(stream: &mut impl Write, head: &[u8], data: &[u8]) -> Result<()> {
    let (mut h, mut d) = (head, data);
    while !h.is_empty() {
        let n = stream.write_vectored(&[IoSlice::new(h), IoSlice::new(d)])?;
        if n == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into());
        }
        let from_head = n.min(h.len());
        h = &h[from_head..];
        d = &d[n - from_head..];
    }
    stream.write_all(d)?;
    Ok(())
}

fn check_id(header: &Header, id: u64) -> Result<()> {
    if header.request_id != id {
        return Err(malformed(
            "response",
            format!("answers request {} instead of {id}", header.request_id),
        ));
    }
    Ok(())
}

/// What an answer other than the expected one means: a refusal of request `id`, or a broken
/// protocol.
fn answer_error(header: &Header, msg: Message, id: u64) -> RemoteIoError {
    match msg {
        Message::Error { code, message } if header.request_id == id => RemoteIoError::Remote {
            code: code_from_i32(code),
            message,
        },
        // An ERROR for request 0 is the agent closing the connection on a protocol error.
        Message::Error { message, .. } => malformed("response", message),
        other => unexpected(&other),
    }
}

/// The agent's refusal of a handshake: a permission refusal is [`RemoteIoError::Auth`], any
/// other code (`Busy`: the key holds too many sessions) a [`RemoteIoError::Remote`].
fn refused(msg: Message) -> RemoteIoError {
    match msg {
        Message::Error { code, message } => match code_from_i32(code) {
            gpuio_hal::ErrorCode::Permission => RemoteIoError::Auth(message),
            code => RemoteIoError::Remote { code, message },
        },
        other => unexpected(&other),
    }
}

fn malformed(what: &'static str, why: String) -> RemoteIoError {
    RemoteIoError::Protocol(WireError::Malformed { what, why })
}

fn unexpected(msg: &Message) -> RemoteIoError {
    malformed("response", format!("unexpected {msg:?}"))
}

/// A read that hit the socket timeout is a timeout, not a network failure.
fn timeouts(e: std::io::Error) -> RemoteIoError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            RemoteIoError::TimedOut("waiting for the agent".into())
        }
        _ => RemoteIoError::Network(e),
    }
}

#[cfg(test)]
mod tests {
    use super::NixlOffer;

    #[test]
    fn a_nixl_offer_is_one_json_line_and_its_debug_hides_the_metadata() {
        let mut o = NixlOffer {
            metadata: vec![0xab, 1],
            addr: 42,
            gpu: Some(1),
        };
        assert_eq!(
            o.to_json(7),
            r#"{"metadata": "ab01", "addr": 42, "len": 7, "gpu": 1}"#
        );
        o.gpu = None;
        assert!(o.to_json(7).ends_with(r#""gpu": null}"#));
        assert!(!format!("{o:?}").contains("ab01") && !format!("{o:?}").contains("171"));
    }
}
