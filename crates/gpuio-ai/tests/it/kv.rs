//! The DSA KV pool against a model of its bytes: decode steps whose top-k selections overlap
//! the step before, loads checked entry by entry against what was stored, a hot buffer small
//! enough to thrash, entries rewritten between steps (a load must never return the old
//! bytes), repeated positions, and bad arguments refused.

use gpuio_ai::AiError;
use gpuio_ai::compress::Codec;
use gpuio_ai::kv::{ColdTier, KvPool, KvPoolConfig, Tier};
use gpuio_api::{Config, DeviceBuffer, HostPlacement, Session};
use gpuio_hal::pattern;

const E: usize = 656;

fn config() -> KvPoolConfig {
    KvPoolConfig {
        layers: 2,
        entry_bytes: E,
        max_tokens: 3000,
        warm_entries: 6000,
        hot_slots: 96,
        max_selection: 64,
        gpu: 0,
        placement: HostPlacement::Dram { numa: None },
    }
}

/// The bytes of entry (layer, pos) as written in generation `gen`.
fn entry(layer: usize, pos: u64, generation: u64) -> Vec<u8> {
    let mut v = vec![0u8; E];
    pattern::fill(&mut v, 0, (layer as u64) << 48 ^ pos << 8 ^ generation);
    v
}

/// `len` bytes of `buf` from `offset`.
fn download(buf: &DeviceBuffer, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let stream = buf.gpu().stream().unwrap();
    stream.download(buf, offset, &mut out).unwrap();
    out
}

fn upload(session: &Session, bytes: &[u8]) -> DeviceBuffer {
    let buf = session.alloc_device(0, bytes.len().max(1)).unwrap();
    buf.gpu().stream().unwrap().upload(bytes, &buf, 0).unwrap();
    buf
}

#[test]
fn overlapping_selections_load_exactly_what_was_stored() {
    let session = Session::new(Config::default()).unwrap();
    let cfg = config();
    let mut pool = KvPool::new(&session, cfg).unwrap();
    let tokens = 2500u64;
    let mut generation = vec![vec![0u64; tokens as usize]; cfg.layers];
    for layer in 0..cfg.layers {
        let bytes: Vec<u8> = (0..tokens).flat_map(|p| entry(layer, p, 0)).collect();
        let scores: Vec<f32> = (0..tokens).map(|p| p as f32).collect();
        let src = upload(&session, &bytes);
        pool.store(&session, layer, 0, tokens as usize, &src, 0, Some(&scores))
            .unwrap();
    }
    assert_eq!(pool.len(1), tokens);
    assert_eq!(pool.importance(1, 7), 7.0);
    let dst = session.alloc_device(0, cfg.max_selection * E).unwrap();
    let mut selection: Vec<u64> = (0..cfg.max_selection as u64).collect();
    let (mut hits, mut seen) = (0, 0);
    for step in 0..60u64 {
        let layer = (step % 2) as usize;
        // Keep ~90% of the previous selection, replace the rest at random.
        for (i, p) in selection.iter_mut().enumerate() {
            if pattern::mix64(step << 20 ^ i as u64).is_multiple_of(10) {
                *p = pattern::mix64(step ^ (i as u64) << 32) % tokens;
            }
        }
        if step % 7 == 3 {
            selection[5] = selection[9]; // a repeat
        }
        if step % 11 == 4 {
            // Rewrite some entries the hot buffer holds: the next load must see the new bytes.
            for &p in &selection[..4] {
                generation[layer][p as usize] += 1;
                let src = upload(&session, &entry(layer, p, generation[layer][p as usize]));
                pool.store(&session, layer, p, 1, &src, 0, None).unwrap();
            }
        }
        let r = pool.load(layer, &selection, &dst, 0).unwrap();
        assert_eq!(r.selected, selection.len());
        assert!(pool.hot_entries(layer) <= cfg.hot_slots);
        hits += r.hits;
        seen += r.selected;
        let out = download(&dst, 0, selection.len() * E);
        for (i, &p) in selection.iter().enumerate() {
            let want = entry(layer, p, generation[layer][p as usize]);
            assert!(
                out[i * E..(i + 1) * E] == want[..],
                "step {step}: entry {i} (position {p})"
            );
        }
        // The same selection again: every entry is in the hot buffer now.
        let again = pool.load(layer, &selection, &dst, 0).unwrap();
        assert_eq!(
            (again.hits, again.misses),
            (selection.len(), 0),
            "step {step}"
        );
    }
    let rate = hits as f64 / seen as f64;
    assert!(rate > 0.5, "an overlapping trace should mostly hit: {rate}");
}

#[test]
fn bad_arguments_are_refused_before_anything_moves() {
    let session = Session::new(Config::default()).unwrap();
    let cfg = config();
    let mut pool = KvPool::new(&session, cfg).unwrap();
    let src = upload(&session, &entry(0, 0, 0).repeat(4));
    let dst = session.alloc_device(0, cfg.max_selection * E).unwrap();
    pool.store(&session, 0, 0, 4, &src, 0, None).unwrap();
    // A gap, past max_tokens, a layer that is not there, scores of the wrong count.
    assert!(pool.store(&session, 0, 5, 1, &src, 0, None).is_err());
    assert!(
        pool.store(&session, 0, cfg.max_tokens, 1, &src, 0, None)
            .is_err()
    );
    assert!(pool.store(&session, 2, 0, 1, &src, 0, None).is_err());
    assert!(
        pool.store(&session, 0, 0, 2, &src, 0, Some(&[1.0]))
            .is_err()
    );
    // A source too short for the entries: refused, and the pool holds what it held.
    let free = pool.warm_free();
    assert!(pool.store(&session, 0, 4, 10, &src, 0, None).is_err());
    assert_eq!((pool.len(0), pool.warm_free()), (4, free));
    // Loads of unstored positions, too many, too small a destination.
    assert!(pool.load(0, &[4], &dst, 0).is_err());
    assert!(
        pool.load(0, &vec![0; cfg.max_selection + 1], &dst, 0)
            .is_err()
    );
    assert!(pool.load(0, &[0, 1], &dst, dst.len() - E).is_err());
    assert_eq!(pool.load(0, &[], &dst, 0).unwrap().selected, 0);
    // Shapes that cannot work.
    for bad in [
        KvPoolConfig {
            max_selection: 97,
            ..cfg
        },
        KvPoolConfig { layers: 0, ..cfg },
        KvPoolConfig {
            max_tokens: u64::MAX,
            ..cfg
        },
    ] {
        assert!(KvPool::new(&session, bad).is_err(), "{bad:?}");
    }
}

/// A pool whose host memory holds 600 of its 1000 entries, with a cold tier in a file.
fn tiered(session: &Session, cold: bool) -> (KvPool, Option<tempfile::TempDir>) {
    let cfg = KvPoolConfig {
        layers: 2,
        max_tokens: 500,
        warm_entries: 600,
        ..config()
    };
    let mut pool = KvPool::new(session, cfg).unwrap();
    if !cold {
        return (pool, None);
    }
    let dir = tempfile::tempdir().unwrap();
    let file = session
        .open_file(dir.path().join("cold"), gpuio_api::OpenOptions::CREATE)
        .unwrap();
    pool.attach_cold_tier(ColdTier::new(file, Codec::Lz4).unwrap())
        .unwrap();
    (pool, Some(dir))
}

/// Stores `n` entries of `layer` from `first`, importance from `score(pos)`.
fn fill(
    session: &Session,
    pool: &mut KvPool,
    layer: usize,
    first: u64,
    n: u64,
    score: impl Fn(u64) -> f32,
) -> gpuio_ai::Result<()> {
    let bytes: Vec<u8> = (first..first + n)
        .flat_map(|p| entry(layer, p, 0))
        .collect();
    let scores: Vec<f32> = (first..first + n).map(score).collect();
    let src = upload(session, &bytes);
    pool.store(session, layer, first, n as usize, &src, 0, Some(&scores))
}

#[test]
fn evicted_entries_go_cold_least_important_first_and_come_back_exact() {
    let session = Session::new(Config::default()).unwrap();
    let (mut pool, _dir) = tiered(&session, true);
    let score = |p: u64| (pattern::mix64(p) % 1000) as f32;
    fill(&session, &mut pool, 0, 0, 500, score).unwrap();
    fill(&session, &mut pool, 1, 0, 100, score).unwrap();
    assert_eq!(pool.warm_free(), 0);
    let e = fill(&session, &mut pool, 1, 100, 1, score).unwrap_err();
    assert!(matches!(e, AiError::TierFull(_)), "{e}");
    // Free 200 entries' worth from those under 800, least important first.
    let r = pool.evict_by_importance(200 * E as u64, 800.0).unwrap();
    assert_eq!(
        (r.evicted, r.to_cold, r.bytes_freed),
        (200, 200, 200 * E as u64)
    );
    let cold: Vec<f32> = (0..2)
        .flat_map(|l| (0..pool.len(l)).map(move |p| (l, p)))
        .filter(|&(l, p)| pool.tier_of(l, p) == Some(Tier::Cold))
        .map(|(l, p)| pool.importance(l, p))
        .collect();
    let warm_low = (0..2)
        .flat_map(|l| (0..pool.len(l)).map(move |p| (l, p)))
        .filter(|&(l, p)| pool.tier_of(l, p) == Some(Tier::Warm))
        .map(|(l, p)| pool.importance(l, p))
        .fold(f32::INFINITY, f32::min);
    assert_eq!(cold.len(), 200);
    assert!(
        cold.iter().all(|&c| c <= warm_low && c < 800.0),
        "evicted out of order"
    );
    // Cold entries come back byte-exact when selected.
    fill(&session, &mut pool, 1, 100, 150, score).unwrap();
    let picked: Vec<u64> = (0..500)
        .filter(|&p| pool.tier_of(0, p) == Some(Tier::Cold))
        .take(40)
        .collect();
    let dst = session.alloc_device(0, picked.len() * E).unwrap();
    let r = pool.load(0, &picked, &dst, 0).unwrap();
    assert_eq!(r.from_cold, picked.len());
    let out = download(&dst, 0, picked.len() * E);
    for (i, &p) in picked.iter().enumerate() {
        assert!(
            out[i * E..(i + 1) * E] == entry(0, p, 0)[..],
            "position {p}"
        );
        assert_eq!(pool.tier_of(0, p), Some(Tier::Warm));
    }
    // Host memory full again: a cold miss is refused, nothing moved.
    while pool.warm_free() > 0 {
        let l = pool.len(1);
        fill(&session, &mut pool, 1, l, 1, score).unwrap();
    }
    let still_cold = (0..500)
        .find(|&p| pool.tier_of(0, p) == Some(Tier::Cold))
        .unwrap();
    let e = pool.load(0, &[still_cold], &dst, 0).unwrap_err();
    assert!(matches!(e, AiError::TierFull(_)), "{e}");
    assert!(pool.cold_tier().unwrap().raw_bytes() >= 200 * E as u64);
    // One cold tier for the pool's life.
    let other = session
        .open_file(
            _dir.as_ref().unwrap().path().join("other"),
            gpuio_api::OpenOptions::CREATE,
        )
        .unwrap();
    assert!(
        pool.attach_cold_tier(ColdTier::new(other, Codec::Lz4).unwrap())
            .is_err()
    );
}

#[test]
fn without_a_cold_tier_evicted_entries_are_dropped_and_say_so() {
    let session = Session::new(Config::default()).unwrap();
    let (mut pool, _) = tiered(&session, false);
    fill(&session, &mut pool, 0, 0, 100, |p| p as f32).unwrap();
    assert!(pool.compact(10.0).is_err(), "compact needs a cold tier");
    let r = pool.evict_by_importance(1, 10.0).unwrap();
    assert_eq!((r.evicted, r.to_cold), (1, 0));
    assert_eq!(pool.tier_of(0, 0), Some(Tier::Dropped));
    let dst = session.alloc_device(0, E).unwrap();
    let e = pool.load(0, &[0], &dst, 0).unwrap_err();
    assert!(e.to_string().contains("evicted"), "{e}");
    // Stored again, it is back.
    fill(&session, &mut pool, 0, 0, 1, |_| 5.0).unwrap();
    assert_eq!(pool.tier_of(0, 0), Some(Tier::Warm));
    pool.load(0, &[0], &dst, 0).unwrap();
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Eviction takes exactly the least important entries under the threshold (ties by
    /// layer, then position), as many as the bytes asked for need.
    #[test]
    fn eviction_takes_the_least_important_under_the_threshold(
        scores in proptest::collection::vec(0u32..50, 1..200),
        want in 0usize..250,
        threshold in 0u32..60,
    ) {
        let session = Session::new(Config::default()).unwrap();
        let (mut pool, _) = tiered(&session, false);
        let n = scores.len() as u64;
        fill(&session, &mut pool, 0, 0, n, |p| scores[p as usize] as f32).unwrap();
        let r = pool.evict_by_importance((want * E) as u64, threshold as f32).unwrap();
        let mut under: Vec<(u32, u64)> = (0..n).map(|p| (scores[p as usize], p)).filter(|&(s, _)| s < threshold).collect();
        under.sort();
        let expected: Vec<u64> = under.iter().take(want).map(|&(_, p)| p).collect();
        let mut dropped: Vec<u64> = (0..n).filter(|&p| pool.tier_of(0, p) == Some(Tier::Dropped)).collect();
        dropped.sort();
        let mut expected_sorted = expected.clone();
        expected_sorted.sort();
        proptest::prop_assert_eq!(r.evicted, expected.len());
        proptest::prop_assert_eq!(dropped, expected_sorted);
    }
}

#[test]
fn a_damaged_cold_tier_is_an_error_never_wrong_bytes() {
    let session = Session::new(Config::default()).unwrap();
    let (mut pool, dir) = tiered(&session, true);
    fill(&session, &mut pool, 0, 0, 50, |p| p as f32).unwrap();
    pool.compact(10.0).unwrap();
    assert_eq!(pool.tier_of(0, 3), Some(Tier::Cold));
    // Flip bytes all through the cold file.
    let path = dir.as_ref().unwrap().path().join("cold");
    let mut bytes = std::fs::read(&path).unwrap();
    for b in bytes.iter_mut().skip(25).step_by(97) {
        *b ^= 0x5a;
    }
    std::fs::write(&path, &bytes).unwrap();
    let dst = session.alloc_device(0, 10 * E).unwrap();
    let e = pool
        .load(0, &(0..10).collect::<Vec<_>>(), &dst, 0)
        .unwrap_err();
    assert!(matches!(e, AiError::Corrupt(_)), "{e}");
}

/// A batch of requests loaded by one call gives each request exactly what a load of its own
/// would: several pools, overlapping steps, outputs packed at offsets of one buffer. A batch
/// with one bad load moves nothing, and the pools keep serving right bytes afterwards.
#[test]
fn a_batch_loads_every_request_as_its_own_load_would() {
    use gpuio_ai::kv::{KvBatch, KvLoad};
    let session = Session::new(Config::default()).unwrap();
    let cfg = KvPoolConfig {
        layers: 1,
        warm_entries: 3000,
        ..config()
    };
    let tokens = 800u64;
    let requests = 5;
    let mut pools: Vec<KvPool> = (0..requests)
        .map(|r| {
            let mut pool = KvPool::new(&session, cfg).unwrap();
            let bytes: Vec<u8> = (0..tokens).flat_map(|p| entry(r, p, 0)).collect();
            let src = upload(&session, &bytes);
            pool.store(&session, 0, 0, tokens as usize, &src, 0, None)
                .unwrap();
            pool
        })
        .collect();
    let stride = cfg.max_selection * E + 16;
    let dst = session.alloc_device(0, requests * stride).unwrap();
    let mut batch = KvBatch::new();
    let mut selections: Vec<Vec<u64>> = (0..requests)
        .map(|r| (0..cfg.max_selection as u64 - r as u64).collect())
        .collect();
    let mut hits = 0;
    for step in 0..30u64 {
        for (r, sel) in selections.iter_mut().enumerate() {
            for (i, p) in sel.iter_mut().enumerate() {
                if pattern::mix64(step << 20 ^ (r as u64) << 10 ^ i as u64).is_multiple_of(8) {
                    *p = pattern::mix64(step ^ (i as u64) << 32 ^ r as u64) % tokens;
                }
            }
        }
        let mut loads: Vec<KvLoad<'_>> = pools
            .iter_mut()
            .zip(&selections)
            .enumerate()
            .map(|(r, (pool, sel))| KvLoad {
                pool,
                layer: 0,
                selection: sel,
                dst: &dst,
                dst_offset: r * stride,
            })
            .collect();
        let reports = batch.load(&mut loads).unwrap();
        for (r, (rep, sel)) in reports.iter().zip(&selections).enumerate() {
            assert_eq!(rep.selected, sel.len());
            hits += rep.hits;
            let got = download(&dst, r * stride, sel.len() * E);
            for (i, &p) in sel.iter().enumerate() {
                assert!(
                    got[i * E..(i + 1) * E] == entry(r, p, 0)[..],
                    "step {step}, request {r}, entry {i} (position {p})"
                );
            }
        }
    }
    assert!(hits > 0, "the overlapping steps never hit the hot buffers");
    // Request 3's destination overlaps request 2's: refused, nothing moves.
    let before: Vec<usize> = pools.iter().map(|p| p.hot_entries(0)).collect();
    let mut loads: Vec<KvLoad<'_>> = pools
        .iter_mut()
        .zip(&selections)
        .enumerate()
        .map(|(r, (pool, sel))| KvLoad {
            pool,
            layer: 0,
            selection: &sel[..],
            dst: &dst,
            dst_offset: if r == 3 { 2 * stride + E } else { r * stride },
        })
        .collect();
    let e = batch.load(&mut loads).unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    drop(loads);
    let after: Vec<usize> = pools.iter().map(|p| p.hot_entries(0)).collect();
    assert!(after.iter().zip(&before).all(|(a, b)| a <= b));
    // The pools still load right bytes on their own.
    for (r, pool) in pools.iter_mut().enumerate() {
        pool.load(0, &selections[r], &dst, 0).unwrap();
        let got = download(&dst, 0, selections[r].len() * E);
        for (i, &p) in selections[r].iter().enumerate() {
            assert!(
                got[i * E..(i + 1) * E] == entry(r, p, 0)[..],
                "request {r} after the refusal"
            );
        }
    }
}
