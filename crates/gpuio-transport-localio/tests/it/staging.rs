//! LocalIO's lanes on a shared staging pool, on both queue engines where the machine has them:
//! a lane leases its slots once (registered with its ring) and keeps them across transfers; a
//! pool with room for one lane still moves everything, on one lane; and the slots go back to
//! the pool, unregistered, when the engine goes.

use gpuio_hal::{BackendPreference, pattern, probe};
use gpuio_staging::{PoolConfig, StagingPool};
use gpuio_transport_localio::{Durability, EnginePreference, LocalIo, LocalIoConfig, OpenOptions};

fn config(engine: EnginePreference) -> LocalIoConfig {
    LocalIoConfig {
        engine,
        chunk_size: 64 << 10,
        lanes: 3,
        slots_per_lane: 2,
        ..LocalIoConfig::default()
    }
}

#[test]
fn lanes_lease_their_slots_once_and_give_them_back() {
    let gpu = probe(BackendPreference::Auto).unwrap().gpus[0].clone();
    let dir = tempfile::tempdir().unwrap();
    let len = (1 << 20) + 4321;
    let mut data = vec![0u8; len];
    pattern::fill(&mut data, 0, 17);
    let path = dir.path().join("src");
    std::fs::write(&path, &data).unwrap();
    for pref in [EnginePreference::Uring, EnginePreference::Posix] {
        let config = config(pref);
        let lane = config.lane_staging_bytes(&PoolConfig::default()).unwrap();
        assert_eq!(lane, 2 * (64 << 10));
        for (limit, lanes) in [(8 * lane, 3), (lane, 1)] {
            let pool = StagingPool::new(PoolConfig {
                limit,
                ..PoolConfig::default()
            })
            .unwrap();
            let io = match LocalIo::with_pool(config.clone(), pool.clone()) {
                Ok(io) => io,
                Err(e) => {
                    eprintln!("skipped {pref:?}: {e}");
                    break;
                }
            };
            let f = io.open(&path, OpenOptions::READ).unwrap();
            let dev = gpu.alloc(len).unwrap();
            for i in 0..3 {
                let t = io.read_to_device(&f, 0, &dev, 0, len).unwrap();
                // The first read starts on the first lane made; the others join as they are
                // made, and are all there for the next.
                match i {
                    0 => assert!((1..=lanes).contains(&t.lanes), "{pref:?} {t:?}"),
                    _ => assert_eq!(t.lanes, lanes, "{pref:?} {t:?}"),
                }
            }
            let mut back = vec![0u8; len];
            gpu.stream().unwrap().download(&dev, 0, &mut back).unwrap();
            assert_eq!(pattern::first_deviation(&back, 0, 17), None);
            // Leased once, kept across the transfers.
            let s = pool.stats();
            assert_eq!(s.allocations, 2 * lanes as u64, "{pref:?} {s:?}");
            assert_eq!(s.in_use_bytes, lanes as u64 * lane, "{s:?}");
            assert_eq!(io.staging_bytes(), lanes as u64 * lane);
            // Writes through the same lanes.
            let out = dir.path().join(format!("out-{pref:?}-{lanes}"));
            let w = io.open(&out, OpenOptions::CREATE).unwrap();
            let t = io
                .write_from_device(&dev, 0, &w, 0, len, Durability::None)
                .unwrap();
            assert_eq!(t.lanes, lanes);
            assert_eq!(std::fs::read(&out).unwrap(), data);
            assert_eq!(pool.stats().allocations, 2 * lanes as u64);
            drop(io);
            let s = pool.stats();
            assert_eq!(s.in_use_bytes, 0, "{s:?}");
            assert_eq!(s.pinned_bytes, lanes as u64 * lane, "back for reuse: {s:?}");
        }
    }
}
