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
