//! The QEMU guest's comparison with fio: under the kernel's NVMe driver, fio filled the first
//! 16 MiB of namespace 1 (`GPUIO_NVME_FIO_IMAGE` holds a copy of what it wrote) and timed
//! random 4 KiB reads of it (`GPUIO_NVME_FIO_TERSE`, its terse output). Then, with the
//! controller handed to gpuio (opened by its PCI address, `GPUIO_NVME_ADDRESS`, through
//! whichever driver holds it), the same region is read whole and by the same random 4 KiB
//! reads, 64 in flight; every byte must be what fio wrote. Both rates are printed, labelled:
//! under TCG they are functional, not performance.

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
    let ctrl = gpuio_nvme::open(&var("GPUIO_NVME_ADDRESS"), ControllerOptions::default()).unwrap();
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
