//! `cargo xtask qemu-nvme`: the NVMe driver against a real controller, QEMU's emulated NVMe
//! with two namespaces, on a q35 machine with an emulated Intel IOMMU. First, under the
//! kernel's NVMe driver, namespace 2 gets an ext4 file system and a test writes a file there
//! and records its extents; the guest unmounts it and hands the controller to gpuio's kernel
//! module (`cargo xtask kmod` builds it for the guest's kernel), whose test drives it through
//! the module's BAR mapping and DMA buffers; then to vfio-pci, for the rest of gpuio-hal's NVMe
//! tests (cargo feature `nvme-vfio`), among them reading that file through its extents. All
//! with `GPUIO_REQUIRE_NVME=1`. Under TCG: functional, not a performance measurement.

use super::{Guest, QEMU_PACKAGES};
use crate::ci::ensure_packages;
use std::path::Path;

/// Kernel modules the guest needs: vfio-pci and the IOMMU type-1 backend; the kernel's NVMe
/// driver and ext4, for the file whose extents the driver then reads.
const GUEST_MODULES: &[&str] = &[
    "vfio_iommu_type1",
    "vfio_pci",
    "nvme",
    "crc32c_generic",
    "ext4",
];

/// Where the guest keeps the extent list between the two phases.
const EXTENTS: &str = "/tmp/extents";

/// The namespaces' sizes in MiB.
const NAMESPACES: [u64; 2] = [64, 32];

pub fn qemu_nvme() -> crate::Result {
    ensure_packages(&[QEMU_PACKAGES, &["e2fsprogs"]].concat())?;
    let kmod = crate::kmod::build(None)?;
    let mut guest = Guest::new("qemu-nvme")?;
    guest.modules(GUEST_MODULES)?;
    guest.module_file(&kmod)?;
    guest.file(Path::new("/usr/sbin/mke2fs"))?;
    guest.file(Path::new("/etc/mke2fs.conf"))?;
    let tests = guest.build_tests(&["gpuio-hal"], "gpuio-hal/nvme-vfio")?;
    let hal = &tests[0];
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
    // With the kernel's driver: ext4 on namespace 2, a file written there and its extents
    // recorded (FIEMAP); then the file system is unmounted.
    guest.shell(
        "for i in $(seq 50); do [ -b /dev/nvme0n2 ] && break; sleep 0.1; done\n\
         mkdir -p /mnt; /usr/sbin/mke2fs -q -t ext4 -F /dev/nvme0n2 && mount -t ext4 /dev/nvme0n2 /mnt \
         || echo 'QEMU-FAIL ext4 on namespace 2'",
    );
    guest.run_tests(
        hal,
        &["nvme::vfio::ext4_file_written_and_its_extents_recorded"],
        &format!("GPUIO_REQUIRE_NVME=1 GPUIO_NVME_EXT4_DIR=/mnt GPUIO_NVME_EXTENTS={EXTENTS}"),
        true,
    )?;
    // Then the controller to gpuio's kernel module, and the driver through it; then to
    // vfio-pci, and every other NVMe test.
    guest.shell(&format!("umount /mnt\n{}", bind("gpuio_nvme")));
    guest.shell("for i in $(seq 50); do [ -c /dev/gpuio-nvme0 ] && break; sleep 0.1; done");
    guest.run_tests(hal, &["nvme::kmod::"], "GPUIO_REQUIRE_NVME=1", false)?;
    guest.shell(&bind("vfio-pci"));
    guest.run_tests(
        hal,
        &["nvme::", "--skip", "nvme::kmod::"],
        &format!("GPUIO_REQUIRE_NVME=1 GPUIO_NVME_EXTENTS={EXTENTS}"),
        false,
    )?;
    let total = guest.boot(&qemu, "intel_iommu=on iommu=pt")?;
    println!(
        "qemu-nvme: {total} NVMe tests passed against QEMU's NVMe (ext4, gpuio_nvme, vfio-pci)"
    );
    Ok(())
}

/// Shell that hands every NVMe controller (class 0x010802) to `driver`.
fn bind(driver: &str) -> String {
    format!(
        "for d in /sys/bus/pci/devices/*; do\n\
           if [ \"$(cat $d/class)\" = 0x010802 ]; then\n\
             [ -e $d/driver ] && echo ${{d##*/}} > $d/driver/unbind\n\
             echo {driver} > $d/driver_override; echo ${{d##*/}} > /sys/bus/pci/drivers_probe\n\
             echo \"bound ${{d##*/}} to $(basename $(readlink $d/driver))\"\n\
           fi\n\
         done"
    )
}
