//! # gpuio-transport-localio
//!
//! LocalIO (SAD §2.3.2, SDD §4.2): files and block devices to and from host and GPU memory.
//!
//! This is the portable POSIX engine: positioned reads and writes (`pread`/`pwrite`) that
//! handle short transfers, `EINTR`, end of file and full disks exactly, and a double-buffered
//! path between files and GPU memory through pinned staging buffers (the read of one chunk
//! overlaps the DMA of the previous one). It is the fallback that always works; faster
//! engines (io_uring, GPUDirect Storage) come on top of it.

#![forbid(unsafe_code)]

use gpuio_hal::{DeviceBuffer, ErrorCode, HalError, HostAllocOptions, HostBuffer, Inflight};
use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// LocalIO's errors.
#[derive(Debug, thiserror::Error)]
pub enum LocalIoError {
    /// Opening a file failed.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A read or write failed.
    #[error("{op} {path} at offset {offset}: {source}")]
    Io {
        /// `read`, `write`, `sync` or `stat`.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// Where.
        offset: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file ended before the requested range did.
    #[error("{path}: wanted {wanted} bytes at offset {offset} but the file ends after {got}")]
    UnexpectedEof {
        /// The file.
        path: PathBuf,
        /// Start of the read.
        offset: u64,
        /// Bytes asked for.
        wanted: usize,
        /// Bytes there were.
        got: usize,
    },
    /// The filesystem (or the user's quota) is full; `written` bytes of the request reached
    /// the file before it filled up, and the rest did not.
    #[error(
        "{path}: no space left on device after writing {written} of {wanted} bytes at offset {offset}"
    )]
    NoSpace {
        /// The file.
        path: PathBuf,
        /// Start of the write.
        offset: u64,
        /// Bytes asked for.
        wanted: usize,
        /// Bytes written before the disk filled (never reported as success).
        written: usize,
    },
    /// A write to a file opened read-only.
    #[error("{0} was opened read-only")]
    ReadOnly(PathBuf),
    /// A copy to or from GPU memory failed.
    #[error(transparent)]
    Hal(#[from] HalError),
}

impl LocalIoError {
    /// The SDD §7.1 code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Open { source, .. } | Self::Io { source, .. } => ErrorCode::from_io(source),
            Self::UnexpectedEof { .. } => ErrorCode::InvalidArg,
            Self::NoSpace { .. } => ErrorCode::Io,
            Self::ReadOnly(_) => ErrorCode::Permission,
            Self::Hal(e) => e.code(),
        }
    }
}

/// LocalIO's result type.
pub type Result<T, E = LocalIoError> = std::result::Result<T, E>;

/// How to open a file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// Open for writing too.
    pub write: bool,
    /// Create the file if it does not exist (implies `write`).
    pub create: bool,
    /// Truncate it to zero length (implies `write`).
    pub truncate: bool,
}

impl OpenOptions {
    /// Read-only.
    pub const READ: Self = Self {
        write: false,
        create: false,
        truncate: false,
    };
    /// Create or truncate, then write.
    pub const CREATE: Self = Self {
        write: true,
        create: true,
        truncate: true,
    };
}

/// An open file or block device. Cheap to clone; positioned IO needs no shared cursor, so
/// clones may read and write concurrently.
#[derive(Debug, Clone)]
pub struct FileHandle {
    inner: Arc<FileInner>,
}

#[derive(Debug)]
struct FileInner {
    file: File,
    path: PathBuf,
    writable: bool,
}

impl FileHandle {
    /// Opens `path`.
    pub fn open(path: impl AsRef<Path>, opts: OpenOptions) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let writable = opts.write || opts.create || opts.truncate;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(writable)
            .create(opts.create)
            .truncate(opts.truncate)
            .open(&path)
            .map_err(|source| LocalIoError::Open {
                path: path.clone(),
                source,
            })?;
        Ok(Self {
            inner: Arc::new(FileInner {
                file,
                path,
                writable,
            }),
        })
    }

    /// Wraps a file the caller opened (`writable`: opened for writing).
    pub fn from_file(file: File, path: impl Into<PathBuf>, writable: bool) -> Self {
        Self {
            inner: Arc::new(FileInner {
                file,
                path: path.into(),
                writable,
            }),
        }
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Whether both handles refer to the same file on disk (same device and inode), however
    /// each was opened.
    pub fn same_inode(&self, other: &FileHandle) -> Result<bool> {
        use std::os::unix::fs::MetadataExt;
        let a = self
            .inner
            .file
            .metadata()
            .map_err(|e| self.io("stat", 0, e))?;
        let b = other
            .inner
            .file
            .metadata()
            .map_err(|e| other.io("stat", 0, e))?;
        Ok(a.dev() == b.dev() && a.ino() == b.ino())
    }

    /// An identity of the open file, unique in the process while any clone lives.
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Current length in bytes (for block devices: the device size).
    pub fn len(&self) -> Result<u64> {
        let meta = self
            .inner
            .file
            .metadata()
            .map_err(|e| self.io("stat", 0, e))?;
        if meta.is_file() {
            return Ok(meta.len());
        }
        // Block devices report 0 in st_size; their size is where a seek to the end lands.
        use std::io::Seek;
        (&self.inner.file)
            .seek(std::io::SeekFrom::End(0))
            .map_err(|e| self.io("stat", 0, e))
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    fn io(&self, op: &'static str, offset: u64, source: std::io::Error) -> LocalIoError {
        LocalIoError::Io {
            op,
            path: self.inner.path.clone(),
            offset,
            source,
        }
    }

    /// Reads into `buf` from `offset` until it is full or the file ends; returns the bytes
    /// read (less than `buf.len()` only at end of file).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            let at = offset + done as u64;
            match self.inner.file.read_at(&mut buf[done..], at) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io("read", at, e)),
            }
        }
        Ok(done)
    }

    /// Reads exactly `buf.len()` bytes from `offset`, or says how short the file was.
    pub fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let got = self.read_at(offset, buf)?;
        if got < buf.len() {
            return Err(LocalIoError::UnexpectedEof {
                path: self.inner.path.clone(),
                offset,
                wanted: buf.len(),
                got,
            });
        }
        Ok(())
    }

    /// Writes all of `buf` at `offset`. A full disk is [`LocalIoError::NoSpace`], naming how
    /// much did reach the file.
    pub fn write_all_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        if !self.inner.writable {
            return Err(LocalIoError::ReadOnly(self.inner.path.clone()));
        }
        let mut done = 0;
        while done < buf.len() {
            let at = offset + done as u64;
            match self.inner.file.write_at(&buf[done..], at) {
                Ok(0) => {
                    return Err(self.no_space(offset, buf.len(), done));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
                    return Err(self.no_space(offset, buf.len(), done));
                }
                Err(e) => return Err(self.io("write", at, e)),
            }
        }
        Ok(())
    }

    fn no_space(&self, offset: u64, wanted: usize, written: usize) -> LocalIoError {
        LocalIoError::NoSpace {
            path: self.inner.path.clone(),
            offset,
            wanted,
            written,
        }
    }

    /// Flushes written data to stable storage (`fdatasync`).
    pub fn sync_data(&self) -> Result<()> {
        self.inner
            .file
            .sync_data()
            .map_err(|e| self.io("sync", 0, e))
    }

    /// Sets the file's length (extending with a hole, or truncating).
    pub fn set_len(&self, len: u64) -> Result<()> {
        if !self.inner.writable {
            return Err(LocalIoError::ReadOnly(self.inner.path.clone()));
        }
        self.inner
            .file
            .set_len(len)
            .map_err(|e| self.io("truncate", len, e))
    }
}

/// Tuning of the LocalIO engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalIoConfig {
    /// Bytes per pinned staging chunk between files and GPU memory.
    pub chunk_size: usize,
}

impl Default for LocalIoConfig {
    fn default() -> Self {
        Self {
            chunk_size: 8 << 20,
        }
    }
}

/// The LocalIO engine. Thread-safe; share it behind an `Arc`.
#[derive(Debug)]
pub struct LocalIo {
    config: LocalIoConfig,
    /// Pinned staging buffers, reused across transfers (pinning costs milliseconds).
    staging: Mutex<Vec<HostBuffer>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A Vec of idle buffers cannot be left inconsistent by a panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl LocalIo {
    /// A new engine.
    pub fn new(config: LocalIoConfig) -> Self {
        Self {
            config: LocalIoConfig {
                chunk_size: config.chunk_size.max(4096),
            },
            staging: Mutex::new(Vec::new()),
        }
    }

    /// The engine's configuration.
    pub fn config(&self) -> &LocalIoConfig {
        &self.config
    }

    /// Opens a file.
    pub fn open(&self, path: impl AsRef<Path>, opts: OpenOptions) -> Result<FileHandle> {
        FileHandle::open(path, opts)
    }

    fn take_staging(&self, n: usize, pin_for: &gpuio_hal::Gpu) -> Result<Vec<HostBuffer>> {
        let mut taken = {
            let mut pool = lock(&self.staging);
            let keep = pool.len().saturating_sub(n);
            pool.split_off(keep)
        };
        while taken.len() < n {
            taken.push(HostBuffer::alloc_pinned(
                self.config.chunk_size,
                &HostAllocOptions {
                    numa: pin_for.info().numa_node,
                    ..HostAllocOptions::default()
                },
                pin_for,
            )?);
        }
        Ok(taken)
    }

    fn give_back(&self, bufs: impl IntoIterator<Item = HostBuffer>) {
        lock(&self.staging).extend(bufs);
    }

    /// Reads `len` bytes of `file` at `offset` into `dst` at `dst_offset`. Reading chunk k+1
    /// overlaps the DMA of chunk k.
    pub fn read_to_device(
        &self,
        file: &FileHandle,
        offset: u64,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        gpuio_hal::check_range("file read destination", dst_offset, len, dst.len())?;
        let stream = dst.gpu().stream()?;
        let chunk = self.config.chunk_size;
        // Two buffers and at most one DMA in flight: every iteration finds one free.
        let mut free = self.take_staging(2, dst.gpu())?;
        let mut in_flight: Option<Inflight<HostBuffer>> = None;
        let mut done = 0;
        // (On an error the staging buffers are simply dropped; the pool grows back later.)
        while done < len {
            let n = chunk.min(len - done);
            let mut buf = free.pop().ok_or_else(lost_staging)?;
            file.read_exact_at(offset + done as u64, &mut buf[..n])?;
            if let Some(prev) = in_flight.take() {
                free.push(prev.wait()?);
            }
            in_flight = Some(stream.upload_async(buf, 0..n, dst, dst_offset + done)?);
            done += n;
        }
        if let Some(last) = in_flight {
            free.push(last.wait()?);
        }
        self.give_back(free);
        Ok(())
    }

    /// Writes `len` bytes of `src` from `src_offset` to `file` at `offset`. Writing chunk k
    /// overlaps the DMA of chunk k+1.
    pub fn write_from_device(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        file: &FileHandle,
        offset: u64,
        len: usize,
    ) -> Result<()> {
        gpuio_hal::check_range("file write source", src_offset, len, src.len())?;
        let stream = src.gpu().stream()?;
        let chunk = self.config.chunk_size;
        let mut free = self.take_staging(2, src.gpu())?;
        let mut queue: VecDeque<(usize, usize, Inflight<HostBuffer>)> = VecDeque::new();
        let mut next = 0;
        loop {
            // Keep every free buffer busy with a DMA before writing the oldest one out.
            while next < len
                && let Some(buf) = free.pop()
            {
                let n = chunk.min(len - next);
                queue.push_back((
                    next,
                    n,
                    stream.download_async(src, src_offset + next, buf, 0..n)?,
                ));
                next += n;
            }
            let Some((at, n, inflight)) = queue.pop_front() else {
                break;
            };
            let buf = inflight.wait()?;
            let wrote = file.write_all_at(offset + at as u64, &buf[..n]);
            free.push(buf);
            wrote?;
        }
        self.give_back(free);
        Ok(())
    }
}

fn lost_staging() -> LocalIoError {
    LocalIoError::Hal(HalError::InvalidArgument(
        "LocalIO staging buffer lost (internal error)".into(),
    ))
}
