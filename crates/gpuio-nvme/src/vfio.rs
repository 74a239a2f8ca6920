//! NVMe controllers bound to `vfio-pci` (cargo feature `vfio`): the device opened through
//! its IOMMU group (rust-vmm's `vfio-ioctls`), bus mastering turned on in its configuration
//! space, BAR0 mapped for the registers and doorbells, and DMA memory mapped into the
//! container's IO address space. What cannot be done here is said, with the reason.

use super::controller::{Controller, ControllerOptions};
use super::dma::{DmaMapper, DmaMemory, IovaSpace, Mmio};
use gpuio_hal::error::{HalError, Result};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;
use vfio_ioctls::{VfioContainer, VfioDevice, VfioOps};

/// `VFIO_PCI_BAR0_REGION_INDEX`.
const BAR0: u32 = 0;
/// `VFIO_PCI_CONFIG_REGION_INDEX`.
const CONFIG: u32 = 7;
/// `VFIO_REGION_INFO_FLAG_MMAP`.
const REGION_MMAP: u32 = 1 << 2;
/// PCI command register: memory space and bus master enable.
const PCI_COMMAND: u64 = 4;
const COMMAND_MEMORY_AND_MASTER: u16 = 0x2 | 0x4;

/// Opens the NVMe controller at PCI address `pci` (e.g. `0000:00:04.0`), which must be bound
/// to `vfio-pci`, and enables it.
pub fn open(pci: &str, options: ControllerOptions) -> Result<Controller> {
    let path = Path::new("/sys/bus/pci/devices").join(pci);
    check_bound(&path, pci)?;
    let container = Arc::new(VfioContainer::new(None).map_err(|e| vfio("open /dev/vfio/vfio", e))?);
    let ops: Arc<dyn VfioOps> = container.clone();
    let device = VfioDevice::new(&path, ops, false).map_err(|e| vfio("open the VFIO device", e))?;
    let mut command = [0u8; 2];
    device.region_read(CONFIG, &mut command, PCI_COMMAND);
    let command = u16::from_le_bytes(command) | COMMAND_MEMORY_AND_MASTER;
    device.region_write(CONFIG, &command.to_le_bytes(), PCI_COMMAND);
    let (offset, size) = (device.get_region_offset(BAR0), device.get_region_size(BAR0));
    if device.get_region_flags(BAR0) & REGION_MMAP == 0 || size < 0x2000 {
        return Err(HalError::NvmeController {
            reason: format!("{pci}: BAR0 ({size} bytes) cannot be mapped through VFIO"),
        });
    }
    let len = usize::try_from(size).map_err(|_| HalError::NvmeController {
        reason: format!("{pci}: BAR0 is {size} bytes"),
    })?;
    let base = gpuio_hal::sys::map_shared(device.as_raw_fd(), offset, len)?;
    let bar = Arc::new(Bar {
        base,
        len,
        _device: device,
    });
    // SAFETY: the BAR stays mapped until `Bar` drops, which the register file's owner handle
    // keeps alive; register accesses are 32-bit volatile ones, and nothing references it.
    let regs = unsafe { Mmio::new(base, len, true, bar) };
    let mapper = Arc::new(VfioMapper {
        container,
        // From 4 GiB up: below lie the x86 MSI window (0xfee00000) and other ranges IOMMUs
        // reserve; 2^39 is the smallest IOMMU address width.
        space: IovaSpace::new(1 << 32, 1 << 39),
    });
    Controller::enable(regs, mapper, options)
}

/// The PCI addresses of NVMe controllers bound to `vfio-pci` on this machine.
pub fn bound_controllers() -> Vec<String> {
    super::tiers::pci_controllers()
        .into_iter()
        .filter(|c| c.driver.as_deref() == Some("vfio-pci"))
        .map(|c| c.address)
        .collect()
}

fn check_bound(path: &Path, pci: &str) -> Result<()> {
    if !path.exists() {
        return Err(HalError::NvmeController {
            reason: format!("no PCI device {pci}"),
        });
    }
    let driver = std::fs::read_link(path.join("driver"))
        .ok()
        .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()));
    match driver {
        Some(d) if d == "vfio-pci" => Ok(()),
        other => Err(HalError::NvmeController {
            reason: format!(
                "{pci} is bound to {}, not vfio-pci (echo vfio-pci > {}/driver_override, \
                 then unbind it and write {pci} to /sys/bus/pci/drivers_probe)",
                other.as_deref().unwrap_or("no driver"),
                path.display()
            ),
        }),
    }
}

fn vfio(op: &str, e: vfio_ioctls::VfioError) -> HalError {
    HalError::NvmeController {
        reason: format!("{op}: {e}"),
    }
}

/// A mapped BAR0 and the device it belongs to (unmapped before the device closes).
struct Bar {
    base: NonNull<u8>,
    len: usize,
    _device: VfioDevice,
}

// SAFETY: the mapping is only reached through `Mmio`'s volatile accesses; the device handle is
// a file descriptor.
unsafe impl Send for Bar {}
// SAFETY: as above.
unsafe impl Sync for Bar {}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: the mapping `open` made, released once, after every `Mmio` over it is gone
        // (they hold this owner).
        unsafe { gpuio_hal::sys::unmap(self.base, self.len) };
    }
}

/// DMA mappings in the VFIO container's IO address space.
struct VfioMapper {
    container: Arc<VfioContainer>,
    space: IovaSpace,
}

impl DmaMapper for VfioMapper {
    unsafe fn map(&self, mem: &DmaMemory) -> Result<u64> {
        let iova = self.space.take(mem.len())?;
        // SAFETY: `DmaMemory` is never referenced by Rust (only raw copies and volatile
        // accesses), which is what the mapping requires while it lasts; the caller keeps it
        // allocated until it is unmapped (this function's contract).
        unsafe { self.container.vfio_dma_map(iova, mem.len(), mem.addr(0)) }
            .map_err(|e| vfio("map DMA memory", e))?;
        Ok(iova)
    }

    fn unmap(&self, iova: u64, len: usize) {
        if let Err(e) = self.container.vfio_dma_unmap(iova, len) {
            tracing::warn!(iova, len, error = %e, "VFIO DMA unmap failed");
        }
    }
}
