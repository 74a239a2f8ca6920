//! Warm reads straight from the page cache: where the device can register a file's mapping
//! read-only, resident chunks are read by its copy engine and cold ones by the lanes; where it
//! cannot (the host backend), the policy declines with the device's reason and the lanes read
//! everything. The data is checked either way, and a file truncated and regrown during reads
//! never crashes a read or yields a short success.

use gpuio_hal::memory::mapped::FileMapping;
use gpuio_hal::{BackendPreference, DeviceBuffer, ErrorCode, Gpu, HalError, pattern, probe};
use gpuio_testkit::Requirement;
use gpuio_transport_localio::{
    IoEngine, LocalIo, LocalIoConfig, LocalIoError, OpenOptions, PageCachePolicy,
};
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

fn gpu() -> Gpu {
    probe(BackendPreference::Auto).unwrap().gpus[0].clone()
}

/// The page cache path's chunk (256 MiB), for files that need several.
const CHUNK: usize = 256 << 20;

/// A scratch file in the temporary directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str, len: usize, seed: u64) -> Self {
        let path = std::env::temp_dir().join(format!("page-cache-{name}-{}", std::process::id()));
        let mut data = vec![0u8; len];
        pattern::fill(&mut data, 0, seed);
        std::fs::write(&path, &data).unwrap();
        Self(path)
    }

    /// Reads the whole file, so its pages are resident.
    fn warm(&self) {
        let mut sink = Vec::new();
        std::fs::File::open(&self.0)
            .unwrap()
            .read_to_end(&mut sink)
            .unwrap();
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn engine(threshold: usize) -> LocalIo {
    LocalIo::new(LocalIoConfig {
        lanes: 2,
        page_cache_threshold: threshold,
        ..LocalIoConfig::default()
    })
    .unwrap()
}

/// Four lanes (which outrun a one-off registration) and room to keep 1 GiB of hot files.
fn keeping_engine() -> LocalIo {
    LocalIo::new(LocalIoConfig {
        lanes: 4,
        page_cache_keep: 1 << 30,
        ..LocalIoConfig::default()
    })
    .unwrap()
}

fn check(gpu: &Gpu, dev: &DeviceBuffer, len: usize, seed: u64) {
    let mut got = vec![0u8; len];
    gpu.stream().unwrap().download(dev, 0, &mut got).unwrap();
    assert_eq!(pattern::first_deviation(&got, 0, seed), None);
}

#[test]
fn a_warm_read_comes_from_the_page_cache_where_the_device_can() {
    let gpu = gpu();
    let can = gpu.info().page_cache_dma.clone();
    // Several chunks where the path runs, so the registering threads take turns.
    let len = if can.available {
        2 * CHUNK + 12345
    } else {
        8 << 20
    };
    let f = Scratch::new("warm", len, 71);
    f.warm();
    let io = engine(1 << 20);
    let file = io.open(&f.0, OpenOptions::READ).unwrap();
    let dev = gpu.alloc(len).unwrap();
    let t = io.read_to_device(&file, 0, &dev, 0, len).unwrap();
    check(&gpu, &dev, len, 71);
    assert_eq!(t.bytes, len as u64);
    if can.available {
        assert_eq!(t.engine, IoEngine::PageCache, "{t}");
        assert_eq!(t.page_cache_bytes, len as u64, "{t}");
        assert!(t.to_string().contains("page cache"), "{t}");
    } else {
        Requirement::Cuda.missing(format_args!("page cache reads: {}", can.detail));
        assert_ne!(t.engine, IoEngine::PageCache);
        assert_eq!(t.page_cache_bytes, 0);
        // The device's own answer, typed, with the reason the policy went by.
        let map = Arc::new(FileMapping::new(&std::fs::File::open(&f.0).unwrap(), 0, len).unwrap());
        match gpu.pin_mapping(&map, 0..len) {
            Err(HalError::Unsupported { reason, .. }) => assert_eq!(reason, can.detail),
            other => panic!("expected Unsupported, got {other:?}"),
        }
    }
    // Off means off, whatever the device.
    let off = LocalIo::new(LocalIoConfig {
        page_cache: PageCachePolicy::Off,
        page_cache_threshold: 1,
        ..LocalIoConfig::default()
    })
    .unwrap();
    let t = off.read_to_device(&file, 0, &dev, 0, len).unwrap();
    assert_ne!(t.engine, IoEngine::PageCache);
}

#[test]
fn cold_chunks_go_through_the_lanes() {
    let gpu = gpu();
    if !gpu.info().page_cache_dma.available {
        Requirement::Cuda.missing("page cache reads need a device that registers file mappings");
        return;
    }
    let len = 3 * CHUNK;
    let f = Scratch::new("cold", len, 72);
    let io = engine(1 << 20);
    let file = io.open(&f.0, OpenOptions::READ).unwrap();
    file.sync_data().unwrap();
    file.drop_cache().unwrap();
    // Warm only the middle chunk.
    let mut mid = vec![0u8; CHUNK];
    file.read_exact_at(CHUNK as u64, &mut mid).unwrap();
    let dev = gpu.alloc(len).unwrap();
    let t = io.read_to_device(&file, 0, &dev, 0, len).unwrap();
    check(&gpu, &dev, len, 72);
    assert_eq!(t.engine, IoEngine::PageCache, "{t}");
    assert_eq!(t.page_cache_bytes, CHUNK as u64, "{t}");
    assert!(
        t.to_string().contains("the rest through the staged lanes"),
        "{t}"
    );
}

#[test]
fn residency_follows_the_page_cache() {
    let len = 4 << 20;
    let f = Scratch::new("resident", len, 73);
    let file = std::fs::File::open(&f.0).unwrap();
    f.warm();
    let map = FileMapping::new(&file, 100, len - 100).unwrap();
    assert_eq!(map.resident(0..len - 100).unwrap(), len - 100);
    file.sync_all().unwrap();
    gpuio_hal::file::drop_cached_pages(&file, 0, len as u64).unwrap();
    // tmpfs has no backing store to drop its pages to; every other file system drops them.
    if !on_tmpfs(&f.0) {
        assert!(
            map.resident(0..len - 100).unwrap() < len - 100,
            "pages dropped from the cache still count as resident"
        );
    }
    // Ranges outside the mapping are refused, not read.
    assert!(map.resident(0..len).is_err());
    assert!(FileMapping::new(&file, 0, 0).is_err());
}

/// A file truncated and grown back again and again while it is read: every read either
/// succeeds with the right bytes for the file as it stood, or fails with a typed error; none
/// crashes or reports a short read as success.
#[test]
fn a_file_truncated_during_reads_never_crashes_or_lies() {
    let gpu = gpu();
    let len = if gpu.info().page_cache_dma.available {
        CHUNK + (8 << 20)
    } else {
        8 << 20
    };
    let f = Scratch::new("truncate", len, 74);
    f.warm();
    let io = engine(1 << 20);
    let file = io.open(&f.0, OpenOptions::READ).unwrap();
    let dev = gpu.alloc(len).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (path, stop) = (f.0.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut data = vec![0u8; len];
            pattern::fill(&mut data, 0, 74);
            while !stop.load(Ordering::Acquire) {
                std::fs::File::options()
                    .write(true)
                    .open(&path)
                    .unwrap()
                    .set_len((len / 2) as u64)
                    .unwrap();
                std::fs::write(&path, &data).unwrap();
            }
        })
    };
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..20 {
        match io.read_to_device(&file, 0, &dev, 0, len) {
            Ok(t) => {
                // The writer always writes the same bytes, so a read that succeeded, from the
                // page cache or the lanes, must hold them all.
                assert_eq!(t.bytes, len as u64);
                check(&gpu, &dev, len, 74);
                ok += 1;
            }
            Err(e @ LocalIoError::UnexpectedEof { .. }) => {
                assert_eq!(e.code(), ErrorCode::InvalidArg);
                failed += 1;
            }
            Err(e) => panic!("an untyped failure: {e}"),
        }
    }
    stop.store(true, Ordering::Release);
    writer.join().unwrap();
    eprintln!("{ok} reads succeeded, {failed} met the file short");
    // Once the file is still, a read gets all of it right.
    f.warm();
    io.read_to_device(&file, 0, &dev, 0, len).unwrap();
    check(&gpu, &dev, len, 74);
}

fn on_tmpfs(path: &std::path::Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    // The longest mount point that contains the path is its file system.
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, at, fs) = (f.next()?, f.next()?, f.next()?);
            path.starts_with(at).then(|| (at.len(), fs == "tmpfs"))
        })
        .max()
        .is_some_and(|(_, tmpfs)| tmpfs)
}

/// A file read a second time, unchanged, keeps its registration: later reads (of any part of
/// it) are one copy from its pinned pages. A changed file is let go and read staged; a file
/// larger than `page_cache_keep` is never kept.
#[test]
fn a_hot_file_keeps_its_registration_until_it_changes() {
    let gpu = gpu();
    let len = 300 << 20;
    let f = Scratch::new("hot", len, 75);
    f.warm();
    let io = keeping_engine();
    let file = io.open(&f.0, OpenOptions::READ).unwrap();
    let dev = gpu.alloc(len).unwrap();
    let read = |off: usize, n: usize| {
        let t = io.read_to_device(&file, off as u64, &dev, off, n).unwrap();
        check(&gpu, &dev, len, 75);
        t
    };
    let first = read(0, len);
    // Four lanes outrun a one-off registration: the first read is staged.
    assert_ne!(first.engine, IoEngine::PageCache, "{first}");
    if !gpu.info().page_cache_dma.available {
        Requirement::Cuda.missing("kept page cache registrations need a GPU");
        let again = read(0, len);
        assert_ne!(again.engine, IoEngine::PageCache);
        assert_eq!(io.page_cache_stats().kept_files, 0);
        return;
    }
    // The second read asks for the registration, and goes through the lanes meanwhile.
    let second = read(0, len);
    assert_ne!(second.engine, IoEngine::PageCache, "{second}");
    io.wait_for_page_cache();
    let s = io.page_cache_stats();
    assert_eq!((s.kept_files, s.kept_bytes), (1, len as u64), "{s:?}");
    let third = read(100 << 20, 64 << 20);
    assert_eq!(
        (third.engine, third.page_cache_bytes, third.lanes),
        (IoEngine::PageCache, 64 << 20, 0)
    );
    assert!(third.to_string().contains("kept"), "{third}");
    let whole = read(0, len);
    assert_eq!(
        (whole.engine, whole.lanes),
        (IoEngine::PageCache, 0),
        "{whole}"
    );
    assert!(io.page_cache_stats().hits >= 2);

    // Rewritten (same bytes, new times): the registration is let go, the read staged.
    std::thread::sleep(std::time::Duration::from_millis(10));
    let mut data = vec![0u8; len];
    pattern::fill(&mut data, 0, 75);
    std::fs::write(&f.0, &data).unwrap();
    let changed = read(0, len);
    assert_ne!(changed.engine, IoEngine::PageCache, "{changed}");
    let s = io.page_cache_stats();
    assert_eq!(s.kept_files, 0, "{s:?}");
    assert!(s.released >= 1, "{s:?}");
    // Read again unchanged, it is kept again; released, its pages are unpinned.
    read(0, len);
    io.wait_for_page_cache();
    let kept_again = read(0, len);
    assert_eq!(
        (kept_again.engine, kept_again.lanes),
        (IoEngine::PageCache, 0)
    );
    assert_eq!(io.page_cache_stats().kept_files, 1);
    io.release_page_cache();
    assert_eq!(io.page_cache_stats().kept_bytes, 0);
    let after = read(0, len);
    assert_ne!(
        (after.engine, after.lanes),
        (IoEngine::PageCache, 0),
        "{after}"
    );
    // Kept again, then deleted: the next lookup lets the registration go (it could serve no
    // read by name), though the open handle still reads the file.
    read(0, len);
    io.wait_for_page_cache();
    assert_eq!(io.page_cache_stats().kept_files, 1);
    std::fs::remove_file(&f.0).unwrap();
    let orphan = read(0, len);
    assert_ne!(
        (orphan.engine, orphan.lanes),
        (IoEngine::PageCache, 0),
        "{orphan}"
    );
    assert_eq!(io.page_cache_stats().kept_files, 0);

    // A file above the limit is never kept.
    let small = LocalIo::new(LocalIoConfig {
        lanes: 4,
        page_cache_keep: 64 << 20,
        ..LocalIoConfig::default()
    })
    .unwrap();
    for _ in 0..3 {
        let t = small.read_to_device(&file, 0, &dev, 0, len).unwrap();
        assert_ne!(t.engine, IoEngine::PageCache, "{t}");
    }
    assert_eq!(small.page_cache_stats().kept_files, 0);
}

/// Reads below the threshold register nothing, but a file read more than once over in them is
/// kept, and from then on each of them is one copy from its pinned pages (as a cuFile program
/// reads: a whole file in 4 MiB calls, again and again).
#[test]
fn a_file_read_over_and_over_in_small_reads_is_kept() {
    let gpu = gpu();
    let (len, piece) = (32 << 20, 4 << 20);
    let f = Scratch::new("small-reads", len, 76);
    f.warm();
    let io = keeping_engine();
    let file = io.open(&f.0, OpenOptions::READ).unwrap();
    let dev = gpu.alloc(len).unwrap();
    let read_whole = || {
        let engines: Vec<IoEngine> = (0..len)
            .step_by(piece)
            .map(|at| {
                let t = io
                    .read_to_device(&file, at as u64, &dev, at, piece)
                    .unwrap();
                t.engine
            })
            .collect();
        check(&gpu, &dev, len, 76);
        engines
    };
    // Read whole once: nothing asks for a registration.
    assert!(read_whole().iter().all(|e| *e != IoEngine::PageCache));
    io.wait_for_page_cache();
    assert_eq!(io.page_cache_stats().kept_files, 0);
    // Past once over, the file is registered in the background.
    let again = read_whole();
    assert_ne!(again[0], IoEngine::PageCache);
    io.wait_for_page_cache();
    if !gpu.info().page_cache_dma.available {
        Requirement::Cuda.missing("kept page cache registrations need a GPU");
        assert_eq!(io.page_cache_stats().kept_files, 0);
        return;
    }
    let s = io.page_cache_stats();
    assert_eq!((s.kept_files, s.kept_bytes), (1, len as u64), "{s:?}");
    assert_eq!(
        s.misses, 0,
        "small reads that register nothing are no misses: {s:?}"
    );
    let hot = read_whole();
    assert!(hot.iter().all(|e| *e == IoEngine::PageCache), "{hot:?}");
    assert_eq!(io.page_cache_stats().hits, (len / piece) as u64);
    // A 4 KiB read at an odd offset comes from the registration too.
    let t = io.read_to_device(&file, 4099, &dev, 4099, 4096).unwrap();
    assert_eq!((t.engine, t.lanes), (IoEngine::PageCache, 0), "{t}");
    check(&gpu, &dev, len, 76);
}
