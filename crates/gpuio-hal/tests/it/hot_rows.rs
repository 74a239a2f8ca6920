//! Gathers through hot rows (`Stream::keep_hot`, `gather_hot`, `refresh_hot`) on the probed
//! backend — the hot gather kernel on the GPU machine, the host backend's copy of it in CI —
//! against the pool they copy: kept rows are read from their copies (a pool row written after
//! `keep_hot` still reads as its copy until `refresh_hot`), every other row from the pool, for
//! each piece width; and the refusals: rows past the pool, another pool.

use gpuio_hal::{
    BackendPreference, DeviceBuffer, Gpu, HalError, HostAllocOptions, HostBuffer, RowIndices,
    Stream, pattern, probe,
};
use gpuio_testkit::Requirement;

const ROWS: usize = 300;

fn gpu() -> Gpu {
    let mut p = probe(BackendPreference::Auto).unwrap();
    if !p.cuda.available {
        Requirement::Cuda.missing(format_args!(
            "CUDA is unavailable: {} (running on the host backend)",
            p.cuda.detail
        ));
    }
    p.gpus.remove(0)
}

fn pool(gpu: &Gpu, row: usize, seed: u64) -> HostBuffer {
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

fn rows_of(pool: &[u8], row: usize, ids: &[u64]) -> Vec<u8> {
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
