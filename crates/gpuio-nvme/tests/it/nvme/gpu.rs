//! GPU threads drive queue pairs on the software controller (its queues, doorbells and data
//! slots in host memory registered with the GPU: Tier 1): the layouts agree with the device
//! compiler's; checked 4 KiB and 8 KiB reads (PRP2) from four pairs at once, every word
//! compared with the pattern the namespace holds; pattern writes landing where they should;
//! 10^8 flushes with none lost or duplicated; error statuses, reordered and late completions
//! reaching the lanes whose commands they answer; and a hung controller breaking its pair and
//! being disabled. The host backend refuses the kernels.

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
