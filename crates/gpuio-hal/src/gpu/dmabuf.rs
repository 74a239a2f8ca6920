//! Device memory exported as a dma-buf: a file descriptor another device's driver imports to
//! reach the memory peer-to-peer over PCIe — gpuio's kernel module, for an NVMe controller to
//! read into or write from GPU memory (NVMe Tier 2, `nvme::Controller::import_dmabuf`).

use super::DeviceBuffer;
use crate::error::{HalError, Result, check_range};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// A dma-buf of part of a [`DeviceBuffer`], which it keeps allocated. An importer holds the
/// dma-buf (and the exporter the memory's pages) until it releases its import, however soon
/// this handle is dropped.
#[derive(Debug)]
pub struct DmaBufExport {
    fd: OwnedFd,
    len: usize,
    _buf: DeviceBuffer,
}

impl DmaBufExport {
    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: an export has at least a page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl AsFd for DmaBufExport {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl DeviceBuffer {
    /// Exports `len` bytes from `offset` as a dma-buf. Offset and length must be non-zero
    /// multiples of the host page size (the driver's rule); a device whose driver cannot
    /// export ([`DeviceInfo::dma_buf`](crate::DeviceInfo::dma_buf) says why) and the host
    /// backend refuse with the reason.
    pub fn export_dmabuf(&self, offset: usize, len: usize) -> Result<DmaBufExport> {
        check_range("dma-buf export", offset, len, self.len())?;
        let page = crate::sys::page_size();
        let addr = self.device_addr() + offset as u64;
        if len == 0 || !len.is_multiple_of(page) || !addr.is_multiple_of(page as u64) {
            return Err(HalError::InvalidArgument(format!(
                "a dma-buf export is whole {page}-byte pages at a page-aligned address, not \
                 {len} bytes at {addr:#x}"
            )));
        }
        let fd = self.gpu().inner.export_dmabuf(addr, len)?;
        Ok(DmaBufExport {
            fd,
            len,
            _buf: self.clone(),
        })
    }
}
