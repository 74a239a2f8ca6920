//! Unit tests of the block cache's internals: a flush racing a write, how requests are cut
//! into blocks, the checks of a cache's configuration, and the upload streams kept between
//! reads to device memory.

use super::*;
use std::sync::mpsc;

/// Host memory as a backing store whose writes can be held at a gate.
#[derive(Debug, Default)]
struct Gated {
    data: Mutex<Vec<u8>>,
    gate: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
}

impl BackingStore for Gated {
    fn len(&self) -> Result<u64> {
        Ok(self.data.lock().unwrap().len() as u64)
    }
    fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        let d = self.data.lock().unwrap();
        buf.copy_from_slice(&d[off as usize..off as usize + buf.len()]);
        Ok(())
    }
    fn write_at(&self, off: u64, buf: &[u8]) -> Result<()> {
        // The first write after the gate is armed says it arrived and waits for release.
        if let Some((entered, release)) = self.gate.lock().unwrap().take() {
            entered.send(()).unwrap();
            release.recv().unwrap();
        }
        self.data.lock().unwrap()[off as usize..off as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn sync(&self) -> Result<()> {
        Ok(())
    }
}

#[test]
fn a_write_during_a_flush_makes_the_block_dirty_again() {
    let store = Arc::new(Gated {
        data: Mutex::new(vec![0; 4096]),
        ..Gated::default()
    });
    let cache = Arc::new(
        BlockCache::new(
            store.clone(),
            CacheConfig {
                block_size: 1024,
                l2_blocks: 4,
                prefetch: PrefetchConfig {
                    enabled: false,
                    ..PrefetchConfig::default()
                },
                ..CacheConfig::default()
            },
        )
        .unwrap(),
    );
    cache.write(1024, &[1; 1024]).unwrap();
    assert_eq!(cache.state_of(1), BlockState::Dirty);

    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    *store.gate.lock().unwrap() = Some((entered_tx, release_rx));
    let flusher = {
        let cache = Arc::clone(&cache);
        std::thread::spawn(move || cache.flush())
    };
    entered.recv().unwrap();
    assert_eq!(cache.state_of(1), BlockState::Flushing);
    // The directory is not locked during the write-back: this write goes through.
    cache.write(1024 + 10, &[2; 4]).unwrap();
    assert_eq!(cache.state_of(1), BlockState::Dirty);
    release.send(()).unwrap();
    flusher.join().unwrap().unwrap();
    // The flush wrote the older copy and left the newer one dirty.
    assert_eq!(cache.state_of(1), BlockState::Dirty);
    assert_eq!(store.data.lock().unwrap()[1024 + 10], 1);
    cache.flush().unwrap();
    assert_eq!(cache.state_of(1), BlockState::Valid);
    assert_eq!(store.data.lock().unwrap()[1024 + 10..1024 + 14], [2; 4]);
    assert_eq!(cache.stats().writebacks, 2);
}

#[test]
fn pieces_cut_at_block_boundaries() {
    let store = Arc::new(Gated {
        data: Mutex::new(vec![0; 2500]),
        ..Gated::default()
    });
    let cache = BlockCache::new(
        store,
        CacheConfig {
            block_size: 1000,
            l2_blocks: 1,
            ..CacheConfig::default()
        },
    )
    .unwrap();
    let s = &cache.shared;
    assert_eq!(s.nblocks, 3);
    assert_eq!(s.block_len(2), 500);
    let p: Vec<_> = s.pieces(900, 1300).collect();
    assert_eq!(p, vec![(0, 900, 100), (1, 0, 1000), (2, 0, 200)]);
    assert_eq!(s.check(900, 1300).unwrap(), 0..3);
    assert!(s.check(2000, 501).is_err());
    assert!(s.check(u64::MAX, 2).is_err());
}

#[test]
fn a_cache_needs_a_level_and_a_sane_block_size() {
    let store: Arc<dyn BackingStore> = Arc::new(Gated::default());
    let none = CacheConfig {
        l2_blocks: 0,
        ..CacheConfig::default()
    };
    assert!(matches!(
        BlockCache::new(store.clone(), none),
        Err(CoreError::InvalidRequest(_))
    ));
    let zero = CacheConfig {
        block_size: 0,
        ..CacheConfig::default()
    };
    assert!(matches!(
        BlockCache::new(store, zero),
        Err(CoreError::InvalidRequest(_))
    ));
}

#[test]
fn reads_to_device_reuse_their_upload_stream() {
    let mut data = vec![0u8; 8192];
    gpuio_hal::pattern::fill(&mut data, 0, 3);
    let store = Arc::new(Gated {
        data: Mutex::new(data),
        ..Gated::default()
    });
    let cache = BlockCache::new(
        store,
        CacheConfig {
            block_size: 1024,
            l2_blocks: 8,
            prefetch: PrefetchConfig {
                enabled: false,
                ..PrefetchConfig::default()
            },
            ..CacheConfig::default()
        },
    )
    .unwrap();
    let gpu = gpuio_hal::probe_with(gpuio_hal::BackendPreference::Host, 1)
        .unwrap()
        .gpus
        .remove(0);
    let dst = gpu.alloc(4096).unwrap();
    let mut back = vec![0u8; 3000];
    for (i, off) in [100u64, 5000, 100].into_iter().enumerate() {
        cache.read_to_device(off, 3000, &dst, 7).unwrap();
        gpu.stream().unwrap().download(&dst, 7, &mut back).unwrap();
        assert_eq!(gpuio_hal::pattern::first_deviation(&back, off, 3), None);
        // The miss, the hit and the second hit each uploaded through the one kept stream.
        let kept = cache.uploads.lock().unwrap();
        assert_eq!(kept.len(), 1, "read {i}");
        assert!(kept[0].gpu().same_device(&gpu));
    }
    // A refused read takes no stream and loses none.
    assert!(cache.read_to_device(0, 10_000, &dst, 0).is_err());
    assert_eq!(cache.uploads.lock().unwrap().len(), 1);
}
