//! What a device is and can do: `gpuio_device_info_t` (docs/REFERENCE.md#devices), with a reason
//! next to every capability that is missing.

use serde::Serialize;
use std::path::Path;

/// The backend driving a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Backend {
    /// Host memory and CPU code standing in for a GPU.
    Host,
    /// An NVIDIA GPU through the CUDA driver.
    Cuda,
}

impl Backend {
    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Cuda => "cuda",
        }
    }
}

/// Whether something is available, with the reason either way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Capability {
    /// Available or not.
    pub available: bool,
    /// What was found, or why it is missing.
    pub detail: String,
}

impl Capability {
    /// Available, with a note.
    pub fn yes(detail: impl Into<String>) -> Self {
        Self {
            available: true,
            detail: detail.into(),
        }
    }

    /// Missing, with the reason.
    pub fn no(reason: impl Into<String>) -> Self {
        Self {
            available: false,
            detail: reason.into(),
        }
    }
}

/// A PCIe link's negotiated and maximum speed and width, from sysfs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PcieLink {
    /// Negotiated speed, e.g. `32.0 GT/s PCIe`.
    pub speed: String,
    /// Negotiated lane count.
    pub width: u32,
    /// The device's maximum speed.
    pub max_speed: String,
    /// The device's maximum lane count.
    pub max_width: u32,
}

impl PcieLink {
    /// Reads the link of a PCI device by bus id (`0000:3b:00.0`); `None` where sysfs does not
    /// expose it (virtual machines often don't).
    pub fn read(bus_id: &str) -> Option<Self> {
        let dir = Path::new("/sys/bus/pci/devices").join(bus_id.to_ascii_lowercase());
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name))
                .ok()
                .map(|s| s.trim().to_owned())
        };
        Some(Self {
            speed: read("current_link_speed")?,
            width: read("current_link_width")?.parse().ok()?,
            max_speed: read("max_link_speed")?,
            max_width: read("max_link_width")?.parse().ok()?,
        })
    }
}

/// `gpuio_device_info_t`: identity, memory, compute capability, link, and the GDS / GDR /
/// CXL capabilities, each with a reason.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceInfo {
    /// Ordinal within its backend.
    pub ordinal: u32,
    /// The backend.
    pub backend: Backend,
    /// Vendor name.
    pub vendor: String,
    /// Device name.
    pub name: String,
    /// Device memory in bytes.
    pub total_memory: u64,
    /// CUDA compute capability (major, minor).
    pub compute_capability: Option<(u32, u32)>,
    /// Streaming multiprocessors (CPU threads for the host backend).
    pub multiprocessors: u32,
    /// Copy engines that can run concurrently with kernels.
    pub copy_engines: u32,
    /// PCI bus id.
    pub pci_bus_id: Option<String>,
    /// The host NUMA node nearest the device.
    pub numa_node: Option<u32>,
    /// The PCIe link, where sysfs shows it.
    pub pcie: Option<PcieLink>,
    /// Driver version (major, minor).
    pub driver_version: Option<(u32, u32)>,
    /// Kernels can load and store mapped host memory (zero-copy).
    pub can_map_host_memory: bool,
    /// GPUDirect Storage: NVMe DMA straight into device memory.
    pub gds: Capability,
    /// GPUDirect RDMA: NIC DMA straight into device memory.
    pub gdr: Capability,
    /// CXL memory reachable from the device (a CPU-less NUMA node in host memory).
    pub cxl: Capability,
    /// Whether the copy engine can read a file's pages straight from the page cache: a
    /// read-only file mapping registered with the device ([`Gpu::pin_mapping`](crate::Gpu::pin_mapping)).
    pub page_cache_dma: Capability,
    /// Whether device memory can be exported as a dma-buf
    /// ([`DeviceBuffer::export_dmabuf`](crate::DeviceBuffer::export_dmabuf)): what another
    /// device's driver imports to reach it peer-to-peer (NVMe Tier 2).
    pub dma_buf: Capability,
}

/// The NUMA node of a PCI device from sysfs (`-1`, i.e. unknown, becomes `None`).
pub(crate) fn pci_numa_node(bus_id: &str) -> Option<u32> {
    let path = Path::new("/sys/bus/pci/devices")
        .join(bus_id.to_ascii_lowercase())
        .join("numa_node");
    let n: i64 = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
    u32::try_from(n).ok()
}

/// CXL reachability, common to both backends: host memory on a CPU-less NUMA node.
pub(crate) fn cxl_capability(can_map_host_memory: bool) -> Capability {
    let topo = crate::memory::numa::NumaTopology::detect();
    let pools = topo.memory_only_nodes();
    if pools.is_empty() {
        return Capability::no("no CPU-less NUMA node (no CXL memory expander online)");
    }
    let ids: Vec<String> = pools.iter().map(|n| n.id.to_string()).collect();
    if can_map_host_memory {
        Capability::yes(format!("memory-only NUMA node(s) {}", ids.join(",")))
    } else {
        Capability::no(format!(
            "memory-only NUMA node(s) {} present, but the device cannot map host memory",
            ids.join(",")
        ))
    }
}
