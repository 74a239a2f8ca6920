//! Managed memory ([`ManagedBuffer`]): one address for the host and the device, each page
//! migrating to whichever side touches it (CUDA's unified memory). gpuio's own paths never
//! use it: it is the "put the data in managed memory and let the kernel fault it in" peer
//! that the on-demand array benches race.

use super::{DeviceAlloc, DeviceBuffer, Gpu};
use crate::error::{Result, check_range};
use std::sync::Arc;

/// A managed allocation: kernels read it at its device address ([`device`](Self::device)),
/// the host writes it with [`write`](Self::write).
#[derive(Debug)]
pub struct ManagedBuffer {
    buf: DeviceBuffer,
}

impl Gpu {
    /// `len` bytes of managed memory (CUDA only; the host backend refuses: `Unsupported`).
    pub fn alloc_managed(&self, len: usize) -> Result<ManagedBuffer> {
        let mem = self.inner.alloc_managed(len.max(1))?;
        Ok(ManagedBuffer {
            buf: DeviceBuffer {
                inner: Arc::new(DeviceAlloc {
                    gpu: self.clone(),
                    mem,
                    len,
                }),
            },
        })
    }
}

impl ManagedBuffer {
    /// The memory as kernels take it.
    pub fn device(&self) -> &DeviceBuffer {
        &self.buf
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }

    /// Writes `src` at `offset` from the host, after the device's queued work (its pages
    /// move to the host as the writes touch them).
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        check_range("managed memory", offset, src.len(), self.len())?;
        self.buf.gpu().synchronize()?;
        let dst = (self.buf.device_addr() as *mut u8).wrapping_add(offset);
        // SAFETY: managed memory is reachable from the host at its device address, and the
        // range lies inside the allocation (checked above), which `self.buf` keeps alive. The
        // device's queued work is done; a kernel launched on a clone of `device()` meanwhile
        // could race these bytes as it could any DMA's, but raw pointer writes form no Rust
        // reference that it could change under.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }
}
