//! Opening a controller by its PCI address, through whichever driver holds it: `vfio-pci`
//! (cargo feature `vfio`) or gpuio's kernel module. A controller the kernel's own `nvme`
//! driver holds is refused with how to hand it over: two drivers must never share one.

use super::controller::{Controller, ControllerOptions};
use super::tiers::pci_controllers;
use gpuio_hal::error::{HalError, Result};
use std::path::Path;

/// Opens and enables the NVMe controller at PCI address `address` (`0000:00:04.0`; the domain
/// may be left out), through the driver it is bound to.
pub fn open(address: &str, options: ControllerOptions) -> Result<Controller> {
    let address = full_address(address)?;
    let found = pci_controllers()
        .into_iter()
        .find(|c| c.address == address)
        .ok_or_else(|| HalError::NoSuchNvmeController {
            address: address.clone(),
        })?;
    match found.driver.as_deref() {
        Some("vfio-pci") => open_vfio(&address, options),
        Some("gpuio_nvme") => super::kmod::open(&kmod_device(&address)?, options),
        other => Err(HalError::NvmeController {
            reason: format!(
                "{address} is bound to {}: gpuio drives controllers bound to vfio-pci or to \
                 its kernel module gpuio_nvme (echo vfio-pci > /sys/bus/pci/devices/{address}/\
                 driver_override, unbind it, then echo {address} > /sys/bus/pci/drivers_probe)",
                other.unwrap_or("no driver")
            ),
        }),
    }
}

#[cfg(feature = "vfio")]
fn open_vfio(address: &str, options: ControllerOptions) -> Result<Controller> {
    super::vfio::open(address, options)
}

#[cfg(not(feature = "vfio"))]
fn open_vfio(address: &str, _: ControllerOptions) -> Result<Controller> {
    Err(HalError::Unsupported {
        what: "NVMe controllers bound to vfio-pci",
        reason: format!("{address} is bound to vfio-pci, and gpuio was built without nvme-vfio"),
    })
}

/// `0000:00:04.0` from `00:04.0` or `0000:00:04.0`; anything else is refused, and so is a
/// device above 0x1f or a function above 7 (PCI has no such slots).
pub fn full_address(address: &str) -> Result<String> {
    // Fixed widths keep the domain within 0xffff and the bus within 0xff.
    let hex = |s: &str, n: usize, max: u32| {
        s.len() == n
            && s.bytes().all(|b| b.is_ascii_hexdigit())
            && u32::from_str_radix(s, 16).is_ok_and(|v| v <= max)
    };
    let parts: Vec<&str> = address.split([':', '.']).collect();
    let full = match parts.as_slice() {
        [bus, dev, func] => format!("0000:{bus}:{dev}.{func}"),
        [_, _, _, _] => address.to_string(),
        _ => String::new(),
    };
    match full.split([':', '.']).collect::<Vec<_>>().as_slice() {
        [domain, bus, dev, func]
            if hex(domain, 4, 0xffff)
                && hex(bus, 2, 0xff)
                && hex(dev, 2, 0x1f)
                && hex(func, 1, 7) =>
        {
            Ok(full.to_ascii_lowercase())
        }
        _ => Err(HalError::InvalidArgument(format!(
            "{address:?} is not a PCI address (domain:bus:device.function, e.g. 0000:00:04.0, \
             device at most 1f, function at most 7)"
        ))),
    }
}

/// The kernel module's device file for the controller at `address`: the misc device it
/// registered under that PCI device.
fn kmod_device(address: &str) -> Result<String> {
    let dir = Path::new("/sys/bus/pci/devices").join(address).join("misc");
    std::fs::read_dir(&dir)
        .ok()
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("gpuio-nvme"))
        .map(|n| format!("/dev/{n}"))
        .ok_or_else(|| HalError::NvmeController {
            reason: format!(
                "{address} is bound to gpuio_nvme but has no device under {}",
                dir.display()
            ),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_completed_and_checked() {
        assert_eq!(full_address("00:04.0").unwrap(), "0000:00:04.0");
        assert_eq!(full_address("0000:3B:00.1").unwrap(), "0000:3b:00.1");
        assert_eq!(full_address("FFFF:FF:1F.7").unwrap(), "ffff:ff:1f.7");
        for bad in [
            "",
            "04.0",
            "0000:00:04",
            "00:04.0.1",
            "zz:04.0",
            "0000:00:004.0",
            "../x",
            "0000:00:04.8",
            "00:04.f",
            "0000:00:20.0",
            "00:ff.0",
        ] {
            assert!(full_address(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_controller_that_is_not_there_is_named() {
        let e = open("ffff:ff:1f.7", ControllerOptions::default())
            .err()
            .unwrap();
        // Not there is NOT_FOUND, as for a missing file: nothing failed doing IO.
        assert_eq!(e.code(), gpuio_hal::error::ErrorCode::NotFound, "{e}");
        let e = e.to_string();
        assert!(
            e.contains("no NVMe controller at PCI address ffff:ff:1f.7"),
            "{e}"
        );
    }
}
