//! Serving one request whose header was read: STAT, READ, WRITE, SYNC, RESERVE and the RDMA
//! exchange, each checked against its export (exists, in bounds) and the key's role, answered
//! with its result or a refusal. Export locks are held only while bytes are copied between the
//! export and the session's buffer, never across socket IO. A read of a file or GPU memory
//! goes out a piece at a time, so a client that does not read its answer holds one piece of
//! buffer, not the whole read. A write that extends a file reserves the blocks it adds first:
//! a full disk refuses it before a byte lands.

use super::buffer::Buffer;
use super::session::read_payload;
use super::{Access, Counters, Served, Shared, Source};
use crate::RemoteIoError;
use crate::auth::Role;
use crate::wire::{self, Header, MAX_REQUEST_PAYLOAD, Message, MsgType, WireError, WriteHead};
use gpuio_hal::ErrorCode;
use gpuio_hal::sync::MutexExt;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Bytes of an answer staged in the session's buffer at a time: a memory export's under its
/// read lock where the answer cannot be written without waiting (TLS; the lock is held for a
/// memcpy of this size, then released while the bytes go out), and a file's or GPU memory's.
const READ_CHUNK: usize = 1 << 20;

/// Where a session's answers go. Plain TCP takes bytes without waiting (`try_write`), so a
/// memory export's bytes go straight from the export into the socket, its lock held only for
/// each non-blocking write; TLS encrypts into buffers of its own, so the bytes are copied out
/// of the export first.
pub(super) trait Answers: AsyncWrite + Unpin + Send {
    /// Whether [`write_now`](Self::write_now) works.
    const WRITES_NOW: bool = false;

    /// Writes what the socket takes now, without waiting (`WouldBlock` when it is full).
    fn write_now(&mut self, _buf: &[u8]) -> std::io::Result<usize> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    /// Waits until the socket takes more.
    fn ready(&mut self) -> impl std::future::Future<Output = std::io::Result<()>> + Send {
        std::future::ready(Ok(()))
    }
}

impl Answers for tokio::net::tcp::OwnedWriteHalf {
    const WRITES_NOW: bool = true;

    fn write_now(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.try_write(buf)
    }

    fn ready(&mut self) -> impl std::future::Future<Output = std::io::Result<()>> + Send {
        self.writable()
    }
}

impl<T: AsyncRead + AsyncWrite + Send> Answers for tokio::io::WriteHalf<T> {}

/// Why a connection ends.
pub(super) enum Fatal {
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

/// A refusal or failure to report to the client.
pub(super) struct Refusal {
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

type Answer = std::result::Result<Message, Refusal>;

/// What a session keeps between its requests.
pub(super) struct SessionState {
    /// Bytes on their way between the socket and an export.
    pub(super) buffer: Buffer,
    /// RDMA links to this client (they live as long as the session).
    #[cfg(feature = "rdma")]
    links: Vec<crate::rdma::Link>,
    /// NIXL links of this client (each a NIXL agent of its own; they live as long as the
    /// session).
    #[cfg(feature = "nixl")]
    nixl_links: Vec<crate::nixl::Link>,
}

impl SessionState {
    /// Whether the session holds RDMA or NIXL links (whose traffic the control connection
    /// does not see).
    pub(super) fn holds_links(&self) -> bool {
        #[allow(unused_mut)] // set by the link features where built
        let mut held = false;
        #[cfg(feature = "rdma")]
        {
            held |= !self.links.is_empty();
        }
        #[cfg(feature = "nixl")]
        {
            held |= !self.nixl_links.is_empty();
        }
        held
    }

    pub(super) fn new(buffer: Buffer) -> Self {
        Self {
            buffer,
            #[cfg(feature = "rdma")]
            links: Vec::new(),
            #[cfg(feature = "nixl")]
            nixl_links: Vec::new(),
        }
    }
}

/// Serves one request whose header was read, answering it (with its result or a refusal).
pub(super) async fn serve_one(
    sh: &Shared,
    role: Role,
    rd: &mut (impl AsyncRead + Unpin),
    wr: &mut impl Answers,
    header: Header,
    state: &mut SessionState,
) -> std::result::Result<(), Fatal> {
    let id = header.request_id;
    let result = if header.msg_type == MsgType::WriteReq {
        let mut name_len = [0u8; 2];
        rd.read_exact(&mut name_len).await?;
        if u16::from_le_bytes(name_len) as usize > wire::MAX_NAME {
            return Err(WireError::Malformed {
                what: "WRITE_REQ",
                why: "an export name over 255 bytes".into(),
            }
            .into());
        }
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
        write(sh, role, rd, head, &mut state.buffer).await?
    } else {
        // Only a WRITE_REQ carries data: nothing else is buffered beyond a few names.
        header.check_payload(MAX_REQUEST_PAYLOAD)?;
        match read_payload(rd, &header).await.map_err(Fatal::Protocol)? {
            Message::ReadReq {
                export,
                offset,
                len,
            } => return read(sh, wr, id, &export, offset, len, &mut state.buffer).await,
            Message::StatReq { export } => stat(sh, role, &export).await,
            Message::SyncReq { export } => sync(sh, role, &export).await,
            Message::ReserveReq { export, len } => reserve(sh, role, &export, len).await,
            Message::RdmaRequest { info, export } => {
                rdma_link(sh, role, &export, &info, state).await
            }
            Message::NixlRequest { export } => nixl_link(sh, role, &export, state).await,
            other => {
                let why = format!("unexpected {other:?} after the handshake");
                return Err(Fatal::Protocol(RemoteIoError::InvalidArgument(why)));
            }
        }
    };
    answer(sh, wr, id, result).await
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
) -> Answer {
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
    // Registering the export is local work (no network IO under the lock).
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
) -> Answer {
    Err(Refusal::new(
        ErrorCode::Unsupported,
        "this agent was built without RDMA (cargo feature `rdma`)",
    ))
}

/// Answers a client's NIXL_INFO request: where the session may write the memory export (host
/// or GPU memory), a NIXL agent of the link's own registers it and its metadata goes back (NIXL cannot hold a
/// peer to reading, so read-only sessions are refused and read over TCP).
#[cfg(feature = "nixl")]
async fn nixl_link(sh: &Shared, role: Role, name: &str, state: &mut SessionState) -> Answer {
    if !sh.nixl {
        return Err(Refusal::new(
            ErrorCode::Unsupported,
            "this agent does not serve NIXL ([agent] nixl = true)",
        ));
    }
    let ex = export(sh, name)?;
    if !may_write(ex, role) {
        return Err(Refusal::new(
            ErrorCode::Unsupported,
            "NIXL cannot hold a peer to reading: it is offered only to sessions that may \
             write the export (this one is read over TCP)",
        ));
    }
    // One link per export and session: asked again, the same answer.
    if let Some(link) = state.nixl_links.iter().find(|l| l.export() == name) {
        return Ok(link.answer());
    }
    // Registering the export is local work (no network IO under the lock).
    let host;
    let mem = match &ex.source {
        Source::Memory(mem) => {
            host = mem.read().await;
            crate::nixl::ExportMemory::Host(&host)
        }
        Source::Device(buf) => crate::nixl::ExportMemory::Device(buf),
        Source::File { .. } => {
            return Err(Refusal::new(
                ErrorCode::Unsupported,
                format!("export {name:?} is a file: NIXL reaches memory exports only"),
            ));
        }
    };
    if let Some(why) = mem.refusal() {
        return Err(Refusal::new(
            ErrorCode::Unsupported,
            format!("export {name:?} is not offered over NIXL (served over TCP): {why}"),
        ));
    }
    // A link that cannot be set up here (UCX found no transport, say) leaves TCP to serve.
    let link = crate::nixl::accept(name, mem).map_err(|e| {
        Refusal::new(
            ErrorCode::Unsupported,
            format!("NIXL could not be set up for {name:?} (served over TCP): {e}"),
        )
    })?;
    let answer = link.answer();
    state.nixl_links.push(link);
    Ok(answer)
}

#[cfg(not(feature = "nixl"))]
async fn nixl_link(_sh: &Shared, _role: Role, _name: &str, _state: &mut SessionState) -> Answer {
    Err(Refusal::new(
        ErrorCode::Unsupported,
        "this agent was built without NIXL (cargo feature `nixl`)",
    ))
}

/// Sends a small answer or a refusal, counting it.
async fn answer(
    sh: &Shared,
    wr: &mut (impl AsyncWrite + Unpin),
    id: u64,
    result: Answer,
) -> std::result::Result<(), Fatal> {
    let msg = match result {
        Ok(m) => {
            Counters::add(&sh.counters.served, 1);
            m
        }
        Err(r) => {
            Counters::add(&sh.counters.refused, 1);
            Message::Error {
                code: r.code.as_i32(),
                message: r.message,
            }
        }
    };
    wr.write_all(&msg.encode(id)).await?;
    Ok(())
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

fn hal_refusal(e: gpuio_hal::HalError) -> Refusal {
    Refusal::new(e.code(), e.to_string())
}

/// The room a buffer needs could not be had (the machine cannot back it now).
fn no_memory(e: gpuio_hal::HalError) -> Refusal {
    Refusal::new(
        ErrorCode::Busy,
        format!("the agent is short of memory: {e}"),
    )
}

/// The bytes an export holds now.
async fn size(source: &Source) -> std::result::Result<u64, Refusal> {
    Ok(match source {
        Source::Memory(mem) => mem.read().await.len() as u64,
        Source::Device(buf) => buf.len() as u64,
        Source::File { file, .. } => file.metadata().map_err(io_refusal)?.len(),
    })
}

/// The most bytes writes may reach, for an export holding `held` bytes now: those, and for a
/// file its limit if larger (a file grown past its limit since the agent started may still
/// be written where it has bytes). STAT reports the same bound writes are checked against.
fn capacity(source: &Source, held: u64) -> u64 {
    match source {
        Source::File { max_len, .. } => held.max(*max_len),
        _ => held,
    }
}

async fn stat(sh: &Shared, role: Role, name: &str) -> Answer {
    let ex = export(sh, name)?;
    let size = size(&ex.source).await?;
    Ok(Message::StatResp {
        size,
        capacity: capacity(&ex.source, size),
        writable: may_write(ex, role),
        durable: matches!(ex.source, Source::File { .. }),
        instance: sh.instance,
    })
}

/// The export `name`, if this session may write it.
fn writable<'a>(
    sh: &'a Shared,
    role: Role,
    name: &str,
) -> std::result::Result<&'a Served, Refusal> {
    let ex = export(sh, name)?;
    if !may_write(ex, role) {
        return Err(Refusal::new(
            ErrorCode::Permission,
            format!("writing export {name:?} is not permitted"),
        ));
    }
    Ok(ex)
}

/// Makes what was written to a file export durable (`fdatasync`), on a blocking thread.
/// Memory and GPU memory start afresh when the agent restarts: refused, saying so.
async fn sync(sh: &Shared, role: Role, name: &str) -> Answer {
    let Source::File { file, flush, .. } = &writable(sh, role, name)?.source else {
        return Err(Refusal::new(
            ErrorCode::Unsupported,
            format!(
                "export {name:?} is memory, which starts afresh when the agent restarts: it \
                 cannot be made durable"
            ),
        ));
    };
    let (file, turn) = (file.clone(), turn(flush).await?);
    blocking(move || {
        let _turn = turn;
        file.sync_data().map_err(io_refusal)
    })
    .await?;
    Ok(Message::Done)
}

/// Reserves room for the first `len` bytes of a file export (its blocks allocated, its size
/// unchanged), so that a copy the disk cannot hold is refused before it writes anything.
/// Memory and GPU memory hold their bytes already: only the bounds are checked.
async fn reserve(sh: &Shared, role: Role, name: &str, len: u64) -> Answer {
    let ex = writable(sh, role, name)?;
    in_bounds(name, 0, len, capacity(&ex.source, size(&ex.source).await?))?;
    if let Source::File { file, flush, .. } = &ex.source {
        let (file, name, turn) = (file.clone(), name.to_string(), turn(flush).await?);
        blocking(move || {
            let _turn = turn;
            reserve_file(&file, &name, 0, len)
        })
        .await?;
    }
    Ok(Message::Done)
}

/// Allocates the blocks of `offset..offset+len` of a file export; a full disk is refused
/// naming the export.
fn reserve_file(
    file: &std::fs::File,
    name: &str,
    offset: u64,
    len: u64,
) -> std::result::Result<(), Refusal> {
    gpuio_hal::file::reserve_space(file, offset, len).map_err(|e| {
        let why = if e.kind() == std::io::ErrorKind::StorageFull {
            "the disk cannot hold it"
        } else {
            "its room could not be reserved"
        };
        Refusal::new(
            ErrorCode::from_io(&e),
            format!("{offset}+{len} of export {name:?}: {why} ({e}); nothing was written"),
        )
    })
}

/// A file export's turn for a SYNC or RESERVE (waited for within the request's time).
async fn turn(
    flush: &std::sync::Arc<tokio::sync::Semaphore>,
) -> std::result::Result<tokio::sync::OwnedSemaphorePermit, Refusal> {
    flush
        .clone()
        .acquire_owned()
        .await
        .map_err(|e| Refusal::new(ErrorCode::General, e.to_string()))
}

/// Runs `op` on a blocking thread.
async fn blocking(
    op: impl FnOnce() -> std::result::Result<(), Refusal> + Send + 'static,
) -> std::result::Result<(), Refusal> {
    tokio::task::spawn_blocking(op)
        .await
        .unwrap_or_else(|e| Err(Refusal::new(ErrorCode::General, e.to_string())))
}

/// Serves a read: memory exports are copied out a chunk at a time under their read lock and
/// sent with the lock released; GPU memory and files go through the session's buffer.
async fn read(
    sh: &Shared,
    wr: &mut impl Answers,
    id: u64,
    name: &str,
    offset: u64,
    len: u64,
    buffer: &mut Buffer,
) -> std::result::Result<(), Fatal> {
    let ex = match export(sh, name) {
        Ok(ex) => ex,
        Err(r) => return answer(sh, wr, id, Err(r)).await,
    };
    let checked = match &ex.source {
        Source::Memory(mem) => {
            let size = mem.read().await.len() as u64;
            // Checked now, and each piece again as it is sent (the program may swap in a
            // smaller buffer).
            let range = match in_bounds(name, offset, len, size) {
                Ok(r) => r,
                Err(r) => return answer(sh, wr, id, Err(r)).await,
            };
            wr.write_all(&wire::read_resp_head(id, range.len())).await?;
            send_memory(wr, mem, range, buffer).await?;
            Counters::add(&sh.counters.served, 1);
            Counters::add(&sh.counters.bytes_read, len);
            return Ok(());
        }
        Source::Device(buf) => in_bounds(name, offset, len, buf.len() as u64),
        Source::File { file, .. } => file
            .metadata()
            .map_err(io_refusal)
            .and_then(|m| in_bounds(name, offset, len, m.len())),
    };
    // One GPU stream for the whole read.
    let stream = match &ex.source {
        Source::Device(buf) => buf.gpu().stream().map(|s| Some(Arc::new(Mutex::new(s)))),
        _ => Ok(None),
    };
    let (range, stream) = match (checked, stream) {
        (Ok(range), Ok(stream)) => (range, stream),
        (Err(r), _) => return answer(sh, wr, id, Err(r)).await,
        (_, Err(e)) => return answer(sh, wr, id, Err(hal_refusal(e))).await,
    };
    // The first piece is read before the answer's head goes out, so that a failure there is
    // still a refusal; a failure after it can only end the connection.
    let mut at = range.start;
    let mut first = true;
    while first || at < range.end {
        let n = READ_CHUNK.min(range.end - at);
        let piece = fill_piece(&ex.source, stream.as_ref(), at as u64, n, buffer).await;
        if first {
            first = false;
            if let Err(r) = piece {
                return answer(sh, wr, id, Err(r)).await;
            }
            wr.write_all(&wire::read_resp_head(id, range.len())).await?;
        } else if piece.is_err() {
            return Err(Fatal::Gone);
        }
        wr.write_all(buffer.held()).await?;
        at += n;
    }
    Counters::add(&sh.counters.served, 1);
    Counters::add(&sh.counters.bytes_read, len);
    Ok(())
}

/// Reads `n` bytes of a GPU memory (through `stream`) or file export at `offset` into the
/// session's buffer, on a blocking thread.
async fn fill_piece(
    source: &Source,
    stream: Option<&Arc<Mutex<gpuio_hal::Stream>>>,
    offset: u64,
    n: usize,
    buffer: &mut Buffer,
) -> std::result::Result<(), Refusal> {
    match (source, stream) {
        (Source::Device(buf), Some(stream)) => {
            let (buf, stream) = (buf.clone(), stream.clone());
            through_buffer(buffer, n, move |data| {
                let stream = stream.lock_unpoisoned();
                stream
                    .download(&buf, offset as usize, data)
                    .map_err(hal_refusal)
            })
            .await
        }
        (Source::File { file, .. }, _) => {
            let file = file.clone();
            through_buffer(buffer, n, move |data| {
                file.read_exact_at(data, offset).map_err(io_refusal)
            })
            .await
        }
        // Memory is sent straight from the export, never through here.
        (Source::Memory(_), _) => Ok(()),
        (Source::Device(_), None) => Err(Refusal::new(
            ErrorCode::General,
            "a GPU memory read without its stream",
        )),
    }
}

/// Sends `range` of a memory export, never holding its lock while waiting for the socket.
async fn send_memory<W: Answers>(
    wr: &mut W,
    mem: &super::SharedMemory,
    range: std::ops::Range<usize>,
    buffer: &mut Buffer,
) -> std::io::Result<()> {
    let mut at = range.start;
    if W::WRITES_NOW {
        while at < range.end {
            // The guard lives for one non-blocking write: a copy into the socket's buffer.
            let wrote = match mem.read().await.get(at..range.end) {
                Some(bytes) => wr.write_now(bytes),
                None => return Err(shrank()),
            };
            match wrote {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wr.ready().await?,
                Err(e) => return Err(e),
            }
        }
        return Ok(());
    }
    let chunk = buffer
        .get(READ_CHUNK.min(range.len()))
        .await
        .map_err(std::io::Error::other)?;
    while at < range.end {
        let n = chunk.len().min(range.end - at);
        match mem.read().await.get(at..at + n) {
            Some(bytes) => chunk[..n].copy_from_slice(bytes),
            None => return Err(shrank()),
        }
        wr.write_all(&chunk[..n]).await?;
        at += n;
    }
    Ok(())
}

/// An export swapped for a smaller buffer by its program in the middle of an answer: the
/// answer cannot be finished, so its connection ends.
fn shrank() -> std::io::Error {
    std::io::Error::other("the export shrank under the read")
}

/// Runs `op` on a blocking thread over the session's buffer (`len` bytes); the buffer comes
/// back whatever happens, and if the request is abandoned meanwhile, its room is given back
/// only when the thread is done with it.
async fn through_buffer(
    buffer: &mut Buffer,
    len: usize,
    op: impl FnOnce(&mut [u8]) -> std::result::Result<(), Refusal> + Send + 'static,
) -> std::result::Result<(), Refusal> {
    let lent = buffer.lend(len).await.map_err(no_memory)?;
    on_blocking_thread(buffer, lent, op).await
}

/// Runs `op` on a blocking thread over what the session's buffer holds (a write's data).
async fn with_held(
    buffer: &mut Buffer,
    op: impl FnOnce(&mut [u8]) -> std::result::Result<(), Refusal> + Send + 'static,
) -> std::result::Result<(), Refusal> {
    let lent = buffer.lend_held();
    on_blocking_thread(buffer, lent, op).await
}

/// Runs `op` over `lent` on a blocking thread, giving the bytes back to `buffer` after.
async fn on_blocking_thread(
    buffer: &mut Buffer,
    mut lent: super::buffer::Lent,
    op: impl FnOnce(&mut [u8]) -> std::result::Result<(), Refusal> + Send + 'static,
) -> std::result::Result<(), Refusal> {
    let done = tokio::task::spawn_blocking(move || {
        let r = op(lent.bytes());
        (r, lent)
    })
    .await;
    match done {
        Ok((r, lent)) => {
            buffer.restore(lent);
            r
        }
        Err(e) => Err(Refusal::new(ErrorCode::General, e.to_string())),
    }
}

/// Serves a write whose fields were read: its data is received whole into the session's
/// buffer, then copied into a memory export under its write lock, or moved to GPU memory or
/// a file on a blocking thread. A refused write's data is read and dropped, so the connection
/// stays in step; a write whose data does not all arrive changes nothing.
async fn write<R: AsyncRead + Unpin>(
    sh: &Shared,
    role: Role,
    rd: &mut R,
    head: WriteHead,
    buffer: &mut Buffer,
) -> std::result::Result<Answer, Fatal> {
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
    let ex = match writable(sh, role, &name) {
        Ok(ex) => ex,
        Err(r) => return refuse(rd, r).await,
    };
    let held = match size(&ex.source).await {
        Ok(held) => held,
        Err(r) => return refuse(rd, r).await,
    };
    let range = match in_bounds(&name, offset, len, capacity(&ex.source, held)) {
        Ok(r) => r,
        Err(r) => return refuse(rd, r).await,
    };
    // What the write adds past the file's end is reserved first (the bytes it holds have
    // their blocks already, holes aside); an overwrite goes straight on.
    let end = offset + len;
    if let Source::File { file, .. } = &ex.source
        && end > held
    {
        let (file, name, from) = (file.clone(), name.clone(), offset.max(held));
        if let Err(r) = blocking(move || reserve_file(&file, &name, from, end - from)).await {
            return refuse(rd, r).await;
        }
    }
    let data = match buffer.get(len as usize).await {
        Ok(data) => data,
        Err(e) => return refuse(rd, no_memory(e)).await,
    };
    rd.read_exact(data).await?;
    let moved = match &ex.source {
        Source::Memory(mem) => {
            let data = buffer.held();
            // The exporting program may have swapped in a smaller buffer meanwhile.
            match mem.write().await.as_mut_slice().get_mut(range) {
                Some(to) => {
                    to.copy_from_slice(data);
                    Ok(())
                }
                None => Err(Refusal::new(
                    ErrorCode::InvalidArg,
                    format!("export {name:?} shrank under the write"),
                )),
            }
        }
        Source::Device(buf) => {
            let buf = buf.clone();
            with_held(buffer, move |data| {
                buf.gpu()
                    .stream()
                    .and_then(|s| s.upload(data, &buf, offset as usize))
                    .map_err(hal_refusal)
            })
            .await
        }
        Source::File { file, .. } => {
            let file = file.clone();
            with_held(buffer, move |data| {
                file.write_all_at(data, offset).map_err(io_refusal)
            })
            .await
        }
    };
    if let Err(r) = moved {
        return Ok(Err(r));
    }
    Counters::add(&sh.counters.bytes_written, len);
    Ok(Ok(Message::WriteResp { written: len }))
}
