//! What an NVMe controller writes that the driver parses: the CAP register, the Identify
//! Controller and Identify Namespace pages, and completion status words.
//!
//! What must hold: any bytes decode (these structures have no invalid encodings the driver
//! cannot describe), the values the driver derives from them are within the bounds it relies
//! on (the largest transfer, a namespace's block size and capacity), and CAP encodes back to
//! the register it was read from wherever its fields are in range.

use crate::Target;
use gpuio_nvme::spec::{Cqe, PAGE};
use gpuio_nvme::{Cap, ControllerIdentity, NamespaceIdentity};

pub const TARGET: Target = Target {
    name: "nvme",
    parses: "NVMe CAP, Identify Controller and Identify Namespace pages, completion status",
    sources: &["crates/gpuio-nvme/src/spec.rs"],
    run,
    seeds,
};

fn run(data: &[u8]) {
    let mut page = [0u8; PAGE];
    let n = data.len().min(PAGE);
    page[..n].copy_from_slice(&data[..n]);

    let c = ControllerIdentity::parse(&page);
    if let Some(max) = c.max_transfer() {
        assert!((PAGE..=PAGE << 20).contains(&max), "{c:?}: {max}");
    }
    for text in [&c.serial, &c.model, &c.firmware] {
        assert!(text.len() <= 3 * 40, "{c:?}");
    }
    if let Some(ns) = NamespaceIdentity::parse(&page) {
        assert!(ns.block_size.is_power_of_two() && (512..=65536).contains(&ns.block_size));
        assert!(ns.blocks > 0);
        let _ = ns.bytes();
    }

    let raw = u64::from_le_bytes(page[..8].try_into().expect("8 bytes"));
    let cap = Cap::from_raw(raw);
    assert!(cap.max_queue_entries >= 1 && cap.max_queue_entries <= 65536);
    let again = Cap::from_raw(cap.to_raw());
    assert_eq!(again, cap, "CAP {raw:#x}");

    let cqe = Cqe {
        result: u32::from_le_bytes(page[8..12].try_into().expect("4 bytes")),
        rsvd: 0,
        sq_head: u16::from_le_bytes([page[12], page[13]]),
        sq_id: 0,
        cid: u16::from_le_bytes([page[14], page[15]]),
        status: u16::from_le_bytes([page[16], page[17]]),
    };
    let status = cqe.status();
    let _ = (status.is_success(), status.to_string(), cqe.phase());
}

/// A real controller's pages: the software controller's Identify answers.
fn seeds() -> Vec<Vec<u8>> {
    let mut id = vec![0u8; PAGE];
    id[0..2].copy_from_slice(&0x1b36u16.to_le_bytes());
    id[4..24].copy_from_slice(b"gpuio-soft-0001     ");
    id[24..64].copy_from_slice(&[b'm'; 40]);
    id[77] = 5;
    id[516..520].copy_from_slice(&1u32.to_le_bytes());
    let mut ns = vec![0u8; PAGE];
    ns[0..8].copy_from_slice(&16384u64.to_le_bytes());
    ns[128 + 2] = 9;
    let cap = 0x0040_0020_0f01_07ffu64.to_le_bytes().to_vec();
    vec![id, ns, cap]
}
