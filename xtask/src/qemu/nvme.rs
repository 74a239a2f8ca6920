//! `cargo xtask qemu-nvme`: the NVMe driver against a real controller, QEMU's emulated NVMe
//! with two namespaces, on a q35 machine with an emulated Intel IOMMU, in three phases:
//!
//! 1. Under the kernel's NVMe driver: namespace 2 gets an ext4 file system and a test writes a
//!    file there and records its extents; fio fills the first 16 MiB of namespace 1 (a copy
//!    of what it wrote is kept) and times random 4 KiB reads of it.
//! 2. The controller handed to gpuio's kernel module (`cargo xtask kmod` builds it for the
//!    guest's kernel): the driver opened by PCI address reads back what fio wrote and times the
//!    same random reads; the module's own tests; then `nvme://` as LocalIO sees it and as
//!    `gpuio cp` uses it.
//! 3. The controller handed to vfio-pci: the rest of gpuio-nvme's tests (cargo feature
//!    `vfio`), among them reading the ext4 file through its extents, and `nvme://` again.
//!
//! All with `GPUIO_REQUIRE_NVME=1`. Under TCG: functional, not a performance measurement.

use super::{Guest, QEMU_PACKAGES};
use crate::ci::ensure_packages;
use std::path::Path;

/// Kernel modules the guest needs: vfio-pci and the IOMMU type-1 backend; the kernel's NVMe
/// driver and ext4, for the file whose extents the driver then reads; vgem, a dma-buf exporter
/// with no hardware, for the kernel module's imports (Tier 2's path, with a stand-in for a
/// GPU's memory).
const GUEST_MODULES: &[&str] = &[
    "vfio_iommu_type1",
    "vfio_pci",
    "nvme",
    "crc32c_generic",
    "ext4",
    "vgem",
];

/// Where the guest keeps the extent list between the phases.
const EXTENTS: &str = "/tmp/extents";

/// The namespaces' sizes in MiB.
const NAMESPACES: [u64; 2] = [64, 32];

/// The crates whose test binaries run in the guest, and the features they are built with.
const CRATES: &[&str] = &["gpuio-nvme", "gpuio-transport-localio", "gpuio-cli"];
const FEATURES: &str = "gpuio-nvme/vfio,gpuio-transport-localio/nvme-vfio,gpuio-cli/nvme-vfio";

/// Under the kernel's driver: fio writes 16 MiB of namespace 1 (kept as /tmp/ns1.img), then
/// times random 4 KiB reads of it, 64 in flight.
const FIO: &str = "fio --thread --name=fill --filename=/dev/nvme0n1 --rw=write --bs=1M --size=16M \
     --direct=1 --ioengine=psync --refill_buffers --randseed=7 > /tmp/fio-fill.log 2>&1 \
     || { cat /tmp/fio-fill.log; echo 'QEMU-FAIL fio fill'; }\n\
     dd if=/dev/nvme0n1 of=/tmp/ns1.img bs=1M count=16 2>/dev/null || echo 'QEMU-FAIL dd'\n\
     fio --thread --name=randread --filename=/dev/nvme0n1 --rw=randread --bs=4k --size=16M \
     --direct=1 --ioengine=io_uring --iodepth=64 --runtime=3 --time_based --minimal \
     > /tmp/fio.terse 2>&1 || { cat /tmp/fio.terse; echo 'QEMU-FAIL fio randread'; }";

pub fn qemu_nvme() -> crate::Result {
    ensure_packages(&[QEMU_PACKAGES, &["e2fsprogs", "fio"]].concat())?;
    let kmod = crate::kmod::build(None)?;
    let mut guest = Guest::new("qemu-nvme")?;
    guest.modules(GUEST_MODULES)?;
    guest.module_file(&kmod)?;
    guest.file(Path::new("/usr/sbin/mke2fs"))?;
    guest.file(Path::new("/etc/mke2fs.conf"))?;
    guest.file(Path::new("/usr/bin/fio"))?;
    let tests = guest.build_tests(CRATES, FEATURES)?;
    let of = |krate: &str| format!("{krate}--it");
    let (hal, localio, cli) = (
        &of("gpuio-nvme"),
        &of("gpuio-transport-localio"),
        &of("gpuio-cli"),
    );
    if let Some(missing) = [hal, localio, cli].into_iter().find(|t| !tests.contains(t)) {
        return Err(format!("no test binary {missing} among {tests:?}"));
    }
    let gpuio = crate::build_binary("gpuio-cli", "gpuio", "gpuio-cli/nvme-vfio")?;
    guest.program(&gpuio, "gpuio")?;
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
    // Phase 1, the kernel's driver: ext4 on namespace 2, a file written there and its extents
    // recorded (FIEMAP), then unmounted; fio on namespace 1.
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
    guest.shell(FIO);
    // Phase 2, gpuio's kernel module: what fio wrote, read back and timed first (the tests
    // after it write namespace 1), then the module's tests, then nvme:// through it.
    guest.shell(&format!("umount /mnt\n{}", bind("gpuio_nvme")));
    guest.shell("for i in $(seq 50); do [ -c /dev/gpuio-nvme0 ] && break; sleep 0.1; done");
    let address = "GPUIO_REQUIRE_NVME=1 GPUIO_NVME_ADDRESS=$(cat /tmp/nvme-address)";
    guest.run_tests(
        hal,
        &["nvme::fio::", "--nocapture"],
        &format!("{address} GPUIO_NVME_FIO_IMAGE=/tmp/ns1.img GPUIO_NVME_FIO_TERSE=/tmp/fio.terse"),
        true,
    )?;
    guest.run_tests(hal, &["nvme::kmod::"], "GPUIO_REQUIRE_NVME=1", false)?;
    let nvme_uris = |guest: &mut Guest| -> crate::Result {
        guest.run_tests(localio, &["nvme::a_real_controller"], address, false)?;
        guest.run_tests(
            cli,
            &["nvme::"],
            &format!("{address} GPUIO_BIN=/tests/gpuio"),
            false,
        )
    };
    nvme_uris(&mut guest)?;
    // Phase 3, vfio-pci: every other NVMe test, and nvme:// through it.
    guest.shell(&bind("vfio-pci"));
    guest.run_tests(
        hal,
        &["nvme::", "--skip", "nvme::kmod::"],
        &format!("GPUIO_REQUIRE_NVME=1 GPUIO_NVME_EXTENTS={EXTENTS}"),
        false,
    )?;
    nvme_uris(&mut guest)?;
    let total = guest.boot(&qemu, "intel_iommu=on iommu=pt")?;
    println!(
        "qemu-nvme: {total} NVMe tests passed against QEMU's NVMe (ext4 and fio, gpuio_nvme, \
         vfio-pci)"
    );
    Ok(())
}

/// Shell that hands every NVMe controller (class 0x010802) to `driver`, and writes the last
/// one's PCI address to /tmp/nvme-address.
fn bind(driver: &str) -> String {
    format!(
        "for d in /sys/bus/pci/devices/*; do\n\
           if [ \"$(cat $d/class)\" = 0x010802 ]; then\n\
             [ -e $d/driver ] && echo ${{d##*/}} > $d/driver/unbind\n\
             echo {driver} > $d/driver_override; echo ${{d##*/}} > /sys/bus/pci/drivers_probe\n\
             echo \"bound ${{d##*/}} to $(basename $(readlink $d/driver))\"\n\
             echo ${{d##*/}} > /tmp/nvme-address\n\
           fi\n\
         done"
    )
}
