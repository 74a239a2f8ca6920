//! MemIO on the backend the probe finds (CUDA on the GPU machine with
//! `GPUIO_REQUIRE_CUDA=1`, the host backend elsewhere). Small chunks and several lanes make
//! the pipeline's lane, slot and partial-chunk logic run even on small data.

use gpuio_hal::{
    Backend, BackendPreference, ErrorCode, HostAllocOptions, HostBuffer, pattern, probe, probe_with,
};
use gpuio_testkit::Requirement;
use gpuio_transport_memio::{HostPlacement, MemIo, MemIoConfig, MemIoError, Route};
use proptest::prelude::*;

fn engine(config: MemIoConfig) -> MemIo {
    let p = probe(BackendPreference::Auto).unwrap();
    if !p.cuda.available {
        Requirement::Cuda.missing(format_args!(
            "CUDA is unavailable: {} (running on the host backend)",
            p.cuda.detail
        ));
    }
    MemIo::new(p.gpus, config).unwrap()
}

fn small_chunks() -> MemIoConfig {
    MemIoConfig {
        chunk_size: 64 << 10,
        threads: 3,
        slots_per_lane: 2,
        pipeline_min: 256 << 10,
        parallel_copy_min: 128 << 10,
        gather_threads: 3,
        resident_linger: None,
    }
}

#[test]
fn routes_follow_memory_kind_and_size() {
    let io = engine(MemIoConfig::default());
    let gpu = io.gpu(0).unwrap().clone();
    let pinned = HostBuffer::alloc_pinned(8 << 20, &HostAllocOptions::default(), &gpu).unwrap();
    let pageable = vec![1u8; 8 << 20];
    if gpu.backend() == Backend::Cuda {
        assert_eq!(io.route_host_device(&gpu, &pinned), Route::DirectDma);
        assert!(matches!(
            io.route_host_device(&gpu, &pageable),
            Route::StagedPipeline { lanes, .. } if lanes >= 1
        ));
        assert_eq!(
            io.route_host_device(&gpu, &pageable[..4096]),
            Route::DriverStaged
        );
    } else {
        assert!(matches!(
            io.route_host_device(&gpu, &pageable),
            Route::HostCopy { .. }
        ));
    }
    assert_eq!(io.route_device_device(&gpu, &gpu), Route::DeviceCopy);
}

#[test]
fn every_route_round_trips() {
    let io = engine(small_chunks());
    let gpu = io.gpu(0).unwrap().clone();
    let len = (5 << 20) + 4321;
    let dev = gpu.alloc(len + 100).unwrap();
    let mut src = vec![0u8; len];
    pattern::fill(&mut src, 0, 77);

    // Automatic route (pipeline on CUDA for pageable memory, parallel copy on host).
    io.upload(&src, &dev, 100).unwrap();
    let mut back = vec![0u8; len];
    io.download(&dev, 100, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 0, 77), None);

    // The staging pipeline explicitly, on any backend.
    let staged = gpu.alloc(len + 2).unwrap();
    let r = io.upload_staged(&src[1..], &staged, 3).unwrap();
    assert!(matches!(r, Route::StagedPipeline { lanes: 3, .. }), "{r:?}");
    let mut back = vec![0u8; len - 1];
    io.download_staged(&staged, 3, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 1, 77), None);

    // Pinned memory.
    let mut pinned = HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), &gpu).unwrap();
    io.download(&dev, 100, &mut pinned).unwrap();
    assert_eq!(pattern::first_deviation(&pinned, 0, 77), None);

    // Device to device.
    let dev2 = gpu.alloc(len).unwrap();
    io.copy_device(&dev, 100, &dev2, 0, len).unwrap();
    let mut back = vec![0u8; len];
    io.download(&dev2, 0, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 0, 77), None);

    let s = io.stats();
    assert!(s.host_to_device >= 2 * len as u64 - 1);
    assert!(s.staged >= 2 * (len as u64 - 1));
    assert_eq!(s.device_to_device, len as u64);
    // Lanes went back to the pool with their staging buffers.
    assert!(io.staging_bytes() >= 3 * 2 * (64 << 10));
}

#[test]
fn host_copies_and_placements() {
    let io = engine(small_chunks());
    let src = {
        let mut v = vec![0u8; 3 << 20];
        pattern::fill(&mut v, 0, 5);
        v
    };
    let mut dst = io
        .alloc_host(HostPlacement::Dram { numa: Some(0) }, src.len(), false)
        .unwrap();
    let route = io.copy_host(&src, &mut dst).unwrap();
    assert!(matches!(route, Route::HostCopy { threads: 3 }), "{route:?}");
    assert_eq!(pattern::first_deviation(&dst, 0, 5), None);
    match dst.page_nodes(8) {
        Ok(nodes) => assert!(nodes.iter().all(|&n| n == 0), "{nodes:?}"),
        Err(e) => eprintln!("skipped page placement check: {e}"),
    }

    let err = io.copy_host(&src, &mut dst[1..]).unwrap_err();
    assert!(matches!(err, MemIoError::LengthMismatch { .. }));

    let err = io
        .alloc_host(HostPlacement::Dram { numa: Some(4096) }, 10, false)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::NotFound);

    let cxl = io.topology().memory_only_nodes().len() as u32;
    let err = io
        .alloc_host(HostPlacement::Cxl { device: cxl }, 10, true)
        .unwrap_err();
    assert!(matches!(err, MemIoError::NoCxlDevice { .. }), "{err}");
}

#[test]
fn out_of_range_and_foreign_devices_are_refused() {
    let io = engine(small_chunks());
    let gpu = io.gpu(0).unwrap().clone();
    let dev = gpu.alloc(1000).unwrap();
    let err = io.upload(&[0u8; 100], &dev, 901).unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg);
    let err = io.upload_staged(&[0u8; 100], &dev, 901).unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg);
    let mut out = vec![0u8; 1001];
    assert!(io.download(&dev, 0, &mut out).is_err());
    assert!(io.copy_device(&dev, 0, &dev, 1, 1000).is_err());

    let other = probe_with(BackendPreference::Host, 2).unwrap();
    let foreign = other.gpus[1].alloc(10).unwrap();
    let err = io.upload(&[0u8; 10], &foreign, 0).unwrap_err();
    assert!(matches!(err, MemIoError::UnknownGpu(_)), "{err}");
    assert!(io.gpu(17).is_err());
}

#[test]
fn peer_copies_between_two_devices() {
    let p = probe_with(BackendPreference::Auto, 2).unwrap();
    if p.gpus.len() < 2 {
        eprintln!("skipped peer copy: one CUDA device");
        return;
    }
    let io = MemIo::new(p.gpus, small_chunks()).unwrap();
    let (g0, g1) = (io.gpu(0).unwrap().clone(), io.gpu(1).unwrap().clone());
    let a = g0.alloc(1 << 20).unwrap();
    let b = g1.alloc(1 << 20).unwrap();
    let mut src = vec![0u8; 1 << 20];
    pattern::fill(&mut src, 0, 8);
    io.upload(&src, &a, 0).unwrap();
    let r = io.copy_device(&a, 0, &b, 0, 1 << 20).unwrap();
    assert!(matches!(r, Route::PeerCopy { .. }));
    let mut back = vec![0u8; 1 << 20];
    io.download(&b, 0, &mut back).unwrap();
    assert_eq!(src, back);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Random lengths and offsets through the pipeline and the automatic route.
    #[test]
    fn random_pipeline_round_trips(len in 1usize..1_200_000, off in 0usize..70_000, seed: u64,
                                   staged: bool) {
        let io = engine(small_chunks());
        let gpu = io.gpu(0).unwrap().clone();
        let dev = gpu.alloc(off + len).unwrap();
        let mut src = vec![0u8; len];
        pattern::fill(&mut src, 0, seed);
        let mut back = vec![0u8; len];
        if staged {
            io.upload_staged(&src, &dev, off).unwrap();
            io.download_staged(&dev, off, &mut back).unwrap();
        } else {
            io.upload(&src, &dev, off).unwrap();
            io.download(&dev, off, &mut back).unwrap();
        }
        prop_assert_eq!(pattern::first_deviation(&back, 0, seed), None);
    }
}
