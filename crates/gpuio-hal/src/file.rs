//! File-system facts for direct and device-initiated IO: the alignment O_DIRECT needs, where a
//! file's bytes are on the device (FIEMAP), how much of a file is cached and dropping its
//! cached pages, and how much room a file system has left.

use crate::error::{HalError, Result};
use serde::Serialize;
use std::fs::File;
use std::os::fd::AsRawFd;

/// What O_DIRECT transfers on a file must be aligned to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DirectIoAlignment {
    /// Alignment of the memory address.
    pub memory: usize,
    /// Alignment of the file offset and the length.
    pub offset: usize,
}

impl DirectIoAlignment {
    /// The conservative default where the kernel does not say: a page for both.
    pub const PAGE: Self = Self {
        memory: 4096,
        offset: 4096,
    };
}

/// The O_DIRECT alignment of `file`: `statx(STATX_DIOALIGN)` where the kernel reports it (Linux
/// 6.1+), the logical block size for block devices, else a page.
pub fn direct_io_alignment(file: &File) -> DirectIoAlignment {
    let fd = file.as_raw_fd();
    // SAFETY: an all-zero statx is a valid value of this plain C struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx on an open fd with AT_EMPTY_PATH and "" reads nothing else and writes one
    // statx into `stx`, which lives across the call.
    let rc = unsafe {
        libc::statx(
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN | libc::STATX_TYPE,
            &mut stx,
        )
    };
    if rc == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 && stx.stx_dio_offset_align != 0 {
        return DirectIoAlignment {
            memory: stx.stx_dio_mem_align.max(1) as usize,
            offset: stx.stx_dio_offset_align as usize,
        };
    }
    if rc == 0 && (stx.stx_mode as u32 & libc::S_IFMT) == libc::S_IFBLK {
        const BLKSSZGET: libc::c_ulong = 0x1268;
        let mut size: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int into `size`; the fd is an open block device.
        if unsafe { libc::ioctl(fd, BLKSSZGET, &mut size) } == 0 && size > 0 {
            return DirectIoAlignment {
                memory: size as usize,
                offset: size as usize,
            };
        }
    }
    DirectIoAlignment::PAGE
}

/// One extent of a file (FIEMAP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Extent {
    /// Offset in the file.
    pub logical: u64,
    /// Offset on the device.
    pub physical: u64,
    /// Length in bytes.
    pub length: u64,
    /// FIEMAP extent flags (`FIEMAP_EXTENT_*`): last, unknown location, delayed allocation,
    /// encoded, unwritten, ...
    pub flags: u32,
}

impl Extent {
    /// The last extent of the file.
    pub const LAST: u32 = 0x1;
    /// Location unknown (e.g. not yet allocated).
    pub const UNKNOWN: u32 = 0x2;
    /// Allocated but unwritten (reads as zeros).
    pub const UNWRITTEN: u32 = 0x800;

    /// Whether the device location can be used for direct device IO.
    pub fn is_addressable(&self) -> bool {
        self.flags & (Self::UNKNOWN | 0x4 /* DELALLOC */ | 0x8/* ENCODED */) == 0
    }
}

/// `struct fiemap` of `<linux/fiemap.h>`, header only.
#[repr(C)]
struct FiemapHeader {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
}

/// `struct fiemap_extent` of `<linux/fiemap.h>`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapExtent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

/// `_IOWR('f', 11, struct fiemap)`.
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
const FIEMAP_FLAG_SYNC: u32 = 0x1;

/// The extents holding `offset..offset+len` of `file` (FIEMAP, after syncing dirty data).
/// Holes of a sparse file are simply absent. Fails with `Unsupported` where the file system
/// has no FIEMAP (tmpfs, some network file systems).
pub fn extents(file: &File, offset: u64, len: u64) -> Result<Vec<Extent>> {
    const BATCH: usize = 256;
    let mut out = Vec::new();
    let end = offset.saturating_add(len);
    let mut at = offset;
    while at < end {
        // Header followed by BATCH extents, 8-byte aligned.
        let words = (std::mem::size_of::<FiemapHeader>()
            + BATCH * std::mem::size_of::<FiemapExtent>())
        .div_ceil(8);
        let mut buf = vec![0u64; words];
        let header = FiemapHeader {
            start: at,
            length: end - at,
            flags: FIEMAP_FLAG_SYNC,
            mapped_extents: 0,
            extent_count: BATCH as u32,
            reserved: 0,
        };
        let base = buf.as_mut_ptr().cast::<u8>();
        // SAFETY: `buf` is large enough and 8-byte aligned for the header and BATCH extents;
        // the ioctl reads the header and writes at most extent_count extents after it.
        let rc = unsafe {
            base.cast::<FiemapHeader>().write(header);
            libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP, base)
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            return Err(match err.raw_os_error() {
                Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) => HalError::Unsupported {
                    what: "FIEMAP",
                    reason: "the file system does not report extents".into(),
                },
                _ => HalError::Os {
                    op: "ioctl(FS_IOC_FIEMAP)",
                    source: err,
                },
            });
        }
        // SAFETY: the kernel filled the header and `mapped_extents` (≤ BATCH) extents.
        let (mapped, extents) = unsafe {
            let h = base.cast::<FiemapHeader>().read();
            let first = base
                .add(std::mem::size_of::<FiemapHeader>())
                .cast::<FiemapExtent>();
            let n = (h.mapped_extents as usize).min(BATCH);
            (n, std::slice::from_raw_parts(first, n).to_vec())
        };
        if mapped == 0 {
            break;
        }
        let mut last = false;
        for e in &extents {
            out.push(Extent {
                logical: e.logical,
                physical: e.physical,
                length: e.length,
                flags: e.flags,
            });
            last |= e.flags & Extent::LAST != 0;
        }
        let tail = extents[mapped - 1];
        at = tail.logical.saturating_add(tail.length);
        if last {
            break;
        }
    }
    Ok(out)
}

/// Drops `file`'s clean cached pages in `offset..offset+len` (`posix_fadvise(DONTNEED)`; `len`
/// 0 means to the end), so the next read comes from the device. Dirty pages are not dropped:
/// sync first.
pub fn drop_cached_pages(file: &File, offset: u64, len: u64) -> Result<()> {
    // SAFETY: posix_fadvise only advises the kernel about an open fd's page cache.
    let rc = unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    if rc != 0 {
        return Err(HalError::Os {
            op: "posix_fadvise(DONTNEED)",
            source: std::io::Error::from_raw_os_error(rc),
        });
    }
    Ok(())
}

/// Bytes of `offset..offset+len` of `file` the page cache holds now (`cachestat`, Linux 6.5+:
/// one system call, no mapping); `None` where the kernel cannot say, which includes a file
/// the process neither owns nor may write (the kernel's rule, as for `mincore`) unless it has
/// `CAP_FOWNER`. Pages that straddle the range's ends count whole, so a result may exceed what
/// the range holds: it is capped at `len`.
pub fn cached_bytes(file: &File, offset: u64, len: u64) -> Option<u64> {
    /// `struct cachestat_range` and `struct cachestat` of `<linux/mman.h>`.
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    /// Its number in the generic system call table, which x86_64 and aarch64 use; elsewhere
    /// the kernel is not asked.
    const SYS_CACHESTAT: Option<libc::c_long> =
        if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
            Some(451)
        } else {
            None
        };
    let number = SYS_CACHESTAT?;
    if len == 0 {
        // The kernel reads a zero length as "to the end of the file".
        return Some(0);
    }
    let range = Range { off: offset, len };
    let mut stat = Stat::default();
    // SAFETY: cachestat reads one `Range` and writes one `Stat`, both live across the call, of
    // the layouts the kernel's uapi header gives; it touches nothing else of the process.
    let rc = unsafe {
        libc::syscall(
            number,
            file.as_raw_fd(),
            &range as *const Range,
            &mut stat as *mut Stat,
            0 as libc::c_uint,
        )
    };
    (rc == 0).then(|| {
        let page = crate::sys::page_size() as u64;
        stat.nr_cache.saturating_mul(page).min(len)
    })
}

/// Starts writeback of `offset..offset+len` of `file` without waiting for it
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`): a large write that ends in `fdatasync` overlaps
/// the flush with the writes still to come instead of flushing everything at the end. Not a
/// durability guarantee by itself.
pub fn start_writeback(file: &File, offset: u64, len: u64) -> Result<()> {
    // SAFETY: sync_file_range only schedules writeback of an open fd's dirty pages.
    let rc = unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        )
    };
    if rc != 0 {
        return Err(HalError::last_os("sync_file_range"));
    }
    Ok(())
}

/// Bytes an unprivileged process may still write to the file system holding `path` (a file or
/// a directory): `statvfs`'s available blocks times its fragment size.
pub fn available_space(path: &std::path::Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| HalError::Os {
        op: "statvfs",
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL byte in the path"),
    })?;
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path that outlives the call; `st` is a valid, writable
    // statvfs the call fills in.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(HalError::last_os("statvfs"));
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Allocates the blocks of `offset..offset+len` of `file` without changing its size
/// (`fallocate(FALLOC_FL_KEEP_SIZE)`), so that writing that range later cannot fail for want
/// of space: a full disk is `ErrorKind::StorageFull` now, before anything is written. Where
/// the file system cannot allocate ahead (`EOPNOTSUPP`), the bytes the range adds past the
/// file's end are compared with the room the file system has left instead: advisory, since
/// nothing is set aside and holes inside the file are not counted.
pub fn reserve_space(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let too_large = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "range too large");
    let off = libc::off64_t::try_from(offset).map_err(|_| too_large())?;
    let n = libc::off64_t::try_from(len).map_err(|_| too_large())?;
    loop {
        // SAFETY: fallocate on an open descriptor reads no memory of ours.
        let rc = unsafe { libc::fallocate64(file.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, off, n) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EOPNOTSUPP) => break,
            _ => return Err(e),
        }
    }
    let size = file.metadata()?.len();
    let wanted = offset.saturating_add(len).saturating_sub(offset.max(size));
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatvfs on an open descriptor fills in `st`, which outlives the call.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let room = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
    if wanted > room {
        return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty file on the temporary directory's file system, already unlinked (it lives
    /// as long as the handle).
    fn scratch(tag: &str) -> File {
        let path = std::env::temp_dir().join(format!("gpuio-{tag}-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    #[test]
    fn layouts_match_the_kernel_header() {
        assert_eq!(std::mem::size_of::<FiemapHeader>(), 32);
        assert_eq!(std::mem::size_of::<FiemapExtent>(), 56);
    }

    #[test]
    fn cached_bytes_follow_the_page_cache() {
        use std::os::unix::fs::FileExt;
        let f = scratch("cachestat");
        let len = 8u64 << 20;
        f.write_all_at(&vec![7u8; len as usize], 0).unwrap();
        f.sync_all().unwrap();
        assert_eq!(cached_bytes(&f, 0, 0), Some(0));
        let Some(whole) = cached_bytes(&f, 0, len) else {
            // The caller wrote the file, so only the kernel can refuse: tell it apart.
            let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
            let version: Vec<u32> = (release.split(['.', '-']).take(2))
                .map(|n| n.trim().parse().unwrap_or(0))
                .collect();
            assert!(
                version < vec![6, 5],
                "cachestat refused on Linux {release}, which has it (a seccomp filter?)"
            );
            eprintln!("cachestat: Linux {release} predates it (6.5); nothing to check");
            return;
        };
        assert_eq!(whole, len, "a file just written is cached");
        assert_eq!(
            cached_bytes(&f, 4096, 100),
            Some(100),
            "capped at the range"
        );
        drop_cached_pages(&f, 0, 0).unwrap();
        let dropped = cached_bytes(&f, 0, len).unwrap();
        if dropped < len {
            // Where the file system drops clean pages (not tmpfs): a read brings them back.
            f.read_exact_at(&mut vec![0u8; 1 << 20], 1 << 20).unwrap();
            let back = cached_bytes(&f, 1 << 20, 1 << 20).unwrap();
            assert_eq!(back, 1 << 20);
            assert!(cached_bytes(&f, 0, len).unwrap() > dropped);
        }
    }

    #[test]
    fn extents_cover_written_data_and_skip_holes() {
        let f = scratch("fiemap");
        use std::os::unix::fs::FileExt;
        f.write_all_at(&[1u8; 1 << 20], 0).unwrap();
        f.write_all_at(&[2u8; 1 << 20], 64 << 20).unwrap();
        f.sync_all().unwrap();
        match extents(&f, 0, 65 << 20) {
            Ok(ex) => {
                let mapped: u64 = ex.iter().map(|e| e.length).sum();
                assert!(mapped >= 2 << 20, "{ex:?}");
                assert!(mapped < 32 << 20, "the hole was reported as data: {ex:?}");
                assert!(
                    ex.iter()
                        .any(|e| e.logical <= 64 << 20 && e.logical + e.length > 64 << 20)
                );
            }
            Err(e) => eprintln!("skipped FIEMAP check: {e}"),
        }
        let a = direct_io_alignment(&f);
        assert!(
            a.offset.is_power_of_two() && a.memory.is_power_of_two(),
            "{a:?}"
        );
        start_writeback(&f, 0, 1 << 20).unwrap();
        drop_cached_pages(&f, 0, 0).unwrap();
    }

    #[test]
    fn available_space_is_what_the_file_system_has_left() {
        let dir = std::env::temp_dir();
        let free = available_space(&dir).unwrap();
        // The file system can take a small file, and does not claim more than an exabyte.
        assert!(free > 4096 && free < 1 << 60, "{free}");
        assert!(available_space(std::path::Path::new("/nonexistent/gpuio")).is_err());
        use std::os::unix::ffi::OsStrExt;
        let nul = std::ffi::OsStr::from_bytes(b"/tmp/a\0b");
        assert!(available_space(std::path::Path::new(nul)).is_err());
    }
}
