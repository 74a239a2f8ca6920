//! Which tiers of device-initiated NVMe this machine supports, and why not (`gpuio info`):
//!
//! - Tier 1: queues and data in host memory pinned for the GPU; GPU threads write the
//!   controller's doorbells in its BAR0 (registered with the GPU as IO memory).
//! - Tier 2: data in GPU memory, which the controller reaches peer-to-peer: the GPU's memory
//!   exported as a dma-buf, imported by the kernel module for the controller.
//! - Tier 3: queues in GPU memory as well.
//!
//! Nothing here opens or resets a controller: the report reads sysfs and `/dev`, and what
//! only an attempt can show (registering a BAR with the GPU) is said to be tried when a GPU
//! queue pair is made.

use gpuio_hal::gpu::{Backend, Capability, Gpu};
use std::path::Path;

/// PCI class of an NVMe controller.
const NVME_CLASS: &str = "0x010802";

/// An NVMe controller found on the PCI bus.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PciController {
    /// Its PCI address, e.g. `0000:00:04.0`.
    pub address: String,
    /// The driver bound to it (`nvme`, `vfio-pci`), if any.
    pub driver: Option<String>,
    /// Its IOMMU group, where the machine has an IOMMU.
    pub iommu_group: Option<u32>,
}

/// Every NVMe controller in sysfs, by PCI address.
pub fn pci_controllers() -> Vec<PciController> {
    let root = Path::new("/sys/bus/pci/devices");
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let link_name = |p: &Path| {
        std::fs::read_link(p)
            .ok()
            .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()))
    };
    let mut found: Vec<PciController> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            std::fs::read_to_string(e.path().join("class")).is_ok_and(|c| c.trim() == NVME_CLASS)
        })
        .map(|e| PciController {
            address: e.file_name().to_string_lossy().into_owned(),
            driver: link_name(&e.path().join("driver")),
            iommu_group: link_name(&e.path().join("iommu_group")).and_then(|g| g.parse().ok()),
        })
        .collect();
    found.sort_by(|a, b| a.address.cmp(&b.address));
    found
}

/// Tier 1, 2 and 3 for `gpu`, each available or why not.
pub fn tiers(gpu: &Gpu) -> [(&'static str, Capability); 3] {
    let controllers = pci_controllers();
    // Controllers this driver can open: bound to vfio-pci (with VFIO present) or to gpuio's
    // kernel module.
    let vfio = Path::new("/dev/vfio/vfio").exists();
    let drivable: Vec<PciController> = controllers
        .iter()
        .filter(|c| match c.driver.as_deref() {
            Some("vfio-pci") => vfio,
            Some("gpuio_nvme") => true,
            _ => false,
        })
        .cloned()
        .collect();
    let gpu_side = match gpu.backend() {
        Backend::Host => Err("no CUDA device: GPU threads cannot drive queues".to_string()),
        Backend::Cuda if !gpu.info().can_map_host_memory => {
            Err("this GPU cannot map host memory, where Tier 1 keeps queues and data".into())
        }
        Backend::Cuda => Ok(()),
    };
    let host_side = if controllers.is_empty() {
        Err(
            "no NVMe controller on this machine (the software controller stands in: \
             `gpuio bench nvme`)"
                .to_string(),
        )
    } else if drivable.is_empty() {
        Err(format!(
            "{} NVMe controller(s), none bound to vfio-pci{} or to gpuio_nvme (kmod/): {}",
            controllers.len(),
            if vfio {
                ""
            } else {
                " (no /dev/vfio/vfio: load vfio-pci)"
            },
            describe(&controllers)
        ))
    } else {
        Ok(describe(&drivable))
    };
    let tier1 = match (host_side, gpu_side) {
        (Ok(bound), Ok(())) => Capability::yes(format!(
            "{bound}; its BAR0 is registered with the GPU as IO memory when a GPU queue pair \
             is made (Controller::gpu_queue_pair), which says why where the platform refuses"
        )),
        (Err(h), Ok(())) => Capability::no(h),
        (Ok(_), Err(g)) => Capability::no(g),
        (Err(h), Err(g)) => Capability::no(format!("{h}; {g}")),
    };
    let kmod_bound: Vec<PciController> = drivable
        .iter()
        .filter(|c| c.driver.as_deref() == Some("gpuio_nvme"))
        .cloned()
        .collect();
    let tier2 = match (&tier1, kmod_bound.is_empty(), &gpu.info().dma_buf) {
        (t, _, _) if !t.available => Capability::no(format!("needs Tier 1: {}", t.detail)),
        (_, _, export) if !export.available => Capability::no(format!(
            "GPU memory cannot be exported as a dma-buf: {}",
            export.detail
        )),
        (_, true, _) => Capability::no(
            "only gpuio's kernel module imports a GPU's dma-buf for a controller, and none is \
             bound to it (VFIO maps process memory only)",
        ),
        (_, false, _) => Capability::yes(format!(
            "{}; GPU memory exported as a dma-buf (DeviceBuffer::export_dmabuf) and imported \
             for the controller (Controller::import_dmabuf), whose PCIe path to the GPU decides \
             whether peer-to-peer DMA succeeds",
            describe(&kmod_bound)
        )),
    };
    let tier3 = Capability::no(
        "not built: queues in GPU memory would need the GPU to read the controller's \
         completions from its own memory and the controller to fetch commands from it, which \
         no machine here can try (none has an NVMe beside a GPU)",
    );
    [
        ("Tier 1 (queues and data in pinned host memory)", tier1),
        ("Tier 2 (data in GPU memory, P2P)", tier2),
        ("Tier 3 (queues in GPU memory)", tier3),
    ]
}

fn describe(controllers: &[PciController]) -> String {
    controllers
        .iter()
        .map(|c| {
            format!(
                "{} ({}{})",
                c.address,
                c.driver.as_deref().unwrap_or("no driver"),
                c.iommu_group.map_or_else(
                    || ", no IOMMU group".to_string(),
                    |g| format!(", IOMMU group {g}")
                )
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tier_says_why_on_the_host_backend() {
        let p = gpuio_hal::probe(gpuio_hal::BackendPreference::Host).unwrap();
        let t = tiers(&p.gpus[0]);
        for (name, cap) in &t {
            assert!(!cap.available, "{name}");
            assert!(!cap.detail.is_empty(), "{name}");
        }
        assert!(t[0].1.detail.contains("CUDA") || t[0].1.detail.contains("NVMe"));
    }
}
