//! `cargo xtask qemu-nvme`: the NVMe driver against a real controller, QEMU's emulated NVMe
//! with two namespaces, on a q35 machine with an emulated Intel IOMMU. The guest binds the
//! controller to vfio-pci and runs gpuio-hal's NVMe tests (cargo feature `nvme-vfio`) with
//! `GPUIO_REQUIRE_NVME=1`: under TCG, so functional, not a performance measurement.

use super::{Guest, QEMU_PACKAGES};
use crate::ci::ensure_packages;

/// Kernel modules the guest needs: vfio-pci and the IOMMU type-1 backend.
const GUEST_MODULES: &[&str] = &["vfio_iommu_type1", "vfio_pci"];

/// The namespaces' sizes in MiB.
const NAMESPACES: [u64; 2] = [64, 32];

pub fn qemu_nvme() -> crate::Result {
    ensure_packages(QEMU_PACKAGES)?;
    let mut guest = Guest::new("qemu-nvme")?;
    guest.modules(GUEST_MODULES)?;
    guest.tests(
        &["gpuio-hal"],
        "gpuio-hal/nvme-vfio",
        "nvme::",
        "GPUIO_REQUIRE_NVME=1",
    )?;
    let mut qemu: Vec<String> = [
        "-M",
        "q35",
        "-device",
        "intel-iommu,intremap=on",
        "-device",
        "nvme,id=nvme0,serial=gpuio-qemu-01",
    ]
    .map(String::from)
    .to_vec();
    for (i, mib) in NAMESPACES.iter().enumerate() {
        let image = guest.work().join(format!("ns{}.img", i + 1));
        let file =
            std::fs::File::create(&image).map_err(|e| format!("{}: {e}", image.display()))?;
        file.set_len(mib << 20)
            .map_err(|e| format!("{}: {e}", image.display()))?;
        qemu.push("-drive".into());
        qemu.push(format!(
            "file={},if=none,id=ns{n},format=raw",
            image.display(),
            n = i + 1
        ));
        qemu.push("-device".into());
        qemu.push(format!("nvme-ns,drive=ns{n},bus=nvme0,nsid={n}", n = i + 1));
    }
    // Bind every NVMe controller (class 0x010802) to vfio-pci.
    let setup = "for d in /sys/bus/pci/devices/*; do\n\
                   if [ \"$(cat $d/class)\" = 0x010802 ]; then\n\
                     echo vfio-pci > $d/driver_override; echo ${d##*/} > /sys/bus/pci/drivers_probe\n\
                     echo \"bound ${d##*/} to $(basename $(readlink $d/driver)), IOMMU group $(basename $(readlink $d/iommu_group))\"\n\
                   fi\n\
                 done; ls /dev/vfio";
    let total = guest.boot(setup, &qemu, "intel_iommu=on iommu=pt")?;
    println!("qemu-nvme: {total} NVMe tests passed against QEMU's NVMe through VFIO");
    Ok(())
}
