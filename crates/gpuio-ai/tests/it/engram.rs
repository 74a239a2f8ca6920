//! Engram tables: lookups of skewed id batches (repeats fetched once) compared with the table
//! row by row; rows stored from device memory read back by the next lookup; bad ids and sizes
//! refused before anything moves.

use gpuio_ai::engram::EngramTable;
use gpuio_api::{Config, HostPlacement, Session};
use gpuio_hal::pattern;

const ROW: usize = 256;

/// Zipf-like ids: small ids far more often than large ones.
fn skewed_ids(n: usize, rows: u64, seed: u64) -> Vec<u64> {
    (0..n as u64)
        .map(|i| {
            let u = (pattern::mix64(seed ^ i) % 1_000_000) as f64 / 1_000_000.0;
            ((rows as f64).powf(u) as u64).min(rows - 1)
        })
        .collect()
}

#[test]
fn lookups_read_the_rows_asked_for_and_stores_land() {
    let session = Session::new(Config::default()).unwrap();
    let rows = 20_000u64;
    let table = EngramTable::new(&session, rows, ROW, HostPlacement::Dram { numa: None }).unwrap();
    pattern::fill(&mut table.memory().write(), 0, 0xe9);
    let ids = skewed_ids(48 * 64, rows, 1);
    let dst = session.alloc_device(0, ids.len() * ROW).unwrap();
    let r = table.lookup(&session, &ids, &dst, 0).unwrap();
    assert_eq!(r.rows, ids.len());
    let check = |dst: &gpuio_api::DeviceBuffer, ids: &[u64]| {
        let mut out = vec![0u8; ids.len() * ROW];
        dst.gpu()
            .stream()
            .unwrap()
            .download(dst, 0, &mut out)
            .unwrap();
        let t = table.memory().read();
        for (i, &id) in ids.iter().enumerate() {
            let want = &t[id as usize * ROW..(id as usize + 1) * ROW];
            assert!(out[i * ROW..(i + 1) * ROW] == *want, "row {i} (id {id})");
        }
    };
    check(&dst, &ids);
    // Stores: new rows for 100 distinct ids, then a lookup sees them.
    let updated: Vec<u64> = (0..100).map(|i| i * 191 % rows).collect();
    let mut fresh = vec![0u8; updated.len() * ROW];
    pattern::fill(&mut fresh, 0, 0x5707e);
    let src = session.alloc_device(0, fresh.len()).unwrap();
    src.gpu().stream().unwrap().upload(&fresh, &src, 0).unwrap();
    table.store(&session, &updated, &src, 0).unwrap();
    let again = session.alloc_device(0, updated.len() * ROW).unwrap();
    table.lookup(&session, &updated, &again, 0).unwrap();
    let mut out = vec![0u8; fresh.len()];
    again
        .gpu()
        .stream()
        .unwrap()
        .download(&again, 0, &mut out)
        .unwrap();
    assert!(out == fresh, "stored rows did not come back");
    // Refused: an id past the table, a destination too small, a table of no bytes.
    assert!(table.lookup(&session, &[rows], &dst, 0).is_err());
    assert!(table.lookup(&session, &ids, &again, 0).is_err());
    assert!(table.store(&session, &updated, &src, 1).is_err());
    assert!(EngramTable::new(&session, 0, ROW, HostPlacement::Dram { numa: None }).is_err());
    assert!(EngramTable::new(&session, u64::MAX, ROW, HostPlacement::Dram { numa: None }).is_err());
}

/// A prefetch and a write-back run on side threads while the caller goes on, and land what a
/// lookup and a store would; bad ids are refused before any thread starts.
#[test]
fn prefetch_and_write_back_run_beside_the_caller() {
    use std::sync::Arc;
    let session = Arc::new(Session::new(Config::default()).unwrap());
    let rows = 4096u64;
    let table = EngramTable::new(&session, rows, ROW, HostPlacement::Dram { numa: None }).unwrap();
    pattern::fill(&mut table.memory().write(), 0, 0x51);
    let ids = skewed_ids(48 * 16, rows, 3);
    let dst = session.alloc_device(0, ids.len() * ROW).unwrap();
    let pending = table
        .prefetch(&session, ids.clone(), dst.clone(), 0)
        .unwrap();
    assert_eq!(pending.work().priority(), gpuio_api::Priority::Background);
    let got = pending.wait().unwrap();
    assert_eq!(got.rows, ids.len());
    let mut out = vec![0u8; ids.len() * ROW];
    dst.gpu()
        .stream()
        .unwrap()
        .download(&dst, 0, &mut out)
        .unwrap();
    {
        let t = table.memory().read();
        for (i, &id) in ids.iter().enumerate() {
            assert!(
                out[i * ROW..(i + 1) * ROW] == t[id as usize * ROW..][..ROW],
                "row {i}"
            );
        }
    }
    // Write rows 0..8 back from a device buffer of new bytes.
    let mut fresh = vec![0u8; 8 * ROW];
    pattern::fill(&mut fresh, 0, 0x77);
    let src = session.alloc_device(0, fresh.len()).unwrap();
    src.gpu().stream().unwrap().upload(&fresh, &src, 0).unwrap();
    let back = table
        .store_async(&session, (0..8).collect(), src.clone(), 0)
        .unwrap();
    assert_eq!(back.work().priority(), gpuio_api::Priority::EngramSync);
    back.wait().unwrap();
    assert!(table.memory().read()[..8 * ROW] == fresh[..]);
    let e = table
        .prefetch(&session, vec![rows], dst.clone(), 0)
        .unwrap_err();
    assert!(e.to_string().contains("past"), "{e}");
    // Dropped without a wait: the drop waits, and the rows land.
    drop(
        table
            .store_async(&session, (8..16).collect(), src, 0)
            .unwrap(),
    );
    assert!(table.memory().read()[8 * ROW..16 * ROW] == fresh[..]);
}

/// Similarity: rows planted as multiples of the query rank first, in order of their
/// multiple, as f32 rows and as FP8 rows; a query of the wrong length is refused.
#[test]
fn similar_rows_come_back_best_first() {
    use gpuio_ai::engram::RowValues;
    let session = Session::new(Config::default()).unwrap();
    let rows = 2000u64;
    for (values, size) in [(RowValues::F32, 4usize), (RowValues::Fp8, 1)] {
        let dim = ROW / size;
        let table =
            EngramTable::new(&session, rows, ROW, HostPlacement::Dram { numa: None }).unwrap();
        let query: Vec<f32> = (0..dim)
            .map(|d| if d % 3 == 0 { 1.0 } else { 0.0 })
            .collect();
        {
            let mut t = table.memory().write();
            // Background rows: small values (score well below the planted ones).
            for r in 0..rows as usize {
                for d in 0..dim {
                    let v = ((pattern::mix64((r * dim + d) as u64) % 5) as f32 - 2.0) / 64.0;
                    put(&mut t[r * ROW..], d, v, values);
                }
            }
            // Planted: row 1500 = 4q, row 7 = 3q, row 999 = 2q.
            for (r, m) in [(1500usize, 4.0f32), (7, 3.0), (999, 2.0)] {
                for (d, q) in query.iter().enumerate() {
                    put(&mut t[r * ROW..], d, m * q, values);
                }
            }
        }
        let best = table.similar(&session, 0, &query, values, 3).unwrap();
        let ids: Vec<u64> = best.iter().map(|b| b.0).collect();
        assert_eq!(ids, [1500, 7, 999], "{values:?}: {best:?}");
        let third = query.iter().filter(|&&q| q != 0.0).count() as f32;
        assert!(
            (best[0].1 - 4.0 * third).abs() < 1e-3,
            "{values:?}: {best:?}"
        );
        let e = table
            .similar(&session, 0, &query[1..], values, 3)
            .unwrap_err();
        assert!(e.to_string().contains("query"), "{e}");
    }
}

fn put(row: &mut [u8], d: usize, v: f32, values: gpuio_ai::engram::RowValues) {
    match values {
        gpuio_ai::engram::RowValues::F32 => row[4 * d..4 * d + 4].copy_from_slice(&v.to_le_bytes()),
        gpuio_ai::engram::RowValues::Fp8 => row[d] = float8::F8E4M3::from_f32(v).to_bits(),
    }
}

/// A hot tier: lookups read kept rows from their device copies and the rest from the table,
/// and what they read is the table's row every time — after stores of kept and unkept rows
/// (an id stored twice included: its copy is the row that landed), after the tier is kept
/// again, and after it is dropped. Each check runs lookups until one went through a GPU path
/// (zero-copy or hybrid: the ones that read the copies), as MemIO's planner tries its paths in
/// turn. Ids past the table are refused, keeping the tier.
#[test]
fn a_hot_tier_serves_kept_rows_and_stays_true_through_stores() {
    use gpuio_transport_memio::GatherStrategy;
    let session = Session::new(Config::default()).unwrap();
    let rows = 20_000u64;
    let table = EngramTable::new(&session, rows, ROW, HostPlacement::Dram { numa: None }).unwrap();
    pattern::fill(&mut table.memory().write(), 0, 0x40);
    assert_eq!(table.hot_stats(), None);
    // The "corpus": the 500 most frequent of a sample, as a caller would pick them.
    let mut counts = std::collections::HashMap::new();
    for id in skewed_ids(50_000, rows, 9) {
        *counts.entry(id).or_insert(0u32) += 1;
    }
    let mut hot: Vec<(u32, u64)> = counts.into_iter().map(|(id, c)| (c, id)).collect();
    hot.sort_unstable_by(|a, b| b.cmp(a));
    let mut keep: Vec<u64> = hot.iter().take(500).map(|&(_, id)| id).collect();
    keep.extend_from_within(..10);
    let stats = table.keep_hot(&session, 0, &keep).unwrap();
    assert_eq!(stats.rows, 500);
    assert!(stats.device_bytes >= 500 * (ROW + 32), "{stats:?}");
    let ids = skewed_ids(48 * 64, rows, 2);
    let dst = session.alloc_device(0, (ids.len() + 101) * ROW).unwrap();
    // Lookups until one took a GPU path; each compared with the table. Returns whether the
    // lookups went through the hot tier.
    let check = |ids: &[u64]| {
        for _ in 0..16 {
            let r = table.lookup(&session, ids, &dst, 0).unwrap();
            let mut out = vec![0u8; ids.len() * ROW];
            let stream = dst.gpu().stream().unwrap();
            stream.download(&dst, 0, &mut out[..]).unwrap();
            let t = table.memory().read();
            for (i, &id) in ids.iter().enumerate() {
                let want = &t[id as usize * ROW..(id as usize + 1) * ROW];
                assert!(
                    out[i * ROW..(i + 1) * ROW] == *want,
                    "row {i} (id {id}), {r:?}"
                );
            }
            if matches!(
                r.strategy,
                GatherStrategy::ZeroCopy | GatherStrategy::Hybrid
            ) {
                return r.hot;
            }
        }
        panic!("16 lookups and none on a GPU path");
    };
    assert!(check(&ids));
    // Stores of kept and unkept rows, the first kept id twice with different bytes.
    let mut stored: Vec<u64> = keep[..50].iter().copied().chain(15_000..15_050).collect();
    stored.push(keep[0]);
    let mut fresh = vec![0u8; stored.len() * ROW];
    pattern::fill(&mut fresh, 0, 0xf7e5);
    let src = session.alloc_device(0, fresh.len()).unwrap();
    src.gpu().stream().unwrap().upload(&fresh, &src, 0).unwrap();
    table.store(&session, &stored, &src, 0).unwrap();
    let mut probe = stored.clone();
    probe.extend_from_slice(&ids);
    assert!(check(&probe));
    // Written behind the tier's back, then kept again: the new copies are read.
    pattern::fill(&mut table.memory().write(), 0, 0x41);
    table.keep_hot(&session, 0, &keep).unwrap();
    assert!(check(&probe));
    // Refused, keeping the tier; then dropped: lookups gather from the table.
    assert!(table.keep_hot(&session, 0, &[1, rows]).is_err());
    assert_eq!(table.hot_stats().map(|s| s.rows), Some(500));
    table.drop_hot();
    assert_eq!(table.hot_stats(), None);
    assert!(!check(&probe));
}

/// A table of `rows` rows, filled from `seed`, keeping hot copies of every third row on GPU 0
/// when `hot`.
fn table(session: &Session, rows: u64, seed: u64, hot: bool) -> EngramTable {
    let t = EngramTable::new(session, rows, ROW, HostPlacement::Dram { numa: None }).unwrap();
    pattern::fill(&mut t.memory().write(), 0, seed);
    if hot {
        let keep: Vec<u64> = (0..rows).filter(|r| r % 3 == 0).collect();
        t.keep_hot(session, 0, &keep).unwrap();
    }
    t
}

/// Downloads `n` rows of `dst` from row `at` and compares them with `table`'s rows `ids`.
fn same_rows(dst: &gpuio_api::DeviceBuffer, at: usize, table: &EngramTable, ids: &[u64]) {
    let mut out = vec![0u8; ids.len() * ROW];
    let stream = dst.gpu().stream().unwrap();
    stream.download(dst, at * ROW, &mut out).unwrap();
    let t = table.memory().read();
    for (i, &id) in ids.iter().enumerate() {
        let want = &t[id as usize * ROW..(id as usize + 1) * ROW];
        assert!(out[i * ROW..(i + 1) * ROW] == *want, "row {i} (id {id})");
    }
}

/// Lookups in several tables run together (one gather where each keeps hot rows, one by one
/// where one does not), read what each table holds, see rows stored since, and refuse a bad
/// id before anything moves.
#[test]
fn lookups_in_several_tables_run_together() {
    use gpuio_ai::engram::TableLookup;
    let session = Session::new(Config::default()).unwrap();
    let (a, b, c) = (
        table(&session, 5000, 0xa, true),
        table(&session, 3000, 0xb, true),
        table(&session, 2000, 0xc, false),
    );
    let ids_a = skewed_ids(24, 5000, 4);
    let ids_b = skewed_ids(384, 3000, 5);
    let dst = session.alloc_device(0, (24 + 384) * ROW).unwrap();
    let both = [
        TableLookup {
            table: &a,
            ids: &ids_a,
            dst: &dst,
            dst_offset: 0,
        },
        TableLookup {
            table: &b,
            ids: &ids_b,
            dst: &dst,
            dst_offset: 24 * ROW,
        },
    ];
    // Until Auto took a GPU path (its first calls try each): every call checked.
    let mut on_gpu = false;
    for _ in 0..16 {
        let r = EngramTable::lookup_tables(&session, &both).unwrap();
        assert_eq!((r.len(), r[0].rows, r[1].rows), (2, 24, 384));
        assert!(r.iter().all(|l| l.hot), "{r:?}");
        same_rows(&dst, 0, &a, &ids_a);
        same_rows(&dst, 24, &b, &ids_b);
        if r[0].strategy != gpuio_transport_memio::GatherStrategy::CpuStaged {
            on_gpu = true;
            break;
        }
    }
    assert!(on_gpu, "16 lookups and none on a GPU path");
    // Rows written behind the tiers' backs: a zero-copy call reads every kept row from its
    // copy (the rows as they were), a CPU-staged one none, a hybrid one some; the others
    // always from the table. The same table named twice reads the same.
    let old_b = b.memory().read().to_vec();
    pattern::fill(&mut b.memory().write(), 0, 0xbb);
    let new_b = b.memory().read().to_vec();
    let twice = [
        both[1],
        TableLookup {
            table: &b,
            ids: &ids_b[..24],
            dst: &dst,
            dst_offset: 0,
        },
    ];
    let mut seen_copies = false;
    for _ in 0..12 {
        let r = EngramTable::lookup_tables(&session, &twice).unwrap();
        let mut out = vec![0u8; 408 * ROW];
        dst.gpu()
            .stream()
            .unwrap()
            .download(&dst, 0, &mut out)
            .unwrap();
        for (l, (at, ids)) in r.iter().zip([(24, &ids_b[..]), (0, &ids_b[..24])]) {
            for (i, &id) in ids.iter().enumerate() {
                let (row, got) = (id as usize * ROW, &out[(at + i) * ROW..(at + i + 1) * ROW]);
                let (then, now) = (&old_b[row..row + ROW], &new_b[row..row + ROW]);
                let copy = id % 3 == 0 && got == then && then != now;
                seen_copies |= copy;
                let want_copy =
                    id % 3 == 0 && l.strategy == gpuio_transport_memio::GatherStrategy::ZeroCopy;
                match l.strategy {
                    gpuio_transport_memio::GatherStrategy::Hybrid => {
                        assert!(
                            got == now || (id % 3 == 0 && got == then),
                            "row {i} (id {id})"
                        )
                    }
                    _ => assert!(
                        got == if want_copy { then } else { now },
                        "{l:?}: row {i} (id {id})"
                    ),
                }
            }
        }
    }
    assert!(seen_copies, "no kept row was read from its copy");
    b.keep_hot(
        &session,
        0,
        &(0..3000).filter(|r| r % 3 == 0).collect::<Vec<_>>(),
    )
    .unwrap();
    // Rows stored in one table (kept ones among them) are what the next lookup reads.
    let fresh_ids: Vec<u64> = ids_b[..50]
        .iter()
        .copied()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut fresh = vec![0u8; fresh_ids.len() * ROW];
    pattern::fill(&mut fresh, 0, 0xf7e5);
    let src = session.alloc_device(0, fresh.len()).unwrap();
    src.gpu().stream().unwrap().upload(&fresh, &src, 0).unwrap();
    b.store(&session, &fresh_ids, &src, 0).unwrap();
    EngramTable::lookup_tables(&session, &both).unwrap();
    same_rows(&dst, 24, &b, &ids_b);
    // A table without a hot tier (and one named twice): one by one, the same rows.
    let ids_c = skewed_ids(100, 2000, 6);
    let mixed = [
        both[0],
        TableLookup {
            table: &c,
            ids: &ids_c,
            dst: &dst,
            dst_offset: 24 * ROW,
        },
        TableLookup {
            table: &a,
            ids: &ids_a[..10],
            dst: &dst,
            dst_offset: 124 * ROW,
        },
    ];
    let r = EngramTable::lookup_tables(&session, &mixed).unwrap();
    assert_eq!(
        r.iter().map(|l| l.hot).collect::<Vec<_>>(),
        [true, false, true]
    );
    same_rows(&dst, 0, &a, &ids_a);
    same_rows(&dst, 24, &c, &ids_c);
    same_rows(&dst, 124, &a, &ids_a[..10]);
    // An id past its table is refused before anything moves.
    let before = {
        let mut out = vec![0u8; dst.len()];
        dst.gpu()
            .stream()
            .unwrap()
            .download(&dst, 0, &mut out)
            .unwrap();
        out
    };
    let bad = [
        both[1],
        TableLookup {
            ids: &[2000],
            ..mixed[1]
        },
    ];
    assert!(EngramTable::lookup_tables(&session, &bad).is_err());
    let mut after = vec![0u8; dst.len()];
    dst.gpu()
        .stream()
        .unwrap()
        .download(&dst, 0, &mut after)
        .unwrap();
    assert!(after == before, "a refused lookup moved rows");
    assert!(
        EngramTable::lookup_tables(&session, &[])
            .unwrap()
            .is_empty()
    );
}

/// Calls naming the same tables in opposite orders, beside `keep_hot` and stores on each
/// table, all finish (every caller locks the tables in one order).
#[test]
fn lookups_in_tables_named_in_either_order_do_not_deadlock() {
    use gpuio_ai::engram::TableLookup;
    use std::sync::Arc;
    let session = Arc::new(Session::new(Config::default()).unwrap());
    let a = table(&session, 600, 1, true);
    let b = table(&session, 600, 2, true);
    let ids: Vec<u64> = (0..48).map(|i| i * 7 % 600).collect();
    std::thread::scope(|s| {
        for flip in [false, true] {
            let (session, a, b, ids) = (&session, &a, &b, &ids);
            s.spawn(move || {
                let dst = session.alloc_device(0, 2 * 48 * ROW).unwrap();
                let (x, y) = if flip { (b, a) } else { (a, b) };
                for _ in 0..100 {
                    let lookups = [
                        TableLookup {
                            table: x,
                            ids,
                            dst: &dst,
                            dst_offset: 0,
                        },
                        TableLookup {
                            table: y,
                            ids,
                            dst: &dst,
                            dst_offset: 48 * ROW,
                        },
                    ];
                    EngramTable::lookup_tables(session, &lookups).unwrap();
                }
            });
        }
        let (session, a, b) = (&session, &a, &b);
        s.spawn(move || {
            let keep: Vec<u64> = (0..600).step_by(5).collect();
            let src = session.alloc_device(0, 4 * ROW).unwrap();
            for k in 0..40 {
                let t = if k % 2 == 0 { a } else { b };
                t.keep_hot(session, 0, &keep).unwrap();
                t.store(session, &[1, 5, 9, 10], &src, 0).unwrap();
            }
        });
    });
}
