//! The DSA KV pool against a model of its bytes: decode steps whose top-k selections overlap
//! the step before, loads checked entry by entry against what was stored, a hot buffer small
//! enough to thrash, entries rewritten between steps (a load must never return the old
//! bytes), repeated positions, and bad arguments refused.

use gpuio_ai::kv::{KvPool, KvPoolConfig};
use gpuio_api::{Config, DeviceBuffer, HostPlacement, Session};
use gpuio_hal::pattern;

const E: usize = 656;

fn config() -> KvPoolConfig {
    KvPoolConfig {
        layers: 2,
        entry_bytes: E,
        max_tokens: 3000,
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
        pool.store(layer, 0, tokens as usize, &src, 0, Some(&scores))
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
                pool.store(layer, p, 1, &src, 0, None).unwrap();
            }
        }
        let r = pool.load(&session, layer, &selection, &dst, 0).unwrap();
        assert_eq!(r.selected, selection.len());
        assert!(pool.hot_entries(layer) <= cfg.hot_slots);
        hits += r.hits;
        seen += r.selected;
        let mut out = vec![0u8; selection.len() * E];
        dst.gpu()
            .stream()
            .unwrap()
            .download(&dst, 0, &mut out)
            .unwrap();
        for (i, &p) in selection.iter().enumerate() {
            let want = entry(layer, p, generation[layer][p as usize]);
            assert!(
                out[i * E..(i + 1) * E] == want[..],
                "step {step}: entry {i} (position {p})"
            );
        }
        // The same selection again: every entry is in the hot buffer now.
        let again = pool.load(&session, layer, &selection, &dst, 0).unwrap();
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
    pool.store(0, 0, 4, &src, 0, None).unwrap();
    // A gap, past max_tokens, a layer that is not there, scores of the wrong count.
    assert!(pool.store(0, 5, 1, &src, 0, None).is_err());
    assert!(pool.store(0, cfg.max_tokens, 1, &src, 0, None).is_err());
    assert!(pool.store(2, 0, 1, &src, 0, None).is_err());
    assert!(pool.store(0, 0, 2, &src, 0, Some(&[1.0])).is_err());
    // Loads of unstored positions, too many, too small a destination.
    assert!(pool.load(&session, 0, &[4], &dst, 0).is_err());
    assert!(
        pool.load(&session, 0, &vec![0; cfg.max_selection + 1], &dst, 0)
            .is_err()
    );
    assert!(
        pool.load(&session, 0, &[0, 1], &dst, dst.len() - E)
            .is_err()
    );
    assert_eq!(pool.load(&session, 0, &[], &dst, 0).unwrap().selected, 0);
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
