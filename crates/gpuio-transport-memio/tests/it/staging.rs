//! The pipeline's lanes on a shared staging pool (the probed backend; the host backend in
//! CI): a lane leases its buffers once and keeps them across transfers, a pool with room for
//! one lane still moves everything (on fewer lanes, concurrent transfers waiting their turn),
//! and the buffers go back to the pool with the engine.

use gpuio_hal::{BackendPreference, pattern, probe};
use gpuio_staging::{PoolConfig, StagingPool};
use gpuio_transport_memio::{MemIo, MemIoConfig, Route};
use std::sync::Arc;

fn config() -> MemIoConfig {
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
fn lanes_lease_staging_once_and_make_do_with_what_the_pool_has() {
    let gpus = probe(BackendPreference::Auto).unwrap().gpus;
    let gpu = gpus[0].clone();
    let config = config();
    let lane = config.lane_staging_bytes(&PoolConfig::default()).unwrap();
    assert_eq!(lane, 2 * (64 << 10));

    // Room for all three lanes: the first transfer leases them, the next reuses them.
    let pool = StagingPool::new(PoolConfig {
        limit: 8 * lane,
        ..PoolConfig::default()
    })
    .unwrap();
    let io = MemIo::with_pool(gpus.clone(), config.clone(), pool.clone()).unwrap();
    let len = (2 << 20) + 123;
    let mut src = vec![0u8; len];
    pattern::fill(&mut src, 0, 31);
    let dev = gpu.alloc(len).unwrap();
    let r = io.upload_staged(&src, &dev, 0).unwrap();
    assert!(matches!(r, Route::StagedPipeline { lanes: 3, .. }), "{r:?}");
    let leased = pool.stats();
    assert_eq!(leased.in_use_bytes, 3 * lane, "{leased:?}");
    assert_eq!(leased.allocations, 6);
    let mut back = vec![0u8; len];
    io.download_staged(&dev, 0, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 0, 31), None);
    let s = pool.stats();
    assert_eq!(
        (s.allocations, s.reuses, s.in_use_bytes),
        (6, 0, 3 * lane),
        "{s:?}"
    );
    assert_eq!(io.staging_bytes() as u64, 3 * lane);
    drop(io);
    let s = pool.stats();
    assert_eq!(
        (s.in_use_bytes, s.pinned_bytes),
        (0, 3 * lane),
        "back for reuse: {s:?}"
    );

    // Room for one lane: every transfer runs on it, concurrent ones take turns.
    let pool = StagingPool::new(PoolConfig {
        limit: lane,
        ..PoolConfig::default()
    })
    .unwrap();
    let io = Arc::new(MemIo::with_pool(gpus, config, pool.clone()).unwrap());
    let r = io.upload_staged(&src, &dev, 0).unwrap();
    assert!(matches!(r, Route::StagedPipeline { lanes: 1, .. }), "{r:?}");
    let src = Arc::new(src);
    let threads: Vec<_> = (0..3)
        .map(|t| {
            let (io, src, gpu) = (io.clone(), src.clone(), gpu.clone());
            std::thread::spawn(move || {
                let dev = gpu.alloc(len).unwrap();
                for _ in 0..4 {
                    io.upload_staged(&src, &dev, 0).unwrap();
                    let mut back = vec![t as u8; len];
                    io.download_staged(&dev, 0, &mut back).unwrap();
                    assert_eq!(pattern::first_deviation(&back, 0, 31), None);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = pool.stats();
    assert!(s.peak_pinned_bytes <= lane, "{s:?}");
    assert_eq!(s.failures, 0, "{s:?}");
    drop(io);
    assert_eq!(pool.stats().in_use_bytes, 0);
}
