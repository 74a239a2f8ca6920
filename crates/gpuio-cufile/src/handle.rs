//! File handles (`cuFileHandleRegister`): a POSIX descriptor the program opened, as a gpuio
//! [`FileHandle`] over a descriptor of its own, so the program may close its own at any time.
//!
//! cuFile asks for `O_DIRECT` descriptors because nvidia-fs DMAs from the device and must not
//! race the page cache. Without nvidia-fs that reason is gone, and bypassing the cache would
//! read a warm file from the disk; going through it reads a cold file slower than the disk
//! gives (buffered reads keep fewer requests in flight than O_DIRECT lanes). So a registered
//! `O_DIRECT` descriptor gets two views of the file, and each read takes one
//! ([`Handle::for_read`]): the page cache where it holds at least a quarter of the range, the
//! bypass where it holds less. Writes go through the page cache. Both views stay coherent:
//! the kernel writes dirty cached pages back before an `O_DIRECT` read of them. The
//! `FORCE_ODIRECT_MODE` parameter makes every transfer take the bypass.

use crate::abi;
use crate::driver::DRIVER;
use crate::fault::{Fault, Result};
use crate::params::FORCE_ODIRECT_MODE;
use gpuio_api::{FileHandle, OpenOptions, Session};
use std::ffi::c_int;
use std::fs::File;
use std::os::fd::{FromRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// A registered file.
pub struct Handle {
    /// The program's descriptor (what `cuFileHandleRegister` was given).
    pub fd: RawFd,
    /// gpuio's view of the file.
    pub file: FileHandle,
    /// For an `O_DIRECT` descriptor read through the page cache, the bypass, for reads of
    /// ranges the page cache does not hold.
    direct: Option<FileHandle>,
    pub readable: bool,
    pub writable: bool,
    /// The file's length when last looked at: a read within it needs no fstat (a system call
    /// that costs more than a small read's copy under some kernels).
    known_len: AtomicU64,
}

/// The access mode and `O_DIRECT` of `fd`, or why it is no descriptor cuFile takes.
fn describe(fd: RawFd) -> Result<(c_int, bool)> {
    // SAFETY: F_GETFL only reads the descriptor table; a closed or bogus fd is EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(Fault::invalid(format!("fd {fd} is not an open descriptor")));
    }
    // SAFETY: fstat writes only the stat struct it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: st is a valid stat buffer; fd was just found open.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(Fault::invalid(format!("fd {fd}: fstat failed")));
    }
    let kind = st.st_mode & libc::S_IFMT;
    if kind != libc::S_IFREG && kind != libc::S_IFBLK {
        return Err(Fault::new(
            abi::CU_FILE_INVALID_FILE_TYPE,
            format!("fd {fd} is neither a regular file nor a block device"),
        ));
    }
    Ok((flags & libc::O_ACCMODE, flags & libc::O_DIRECT != 0))
}

impl Handle {
    /// Registers `fd`.
    pub fn register(session: &Session, fd: RawFd) -> Result<Self> {
        let (mode, direct) = describe(fd)?;
        let (readable, writable) = (mode != libc::O_WRONLY, mode != libc::O_RDONLY);
        let path = format!("/proc/self/fd/{fd}");
        let reopen = |direct: bool| {
            // Reopened, to have a descriptor whose O_DIRECT is its own (the flag belongs to
            // the open file, which a dup would share).
            let opts = OpenOptions {
                write: writable,
                direct,
                ..OpenOptions::READ
            };
            session.open_file(&path, opts).map_err(|e| {
                Fault::new(
                    abi::CU_FILE_IO_NOT_SUPPORTED,
                    format!("reopening O_DIRECT fd {fd} through {path}: {e}"),
                )
            })
        };
        let forced = DRIVER.params().flag(FORCE_ODIRECT_MODE);
        let mut bypass = None;
        let file = if direct {
            if !forced && readable {
                bypass = Some(reopen(true)?);
            }
            reopen(forced)?
        } else {
            // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor; fd was just found open.
            let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
            if dup < 0 {
                return Err(Fault::new(
                    abi::CU_FILE_INTERNAL_ERROR,
                    format!("dup of fd {fd}: {}", std::io::Error::last_os_error()),
                ));
            }
            // SAFETY: dup is a descriptor this library just made and now owns alone.
            let owned = unsafe { File::from_raw_fd(dup) };
            let name = std::fs::read_link(&path).unwrap_or_else(|_| path.clone().into());
            FileHandle::from_file(owned, name, writable)
        };
        Ok(Self {
            fd,
            file,
            direct: bypass,
            readable,
            writable,
            known_len: AtomicU64::new(0),
        })
    }

    /// The bytes a read of `size` at `at` gets: up to the end of the file, looked up again only
    /// where the length last seen would cut the read short (`fresh`: look it up anyway).
    pub fn readable_len(&self, at: u64, size: usize, fresh: bool) -> Result<usize> {
        let mut len = self.known_len.load(Ordering::Relaxed);
        if fresh || at.saturating_add(size as u64) > len {
            len = self
                .file
                .len()
                .map_err(|e| Fault::from(gpuio_api::Error::from(e)))?;
            self.known_len.store(len, Ordering::Relaxed);
        }
        Ok(len.saturating_sub(at).min(size as u64) as usize)
    }

    /// The view a read of `len` bytes at `at` takes: the bypass where the program asked for
    /// it and the page cache holds less than a quarter of the range, the page cache otherwise
    /// (and where the kernel cannot say how much it holds).
    pub fn for_read(&self, at: u64, len: usize) -> &FileHandle {
        match &self.direct {
            Some(direct)
                if self
                    .file
                    .cached_bytes(at, len as u64)
                    .is_some_and(|cached| cached.saturating_mul(4) < len as u64) =>
            {
                direct
            }
            _ => &self.file,
        }
    }

    /// Notes a write that ended at `end`.
    pub fn wrote_to(&self, end: u64) {
        self.known_len.fetch_max(end, Ordering::Relaxed);
    }
}
