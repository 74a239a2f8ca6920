//! `gpuio cp` with `nvme://` URIs: namespaces gpuio's own driver serves. Everywhere: a URI
//! naming no controller fails with the reason. With `GPUIO_NVME_ADDRESS` (set in `cargo xtask
//! qemu-nvme`'s guest while QEMU's NVMe is bound to gpuio_nvme, then to vfio-pci): a file
//! copied onto namespace 1 and back comes out whole, checksums verified; a file larger than
//! the namespace is refused before anything is written.

use crate::common::bin;
use gpuio_testkit::Requirement;
use std::process::{Command, Output};

fn cp(args: &[&str]) -> Output {
    Command::new(bin()).arg("cp").args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Bytes that name their own offset (every 8-byte word is its index, mixed with `seed`).
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len.div_ceil(8) as u64)
        .flat_map(|i| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed).to_le_bytes())
        .take(len)
        .collect()
}

#[test]
fn nvme_uris_without_a_controller_fail_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::write(&src, b"data").unwrap();
    let src = src.to_str().unwrap();
    let o = cp(&["-q", src, "nvme://ffff:ff:1f.7/1"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("no NVMe controller at PCI address ffff:ff:1f.7"),
        "{}",
        text(&o)
    );
    // Nothing is there: NOT_FOUND, not an IO error.
    assert!(text(&o).contains("[GPUIO_ERROR_NOT_FOUND]"), "{}", text(&o));
    let o = cp(&["-q", src, "nvme://not-an-address/1"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("a PCI address"), "{}", text(&o));
}

#[test]
fn cp_onto_a_real_namespace_and_back() {
    let Ok(address) = std::env::var("GPUIO_NVME_ADDRESS") else {
        Requirement::Nvme.missing("GPUIO_NVME_ADDRESS names no controller bound for gpuio");
        return;
    };
    let ns = format!("nvme://{address}/1");
    let dir = tempfile::tempdir().unwrap();
    let (src, back) = (dir.path().join("src"), dir.path().join("back"));
    let data = pattern((3 << 20) + 4321, 0x5eed);
    std::fs::write(&src, &data).unwrap();
    let (src_s, back_s) = (src.to_str().unwrap(), back.to_str().unwrap());
    let o = cp(&["--verify", "--durable", "--window", "1MiB", src_s, &ns]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("verified"), "{}", text(&o));
    // The namespace back into a file: all of it, the copied bytes first.
    let o = cp(&["--verify", &ns, back_s]);
    assert!(o.status.success(), "{}", text(&o));
    let got = std::fs::read(&back).unwrap();
    assert!(got.len() >= data.len(), "{} bytes came back", got.len());
    assert!(
        got[..data.len()] == data[..],
        "the namespace does not hold the file"
    );
    // Larger than the namespace: refused whole.
    let big = dir.path().join("big");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(got.len() as u64 + 4096)
        .unwrap();
    let o = cp(&["-q", big.to_str().unwrap(), &ns]);
    assert!(!o.status.success());
    assert!(text(&o).contains("does not fit"), "{}", text(&o));
    let o = cp(&["-q", &ns, back_s]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        std::fs::read(&back).unwrap()[..data.len()] == data[..],
        "a refused copy wrote"
    );
    // A namespace the controller does not have.
    let o = cp(&["-q", src_s, &format!("nvme://{address}/77")]);
    assert!(!o.status.success());
    assert!(text(&o).contains("77"), "{}", text(&o));
}
