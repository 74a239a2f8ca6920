//! Zero-copy gathers of an engine that keeps a resident block per GPU
//! (`MemIoConfig::resident_linger`), on the probed backend: small calls with host index lists
//! (plain, through hot rows, several pools at once) are served by the block, larger calls and
//! device lists by launches; every row checked against its pool, bad indices reported at their
//! place as the launched paths report them.

use super::gather::{download, engine_with, pool, random_indices, reference, seed};
use gpuio_hal::{HalError, HostBuffer, RESIDENT_MAX_BYTES, RESIDENT_MAX_ROWS};
use gpuio_transport_memio::{GatherOptions, GatherStrategy, HotLookup, MemIoError};
use std::time::Duration;

const ZERO_COPY: GatherOptions = GatherOptions {
    strategy: GatherStrategy::ZeroCopy,
    dedup: false,
    gpu_share: None,
};

/// Calls the engine's resident server has answered (on either backend: the host backend runs
/// its jobs inline, but routes and counts them the same).
fn served(io: &gpuio_transport_memio::MemIo) -> u64 {
    let gpu = io.gpu(0).unwrap();
    io.resident_stats(gpu).map_or(0, |s| s.calls)
}

#[test]
fn small_gathers_through_the_resident_block_match_the_pool() {
    let io = engine_with(Some(Duration::from_millis(20)));
    let gpu = io.gpu(0).unwrap().clone();
    let rows = 2048;
    for rb in [656usize, 64, 12, 5] {
        let p = pool(&io, rows * rb, seed(), true);
        let dst = gpu.alloc((RESIDENT_MAX_ROWS + 8) * rb + 3).unwrap();
        // Served by the block (1, 64, the most it takes), then by a launch (one more).
        let most = RESIDENT_MAX_ROWS.min(RESIDENT_MAX_BYTES / rb);
        for n in [1usize, 64.min(most), most, most + 1] {
            let idx = random_indices(n, rows, seed() ^ n as u64);
            let before = served(&io);
            let r = io.gather(&p, rb, &idx, &dst, 3, &ZERO_COPY).unwrap();
            assert_eq!(
                served(&io) - before,
                u64::from(n <= most),
                "{n} rows of {rb} B"
            );
            assert_eq!(r.strategy, GatherStrategy::ZeroCopy);
            let want = reference(p.as_slice(), rb, &idx);
            assert_eq!(download(&io, &dst, 3, n * rb), want, "{n} rows of {rb} B");
        }
        // A device list takes the launched path.
        let idx = random_indices(40, rows, seed());
        let list = gpu.alloc(40 * 8).unwrap();
        let bytes: Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
        io.upload(&bytes, &list, 0).unwrap();
        let device = gpuio_transport_memio::GatherIndices::Device {
            list: &list,
            count: 40,
        };
        let before = served(&io);
        io.gather(&p, rb, device, &dst, 0, &ZERO_COPY).unwrap();
        assert_eq!(served(&io), before, "a device list, rows of {rb} B");
        let want = reference(p.as_slice(), rb, &idx);
        assert_eq!(
            download(&io, &dst, 0, 40 * rb),
            want,
            "device list, rows of {rb} B"
        );
    }
}

#[test]
fn hot_lookups_through_the_resident_block_read_kept_rows_from_their_copies() {
    let io = engine_with(Some(Duration::from_millis(20)));
    let gpu = io.gpu(0).unwrap().clone();
    let stream = gpu.stream().unwrap();
    let (rows, rb) = (4096usize, 48usize);
    let mut pools: Vec<HostBuffer> = (0..2)
        .map(|k| pool(&io, rows * rb, seed() ^ k, true))
        .collect();
    let hot: Vec<_> = pools
        .iter()
        .map(|p| {
            let keep: Vec<u64> = (0..rows as u64).filter(|r| r % 2 == 0).collect();
            stream.keep_hot(p, rb, &keep).unwrap()
        })
        .collect();
    let old: Vec<Vec<u8>> = pools.iter().map(|p| p.as_slice().to_vec()).collect();
    for (k, p) in pools.iter_mut().enumerate() {
        gpuio_hal::pattern::fill(p, 0, seed() ^ 0xbeef ^ k as u64);
    }
    let want = |k: usize, ids: &[u64]| -> Vec<u8> {
        ids.iter()
            .flat_map(|&r| {
                let from = if r % 2 == 0 {
                    &old[k]
                } else {
                    pools[k].as_slice()
                };
                from[r as usize * rb..(r as usize + 1) * rb].to_vec()
            })
            .collect()
    };
    let dst = gpu.alloc(2048 * rb).unwrap();
    // One pool, then two at once: within the block's 1024 rows, and past them.
    let one = random_indices(24, rows, seed());
    let before = served(&io);
    io.gather_hot(&pools[0], &hot[0], &one, &dst, 0, &ZERO_COPY)
        .unwrap();
    assert_eq!(served(&io), before + 1);
    assert_eq!(download(&io, &dst, 0, 24 * rb), want(0, &one));
    for second in [999usize, 1001] {
        let ids = [
            random_indices(24, rows, seed() ^ 1),
            random_indices(second, rows, seed() ^ 2),
        ];
        let jobs = [
            HotLookup {
                pool: &pools[0],
                hot: &hot[0],
                indices: &ids[0],
                dst: &dst,
                dst_offset: 0,
            },
            HotLookup {
                pool: &pools[1],
                hot: &hot[1],
                indices: &ids[1],
                dst: &dst,
                dst_offset: 24 * rb,
            },
        ];
        let before = served(&io);
        io.gather_hot_jobs(&jobs, &ZERO_COPY).unwrap();
        let by_block = u64::from(24 + second <= RESIDENT_MAX_ROWS);
        assert_eq!(served(&io) - before, by_block, "{second}");
        assert_eq!(
            download(&io, &dst, 0, 24 * rb),
            want(0, &ids[0]),
            "{second}"
        );
        let got = download(&io, &dst, 24 * rb, second * rb);
        assert_eq!(got, want(1, &ids[1]), "{second}");
        // A bad index in the second job is reported at its place in both lists.
        let mut bad = ids[1].clone();
        bad[7] = rows as u64 + 3;
        let jobs = [
            jobs[0],
            HotLookup {
                indices: &bad,
                ..jobs[1]
            },
        ];
        match io.gather_hot_jobs(&jobs, &ZERO_COPY) {
            Err(MemIoError::Hal(HalError::IndexOutOfRange { position, rows: r })) => {
                assert_eq!((position, r), (24 + 7, rows as u64), "{second}");
            }
            other => panic!("{other:?}"),
        }
    }
}
