//! NVMe controllers handed to gpuio's kernel module (`kmod/gpuio_nvme.c`) instead of VFIO: for
//! machines without an IOMMU, or where VFIO is not wanted. The module's character device
//! `/dev/gpuio-nvmeN` maps BAR0 at offset 0, allocates DMA-coherent buffers (their bus
//! addresses are what the controller is given), and maps each at the offset it returns; it
//! also imports dma-bufs (a GPU's memory) for the controller to reach peer-to-peer. Its
//! interface is mirrored here: the ioctl numbers and argument layouts.

use super::controller::{Controller, ControllerOptions};
use super::dma::{DmaMapper, DmaMemory, Mmio};
use super::peer::PeerBuffer;
use gpuio_hal::error::{HalError, Result};
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;

/// `struct gpuio_nvme_alloc`.
#[repr(C)]
#[derive(Default)]
struct Alloc {
    size: u64,
    bus_addr: u64,
    offset: u64,
}

/// `struct gpuio_nvme_info`.
#[repr(C)]
#[derive(Default)]
struct Info {
    bar_size: u64,
}

/// `struct gpuio_nvme_segment`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Segment {
    bus_addr: u64,
    len: u64,
}

/// `struct gpuio_nvme_import`.
#[repr(C)]
#[derive(Default)]
struct Import {
    fd: i32,
    max_segments: u32,
    segments: u64,
    size: u64,
    count: u32,
    id: u32,
}

/// The most segments one import may return (`GPUIO_NVME_MAX_SEGMENTS`).
const MAX_SEGMENTS: usize = 1 << 18;

/// `_IOC(dir, 'g', nr, size)` as `<asm-generic/ioctl.h>` builds it.
const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    dir << 30 | (size as u64) << 16 | (b'g' as u64) << 8 | nr
}
const IOC_ALLOC: u64 = ioc(3, 1, size_of::<Alloc>());
const IOC_FREE: u64 = ioc(1, 2, size_of::<u64>());
const IOC_INFO: u64 = ioc(2, 3, size_of::<Info>());
const IOC_IMPORT: u64 = ioc(3, 4, size_of::<Import>());
const IOC_RELEASE: u64 = ioc(1, 5, size_of::<u32>());

/// The device files of controllers the module holds.
pub fn devices() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/dev") else {
        return Vec::new();
    };
    let mut found: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("gpuio-nvme"))
        .map(|n| format!("/dev/{n}"))
        .collect();
    found.sort();
    found
}

/// Opens the controller behind the module's device file `path` (e.g. `/dev/gpuio-nvme0`) and
/// enables it. The module lets one process hold a controller at a time.
pub fn open(path: &str, options: ControllerOptions) -> Result<Controller> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| HalError::NvmeController {
            reason: format!("{path}: {e} (is gpuio_nvme loaded and the controller bound to it?)"),
        })?;
    let device = Arc::new(Device { file });
    let mut info = Info::default();
    device.ioctl("GPUIO_NVME_IOC_INFO", IOC_INFO, (&raw mut info).cast())?;
    let len = usize::try_from(info.bar_size)
        .ok()
        .filter(|&l| l >= 0x2000)
        .ok_or_else(|| HalError::NvmeController {
            reason: format!("{path}: BAR0 is {} bytes", info.bar_size),
        })?;
    let base = gpuio_hal::sys::map_shared(device.fd(), 0, len)?;
    let bar = Arc::new(Bar {
        base,
        len,
        _device: device.clone(),
    });
    // SAFETY: the BAR stays mapped until `Bar` drops, which the register file's owner handle
    // keeps alive; register accesses are 32-bit volatile ones, and nothing references it.
    let regs = unsafe { Mmio::new(base, len, true, bar) };
    Controller::enable(regs, Arc::new(KmodMapper { device }), options)
}

/// The open device file.
struct Device {
    file: File,
}

impl Device {
    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn ioctl(&self, op: &'static str, request: u64, arg: *mut libc::c_void) -> Result<()> {
        // SAFETY: each request's argument is the `#[repr(C)]` struct (or u64) the module's
        // ioctl reads and writes, living across the call.
        let rc = unsafe { libc::ioctl(self.fd(), request as libc::c_ulong, arg) };
        if rc < 0 {
            return Err(HalError::last_os(op));
        }
        Ok(())
    }
}

/// A mapped BAR0 and the open device (unmapped before the file closes).
struct Bar {
    base: NonNull<u8>,
    len: usize,
    _device: Arc<Device>,
}

// SAFETY: the mapping is only reached through `Mmio`'s volatile accesses.
unsafe impl Send for Bar {}
// SAFETY: as above.
unsafe impl Sync for Bar {}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: the mapping `open` made, released once, after every `Mmio` over it is gone.
        unsafe { gpuio_hal::sys::unmap(self.base, self.len) };
    }
}

/// DMA memory the module allocates: coherent buffers at the bus addresses it returns.
struct KmodMapper {
    device: Arc<Device>,
}

/// Gives a module buffer back once its mapping is gone.
struct KmodBuffer {
    device: Arc<Device>,
    offset: u64,
}

impl Drop for KmodBuffer {
    fn drop(&mut self) {
        let mut offset = self.offset;
        if let Err(e) = self
            .device
            .ioctl("GPUIO_NVME_IOC_FREE", IOC_FREE, (&raw mut offset).cast())
        {
            tracing::warn!(error = %e, "gpuio_nvme buffer not freed");
        }
    }
}

impl DmaMapper for KmodMapper {
    unsafe fn map(&self, _mem: &DmaMemory) -> Result<u64> {
        Err(HalError::Unsupported {
            what: "mapping process memory for a gpuio_nvme controller",
            reason: "the kernel module hands out its own DMA buffers (no IOMMU to map others)"
                .into(),
        })
    }

    fn unmap(&self, _iova: u64, _len: usize) {}

    unsafe fn alloc(&self, len: usize) -> Result<(DmaMemory, u64)> {
        let mut a = Alloc {
            size: len as u64,
            ..Alloc::default()
        };
        self.device
            .ioctl("GPUIO_NVME_IOC_ALLOC", IOC_ALLOC, (&raw mut a).cast())?;
        let owner = KmodBuffer {
            device: self.device.clone(),
            offset: a.offset,
        };
        let len = usize::try_from(a.size).map_err(|_| HalError::OutOfMemory {
            what: "gpuio_nvme DMA buffer",
            len,
        })?;
        let mem = DmaMemory::map_device_file(self.device.fd(), a.offset, len, Box::new(owner))?;
        Ok((mem, a.bus_addr))
    }

    fn import_dmabuf(&self, fd: BorrowedFd<'_>) -> Result<PeerBuffer> {
        let size = gpuio_hal::sys::seekable_size(fd)?;
        let len = usize::try_from(size).map_err(|_| {
            HalError::InvalidArgument(format!("a dma-buf of {size} bytes is too large"))
        })?;
        // One segment per page at worst (contiguous runs come back merged).
        let room = (len / 4096 + 1).min(MAX_SEGMENTS);
        let mut segments = vec![Segment::default(); room];
        let mut im = Import {
            fd: fd.as_raw_fd(),
            max_segments: room as u32,
            segments: segments.as_mut_ptr() as u64,
            ..Import::default()
        };
        self.device
            .ioctl("GPUIO_NVME_IOC_IMPORT", IOC_IMPORT, (&raw mut im).cast())?;
        let release = KmodImport {
            device: self.device.clone(),
            id: im.id,
        };
        segments.truncate(im.count as usize);
        let runs = segments.iter().map(|s| (s.bus_addr, s.len)).collect();
        let me = self as *const Self as *const ();
        PeerBuffer::new(len.min(im.size as usize), runs, me, Box::new(release))
    }
}

/// Releases a module import (unmapped, unpinned, detached) once its `PeerBuffer` is gone.
struct KmodImport {
    device: Arc<Device>,
    id: u32,
}

impl Drop for KmodImport {
    fn drop(&mut self) {
        let mut id = self.id;
        if let Err(e) =
            self.device
                .ioctl("GPUIO_NVME_IOC_RELEASE", IOC_RELEASE, (&raw mut id).cast())
        {
            tracing::warn!(error = %e, "gpuio_nvme dma-buf import not released");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_module() {
        // _IOWR('g', 1, 24 bytes), _IOW('g', 2, 8 bytes), _IOR('g', 3, 8 bytes),
        // _IOWR('g', 4, 32 bytes), _IOW('g', 5, 4 bytes).
        assert_eq!(IOC_ALLOC, 0xc018_6701);
        assert_eq!(IOC_FREE, 0x4008_6702);
        assert_eq!(IOC_INFO, 0x8008_6703);
        assert_eq!(IOC_IMPORT, 0xc020_6704);
        assert_eq!(IOC_RELEASE, 0x4004_6705);
    }
}
