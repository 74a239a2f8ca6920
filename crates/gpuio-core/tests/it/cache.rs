//! The multi-level block cache (docs/REFERENCE.md#block-cache) over a real file, with L1 on the
//! probed backend's GPU: a model check of random operations in both write modes, promotion and
//! demotion order, nothing lost on drop, prefetch, reads into device memory.

use gpuio_core::CoreError;
use gpuio_core::cache::{BlockCache, BlockState, CacheConfig, Level, PrefetchConfig, WriteMode};
use gpuio_hal::{BackendPreference, Gpu, probe};
use gpuio_transport_localio::{FileHandle, OpenOptions};
use proptest::prelude::*;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const BS: usize = 4096;
const FILE: usize = 64 << 10;
const BLOCKS: u64 = (FILE / BS) as u64;

fn gpu() -> Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| probe(BackendPreference::Auto).unwrap().gpus[0].clone())
        .clone()
}

/// Deterministic bytes for a seed (xorshift).
fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A temporary directory holding `data` (filled from `seed`) and room for L3.
struct Fixture {
    dir: tempfile::TempDir,
    path: PathBuf,
    model: Vec<u8>,
}

impl Fixture {
    fn new(len: usize, seed: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let model = bytes(len, seed);
        std::fs::write(&path, &model).unwrap();
        Self { dir, path, model }
    }

    fn backing(&self) -> Arc<FileHandle> {
        let opts = OpenOptions {
            write: true,
            ..OpenOptions::READ
        };
        Arc::new(FileHandle::open(&self.path, opts).unwrap())
    }

    fn on_disk(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap()
    }

    fn l3(&self) -> Option<PathBuf> {
        Some(self.dir.path().to_path_buf())
    }
}

/// L1 2 blocks, L2 2, L3 3: every level overflows within a few operations.
fn tiny(l3_dir: Option<PathBuf>, mode: WriteMode, prefetch: bool) -> CacheConfig {
    CacheConfig {
        block_size: BS,
        l1_blocks: 2,
        l2_blocks: 2,
        l3_blocks: 3,
        l3_dir,
        gpu: Some(gpu()),
        mode,
        prefetch: PrefetchConfig {
            enabled: prefetch,
            depth: 2,
            history: 16,
        },
    }
}

fn no_l3_files_left(dir: &Path) {
    let names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec!["data"], "L3's file is unlinked at once");
}

#[derive(Debug, Clone)]
enum Op {
    Read(usize, usize),
    Write(usize, usize, u64),
    Flush,
}

fn offset() -> impl Strategy<Value = usize> {
    prop_oneof![0..FILE, (0..FILE / BS).prop_map(|b| b * BS)]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (offset(), 1..3 * BS).prop_map(|(o, l)| Op::Read(o, l.min(FILE - o))),
        4 => (offset(), 1..3 * BS, any::<u64>())
            .prop_map(|(o, l, s)| Op::Write(o, l.min(FILE - o), s)),
        1 => Just(Op::Flush),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random reads, writes and flushes against a `Vec<u8>` model, in both modes, with and
    /// without the prefetcher running beside them.
    #[test]
    fn the_cache_behaves_like_the_bytes_behind_it(
        write_back in any::<bool>(),
        prefetch in any::<bool>(),
        seed in any::<u64>(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let mode = if write_back { WriteMode::WriteBack } else { WriteMode::WriteThrough };
        let mut fx = Fixture::new(FILE, seed);
        let cache = BlockCache::new(fx.backing(), tiny(fx.l3(), mode, prefetch)).unwrap();
        let (mut touched, mut seen) = (BTreeSet::new(), BTreeSet::new());
        for op in ops {
            match op {
                Op::Read(o, l) => {
                    let mut buf = vec![0; l];
                    cache.read(o as u64, &mut buf).unwrap();
                    prop_assert!(buf == fx.model[o..o + l], "read {}+{}", o, l);
                    touched.extend(o / BS..(o + l).div_ceil(BS));
                }
                Op::Write(o, l, s) => {
                    let data = bytes(l, s);
                    cache.write(o as u64, &data).unwrap();
                    fx.model[o..o + l].copy_from_slice(&data);
                    touched.extend(o / BS..(o + l).div_ceil(BS));
                    if mode == WriteMode::WriteThrough {
                        prop_assert!(fx.on_disk() == fx.model, "write-through {}+{}", o, l);
                    }
                }
                Op::Flush => {
                    cache.flush().unwrap();
                    prop_assert!(fx.on_disk() == fx.model, "after a flush");
                }
            }
            seen.extend((0..BLOCKS).filter_map(|b| cache.level_of(b)));
            if mode == WriteMode::WriteThrough {
                prop_assert!((0..BLOCKS).all(|b| cache.state_of(b) != BlockState::Dirty));
            }
        }
        // Levels fill top-down and never empty again: once more blocks were touched than fit
        // above a level, that level held blocks (demotion), and hits below promoted them.
        if !touched.is_empty() {
            prop_assert!(seen.contains(&Level::L1));
        }
        if touched.len() > 2 {
            prop_assert!(seen.contains(&Level::L2), "{:?} {:?}", touched, seen);
        }
        if touched.len() > 4 {
            prop_assert!(seen.contains(&Level::L3), "{:?} {:?}", touched, seen);
        }
        cache.flush().unwrap();
        prop_assert!(fx.on_disk() == fx.model);
        drop(cache);
        no_l3_files_left(fx.dir.path());
    }
}

#[test]
fn hits_promote_and_full_levels_demote_their_lru_block() {
    let fx = Fixture::new(FILE, 1);
    let cache = BlockCache::new(fx.backing(), tiny(fx.l3(), WriteMode::WriteBack, false)).unwrap();
    let mut buf = vec![0; BS];
    for b in 0..8u64 {
        cache.read(b * BS as u64, &mut buf).unwrap();
    }
    let levels = |c: &BlockCache| (0..9).map(|b| c.level_of(b)).collect::<Vec<_>>();
    use Level::*;
    // 0 fell off the bottom; the rest sit where their age puts them.
    assert_eq!(
        levels(&cache),
        [
            None,
            Some(L3),
            Some(L3),
            Some(L3),
            Some(L2),
            Some(L2),
            Some(L1),
            Some(L1),
            None
        ]
    );
    // A hit in L3 moves 2 up; L1's oldest (6) and L2's oldest (4) each move down one level,
    // into the slot 2 left.
    cache.read(2 * BS as u64 + 5, &mut buf[..10]).unwrap();
    assert_eq!(buf[..10], fx.model[2 * BS + 5..2 * BS + 15]);
    assert_eq!(
        levels(&cache),
        [
            None,
            Some(L3),
            Some(L1),
            Some(L3),
            Some(L3),
            Some(L2),
            Some(L2),
            Some(L1),
            None
        ]
    );
    let s = cache.stats();
    let (l1, l2, l3) = (
        s.level(L1).unwrap(),
        s.level(L2).unwrap(),
        s.level(L3).unwrap(),
    );
    assert_eq!(
        (l1.hits, l1.misses, l1.evictions, l1.resident),
        (0, 9, 7, 2)
    );
    assert_eq!(
        (l2.hits, l2.misses, l2.evictions, l2.resident),
        (0, 9, 5, 2)
    );
    assert_eq!(
        (l3.hits, l3.misses, l3.evictions, l3.resident),
        (1, 8, 1, 3)
    );
    assert_eq!(s.writebacks, 0);
    // Dirty blocks keep their state on the way down, and are written back off the bottom.
    for b in 0..8u64 {
        cache.write(b * BS as u64, &[b as u8; 3]).unwrap();
    }
    assert_eq!(cache.state_of(1), BlockState::Dirty);
    assert_eq!(cache.level_of(1), Some(L3));
    assert_eq!(cache.state_of(0), BlockState::Invalid);
    assert!(cache.stats().writebacks > 0);
    assert_eq!(
        fx.on_disk()[..3],
        [0; 3],
        "block 0 was written back on eviction"
    );
}

#[test]
fn dropping_a_write_back_cache_loses_nothing() {
    let mut fx = Fixture::new(FILE, 2);
    let cache = BlockCache::new(fx.backing(), tiny(fx.l3(), WriteMode::WriteBack, true)).unwrap();
    for i in 0..40u64 {
        let off = (i * 7919 * 13) as usize % (FILE - 100);
        let len = 1 + (i as usize * 997) % (2 * BS).min(FILE - off);
        let data = bytes(len, i);
        cache.write(off as u64, &data).unwrap();
        fx.model[off..off + len].copy_from_slice(&data);
    }
    let dirty = (0..BLOCKS)
        .filter(|&b| cache.state_of(b) == BlockState::Dirty)
        .count();
    assert!(dirty > 0);
    assert_ne!(fx.on_disk(), fx.model);
    drop(cache);
    assert_eq!(fx.on_disk(), fx.model);
    no_l3_files_left(fx.dir.path());
}

#[test]
fn ranges_outside_the_store_are_refused_with_their_numbers() {
    let fx = Fixture::new(10_000, 3);
    let cache = BlockCache::new(fx.backing(), tiny(None, WriteMode::WriteBack, false)).unwrap();
    assert_eq!(cache.len(), 10_000);
    // The last block is partial.
    let mut buf = vec![0; 10_000];
    cache.read(0, &mut buf).unwrap();
    assert_eq!(buf, fx.model);
    let err = cache.read(9_000, &mut [0; 1001]).unwrap_err();
    assert!(matches!(err, CoreError::InvalidRequest(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("9000") && msg.contains("1001") && msg.contains("10000"),
        "{msg}"
    );
    assert!(cache.write(u64::MAX, &[1]).is_err());
    let dst = gpu().alloc(100).unwrap();
    assert!(cache.read_to_device(0, 101, &dst, 0).is_err());
    assert!(cache.read_to_device(0, 10, &dst, 91).is_err());
}

/// Reads `blocks` one block at a time like a consumer that computes on each: with `patient`,
/// it computes until the next block is cached (at most 20 ms, so a prefetch that never comes
/// costs little), which keeps the test independent of how busy the machine is.
fn scan(cache: &BlockCache, fx: &Fixture, blocks: &[u64], patient: bool) {
    let mut buf = vec![0; BS];
    for (i, &b) in blocks.iter().enumerate() {
        let off = b as usize * BS;
        cache.read(off as u64, &mut buf).unwrap();
        assert_eq!(buf, fx.model[off..off + BS]);
        let start = Instant::now();
        let next = blocks.get(i + 1).copied();
        while patient
            && next.is_some_and(|n| cache.level_of(n).is_none())
            && start.elapsed() < Duration::from_millis(20)
        {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

fn prefetching(fx: &Fixture) -> BlockCache {
    let cfg = CacheConfig {
        block_size: BS,
        l1_blocks: 4,
        l2_blocks: 16,
        l3_blocks: 0,
        l3_dir: None,
        gpu: Some(gpu()),
        mode: WriteMode::WriteBack,
        prefetch: PrefetchConfig {
            enabled: true,
            depth: 4,
            history: 64,
        },
    };
    BlockCache::new(fx.backing(), cfg).unwrap()
}

#[test]
fn a_sequential_scan_hits_prefetched_blocks() {
    let fx = Fixture::new(128 * BS, 4);
    let cache = prefetching(&fx);
    scan(&cache, &fx, &(0..128).collect::<Vec<_>>(), true);
    let s = cache.stats();
    // All but the first two blocks are predicted; half is plenty on a loaded machine.
    assert!(s.prefetch_useful >= 64, "{s:?}");
    assert!(s.prefetch_issued >= s.prefetch_useful, "{s:?}");
    assert!(
        s.level(Level::L2).unwrap().hits > 0,
        "prefetched into L2: {s:?}"
    );
}

#[test]
fn a_strided_scan_hits_prefetched_blocks() {
    let fx = Fixture::new(192 * BS, 5);
    let cache = prefetching(&fx);
    scan(&cache, &fx, &(0..192).step_by(3).collect::<Vec<_>>(), true);
    let s = cache.stats();
    assert!(s.prefetch_useful >= 32, "{s:?}");
}

#[test]
fn a_repeated_irregular_pattern_hits_prefetched_blocks() {
    let fx = Fixture::new(256 * BS, 6);
    let cache = prefetching(&fx);
    // Far more blocks than the cache holds, so the second pass finds them only by prefetch.
    let pattern: Vec<u64> = (0..40u64)
        .map(|i| (i * i * 37 + i * 11 + 5) % 256)
        .collect();
    scan(&cache, &fx, &pattern, false);
    let before = cache.stats().prefetch_useful;
    scan(&cache, &fx, &pattern, true);
    let s = cache.stats();
    assert!(s.prefetch_useful > before, "{s:?}");
}

#[test]
fn read_to_device_round_trips() {
    let mut fx = Fixture::new(FILE, 7);
    let gpu = gpu();
    let cache = BlockCache::new(fx.backing(), tiny(fx.l3(), WriteMode::WriteBack, false)).unwrap();
    // Cached data newer than the file is what the device gets.
    cache.write(BS as u64 - 3, &[0xAB; 7]).unwrap();
    fx.model[BS - 3..BS + 4].fill(0xAB);
    let stream = gpu.stream().unwrap();
    let (off, len, at) = (BS - 100, 2 * BS - 50, 33);
    let dst = gpu.alloc(len + 64).unwrap();
    let mut back = vec![0; len];
    // Blocks cached in L1 are copied device to device, missed ones through host memory; the
    // second pass hits L2 and promotes.
    for pass in 0..2 {
        stream.upload(&vec![0; len + 64], &dst, 0).unwrap();
        cache.read_to_device(off as u64, len, &dst, at).unwrap();
        stream.download(&dst, at, &mut back).unwrap();
        assert!(back == fx.model[off..off + len], "pass {pass}");
        if pass == 0 {
            assert_eq!(cache.level_of(1), Some(Level::L1));
            assert_eq!(cache.level_of(2), Some(Level::L1));
            assert_eq!(cache.level_of(0), Some(Level::L2));
        }
    }
    // Blocks in L3 too.
    for b in 4..10u64 {
        cache.read(b * BS as u64, &mut [0; 1]).unwrap();
    }
    assert_eq!(cache.level_of(4), Some(Level::L3));
    cache
        .read_to_device(4 * BS as u64 + 1, 100, &dst, 0)
        .unwrap();
    let mut small = vec![0; 100];
    stream.download(&dst, 0, &mut small).unwrap();
    assert_eq!(small, fx.model[4 * BS + 1..4 * BS + 101]);
}

#[test]
fn levels_can_be_left_out() {
    let fx = Fixture::new(FILE, 8);
    let only_l3 = CacheConfig {
        block_size: BS,
        l1_blocks: 0,
        l2_blocks: 0,
        l3_blocks: 2,
        l3_dir: fx.l3(),
        gpu: None,
        mode: WriteMode::WriteBack,
        // Off: predicted blocks would push the ones read out of two slots.
        prefetch: PrefetchConfig {
            enabled: false,
            ..PrefetchConfig::default()
        },
    };
    let cache = BlockCache::new(fx.backing(), only_l3).unwrap();
    let mut buf = vec![0; 3 * BS];
    cache.read(BS as u64, &mut buf).unwrap();
    assert_eq!(buf, fx.model[BS..4 * BS]);
    assert_eq!(cache.level_of(3), Some(Level::L3));
    assert_eq!(cache.stats().levels.len(), 1);
    // Without L1, reads into device memory go through host memory.
    let gpu = gpu();
    let dst = gpu.alloc(BS).unwrap();
    cache
        .read_to_device(3 * BS as u64 + 9, BS - 9, &dst, 9)
        .unwrap();
    let mut back = vec![0; BS - 9];
    gpu.stream().unwrap().download(&dst, 9, &mut back).unwrap();
    assert_eq!(back, fx.model[3 * BS + 9..4 * BS]);
}

#[test]
fn threads_sharing_a_cache_see_their_own_writes() {
    let fx = Fixture::new(FILE, 9);
    let cache =
        Arc::new(BlockCache::new(fx.backing(), tiny(fx.l3(), WriteMode::WriteBack, true)).unwrap());
    const REGION: usize = FILE / 4;
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let cache = Arc::clone(&cache);
            let mut model = fx.model[t * REGION..(t + 1) * REGION].to_vec();
            std::thread::spawn(move || {
                let base = t * REGION;
                for i in 0..150usize {
                    let r = bytes(3, (t * 1000 + i) as u64);
                    let off = (r[0] as usize * 61 + r[1] as usize * 7) % REGION;
                    let len = (1 + r[2] as usize * 29).min(REGION - off);
                    if i % 3 == 0 {
                        let data = bytes(len, i as u64);
                        cache.write((base + off) as u64, &data).unwrap();
                        model[off..off + len].copy_from_slice(&data);
                    } else {
                        let mut buf = vec![0; len];
                        cache.read((base + off) as u64, &mut buf).unwrap();
                        assert!(buf == model[off..off + len], "thread {t} op {i}");
                    }
                    if i % 25 == 24 {
                        cache.flush().unwrap();
                    }
                }
                model
            })
        })
        .collect();
    let model: Vec<u8> = workers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect();
    drop(Arc::into_inner(cache).unwrap());
    assert_eq!(fx.on_disk(), model);
}
