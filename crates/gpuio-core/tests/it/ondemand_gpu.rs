//! On-demand arrays with real kernels (the GPU machine, `GPUIO_REQUIRE_CUDA=1`): the layout
//! the device compiler sees; GPU threads reading random elements of a file four times the
//! cache and checking each against the data pattern; stores, `synchronize` and the file
//! checked byte for byte; a page-size sweep; gathers whose hits race evictions. On the host backend these report that they need
//! a GPU (the protocol itself runs in CI through `ondemand.rs`).

use gpuio_core::ondemand::{ArrayMode, PageCache, PageCacheConfig};
use gpuio_core::ring::RingConfig;
use gpuio_core::{Endpoint, HostMemory};
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_ring::ondemand;
use gpuio_ring::ondemand::ops as array_kernels;
use gpuio_transport_localio::{FileHandle, OpenOptions};

#[test]
fn the_device_compiler_sees_the_same_array_layout() {
    let Some((_, gpu)) = super::common::cuda("on-demand array kernels run") else {
        return;
    };
    let words = array_kernels::device_layout_words(&gpu.stream().unwrap()).unwrap();
    let want: Vec<u64> = ondemand::constants().iter().map(|c| c.1).collect();
    assert_eq!(words, want, "{:?}", ondemand::constants());
}

#[test]
fn kernels_read_and_write_a_file_four_times_the_cache() {
    let Some((engines, gpu)) = super::common::cuda("on-demand array kernels run") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("array.bin");
    let seed = 0x0d0d;
    for page in [512usize, 4096, 65536] {
        let capacity = 16usize << 20;
        let bytes = 4 * capacity as u64;
        let mut data = vec![0u8; bytes as usize];
        pattern::fill(&mut data, 0, seed);
        std::fs::write(&path, &data).unwrap();
        drop(data);
        let file = FileHandle::open(
            &path,
            OpenOptions {
                write: true,
                ..OpenOptions::READ
            },
        )
        .unwrap();
        let cfg = PageCacheConfig {
            page_size: page,
            capacity,
            // Fewer slots than GPU threads: posts wait for slots.
            ring: RingConfig {
                slots: 1024,
                ..PageCacheConfig::default().ring
            },
            in_place: true,
            ..PageCacheConfig::default()
        };
        let cache = PageCache::new(engines.clone(), &gpu, cfg).unwrap();
        let array = cache
            .array::<u64>(Endpoint::file(&file, 0), bytes / 8, ArrayMode::ReadWrite)
            .unwrap();
        let (memory, table, ring) = array.hal_parts();
        let stream = gpu.stream().unwrap();
        let reads = 1u64 << 18;
        let t = std::time::Instant::now();
        let check =
            array_kernels::test_read(&stream, memory, table, &ring, reads, 8192, 1, seed, None)
                .unwrap();
        assert_eq!(check.reads, reads, "page {page}");
        assert_eq!(
            check.mismatches, 0,
            "page {page}: first bad {:?}",
            check.first_bad
        );
        array.check().unwrap();
        let s = array.stats().unwrap();
        assert!(
            s.misses > 0 && s.evictions > 0 && s.failures == 0,
            "page {page}: {s:?}"
        );
        println!(
            "page {page}: {reads} checked reads in {:?}: {s:?}",
            t.elapsed()
        );
        let t = std::time::Instant::now();

        // Stores into every page (every 7th element), many evicted dirty along the way.
        let (every, written) = (7u64, 0xbeef);
        array_kernels::test_store(&stream, memory, table, &ring, every, written).unwrap();
        array.check().unwrap();
        println!("page {page}: stores in {:?}", t.elapsed());
        let check = array_kernels::test_read(
            &stream,
            memory,
            table,
            &ring,
            reads,
            8192,
            2,
            seed,
            Some((every, written)),
        )
        .unwrap();
        assert_eq!(
            check.mismatches, 0,
            "page {page} after stores: {:?}",
            check.first_bad
        );
        let t = std::time::Instant::now();
        array.synchronize().unwrap();
        println!("page {page}: synchronize in {:?}", t.elapsed());
        let s = array.stats().unwrap();
        assert!(s.writebacks > 0 && s.bytes_out > 0, "page {page}: {s:?}");
        let back = std::fs::read(&path).unwrap();
        for (i, w) in back.chunks_exact(8).enumerate() {
            let i = i as u64;
            let want = if i.is_multiple_of(every) {
                pattern::word_at(written, i)
            } else {
                pattern::word_at(seed, i)
            };
            assert_eq!(
                u64::from_le_bytes(w.try_into().unwrap()),
                want,
                "page {page} element {i}"
            );
        }
        println!(
            "page {page}: {} misses, {} evictions, {} write-backs, miss p50 {:?} ns p99 {:?} ns",
            s.misses,
            s.evictions,
            s.writebacks,
            s.miss_quantile_ns(0.5),
            s.miss_quantile_ns(0.99)
        );
        array.close().unwrap();
    }
}

#[test]
fn read_only_arrays_over_warm_files_read_misses_in_place() {
    let Some((engines, gpu)) = super::common::cuda("on-demand array kernels run") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("warm.bin");
    let seed = 0x1f1f;
    let capacity = 8usize << 20;
    let bytes = 4 * capacity as u64;
    let mut data = vec![0u8; bytes as usize];
    pattern::fill(&mut data, 0, seed);
    std::fs::write(&path, &data).unwrap(); // its pages stay in the page cache: warm
    drop(data);
    let file = FileHandle::open(&path, OpenOptions::READ).unwrap();
    let can = gpu.info().page_cache_dma.clone();
    for page in [512usize, 4096, 65536] {
        // In place with every miss cached, in place admitting pages on their ninth touch
        // (most reads then read their 8 bytes over the bus), through the ring.
        for (in_place, admit_after) in [(true, 0), (true, 8), (false, 8)] {
            let cfg = PageCacheConfig {
                page_size: page,
                capacity,
                in_place,
                admit_after,
                ..PageCacheConfig::default()
            };
            let cache = PageCache::new(engines.clone(), &gpu, cfg).unwrap();
            let array = cache
                .array::<u64>(Endpoint::file(&file, 0), bytes / 8, ArrayMode::ReadOnly)
                .unwrap();
            assert_eq!(
                array.reads_in_place(),
                in_place && can.available,
                "page {page}: misses {} ({can:?})",
                array.miss_path()
            );
            let (memory, table, ring) = array.hal_parts();
            let stream = gpu.stream().unwrap();
            let reads = 1u64 << 18;
            let check =
                array_kernels::test_read(&stream, memory, table, &ring, reads, 8192, 5, seed, None)
                    .unwrap();
            assert_eq!(check.reads, reads);
            assert_eq!(
                check.mismatches, 0,
                "page {page} in place {in_place}: {check:?}"
            );
            array.check().unwrap();
            let s = array.stats().unwrap();
            assert_eq!(s.failures, 0, "{s:?}");
            if array.reads_in_place() {
                // Every access counted once: a hit, a wait, a fill, or a read in place; the
                // kernel's get_async half (4096 threads) waits for one future past its reads.
                assert_eq!(s.accesses(), reads + 8192 / 2, "{s:?}");
            }
            if array.reads_in_place() && admit_after > 0 {
                assert!(s.direct_reads > 0, "{s:?}");
                assert_eq!(s.direct_bytes, s.direct_reads * ondemand::SECTOR_BYTES);
            } else {
                assert!(
                    s.direct_reads == 0 && s.misses > 0 && s.evictions > 0,
                    "{s:?}"
                );
            }
            println!(
                "page {page}, misses {}: {} misses, {} read in place, miss p50 {:?} ns",
                array.miss_path(),
                s.misses,
                s.direct_reads,
                s.miss_quantile_ns(0.5)
            );
        }
    }
    // Host memory reads in place too, where the device can register it.
    let mut buf = HostBuffer::alloc(bytes as usize, &HostAllocOptions::default()).unwrap();
    pattern::fill(&mut buf, 0, seed);
    let mem = HostMemory::new(buf);
    let cache = PageCache::new(engines.clone(), &gpu, PageCacheConfig::default()).unwrap();
    let array = cache
        .array::<u64>(Endpoint::host(&mem, 0), bytes / 8, ArrayMode::ReadOnly)
        .unwrap();
    assert!(array.reads_in_place(), "{}", array.miss_path());
    let (memory, table, ring) = array.hal_parts();
    let check = array_kernels::test_read(
        &gpu.stream().unwrap(),
        memory,
        table,
        &ring,
        1 << 18,
        8192,
        6,
        seed,
        None,
    )
    .unwrap();
    assert_eq!(check.mismatches, 0, "host memory in place: {check:?}");
    array.check().unwrap();
    let s = array.stats().unwrap();
    assert!(s.direct_reads > 0 && s.failures == 0, "{s:?}");
    drop(array);
    // An array longer than its file is never read in place: reads past the end must fail.
    let cache = PageCache::new(engines, &gpu, PageCacheConfig::default()).unwrap();
    let long = cache
        .array::<u64>(Endpoint::file(&file, 0), bytes / 8 + 1, ArrayMode::ReadOnly)
        .unwrap();
    assert!(!long.reads_in_place(), "{}", long.miss_path());
    assert!(
        long.miss_path().contains("past its end"),
        "{}",
        long.miss_path()
    );
}

#[test]
fn kernel_errors_are_reported_not_read_as_data() {
    let Some((engines, gpu)) = super::common::cuda("on-demand array kernels run") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short.bin");
    let mut data = vec![0u8; 1 << 20];
    pattern::fill(&mut data, 0, 3);
    std::fs::write(&path, &data).unwrap();
    let file = FileHandle::open(&path, OpenOptions::READ).unwrap();
    let cfg = PageCacheConfig {
        capacity: 1 << 20,
        ..PageCacheConfig::default()
    };
    let cache = PageCache::new(engines, &gpu, cfg).unwrap();
    // Twice the file: reads of the second half fail.
    let array = cache
        .array::<u64>(Endpoint::file(&file, 0), (2 << 20) / 8, ArrayMode::ReadOnly)
        .unwrap();
    let (memory, table, ring) = array.hal_parts();
    let stream = gpu.stream().unwrap();
    let check =
        array_kernels::test_read(&stream, memory, table, &ring, 4096, 1024, 3, 3, None).unwrap();
    assert!(
        check.mismatches > 0,
        "reads past the file's end came back as data"
    );
    assert!(array.check().is_err());
    // Stores into a read-only array are refused and recorded.
    array_kernels::test_store(&stream, memory, table, &ring, 64, 9).unwrap();
    let e = array.check().unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
}

#[test]
fn row_and_element_gathers_read_every_byte_right() {
    let Some((engines, gpu)) = super::common::cuda("on-demand array kernels run") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rows.bin");
    let (seed, bytes) = (0x5eed, 32usize << 20);
    let mut data = vec![0u8; bytes];
    pattern::fill(&mut data, 0, seed);
    std::fs::write(&path, &data).unwrap();
    let file = FileHandle::open(&path, OpenOptions::READ).unwrap();
    let stream = gpu.stream().unwrap();
    for row in [512usize, 4096, 16384] {
        // Pages of 4 KiB: 512 B rows share pages, 16 KiB rows span four.
        let cfg = PageCacheConfig {
            page_size: 4096,
            capacity: 8 << 20,
            ..PageCacheConfig::default()
        };
        let cache = PageCache::new(engines.clone(), &gpu, cfg).unwrap();
        let array = cache
            .array::<u64>(
                Endpoint::file(&file, 0),
                (bytes / 8) as u64,
                ArrayMode::ReadOnly,
            )
            .unwrap();
        let (memory, table, ring) = array.hal_parts();
        let n = 8192usize;
        let ids: Vec<u64> = (0..n as u64)
            .map(|k| pattern::mix64(k ^ row as u64) % (bytes / row) as u64)
            .collect();
        let rows = gpu.alloc(n * 8).unwrap();
        let raw: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        stream.upload(&raw, &rows, 0).unwrap();
        let out = gpu.alloc(n * row).unwrap();
        array_kernels::bench_reads(
            &stream,
            Ok((memory.as_ref(), table, &ring)),
            &rows,
            n,
            row,
            &out,
            4096,
        )
        .unwrap();
        array.check().unwrap();
        let mut got = vec![0u8; n * row];
        stream.download(&out, 0, &mut got).unwrap();
        for (k, id) in ids.iter().enumerate() {
            let at = (id * row as u64) as usize;
            assert!(
                got[k * row..(k + 1) * row] == data[at..at + row],
                "row {k} ({row} B)"
            );
        }
        // Elements, through gather: the row numbers as element indices.
        array_kernels::bench_reads(
            &stream,
            Ok((memory.as_ref(), table, &ring)),
            &rows,
            n,
            0,
            &out,
            4096,
        )
        .unwrap();
        array.check().unwrap();
        let mut got = vec![0u8; n * 8];
        stream.download(&out, 0, &mut got).unwrap();
        for (k, id) in ids.iter().enumerate() {
            let word = u64::from_le_bytes(got[k * 8..k * 8 + 8].try_into().unwrap());
            assert_eq!(word, pattern::word_at(seed, *id), "element {id}");
        }
    }
}

#[test]
fn resident_arrays_read_right_while_other_arrays_thrash_the_cache() {
    let Some((engines, gpu)) = super::common::cuda("on-demand array kernels run") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (seed, bytes) = (0x4e5d, 64usize << 20);
    let file = pattern_file(&dir, "resident.bin", seed, bytes);
    let stream = gpu.stream().unwrap();
    // 16 MiB held in a 24 MiB cache; a 64 MiB array thrashes through the other 8 MiB (every
    // miss cached: read in place without a frame, it would not thrash).
    let cfg = PageCacheConfig {
        page_size: 4096,
        capacity: 24 << 20,
        admit_after: 0,
        ..PageCacheConfig::default()
    };
    let cache = PageCache::new(engines, &gpu, cfg).unwrap();
    let words = (16u64 << 20) / 8;
    let held = cache
        .array::<u64>(Endpoint::file(&file, 0), words, ArrayMode::ReadOnly)
        .unwrap();
    let other = cache
        .array::<u64>(
            Endpoint::file(&file, 0),
            (bytes / 8) as u64,
            ArrayMode::ReadOnly,
        )
        .unwrap();
    let resident = held.resident().unwrap();
    let frames = resident.held().frames().unwrap();
    assert_eq!(frames.len() as u64, held.pages());
    assert!(!frames.contains(&ondemand::NOT_HELD));

    let n = 1usize << 20;
    let idx: Vec<u64> = (0..n as u64).map(|k| pattern::mix64(k) % words).collect();
    let idx_buf = gpu.alloc(n * 8).unwrap();
    let raw: Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
    stream.upload(&raw, &idx_buf, 0).unwrap();
    let out = gpu.alloc(n * 8).unwrap();
    let check = |what: &str| {
        array_kernels::resident_bench_reads(&stream, resident.held(), &idx_buf, n, &out, 8192)
            .unwrap();
        held.check().unwrap();
        assert_words(&stream, &out, &idx, seed, what);
    };
    check("held");
    // The other array misses through the frames left: none of the held ones moves.
    let (memory, table, ring) = other.hal_parts();
    let c = array_kernels::test_read(&stream, memory, table, &ring, 1 << 18, 8192, 7, seed, None)
        .unwrap();
    assert_eq!(c.mismatches, 0, "first bad {:?}", c.first_bad);
    let s = other.stats().unwrap();
    assert!(s.evictions > 1000, "{s:?}");
    assert_eq!(resident.held().frames().unwrap(), frames);
    check("held, after the thrash");
    // An index past the end reads 0 and is reported.
    let past = gpu.alloc(8).unwrap();
    stream.upload(&words.to_le_bytes(), &past, 0).unwrap();
    array_kernels::resident_bench_reads(&stream, resident.held(), &past, 1, &out, 32).unwrap();
    assert_eq!(
        held.check().unwrap_err().code(),
        gpuio_hal::ErrorCode::InvalidArg
    );
    // Let go: no pins are left on the held array's pages.
    resident.release().unwrap();
    let (_, table, _) = held.hal_parts();
    assert_unpinned(&stream, table);
}

#[test]
fn gathers_read_right_while_their_hits_race_evictions() {
    let Some((engines, gpu)) = super::common::cuda("on-demand array kernels run") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (seed, bytes) = (0x9a7e, 32usize << 20);
    let file = pattern_file(&dir, "gather.bin", seed, bytes);
    let stream = gpu.stream().unwrap();
    // 8 MiB of frames for a 32 MiB array, every miss cached: a lane's eight hits in flight
    // meet pages being evicted and filled by the other warps.
    let cfg = PageCacheConfig {
        page_size: 4096,
        capacity: 8 << 20,
        admit_after: 0,
        ..PageCacheConfig::default()
    };
    let cache = PageCache::new(engines, &gpu, cfg).unwrap();
    let words = (bytes / 8) as u64;
    let array = cache
        .array::<u64>(Endpoint::file(&file, 0), words, ArrayMode::ReadOnly)
        .unwrap();
    let (memory, table, ring) = array.hal_parts();
    // Blocks of 64 random indices, then of 64 neighbours (adjacent lanes sharing pages: the
    // shared pins).
    let n = 1usize << 19;
    let idx: Vec<u64> = (0..n as u64)
        .map(|k| match (k >> 6) % 2 {
            0 => pattern::mix64(k ^ seed) % words,
            _ => (pattern::mix64(k >> 6) % words + (k & 63)) % words,
        })
        .collect();
    let idx_buf = gpu.alloc(n * 8).unwrap();
    let raw: Vec<u8> = idx.iter().flat_map(|i| i.to_le_bytes()).collect();
    stream.upload(&raw, &idx_buf, 0).unwrap();
    let out = gpu.alloc(n * 8).unwrap();
    for pass in 0..3 {
        array_kernels::bench_reads(
            &stream,
            Ok((memory.as_ref(), table, &ring)),
            &idx_buf,
            n,
            0,
            &out,
            16384,
        )
        .unwrap();
        array.check().unwrap();
        assert_words(&stream, &out, &idx, seed, &format!("pass {pass}"));
    }
    let s = array.stats().unwrap();
    assert!(s.evictions > 1000 && s.hits > 100_000, "{s:?}");
    // Every pin came off again.
    assert_unpinned(&stream, table);
    // An index past the end reads 0 and is reported; the ones beside it read right.
    let mixed = [3u64, words, words - 1];
    let raw: Vec<u8> = mixed.iter().flat_map(|i| i.to_le_bytes()).collect();
    stream.upload(&raw, &idx_buf, 0).unwrap();
    array_kernels::bench_reads(
        &stream,
        Ok((memory.as_ref(), table, &ring)),
        &idx_buf,
        3,
        0,
        &out,
        32,
    )
    .unwrap();
    assert_eq!(
        array.check().unwrap_err().code(),
        gpuio_hal::ErrorCode::InvalidArg
    );
    let mut got = vec![0u8; 24];
    stream.download(&out, 0, &mut got).unwrap();
    let word = |k: usize| u64::from_le_bytes(got[k * 8..k * 8 + 8].try_into().unwrap());
    assert_eq!(word(0), pattern::word_at(seed, 3));
    assert_eq!(word(1), 0);
    assert_eq!(word(2), pattern::word_at(seed, words - 1));
}

/// A file of `bytes` bytes of the data pattern from `seed` in `dir`, opened for reading.
fn pattern_file(dir: &tempfile::TempDir, name: &str, seed: u64, bytes: usize) -> FileHandle {
    let path = dir.path().join(name);
    let mut data = vec![0u8; bytes];
    pattern::fill(&mut data, 0, seed);
    std::fs::write(&path, &data).unwrap();
    FileHandle::open(&path, OpenOptions::READ).unwrap()
}

/// `out` holds the pattern's word at each of `idx`, in order.
fn assert_words(
    stream: &gpuio_hal::Stream,
    out: &gpuio_hal::DeviceBuffer,
    idx: &[u64],
    seed: u64,
    what: &str,
) {
    let mut got = vec![0u8; idx.len() * 8];
    stream.download(out, 0, &mut got).unwrap();
    for (k, i) in idx.iter().enumerate() {
        let word = u64::from_le_bytes(got[k * 8..k * 8 + 8].try_into().unwrap());
        assert_eq!(word, pattern::word_at(seed, *i), "{what}: element {i}");
    }
}

/// No page of `table` holds a pin.
fn assert_unpinned(stream: &gpuio_hal::Stream, table: &ondemand::PageTable) {
    let mut raw = vec![0u8; table.pages() as usize * 8];
    stream.download(table.table(), 0, &mut raw).unwrap();
    for (page, e) in raw.chunks_exact(8).enumerate() {
        let e = u64::from_le_bytes(e.try_into().unwrap());
        assert_eq!(ondemand::page_pins(e), 0, "page {page}");
    }
}
