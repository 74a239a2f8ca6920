//! Another device's memory — a GPU's — that a controller reaches peer-to-peer (Tier 2: data in
//! GPU memory). The device's driver exports the memory as a dma-buf
//! ([`DeviceBuffer::export_dmabuf`](gpuio_hal::DeviceBuffer::export_dmabuf) for CUDA memory); gpuio's
//! kernel module attaches it to the controller with peer-to-peer allowed, pins and maps it, and
//! returns the bus address runs the controller is given in its PRPs. VFIO cannot take a
//! dma-buf into its IO address space, and the software controller has no bus: both refuse.

use super::dma::DmaTarget;
use gpuio_hal::error::{HalError, Result};
use std::any::Any;

/// A dma-buf mapped for one controller: `len` bytes at bus address runs, in order; unmapped,
/// unpinned and detached when dropped. Its bytes are reached only by the controller (and the
/// device that owns the memory), never by the CPU through this type.
pub struct PeerBuffer {
    len: usize,
    /// `(bus address, bytes)`, covering at least `len` bytes.
    runs: Vec<(u64, u64)>,
    /// The run each byte offset starts: `starts[i]` is run `i`'s first offset.
    starts: Vec<usize>,
    /// The mapper (controller) the runs were mapped for.
    mapped_by: usize,
    _release: Box<dyn Any + Send + Sync>,
}

impl PeerBuffer {
    /// A mapping of `len` bytes at `runs`, released by dropping `release`.
    pub(crate) fn new(
        len: usize,
        runs: Vec<(u64, u64)>,
        mapped_by: *const (),
        release: Box<dyn Any + Send + Sync>,
    ) -> Result<Self> {
        let mut starts = Vec::with_capacity(runs.len());
        let mut at = 0usize;
        for &(addr, n) in &runs {
            let n = usize::try_from(n)
                .ok()
                .filter(|&n| n > 0 && addr.checked_add(n as u64).is_some());
            let Some(n) = n else {
                return Err(HalError::NvmeController {
                    reason: format!("a dma-buf mapping has an impossible run at {addr:#x}"),
                });
            };
            starts.push(at);
            at = at.saturating_add(n);
        }
        if at < len {
            return Err(HalError::NvmeController {
                reason: format!("a dma-buf of {len} bytes was mapped as only {at}"),
            });
        }
        Ok(Self {
            len,
            runs,
            starts,
            mapped_by: mapped_by as usize,
            _release: release,
        })
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bus address runs `(address, bytes)` the controller reaches it at, in order.
    pub fn runs(&self) -> &[(u64, u64)] {
        &self.runs
    }
}

impl DmaTarget for PeerBuffer {
    fn target_len(&self) -> usize {
        self.len
    }

    fn bus_run(&self, offset: usize) -> Option<(u64, usize)> {
        if offset >= self.len {
            return None;
        }
        let i = self.starts.partition_point(|&s| s <= offset) - 1;
        let within = offset - self.starts[i];
        let (addr, n) = self.runs[i];
        let left = (n as usize - within).min(self.len - offset);
        Some((addr + within as u64, left))
    }

    fn mapped_by(&self) -> *const () {
        self.mapped_by as *const ()
    }
}

impl std::fmt::Debug for PeerBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerBuffer")
            .field("len", &self.len)
            .field("runs", &self.runs.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_find_their_run_and_what_is_left_of_it() {
        let b = PeerBuffer::new(
            10_000,
            vec![(0x1000, 4096), (0x9000, 8192)],
            std::ptr::null(),
            Box::new(()),
        )
        .unwrap();
        assert_eq!(b.bus_run(0), Some((0x1000, 4096)));
        assert_eq!(b.bus_run(4095), Some((0x1fff, 1)));
        assert_eq!(b.bus_run(4096), Some((0x9000, 10_000 - 4096)));
        assert_eq!(b.bus_run(5000), Some((0x9000 + 904, 5000)));
        assert_eq!(b.bus_run(10_000), None);
        assert!(PeerBuffer::new(10_000, vec![(0, 4096)], std::ptr::null(), Box::new(())).is_err());
        assert!(PeerBuffer::new(1, vec![(u64::MAX, 2)], std::ptr::null(), Box::new(())).is_err());
        assert!(
            PeerBuffer::new(1, vec![(0, 0), (0, 4096)], std::ptr::null(), Box::new(())).is_err()
        );
    }
}
