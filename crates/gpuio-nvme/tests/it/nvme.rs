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

/// A controller bound to gpuio's kernel module (`kmod/gpuio_nvme.c`; `cargo xtask qemu-nvme`
/// loads it and binds QEMU's NVMe to it): BAR0 mapped from its device file, queues and data
/// in the DMA-coherent buffers it allocates. Namespace 2 holds the ext4 file a later test
/// reads, so only namespace 1 is written.
mod kmod {
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
}

/// A dma-buf exporter with no hardware: the kernel's virtual GEM driver (vgem, loaded in
/// `cargo xtask qemu-nvme`'s guest), a dumb buffer exported through PRIME and mapped here.
mod vgem {
    use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

    /// `struct drm_mode_create_dumb`.
    #[repr(C)]
    #[derive(Default)]
    struct CreateDumb {
        height: u32,
        width: u32,
        bpp: u32,
        flags: u32,
        handle: u32,
        pitch: u32,
        size: u64,
    }

    /// `struct drm_prime_handle`.
    #[repr(C)]
    #[derive(Default)]
    struct PrimeHandle {
        handle: u32,
        flags: u32,
        fd: i32,
    }

    /// `DRM_IOWR(0xB2, struct drm_mode_create_dumb)`, `DRM_IOWR(0x2d, struct drm_prime_handle)`.
    const CREATE_DUMB: u64 = 0xc020_64b2;
    const PRIME_HANDLE_TO_FD: u64 = 0xc00c_642d;

    pub struct Buffer {
        _card: std::fs::File,
        dmabuf: OwnedFd,
        map: *mut u8,
        len: usize,
    }

    impl Buffer {
        /// `len` bytes (whole 4 KiB rows), exported and mapped; why not where vgem is absent.
        pub fn new(len: usize) -> Result<Self, String> {
            let card = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/dri/card0")
                .map_err(|e| format!("/dev/dri/card0: {e} (load vgem)"))?;
            let mut create = CreateDumb {
                width: 1024,
                bpp: 32,
                height: (len / 4096) as u32,
                ..CreateDumb::default()
            };
            let ioctl = |request: u64, arg: *mut libc::c_void, what: &str| {
                // SAFETY: each request's argument is the `#[repr(C)]` struct the DRM ioctl
                // reads and writes, living across the call.
                let rc = unsafe { libc::ioctl(card.as_raw_fd(), request as libc::c_ulong, arg) };
                if rc < 0 {
                    return Err(format!("{what}: {}", std::io::Error::last_os_error()));
                }
                Ok(())
            };
            ioctl(
                CREATE_DUMB,
                (&raw mut create).cast(),
                "DRM_IOCTL_MODE_CREATE_DUMB",
            )?;
            let mut prime = PrimeHandle {
                handle: create.handle,
                flags: (libc::O_RDWR | libc::O_CLOEXEC) as u32,
                fd: -1,
            };
            ioctl(
                PRIME_HANDLE_TO_FD,
                (&raw mut prime).cast(),
                "DRM_IOCTL_PRIME_HANDLE_TO_FD",
            )?;
            // SAFETY: the ioctl returned a new descriptor that nothing else owns.
            let dmabuf = unsafe { OwnedFd::from_raw_fd(prime.fd) };
            // SAFETY: a fresh shared mapping of the dma-buf; the kernel picks the address.
            let map = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    dmabuf.as_raw_fd(),
                    0,
                )
            };
            if map == libc::MAP_FAILED {
                return Err(format!(
                    "mmap of the dma-buf: {}",
                    std::io::Error::last_os_error()
                ));
            }
            Ok(Self {
                _card: card,
                dmabuf,
                map: map.cast(),
                len,
            })
        }

        /// Copies `data` in at `offset`.
        pub fn write(&self, offset: usize, data: &[u8]) {
            assert!(offset + data.len() <= self.len);
            // SAFETY: in bounds of the mapping, which lives as long as `self`; no DMA runs
            // while the test writes.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), self.map.add(offset), data.len())
            };
        }

        /// All of its bytes.
        pub fn read(&self) -> Vec<u8> {
            let mut out = vec![0u8; self.len];
            // SAFETY: as in `write`: the whole mapping, read after the DMA completed.
            unsafe { std::ptr::copy_nonoverlapping(self.map, out.as_mut_ptr(), self.len) };
            out
        }
    }

    impl AsFd for Buffer {
        fn as_fd(&self) -> BorrowedFd<'_> {
            self.dmabuf.as_fd()
        }
    }

    impl Drop for Buffer {
        fn drop(&mut self) {
            // SAFETY: the mapping `new` made, unmapped once.
            unsafe { libc::munmap(self.map.cast(), self.len) };
        }
    }
}

#[cfg(feature = "vfio")]
mod vfio {
    use super::*;
    use gpuio_testkit::Requirement;

    /// The first NVMe controller bound to vfio-pci, or why there is none.
    fn controller() -> Option<Controller> {
        let found = gpuio_nvme::vfio::bound_controllers();
        let Some(pci) = found.first() else {
            Requirement::Nvme.missing("no NVMe controller is bound to vfio-pci");
            return None;
        };
        Some(gpuio_nvme::vfio::open(pci, ControllerOptions::default()).unwrap())
    }

    #[test]
    fn vfio_controller_brings_up_and_moves_data() {
        let Some(ctrl) = controller() else { return };
        eprintln!("{:?}, {:?}", ctrl.identity(), ctrl.cap());
        let nss = check_bring_up(&ctrl, 2);
        // Namespace 2 holds the ext4 file the extents test reads: only namespace 1 is written.
        check_random_io(&ctrl, &nss[0], 4, 40);
        check_errors(&ctrl, &nss[0]);
        check_disabled(&ctrl, &nss[0]);
    }

    /// The file the ext4 phase writes: its length and pattern seed.
    const EXT4_FILE_LEN: usize = (3 << 20) + 1234;
    const EXT4_SEED: u64 = 0xe47;

    /// The first phase of `cargo xtask qemu-nvme`, under the kernel's NVMe driver with ext4
    /// mounted on namespace 2 at `GPUIO_NVME_EXT4_DIR`: writes a pattern file and records its
    /// extents at `GPUIO_NVME_EXTENTS`; a sparse file and a preallocated one are refused with
    /// their reasons.
    #[test]
    #[ignore = "run by cargo xtask qemu-nvme while ext4 is mounted, before vfio-pci takes the controller"]
    fn ext4_file_written_and_its_extents_recorded() {
        use gpuio_nvme::FileExtents;
        use std::io::{Seek, SeekFrom, Write};
        use std::os::fd::AsRawFd;
        let (Ok(dir), Ok(out)) = (
            std::env::var("GPUIO_NVME_EXT4_DIR"),
            std::env::var("GPUIO_NVME_EXTENTS"),
        ) else {
            panic!("set GPUIO_NVME_EXT4_DIR and GPUIO_NVME_EXTENTS");
        };
        let dir = std::path::Path::new(&dir);
        let mut data = vec![0u8; EXT4_FILE_LEN];
        pattern::fill(&mut data, 0, EXT4_SEED);
        let path = dir.join("data.bin");
        std::fs::write(&path, &data).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let extents = FileExtents::of(&file).unwrap();
        assert_eq!(extents.len, EXT4_FILE_LEN as u64);
        std::fs::write(&out, extents.to_text()).unwrap();

        let mut sparse = std::fs::File::create(dir.join("sparse.bin")).unwrap();
        sparse.seek(SeekFrom::Start(1 << 20)).unwrap();
        sparse.write_all(&data[..4096]).unwrap();
        let err = FileExtents::of(&sparse).unwrap_err();
        assert!(err.to_string().contains("hole"), "{err}");
        let unwritten = std::fs::File::create(dir.join("unwritten.bin")).unwrap();
        // SAFETY: fallocate on a file this test owns; no memory is involved.
        let rc = unsafe { libc::fallocate(unwritten.as_raw_fd(), 0, 0, 1 << 20) };
        assert_eq!(rc, 0, "fallocate: {}", std::io::Error::last_os_error());
        let err = FileExtents::of(&unwritten).unwrap_err();
        assert!(err.to_string().contains("unwritten"), "{err}");
        // SAFETY: sync has no preconditions.
        unsafe { libc::sync() };
    }

    /// The second phase: with vfio-pci holding the controller, the file is read from
    /// namespace 2 through the extents recorded while ext4 was mounted.
    #[test]
    fn vfio_reads_an_ext4_file_through_its_extents() {
        use gpuio_nvme::FileExtents;
        let Ok(list) = std::env::var("GPUIO_NVME_EXTENTS") else {
            Requirement::Nvme
                .missing("no extent list recorded (cargo xtask qemu-nvme records one)");
            return;
        };
        let Some(ctrl) = controller() else { return };
        let extents = FileExtents::from_text(&std::fs::read_to_string(list).unwrap()).unwrap();
        eprintln!("{} extents", extents.extents.len());
        let ns = ctrl.namespace(2).unwrap();
        let mut qp = ctrl.io_queue_pair(32).unwrap();
        let buf = ctrl.dma_buffer(EXT4_FILE_LEN + 4096).unwrap();
        qp.read_extents(&ns, &extents, &buf).unwrap();
        let mut got = vec![0u8; EXT4_FILE_LEN];
        buf.read(0, &mut got).unwrap();
        assert_eq!(pattern::first_deviation(&got, 0, EXT4_SEED), None);
    }

    #[test]
    fn vfio_refuses_what_is_not_bound() {
        let err = gpuio_nvme::vfio::open("0000:ff:1f.7", ControllerOptions::default())
            .expect_err("no such device");
        assert!(err.to_string().contains("no PCI device"), "{err}");
    }
}

/// The QEMU guest's comparison with fio: under the kernel's NVMe driver, fio filled the first
/// 16 MiB of namespace 1 (`GPUIO_NVME_FIO_IMAGE` holds a copy of what it wrote) and timed
/// random 4 KiB reads of it (`GPUIO_NVME_FIO_TERSE`, its terse output). Then, with the
/// controller handed to gpuio (opened by its PCI address, `GPUIO_NVME_ADDRESS`, through
/// whichever driver holds it), the same region is read whole and by the same random 4 KiB
/// reads, 64 in flight; every byte must be what fio wrote. Both rates are printed, labelled:
/// under TCG they are functional, not performance.
mod fio {
    use super::*;

    const REGION: usize = 16 << 20;
    const CHUNK: usize = 4 << 20;

    #[test]
    #[ignore = "run by cargo xtask qemu-nvme after fio filled namespace 1"]
    fn what_fio_wrote_reads_back_and_random_reads_are_timed_beside_fio() {
        let var = |v: &str| std::env::var(v).unwrap_or_else(|_| panic!("set {v}"));
        let image = std::fs::read(var("GPUIO_NVME_FIO_IMAGE")).unwrap();
        assert_eq!(image.len(), REGION);
        assert!(image.iter().any(|&b| b != 0), "fio wrote nothing");
        let ctrl =
            gpuio_nvme::open(&var("GPUIO_NVME_ADDRESS"), ControllerOptions::default()).unwrap();
        let ns = ctrl.namespace(1).unwrap();
        let block = ns.identity.block_size as usize;
        let mut qp = ctrl.io_queue_pair(64).unwrap();
        let buf = ctrl.dma_buffer(CHUNK).unwrap();
        let mut got = vec![0u8; CHUNK];
        for at in (0..REGION).step_by(CHUNK) {
            qp.read(&ns, (at / block) as u64, &buf, 0, CHUNK).unwrap();
            buf.read(0, &mut got).unwrap();
            assert_eq!(
                pattern::first_mismatch(&got, &image[at..at + CHUNK]),
                None,
                "at {at}"
            );
        }
        const IO: usize = 4096;
        const BATCH: usize = 64;
        let (mut reads, mut seed, mut busy) = (0u64, 3u64, Duration::ZERO);
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(3) {
            let lbas: Vec<u64> = (0..BATCH)
                .map(|_| {
                    seed = pattern::mix64(seed);
                    (seed % (REGION / IO) as u64) * (IO / block) as u64
                })
                .collect();
            let ops: Vec<BlockIo> = (lbas.iter().enumerate())
                .map(|(k, &lba)| BlockIo::new(false, lba, k * IO, IO))
                .collect();
            let t = Instant::now();
            qp.run(&ns, &buf, &ops).unwrap();
            busy += t.elapsed();
            buf.read(0, &mut got[..BATCH * IO]).unwrap();
            for (k, &lba) in lbas.iter().enumerate() {
                let at = lba as usize * block;
                assert!(
                    got[k * IO..(k + 1) * IO] == image[at..at + IO],
                    "read of LBA {lba}"
                );
            }
            reads += BATCH as u64;
        }
        let ours = reads as f64 / busy.as_secs_f64();
        let terse = std::fs::read_to_string(var("GPUIO_NVME_FIO_TERSE")).unwrap();
        let fio: f64 = terse
            .lines()
            .find_map(|l| l.split(';').nth(7)?.parse().ok())
            .unwrap_or_else(|| panic!("no read IOPS in fio's terse output: {terse}"));
        assert!(fio > 0.0, "fio read nothing");
        // Printed past libtest's capture; `cargo xtask qemu-nvme` shows lines marked so.
        eprintln!(
            "QEMU-MEASURED random 4 KiB reads of namespace 1, 64 in flight (QEMU TCG: functional, not \
             performance): gpuio's driver {ours:.0} IOPS, {reads} reads all checked; fio \
             (kernel NVMe driver, io_uring) {fio:.0} IOPS; ratio {:.2}",
            ours / fio
        );
    }
}

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

/// GPU threads drive queue pairs on the software controller (its queues, doorbells and data
/// slots in host memory registered with the GPU: Tier 1): the layouts agree with the device
/// compiler's; checked 4 KiB and 8 KiB reads (PRP2) from four pairs at once, every word
/// compared with the pattern the namespace holds; pattern writes landing where they should;
/// 10^8 flushes with none lost or duplicated; error statuses, reordered and late completions
/// reaching the lanes whose commands they answer; and a hung controller breaking its pair and
/// being disabled. The host backend refuses the kernels.
mod gpu {
    use super::*;
    use gpuio_hal::{BackendPreference, DeviceBuffer, Gpu, Stream, probe};
    use gpuio_nvme::GpuNvmeOp;
    use gpuio_testkit::Requirement;

    fn cuda() -> Option<Gpu> {
        let p = probe(BackendPreference::Auto).expect("probe never fails with Auto");
        if !p.cuda.available {
            Requirement::Cuda.missing(format_args!("CUDA is unavailable: {}", p.cuda.detail));
            return None;
        }
        Some(p.gpus[0].clone())
    }

    fn upload_u64s(stream: &Stream, gpu: &Gpu, v: &[u64]) -> DeviceBuffer {
        let buf = gpu.alloc(v.len() * 8).unwrap();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        stream.upload(&bytes, &buf, 0).unwrap();
        buf
    }

    fn statuses(stream: &Stream, buf: &DeviceBuffer, n: usize) -> Vec<u32> {
        let mut raw = vec![0u8; n * 4];
        stream.download(buf, 0, &mut raw).unwrap();
        raw.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Tier 2's GPU half: device memory exported as a dma-buf (the kernel module imports
    /// it for a controller; the QEMU guest tests that half with vgem standing in). The host
    /// backend and misaligned ranges are refused with the reason; a driver that cannot
    /// export says why, and GPUIO_REQUIRE_CUDA machines must export.
    #[test]
    fn device_memory_exports_as_a_dmabuf() {
        use std::os::fd::{AsFd, AsRawFd};
        let host = probe(BackendPreference::Host).unwrap();
        let buf = host.gpus[0].alloc(1 << 20).unwrap();
        let e = buf.export_dmabuf(0, 1 << 20).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unsupported, "{e}");
        let Some(gpu) = cuda() else { return };
        let buf = gpu.alloc(4 << 20).unwrap();
        for (offset, len) in [(0, 0), (0, 1000), (100, 4096), (0, 8 << 20)] {
            let e = buf.export_dmabuf(offset, len).unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidArg, "{offset}+{len}: {e}");
        }
        let cap = &gpu.info().dma_buf;
        eprintln!("dma-buf export: {} ({})", cap.available, cap.detail);
        let export = match buf.export_dmabuf(1 << 20, 2 << 20) {
            Ok(x) => x,
            Err(e) => {
                assert!(!cap.available, "the device said it exports: {e}");
                assert_eq!(e.code(), ErrorCode::Unsupported, "{e}");
                return;
            }
        };
        assert_eq!(export.len(), 2 << 20);
        // The kernel's view of the descriptor: a dma-buf of that size, from NVIDIA's exporter.
        let fd = export.as_fd().as_raw_fd();
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
        assert!(info.contains(&format!("size:\t{}", 2 << 20)), "{info}");
        assert!(info.contains("exp_name:"), "not a dma-buf: {info}");
        eprintln!("{info}");
        // The buffer may go; the export keeps the allocation until it is dropped.
        drop(buf);
        drop(export);
    }

    #[test]
    fn host_backend_refuses_gpu_queues() {
        let p = probe(BackendPreference::Host).unwrap();
        let gpu = &p.gpus[0];
        let stream = gpu.stream().unwrap();
        let err = nvme_kernels::device_layout_words(&stream).unwrap_err();
        assert_eq!(err.code(), ErrorCode::Unsupported, "{err}");
        // What a launch would get wrong is refused before any launch: commands of no blocks,
        // or over the controller's transfer limit.
        let (_dev, ctrl) = soft(SoftConfig::default());
        let ns = ctrl.namespace(1).unwrap();
        let pair = ctrl.gpu_queue_pair(gpu, 64).unwrap();
        assert_eq!(
            ctrl.gpu_queue_pair(gpu, 32).unwrap_err().code(),
            ErrorCode::InvalidArg
        );
        let data = ctrl.dma_buffer(128 * 128 * 1024).unwrap();
        let mapped = data.map_for_gpu(gpu).unwrap();
        let lbas = upload_u64s(&stream, gpu, &[0; 32]);
        let st = gpu.alloc(32 * 4).unwrap();
        // Up to the controller's transfer limit (MDTS 5: 128 KiB), any block count.
        for (blocks, refused) in [(0, true), (257, true), (15, false), (256, false)] {
            let err = nvme_kernels::io(
                &stream,
                &[&pair],
                GpuNvmeOp::ReadChecked(1),
                &ns,
                &lbas,
                32,
                blocks,
                &mapped,
                &st,
                1,
            )
            .unwrap_err();
            let want = if refused {
                ErrorCode::InvalidArg
            } else {
                ErrorCode::Unsupported
            };
            assert_eq!(err.code(), want, "{blocks} blocks: {err}");
        }
    }

    #[test]
    fn gpu_threads_drive_queue_pairs() {
        let Some(gpu) = cuda() else { return };
        let stream = gpu.stream().unwrap();
        assert_eq!(
            nvme_kernels::device_layout_words(&stream).unwrap(),
            gpuio_nvme::gpu::layout_words(),
            "the device compiler's NVMe layouts"
        );
        const SEED: u64 = 0x5eed;
        let (dev, ctrl) = soft(SoftConfig {
            namespaces: vec![131072], // 64 MiB of 512-byte blocks
            ..SoftConfig::default()
        });
        dev.fill_pattern(1, SEED).unwrap();
        let ns = ctrl.namespace(1).unwrap();
        let pairs: Vec<_> = (0..4)
            .map(|_| ctrl.gpu_queue_pair(&gpu, 64).unwrap())
            .collect();
        let queues: Vec<_> = pairs.iter().collect();
        let grid = 8u32;
        let data = ctrl.dma_buffer(grid as usize * 128 * 65536).unwrap();
        let mapped = data.map_for_gpu(&gpu).unwrap();

        // Checked reads: 4 KiB at random 4 KiB-aligned LBAs, 8 KiB (PRP1 + PRP2), 7.5 KiB
        // (slots crossing three pages) and 64 KiB (PRP lists the GPU writes).
        for (blocks, n) in [
            (8u32, 100_000usize),
            (16, 20_000),
            (15, 20_000),
            (128, 8_000),
        ] {
            let lbas: Vec<u64> = (0..n as u64)
                .map(|i| pattern::mix64(i ^ blocks as u64) % ((131072 - blocks as u64) / 16) * 16)
                .collect();
            let lba_buf = upload_u64s(&stream, &gpu, &lbas);
            let st = gpu.alloc(n * 4).unwrap();
            let bad = nvme_kernels::io(
                &stream,
                &queues,
                GpuNvmeOp::ReadChecked(SEED),
                &ns,
                &lba_buf,
                n,
                blocks,
                &mapped,
                &st,
                grid,
            )
            .unwrap();
            assert_eq!(bad, 0, "{blocks}-block reads: mismatched words");
            assert!(
                statuses(&stream, &st, n).iter().all(|&s| s == 0),
                "{blocks}-block reads"
            );
        }

        // Pattern writes of a new stream to every other 4 KiB slot, then checked on the host.
        const NEW: u64 = 0xbeef;
        let slots: Vec<u64> = (0..4096u64).map(|i| i * 16).collect();
        let lba_buf = upload_u64s(&stream, &gpu, &slots);
        let st = gpu.alloc(slots.len() * 4).unwrap();
        nvme_kernels::io(
            &stream,
            &queues,
            GpuNvmeOp::WritePattern(NEW),
            &ns,
            &lba_buf,
            slots.len(),
            8,
            &mapped,
            &st,
            grid,
        )
        .unwrap();
        assert!(statuses(&stream, &st, slots.len()).iter().all(|&s| s == 0));
        let held = dev.namespace_bytes(1).unwrap();
        for &lba in slots.iter().step_by(97) {
            let at = lba as usize * 512;
            assert_eq!(
                pattern::first_deviation(&held[at..at + 4096], at as u64, NEW),
                None,
                "LBA {lba}"
            );
            let next = at + 4096;
            assert_eq!(
                pattern::first_deviation(&held[next..next + 512], next as u64, SEED),
                None,
                "untouched after LBA {lba}"
            );
        }

        // 10^8 flushes from 16 blocks on 16 pairs (a software controller of 8 threads): none
        // lost, none duplicated (a duplicate completion is a protocol error), none failed.
        let (flush_dev, flush_ctrl) = soft(SoftConfig {
            io_threads: 8,
            ..SoftConfig::default()
        });
        let flush_ns = flush_ctrl.namespace(1).unwrap();
        let flush_pairs: Vec<_> = (0..16)
            .map(|_| flush_ctrl.gpu_queue_pair(&gpu, 64).unwrap())
            .collect();
        let flush_queues: Vec<_> = flush_pairs.iter().collect();
        let flush_data = flush_ctrl.dma_buffer(4096).unwrap();
        let flush_mapped = flush_data.map_for_gpu(&gpu).unwrap();
        let n = 100_000_000;
        let no_lbas = gpu.alloc(8).unwrap();
        let st = gpu.alloc(n * 4).unwrap();
        let before = flush_dev.served();
        let start = std::time::Instant::now();
        nvme_kernels::io(
            &stream,
            &flush_queues,
            GpuNvmeOp::Flush,
            &flush_ns,
            &no_lbas,
            n,
            0,
            &flush_mapped,
            &st,
            16,
        )
        .unwrap();
        eprintln!("10^8 flushes in {:.2?}", start.elapsed());
        assert_eq!(flush_dev.served() - before, n as u64, "flushes served");
        assert!(statuses(&stream, &st, n).iter().all(|&s| s == 0));
        drop((flush_mapped, flush_pairs, st));

        // Faults: a bad block, an out-of-range LBA, reordered and late completions, on reads of
        // the odd 4 KiB slots. Each
        // status reaches the lane whose command it answers.
        dev.set_faults(SoftFaults {
            bad_blocks: vec![(1, 129_608..129_609)], // in a 4 KiB slot no other read takes
            reorder: 5,
            delay: Duration::from_micros(5),
            ..SoftFaults::default()
        });
        let n = 20_000usize;
        let mut lbas: Vec<u64> = (0..n as u64)
            .map(|i| pattern::mix64(i) % 8000 * 16 + 8)
            .collect();
        lbas[7] = 129_608;
        lbas[1234] = 131072 - 4; // runs past the end
        let lba_buf = upload_u64s(&stream, &gpu, &lbas);
        let st = gpu.alloc(n * 4).unwrap();
        let bad = nvme_kernels::io(
            &stream,
            &queues,
            GpuNvmeOp::ReadChecked(SEED),
            &ns,
            &lba_buf,
            n,
            8,
            &mapped,
            &st,
            grid,
        )
        .unwrap();
        let got = statuses(&stream, &st, n);
        assert_eq!(
            got[7] & 0x7ff,
            Status::UNRECOVERED_READ.0 as u32,
            "bad block"
        );
        assert_eq!(
            got[1234] & 0x7ff,
            Status::LBA_OUT_OF_RANGE.0 as u32,
            "out of range"
        );
        let others = got
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 7 && *i != 1234);
        assert!(others.clone().all(|(_, &s)| s == 0));
        // The odd 4 KiB slots still hold the first pattern (the writes took the even ones).
        assert_eq!(bad, 0, "reads under reordered and late completions");
        dev.set_faults(SoftFaults::default());

        // A controller that stops answering: the batch times out on the GPU (10 s), the
        // pair is broken for good, and the host disables the controller and fails.
        dev.set_faults(SoftFaults {
            hang: true,
            ..SoftFaults::default()
        });
        let n = 64usize;
        let lba_buf = upload_u64s(&stream, &gpu, &vec![8; n]);
        let st = gpu.alloc(n * 4).unwrap();
        let err = nvme_kernels::io(
            &stream,
            &queues[..1],
            GpuNvmeOp::ReadChecked(SEED),
            &ns,
            &lba_buf,
            n,
            8,
            &mapped,
            &st,
            1,
        )
        .unwrap_err();
        assert!(err.to_string().contains("broken"), "{err}");
        assert!(!ctrl.is_ready(), "the controller is disabled");
        dev.set_faults(SoftFaults::default());
        drop(mapped);
        drop(pairs);
    }
}
