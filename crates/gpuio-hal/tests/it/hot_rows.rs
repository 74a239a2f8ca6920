//! Gathers through hot rows (`Stream::keep_hot`, `gather_hot`, `refresh_hot`) on the probed
//! backend — the hot gather kernel on the GPU machine, the host backend's copy of it in CI —
//! against the pool they copy: kept rows are read from their copies (a pool row written after
//! `keep_hot` still reads as its copy until `refresh_hot`), every other row from the pool, for
//! each piece width; and the refusals: rows past the pool, another pool.

use super::first_gpu as gpu;
use gpuio_hal::{
    DeviceBuffer, Gpu, HalError, HostAllocOptions, HostBuffer, HotGather, RowIndices, Stream,
    pattern,
};

/// Rows of each test pool (the resident server's tests share these helpers).
pub(super) const ROWS: usize = 300;

pub(super) fn pool(gpu: &Gpu, row: usize, seed: u64) -> HostBuffer {
    let mut pool = HostBuffer::alloc_pinned(ROWS * row, &HostAllocOptions::default(), gpu).unwrap();
    pattern::fill(&mut pool, 0, seed);
    pool
}

/// Gathers `ids` through `hot` (indices uploaded to the device) and downloads the rows.
fn gather(
    stream: &Stream,
    pool: &HostBuffer,
    hot: &gpuio_hal::HotRows,
    ids: &[u64],
    dst: &DeviceBuffer,
) -> gpuio_hal::Result<Vec<u8>> {
    let row = hot.row_bytes();
    let idx = stream.gpu().alloc(ids.len() * 8)?;
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    stream.upload(&bytes, &idx, 0)?;
    stream.gather_hot(pool, hot, RowIndices::Device(&idx), ids.len(), dst, row)?;
    let mut got = vec![0u8; ids.len() * row];
    stream.download(dst, row, &mut got)?;
    Ok(got)
}

pub(super) fn rows_of(pool: &[u8], row: usize, ids: &[u64]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&i| &pool[i as usize * row..(i as usize + 1) * row])
        .copied()
        .collect()
}

#[test]
fn kept_rows_are_read_from_their_copies_and_the_rest_from_the_pool() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    // 48-byte rows move in 16-byte pieces, 40-byte rows in 8-byte ones, 20-byte rows in
    // 4-byte ones, 7-byte rows in bytes.
    for row in [48usize, 40, 20, 7] {
        let mut pool = pool(&gpu, row, row as u64);
        let keep: Vec<u64> = (0..ROWS as u64)
            .filter(|r| r % 3 == 0)
            .chain([9, 0])
            .collect();
        let hot = stream.keep_hot(&pool, row, &keep).unwrap();
        assert_eq!(hot.len(), ROWS / 3, "repeats are kept once");
        assert_eq!(hot.slot_of(3), Some(1));
        assert_eq!(hot.slot_of(4), None);
        let ids: Vec<u64> = (0..2000u64)
            .map(|k| pattern::mix64(k) % ROWS as u64)
            .collect();
        let dst = gpu.alloc((ids.len() + 1) * row).unwrap();
        let before = pool.as_slice().to_vec();
        assert_eq!(
            gather(&stream, &pool, &hot, &ids, &dst).unwrap(),
            rows_of(&before, row, &ids)
        );
        // Rewrite every pool row: kept ones still read as their copies until refreshed.
        pattern::fill(&mut pool, 0, row as u64 ^ 0x5eed);
        let after = pool.as_slice().to_vec();
        let stale: Vec<u8> = ids
            .iter()
            .flat_map(|&i| {
                let src = if i % 3 == 0 { &before } else { &after };
                src[i as usize * row..(i as usize + 1) * row].to_vec()
            })
            .collect();
        assert_eq!(gather(&stream, &pool, &hot, &ids, &dst).unwrap(), stale);
        // Refreshing rows 0..150 (and rows past the pool, ignored) copies the kept ones.
        let refreshed: Vec<u64> = (0..150).chain([ROWS as u64 + 5]).collect();
        assert_eq!(stream.refresh_hot(&pool, &hot, &refreshed).unwrap(), 50);
        let want: Vec<u8> = ids
            .iter()
            .flat_map(|&i| {
                let src = if i % 3 == 0 && i >= 150 {
                    &before
                } else {
                    &after
                };
                src[i as usize * row..(i as usize + 1) * row].to_vec()
            })
            .collect();
        assert_eq!(gather(&stream, &pool, &hot, &ids, &dst).unwrap(), want);
    }
}

#[test]
fn rows_past_the_pool_and_other_pools_are_refused() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let row = 32;
    let pool = pool(&gpu, row, 1);
    match stream.keep_hot(&pool, row, &[1, ROWS as u64]) {
        Err(HalError::IndexOutOfRange { position: 1, rows }) => assert_eq!(rows, ROWS as u64),
        other => panic!("a hot row past the pool: {other:?}"),
    }
    let hot = stream.keep_hot(&pool, row, &[1, 2]).unwrap();
    let dst = gpu.alloc(8 * row).unwrap();
    // A row past the pool fails the gather; the other rows are gathered.
    stream.fill_pattern(&dst, 0, 8 * row, 9).unwrap();
    match gather(&stream, &pool, &hot, &[2, 7, ROWS as u64, 1], &dst) {
        Err(HalError::IndexOutOfRange { position: 2, .. }) => {}
        other => panic!("a gathered row past the pool: {other:?}"),
    }
    let mut got = vec![0u8; 4 * row];
    stream.download(&dst, row, &mut got).unwrap();
    let pool_bytes = pool.as_slice();
    assert_eq!(&got[..2 * row], &rows_of(pool_bytes, row, &[2, 7])[..]);
    assert_eq!(&got[3 * row..], &rows_of(pool_bytes, row, &[1])[..]);
    // Copies of one pool are refused for another of the same size.
    let other = self::pool(&gpu, row, 2);
    let err = gather(&stream, &other, &hot, &[1], &dst).unwrap_err();
    assert!(err.to_string().contains("another pool"), "{err}");
    let err = stream.refresh_hot(&other, &hot, &[1]).unwrap_err();
    assert!(err.to_string().contains("another pool"), "{err}");
    // An empty set of hot rows gathers everything from the pool.
    let none = stream.keep_hot(&pool, row, &[]).unwrap();
    assert!(none.is_empty());
    assert_eq!(
        gather(&stream, &pool, &none, &[3, 0], &dst).unwrap(),
        rows_of(pool_bytes, row, &[3, 0])
    );
}

/// The jobs' lists one after another, as little-endian bytes.
fn list_bytes(lists: &[&[u64]]) -> Vec<u8> {
    lists
        .iter()
        .flat_map(|l| l.iter())
        .flat_map(|i| i.to_le_bytes())
        .collect()
}

#[test]
fn several_pools_gather_through_their_hot_rows_in_one_call() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    // Each piece width: 16, 8, 4 and 1 bytes; long and short lists.
    for (row, last) in [
        (48usize, 500usize),
        (24, 500),
        (20, 500),
        (7, 500),
        (48, 100),
        (7, 100),
    ] {
        let pools: Vec<HostBuffer> = (0..3)
            .map(|k| pool(&gpu, row, 10 * row as u64 + k))
            .collect();
        let hots: Vec<_> = pools
            .iter()
            .enumerate()
            .map(|(k, p)| {
                let keep: Vec<u64> = (0..ROWS as u64)
                    .filter(|r| r % (k as u64 + 2) == 0)
                    .collect();
                stream.keep_hot(p, row, &keep).unwrap()
            })
            .collect();
        // Kept rows read as their copies: rewrite the pools after keeping them.
        let before: Vec<Vec<u8>> = pools.iter().map(|p| p.as_slice().to_vec()).collect();
        let mut pools = pools;
        for (k, p) in pools.iter_mut().enumerate() {
            pattern::fill(p, 0, 77 + k as u64);
        }
        let ids: Vec<Vec<u64>> = [24usize, 0, last]
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                (0..n as u64)
                    .map(|i| pattern::mix64(i ^ (k as u64) << 32) % ROWS as u64)
                    .collect()
            })
            .collect();
        let want = |k: usize| -> Vec<u8> {
            ids[k]
                .iter()
                .flat_map(|&i| {
                    let kept = i % (k as u64 + 2) == 0;
                    let src = if kept {
                        &before[k]
                    } else {
                        pools[k].as_slice()
                    };
                    src[i as usize * row..(i as usize + 1) * row].to_vec()
                })
                .collect()
        };
        let lists: Vec<&[u64]> = ids.iter().map(Vec::as_slice).collect();
        let bytes = list_bytes(&lists);
        let mut pinned =
            HostBuffer::alloc_pinned(bytes.len().max(8), &HostAllocOptions::default(), &gpu)
                .unwrap();
        pinned.as_mut_slice()[..bytes.len()].copy_from_slice(&bytes);
        let device = gpu.alloc(bytes.len()).unwrap();
        stream.upload(&bytes, &device, 0).unwrap();
        let staged_to = gpu.alloc(bytes.len()).unwrap();
        // The jobs write into one buffer at offsets of their own, and a second buffer.
        let dst = gpu.alloc(600 * row).unwrap();
        let other = gpu.alloc(500 * row).unwrap();
        for (name, indices) in [
            ("device", RowIndices::Device(&device)),
            ("pinned", RowIndices::Pinned(&pinned)),
            (
                "staged",
                RowIndices::Staged {
                    host: &pinned,
                    device: &staged_to,
                },
            ),
        ] {
            stream.fill_pattern(&dst, 0, 600 * row, 3).unwrap();
            let jobs = [
                HotGather {
                    pool: &pools[0],
                    hot: &hots[0],
                    count: ids[0].len(),
                    dst: &dst,
                    dst_offset: 5 * row,
                },
                HotGather {
                    pool: &pools[1],
                    hot: &hots[1],
                    count: 0,
                    dst: &dst,
                    dst_offset: 0,
                },
                HotGather {
                    pool: &pools[2],
                    hot: &hots[2],
                    count: ids[2].len(),
                    dst: &other,
                    dst_offset: 0,
                },
            ];
            let took = stream.gather_hot_jobs_timed(&jobs, indices).unwrap();
            assert!(took > std::time::Duration::ZERO, "{name}");
            let mut got = vec![0u8; ids[0].len() * row];
            stream.download(&dst, 5 * row, &mut got).unwrap();
            assert_eq!(got, want(0), "{name}, first job, rows of {row} B");
            let mut got = vec![0u8; ids[2].len() * row];
            stream.download(&other, 0, &mut got).unwrap();
            assert_eq!(got, want(2), "{name}, third job, rows of {row} B");
            // Nothing else of `dst` was written.
            let mut head = vec![0u8; 5 * row];
            stream.download(&dst, 0, &mut head).unwrap();
            assert_eq!(pattern::first_deviation(&head, 0, 3), None, "{name}");
        }
    }
}

#[test]
fn a_hot_gather_of_several_pools_refuses_what_it_cannot_run() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let (a, b) = (pool(&gpu, 32, 1), pool(&gpu, 16, 2));
    let hot_a = stream.keep_hot(&a, 32, &[1, 2]).unwrap();
    let hot_b = stream.keep_hot(&b, 16, &[1]).unwrap();
    let dst = gpu.alloc(64 * 32).unwrap();
    let list = gpu.alloc(64 * 8).unwrap();
    let job = |pool, hot, count, dst_offset| HotGather {
        pool,
        hot,
        count,
        dst: &dst,
        dst_offset,
    };
    let refused = |jobs: &[HotGather<'_>], why: &str| {
        let err = stream
            .gather_hot_jobs(jobs, RowIndices::Device(&list))
            .unwrap_err();
        assert!(err.to_string().contains(why), "{err}");
    };
    refused(&[], "needs a job");
    refused(&[job(&a, &hot_a, 1, 0), job(&b, &hot_b, 1, 32)], "one size");
    refused(&[job(&a, &hot_a, 1, 0); 9], "more than 8");
    refused(&[job(&b, &hot_a, 1, 0)], "another pool");
    let err = stream
        .gather_hot_jobs(&[job(&a, &hot_a, 64, 32)], RowIndices::Device(&list))
        .unwrap_err();
    assert!(
        matches!(err, HalError::OutOfRange { what: "rows", .. }),
        "{err}"
    );
    refused(&[job(&a, &hot_a, 2, 0), job(&a, &hot_a, 2, 32)], "overlap");
    refused(&[job(&a, &hot_a, 65, 0)], "row indices");
    let err = stream
        .gather_hot_jobs(&[job(&a, &hot_a, 2, 0)], RowIndices::Device(&dst))
        .unwrap_err();
    assert!(err.to_string().contains("different buffers"), "{err}");
    // A row past its pool is reported at its position in the whole list, naming its own
    // pool's rows (the first pool has more); the other rows are gathered.
    let mut big =
        HostBuffer::alloc_pinned(2 * ROWS * 32, &HostAllocOptions::default(), &gpu).unwrap();
    pattern::fill(&mut big, 0, 3);
    let hot_big = stream.keep_hot(&big, 32, &[5]).unwrap();
    let ids = [3u64, ROWS as u64 + 4, 1, ROWS as u64, 2];
    stream.upload(&list_bytes(&[&ids]), &list, 0).unwrap();
    let mut pinned = HostBuffer::alloc_pinned(64 * 8, &HostAllocOptions::default(), &gpu).unwrap();
    pinned.as_mut_slice()[..5 * 8].copy_from_slice(&list_bytes(&[&ids]));
    for indices in [RowIndices::Device(&list), RowIndices::Pinned(&pinned)] {
        stream.fill_pattern(&dst, 0, 64 * 32, 9).unwrap();
        match stream.gather_hot_jobs(
            &[job(&big, &hot_big, 2, 0), job(&a, &hot_a, 3, 2 * 32)],
            indices,
        ) {
            Err(HalError::IndexOutOfRange { position: 3, rows }) => assert_eq!(rows, ROWS as u64),
            other => panic!("a row past the pool: {other:?}"),
        }
        let mut got = vec![0u8; 5 * 32];
        stream.download(&dst, 0, &mut got).unwrap();
        assert_eq!(&got[..2 * 32], &rows_of(big.as_slice(), 32, &ids[..2])[..]);
        assert_eq!(
            &got[2 * 32..3 * 32],
            &rows_of(a.as_slice(), 32, &ids[2..3])[..]
        );
        assert_eq!(&got[4 * 32..], &rows_of(a.as_slice(), 32, &ids[4..])[..]);
    }
}
