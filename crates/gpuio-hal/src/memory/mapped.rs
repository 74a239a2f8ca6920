//! Read-only mappings of file ranges, for DMA straight from the page cache.
//!
//! A warm file's pages are already in host memory. Mapping them (`mmap(PROT_READ,
//! MAP_SHARED)`) and registering the mapping with the device read-only (`cuMemHostRegister`
//! with `READ_ONLY`) lets the copy engine read them where they are: no CPU copy into staging.
//!
//! The CPU never reads through a [`FileMapping`]: a file that shrinks under a mapping turns
//! such reads into `SIGBUS`. A registered range is pinned (its pages are held by the driver),
//! so the DMA never faults; what a shrink or rewrite can do is leave the pinned pages holding
//! the file's old bytes, which the caller detects by checking the file's identity (size,
//! times, inode) before and after and redoing the read another way.

use crate::error::{HalError, Result};
use crate::gpu::{DeviceBuffer, Gpu, HostPin, Stream};
use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// A read-only shared mapping of `len` bytes of a file. Its bytes are only ever handed to a
/// device's copy engine through a [`MappingPin`].
#[derive(Debug)]
pub struct FileMapping {
    /// Page-aligned start of the mapping.
    pub(crate) base: *mut u8,
    /// Bytes mapped (whole pages).
    map_len: usize,
    /// Where the wanted bytes start inside the mapping.
    pub(crate) head: usize,
    /// Wanted bytes.
    len: usize,
    page: usize,
}

// SAFETY: the mapping's address is only passed to the kernel (`mincore`, `munmap`) and the
// driver (registration and DMA); no CPU access goes through it, so sharing it between threads
// shares no Rust-visible data.
unsafe impl Send for FileMapping {}
// SAFETY: as above.
unsafe impl Sync for FileMapping {}

impl FileMapping {
    /// Maps `len` bytes of `file` from `offset` (any alignment), read-only and shared with the
    /// page cache. The range should lie inside the file: pages past its end cannot be
    /// registered.
    pub fn new(file: &File, offset: u64, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(HalError::InvalidArgument(
                "cannot map an empty file range".into(),
            ));
        }
        let page = crate::sys::page_size();
        let head = (offset % page as u64) as usize;
        let start = offset - head as u64;
        let map_len = head
            .checked_add(len)
            .and_then(|n| n.checked_next_multiple_of(page))
            .ok_or_else(|| HalError::InvalidArgument("file mapping size overflows".into()))?;
        let start = libc::off_t::try_from(start)
            .map_err(|_| HalError::InvalidArgument(format!("file offset {offset} too large")))?;
        // SAFETY: a fresh read-only shared mapping chosen by the kernel (null hint); it aliases
        // no Rust memory, and is unmapped once, in Drop.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                start,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(HalError::Os {
                op: "mmap",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(Self {
            base: base.cast(),
            map_len,
            head,
            len,
            page,
        })
    }

    /// Bytes mapped (those asked for, not the page padding).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no bytes are mapped (never: an empty range is refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The page size the mapping is cut in.
    pub fn page_size(&self) -> usize {
        self.page
    }

    /// The pages (as a byte range of the mapping, padding included) that `range` of the wanted
    /// bytes touches.
    pub(crate) fn pages(&self, range: &Range<usize>) -> Result<Range<usize>> {
        if range.start >= range.end || range.end > self.len {
            return Err(HalError::InvalidArgument(format!(
                "range {range:?} of a {}-byte file mapping",
                self.len
            )));
        }
        let start = (self.head + range.start) / self.page * self.page;
        let end = (self.head + range.end).next_multiple_of(self.page);
        Ok(start..end)
    }

    /// Maps the pages of `range` (of the wanted bytes) into this process's page tables ahead
    /// of a registration (`MADV_POPULATE_READ`), reading in those not resident. Registering
    /// populated pages is faster, and several threads can populate at once where the
    /// registration itself is serialized. Kernels before 5.14 lack it: nothing is done there.
    pub fn populate(&self, range: Range<usize>) -> Result<()> {
        let pages = self.pages(&range)?;
        // SAFETY: the span is page-aligned and inside our live mapping; the advice only maps
        // (and reads in) its pages, which are read-only to us, and touches no Rust memory.
        let rc = unsafe {
            libc::madvise(
                self.base.wrapping_add(pages.start).cast(),
                pages.end - pages.start,
                libc::MADV_POPULATE_READ,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(HalError::Os {
                    op: "madvise(MADV_POPULATE_READ)",
                    source: e,
                });
            }
        }
        Ok(())
    }

    /// How many bytes of `range` (of the wanted bytes, counted in whole pages) are in the page
    /// cache now (`mincore`): what a read from memory would find without going to the disk.
    pub fn resident(&self, range: Range<usize>) -> Result<usize> {
        let pages = self.pages(&range)?;
        let mut vec = vec![0u8; (pages.end - pages.start) / self.page];
        // SAFETY: the address is page-aligned and the span lies inside our live mapping;
        // mincore writes one byte per page into `vec`, which has exactly that many.
        let rc = unsafe {
            libc::mincore(
                self.base.wrapping_add(pages.start).cast(),
                pages.end - pages.start,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(HalError::Os {
                op: "mincore",
                source: std::io::Error::last_os_error(),
            });
        }
        let resident = vec.iter().filter(|&&b| b & 1 != 0).count();
        Ok((resident * self.page).min(range.end - range.start))
    }
}

impl Drop for FileMapping {
    fn drop(&mut self) {
        // SAFETY: base/map_len are the mapping made in `new`, unmapped exactly once; every
        // registration of it holds an Arc to it, so none is alive now.
        unsafe { libc::munmap(self.base.cast(), self.map_len) };
    }
}

/// Part of a [`FileMapping`] registered read-only with a device (its pages pinned), so the
/// copy engine reads them directly. Unregistered when dropped; holds the mapping until then.
#[derive(Debug)]
pub struct MappingPin {
    // Dropped before `map`: the registration ends before the mapping can go.
    _pin: Box<dyn HostPin>,
    map: Arc<FileMapping>,
    range: Range<usize>,
    gpu: Gpu,
    device_addr: u64,
}

impl MappingPin {
    /// Takes over `pin`, the registration of [`FileMapping::pages`] of `range` with `gpu`,
    /// whose kernels read `range.start` at `device_addr`.
    pub(crate) fn new(
        pin: Box<dyn HostPin>,
        map: Arc<FileMapping>,
        range: Range<usize>,
        gpu: Gpu,
        device_addr: u64,
    ) -> Self {
        Self {
            _pin: pin,
            map,
            range,
            gpu,
            device_addr,
        }
    }

    /// Where kernels of the device that registered it read the first byte of
    /// [`range`](Self::range) in place (over PCIe, from the pinned page cache pages), for as
    /// long as the pin lives.
    pub fn device_addr(&self) -> u64 {
        self.device_addr
    }

    /// The wanted bytes it covers.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Copies `part` of the pinned bytes (a range of the mapping's wanted bytes, inside
    /// [`range`](Self::range)) into `dst` at `dst_offset` on `stream` (of any device of the
    /// backend that registered it), and waits for the copy.
    pub fn copy_to_device(
        &self,
        part: Range<usize>,
        stream: &Stream,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        if part.start > part.end || part.start < self.range.start || part.end > self.range.end {
            return Err(HalError::InvalidArgument(format!(
                "range {part:?} is outside the registered {:?}",
                self.range
            )));
        }
        // Registrations are portable: any device of the backend that made one can read it.
        if stream.gpu().backend() != self.gpu.backend() {
            return Err(HalError::WrongDevice {
                what: "registered file range",
                owner: self.gpu.to_string(),
                expected: stream.gpu().to_string(),
            });
        }
        let src = self
            .map
            .base
            .wrapping_add(self.map.head + part.start)
            .cast_const();
        // SAFETY: `part` lies in the range registered (pinned) with this device for the pin's
        // life, which spans the copy and the wait in `copy_pinned_h2d`, so the DMA reads
        // pinned pages and never faults, whatever happens to the file meanwhile.
        unsafe { stream.copy_pinned_h2d(src, part.len(), dst, dst_offset) }
    }
}
