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
        Requirement::Nvme.missing("no extent list recorded (cargo xtask qemu-nvme records one)");
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
