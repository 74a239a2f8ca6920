//! The NVMe driver against two controllers: the software controller (everywhere, with
//! injected faults) and, with the `vfio` feature, a real controller bound to vfio-pci
//! (QEMU's emulated NVMe behind an emulated IOMMU in `cargo xtask qemu-nvme`'s guest; skipped
//! with a reason where none is bound, unless `GPUIO_REQUIRE_NVME=1`). The same checks run
//! against both: bring-up and Identify, random-LBA writes and reads on several queue pairs at
//! once (PRP lists, unaligned buffer offsets, transfers split at the controller's limit),
//! out-of-range LBAs and bad arguments as typed errors, and a disabled controller.

use gpuio_hal::{ErrorCode, HalError, pattern};
use gpuio_nvme::ops as nvme_kernels;
use gpuio_nvme::{
    BlockIo, Controller, ControllerOptions, Namespace, SoftConfig, SoftController, SoftFaults,
    Status,
};
use std::time::{Duration, Instant};

fn soft(config: SoftConfig) -> (SoftController, Controller) {
    let dev = SoftController::start(config).unwrap();
    let ctrl =
        Controller::enable(dev.registers(), dev.mapper(), ControllerOptions::default()).unwrap();
    (dev, ctrl)
}

/// Identify: the namespaces are there and have sane formats.
fn check_bring_up(ctrl: &Controller, namespaces: usize) -> Vec<Namespace> {
    assert!(ctrl.is_ready());
    assert_eq!(ctrl.namespaces().len(), namespaces, "{:?}", ctrl.identity());
    assert!(!ctrl.identity().serial.is_empty());
    ctrl.namespaces()
        .iter()
        .map(|&n| {
            let ns = ctrl.namespace(n).unwrap();
            assert!(ns.identity.blocks > 0 && ns.identity.block_size >= 512);
            ns
        })
        .collect()
}

/// `threads` threads, each with its own queue pair and its own quarter of the namespace's
/// first `span` blocks, write and read random block ranges (up to 600 KiB, so PRP lists and
/// splitting at MDTS are exercised) from random dword-aligned buffer offsets; every read is
/// checked against what that thread wrote.
fn check_random_io(ctrl: &Controller, ns: &Namespace, threads: u64, rounds: usize) {
    let bs = ns.identity.block_size as usize;
    let span = ns.identity.blocks.min(((16 << 20) / bs) as u64);
    let share = span / threads;
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut qp = ctrl.io_queue_pair(32).unwrap();
                let max_blocks = ((600 << 10) / bs).min(share as usize);
                let buf = ctrl.dma_buffer(max_blocks * bs + 4096).unwrap();
                let mut model = vec![0u8; share as usize * bs];
                let mut written = vec![false; share as usize];
                let mut seed = 0x9e37_79b9 ^ t;
                for round in 0..rounds {
                    seed = pattern::mix64(seed + round as u64);
                    let blocks = 1 + (seed % max_blocks as u64) as usize;
                    let first = (seed >> 20) % (share - blocks as u64 + 1);
                    let offset = ((seed >> 40) % 1024) as usize * 4;
                    let lba = t * share + first;
                    let (from, len) = (first as usize * bs, blocks * bs);
                    if round % 2 == 0 {
                        let mut data = vec![0u8; len];
                        pattern::fill(&mut data, 0, seed);
                        buf.write(offset, &data).unwrap();
                        qp.write(ns, lba, &buf, offset, len).unwrap();
                        model[from..from + len].copy_from_slice(&data);
                        written[first as usize..first as usize + blocks].fill(true);
                    } else {
                        qp.read(ns, lba, &buf, offset, len).unwrap();
                        let mut got = vec![0u8; len];
                        buf.read(offset, &mut got).unwrap();
                        for b in 0..blocks {
                            if written[first as usize + b] {
                                assert_eq!(
                                    got[b * bs..(b + 1) * bs],
                                    model[from + b * bs..from + (b + 1) * bs],
                                    "thread {t}, LBA {}",
                                    lba + b as u64
                                );
                            }
                        }
                    }
                }
                qp.flush(ns).unwrap();
            });
        }
    });
}

/// Out-of-range LBAs are the controller's typed status; malformed requests are refused before
/// they reach it; neither disturbs the queue pair.
fn check_errors(ctrl: &Controller, ns: &Namespace) {
    let bs = ns.identity.block_size as usize;
    let mut qp = ctrl.io_queue_pair(8).unwrap();
    let buf = ctrl.dma_buffer(4 * bs).unwrap();
    let last = ns.identity.blocks - 1;
    let err = qp.read(ns, last, &buf, 0, 2 * bs).unwrap_err();
    match &err {
        HalError::NvmeCommand { status, .. } => {
            assert_eq!(status.code(), Status::LBA_OUT_OF_RANGE)
        }
        other => panic!("expected LBA out of range, got {other}"),
    }
    assert_eq!(err.code(), ErrorCode::InvalidArg);
    assert!(qp.write(ns, u64::MAX - 1, &buf, 0, 2 * bs).is_err());
    let short = qp.read(ns, 0, &buf, 0, bs / 2).unwrap_err();
    assert_eq!(short.code(), ErrorCode::InvalidArg, "{short}");
    let past = qp.read(ns, 0, &buf, buf.len() - 4, bs).unwrap_err();
    assert!(matches!(past, HalError::OutOfRange { .. }), "{past}");
    let unaligned = qp.read(ns, 0, &buf, 2, bs).unwrap_err();
    assert_eq!(unaligned.code(), ErrorCode::InvalidArg, "{unaligned}");
    // The queue pair still works, and the last block is readable.
    qp.read(ns, last, &buf, 0, bs).unwrap();
}

/// After the controller is disabled, commands fail with a typed error, promptly.
fn check_disabled(ctrl: &Controller, ns: &Namespace) {
    let bs = ns.identity.block_size as usize;
    let mut qp = ctrl.io_queue_pair(8).unwrap();
    let buf = ctrl.dma_buffer(bs).unwrap();
    ctrl.disable().unwrap();
    assert!(!ctrl.is_ready());
    let start = Instant::now();
    let err = qp.read(ns, 0, &buf, 0, bs).unwrap_err();
    assert!(
        matches!(err, HalError::NvmeController { .. }),
        "expected a disabled controller, got {err}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn soft_controller_brings_up_and_moves_data() {
    // Three workers serve the queue pairs of the four threads below.
    let (dev, ctrl) = soft(SoftConfig {
        namespaces: vec![32768, 1024],
        io_threads: 3,
        ..SoftConfig::default()
    });
    let nss = check_bring_up(&ctrl, 2);
    assert_eq!(ctrl.identity().model, "gpuio software NVMe controller");
    check_random_io(&ctrl, &nss[0], 4, 60);
    check_random_io(&ctrl, &nss[1], 1, 20);
    check_errors(&ctrl, &nss[0]);
    // What the driver wrote is what the device holds.
    let mut qp = ctrl.io_queue_pair(4).unwrap();
    let buf = ctrl.dma_buffer(8192).unwrap();
    let mut data = vec![0u8; 8192];
    pattern::fill(&mut data, 0, 77);
    buf.write(0, &data).unwrap();
    qp.write(&nss[1], 100, &buf, 0, 8192).unwrap();
    drop(qp);
    let held = dev.namespace_bytes(2).unwrap();
    assert_eq!(&held[100 * 512..100 * 512 + 8192], &data[..]);
    check_disabled(&ctrl, &nss[0]);
}

#[test]
fn soft_controller_splits_at_its_transfer_limit_and_recycles_queues() {
    // MDTS 1: 8 KiB per command, so a 1 MiB read is 128 commands through a 4-entry queue.
    let (dev, ctrl) = soft(SoftConfig {
        mdts: 1,
        block_size: 4096,
        namespaces: vec![1024],
        ..SoftConfig::default()
    });
    let ns = ctrl.namespace(1).unwrap();
    assert_eq!(ns.identity.block_size, 4096);
    let before = dev.served();
    let mut qp = ctrl.io_queue_pair(4).unwrap();
    let buf = ctrl.dma_buffer(1 << 20).unwrap();
    let mut data = vec![0u8; 1 << 20];
    pattern::fill(&mut data, 0, 5);
    buf.write(0, &data).unwrap();
    qp.write(&ns, 7, &buf, 0, 1 << 20).unwrap();
    let back = ctrl.dma_buffer(1 << 20).unwrap();
    qp.read(&ns, 7, &back, 0, 1 << 20).unwrap();
    let mut got = vec![0u8; 1 << 20];
    back.read(0, &mut got).unwrap();
    assert_eq!(pattern::first_mismatch(&got, &data), None);
    assert!(dev.served() - before >= 256, "split into 8 KiB commands");
    drop(qp);
    // Queue identifiers come back when pairs are dropped: far more pairs than identifiers.
    for _ in 0..200 {
        let mut qp = ctrl.io_queue_pair(2).unwrap();
        qp.read(&ns, 0, &back, 0, 4096).unwrap();
    }
    let depth = ctrl.io_queue_pair(5000).unwrap_err();
    assert_eq!(depth.code(), ErrorCode::InvalidArg);

    // A transfer limit below one block: refused, not a loop of empty commands.
    let (_dev, ctrl) = soft(SoftConfig {
        mdts: 1,
        block_size: 65536,
        namespaces: vec![64],
        ..SoftConfig::default()
    });
    let ns = ctrl.namespace(1).unwrap();
    let buf = ctrl.dma_buffer(65536).unwrap();
    let err = ctrl
        .io_queue_pair(4)
        .unwrap()
        .read(&ns, 0, &buf, 0, 65536)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Unsupported, "{err}");
}

#[test]
fn soft_controller_faults_become_typed_errors() {
    let (dev, ctrl) = soft(SoftConfig::default());
    let ns = ctrl.namespace(1).unwrap();
    let mut qp = ctrl.io_queue_pair(16).unwrap();
    let buf = ctrl.dma_buffer(64 << 10).unwrap();
    // Bad blocks: a media error, and only on reads that touch them.
    dev.set_faults(SoftFaults {
        bad_blocks: vec![(1, 100..101)],
        ..SoftFaults::default()
    });
    let err = qp.read(&ns, 96, &buf, 0, 8 * 512).unwrap_err();
    assert!(
        matches!(err, HalError::NvmeCommand { status, .. } if status.code() == Status::UNRECOVERED_READ),
        "{err}"
    );
    assert_eq!(err.code(), ErrorCode::Io);
    qp.read(&ns, 101, &buf, 0, 8 * 512).unwrap();
    // Completions reordered and late: every command still lands on its own identifier.
    dev.set_faults(SoftFaults {
        reorder: 7,
        delay: Duration::from_micros(200),
        ..SoftFaults::default()
    });
    let ops: Vec<BlockIo> = (0..40)
        .map(|i| BlockIo {
            write: true,
            lba: 1000 + 2 * i,
            offset: i as usize * 1024,
            len: 1024,
        })
        .collect();
    let mut data = vec![0u8; 40 * 1024];
    pattern::fill(&mut data, 0, 11);
    buf.write(0, &data).unwrap();
    qp.run(&ns, &buf, &ops).unwrap();
    dev.set_faults(SoftFaults::default());
    let back = ctrl.dma_buffer(64 << 10).unwrap();
    let reads: Vec<BlockIo> = ops.iter().map(|o| BlockIo { write: false, ..*o }).collect();
    qp.run(&ns, &back, &reads).unwrap();
    let mut got = vec![0u8; 40 * 1024];
    back.read(0, &mut got).unwrap();
    assert_eq!(pattern::first_mismatch(&got, &data), None);
    drop(qp);

    // A hung controller: the command times out, and the controller is disabled before the
    // error returns, so nothing can land in the buffer afterwards.
    let opts = ControllerOptions {
        command_timeout: Duration::from_millis(300),
    };
    let hung = Controller::enable(dev.registers(), dev.mapper(), opts).unwrap();
    let mut qp = hung.io_queue_pair(8).unwrap();
    dev.set_faults(SoftFaults {
        hang: true,
        ..SoftFaults::default()
    });
    let err = qp.read(&ns, 0, &buf, 0, 512).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Timeout, "{err}");
    assert!(!hung.is_ready());
    dev.set_faults(SoftFaults::default());
    let err = qp.read(&ns, 0, &buf, 0, 512).unwrap_err();
    assert!(matches!(err, HalError::NvmeController { .. }), "{err}");
    drop((qp, hung));

    // A fatal status: a typed error, and a reset brings the controller back.
    let ctrl =
        Controller::enable(dev.registers(), dev.mapper(), ControllerOptions::default()).unwrap();
    let mut qp = ctrl.io_queue_pair(8).unwrap();
    dev.set_faults(SoftFaults {
        fatal_after: Some(dev.served() + 1),
        ..SoftFaults::default()
    });
    qp.read(&ns, 0, &buf, 0, 512).unwrap();
    let err = qp.read(&ns, 0, &buf, 0, 512).unwrap_err();
    assert!(
        matches!(&err, HalError::NvmeController { reason } if reason.contains("fatal")),
        "{err}"
    );
    drop((qp, ctrl));
    dev.set_faults(SoftFaults::default());
    let ctrl =
        Controller::enable(dev.registers(), dev.mapper(), ControllerOptions::default()).unwrap();
    ctrl.io_queue_pair(8)
        .unwrap()
        .read(&ns, 0, &buf, 0, 512)
        .unwrap();
}

/// A hostile controller: completions for commands not in flight, forged failures, lost
/// completions and forged Identify data are typed errors, never a panic or a hang.
#[test]
fn hostile_controller_data_becomes_typed_errors() {
    use gpuio_nvme::CqeTamper;
    use gpuio_nvme::spec::PAGE;
    let (dev, _) = soft(SoftConfig::default());
    let opts = || ControllerOptions {
        command_timeout: Duration::from_millis(200),
    };
    let ctrl = Controller::enable(dev.registers(), dev.mapper(), opts()).unwrap();
    let ns = ctrl.namespace(1).unwrap();
    let buf = ctrl.dma_buffer(4096).unwrap();
    let fault = |tamper: CqeTamper| {
        dev.set_faults(SoftFaults {
            tamper: vec![tamper],
            ..SoftFaults::default()
        })
    };
    let mut qp = ctrl.io_queue_pair(8).unwrap();
    // Another command's identifier: not in flight, a controller fault.
    fault(CqeTamper {
        cid_xor: 0x40,
        ..CqeTamper::default()
    });
    let err = qp.read(&ns, 0, &buf, 0, 512).unwrap_err();
    assert!(
        matches!(&err, HalError::NvmeController { reason } if reason.contains("not in flight")),
        "{err}"
    );
    // The pair is given up: its commands' completions are unaccounted for. Found by fuzzing:
    // each later read leaked an identifier, until a full queue with nothing in flight panicked.
    for _ in 0..10 {
        let err = qp.read(&ns, 0, &buf, 0, 512).unwrap_err();
        assert!(matches!(err, HalError::NvmeController { .. }), "{err}");
    }
    drop((qp, ctrl));
    // A forged failure is the command's error; the queue pair goes on.
    let ctrl = Controller::enable(dev.registers(), dev.mapper(), opts()).unwrap();
    let mut qp = ctrl.io_queue_pair(8).unwrap();
    fault(CqeTamper {
        status: Some(Status::UNRECOVERED_READ.0),
        ..CqeTamper::default()
    });
    let err = qp.read(&ns, 0, &buf, 0, 512).unwrap_err();
    assert!(matches!(err, HalError::NvmeCommand { .. }), "{err}");
    qp.read(&ns, 0, &buf, 0, 512).unwrap();
    // A lost completion: the command times out and the controller is disabled.
    fault(CqeTamper {
        lose: true,
        ..CqeTamper::default()
    });
    let err = qp.read(&ns, 0, &buf, 0, 512).unwrap_err();
    assert_eq!(err.code(), ErrorCode::Timeout, "{err}");
    assert!(!ctrl.is_ready());
    drop((qp, ctrl));
    // Identify data of the controller's choosing: a namespace whose format has no block size
    // the driver can use reads as not active.
    dev.set_faults(SoftFaults {
        identify: vec![(0, Box::new([0xff; PAGE]))],
        ..SoftFaults::default()
    });
    let ctrl = Controller::enable(dev.registers(), dev.mapper(), opts()).unwrap();
    let err = ctrl.namespace(1).unwrap_err();
    assert!(matches!(err, HalError::InvalidArgument(_)), "{err}");
}

mod kmod;

mod vgem;

#[cfg(feature = "vfio")]
mod vfio;

mod fio;

/// A buffer mapped for one controller is refused by another's queue pairs (its addresses mean
/// nothing, or something else, there), and a misaligned offset is refused before any command
/// of the call goes.
#[test]
fn buffers_belong_to_their_controller() {
    let (_a, ctrl_a) = soft(SoftConfig::default());
    let (b, ctrl_b) = soft(SoftConfig::default());
    let ns = ctrl_b.namespace(1).unwrap();
    let foreign = ctrl_a.dma_buffer(4096).unwrap();
    let mut qp = ctrl_b.io_queue_pair(8).unwrap();
    let e = qp.read(&ns, 0, &foreign, 0, 512).unwrap_err();
    assert!(e.to_string().contains("another NVMe controller"), "{e}");
    let own = ctrl_b.dma_buffer(8192).unwrap();
    own.write(0, &[0xee; 512]).unwrap();
    let served = b.served();
    let ops = [BlockIo::new(true, 0, 0, 512), BlockIo::new(true, 1, 2, 512)];
    assert!(matches!(
        qp.run(&ns, &own, &ops),
        Err(HalError::InvalidArgument(_))
    ));
    assert_eq!(
        b.served(),
        served,
        "a command went before the bad one was refused"
    );
}

/// Only the kernel module imports dma-bufs: the software controller says why it cannot.
#[test]
fn soft_controller_refuses_dmabuf_imports() {
    use std::os::fd::AsFd;
    let (_dev, ctrl) = soft(SoftConfig::default());
    let f = std::fs::File::open("/dev/null").unwrap();
    let e = ctrl.import_dmabuf(f.as_fd()).unwrap_err();
    assert!(matches!(e, HalError::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("kernel module"), "{e}");
}

/// Batches of writes to distinct random slots, then reads of every slot, each batch under a
/// random mix of reordered and late completions: nothing is lost, duplicated or misplaced.
#[test]
fn soft_controller_reordered_batches_lose_nothing() {
    let (dev, ctrl) = soft(SoftConfig::default());
    let ns = ctrl.namespace(1).unwrap();
    let mut qp = ctrl.io_queue_pair(16).unwrap();
    const SLOTS: u64 = 256;
    const SLOT: usize = 4 * 512;
    let buf = ctrl.dma_buffer(SLOTS as usize * SLOT).unwrap();
    let mut model = vec![0u8; SLOTS as usize * SLOT];
    let mut seed = 1u64;
    for round in 0..12 {
        seed = pattern::mix64(seed);
        dev.set_faults(SoftFaults {
            reorder: (seed % 9) as usize,
            delay: Duration::from_micros(if round % 3 == 0 { 30 } else { 0 }),
            ..SoftFaults::default()
        });
        let mut slots: Vec<u64> = (0..SLOTS).collect();
        for i in 0..SLOTS as usize {
            let j = i + (pattern::mix64(seed ^ i as u64) % (SLOTS - i as u64)) as usize;
            slots.swap(i, j);
        }
        let chosen = &slots[..48];
        let writes: Vec<BlockIo> = chosen
            .iter()
            .map(|&s| BlockIo {
                write: true,
                lba: s * 4,
                offset: s as usize * SLOT,
                len: SLOT,
            })
            .collect();
        for &s in chosen {
            let at = s as usize * SLOT;
            pattern::fill(&mut model[at..at + SLOT], 0, seed ^ s);
        }
        buf.write(0, &model).unwrap();
        qp.run(&ns, &buf, &writes).unwrap();
        buf.write(0, &vec![0u8; model.len()]).unwrap();
        let reads: Vec<BlockIo> = (0..SLOTS)
            .map(|s| BlockIo {
                write: false,
                lba: s * 4,
                offset: s as usize * SLOT,
                len: SLOT,
            })
            .collect();
        qp.run(&ns, &buf, &reads).unwrap();
        let mut got = vec![0u8; model.len()];
        buf.read(0, &mut got).unwrap();
        assert_eq!(pattern::first_mismatch(&got, &model), None, "round {round}");
    }
}

mod gpu;
