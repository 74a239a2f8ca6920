//! `cargo xtask qemu-rdma`: the RDMA tests in a QEMU guest with soft-RoCE (rxe): gpuio-rdma's
//! test binary whole, and the test binaries of the crates that reach it through their `rdma`
//! cargo feature filtered to their `rdma` module, with `GPUIO_REQUIRE_RDMA=1`, over a virtio
//! NIC with an rxe device on it.

use super::{Guest, QEMU_PACKAGES};
use crate::ci::{RDMA_PACKAGES, ensure_packages};
use std::path::Path;

/// The RDMA verbs crate: every test of its test binary (`tests/it`) is an RDMA test.
const VERBS_CRATE: &str = "gpuio-rdma";

/// The crates whose test binary (`tests/it`) has an `rdma` module, built with their `rdma`
/// features.
const RDMA_CRATES: &[&str] = &["gpuio-transport-remoteio", "gpuio-api"];

/// Kernel modules the guest needs: virtio networking, then soft-RoCE.
const GUEST_MODULES: &[&str] = &["virtio_pci", "virtio_net", "crc32_generic", "rdma_rxe"];

pub fn qemu_rdma() -> crate::Result {
    ensure_packages(&[RDMA_PACKAGES, QEMU_PACKAGES].concat())?;
    let mut guest = Guest::new("qemu-rdma")?;
    guest.modules(GUEST_MODULES)?;
    let features = RDMA_CRATES
        .iter()
        .map(|c| format!("{c}/rdma"))
        .collect::<Vec<_>>()
        .join(",");
    let setup = "ip link set lo up; ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0\n\
                 rdma link add rxe0 type rxe netdev eth0 || echo 'QEMU-FAIL rxe'";
    guest.shell(setup);
    let crates = [&[VERBS_CRATE], RDMA_CRATES].concat();
    for name in guest.build_tests(&crates, &features)? {
        let whole = name.starts_with(&format!("{VERBS_CRATE}--"));
        let filter: &[&str] = if whole { &[] } else { &["rdma::"] };
        guest.run_tests(&name, filter, "GPUIO_REQUIRE_RDMA=1", false)?;
    }
    guest.file(Path::new("/usr/bin/rdma"))?;
    guest.file(Path::new("/etc/libibverbs.d/rxe.driver"))?;
    guest.file(Path::new(
        "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so",
    ))?;
    let qemu: Vec<String> = [
        "-M",
        "q35",
        "-netdev",
        "user,id=n0",
        "-device",
        "virtio-net-pci,netdev=n0",
    ]
    .map(String::from)
    .to_vec();
    let total = guest.boot(&qemu, "")?;
    println!("qemu-rdma: {total} RDMA tests passed on soft-RoCE");
    Ok(())
}
