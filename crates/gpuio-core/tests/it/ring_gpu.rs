//! The request ring with real kernels as producers (the GPU machine, `GPUIO_REQUIRE_CUDA=1`):
//! the layout the device compiler sees, thousands of GPU threads reading file blocks through
//! a `RingProxy` (delivered in the slots' bounce buffers), larger reads by DMA, and round
//! trips. On the host backend these report that they need a GPU.

use gpuio_core::Endpoint;
use gpuio_core::ring::{RingConfig, RingProxy};
use gpuio_hal::pattern;
use gpuio_ring as ring;
use gpuio_ring::ops as ring_kernels;
use gpuio_transport_localio::{FileHandle, OpenOptions};

#[test]
fn the_device_compiler_sees_the_same_layout() {
    let Some((_, gpu)) = super::common::cuda("kernels post ring requests") else {
        return;
    };
    let words = ring_kernels::layout_words(&gpu.stream().unwrap()).unwrap();
    assert_eq!(words, ring::layout().words());
}

#[test]
fn gpu_threads_read_file_blocks_through_the_ring() {
    let Some((engines, gpu)) = super::common::cuda("kernels post ring requests") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blocks.bin");
    let (size, seed) = (16u64 << 20, 0x5eed);
    let mut data = vec![0u8; size as usize];
    pattern::fill(&mut data, 0, seed);
    std::fs::write(&path, &data).unwrap();
    let file = FileHandle::open(&path, OpenOptions::READ).unwrap();
    let cfg = RingConfig {
        slots: 64,
        threads: 4,
        ..RingConfig::default()
    };
    let mut proxy = RingProxy::new(engines, &gpu, cfg).unwrap();
    let handle = proxy.register(Endpoint::file(&file, 0)).unwrap();
    let n = 4096usize;
    let offsets: Vec<u64> = (0..n as u64)
        .map(|i| pattern::mix64(i) % (size / 4096) * 4096)
        .collect();
    let stream = gpu.stream().unwrap();
    let offs = gpu.alloc(n * 8).unwrap();
    let bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
    stream.upload(&bytes, &offs, 0).unwrap();
    let dst = gpu.alloc(n * 4096).unwrap();
    let results = gpu.alloc(n * 8).unwrap();
    proxy.register_device(&dst).unwrap();
    // More threads than slots: the full-ring wait runs on the GPU too.
    ring_kernels::read_blocks(
        &stream,
        proxy.ring(),
        handle,
        &offs,
        n,
        4096,
        &dst,
        &results,
        1024,
    )
    .unwrap();
    let mut res = vec![0u8; n * 8];
    stream.download(&results, 0, &mut res).unwrap();
    for (i, w) in res.chunks_exact(8).enumerate() {
        assert_eq!(i64::from_le_bytes(w.try_into().unwrap()), 4096, "read {i}");
    }
    let mut got = vec![0u8; n * 4096];
    stream.download(&dst, 0, &mut got).unwrap();
    for (i, &o) in offsets.iter().enumerate() {
        assert!(got[i * 4096..(i + 1) * 4096] == data[o as usize..o as usize + 4096]);
    }
    // Reads of at most 8 bytes come back inline in the slot: 8-byte and 5-byte blocks (the
    // latter stored byte by byte), every one checked.
    for len in [8usize, 5] {
        let pieces = 512usize;
        ring_kernels::read_blocks(
            &stream,
            proxy.ring(),
            handle,
            &offs,
            pieces,
            len,
            &dst,
            &results,
            256,
        )
        .unwrap();
        let mut res = vec![0u8; pieces * 8];
        stream.download(&results, 0, &mut res).unwrap();
        let mut got = vec![0u8; pieces * len];
        stream.download(&dst, 0, &mut got).unwrap();
        for (i, &o) in offsets[..pieces].iter().enumerate() {
            assert_eq!(
                i64::from_le_bytes(res[i * 8..i * 8 + 8].try_into().unwrap()),
                len as i64
            );
            assert!(
                got[i * len..(i + 1) * len] == data[o as usize..o as usize + len],
                "{len}: {i}"
            );
        }
    }
    // Reads too large for a slot's bounce buffer go to device memory from the host: a
    // destination outside every registered buffer is refused there, and nothing is written.
    let big = proxy.ring().bounce_bytes() * 2;
    let stray = gpu.alloc(big).unwrap();
    let one = gpu.alloc(8).unwrap();
    stream.upload(&0u64.to_le_bytes(), &one, 0).unwrap();
    let res1 = gpu.alloc(8).unwrap();
    ring_kernels::read_blocks(
        &stream,
        proxy.ring(),
        handle,
        &one,
        1,
        big,
        &stray,
        &res1,
        1,
    )
    .unwrap();
    let mut r = [0u8; 8];
    stream.download(&res1, 0, &mut r).unwrap();
    assert_eq!(i64::from_le_bytes(r), ring::RESULT_UNREGISTERED);

    // Round trips of a minimal request, each phase later than the one before.
    let phases = ring_kernels::RING_PING_PHASES;
    let ns = gpu.alloc(100 * 8 * phases).unwrap();
    ring_kernels::ping(&stream, proxy.ring(), handle, 100, 8, &dst, &ns).unwrap();
    let mut t = vec![0u8; 800 * phases];
    stream.download(&ns, 0, &mut t).unwrap();
    let t: Vec<u64> = t
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
        .collect();
    for trip in t.chunks_exact(phases) {
        assert!(trip[phases - 1] != u64::MAX, "a round trip failed");
        assert!(trip.windows(2).all(|w| w[0] <= w[1]), "phases {trip:?}");
    }
    let stats = proxy.shutdown().unwrap();
    assert_eq!(stats.served, n as u64 + 2 * 512 + 100);
}
