//! Device tests, run on the backend the probe finds: CUDA on the GPU machine (where
//! `GPUIO_REQUIRE_CUDA=1` makes a missing device a failure), the host backend elsewhere (the
//! CUDA-specific checks then say they were skipped and why).

use super::{devices, first_gpu};
use gpuio_hal::{
    Backend, BackendPreference, ErrorCode, HalError, HostAllocOptions, HostBuffer, Piece2d,
    pattern, probe, probe_with,
};
use proptest::prelude::*;

#[test]
fn probe_describes_the_device() {
    let p = devices();
    let info = p.gpus[0].info();
    assert!(!info.name.is_empty());
    assert!(info.total_memory > 0);
    if info.backend == Backend::Cuda {
        let (major, _) = info.compute_capability.expect("CUDA devices have a CC");
        assert!(major >= 5);
        assert!(info.multiprocessors > 0);
        assert!(info.pci_bus_id.is_some());
        assert!(info.driver_version.is_some());
        eprintln!("{info:#?}");
    }
    assert!(matches!(
        p.gpu(99),
        Err(HalError::NoSuchDevice { ordinal: 99, .. })
    ));
}

#[test]
fn host_backend_is_always_available() {
    let p = probe(BackendPreference::Host).unwrap();
    assert_eq!(p.gpus[0].backend(), Backend::Host);
}

#[test]
fn cuda_preference_fails_with_a_reason_where_absent() {
    match probe(BackendPreference::Cuda) {
        Ok(p) => assert_eq!(p.gpus[0].backend(), Backend::Cuda),
        Err(e) => {
            assert_eq!(e.code(), ErrorCode::Unsupported);
            eprintln!("skipped CUDA-only check: {e}");
        }
    }
}

#[test]
fn pinned_and_pageable_round_trips() {
    let p = devices();
    let gpu = &p.gpus[0];
    let stream = gpu.stream().unwrap();
    let len = 8 << 20;
    let dev = gpu.alloc(len).unwrap();
    let mut pinned = HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), gpu).unwrap();
    assert!(pinned.is_pinned());
    pattern::fill(&mut pinned, 0, 7);
    stream.upload(&pinned, &dev, 0).unwrap();
    let mut pageable = vec![0u8; len];
    stream.download(&dev, 0, &mut pageable).unwrap();
    assert_eq!(pattern::first_deviation(&pageable, 0, 7), None);
    if gpu.backend() == Backend::Cuda {
        assert!(gpu.is_pinned(&pinned));
        assert!(gpu.is_pinned(&pinned[100..200]));
        assert!(!gpu.is_pinned(&pageable));
    }
}

#[test]
fn registration_is_scoped() {
    let p = devices();
    let gpu = &p.gpus[0];
    let cuda = gpu.backend() == Backend::Cuda;
    let dev = gpu.alloc(1 << 20).unwrap();
    let stream = gpu.stream().unwrap();
    let mut v = vec![0u8; 1 << 20];
    pattern::fill(&mut v, 0, 13);
    let pinned_inside = gpu
        .with_registered(&mut v, |mem| {
            stream.upload(mem, &dev, 0).unwrap();
            gpu.is_pinned(mem)
        })
        .unwrap();
    assert_eq!(pinned_inside, cuda);
    assert!(!gpu.is_pinned(&v));
    // Registering again only works if the first registration was undone.
    gpu.with_registered(&mut v, |_| ()).unwrap();
    assert!(gpu.with_registered(&mut [], |_| ()).is_err());
    let mut back = vec![0u8; 1 << 20];
    stream.download(&dev, 0, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 0, 13), None);
}

#[test]
fn overlapping_copies_within_a_buffer_are_refused() {
    let p = devices();
    let gpu = &p.gpus[0];
    let stream = gpu.stream().unwrap();
    let a = gpu.alloc(1000).unwrap();
    let err = stream.copy_device(&a, 0, &a, 500, 501).unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    stream.copy_device(&a, 0, &a, 500, 500).unwrap();
    assert!(gpu.baseline_copy_device(&a, &a, 10).is_err());
}

#[test]
fn strided_pieces_copy_their_rows_and_refuse_what_does_not_fit() {
    let p = devices();
    let gpu = &p.gpus[0];
    let stream = gpu.stream().unwrap();
    const LEN: usize = 128 << 10;
    let data: Vec<u8> = (0..LEN as u32).map(|i| (i * 7 % 251) as u8).collect();
    let (src, dst) = (gpu.alloc(LEN).unwrap(), gpu.alloc(LEN).unwrap());
    stream.upload(&data, &src, 0).unwrap();
    stream.upload(&[0xEE; LEN], &dst, 0).unwrap();
    let piece = |src_offset, src_pitch, dst_offset, dst_pitch, width, rows| Piece2d {
        src_offset,
        src_pitch,
        dst_offset,
        dst_pitch,
        width,
        rows,
    };
    // Columns 16..40 of a 16 x 64 matrix (a split along dim 1), a run of 1000 bytes, an
    // empty piece, rows at odd offsets and pitches, one row wider than the kernel's
    // segments, 2- and 4-byte elements, and rows of two segments at mixed alignments: each
    // word width the kernel copies with.
    let pieces = [
        piece(16, 64, 0, 24, 24, 16),
        piece(1024, 0, 512, 0, 1000, 1),
        piece(0, 0, 0, 0, 0, 5),
        piece(3001, 100, 2001, 37, 37, 3),
        piece(16384, 0, 16384, 0, 20000, 1),
        piece(40000, 2, 40000, 4, 2, 1000),
        piece(50000, 12, 50000, 4, 4, 100),
        piece(70000, 9001, 70000, 9000, 9000, 3),
    ];
    stream.copy_pieces(&src, &dst, &pieces).unwrap();
    let mut want = vec![0xEE; LEN];
    for p in &pieces {
        for i in 0..p.rows {
            let from = &data[p.src_offset + i * p.src_pitch..][..p.width];
            want[p.dst_offset + i * p.dst_pitch..][..p.width].copy_from_slice(from);
        }
    }
    let mut got = vec![0; LEN];
    stream.download(&dst, 0, &mut got).unwrap();
    assert!(got == want, "the pieces' rows, and nothing else, changed");
    // Into another GPU's memory: written over the peer link where this device reaches it,
    // else staged here; the same bytes either way.
    if let Some(other) = p.gpus.get(1) {
        let far = other.alloc(LEN).unwrap();
        other
            .stream()
            .unwrap()
            .upload(&[0xEE; LEN], &far, 0)
            .unwrap();
        stream.copy_pieces(&src, &far, &pieces).unwrap();
        let mut there = vec![0; LEN];
        other
            .stream()
            .unwrap()
            .download(&far, 0, &mut there)
            .unwrap();
        assert!(there == want, "pieces into a peer GPU");
    }
    // Refused before any piece is queued: a last row past the end, rows over each other,
    // and a buffer into itself.
    for bad in [
        piece(LEN - 96, 64, 0, 64, 64, 2),
        piece(0, 64, LEN - 96, 64, 64, 2),
        piece(0, 16, 0, 64, 64, 2),
        piece(0, usize::MAX, 0, 64, 64, 2),
    ] {
        let err = stream
            .copy_pieces(&src, &dst, &[piece(0, 1, 0, 1, 1, 1), bad])
            .unwrap_err();
        assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    }
    let err = stream.copy_pieces(&src, &src, &pieces[..1]).unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg, "{err}");
    stream.download(&dst, 0, &mut got).unwrap();
    assert!(got == want, "a refused batch wrote nothing");
}

#[test]
fn one_device_buffer_can_be_shared_by_threads() {
    let p = devices();
    let gpu = p.gpus[0].clone();
    let dev = gpu.alloc(1 << 20).unwrap();
    let reference = gpu.alloc(1 << 20).unwrap();
    gpu.stream()
        .unwrap()
        .fill_pattern(&reference, 0, 1 << 20, 3)
        .unwrap();
    std::thread::scope(|s| {
        for t in 0..4 {
            let (gpu, dev, reference) = (&gpu, &dev, &reference);
            s.spawn(move || {
                let stream = gpu.stream().unwrap();
                let mut src = vec![0u8; 1 << 20];
                pattern::fill(&mut src, 0, 3);
                for i in 0..20 {
                    if (i + t) % 2 == 0 {
                        stream.upload(&src, dev, 0).unwrap();
                    } else {
                        stream.copy_device(reference, 0, dev, 0, 1 << 20).unwrap();
                    }
                    let _ = stream.find_mismatch(dev, 0, reference, 0, 1 << 20).unwrap();
                }
            });
        }
    });
    // Every writer wrote the same bytes, so whatever the interleaving the result is exact.
    let stream = gpu.stream().unwrap();
    assert_eq!(
        stream
            .find_mismatch(&dev, 0, &reference, 0, 1 << 20)
            .unwrap(),
        None
    );
}

#[test]
fn async_copies_hand_buffers_back() {
    let p = devices();
    let gpu = &p.gpus[0];
    let stream = gpu.stream().unwrap();
    let len = 4 << 20;
    let dev = gpu.alloc(len).unwrap();
    let mut src = HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), gpu).unwrap();
    pattern::fill(&mut src, 0, 11);
    // Two halves in flight at once, then back.
    let a = stream.upload_async(src, 0..len / 2, &dev, 0).unwrap();
    let src = a.wait().unwrap();
    let b = stream
        .upload_async(src, len / 2..len, &dev, len / 2)
        .unwrap();
    let _src = b.wait().unwrap();
    let dst = HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), gpu).unwrap();
    let d = stream.download_async(&dev, 0, dst, 0..len).unwrap();
    let dst = d.wait().unwrap();
    assert_eq!(pattern::first_deviation(&dst, 0, 11), None);
}

#[test]
fn a_stream_waits_for_another_streams_event_in_device_order() {
    let gpu = first_gpu();
    let (a, b) = (gpu.stream().unwrap(), gpu.stream().unwrap());
    let len = 64 << 20;
    let (src, dst) = (gpu.alloc(len).unwrap(), gpu.alloc(len).unwrap());
    for seed in [3, 4] {
        a.fill_pattern(&src, 0, len, seed).unwrap();
        // A copy of some tens of µs on a GPU, queued on `a`; `b` reads its last bytes only
        // once it is done, without the host waiting in between.
        let copy = a.copy_device_async(&src, 0, &dst, 0, len).unwrap();
        b.wait_for(&a.record_event().unwrap()).unwrap();
        let mut tail = vec![0u8; 4096];
        b.download(&dst, len - 4096, &mut tail).unwrap();
        assert_eq!(
            pattern::first_deviation(&tail, (len - 4096) as u64, seed),
            None,
            "seed {seed}"
        );
        copy.wait().unwrap();
    }
}

#[test]
fn device_pattern_kernel_matches_the_cpu_reference() {
    let p = devices();
    let gpu = &p.gpus[0];
    let stream = gpu.stream().unwrap();
    let len = (3 << 20) + 5;
    let dev = gpu.alloc(len).unwrap();
    // Unaligned ranges exercise the kernel's byte-wise head and tail.
    for (off, n, seed) in [
        (0, len, 3u64),
        (1, 1000, 4),
        (7, 65_537, 5),
        (len - 3, 3, 6),
    ] {
        stream.fill_pattern(&dev, off, n, seed).unwrap();
        let mut out = vec![0u8; n];
        stream.download(&dev, off, &mut out).unwrap();
        assert_eq!(
            pattern::first_deviation(&out, off as u64, seed),
            None,
            "off {off} n {n}"
        );
    }
}

#[test]
fn device_compare_finds_the_first_difference() {
    let p = devices();
    let gpu = &p.gpus[0];
    let stream = gpu.stream().unwrap();
    let len = 5 << 20;
    let a = gpu.alloc(len).unwrap();
    let b = gpu.alloc(len).unwrap();
    stream.fill_pattern(&a, 0, len, 9).unwrap();
    stream.copy_device(&a, 0, &b, 0, len).unwrap();
    assert_eq!(stream.find_mismatch(&a, 0, &b, 0, len).unwrap(), None);
    for flip in [len - 1, 4_000_001, 17, 0] {
        stream
            .upload(&[0xAA ^ pattern::byte_at(9, flip as u64)], &b, flip)
            .unwrap();
        assert_eq!(
            stream.find_mismatch(&a, 0, &b, 0, len).unwrap(),
            Some(flip as u64)
        );
    }
}

/// Every module loads from its embedded machine code where it has some for the device, else
/// from its embedded PTX where one fits (no compiler at first use), and by each way alone when
/// asked; the host backend has no modules to load. Prints what each way took (`gpuio bench
/// kernels` measures it properly).
#[test]
fn kernel_modules_load_from_embedded_code() {
    use gpuio_hal::kernels::{KernelOrigin, KernelPath, MODULES};
    let p = devices();
    let gpu = &p.gpus[0];
    if gpu.backend() == Backend::Host {
        let e = gpu.load_kernels(MODULES[0]).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unsupported);
        eprintln!("skipped kernel modules: the host backend has none");
        return;
    }
    let cc = gpu
        .info()
        .compute_capability
        .expect("CUDA devices have a CC");
    for src in MODULES {
        let origin = gpu.load_kernels(src).unwrap();
        match (src.cubin_for(cc), src.ptx_for(cc)) {
            (Some(c), _) => assert_eq!(origin, KernelOrigin::EmbeddedCubin { arch: c.arch }),
            (None, Some(ptx)) => assert_eq!(origin, KernelOrigin::EmbeddedPtx { arch: ptx.arch }),
            (None, None) => assert_eq!(origin, KernelOrigin::Nvrtc),
        }
        let cubin = gpu.time_kernel_load(src, KernelPath::EmbeddedCubin);
        let ptx = gpu.time_kernel_load(src, KernelPath::EmbeddedPtx);
        let nvrtc = gpu.time_kernel_load(src, KernelPath::Nvrtc);
        eprintln!(
            "{}: machine code {:?}; PTX {:?}; NVRTC {:?}",
            src.name,
            cubin.as_ref().map(|l| l.load),
            ptx.as_ref().map(|l| l.load),
            nvrtc.as_ref().map(|l| l.total())
        );
        assert_eq!(cubin.is_ok(), src.cubin_for(cc).is_some(), "{cubin:?}");
        if src.ptx_for(cc).is_some() {
            ptx.unwrap();
        }
    }
}

#[test]
fn events_time_device_work() {
    let p = devices();
    let gpu = &p.gpus[0];
    let stream = gpu.stream().unwrap();
    let dev = gpu.alloc(64 << 20).unwrap();
    let start = stream.record_event().unwrap();
    stream.fill_pattern(&dev, 0, 64 << 20, 1).unwrap();
    let end = stream.record_event().unwrap();
    end.synchronize().unwrap();
    let ms = end.elapsed_ms_since(&start).unwrap();
    assert!(ms >= 0.0, "{ms}");
}

#[test]
fn bad_ranges_and_foreign_buffers_are_typed_errors() {
    let p = probe_with(BackendPreference::Host, 2).unwrap();
    let (g0, g1) = (&p.gpus[0], &p.gpus[1]);
    let s0 = g0.stream().unwrap();
    let d0 = g0.alloc(100).unwrap();
    let d1 = g1.alloc(100).unwrap();
    let err = s0.upload(&[0u8; 10], &d0, 95).unwrap_err();
    assert!(matches!(
        err,
        HalError::OutOfRange {
            offset: 95,
            len: 10,
            limit: 100,
            ..
        }
    ));
    assert_eq!(err.code(), ErrorCode::InvalidArg);
    let err = s0.upload(&[0u8; 10], &d1, 0).unwrap_err();
    assert!(matches!(err, HalError::WrongDevice { .. }), "{err}");
    let mut out = [0u8; 10];
    assert!(s0.download(&d0, usize::MAX - 3, &mut out).is_err());
    assert!(s0.copy_device(&d0, 50, &d0, 0, 51).is_err());
    let host = HostBuffer::alloc(10, &HostAllocOptions::default()).unwrap();
    assert!(s0.upload_async(host, 5..11, &d0, 0).is_err());
}

#[test]
fn peer_copies_between_devices() {
    // Real devices where there are two; two host-backend devices otherwise.
    let real = devices();
    let p = if real.gpus.len() >= 2 {
        real
    } else {
        eprintln!("skipped CUDA peer copy: fewer than 2 CUDA devices (using 2 host devices)");
        probe_with(BackendPreference::Host, 2).unwrap()
    };
    let (g0, g1) = (&p.gpus[0], &p.gpus[1]);
    eprintln!("peer access gpu0->gpu1: {}", g0.can_access_peer(g1));
    let len = 16 << 20;
    let a = g0.alloc(len).unwrap();
    let b = g1.alloc(len).unwrap();
    let s0 = g0.stream().unwrap();
    s0.fill_pattern(&a, 0, len, 21).unwrap();
    s0.copy_device(&a, 0, &b, 0, len).unwrap();
    let mut out = vec![0u8; len];
    g1.stream().unwrap().download(&b, 0, &mut out).unwrap();
    assert_eq!(pattern::first_deviation(&out, 0, 21), None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Random sizes and offsets, pinned or pageable, round-trip exactly.
    #[test]
    fn random_round_trips(len in 1usize..300_000, src_off in 0usize..4096, dev_off in 0usize..4096,
                          pinned: bool, seed: u64) {
        let p = devices();
        let gpu = &p.gpus[0];
        let stream = gpu.stream().unwrap();
        let dev = gpu.alloc(dev_off + len).unwrap();
        let mut host = HostBuffer::alloc(src_off + len, &HostAllocOptions::default()).unwrap();
        if pinned {
            host.pin(gpu).unwrap();
        }
        pattern::fill(&mut host[src_off..], 0, seed);
        stream.upload(&host[src_off..], &dev, dev_off).unwrap();
        let mut back = vec![0u8; len];
        stream.download(&dev, dev_off, &mut back).unwrap();
        prop_assert_eq!(pattern::first_deviation(&back, 0, seed), None);
    }
}

#[test]
fn borrowed_device_memory_is_checked_against_its_allocation() {
    let p = devices();
    let gpu = &p.gpus[0];
    let owned = gpu.alloc(1 << 20).unwrap();
    let base = owned.device_addr();
    gpu.synchronize().unwrap();
    if gpu.backend() == Backend::Host {
        let e = gpu.borrow_device(base, 4096, ()).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Unsupported, "{e}");
        return;
    }
    // A view of the middle of another allocation moves bytes like the allocation itself.
    // The view holds its owner for as long as any clone of it lives.
    let owner = std::sync::Arc::new(());
    let view = gpu.borrow_device(base + 4096, 8192, owner.clone()).unwrap();
    let clone = view.clone();
    assert_eq!(std::sync::Arc::strong_count(&owner), 2);
    let stream = gpu.stream().unwrap();
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
    stream.upload(&data, &view, 0).unwrap();
    let mut back = vec![0u8; 8192];
    stream.download(&owned, 4096, &mut back).unwrap();
    assert_eq!(back, data);
    drop(view);
    assert_eq!(std::sync::Arc::strong_count(&owner), 2);
    drop(clone);
    assert_eq!(std::sync::Arc::strong_count(&owner), 1);
    // Past the allocation's end, a host address, zero bytes: typed errors, nothing copied.
    for (addr, len) in [
        (base + (1 << 20) - 100, 200),
        (data.as_ptr() as u64, 16),
        (base, 0),
    ] {
        let e = gpu.borrow_device(addr, len, ()).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArg, "{addr:#x}+{len}: {e}");
    }
    if let Ok(other) = p.gpu(1)
        && other.backend() == Backend::Cuda
    {
        let e = other.borrow_device(base, 4096, ()).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
    }
}
