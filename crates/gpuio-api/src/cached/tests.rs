//! Cached files through a session on the probed backend, over real files: what reads return
//! (to host and device memory, across blocks and levels), hits on a second read, write-back
//! and write-through reaching the file, and what is refused.

use super::*;
use crate::Config;
use gpuio_core::cache::Level;
use gpuio_hal::pattern;
use std::path::{Path, PathBuf};

/// A session whose `[cache]` section is `cache` (the rest: defaults).
fn session(cache: &str) -> Session {
    let cfg = Config::from_toml(&format!("[cache]\n{cache}\n"), None).unwrap();
    Session::new(cfg).unwrap()
}

/// A file of `len` bytes of pattern `seed`, and its URI.
fn patterned(dir: &Path, len: usize, seed: u64) -> (PathBuf, Uri) {
    let path = dir.join(format!("data-{seed}"));
    let mut data = vec![0u8; len];
    pattern::fill(&mut data, 0, seed);
    std::fs::write(&path, &data).unwrap();
    let uri = Uri::parse(path.to_str().unwrap()).unwrap();
    (path, uri)
}

/// A random number from `state`, advanced.
fn next(state: &mut u64) -> u64 {
    *state = pattern::mix64(*state);
    *state
}

#[test]
fn random_reads_across_blocks_and_levels_return_the_files_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let l3 = tempfile::tempdir().unwrap();
    let len = (1 << 20) + 1234;
    let (_, uri) = patterned(dir.path(), len, 41);
    // 4 KiB blocks on three small levels (8 + 16 + 32 blocks for 257 blocks of file), with
    // prefetching: blocks move down and out all the time.
    let s = session(&format!(
        "block_size = \"4 KiB\"\nl1_size = \"32 KiB\"\nl2_size = \"64 KiB\"\n\
         l3_dir = {:?}\nl3_size = \"128 KiB\"",
        l3.path().to_str().unwrap()
    ));
    let file = s.open_cached(&uri, Access::Read).unwrap();
    assert_eq!(file.len(), len as u64);
    assert_eq!(file.block_size(), 4096);
    let dev = s.alloc_device(0, 64 << 10).unwrap();
    let mut rng = 7;
    for i in 0..400 {
        let off = next(&mut rng) % len as u64;
        let most = (len as u64 - off).min(3 * 4096 + 100);
        let n = (next(&mut rng) % most + 1) as usize;
        let mut buf = vec![0u8; n];
        if i % 3 == 0 {
            let at = (next(&mut rng) % 1000) as usize;
            file.read_to_device(off, &dev, at, n).unwrap();
            s.download(&dev, at, &mut buf).unwrap();
        } else {
            file.read(off, &mut buf).unwrap();
        }
        assert_eq!(
            pattern::first_deviation(&buf, off, 41),
            None,
            "read {i}: {n} bytes at {off}"
        );
    }
    let stats = file.stats();
    let levels: Vec<Level> = stats.levels.iter().map(|l| l.level).collect();
    assert_eq!(levels, [Level::L1, Level::L2, Level::L3]);
    for l in &stats.levels {
        assert!(l.hits > 0, "{l:?}");
        assert!(l.resident <= l.capacity, "{l:?}");
    }
    // The working set is larger than the cache: every level gave blocks away.
    assert!(stats.levels.iter().all(|l| l.evictions > 0), "{stats:?}");
    file.close().unwrap();
}

#[test]
fn a_second_read_of_a_range_hits_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let (_, uri) = patterned(dir.path(), 256 << 10, 42);
    let s = session("block_size = \"4 KiB\"\nl2_size = \"1 MiB\"\nprefetch = false");
    let file = s.open_cached(&uri, Access::Read).unwrap();
    // Bytes 10000..60000: blocks 2 to 14.
    let mut buf = vec![0u8; 50_000];
    file.read(10_000, &mut buf).unwrap();
    assert_eq!(pattern::first_deviation(&buf, 10_000, 42), None);
    let l2 = |f: &CachedFile| f.stats().level(Level::L2).cloned().unwrap();
    let first = l2(&file);
    assert_eq!((first.hits, first.misses, first.resident), (0, 13, 13));
    buf.fill(0);
    file.read(10_000, &mut buf).unwrap();
    assert_eq!(pattern::first_deviation(&buf, 10_000, 42), None);
    let second = l2(&file);
    assert_eq!((second.hits, second.misses), (13, 13));
    // Into device memory, from the same blocks.
    let dev = s.alloc_device(0, 50_000).unwrap();
    file.read_to_device(10_000, &dev, 0, 50_000).unwrap();
    buf.fill(0);
    s.download(&dev, 0, &mut buf).unwrap();
    assert_eq!(pattern::first_deviation(&buf, 10_000, 42), None);
    assert_eq!(l2(&file).hits, 26);
    assert_eq!(file.stats().levels.len(), 1, "only L2 is configured");
}

#[test]
fn concurrent_readers_share_one_cached_file() {
    let dir = tempfile::tempdir().unwrap();
    let len = 512 << 10;
    let (_, uri) = patterned(dir.path(), len, 43);
    let s = session("block_size = \"4 KiB\"\nl2_size = \"128 KiB\"");
    let file = Arc::new(s.open_cached(&uri, Access::Read).unwrap());
    let readers: Vec<_> = (0..4u64)
        .map(|t| {
            let file = Arc::clone(&file);
            std::thread::spawn(move || {
                let mut rng = 100 + t;
                for _ in 0..200 {
                    let off = next(&mut rng) % len as u64;
                    let n = (next(&mut rng) % (len as u64 - off).min(20_000) + 1) as usize;
                    let mut buf = vec![0u8; n];
                    file.read(off, &mut buf).unwrap();
                    assert_eq!(
                        pattern::first_deviation(&buf, off, 43),
                        None,
                        "{n} at {off}"
                    );
                }
            })
        })
        .collect();
    for r in readers {
        r.join().unwrap();
    }
    let l2 = file.stats().level(Level::L2).cloned().unwrap();
    assert!(l2.hits > 0 && l2.misses > 0, "{l2:?}");
}

#[test]
fn write_back_reaches_the_file_at_flush_close_or_drop() {
    let dir = tempfile::tempdir().unwrap();
    let (path, uri) = patterned(dir.path(), 64 << 10, 44);
    let s = session("block_size = \"4 KiB\"\nl2_size = \"1 MiB\"\nprefetch = false");
    let file = s.open_cached(&uri, Access::Write).unwrap();
    // Bytes 3000..8000: parts of blocks 0 and 1.
    file.write(3000, &[0xAB; 5000]).unwrap();
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(
        pattern::first_deviation(&on_disk, 0, 44),
        None,
        "write-back: nothing reaches the file before a flush"
    );
    let mut back = vec![0u8; 5000];
    file.read(3000, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0xAB),
        "the cache serves its newer bytes"
    );
    file.flush().unwrap();
    let on_disk = std::fs::read(&path).unwrap();
    assert!(on_disk[3000..8000].iter().all(|&b| b == 0xAB));
    assert_eq!(pattern::first_deviation(&on_disk[..3000], 0, 44), None);
    assert_eq!(pattern::first_deviation(&on_disk[8000..], 8000, 44), None);
    assert_eq!(on_disk.len(), 64 << 10, "the file keeps its size");
    assert_eq!(file.stats().writebacks, 2);

    // Close writes back what is dirty, and so does drop.
    file.write(20_000, &[0xCD; 100]).unwrap();
    file.close().unwrap();
    assert!(
        std::fs::read(&path).unwrap()[20_000..20_100]
            .iter()
            .all(|&b| b == 0xCD)
    );
    let file = s.open_cached(&uri, Access::Write).unwrap();
    file.write(40_000, &[0xEF; 100]).unwrap();
    drop(file);
    assert!(
        std::fs::read(&path).unwrap()[40_000..40_100]
            .iter()
            .all(|&b| b == 0xEF)
    );
}

#[test]
fn write_through_reaches_the_file_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (path, uri) = patterned(dir.path(), 64 << 10, 45);
    let s = session(
        "block_size = \"4 KiB\"\nl2_size = \"1 MiB\"\nprefetch = false\n\
         write_policy = \"write-through\"",
    );
    let file = s.open_cached(&uri, Access::Write).unwrap();
    // A block not cached yet (a miss), then one just read (a hit).
    file.write(5000, &[1; 10]).unwrap();
    assert_eq!(std::fs::read(&path).unwrap()[5000..5010], [1; 10]);
    let mut buf = vec![0u8; 4096];
    file.read(32 << 10, &mut buf).unwrap();
    file.write((32 << 10) + 7, &[2; 10]).unwrap();
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(on_disk[(32 << 10) + 7..(32 << 10) + 17], [2; 10]);
    file.read(32 << 10, &mut buf).unwrap();
    assert_eq!(buf[7..17], [2; 10], "the cached copy was updated too");
    assert_eq!(pattern::first_deviation(&buf[..7], 32 << 10, 45), None);
    assert_eq!(file.stats().writebacks, 0, "nothing was left to write back");
}

#[test]
fn what_cannot_be_cached_or_done_is_refused_with_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (path, uri) = patterned(dir.path(), 8192, 46);
    let s = session("block_size = \"4 KiB\"\nl2_size = \"64 KiB\"");
    let e = s.open_cached(&Uri::Gpu(0), Access::Read).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    let missing = Uri::parse(dir.path().join("missing").to_str().unwrap()).unwrap();
    let e = s.open_cached(&missing, Access::Read).unwrap_err();
    assert_eq!(e.code(), gpuio_core::ErrorCode::NotFound, "{e}");
    let e = s.open_cached(&missing, Access::Write).unwrap_err();
    assert_eq!(
        e.code(),
        gpuio_core::ErrorCode::NotFound,
        "Access::Write does not create: {e}"
    );

    let file = s.open_cached(&uri, Access::Read).unwrap();
    let e = file.write(0, &[9; 10]).unwrap_err();
    assert!(matches!(e, Error::Invalid(_)), "{e}");
    let mut buf = [0u8; 10];
    let e = file.read(8190, &mut buf).unwrap_err();
    assert_eq!(e.code(), gpuio_core::ErrorCode::InvalidArg, "{e}");
    drop(file);
    assert_eq!(
        pattern::first_deviation(&std::fs::read(&path).unwrap(), 0, 46),
        None
    );

    // More host memory than the machine can back: refused when the file is opened, naming the
    // key, before anything is allocated.
    let room = gpuio_hal::memory::backing::backable_bytes(true).unwrap_or(u64::MAX);
    if room < crate::MAX_CACHE_MEMORY {
        let s = session("block_size = \"1 MiB\"\nl2_size = \"1 TiB\"");
        let e = s.open_cached(&uri, Access::Read).unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{e}");
        assert!(e.to_string().contains("cache.l2_size"), "{e}");
    }
}
