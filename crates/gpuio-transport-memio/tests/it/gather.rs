//! Row gathers and scatters on the backend the probe finds (the tuned and naive CUDA kernels
//! on the GPU machine with `GPUIO_REQUIRE_CUDA=1`; the host backend's CPU versions elsewhere),
//! checked byte for byte against a CPU reference on fresh random data.

use gpuio_hal::{
    BackendPreference, ErrorCode, HalError, HostAllocOptions, HostBuffer, RowKernel, pattern, probe,
};
use gpuio_testkit::Requirement;
use gpuio_transport_memio::{
    GatherIndices, GatherOptions, GatherStrategy, IndexPlace, MemIo, MemIoConfig, MemIoError,
};

/// Every path a caller can force.
const FORCED: [GatherStrategy; 4] = [
    GatherStrategy::ZeroCopy,
    GatherStrategy::Sorted,
    GatherStrategy::CpuStaged,
    GatherStrategy::Hybrid,
];

pub(crate) fn engine() -> MemIo {
    engine_with(None)
}

/// The test engine, its small gathers served by a resident block where `resident_linger`.
pub(crate) fn engine_with(resident_linger: Option<std::time::Duration>) -> MemIo {
    let p = probe(BackendPreference::Auto).unwrap();
    if !p.cuda.available {
        Requirement::Cuda.missing(format_args!(
            "CUDA is unavailable: {} (running on the host backend)",
            p.cuda.detail
        ));
    }
    let config = MemIoConfig {
        chunk_size: 64 << 10,
        gather_threads: 3,
        resident_linger,
        ..MemIoConfig::default()
    };
    MemIo::new(p.gpus, config).unwrap()
}

pub(crate) fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

pub(crate) fn pool(io: &MemIo, len: usize, seed: u64, pinned: bool) -> HostBuffer {
    let gpu = io.gpu(0).unwrap();
    let mut b = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut b, 0, seed);
    if pinned {
        b.pin(gpu).unwrap();
    }
    b
}

pub(crate) fn random_indices(n: usize, rows: usize, seed: u64) -> Vec<u64> {
    (0..n)
        .map(|i| pattern::mix64(seed ^ (i as u64).wrapping_mul(0x9e37)) % rows as u64)
        .collect()
}

pub(crate) fn reference(pool: &[u8], rb: usize, idx: &[u64]) -> Vec<u8> {
    idx.iter()
        .flat_map(|&r| pool[r as usize * rb..(r as usize + 1) * rb].iter().copied())
        .collect()
}

pub(crate) fn download(
    io: &MemIo,
    dev: &gpuio_hal::DeviceBuffer,
    off: usize,
    len: usize,
) -> Vec<u8> {
    let mut out = vec![0u8; len];
    io.download(dev, off, &mut out).unwrap();
    out
}

#[test]
fn a_hybrid_gather_takes_the_callers_share_and_refuses_one_outside_0_to_1() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let s = seed();
    let (rb, rows, n) = (160, 20_000, 5000);
    let p = pool(&io, rows * rb, s, true);
    let idx = random_indices(n, rows, s ^ 1);
    let want = reference(&p, rb, &idx);
    let dst = gpu.alloc(n * rb).unwrap();
    // All on the CPU, all on the GPU, and splits between (the GPU's side may sort).
    for share in [0.0, 0.3, 0.77, 1.0] {
        io.upload(&vec![0u8; n * rb], &dst, 0).unwrap();
        let opts = GatherOptions {
            strategy: GatherStrategy::Hybrid,
            gpu_share: Some(share),
            ..GatherOptions::default()
        };
        let r = io.gather(&p, rb, &idx, &dst, 0, &opts).unwrap();
        assert_eq!(r.strategy, GatherStrategy::Hybrid);
        assert!(download(&io, &dst, 0, n * rb) == want, "share {share}");
    }
    for (share, strategy) in [
        (-0.1, GatherStrategy::Hybrid),
        (1.5, GatherStrategy::Auto),
        (f64::NAN, GatherStrategy::ZeroCopy),
    ] {
        let opts = GatherOptions {
            strategy,
            gpu_share: Some(share),
            ..GatherOptions::default()
        };
        match io.gather(&p, rb, &idx, &dst, 0, &opts) {
            Err(MemIoError::Hal(HalError::InvalidArgument(m))) => {
                assert!(m.contains("share"), "{m}")
            }
            other => panic!("share {share}: {other:?}"),
        }
    }
    // A pinned share is the caller's: it moves neither Auto's share nor its rates.
    for _ in 0..10 {
        io.gather(&p, rb, &idx, &dst, 0, &GatherOptions::default())
            .unwrap();
    }
    let before = io.gather_plan(&p, &gpu, rb, n, IndexPlace::Host).unwrap();
    let opts = GatherOptions {
        strategy: GatherStrategy::Hybrid,
        gpu_share: Some(0.5),
        ..GatherOptions::default()
    };
    io.gather(&p, rb, &idx, &dst, 0, &opts).unwrap();
    assert_eq!(
        io.gather_plan(&p, &gpu, rb, n, IndexPlace::Host).unwrap(),
        before
    );
}

#[test]
fn every_strategy_gathers_rows_of_any_size_and_alignment() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let s = seed();
    // Sizes that take each piece width (16, 8, 4, 1 bytes) and rows larger than a chunk.
    for (k, rb) in [1usize, 3, 4, 8, 24, 64, 160, 656, 4096, 65536]
        .into_iter()
        .enumerate()
    {
        let rows = (4 << 20) / rb;
        let p = pool(&io, rows * rb, s ^ k as u64, true);
        let n = 3000.min(rows * 2);
        let idx = random_indices(n, rows, s.wrapping_add(k as u64));
        let want = reference(&p, rb, &idx);
        // An odd destination offset: rows are opaque bytes, alignment is not promised.
        let off = 3;
        let dst = gpu.alloc(off + n * rb).unwrap();
        for strategy in FORCED.into_iter().chain([GatherStrategy::Auto]) {
            for dedup in [false, true] {
                let opts = GatherOptions {
                    strategy,
                    dedup,
                    ..GatherOptions::default()
                };
                let r = io.gather(&p, rb, &idx, &dst, off, &opts).unwrap();
                assert_ne!(r.strategy, GatherStrategy::Auto);
                assert_eq!(r.rows, n);
                assert!(r.rows_fetched <= n);
                assert!(
                    download(&io, &dst, off, n * rb) == want,
                    "row size {rb}, {strategy:?}, dedup {dedup}"
                );
            }
        }
    }
}

#[test]
fn a_device_index_list_gathers_by_every_strategy_under_a_plan_of_its_own() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let s = seed();
    for rb in [64usize, 656, 100] {
        let rows = (2 << 20) / rb;
        let p = pool(&io, rows * rb, s ^ rb as u64, true);
        let n = 5000;
        let mut idx = random_indices(n, rows, s);
        let want = reference(&p, rb, &idx);
        // The list lies at the start of a longer buffer (only `count` indices are read).
        let list = gpu.alloc(n * 8 + 4096).unwrap();
        let upload = |idx: &[u64]| {
            let bytes: Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
            io.upload(&bytes, &list, 0).unwrap();
        };
        upload(&idx);
        let on_device = GatherIndices::Device {
            list: &list,
            count: n,
        };
        let dst = gpu.alloc(n * rb).unwrap();
        let zeros = vec![0u8; n * rb];
        for strategy in FORCED.into_iter().chain([GatherStrategy::Auto]) {
            for (dedup, gpu_share) in [(false, None), (true, None), (false, Some(0.3))] {
                let opts = GatherOptions {
                    strategy,
                    dedup,
                    gpu_share,
                };
                io.upload(&zeros, &dst, 0).unwrap();
                let r = io.gather(&p, rb, on_device, &dst, 0, &opts).unwrap();
                assert_eq!(r.rows, n);
                assert!(
                    download(&io, &dst, 0, n * rb) == want,
                    "row size {rb}, {strategy:?}, dedup {dedup}, share {gpu_share:?}"
                );
            }
        }
        // Auto learns device lists as a shape of their own.
        assert!(
            io.gather_plan(&p, &gpu, rb, n, IndexPlace::Device)
                .is_some()
        );
        // An index past the last row is reported by its position, whichever side finds it.
        idx[4321] = rows as u64;
        upload(&idx);
        for strategy in FORCED {
            let opts = GatherOptions {
                strategy,
                ..GatherOptions::default()
            };
            match io.gather(&p, rb, on_device, &dst, 0, &opts) {
                Err(MemIoError::Hal(HalError::IndexOutOfRange { position, .. })) => {
                    assert_eq!(position, 4321, "{rb} {strategy:?}")
                }
                other => panic!("{rb} {strategy:?}: {other:?}"),
            }
        }
    }
    // A count past the list's end is refused before anything moves.
    let p = pool(&io, 64 << 10, s, true);
    let list = gpu.alloc(80).unwrap();
    let dst = gpu.alloc(64 * 11).unwrap();
    let long = GatherIndices::Device {
        list: &list,
        count: 11,
    };
    let e = io
        .gather(&p, 64, long, &dst, 0, &GatherOptions::default())
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg);
}

#[test]
fn the_naive_tuned_and_sorted_kernels_agree_with_the_reference() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let stream = gpu.stream().unwrap();
    let s = seed();
    for rb in [64usize, 160, 656, 4096, 100] {
        let rows = (2 << 20) / rb;
        let p = pool(&io, rows * rb, s ^ rb as u64, true);
        let idx = random_indices(5000, rows, s);
        let bytes: Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
        let dev_idx = gpu.alloc(bytes.len()).unwrap();
        stream.upload(&bytes, &dev_idx, 0).unwrap();
        let dst = gpu.alloc(idx.len() * rb).unwrap();
        for kernel in [RowKernel::Tuned, RowKernel::Sorted, RowKernel::Naive] {
            stream
                .gather(&p, rb, (&dev_idx).into(), idx.len(), &dst, 0, kernel)
                .unwrap();
            assert!(download(&io, &dst, 0, idx.len() * rb) == reference(&p, rb, &idx));
            // The same indices read in place from pinned host memory (not for a sorted
            // gather: it sorts the list in device memory).
            let mut pinned = HostBuffer::alloc(bytes.len(), &HostAllocOptions::default()).unwrap();
            pinned.copy_from_slice(&bytes);
            pinned.pin(&gpu).unwrap();
            let zeros = vec![0u8; idx.len() * rb];
            io.upload(&zeros, &dst, 0).unwrap();
            let in_place = stream.gather(&p, rb, (&pinned).into(), idx.len(), &dst, 0, kernel);
            if kernel == RowKernel::Sorted {
                assert_eq!(in_place.unwrap_err().code(), ErrorCode::InvalidArg);
            } else {
                in_place.unwrap();
                assert!(download(&io, &dst, 0, idx.len() * rb) == reference(&p, rb, &idx));
            }
            // And copied to the device in stream order just before the kernel.
            io.upload(&zeros, &dst, 0).unwrap();
            let staged_to = gpu.alloc(bytes.len()).unwrap();
            let staged = gpuio_hal::RowIndices::Staged {
                host: &pinned,
                device: &staged_to,
            };
            stream
                .gather(&p, rb, staged, idx.len(), &dst, 0, kernel)
                .unwrap();
            assert!(download(&io, &dst, 0, idx.len() * rb) == reference(&p, rb, &idx));
        }
    }
}

#[test]
fn a_sorted_gather_counts_a_streamed_list_piece_by_piece() {
    // 100 000 indices stream in 7 pieces of 16 Ki, each copied to the device and counted as
    // it arrives; the rows move once the whole list is ordered.
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let stream = gpu.stream().unwrap();
    let (n, rb) = (100_000, 24);
    let rows = (2 << 20) / rb;
    let p = pool(&io, rows * rb, seed(), true);
    let mut idx = random_indices(n, rows, seed());
    let mut stage = HostBuffer::alloc(n * 8, &HostAllocOptions::default()).unwrap();
    stage.pin(&gpu).unwrap();
    let on_device = gpu.alloc(n * 8).unwrap();
    let dst = gpu.alloc(n * rb).unwrap();
    let mut run = |idx: &[u64]| {
        let mut pieces = 0;
        let mut encode = |range: std::ops::Range<usize>, out: &mut [u8]| {
            pieces += 1;
            for (o, i) in out.chunks_exact_mut(8).zip(&idx[range]) {
                o.copy_from_slice(&i.to_le_bytes());
            }
        };
        let list = gpuio_hal::RowIndices::Streamed {
            stage: &mut stage,
            encode: &mut encode,
            device: Some(&on_device),
        };
        let done = stream.gather(&p, rb, list, n, &dst, 0, RowKernel::Sorted);
        (done, pieces)
    };
    let (done, pieces) = run(&idx);
    done.unwrap();
    assert_eq!(pieces, 7);
    assert!(download(&io, &dst, 0, n * rb) == reference(&p, rb, &idx));
    // Out-of-range indices in two pieces: the first position is reported.
    idx[90_000] = rows as u64;
    idx[40_000] = u64::MAX;
    match run(&idx).0 {
        Err(HalError::IndexOutOfRange { position, .. }) => assert_eq!(position, 40_000),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_unpinned_pool_is_gathered_by_the_cpu() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let p = pool(&io, 1 << 20, seed(), false);
    let idx = random_indices(500, (1 << 20) / 160, 7);
    let dst = gpu.alloc(500 * 160).unwrap();
    let opts = GatherOptions {
        strategy: GatherStrategy::ZeroCopy,
        ..GatherOptions::default()
    };
    let r = io.gather(&p, 160, &idx, &dst, 0, &opts).unwrap();
    assert_eq!(r.strategy, GatherStrategy::CpuStaged);
    assert!(download(&io, &dst, 0, 500 * 160) == reference(&p, 160, &idx));
}

#[test]
fn auto_measures_each_path_then_exploits_them() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let p = pool(&io, 1 << 20, seed(), true);
    let idx = random_indices(2000, (1 << 20) / 256, 1);
    let dst = gpu.alloc(2000 * 256).unwrap();
    let used: Vec<GatherStrategy> = (0..12)
        .map(|_| {
            io.gather(&p, 256, &idx, &dst, 0, &GatherOptions::default())
                .unwrap()
                .strategy
        })
        .collect();
    // Each path twice: a warm-up call, then a measured one.
    let first = [
        GatherStrategy::ZeroCopy,
        GatherStrategy::Sorted,
        GatherStrategy::CpuStaged,
        GatherStrategy::Hybrid,
    ];
    for (i, path) in first.into_iter().enumerate() {
        assert_eq!(used[2 * i..2 * i + 2], [path, path], "{used:?}");
    }
    // Then it exploits what it measured (which one depends on this machine).
    assert!(
        used[8..].iter().all(|s| *s != GatherStrategy::Auto),
        "{used:?}"
    );
}

#[test]
fn bad_indices_and_sizes_are_typed_errors() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let p = pool(&io, 64 * 100, seed(), true);
    let dst = gpu.alloc(64 * 10).unwrap();
    let mut idx = vec![1u64; 10];
    idx[7] = 100; // one past the last row
    for strategy in FORCED {
        let opts = GatherOptions {
            strategy,
            ..GatherOptions::default()
        };
        match io.gather(&p, 64, &idx, &dst, 0, &opts) {
            Err(MemIoError::Hal(HalError::IndexOutOfRange { position, rows })) => {
                assert_eq!((position, rows), (7, 100), "{strategy:?}")
            }
            other => panic!("{strategy:?}: {other:?}"),
        }
    }
    let e = io
        .gather(&p, 64, &[0; 11], &dst, 0, &GatherOptions::default())
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg);
    let e = io
        .gather(&p, 0, &[0], &dst, 0, &GatherOptions::default())
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArg);
}

#[test]
fn long_index_lists_stream_in_pieces_and_report_positions_across_them() {
    // 30 000 indices are written and moved in pieces: of 4 Ki, 8 Ki, 16 Ki and the rest for
    // 24-byte rows (read by the kernels from pinned memory), of 4 Ki and the rest for 1 KiB
    // rows (each piece copied to the device first).
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let n = 30_000;
    for rb in [24, 1024] {
        let rows = (2 << 20) / rb;
        let p = pool(&io, rows * rb, seed(), true);
        let mut idx = random_indices(n, rows, seed());
        let dst = gpu.alloc(n * rb).unwrap();
        let opts = GatherOptions {
            strategy: GatherStrategy::ZeroCopy,
            ..GatherOptions::default()
        };
        io.gather(&p, rb, &idx, &dst, 0, &opts).unwrap();
        assert!(
            download(&io, &dst, 0, n * rb) == reference(&p, rb, &idx),
            "{rb}"
        );
        // Out-of-range indices in two later pieces: the first is reported.
        idx[29_000] = rows as u64 + 5;
        idx[20_000] = u64::MAX;
        for strategy in [
            GatherStrategy::ZeroCopy,
            GatherStrategy::Sorted,
            GatherStrategy::Hybrid,
        ] {
            let opts = GatherOptions {
                strategy,
                ..GatherOptions::default()
            };
            match io.gather(&p, rb, &idx, &dst, 0, &opts) {
                Err(MemIoError::Hal(HalError::IndexOutOfRange { position, .. })) => {
                    if strategy != GatherStrategy::Hybrid {
                        assert_eq!(position, 20_000, "{rb}");
                    } else {
                        // The hybrid's CPU share may find the later one first.
                        assert!([20_000, 29_000].contains(&position), "{rb}: {position}");
                    }
                }
                other => panic!("{rb} {strategy:?}: {other:?}"),
            }
        }
        // Scatters stream their indices the same way (distinct rows here).
        let idx: Vec<u64> = (0..n as u64).map(|i| (i * 5) % rows as u64).collect();
        let idx = &idx[..n.min(rows)];
        let mut target = pool(&io, rows * rb, seed(), true);
        io.gather(&p, rb, idx, &dst, 0, &opts).unwrap();
        io.scatter(&dst, 0, rb, idx, &mut target).unwrap();
        for &r in idx.iter().step_by(97) {
            let r = r as usize;
            assert_eq!(
                &target[r * rb..(r + 1) * rb],
                &p[r * rb..(r + 1) * rb],
                "{rb}"
            );
        }
    }
}

#[test]
fn scatter_puts_rows_back_where_gather_found_them() {
    let io = engine();
    let gpu = io.gpu(0).unwrap().clone();
    let s = seed();
    for rb in [64usize, 160, 13] {
        let rows = 4096;
        let mut p = pool(&io, rows * rb, s, true);
        // Distinct indices, so the scatter has one writer per row.
        let mut idx: Vec<u64> = (0..rows as u64).step_by(3).collect();
        idx.reverse();
        let src: Vec<u8> = (0..idx.len() * rb).map(|i| (i * 7 + rb) as u8).collect();
        let dev = gpu.alloc(src.len()).unwrap();
        io.upload(&src, &dev, 0).unwrap();
        let before = p.to_vec();
        io.scatter(&dev, 0, rb, &idx, &mut p).unwrap();
        for (i, &r) in idx.iter().enumerate() {
            let r = r as usize;
            assert_eq!(&p[r * rb..(r + 1) * rb], &src[i * rb..(i + 1) * rb]);
        }
        // Rows not named are untouched.
        for r in (0..rows).filter(|r| r % 3 != 0) {
            assert_eq!(&p[r * rb..(r + 1) * rb], &before[r * rb..(r + 1) * rb]);
        }
    }
}

/// Gathers through hot rows: the GPU's paths read kept rows from their copies, the CPU's read
/// the pool. After the pool's rows are rewritten (the copies now stale, so each side shows
/// which it read), zero-copy gives the old bytes of kept rows, CPU-staged the new, and a
/// hybrid with a fixed half share the old in its GPU half and the new in its CPU half; a
/// device index list and `Auto` work as well, and a sorted gather is refused.
#[test]
fn a_gather_through_hot_rows_reads_copies_on_the_gpu_and_the_pool_on_the_cpu() {
    let io = engine();
    let (rb, rows) = (48usize, 4096usize);
    let mut p = pool(&io, rows * rb, seed(), true);
    let gpu = io.gpu(0).unwrap().clone();
    let stream = gpu.stream().unwrap();
    let keep: Vec<u64> = (0..rows as u64).filter(|r| r % 2 == 0).collect();
    let hot = stream.keep_hot(&p, rb, &keep).unwrap();
    let old = p.as_slice().to_vec();
    pattern::fill(&mut p, 0, seed() ^ 0xfeed);
    let new = p.as_slice().to_vec();
    let idx = random_indices(2000, rows, seed());
    let mixed = |gpu_rows: std::ops::Range<usize>| -> Vec<u8> {
        idx.iter()
            .enumerate()
            .flat_map(|(i, &r)| {
                let from = if r % 2 == 0 && gpu_rows.contains(&i) {
                    &old
                } else {
                    &new
                };
                from[r as usize * rb..(r as usize + 1) * rb].to_vec()
            })
            .collect()
    };
    let dst = gpu.alloc(idx.len() * rb).unwrap();
    let run = |strategy, gpu_share| {
        let opts = GatherOptions {
            strategy,
            gpu_share,
            ..GatherOptions::default()
        };
        let r = io.gather_hot(&p, &hot, &idx, &dst, 0, &opts).unwrap();
        assert_eq!(r.strategy, strategy);
        download(&io, &dst, 0, idx.len() * rb)
    };
    assert_eq!(run(GatherStrategy::ZeroCopy, None), mixed(0..idx.len()));
    assert_eq!(run(GatherStrategy::CpuStaged, None), mixed(0..0));
    assert_eq!(run(GatherStrategy::Hybrid, Some(0.5)), mixed(0..1000));
    // A list already on the device, by zero-copy.
    let list = gpu.alloc(idx.len() * 8).unwrap();
    let bytes: Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
    stream.upload(&bytes, &list, 0).unwrap();
    let on_device = GatherIndices::Device {
        list: &list,
        count: idx.len(),
    };
    let opts = GatherOptions {
        strategy: GatherStrategy::ZeroCopy,
        ..GatherOptions::default()
    };
    io.gather_hot(&p, &hot, on_device, &dst, 0, &opts).unwrap();
    assert_eq!(download(&io, &dst, 0, idx.len() * rb), mixed(0..idx.len()));
    // Auto never picks the sorted path for hot shapes, and a caller cannot force it.
    for _ in 0..12 {
        let r = io
            .gather_hot(&p, &hot, &idx, &dst, 0, &GatherOptions::default())
            .unwrap();
        assert_ne!(r.strategy, GatherStrategy::Sorted);
    }
    let sorted = GatherOptions {
        strategy: GatherStrategy::Sorted,
        ..GatherOptions::default()
    };
    let err = io.gather_hot(&p, &hot, &idx, &dst, 0, &sorted).unwrap_err();
    assert!(err.to_string().contains("sorted"), "{err}");
}
