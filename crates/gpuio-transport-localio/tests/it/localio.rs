//! LocalIO against real files, on both engines (io_uring and pread/pwrite) and both caching
//! modes (buffered and O_DIRECT), into device memory of the probed backend: integrity over
//! random ranges, alignment, end of file, sparse files, truncation during a read, full disks,
//! striping, checksums, and the cuFile policy. Every failure is a typed error, and nothing is
//! reported written that was not.

use gpuio_hal::{BackendPreference, ErrorCode, Gpu, pattern, probe};
use gpuio_testkit::Requirement;
use gpuio_transport_localio::{
    Durability, EnginePreference, FileHandle, GdsPolicy, IoEngine, LocalIo, LocalIoConfig,
    LocalIoError, OpenOptions, StripeSet,
};
use proptest::prelude::*;
use std::path::Path;

fn gpu() -> Gpu {
    probe(BackendPreference::Auto).unwrap().gpus[0].clone()
}

fn engine(pref: EnginePreference, chunk: usize) -> Option<LocalIo> {
    let io = LocalIo::new(LocalIoConfig {
        engine: pref,
        chunk_size: chunk,
        lanes: 3,
        slots_per_lane: 2,
        ..LocalIoConfig::default()
    });
    match io {
        Ok(io) => Some(io),
        Err(e) => {
            eprintln!("skipped {pref:?}: {e}");
            None
        }
    }
}

/// Both engines where this machine has them.
fn engines(chunk: usize) -> Vec<LocalIo> {
    [EnginePreference::Uring, EnginePreference::Posix]
        .into_iter()
        .filter_map(|p| engine(p, chunk))
        .collect()
}

/// Opens `path` on `io`; `None` where [`skip_refused_direct`] allows it.
pub(crate) fn open(io: &LocalIo, path: &Path, opts: OpenOptions) -> Option<FileHandle> {
    io.open(path, opts)
        .map_err(|e| skip_refused_direct(opts.direct, path, e))
        .ok()
}

/// For an open of `path` that failed: a skip only for an O_DIRECT open where the file system
/// itself refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE mounts), and never under
/// `GPUIO_REQUIRE_ODIRECT=1` (CI, whose scratch is ext4). Anything else panics: a refusal on
/// a file system that takes O_DIRECT is a failure, not a reason to pass.
fn skip_refused_direct(direct: bool, path: &Path, e: impl std::fmt::Display) {
    if !direct || fs_takes_direct_io(path) {
        panic!("opening {} (direct: {direct}): {e}", path.display());
    }
    Requirement::ODirect.missing(format_args!(
        "the file system of {} refuses O_DIRECT: {e}",
        path.display()
    ));
}

/// Whether the file system holding `path` opens a file of its own with O_DIRECT (asked of
/// the kernel directly, not of the code under test).
fn fs_takes_direct_io(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let probe = path.with_extension("direct-probe");
    let ok = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe)
        .is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

pub(crate) fn patterned_file(path: &Path, len: usize, seed: u64) {
    let mut data = vec![0u8; len];
    pattern::fill(&mut data, 0, seed);
    std::fs::write(path, &data).unwrap();
}

fn device_bytes(gpu: &Gpu, dev: &gpuio_hal::DeviceBuffer, off: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    gpu.stream().unwrap().download(dev, off, &mut out).unwrap();
    out
}

#[test]
fn engines_are_chosen_and_explained() {
    let io = LocalIo::new(LocalIoConfig::default()).unwrap();
    let (e, why) = io.engine();
    assert!(!why.is_empty());
    eprintln!("auto engine: {e} ({why})");
    let posix = engine(EnginePreference::Posix, 1 << 20).unwrap();
    assert_eq!(posix.engine().0, IoEngine::Posix);
}

#[test]
fn ranges_past_the_largest_file_offset_are_refused_not_overflowed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    patterned_file(&path, 8192, 1);
    let h = FileHandle::open(&path, OpenOptions::READ).unwrap();
    let gpu = gpu();
    let dev = gpu.alloc(8192).unwrap();
    for io in engines(4096) {
        for offset in [u64::MAX - 10, i64::MAX as u64 - 100] {
            let e = io.read_to_device(&h, offset, &dev, 0, 4096).unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
            let e = io
                .read_blocks_to_device(&h, &[0, offset / 4096 * 4096], 4096, &dev, 0)
                .unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidArg, "{e}");
        }
    }
}

#[test]
fn reads_stop_exactly_at_end_of_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    patterned_file(&path, 10_000, 1);
    let h = FileHandle::open(&path, OpenOptions::READ).unwrap();
    assert_eq!(h.len().unwrap(), 10_000);
    let mut buf = vec![0u8; 500];
    assert_eq!(h.read_at(9_800, &mut buf).unwrap(), 200);
    assert_eq!(pattern::first_deviation(&buf[..200], 9_800, 1), None);
    let err = h.read_exact_at(9_800, &mut buf).unwrap_err();
    assert!(
        matches!(
            err,
            LocalIoError::UnexpectedEof {
                offset: 9_800,
                wanted: 500,
                got: 200,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(h.read_at(20_000, &mut buf).unwrap(), 0);

    // The same through the pipeline, on each engine and caching mode: an error, never a short
    // success.
    let g = gpu();
    let dev = g.alloc(20_000).unwrap();
    for io in engines(4096) {
        for opts in [OpenOptions::READ, OpenOptions::READ.direct()] {
            let Some(f) = open(&io, &path, opts) else {
                continue;
            };
            let err = io.read_to_device(&f, 5_000, &dev, 0, 5_001).unwrap_err();
            assert!(
                matches!(err, LocalIoError::UnexpectedEof { .. }),
                "{:?}: {err}",
                io.engine().0
            );
            io.read_to_device(&f, 5_000, &dev, 0, 5_000).unwrap();
            assert_eq!(
                pattern::first_deviation(&device_bytes(&g, &dev, 0, 5_000), 5_000, 1),
                None
            );
        }
    }
}

#[test]
fn a_full_disk_is_a_typed_error_that_reports_nothing_written() {
    if !Path::new("/dev/full").exists() {
        eprintln!("skipped: /dev/full is not available here");
        return;
    }
    let full = FileHandle::open(
        "/dev/full",
        OpenOptions {
            write: true,
            ..OpenOptions::READ
        },
    )
    .unwrap();
    let err = full.write_all_at(0, &[1u8; 4096]).unwrap_err();
    assert!(
        matches!(
            err,
            LocalIoError::NoSpace {
                wanted: 4096,
                written: 0,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(err.code(), ErrorCode::Io);
    let g = gpu();
    let dev = g.alloc(1 << 20).unwrap();
    for io in engines(64 << 10) {
        let err = io
            .write_from_device(&dev, 0, &full, 0, 1 << 20, Durability::None)
            .unwrap_err();
        assert!(
            matches!(err, LocalIoError::NoSpace { written: 0, .. }),
            "{:?}: {err}",
            io.engine().0
        );
    }
}

#[test]
fn read_only_and_missing_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    patterned_file(&path, 100, 2);
    let h = FileHandle::open(&path, OpenOptions::READ).unwrap();
    assert_eq!(
        h.write_all_at(0, b"x").unwrap_err().code(),
        ErrorCode::Permission
    );
    let g = gpu();
    let dev = g.alloc(100).unwrap();
    let io = engines(4096).remove(0);
    let err = io
        .write_from_device(&dev, 0, &h, 0, 100, Durability::None)
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Permission);
    let err = FileHandle::open("/nonexistent/gpuio", OpenOptions::READ).unwrap_err();
    assert_eq!(err.code(), ErrorCode::NotFound);
    assert!(err.to_string().contains("/nonexistent/gpuio"));
    // Out of the device buffer's range.
    let err = io.read_to_device(&h, 0, &dev, 50, 51).unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg);
}

#[test]
fn sparse_files_read_as_zeros_and_extents_skip_holes() {
    let dir = tempfile::tempdir().unwrap();
    let h = FileHandle::open(dir.path().join("sparse"), OpenOptions::CREATE).unwrap();
    h.set_len(1 << 30).unwrap();
    h.write_all_at((1 << 30) - 4, b"tail").unwrap();
    let mut buf = vec![7u8; 8192];
    h.read_exact_at(1 << 29, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    let g = gpu();
    let dev = g.alloc(1 << 20).unwrap();
    for io in engines(256 << 10) {
        io.read_to_device(&h, (1 << 30) - (1 << 20), &dev, 0, 1 << 20)
            .unwrap();
        let back = device_bytes(&g, &dev, 0, 1 << 20);
        assert!(back[..(1 << 20) - 4].iter().all(|&b| b == 0));
        assert_eq!(&back[(1 << 20) - 4..], b"tail");
    }
    match h.extents(0, 1 << 30) {
        Ok(ex) => {
            let mapped: u64 = ex.iter().map(|e| e.length).sum();
            assert!(mapped < 1 << 20, "a 1 GiB hole reported as data: {ex:?}");
        }
        Err(e) => eprintln!("skipped extent check: {e}"),
    }
}

#[test]
fn direct_io_handles_any_range_and_trims_padding() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d");
    let len = (3 << 20) + 777;
    patterned_file(&path, len, 4);
    let Some(probe_io) = engine(EnginePreference::Posix, 4096) else {
        return;
    };
    let Some(h) = open(&probe_io, &path, OpenOptions::READ.direct()) else {
        return;
    };
    assert!(h.required_alignment() >= 512);
    // Unaligned offset, length and memory through the bounce path.
    let mut buf = vec![0u8; 100_003];
    h.read_exact_at(12_345, &mut buf[1..100_002]).unwrap();
    assert_eq!(pattern::first_deviation(&buf[1..100_002], 12_345, 4), None);

    let g = gpu();
    let dev = g.alloc(len).unwrap();
    g.stream().unwrap().fill_pattern(&dev, 0, len, 9).unwrap();
    for io in engines(256 << 10) {
        // Write an unaligned range into the middle of the file and one past its end.
        let w = io
            .open(
                &path,
                OpenOptions {
                    write: true,
                    ..OpenOptions::READ
                }
                .direct(),
            )
            .unwrap();
        io.write_from_device(&dev, 1000, &w, 1000, 500_001, Durability::DataSync)
            .unwrap();
        let mut back = vec![0u8; len];
        FileHandle::open(&path, OpenOptions::READ)
            .unwrap()
            .read_exact_at(0, &mut back)
            .unwrap();
        assert_eq!(
            pattern::first_deviation(&back[..1000], 0, 4),
            None,
            "head kept"
        );
        assert_eq!(
            pattern::first_deviation(&back[1000..501_001], 1000, 9),
            None,
            "written"
        );
        assert_eq!(
            pattern::first_deviation(&back[501_001..], 501_001, 4),
            None,
            "tail kept"
        );
        let grown = len as u64 + 12_345;
        io.write_from_device(&dev, 0, &w, grown - 4_097, 4_097, Durability::None)
            .unwrap();
        assert_eq!(w.len().unwrap(), grown, "padding trimmed");
        w.set_len(len as u64).unwrap();
        patterned_file(&path, len, 4);
    }
}

#[test]
fn a_read_racing_a_truncation_never_reports_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t");
    let len = 32 << 20;
    let g = gpu();
    let dev = g.alloc(len).unwrap();
    for io in engines(256 << 10) {
        for round in 0..4u64 {
            patterned_file(&path, len, round);
            let f = io.open(&path, OpenOptions::READ).unwrap();
            let cutter = {
                let path = path.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_micros(200 * round));
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(&path)
                        .unwrap()
                        .set_len(1 << 20)
                        .unwrap();
                })
            };
            let r = io.read_to_device(&f, 0, &dev, 0, len);
            cutter.join().unwrap();
            match r {
                // Finished first: every byte must be the original.
                Ok(_) => assert_eq!(
                    pattern::first_deviation(&device_bytes(&g, &dev, 0, len), 0, round),
                    None
                ),
                Err(e) => assert!(matches!(e, LocalIoError::UnexpectedEof { .. }), "{e}"),
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// Random ranges, both engines, buffered and direct: file -> device -> another file.
    #[test]
    fn random_ranges_round_trip(off in 0u64..400_000, len in 1usize..900_000, direct: bool,
                                posix: bool, dev_off in 0usize..5000, seed: u64) {
        let pref = if posix { EnginePreference::Posix } else { EnginePreference::Uring };
        let Some(io) = engine(pref, 64 << 10) else { return Ok(()) };
        let dir = tempfile::tempdir().unwrap();
        let src_path = dir.path().join("src");
        patterned_file(&src_path, 1_400_000, seed);
        let opts = if direct { OpenOptions::READ.direct() } else { OpenOptions::READ };
        let Some(src) = open(&io, &src_path, opts) else { return Ok(()) };
        let g = gpu();
        let dev = g.alloc(dev_off + len).unwrap();
        io.read_to_device(&src, off, &dev, dev_off, len).unwrap();
        let dst_opts = OpenOptions { direct, ..OpenOptions::CREATE };
        let dst = io.open(dir.path().join("dst"), dst_opts).unwrap();
        io.write_from_device(&dev, dev_off, &dst, off, len, Durability::None).unwrap();
        prop_assert_eq!(dst.len().unwrap(), off + len as u64);
        let mut back = vec![0u8; len];
        FileHandle::open(dir.path().join("dst"), OpenOptions::READ)
            .unwrap()
            .read_exact_at(off, &mut back)
            .unwrap();
        prop_assert_eq!(pattern::first_deviation(&back, off, seed), None);
    }
}

#[test]
fn random_blocks_gather_into_device_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blocks");
    let len = 8 << 20;
    patterned_file(&path, len, 21);
    let g = gpu();
    let n = 3000;
    let offsets: Vec<u64> = (0..n)
        .map(|i| (pattern::mix64(i as u64) % (len as u64 / 4096)) * 4096)
        .collect();
    let dev = g.alloc(n * 4096 + 64).unwrap();
    for io in engines(256 << 10) {
        for opts in [OpenOptions::READ, OpenOptions::READ.direct()] {
            let Some(f) = open(&io, &path, opts) else {
                continue;
            };
            let t = io
                .read_blocks_to_device(&f, &offsets, 4096, &dev, 64)
                .unwrap();
            assert_eq!(t.bytes, (n * 4096) as u64);
            let back = device_bytes(&g, &dev, 64, n * 4096);
            for (k, off) in offsets.iter().enumerate() {
                let got = &back[k * 4096..(k + 1) * 4096];
                assert_eq!(pattern::first_deviation(got, *off, 21), None, "block {k}");
            }
            // A block past the end of the file is an error, not a short success.
            let err = io
                .read_blocks_to_device(&f, &[0, len as u64], 4096, &dev, 0)
                .unwrap_err();
            assert!(matches!(err, LocalIoError::UnexpectedEof { .. }), "{err}");
            if f.is_direct() {
                let err = io
                    .read_blocks_to_device(&f, &[100], 4096, &dev, 0)
                    .unwrap_err();
                assert_eq!(err.code(), ErrorCode::InvalidArg);
            }
        }
        // Unaligned blocks on a buffered file are fine.
        let f = io.open(&path, OpenOptions::READ).unwrap();
        io.read_blocks_to_device(&f, &[1, 77_777], 100, &dev, 0)
            .unwrap();
        let back = device_bytes(&g, &dev, 0, 200);
        assert_eq!(pattern::first_deviation(&back[..100], 1, 21), None);
        assert_eq!(pattern::first_deviation(&back[100..], 77_777, 21), None);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// A stripe set written from the device reads back the same, and each file holds exactly
    /// its stripe units.
    #[test]
    fn stripe_sets_round_trip(n in 1usize..5, units in 1u64..8, off in 0u64..300_000,
                              len in 1usize..700_000, direct: bool, seed: u64) {
        let Some(io) = engine(EnginePreference::Auto, 64 << 10) else { return Ok(()) };
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<_> = (0..n).map(|i| dir.path().join(format!("stripe{i}"))).collect();
        let opts = OpenOptions { direct, ..OpenOptions::CREATE };
        let stripe = units * 4096;
        let set = match StripeSet::open(&paths, stripe, opts) {
            Ok(set) => set,
            Err(e) => {
                skip_refused_direct(direct, &paths[0], e);
                return Ok(());
            }
        };
        let g = gpu();
        let dev = g.alloc(len).unwrap();
        let mut data = vec![0u8; len];
        pattern::fill(&mut data, off, seed);
        g.stream().unwrap().upload(&data, &dev, 0).unwrap();
        io.write_striped_from_device(&dev, 0, &set, off, len, Durability::None).unwrap();
        // Each logical byte sits where the layout says.
        for pos in [off, off + len as u64 / 2, off + len as u64 - 1] {
            let (file, at) = set.locate(pos);
            let mut b = [0u8; 1];
            FileHandle::open(&paths[file], OpenOptions::READ).unwrap()
                .read_exact_at(at, &mut b).unwrap();
            prop_assert_eq!(b[0], data[(pos - off) as usize]);
        }
        let back = g.alloc(len).unwrap();
        io.read_striped_to_device(&set, off, &back, 0, len).unwrap();
        prop_assert_eq!(pattern::first_deviation(&device_bytes(&g, &back, 0, len), off, seed), None);
    }
}

#[test]
fn a_stripe_set_past_its_end_is_an_eof_error() {
    let dir = tempfile::tempdir().unwrap();
    let paths: Vec<_> = (0..3).map(|i| dir.path().join(format!("s{i}"))).collect();
    for p in &paths {
        patterned_file(p, 8192, 5);
    }
    let set = StripeSet::open(&paths, 4096, OpenOptions::READ).unwrap();
    assert_eq!(set.len().unwrap(), 3 * 8192);
    let g = gpu();
    let dev = g.alloc(1 << 20).unwrap();
    for io in engines(64 << 10) {
        io.read_striped_to_device(&set, 0, &dev, 0, 3 * 8192)
            .unwrap();
        let err = io
            .read_striped_to_device(&set, 1, &dev, 0, 3 * 8192)
            .unwrap_err();
        assert!(matches!(err, LocalIoError::UnexpectedEof { .. }), "{err}");
    }
    assert!(StripeSet::open(&paths, 0, OpenOptions::READ).is_err());
}

#[test]
fn checksums_follow_the_bytes_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c");
    let len = 3 << 20;
    patterned_file(&path, len + 100, 77);
    let expected = crc32c::crc32c(&std::fs::read(&path).unwrap()[100..100 + len]);
    let g = gpu();
    let dev = g.alloc(len).unwrap();
    for pref in [EnginePreference::Uring, EnginePreference::Posix] {
        let Ok(io) = LocalIo::new(LocalIoConfig {
            engine: pref,
            chunk_size: 256 << 10,
            checksum: true,
            ..LocalIoConfig::default()
        }) else {
            continue;
        };
        let f = io.open(&path, OpenOptions::READ).unwrap();
        let t = io.read_to_device(&f, 100, &dev, 0, len).unwrap();
        assert_eq!(t.crc32c, Some(expected));
        t.verify_crc32c(expected).unwrap();
        let err = t.verify_crc32c(expected ^ 1).unwrap_err();
        assert!(matches!(err, LocalIoError::Checksum { .. }), "{err}");
        assert_eq!(err.code(), ErrorCode::Io);
        // Writes checksum what came out of GPU memory.
        let out = io
            .open(dir.path().join("out"), OpenOptions::CREATE)
            .unwrap();
        let t = io
            .write_from_device(&dev, 0, &out, 0, len, Durability::DataSync)
            .unwrap();
        assert_eq!(t.crc32c, Some(expected));
    }
    // Without checksums nothing can be verified.
    let io = engine(EnginePreference::Auto, 1 << 20).unwrap();
    let f = io.open(&path, OpenOptions::READ).unwrap();
    let t = io.read_to_device(&f, 0, &dev, 0, 4096).unwrap();
    assert_eq!(t.crc32c, None);
    assert!(t.verify_crc32c(0).is_err());
}

/// cuFile: forced per file it either runs (a CUDA machine with libcufile, compat mode or
/// native) or fails with the reason; the policy never picks it where it cannot run or where
/// it would be slower than the lanes. `GPUIO_REQUIRE_GDS=1` makes its absence a failure.
#[test]
fn cufile_runs_where_it_can_and_says_why_not_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g");
    let len = (8 << 20) + 12_345;
    patterned_file(&path, len + 999, 31);
    let g = gpu();
    let dev = g.alloc(len).unwrap();
    let io = LocalIo::new(LocalIoConfig::default()).unwrap();
    let forced = OpenOptions {
        gds: Some(true),
        ..OpenOptions::READ
    };
    let f = io.open(&path, forced).unwrap();
    let available = g.gds();
    eprintln!("cuFile: {available:?}; {}", io.explain(&g));
    let required = Requirement::Gds.required();
    if required {
        assert!(available.is_ok(), "{available:?}");
    }
    let Ok((mode, _)) = available else {
        let err = io.read_to_device(&f, 999, &dev, 0, len).unwrap_err();
        assert_eq!(err.code(), ErrorCode::Unsupported, "{err}");
        // Files that leave it to the policy use the lanes.
        let plain = io.open(&path, OpenOptions::READ).unwrap();
        let t = io.read_to_device(&plain, 999, &dev, 0, len).unwrap();
        assert!(!matches!(t.engine, IoEngine::Gds(_)));
        return;
    };
    let t = match io.read_to_device(&f, 999, &dev, 0, len) {
        Err(e) if e.code() == ErrorCode::Unsupported && !required => {
            // The driver opened but cannot serve this file system (cufile.log says why).
            eprintln!("skipped: {e}");
            return;
        }
        other => other.unwrap(),
    };
    assert_eq!(t.engine, IoEngine::Gds(mode));
    assert_eq!(
        pattern::first_deviation(&device_bytes(&g, &dev, 0, len), 999, 31),
        None
    );
    // Write through cuFile, O_DIRECT and unaligned, then read back through the lanes.
    for direct in [false, true] {
        let out_path = dir.path().join(format!("out{direct}"));
        let out = io
            .open(
                &out_path,
                OpenOptions {
                    direct,
                    gds: Some(true),
                    ..OpenOptions::CREATE
                },
            )
            .unwrap();
        let t = io
            .write_from_device(&dev, 0, &out, 777, len, Durability::DataSync)
            .unwrap();
        assert_eq!(t.engine, IoEngine::Gds(mode));
        let back = std::fs::read(&out_path).unwrap();
        assert_eq!(back.len(), 777 + len);
        assert_eq!(pattern::first_deviation(&back[777..], 999, 31), None);
    }
    // Past the end: an error (which may leave the destination partly written).
    let err = io.read_to_device(&f, 1000, &dev, 0, len).unwrap_err();
    assert!(matches!(err, LocalIoError::UnexpectedEof { .. }), "{err}");
    // The policy: AUTO takes cuFile only natively and for O_DIRECT files; ON takes it in
    // compat mode too, from the threshold up.
    let plain = io.open(&path, OpenOptions::READ).unwrap();
    let t = io.read_to_device(&plain, 0, &dev, 0, len).unwrap();
    assert!(
        !matches!(t.engine, IoEngine::Gds(_)),
        "buffered files use the page cache"
    );
    if let Some(direct) = open(&io, &path, OpenOptions::READ.direct()) {
        let t = io.read_to_device(&direct, 0, &dev, 0, len).unwrap();
        assert_eq!(
            matches!(t.engine, IoEngine::Gds(_)),
            mode == gpuio_hal::GdsMode::Native
        );
    }
    let on = LocalIo::new(LocalIoConfig {
        gds: GdsPolicy::On,
        ..LocalIoConfig::default()
    })
    .unwrap();
    assert_eq!(
        on.read_to_device(&plain, 0, &dev, 0, len).unwrap().engine,
        IoEngine::Gds(mode)
    );
    assert!(!matches!(
        on.read_to_device(&plain, 0, &dev, 0, 4096).unwrap().engine,
        IoEngine::Gds(_)
    ));
}

/// Opens `path` read-only on another thread, failing if that blocks for 20 s (a FIFO).
fn open_for_reading(path: &Path) -> Result<FileHandle, LocalIoError> {
    let path = path.to_path_buf();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(FileHandle::open(&path, OpenOptions::READ)));
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .expect("opening for reading blocked")
}

#[test]
fn sources_that_cannot_be_sized_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success());
    assert!(made, "mkfifo");
    let socket = dir.path().join("socket");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let mut cases = vec![
        (fifo.clone(), "a FIFO"),
        (socket, "a socket"),
        (dir.path().to_path_buf(), "a directory"),
    ];
    for (path, kind) in [
        ("/dev/zero", "a character device"),
        ("/dev/urandom", "a character device"),
        ("/proc/cpuinfo", "has content"),
        ("/proc/self/status", "has content"),
        ("/proc/self/mem", "cannot be read"),
    ] {
        if Path::new(path).exists() {
            cases.push((path.into(), kind));
        }
    }
    for (path, kind) in &cases {
        let err = open_for_reading(path).unwrap_err();
        assert!(
            matches!(err, LocalIoError::Unsized { .. }),
            "{}: {err:?}",
            path.display()
        );
        assert_eq!(err.code(), ErrorCode::InvalidArg);
        let msg = err.to_string();
        assert!(
            msg.contains(&*path.to_string_lossy())
                && msg.contains(kind)
                && msg.contains("cannot be sized"),
            "{msg}"
        );
    }
    // Empty and non-empty regular files are sources; special files stay destinations.
    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"").unwrap();
    assert_eq!(open_for_reading(&empty).unwrap().len().unwrap(), 0);
    let full = dir.path().join("full");
    std::fs::write(&full, b"bytes").unwrap();
    let h = open_for_reading(&full).unwrap();
    let mut got = [0u8; 5];
    h.read_exact_at(0, &mut got).unwrap();
    assert_eq!(&got, b"bytes");
    for sink in ["/dev/null", "/dev/full"] {
        if Path::new(sink).exists() {
            let opts = OpenOptions {
                write: true,
                ..OpenOptions::READ
            };
            assert!(FileHandle::open(sink, opts).unwrap().is_writable());
        }
    }
}
