//! A controller bound to gpuio's kernel module (`kmod/gpuio_nvme.c`; `cargo xtask qemu-nvme`
//! loads it and binds QEMU's NVMe to it): BAR0 mapped from its device file, queues and data
//! in the DMA-coherent buffers it allocates. Namespace 2 holds the ext4 file a later test
//! reads, so only namespace 1 is written.

use super::*;
use gpuio_testkit::Requirement;

#[test]
fn kmod_controller_brings_up_and_moves_data() {
    let found = gpuio_nvme::kmod::devices();
    let Some(path) = found.first() else {
        Requirement::Nvme.missing("no NVMe controller is bound to gpuio_nvme");
        return;
    };
    let ctrl = gpuio_nvme::kmod::open(path, ControllerOptions::default()).unwrap();
    let again = gpuio_nvme::kmod::open(path, ControllerOptions::default()).unwrap_err();
    assert!(
        again.to_string().contains("busy"),
        "one opener at a time: {again}"
    );
    let nss = check_bring_up(&ctrl, 2);
    check_random_io(&ctrl, &nss[0], 2, 30);
    check_errors(&ctrl, &nss[0]);
    check_disabled(&ctrl, &nss[0]);
}

/// Tier 2's import path: a dma-buf (vgem's: a kernel exporter with no hardware behind
/// it, standing in for a GPU's) imported through the module, and the controller writing
/// from it and reading into it at scattered offsets, in and out of order. Namespace 1
/// from LBA 1000 only.
#[test]
fn kmod_controller_moves_data_through_an_imported_dmabuf() {
    use std::os::fd::AsFd;
    let found = gpuio_nvme::kmod::devices();
    let Some(path) = found.first() else {
        Requirement::Nvme.missing("no NVMe controller is bound to gpuio_nvme");
        return;
    };
    const LEN: usize = 1 << 20;
    let exported = match super::vgem::Buffer::new(LEN) {
        Ok(b) => b,
        Err(why) => {
            Requirement::Nvme.missing(format_args!("no dma-buf exporter: {why}"));
            return;
        }
    };
    let ctrl = gpuio_nvme::kmod::open(path, ControllerOptions::default()).unwrap();
    let ns = ctrl.namespace(1).unwrap();
    let peer = ctrl.import_dmabuf(exported.as_fd()).unwrap();
    eprintln!(
        "imported {} bytes as {} bus address run(s)",
        peer.len(),
        peer.runs().len()
    );
    assert_eq!(peer.len(), LEN);
    let mut qp = ctrl.io_queue_pair(32).unwrap();
    let mut data = vec![0u8; LEN];
    pattern::fill(&mut data, 0, 0x7e2);
    exported.write(0, &data);
    qp.run(&ns, &peer, &[BlockIo::new(true, 1000, 0, LEN)])
        .unwrap();
    let dma = ctrl.dma_buffer(LEN).unwrap();
    qp.read(&ns, 1000, &dma, 0, LEN).unwrap();
    let mut got = vec![0u8; LEN];
    dma.read(0, &mut got).unwrap();
    assert_eq!(
        pattern::first_mismatch(&got, &data),
        None,
        "written from the dma-buf"
    );
    // Reads into it: 8 KiB pieces landing in reverse order of their blocks.
    exported.write(0, &vec![0u8; LEN]);
    const PIECE: usize = 8192;
    let pieces = LEN / PIECE;
    let blocks = (PIECE / ns.identity.block_size as usize) as u64;
    let ops: Vec<BlockIo> = (0..pieces)
        .map(|k| {
            BlockIo::new(
                false,
                1000 + (pieces - 1 - k) as u64 * blocks,
                k * PIECE,
                PIECE,
            )
        })
        .collect();
    qp.run(&ns, &peer, &ops).unwrap();
    let got = exported.read();
    for k in 0..pieces {
        let from = (pieces - 1 - k) * PIECE;
        assert!(
            got[k * PIECE..(k + 1) * PIECE] == data[from..from + PIECE],
            "piece {k}"
        );
    }
    // Past its end, and something that is not a dma-buf: typed errors.
    let e = qp.read(&ns, 1000, &peer, LEN - 512, 1024).unwrap_err();
    assert!(matches!(e, HalError::OutOfRange { .. }), "{e}");
    let not_a_dmabuf = std::fs::File::open("/dev/null").unwrap();
    let e = ctrl.import_dmabuf(not_a_dmabuf.as_fd()).unwrap_err();
    assert!(e.to_string().contains("IMPORT"), "{e}");
    drop(peer);
}
