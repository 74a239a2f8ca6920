//! Where host memory comes from: DRAM (optionally one NUMA node) or a CXL memory expander,
//! which the kernel shows as a NUMA node with memory and no CPUs.

use crate::{MemIoError, Result};
use gpuio_hal::{HostAllocOptions, MemoryTier, NumaTopology};
use std::fmt;

/// A host memory tier to allocate from: the resource part of `memio://cpu/dram?numa=N` and
/// `memio://cxl/<pool>?device=N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostPlacement {
    /// CPU-attached DRAM, optionally bound to one NUMA node.
    Dram {
        /// The NUMA node, or `None` for the kernel's default policy.
        numa: Option<u32>,
    },
    /// The `device`-th CXL memory expander (the `device`-th memory-only NUMA node, in id
    /// order).
    Cxl {
        /// Which expander.
        device: u32,
    },
}

impl HostPlacement {
    /// Resolves the placement against this machine's topology into allocation options
    /// (huge pages and populate on), or says why it cannot be met.
    pub fn resolve(&self, topo: &NumaTopology) -> Result<HostAllocOptions> {
        match *self {
            Self::Dram { numa } => {
                if let Some(n) = numa {
                    topo.node(n)?;
                }
                Ok(HostAllocOptions {
                    numa,
                    tier: MemoryTier::Dram,
                    ..HostAllocOptions::default()
                })
            }
            Self::Cxl { device } => {
                let pools = topo.memory_only_nodes();
                let node = pools.get(device as usize).ok_or(MemIoError::NoCxlDevice {
                    device,
                    found: pools.len(),
                })?;
                Ok(HostAllocOptions {
                    numa: Some(node.id),
                    tier: MemoryTier::Cxl,
                    ..HostAllocOptions::default()
                })
            }
        }
    }
}

impl fmt::Display for HostPlacement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Dram { numa: None } => write!(f, "memio://cpu/dram"),
            Self::Dram { numa: Some(n) } => write!(f, "memio://cpu/dram?numa={n}"),
            Self::Cxl { device } => write!(f, "memio://cxl/pool?device={device}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuio_hal::NumaNode;

    fn topo() -> NumaTopology {
        NumaTopology {
            nodes: vec![
                NumaNode {
                    id: 0,
                    cpus: vec![0, 1],
                    memory_bytes: 1 << 30,
                },
                NumaNode {
                    id: 2,
                    cpus: vec![],
                    memory_bytes: 1 << 30,
                },
            ],
        }
    }

    #[test]
    fn cxl_devices_are_memory_only_nodes() {
        let o = HostPlacement::Cxl { device: 0 }.resolve(&topo()).unwrap();
        assert_eq!(o.numa, Some(2));
        assert_eq!(o.tier, MemoryTier::Cxl);
        let err = HostPlacement::Cxl { device: 1 }
            .resolve(&topo())
            .unwrap_err();
        assert!(matches!(
            err,
            MemIoError::NoCxlDevice {
                device: 1,
                found: 1
            }
        ));
    }

    #[test]
    fn dram_nodes_must_exist() {
        assert!(
            HostPlacement::Dram { numa: Some(0) }
                .resolve(&topo())
                .is_ok()
        );
        assert!(
            HostPlacement::Dram { numa: Some(1) }
                .resolve(&topo())
                .is_err()
        );
        assert!(HostPlacement::Dram { numa: None }.resolve(&topo()).is_ok());
    }
}
