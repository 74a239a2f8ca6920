//! The memory vocabulary every gpuio layer shares (docs/REFERENCE.md#memory-regions): where a
//! region lives, how long it is, and whether it is registered for DMA; plus the host buffer
//! type and its range-locked shared form ([`SharedHostBuffer`]) and NUMA topology. The pinned
//! staging pool the transports draw their staging buffers from is the gpuio-staging crate,
//! over [`HostBuffer`] (docs/REFERENCE.md#staging-pool).

pub mod backing;
mod host;
pub mod mapped;
pub mod numa;
mod shared;

pub use host::{BufferInfo, HostAllocOptions, HostBuffer, MappingHold};
use serde::Serialize;
pub use shared::{
    HostRead, HostWrite, RangeGuard, RangeRead, RangeWrite, SharedHostBuffer, WholeGuard,
};
use std::fmt;

/// Which kind of host memory a region is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
pub enum MemoryTier {
    /// Ordinary DRAM of a CPU socket.
    #[default]
    Dram,
    /// A CXL memory expander: host memory on a NUMA node without CPUs.
    Cxl,
}

/// Where a memory region lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Location {
    /// Memory of GPU `gpu` (for the host backend: host memory standing in for it).
    Device {
        /// The GPU's ordinal.
        gpu: u32,
    },
    /// Host memory, optionally bound to one NUMA node.
    Host {
        /// The NUMA node its pages are bound to, if any.
        numa: Option<u32>,
        /// DRAM or CXL.
        tier: MemoryTier,
    },
}

impl Location {
    /// Host DRAM with no NUMA binding.
    pub const HOST: Self = Self::Host {
        numa: None,
        tier: MemoryTier::Dram,
    };

    /// Whether this is GPU memory.
    pub fn is_device(&self) -> bool {
        matches!(self, Self::Device { .. })
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Device { gpu } => write!(f, "gpu{gpu}"),
            Self::Host { numa, tier } => {
                let tier = match tier {
                    MemoryTier::Dram => "dram",
                    MemoryTier::Cxl => "cxl",
                };
                match numa {
                    Some(n) => write!(f, "host {tier} (NUMA node {n})"),
                    None => write!(f, "host {tier}"),
                }
            }
        }
    }
}

/// Whether a host region is registered (page-locked and mapped) for device DMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
pub enum DmaRegistration {
    /// Pageable memory: a DMA must go through a bounce buffer.
    #[default]
    Pageable,
    /// Pinned and registered with the GPU driver: DMA reads and writes it directly, and kernels
    /// can load and store it through its device mapping.
    Pinned,
}

/// A description of a memory region: `gpuio_memory_region_t` as plain data. Owned buffer
/// types ([`HostBuffer`], [`crate::DeviceBuffer`]) describe themselves with one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryRegion {
    /// Where the bytes live.
    pub location: Location,
    /// Start address: a host virtual address, or a device address for GPU memory.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// Registration state (always [`DmaRegistration::Pinned`] for device memory).
    pub registration: DmaRegistration,
}

impl MemoryRegion {
    /// The sub-region `offset..offset+len`, if it lies inside this one.
    pub fn slice(&self, offset: usize, len: usize) -> Option<Self> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| Self {
            addr: self.addr.wrapping_add(offset as u64),
            len,
            ..*self
        })
    }

    /// Whether `other` starts exactly where this region ends, in the same place.
    pub fn is_followed_by(&self, other: &Self) -> bool {
        self.location == other.location
            && self.addr.checked_add(self.len as u64) == Some(other.addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_slice_and_abut() {
        let r = MemoryRegion {
            location: Location::Device { gpu: 0 },
            addr: 0x1000,
            len: 100,
            registration: DmaRegistration::Pinned,
        };
        let a = r.slice(0, 40).unwrap();
        let b = r.slice(40, 60).unwrap();
        assert!(a.is_followed_by(&b));
        assert!(!b.is_followed_by(&a));
        assert!(r.slice(50, 51).is_none());
        assert!(r.slice(usize::MAX, 2).is_none());
        assert_eq!(Location::Device { gpu: 3 }.to_string(), "gpu3");
    }
}
