//! One read or write between a registered file and a buffer, through gpuio's LocalIO: GPU
//! memory by its lanes (or straight from a kept file's pinned page cache), host memory by
//! pread/pwrite in place; a read of a cold range of an `O_DIRECT` file bypasses the page
//! cache ([`Handle::for_read`]). Every cuFile IO call (sync, vectored, batch, stream) ends here.

use crate::abi;
use crate::driver::DRIVER;
use crate::fault::{Fault, Result};
use crate::handle::Handle;
use crate::memory::{self, Memory};
use gpuio_api::{Dest, Session, Source};
use std::sync::Arc;
use std::time::Instant;

/// Which way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// File to memory.
    Read,
    /// Memory to file.
    Write,
}

/// One IO, as cuFile's calls give it.
#[derive(Clone, Copy, Debug)]
pub struct Io {
    pub direction: Direction,
    pub handle: usize,
    pub base: u64,
    pub buf_offset: i64,
    pub size: usize,
    pub file_offset: i64,
}

/// The registered handle under `key`.
pub fn handle(key: usize) -> Result<Arc<Handle>> {
    DRIVER.registry().handles.get(&key).cloned().ok_or_else(|| {
        Fault::new(
            abi::CU_FILE_HANDLE_NOT_REGISTERED,
            format!("handle {key:#x} is not registered"),
        )
    })
}

/// Runs `io`: the bytes moved (a read stops at the end of the file).
pub fn run(session: &Session, io: Io) -> Result<usize> {
    let started = Instant::now();
    let mut gpu = None;
    let result = move_bytes(session, io, &mut gpu);
    let flow = match io.direction {
        Direction::Read => &DRIVER.stats.read,
        Direction::Write => &DRIVER.stats.write,
    };
    flow.record(
        result.as_ref().map(|n| *n).map_err(|_| ()),
        started.elapsed(),
        gpu,
    );
    result
}

fn move_bytes(session: &Session, io: Io, gpu: &mut Option<u32>) -> Result<usize> {
    let h = handle(io.handle)?;
    let at = u64::try_from(io.file_offset)
        .map_err(|_| Fault::invalid(format!("negative file offset {}", io.file_offset)))?;
    if io.size > isize::MAX as usize {
        return Err(Fault::invalid(format!("{} bytes is too many", io.size)));
    }
    let (allowed, what) = match io.direction {
        Direction::Read => (h.readable, "reading"),
        Direction::Write => (h.writable, "writing"),
    };
    if !allowed {
        return Err(Fault::new(
            abi::CU_FILE_PERMISSION_DENIED,
            format!("fd {} is not open for {what}", h.fd),
        ));
    }
    let mem = memory::resolve(session, io.base, io.buf_offset, io.size)?;
    *gpu = mem.gpu();
    if io.direction == Direction::Write {
        transfer(session, &h, &mem, io.direction, at, io.size)?;
        h.wrote_to(at + io.size as u64);
        return Ok(io.size);
    }
    let len = h.readable_len(at, io.size, false)?;
    match transfer(session, &h, &mem, io.direction, at, len) {
        Ok(()) => Ok(len),
        // The file may have shrunk since its length was last seen: a read that now runs past
        // its end is a short read, not an error.
        Err(e) => match h.readable_len(at, io.size, true)? {
            shorter if shorter < len => {
                transfer(session, &h, &mem, io.direction, at, shorter)?;
                Ok(shorter)
            }
            _ => Err(e),
        },
    }
}

/// Moves `len` bytes between the file at `at` and `mem`.
fn transfer(
    session: &Session,
    h: &Handle,
    mem: &Memory,
    direction: Direction,
    at: u64,
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let outcome = match (mem, direction) {
        (Memory::Device { buf, offset }, Direction::Read) => {
            let file = h.for_read(at, len);
            session.transfer(Source::File(file, at), Dest::Device(buf, *offset), len)
        }
        (Memory::Device { buf, offset }, Direction::Write) => {
            session.transfer(Source::Device(buf, *offset), Dest::File(&h.file, at), len)
        }
        (Memory::Host(p), Direction::Read) => {
            // SAFETY: cuFile's contract: a host buffer is mapped and writable for the IO's
            // size at base + offset (resolve checked the address arithmetic; len is at most
            // that size), and the program does not touch it until the call returns.
            let dst = unsafe { std::slice::from_raw_parts_mut(*p, len) };
            session.transfer(Source::File(h.for_read(at, len), at), Dest::Host(dst), len)
        }
        (Memory::Host(p), Direction::Write) => {
            // SAFETY: as above, readable for the IO's size and unchanged during the call.
            let src = unsafe { std::slice::from_raw_parts(*p, len) };
            session.transfer(Source::Host(src), Dest::File(&h.file, at), len)
        }
    };
    outcome.map(|_| ()).map_err(Fault::from)
}

/// `cuFileReadv`/`cuFileWritev`: the vectors in turn from `file_offset`; the bytes moved (a
/// read stops at the end of the file).
pub fn run_vectored(
    session: &Session,
    direction: Direction,
    handle: usize,
    iov: &[abi::CUfileIOVec_t],
    file_offset: i64,
) -> Result<usize> {
    let started = Instant::now();
    let mut total = 0usize;
    let mut at = file_offset;
    let mut result = Ok(());
    for v in iov {
        let io = Io {
            direction,
            handle,
            base: v.base as u64,
            buf_offset: 0,
            size: v.len,
            file_offset: at,
        };
        match move_bytes(session, io, &mut None) {
            Ok(n) => {
                total += n;
                at = at.saturating_add(n as i64);
                if n < v.len {
                    break;
                }
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let flow = match direction {
        Direction::Read => &DRIVER.stats.readv,
        Direction::Write => &DRIVER.stats.writev,
    };
    flow.record(
        result.as_ref().map(|_| total).map_err(|_| ()),
        started.elapsed(),
        None,
    );
    result.map(|()| total)
}
