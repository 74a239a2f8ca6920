//! Row gathers and scatters call after call on one stream. On the GPU machine the end of an
//! untimed call whose last kernel has at most a block per multiprocessor is seen through the
//! word that kernel stores (the last of its blocks to finish, which also sets the count of
//! finished blocks back to zero for the next call), a larger call's through the driver's wait:
//! a call must never return before every row landed, whatever grid the calls before it had.
//! Each call's rows are read back through another stream, which is not ordered after the
//! call's kernel (a gather that returned early would show). Every kernel (tuned, sorted,
//! naive, scatter) with every grid size, a call with a bad index among them; in CI the same
//! calls run on the host backend's copies of the kernels.

use super::first_gpu as gpu;
use gpuio_hal::{
    DeviceBuffer, HalError, HostAllocOptions, HostBuffer, RowIndices, RowKernel, Stream, pattern,
};

const ROW: usize = 48;
const ROWS: usize = 1 << 14;
/// Rows per call, in turn (48-byte rows, 256 threads a block, 4 pieces a thread): one block,
/// 6 blocks, one, ~120 (at most a block per multiprocessor on an H200: the end word), one,
/// ~600 (more: the driver's wait).
const COUNTS: [usize; 6] = [1, 2000, 200, 40_000, 64, 200_000];

fn upload(stream: &Stream, ids: &[u64], idx: &DeviceBuffer) {
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    stream.upload(&bytes, idx, 0).unwrap();
}

fn rows_of(pool: &[u8], ids: &[u64]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&i| &pool[i as usize * ROW..(i as usize + 1) * ROW])
        .copied()
        .collect()
}

/// The first `n` rows of `dst`, read through `reader`.
fn read_back(reader: &Stream, dst: &DeviceBuffer, n: usize) -> Vec<u8> {
    let mut got = vec![0u8; n * ROW];
    reader.download(dst, 0, &mut got).unwrap();
    got
}

#[test]
fn each_call_returns_with_all_its_rows_whatever_came_before() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let reader = gpu.stream().unwrap();
    let mut pool =
        HostBuffer::alloc_pinned(ROWS * ROW, &HostAllocOptions::default(), &gpu).unwrap();
    pattern::fill(&mut pool, 0, 11);
    let max = COUNTS.iter().copied().max().unwrap();
    let dst = gpu.alloc(max * ROW).unwrap();
    let idx = gpu.alloc(max * 8).unwrap();
    let gather = |ids: &[u64], kernel: RowKernel| {
        upload(&stream, ids, &idx);
        let list = RowIndices::Device(&idx);
        stream.gather(&pool, ROW, list, ids.len(), &dst, 0, kernel)
    };
    let kernels = [RowKernel::Tuned, RowKernel::Sorted, RowKernel::Naive];
    for call in 0..2 * COUNTS.len() * kernels.len() {
        let n = COUNTS[call % COUNTS.len()];
        let kernel = kernels[call / COUNTS.len() % kernels.len()];
        let ids: Vec<u64> = (0..n as u64)
            .map(|k| pattern::mix64(((call as u64) << 32) | k) % ROWS as u64)
            .collect();
        gather(&ids, kernel).unwrap();
        assert!(
            read_back(&reader, &dst, n) == rows_of(pool.as_slice(), &ids),
            "call {call}: {n} rows by {kernel:?}"
        );
    }

    // A bad index fails its call (the other rows land), and the call after it is whole.
    let mut ids: Vec<u64> = (0..200u64).map(|k| k * 7 % ROWS as u64).collect();
    ids[123] = ROWS as u64;
    let err = gather(&ids, RowKernel::Tuned).unwrap_err();
    assert!(
        matches!(err, HalError::IndexOutOfRange { position: 123, .. }),
        "{err}"
    );
    assert!(read_back(&reader, &dst, 123) == rows_of(pool.as_slice(), &ids[..123]));
    let ids: Vec<u64> = (0..3000u64)
        .map(|k| pattern::mix64(k) % ROWS as u64)
        .collect();
    gather(&ids, RowKernel::Tuned).unwrap();
    assert!(read_back(&reader, &dst, ids.len()) == rows_of(pool.as_slice(), &ids));
}

#[test]
fn scatters_one_after_another_land_before_each_returns() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let mut pool =
        HostBuffer::alloc_pinned(ROWS * ROW, &HostAllocOptions::default(), &gpu).unwrap();
    let max = COUNTS.iter().copied().max().unwrap();
    let src = gpu.alloc(max * ROW).unwrap();
    let idx = gpu.alloc(max * 8).unwrap();
    for call in 0..20usize {
        let n = COUNTS[call % COUNTS.len()].min(ROWS);
        // Distinct rows, so that each lands as written.
        let start = pattern::mix64(call as u64) % ROWS as u64;
        let ids: Vec<u64> = (0..n as u64).map(|k| (start + k) % ROWS as u64).collect();
        let mut rows = vec![0u8; n * ROW];
        pattern::fill(&mut rows, 0, call as u64 + 100);
        stream.upload(&rows, &src, 0).unwrap();
        upload(&stream, &ids, &idx);
        stream
            .scatter(&src, 0, ROW, RowIndices::Device(&idx), n, &mut pool)
            .unwrap();
        assert!(
            rows_of(pool.as_slice(), &ids) == rows,
            "call {call}: {n} rows scattered"
        );
    }
}
