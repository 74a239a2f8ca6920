//! Handles, buffers, and IO: sync, vectored, and on streams.

use super::{bytes, get, put, status};
use crate::abi::{self, CUfileDescr_t, CUfileError_t, CUfileHandle_t, CUfileIOVec_t, CUstream};
use crate::driver::DRIVER;
use crate::fault::{Fault, Result};
use crate::handle::Handle;
use crate::io::{self, Direction, Io};
use crate::memory;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::Arc;

/// # Safety
/// `fh` is NULL or writable for a handle; `descr` is NULL or points to a `CUfileDescr_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileHandleRegister(
    fh: *mut CUfileHandle_t,
    descr: *mut CUfileDescr_t,
) -> CUfileError_t {
    let result = status(|| {
        // SAFETY: the caller's contract.
        let d = unsafe { get(descr.cast_const(), "descr")? };
        if fh.is_null() {
            return Err(Fault::invalid("fh is NULL"));
        }
        if d.type_ != abi::CU_FILE_HANDLE_TYPE_OPAQUE_FD {
            return Err(Fault::new(
                abi::CU_FILE_IO_NOT_SUPPORTED,
                format!("handle type {}: only Linux file descriptors", d.type_),
            ));
        }
        // SAFETY: an OPAQUE_FD descriptor's union holds the fd.
        let fd = unsafe { d.handle.fd };
        let session = DRIVER.active()?;
        if DRIVER.registry().handles.values().any(|h| h.fd == fd) {
            return Err(Fault::new(
                abi::CU_FILE_HANDLE_ALREADY_REGISTERED,
                format!("fd {fd} is already registered"),
            ));
        }
        let handle = Arc::new(Handle::register(&session, fd)?);
        let key = DRIVER.key();
        DRIVER.registry_mut().handles.insert(key, handle);
        // SAFETY: the caller's contract; checked non-null above.
        unsafe { put(fh, key as CUfileHandle_t, "fh") }
    });
    DRIVER
        .stats
        .handle_register
        .count(result.err == abi::CU_FILE_SUCCESS);
    result
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileHandleDeregister(fh: CUfileHandle_t) {
    let gone = DRIVER.registry_mut().handles.remove(&(fh as usize));
    DRIVER.stats.handle_deregister.count(gone.is_some());
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileBufRegister(
    buf: *const c_void,
    length: usize,
    _flags: c_int,
) -> CUfileError_t {
    let result = status(|| {
        let session = DRIVER.active()?;
        let base = buf as u64;
        if DRIVER.registry().buffers.contains_key(&base) {
            return Err(Fault::new(
                abi::CU_FILE_MEMORY_ALREADY_REGISTERED,
                format!("{base:#x} is already registered"),
            ));
        }
        let reg = memory::register(&session, base, length)?;
        DRIVER.registry_mut().buffers.insert(base, Arc::new(reg));
        Ok(())
    });
    DRIVER
        .stats
        .buf_register
        .count(result.err == abi::CU_FILE_SUCCESS);
    result
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileBufDeregister(buf: *const c_void) -> CUfileError_t {
    let result = status(
        || match DRIVER.registry_mut().buffers.remove(&(buf as u64)) {
            Some(_) => Ok(()),
            None => Err(Fault::new(
                abi::CU_FILE_MEMORY_NOT_REGISTERED,
                format!("{buf:p} is not registered"),
            )),
        },
    );
    DRIVER
        .stats
        .buf_deregister
        .count(result.err == abi::CU_FILE_SUCCESS);
    result
}

fn sync_io(
    direction: Direction,
    fh: CUfileHandle_t,
    buf: *const c_void,
    size: usize,
    file_offset: i64,
    buf_offset: i64,
) -> isize {
    bytes(|| {
        let session = DRIVER.active()?;
        let io = Io {
            direction,
            handle: fh as usize,
            base: buf as u64,
            buf_offset,
            size,
            file_offset,
        };
        io::run(&session, io)
    })
}

/// Reads `size` bytes at `file_offset` into `buf + buf_offset`: the bytes read (fewer at the
/// end of the file), or a negated cuFile error code.
///
/// # Safety
/// Host memory at `buf + buf_offset` is writable for `size` bytes (GPU memory is checked
/// with the driver).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileRead(
    fh: CUfileHandle_t,
    buf: *mut c_void,
    size: usize,
    file_offset: libc::off_t,
    buf_offset: libc::off_t,
) -> isize {
    sync_io(Direction::Read, fh, buf, size, file_offset, buf_offset)
}

/// Writes `size` bytes from `buf + buf_offset` at `file_offset`.
///
/// # Safety
/// Host memory at `buf + buf_offset` is readable for `size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileWrite(
    fh: CUfileHandle_t,
    buf: *const c_void,
    size: usize,
    file_offset: libc::off_t,
    buf_offset: libc::off_t,
) -> isize {
    sync_io(Direction::Write, fh, buf, size, file_offset, buf_offset)
}

/// # Safety
/// `iov` is NULL or points to `iovcnt` vectors, each over memory as `cuFileRead` needs.
unsafe fn vectored(
    direction: Direction,
    fh: CUfileHandle_t,
    iov: *const CUfileIOVec_t,
    iovcnt: usize,
    file_offset: i64,
    flags: c_uint,
) -> isize {
    bytes(|| {
        if iov.is_null() || iovcnt == 0 || iovcnt > libc::UIO_MAXIOV as usize {
            return Err(Fault::invalid(format!(
                "iov: 1 to {} vectors, not {iovcnt}{}",
                libc::UIO_MAXIOV,
                if iov.is_null() { " (NULL)" } else { "" }
            )));
        }
        if flags != 0 {
            return Err(Fault::invalid(format!(
                "flags {flags:#x}: none are defined"
            )));
        }
        // SAFETY: non-null, iovcnt vectors (the caller's contract), bounded above.
        let v = unsafe { std::slice::from_raw_parts(iov, iovcnt) };
        let session = DRIVER.active()?;
        io::run_vectored(&session, direction, fh as usize, v, file_offset)
    })
}

/// # Safety
/// As `vectored`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileReadv(
    fh: CUfileHandle_t,
    iov: *const CUfileIOVec_t,
    iovcnt: usize,
    file_offset: libc::off_t,
    flags: c_uint,
) -> isize {
    // SAFETY: the caller's contract.
    unsafe { vectored(Direction::Read, fh, iov, iovcnt, file_offset, flags) }
}

/// # Safety
/// As `vectored`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileWritev(
    fh: CUfileHandle_t,
    iov: *const CUfileIOVec_t,
    iovcnt: usize,
    file_offset: libc::off_t,
    flags: c_uint,
) -> isize {
    // SAFETY: the caller's contract.
    unsafe { vectored(Direction::Write, fh, iov, iovcnt, file_offset, flags) }
}

/// The stream calls: the work queued on `stream` is waited for, then the IO runs and its
/// result goes to `*done_p`; when the call returns, the IO is complete, so work queued on the
/// stream afterwards sees it (cuFile's ordering, met by finishing early).
///
/// # Safety
/// The pointers are NULL or valid for their types; `stream` is NULL or a live stream of the
/// primary context of the buffer's GPU.
#[allow(clippy::too_many_arguments)] // cuFile's own signature, plus the direction
unsafe fn on_stream(
    direction: Direction,
    fh: CUfileHandle_t,
    buf: *const c_void,
    size_p: *const usize,
    file_offset_p: *const libc::off_t,
    buf_offset_p: *const libc::off_t,
    done_p: *mut isize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let (size, file_offset, buf_offset) = unsafe {
        (
            get(size_p, "size_p")?,
            get(file_offset_p, "file_offset_p")?,
            get(buf_offset_p, "bufPtr_offset_p")?,
        )
    };
    if done_p.is_null() {
        return Err(Fault::invalid("bytes_read_p/bytes_written_p is NULL"));
    }
    let session = DRIVER.active()?;
    let mem = memory::resolve(&session, buf as u64, buf_offset, size)?;
    let gpu = match mem.gpu() {
        Some(g) => session.gpu(g).ok(),
        None => session.gpus().first(),
    };
    if let Some(gpu) = gpu {
        // SAFETY: the caller's contract on `stream`.
        unsafe { gpu.synchronize_foreign(stream as u64) }.map_err(|e| {
            Fault::new(
                abi::CU_FILE_CUDA_DRIVER_ERROR,
                format!("waiting for the stream: {e}"),
            )
        })?;
    }
    let io = Io {
        direction,
        handle: fh as usize,
        base: buf as u64,
        buf_offset,
        size,
        file_offset,
    };
    let done = match io::run(&session, io) {
        Ok(n) => n as isize,
        Err(e) => e.negated(),
    };
    // SAFETY: checked non-null above; the caller's contract.
    unsafe { put(done_p, done, "bytes_read_p") }
}

/// # Safety
/// As `on_stream`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileReadAsync(
    fh: CUfileHandle_t,
    buf: *mut c_void,
    size_p: *mut usize,
    file_offset_p: *mut libc::off_t,
    buf_offset_p: *mut libc::off_t,
    bytes_read_p: *mut isize,
    stream: CUstream,
) -> CUfileError_t {
    // SAFETY: the caller's contract.
    status(|| unsafe {
        on_stream(
            Direction::Read,
            fh,
            buf,
            size_p,
            file_offset_p,
            buf_offset_p,
            bytes_read_p,
            stream,
        )
    })
}

/// # Safety
/// As `on_stream`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFileWriteAsync(
    fh: CUfileHandle_t,
    buf: *mut c_void,
    size_p: *mut usize,
    file_offset_p: *mut libc::off_t,
    buf_offset_p: *mut libc::off_t,
    bytes_written_p: *mut isize,
    stream: CUstream,
) -> CUfileError_t {
    // SAFETY: the caller's contract.
    status(|| unsafe {
        on_stream(
            Direction::Write,
            fh,
            buf,
            size_p,
            file_offset_p,
            buf_offset_p,
            bytes_written_p,
            stream,
        )
    })
}

/// The flags a stream may be registered with (`CU_FILE_STREAM_*`).
const STREAM_FLAGS: c_uint = 0xf;

#[unsafe(no_mangle)]
pub extern "C" fn cuFileStreamRegister(stream: CUstream, flags: c_uint) -> CUfileError_t {
    status(|| {
        if flags & !STREAM_FLAGS != 0 {
            return Err(Fault::invalid(format!("stream flags {flags:#x}")));
        }
        DRIVER.active()?;
        DRIVER.registry_mut().streams.insert(stream as usize, flags);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFileStreamDeregister(stream: CUstream) -> CUfileError_t {
    status(
        || match DRIVER.registry_mut().streams.remove(&(stream as usize)) {
            Some(_) => Ok(()),
            None => Err(Fault::invalid(format!(
                "stream {stream:p} is not registered"
            ))),
        },
    )
}
