//! Open files and block devices: positioned IO that handles short transfers, `EINTR`, end of
//! file and full disks exactly, buffered or O_DIRECT (aligned through a bounce buffer where the
//! caller's range or memory is not), and the file facts device IO needs (alignment, extents).

use crate::nvme::NvmeDevice;
use crate::{LocalIoError, Result};
use gpuio_hal::file::{DirectIoAlignment, Extent};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{GdsFile, Gpu, HostAllocOptions, HostBuffer};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// How to open a file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// Open for writing too.
    pub write: bool,
    /// Create the file if it does not exist (implies `write`).
    pub create: bool,
    /// Truncate it to zero length (implies `write`).
    pub truncate: bool,
    /// O_DIRECT: bypass the page cache (transfers are aligned for you).
    pub direct: bool,
    /// O_DSYNC: every write is durable when it returns.
    pub dsync: bool,
    /// GPUDirect Storage: `Some(true)` moves this file's GPU transfers through cuFile (an
    /// error where cuFile cannot run), `Some(false)` never does, `None` leaves it to the
    /// engine's policy.
    pub gds: Option<bool>,
}

impl OpenOptions {
    /// Read-only, buffered.
    pub const READ: Self = Self {
        write: false,
        create: false,
        truncate: false,
        direct: false,
        dsync: false,
        gds: None,
    };
    /// Create or truncate, then write; buffered.
    pub const CREATE: Self = Self {
        write: true,
        create: true,
        truncate: true,
        direct: false,
        dsync: false,
        gds: None,
    };

    /// These options with O_DIRECT.
    pub fn direct(self) -> Self {
        Self {
            direct: true,
            ..self
        }
    }
}

/// An open file or block device: one the kernel serves, or an NVMe namespace gpuio's own
/// driver serves ([`NvmeDevice`]). Cheap to clone; positioned IO needs no shared cursor, so
/// clones may read and write concurrently.
#[derive(Debug, Clone)]
pub struct FileHandle {
    inner: Arc<FileInner>,
    /// What errors call it, where that is not its path ([`FileHandle::with_name`]).
    name: Option<Arc<Path>>,
}

#[derive(Debug)]
struct FileInner {
    path: PathBuf,
    writable: bool,
    backing: Backing,
}

/// What serves a handle's IO.
#[derive(Debug)]
enum Backing {
    /// The kernel, through a file descriptor.
    Os(OsFile),
    /// gpuio's NVMe driver.
    Nvme(NvmeDevice),
}

#[derive(Debug)]
struct OsFile {
    file: Arc<File>,
    direct: bool,
    alignment: DirectIoAlignment,
    gds: Option<bool>,
    /// cuFile registrations, one per GPU that used this file, released with the handle.
    gds_files: Mutex<Vec<(Gpu, Arc<GdsFile>)>>,
}

/// Bytes per bounce transfer for unaligned O_DIRECT IO.
const BOUNCE: usize = 1 << 20;

impl OsFile {
    /// How many bytes of `buf` from file offset `at` a direct file can read or write in place:
    /// whole blocks from an aligned offset into aligned memory, else 0 (a bounce buffer then).
    fn in_place(&self, at: u64, buf: &[u8]) -> usize {
        let block = self.alignment.offset.max(self.alignment.memory).max(1);
        let memory = self.alignment.memory.max(1);
        if at.is_multiple_of(block as u64) && (buf.as_ptr() as usize).is_multiple_of(memory) {
            buf.len() / block * block
        } else {
            0
        }
    }
}

/// The bounce buffer of a direct transfer with `rest` bytes to go, made on first use: up to
/// [`BOUNCE`], whole blocks of `a`.
fn bounce_for(slot: &mut Option<HostBuffer>, rest: usize, a: usize) -> Result<&mut HostBuffer> {
    let buf = match slot.take() {
        Some(b) => b,
        None => {
            let len = BOUNCE.min(rest + 2 * a).next_multiple_of(a);
            HostBuffer::alloc(len, &HostAllocOptions::default())?
        }
    };
    Ok(slot.insert(buf))
}

impl FileHandle {
    /// Opens `path`.
    ///
    /// Opened only for reading, it must be something that can be sized: a regular file or a
    /// block device. FIFOs, sockets, character devices and directories are refused with
    /// [`LocalIoError::Unsized`] (without blocking on a FIFO), and so is a regular file whose
    /// size reads as 0 while it has content (procfs, sysfs, debugfs). Opened for writing, any
    /// file is taken (`/dev/null` is a fine destination).
    pub fn open(path: impl AsRef<Path>, opts: OpenOptions) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let writable = opts.write || opts.create || opts.truncate;
        if !writable {
            // Refused before it is opened: opening a device can do things of its own (a tape
            // rewinds), and a socket cannot be opened at all. Where the path cannot be
            // stat'ed, the open below says why.
            if let Ok(meta) = std::fs::metadata(&path)
                && let Some(kind) = special_kind(&meta)
            {
                return Err(LocalIoError::Unsized {
                    path,
                    kind: kind.into(),
                });
            }
        }
        // Should a FIFO be swapped in after that check, a read-only open would wait for a
        // writer: O_NONBLOCK makes it return, and the open file's type is checked again.
        // O_NOCTTY: opening a terminal must not make it ours.
        let mut flags = if writable {
            0
        } else {
            libc::O_NONBLOCK | libc::O_NOCTTY
        };
        if opts.direct {
            flags |= libc::O_DIRECT;
        }
        if opts.dsync {
            flags |= libc::O_DSYNC;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(writable)
            .create(opts.create)
            .truncate(opts.truncate)
            .custom_flags(flags)
            .open(&path)
            .map_err(|source| LocalIoError::Open {
                path: path.clone(),
                source,
            })?;
        let handle = Self::from_parts(file, path, writable, opts.direct, opts.gds);
        if !writable {
            handle.check_sizable()?;
        }
        Ok(handle)
    }

    /// Refuses a read-only file whose length [`len`](Self::len) cannot tell (a copy from it
    /// would block, never end, or end empty), then takes O_NONBLOCK off the rest.
    fn check_sizable(&self) -> Result<()> {
        let unsized_as = |kind: &str| LocalIoError::Unsized {
            path: self.name().to_path_buf(),
            kind: kind.into(),
        };
        let file = self.os_file()?;
        let meta = file.metadata().map_err(|e| self.io("stat", 0, e))?;
        if let Some(kind) = special_kind(&meta) {
            return Err(unsized_as(kind));
        }
        gpuio_hal::clear_nonblocking(&*file)?;
        if meta.is_file() && meta.len() == 0 {
            // Pseudo-file systems report 0 for files that have content: one byte tells.
            let mut probe = [0u8; 1];
            match self.read_at(0, &mut probe) {
                Ok(0) => {}
                Ok(_) => {
                    return Err(unsized_as(
                        "a file whose size reads as 0 although it has content (a pseudo-file, \
                         as in /proc or /sys)",
                    ));
                }
                Err(e) => {
                    let why = match e {
                        LocalIoError::Io { source, .. } => source.to_string(),
                        other => other.to_string(),
                    };
                    return Err(unsized_as(&format!(
                        "a file whose size reads as 0 and which cannot be read ({why})"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Wraps a file the caller opened (`writable`: opened for writing; buffered IO).
    pub fn from_file(file: File, path: impl Into<PathBuf>, writable: bool) -> Self {
        Self::from_parts(file, path.into(), writable, false, None)
    }

    fn from_parts(
        file: File,
        path: PathBuf,
        writable: bool,
        direct: bool,
        gds: Option<bool>,
    ) -> Self {
        let alignment = gpuio_hal::file::direct_io_alignment(&file);
        Self {
            name: None,
            inner: Arc::new(FileInner {
                path,
                writable,
                backing: Backing::Os(OsFile {
                    file: Arc::new(file),
                    direct,
                    alignment,
                    gds,
                    gds_files: Mutex::new(Vec::new()),
                }),
            }),
        }
    }

    /// An NVMe namespace served by gpuio's driver, as a file of the namespace's size (its
    /// path is the device's name, `nvme://<address>/<nsid>`). Writes past its end are
    /// [`LocalIoError::NoSpace`]; `sync_data` is an NVMe FLUSH.
    pub fn nvme(device: NvmeDevice, writable: bool) -> Self {
        Self {
            name: None,
            inner: Arc::new(FileInner {
                path: device.name().into(),
                writable,
                backing: Backing::Nvme(device),
            }),
        }
    }

    /// The NVMe namespace behind this handle, where gpuio's driver serves it.
    pub fn nvme_device(&self) -> Option<&NvmeDevice> {
        match &self.inner.backing {
            Backing::Nvme(d) => Some(d),
            Backing::Os(_) => None,
        }
    }

    fn os(&self) -> Option<&OsFile> {
        match &self.inner.backing {
            Backing::Os(f) => Some(f),
            Backing::Nvme(_) => None,
        }
    }

    /// The kernel's file under this handle; an NVMe namespace gpuio drives has none, which
    /// the paths that need one say.
    pub(crate) fn os_file(&self) -> Result<Arc<File>> {
        Ok(self.os_required()?.file.clone())
    }

    fn os_required(&self) -> Result<&OsFile> {
        self.os().ok_or_else(|| {
            LocalIoError::Hal(gpuio_hal::HalError::Unsupported {
                what: "this operation on an NVMe namespace gpuio's driver serves",
                reason: format!("{} has no kernel file under it", self.name().display()),
            })
        })
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The same file, called `name` in its errors instead of by its path: a file written
    /// under a temporary name is reported as the destination the user named.
    pub fn with_name(self, name: impl Into<PathBuf>) -> Self {
        Self {
            name: Some(name.into().into()),
            ..self
        }
    }

    /// What its errors call it: the name given with [`with_name`](Self::with_name), else its
    /// path.
    pub fn name(&self) -> &Path {
        self.name.as_deref().unwrap_or(&self.inner.path)
    }

    /// Whether it was opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.os().is_some_and(|f| f.direct)
    }

    /// Whether it was opened for writing.
    pub fn is_writable(&self) -> bool {
        self.inner.writable
    }

    /// The O_DIRECT alignment of the file system or device under it.
    pub fn direct_io_alignment(&self) -> DirectIoAlignment {
        match &self.inner.backing {
            Backing::Os(f) => f.alignment,
            Backing::Nvme(d) => {
                let block = d.namespace().identity.block_size as usize;
                DirectIoAlignment {
                    memory: 4,
                    offset: block,
                }
            }
        }
    }

    /// The alignment transfers on this handle must keep: the O_DIRECT offset alignment for a
    /// direct file, 1 otherwise.
    pub fn required_alignment(&self) -> usize {
        match self.os() {
            Some(f) if f.direct => f.alignment.offset.max(f.alignment.memory),
            _ => 1,
        }
    }

    /// Registers `len` bytes from `offset` with `gpu` for its kernels to read in place over
    /// PCIe ([`MappingPin::device_addr`](gpuio_hal::memory::mapped::MappingPin::device_addr)),
    /// from the pages the page cache holds, pinned until the returned pin drops. Refused
    /// (`Unsupported`, with the reason) where the device cannot register page cache pages or
    /// less than three quarters of the range is resident.
    pub fn pin_page_cache(
        &self,
        gpu: &Gpu,
        offset: u64,
        len: usize,
    ) -> Result<gpuio_hal::memory::mapped::MappingPin> {
        crate::page_cache::pin_warm(self, offset, len, gpu)
    }

    /// Whether this file asked for cuFile ([`OpenOptions::gds`]).
    pub fn gds(&self) -> Option<bool> {
        self.os().and_then(|f| f.gds)
    }

    /// This file's cuFile registration for `gpu`, made on first use. cuFile wants an
    /// O_DIRECT descriptor; a buffered handle reopens its own file (through `/proc/self/fd`,
    /// so a rename cannot swap it) with O_DIRECT where the file system allows.
    pub(crate) fn gds_file(&self, gpu: &Gpu) -> Result<Arc<GdsFile>> {
        let os = self.os_required()?;
        let file = os.file.clone();
        let mut files = os.gds_files.lock_unpoisoned();
        if let Some((_, f)) = files.iter().find(|(g, _)| g.same_device(gpu)) {
            return Ok(f.clone());
        }
        let fd = if os.direct {
            file
        } else {
            let own = format!("/proc/self/fd/{}", file.as_raw_fd());
            std::fs::OpenOptions::new()
                .read(true)
                .write(self.inner.writable)
                .custom_flags(libc::O_DIRECT)
                .open(own)
                .map(Arc::new)
                .unwrap_or(file)
        };
        let registered = Arc::new(GdsFile::register(gpu, fd)?);
        files.push((gpu.clone(), registered.clone()));
        Ok(registered)
    }

    /// Whether both handles refer to the same file on disk (same device and inode), however
    /// each was opened.
    pub fn same_inode(&self, other: &FileHandle) -> Result<bool> {
        use std::os::unix::fs::MetadataExt;
        let (a, b) = match (&self.inner.backing, &other.inner.backing) {
            (Backing::Os(a), Backing::Os(b)) => (&a.file, &b.file),
            (Backing::Nvme(a), Backing::Nvme(b)) => return Ok(a.same_namespace(b)),
            _ => return Ok(false),
        };
        let a = a.metadata().map_err(|e| self.io("stat", 0, e))?;
        let b = b.metadata().map_err(|e| other.io("stat", 0, e))?;
        Ok(a.dev() == b.dev() && a.ino() == b.ino())
    }

    /// An identity of the open file, unique in the process while any clone lives.
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// Current length in bytes (for block devices: the device size).
    pub fn len(&self) -> Result<u64> {
        let file = match &self.inner.backing {
            Backing::Os(f) => &f.file,
            Backing::Nvme(d) => return Ok(d.len()),
        };
        let meta = file.metadata().map_err(|e| self.io("stat", 0, e))?;
        if meta.is_file() {
            return Ok(meta.len());
        }
        // Block devices report 0 in st_size; their size is where a seek to the end lands.
        use std::io::Seek;
        (&**file)
            .seek(std::io::SeekFrom::End(0))
            .map_err(|e| self.io("stat", 0, e))
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Where `offset..offset+len` lives on the device (FIEMAP), for device-initiated IO.
    pub fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        Ok(gpuio_hal::file::extents(&*self.os_file()?, offset, len)?)
    }

    /// Bytes of `offset..offset+len` the page cache holds now; `None` where the kernel cannot
    /// say (before Linux 6.5) or no kernel file is under the handle.
    pub fn cached_bytes(&self, offset: u64, len: u64) -> Option<u64> {
        gpuio_hal::file::cached_bytes(&self.os()?.file, offset, len)
    }

    /// Drops the file's clean cached pages (so the next read is a cold read).
    /// An NVMe namespace gpuio drives has no cache to drop.
    pub fn drop_cache(&self) -> Result<()> {
        match self.os() {
            Some(f) => Ok(gpuio_hal::file::drop_cached_pages(&f.file, 0, 0)?),
            None => Ok(()),
        }
    }

    pub(crate) fn io(&self, op: &'static str, offset: u64, source: std::io::Error) -> LocalIoError {
        LocalIoError::Io {
            op,
            path: self.name().to_path_buf(),
            offset,
            source,
        }
    }

    pub(crate) fn eof(&self, offset: u64, wanted: usize, got: usize) -> LocalIoError {
        LocalIoError::UnexpectedEof {
            path: self.name().to_path_buf(),
            offset,
            wanted,
            got,
        }
    }

    pub(crate) fn no_space(&self, offset: u64, wanted: usize, written: usize) -> LocalIoError {
        LocalIoError::NoSpace {
            path: self.name().to_path_buf(),
            offset,
            wanted,
            written,
        }
    }

    fn check_writable(&self) -> Result<()> {
        if self.inner.writable {
            Ok(())
        } else {
            Err(LocalIoError::ReadOnly(self.name().to_path_buf()))
        }
    }

    /// Positioned read, looping over short reads and EINTR; returns the bytes read (fewer than
    /// asked only at end of file). `buf` and `offset` must suit the handle's alignment.
    fn pread(&self, file: &File, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            let at = offset + done as u64;
            match file.read_at(&mut buf[done..], at) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io("read", at, e)),
            }
        }
        Ok(done)
    }

    /// Positioned write of all of `buf`; a full disk (or quota) is [`LocalIoError::NoSpace`]
    /// naming how much reached the file.
    fn pwrite(&self, file: &File, offset: u64, buf: &[u8]) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let at = offset + done as u64;
            match file.write_at(&buf[done..], at) {
                Ok(0) => return Err(self.no_space(offset, buf.len(), done)),
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

    /// Reads into `buf` from `offset` until it is full or the file ends; returns the bytes
    /// read (less than `buf.len()` only at end of file). Any range works on a direct file: in
    /// place where `buf` and the range suit O_DIRECT, through a bounce buffer where not.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let os = match &self.inner.backing {
            Backing::Os(f) => f,
            Backing::Nvme(d) => return d.read_at(offset, buf),
        };
        if !os.direct {
            return self.pread(&os.file, offset, buf);
        }
        let a = self.required_alignment() as u64;
        let mut bounce = None;
        let mut done = 0;
        while done < buf.len() {
            let at = offset + done as u64;
            let whole = os.in_place(at, &buf[done..]);
            if whole > 0 {
                let got = self.pread(&os.file, at, &mut buf[done..done + whole])?;
                done += got;
                if got < whole {
                    break;
                }
                continue;
            }
            let bounce = bounce_for(&mut bounce, buf.len() - done, a as usize)?;
            let start = at / a * a;
            let head = (at - start) as usize;
            let want = (buf.len() - done).min(bounce.len() - head);
            let span = (head + want).next_multiple_of(a as usize).min(bounce.len());
            let got = self.pread(&os.file, start, &mut bounce[..span])?;
            let useful = got.saturating_sub(head).min(want);
            buf[done..done + useful].copy_from_slice(&bounce[head..head + useful]);
            done += useful;
            if useful < want {
                break;
            }
        }
        Ok(done)
    }

    /// Reads exactly `buf.len()` bytes from `offset`, or says how short the file was.
    pub fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let got = self.read_at(offset, buf)?;
        if got < buf.len() {
            return Err(self.eof(offset, buf.len(), got));
        }
        Ok(())
    }

    /// Writes all of `buf` at `offset`. A full disk is [`LocalIoError::NoSpace`], naming how
    /// much did reach the file. On a direct file an unaligned range is written by reading the
    /// partial edge blocks, and a write past the end trims the alignment padding afterwards.
    pub fn write_all_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        self.check_writable()?;
        let old_len = match self.os() {
            Some(f) if f.direct => self.len()?,
            _ => 0,
        };
        self.write_padded_at(offset, buf, old_len)?;
        self.trim_padding(old_len, offset + buf.len() as u64)
    }

    /// Cuts a direct file that a write ending at `end` grew from `old_len` back to `end`: its
    /// last block was written whole. Nothing to do on other files.
    pub(crate) fn trim_padding(&self, old_len: u64, end: u64) -> Result<()> {
        match self.os() {
            Some(f) if f.direct && end > old_len => self.set_len(end),
            _ => Ok(()),
        }
    }

    /// [`write_all_at`](Self::write_all_at) without the trim, for one of several writes of a
    /// transfer that trims once when all are done ([`trim_padding`](Self::trim_padding)).
    /// `old_len` is the file's length before the transfer (direct files only: partial blocks
    /// keep what the file holds, zeros past its end). Writes that run at once must not share
    /// a block.
    pub(crate) fn write_padded_at(&self, offset: u64, buf: &[u8], old_len: u64) -> Result<()> {
        self.check_writable()?;
        let os = match &self.inner.backing {
            Backing::Os(f) => f,
            Backing::Nvme(d) => return d.write_at(offset, buf),
        };
        if !os.direct {
            return self.pwrite(&os.file, offset, buf);
        }
        let a = self.required_alignment();
        let full = |done: usize, written: usize| self.no_space(offset, buf.len(), done + written);
        let mut bounce = None;
        let mut done = 0;
        while done < buf.len() {
            let at = offset + done as u64;
            let whole = os.in_place(at, &buf[done..]);
            if whole > 0 {
                self.pwrite(&os.file, at, &buf[done..done + whole])
                    .map_err(|e| match e {
                        LocalIoError::NoSpace { written, .. } => full(done, written),
                        other => other,
                    })?;
                done += whole;
                continue;
            }
            let bounce = bounce_for(&mut bounce, buf.len() - done, a)?;
            let start = at / a as u64 * a as u64;
            let head = (at - start) as usize;
            let n = (buf.len() - done).min(bounce.len() - head);
            let span = (head + n).next_multiple_of(a);
            // Partial blocks keep the bytes already in the file (zeros past its end).
            if head != 0 || span != head + n {
                bounce[..span].fill(0);
                if start < old_len {
                    self.pread(&os.file, start, &mut bounce[..span])?;
                }
            }
            bounce[head..head + n].copy_from_slice(&buf[done..done + n]);
            self.pwrite(&os.file, start, &bounce[..span])
                .map_err(|e| match e {
                    LocalIoError::NoSpace { written, .. } => {
                        full(done, written.saturating_sub(head))
                    }
                    other => other,
                })?;
            done += n;
        }
        Ok(())
    }

    /// Starts writing back `offset..offset+len` without waiting (buffered files only; a
    /// no-op on direct ones, which have nothing cached, and on NVMe namespaces gpuio drives).
    pub(crate) fn start_writeback(&self, offset: u64, len: u64) -> Result<()> {
        match self.os() {
            Some(f) if !f.direct => Ok(gpuio_hal::file::start_writeback(&f.file, offset, len)?),
            _ => Ok(()),
        }
    }

    /// Flushes written data to stable storage (`fdatasync`; NVMe FLUSH on a namespace gpuio
    /// drives).
    pub fn sync_data(&self) -> Result<()> {
        match &self.inner.backing {
            Backing::Os(f) => f.file.sync_data().map_err(|e| self.io("sync", 0, e)),
            Backing::Nvme(d) => d.flush(),
        }
    }

    /// Sets the file's length (extending with a hole, or truncating). A namespace gpuio
    /// drives has a fixed size: asking for that size does nothing, any other is refused.
    pub fn set_len(&self, len: u64) -> Result<()> {
        self.check_writable()?;
        match &self.inner.backing {
            Backing::Os(f) => f.file.set_len(len).map_err(|e| self.io("truncate", len, e)),
            Backing::Nvme(d) if d.len() == len => Ok(()),
            Backing::Nvme(d) => Err(self.io(
                "truncate",
                len,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("an NVMe namespace has a fixed size ({} bytes)", d.len()),
                ),
            )),
        }
    }
}

/// What a file is when it cannot be read as a sized source (`None`: a regular file or a block
/// device, which seeking to the end sizes).
fn special_kind(meta: &std::fs::Metadata) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_file() || t.is_block_device() {
        None
    } else if t.is_fifo() {
        Some("a FIFO")
    } else if t.is_socket() {
        Some("a socket")
    } else if t.is_char_device() {
        Some("a character device")
    } else if t.is_dir() {
        Some("a directory")
    } else {
        Some("not a regular file")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The open file's status flags, from /proc (octal, as the kernel prints them).
    fn status_flags(h: &FileHandle) -> Option<i32> {
        let fdinfo = format!("/proc/self/fdinfo/{}", h.os_file().ok()?.as_raw_fd());
        let text = std::fs::read_to_string(fdinfo).ok()?;
        let line = text.lines().find(|l| l.starts_with("flags:"))?;
        i32::from_str_radix(line.trim_start_matches("flags:").trim(), 8).ok()
    }

    #[test]
    fn read_only_handles_do_not_stay_non_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"data").unwrap();
        let h = FileHandle::open(&path, OpenOptions::READ).unwrap();
        // io_uring fails reads of non-blocking files on some file systems with EAGAIN.
        if let Some(flags) = status_flags(&h) {
            assert_eq!(flags & libc::O_NONBLOCK, 0, "flags {flags:o}");
        }
    }

    #[test]
    fn a_named_handle_is_called_by_its_name_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".dest.AbC123.tmp");
        std::fs::write(&path, b"data").unwrap();
        let h = FileHandle::open(&path, OpenOptions::READ)
            .unwrap()
            .with_name("dest");
        assert_eq!(h.path(), path);
        assert_eq!(h.name(), Path::new("dest"));
        let clone = h.clone();
        let eof = clone.read_exact_at(2, &mut [0; 8]).unwrap_err();
        assert!(
            matches!(&eof, LocalIoError::UnexpectedEof { path, .. } if path == Path::new("dest")),
            "{eof:?}"
        );
        let ro = h.write_all_at(0, b"x").unwrap_err();
        assert!(
            matches!(&ro, LocalIoError::ReadOnly(p) if p == Path::new("dest")),
            "{ro:?}"
        );
    }
}
