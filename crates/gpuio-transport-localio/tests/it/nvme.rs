//! NVMe namespaces served by gpuio's own driver as LocalIO files (`FileHandle::nvme`): against
//! the software controller everywhere, and (with `GPUIO_NVME_ADDRESS`, in `cargo xtask
//! qemu-nvme`'s guest) against a real controller opened by its PCI address, as `nvme://`
//! URIs are. Byte ranges that cut blocks, writes that share blocks from several threads at
//! once, the namespace's end, durability, read-only handles, and GPU transfers (staged, with
//! checksums) are each checked against a model of the bytes.

use gpuio_hal::{BackendPreference, Gpu, pattern, probe};
use gpuio_nvme::{Controller, ControllerOptions, SoftConfig, SoftController};
use gpuio_testkit::Requirement;
use gpuio_transport_localio::{
    Durability, FileHandle, IoEngine, LocalIo, LocalIoConfig, LocalIoError, NvmeDevice,
};
use std::sync::Arc;

const BLOCK: u64 = 512;
const BLOCKS: u64 = 8192;

fn gpu() -> Gpu {
    probe(BackendPreference::Auto).unwrap().gpus[0].clone()
}

/// Namespace 1 of a software controller (4 MiB of 512-byte blocks, transfers split at 16 KiB).
fn soft_namespace(writable: bool) -> (SoftController, FileHandle) {
    let dev = SoftController::start(SoftConfig {
        namespaces: vec![BLOCKS],
        block_size: BLOCK as u32,
        mdts: 2,
        io_threads: 2,
        ..SoftConfig::default()
    })
    .unwrap();
    let ctrl =
        Controller::enable(dev.registers(), dev.mapper(), ControllerOptions::default()).unwrap();
    let device = NvmeDevice::on(Arc::new(ctrl), 1, "nvme://soft/1".into()).unwrap();
    (dev, FileHandle::nvme(device, writable))
}

/// Writes and reads at offsets and lengths that cut blocks, checked against a model.
fn check_byte_ranges(file: &FileHandle, span: u64, seed: u64) {
    let mut model = vec![0u8; span as usize];
    file.read_exact_at(0, &mut model).unwrap();
    let mut rng = seed;
    for round in 0..60u64 {
        rng = pattern::mix64(rng ^ round);
        let len = (rng % 70_000 + 1) as usize;
        let offset = (rng >> 20) % (span - len as u64);
        let mut data = vec![0u8; len];
        pattern::fill(&mut data, offset, seed ^ round);
        file.write_all_at(offset, &data).unwrap();
        model[offset as usize..offset as usize + len].copy_from_slice(&data);
        // A read of another random range, and of the one just written.
        let r_len = ((rng >> 40) % 90_000 + 1) as usize;
        let r_off = (rng >> 8) % (span - r_len as u64);
        for (o, l) in [(r_off, r_len), (offset, len)] {
            let mut got = vec![0u8; l];
            file.read_exact_at(o, &mut got).unwrap();
            let want = &model[o as usize..o as usize + l];
            assert!(
                got == want,
                "round {round}: {l} bytes at {o} differ from the model"
            );
        }
    }
}

#[test]
fn byte_ranges_that_cut_blocks_read_and_write_exactly() {
    let (_dev, file) = soft_namespace(true);
    assert_eq!(file.len().unwrap(), BLOCK * BLOCKS);
    assert_eq!(file.path().to_str(), Some("nvme://soft/1"));
    check_byte_ranges(&file, BLOCK * BLOCKS, 7);
}

/// Four threads write interleaved 300-byte stripes (neighbours share blocks) at once; each
/// partial block is read, changed and written back whole, so none may undo another's bytes.
#[test]
fn concurrent_writes_sharing_blocks_lose_nothing() {
    let (_dev, file) = soft_namespace(true);
    const STRIPE: usize = 300;
    const STRIPES: usize = 2000;
    for seed in 0..8u64 {
        std::thread::scope(|s| {
            for t in 0..4 {
                let file = &file;
                s.spawn(move || {
                    for k in (t..STRIPES).step_by(4) {
                        let at = (k * STRIPE) as u64;
                        let mut data = vec![0u8; STRIPE];
                        pattern::fill(&mut data, at, seed);
                        file.write_all_at(at, &data).unwrap();
                    }
                });
            }
        });
        let mut got = vec![0u8; STRIPE * STRIPES];
        file.read_exact_at(0, &mut got).unwrap();
        assert_eq!(pattern::first_deviation(&got, 0, seed), None, "seed {seed}");
    }
}

#[test]
fn the_namespace_end_durability_and_read_only_handles() {
    let (dev, file) = soft_namespace(true);
    let end = BLOCK * BLOCKS;
    let mut buf = vec![0u8; 1000];
    // Reads stop at the end; read_exact_at says how short.
    assert_eq!(file.read_at(end - 100, &mut buf).unwrap(), 100);
    assert_eq!(file.read_at(end + 5, &mut buf).unwrap(), 0);
    match file.read_exact_at(end - 100, &mut buf) {
        Err(LocalIoError::UnexpectedEof { wanted, got, .. }) => {
            assert_eq!((wanted, got), (1000, 100))
        }
        other => panic!("expected UnexpectedEof, got {other:?}"),
    }
    // A write past the end is refused whole, and changes nothing.
    let before = dev.namespace_bytes(1).unwrap();
    match file.write_all_at(end - 100, &[0xab; 1000]) {
        Err(LocalIoError::NoSpace { written: 0, .. }) => {}
        other => panic!("expected NoSpace with nothing written, got {other:?}"),
    }
    assert!(matches!(
        file.write_all_at(u64::MAX - 10, &[1; 20]),
        Err(LocalIoError::NoSpace { .. })
    ));
    assert!(
        dev.namespace_bytes(1).unwrap() == before,
        "a refused write changed the namespace"
    );
    // A fixed size; a flush is a command the controller serves.
    assert!(file.set_len(end).is_ok());
    assert!(file.set_len(end + BLOCK).is_err());
    let served = dev.served();
    file.sync_data().unwrap();
    assert!(dev.served() > served, "no FLUSH reached the controller");
    // Read-only handles refuse writes before any command.
    let (_dev2, ro) = soft_namespace(false);
    assert!(matches!(
        ro.write_all_at(0, &[1]),
        Err(LocalIoError::ReadOnly(_))
    ));
    assert!(
        ro.extents(0, 4096).is_err(),
        "a namespace has no file extents"
    );
}

/// To and from device memory: staged through pinned host memory, checksummed, gathered by
/// blocks, durable when asked.
#[test]
fn gpu_transfers_are_staged_and_checksummed() {
    let (_dev, file) = soft_namespace(true);
    let gpu = gpu();
    let io = LocalIo::new(LocalIoConfig {
        checksum: true,
        ..LocalIoConfig::default()
    })
    .unwrap();
    let len = 1_500_001usize;
    let mut data = vec![0u8; len];
    pattern::fill(&mut data, 0, 5);
    let src = gpu.alloc(len + 64).unwrap();
    gpu.stream().unwrap().upload(&data, &src, 64).unwrap();
    let t = io
        .write_from_device(&src, 64, &file, 333, len, Durability::DataSync)
        .unwrap();
    assert_eq!((t.engine, t.bytes), (IoEngine::Nvme, len as u64));
    t.verify_crc32c(crc32c::crc32c(&data)).unwrap();
    let dst = gpu.alloc(len + 7).unwrap();
    let t = io.read_to_device(&file, 333, &dst, 7, len).unwrap();
    assert_eq!(t.engine, IoEngine::Nvme);
    t.verify_crc32c(crc32c::crc32c(&data)).unwrap();
    let mut back = vec![0u8; len];
    gpu.stream().unwrap().download(&dst, 7, &mut back).unwrap();
    assert_eq!(pattern::first_mismatch(&back, &data), None);
    // Blocks gathered from scattered offsets.
    let offsets = [333u64 + 4096 * 100, 333, 333 + 777_777];
    let dst = gpu.alloc(3 * 4096).unwrap();
    io.read_blocks_to_device(&file, &offsets, 4096, &dst, 0)
        .unwrap();
    let mut got = vec![0u8; 3 * 4096];
    gpu.stream().unwrap().download(&dst, 0, &mut got).unwrap();
    for (k, o) in offsets.iter().enumerate() {
        let o = (*o - 333) as usize;
        assert!(
            got[k * 4096..(k + 1) * 4096] == data[o..o + 4096],
            "block {k}"
        );
    }
    // Past the end: a typed error, not a short success.
    let e = io
        .read_to_device(&file, BLOCK * BLOCKS - 10, &dst, 0, 100)
        .unwrap_err();
    assert!(matches!(e, LocalIoError::UnexpectedEof { .. }), "{e}");
}

/// A real controller, by PCI address (`GPUIO_NVME_ADDRESS`, set in the QEMU guest while the
/// controller is bound to vfio-pci or gpuio_nvme): namespace 1 through `NvmeDevice::open`, the
/// path `nvme://` URIs take; the same byte-range checks, then a second open of the same
/// controller shares it.
#[test]
fn a_real_controller_by_its_pci_address() {
    let Ok(address) = std::env::var("GPUIO_NVME_ADDRESS") else {
        Requirement::Nvme.missing("GPUIO_NVME_ADDRESS names no controller bound for gpuio");
        return;
    };
    let file = FileHandle::nvme(NvmeDevice::open(&address, 1).unwrap(), true);
    assert_eq!(file.path().to_string_lossy(), format!("nvme://{address}/1"));
    let span = file.len().unwrap().min(8 << 20);
    check_byte_ranges(&file, span, 11);
    file.sync_data().unwrap();
    let again = FileHandle::nvme(NvmeDevice::open(&address, 1).unwrap(), false);
    assert!(
        again.same_inode(&file).unwrap(),
        "a second open did not share the controller"
    );
    let mut a = vec![0u8; 100_000];
    let mut b = vec![0u8; 100_000];
    file.read_exact_at(12_345, &mut a).unwrap();
    again.read_exact_at(12_345, &mut b).unwrap();
    assert!(a == b);
    let e = NvmeDevice::open(&address, 999).unwrap_err();
    assert!(e.to_string().contains("999"), "{e}");
}
