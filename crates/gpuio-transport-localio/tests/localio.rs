//! LocalIO against real files: positioned IO, EOF, full disks (`/dev/full`), read-only files,
//! sparse files, and file↔GPU round trips on the probed backend.

use gpuio_hal::{BackendPreference, ErrorCode, pattern, probe};
use gpuio_transport_localio::{FileHandle, LocalIo, LocalIoConfig, LocalIoError, OpenOptions};
use proptest::prelude::*;

fn patterned_file(len: usize, seed: u64) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    let mut data = vec![0u8; len];
    pattern::fill(&mut data, 0, seed);
    std::fs::write(f.path(), &data).unwrap();
    f
}

#[test]
fn reads_stop_exactly_at_end_of_file() {
    let f = patterned_file(10_000, 1);
    let h = FileHandle::open(f.path(), OpenOptions::READ).unwrap();
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
}

#[test]
fn a_full_disk_is_a_typed_error_that_reports_nothing_written() {
    let full = FileHandle::open(
        "/dev/full",
        OpenOptions {
            write: true,
            ..OpenOptions::READ
        },
    );
    let Ok(full) = full else {
        eprintln!("skipped: /dev/full is not available here");
        return;
    };
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
}

#[test]
fn read_only_and_missing_files_are_refused() {
    let f = patterned_file(100, 2);
    let h = FileHandle::open(f.path(), OpenOptions::READ).unwrap();
    let err = h.write_all_at(0, b"x").unwrap_err();
    assert_eq!(err.code(), ErrorCode::Permission);
    let err = FileHandle::open("/nonexistent/gpuio", OpenOptions::READ).unwrap_err();
    assert_eq!(err.code(), ErrorCode::NotFound);
    assert!(err.to_string().contains("/nonexistent/gpuio"));
}

#[test]
fn sparse_files_read_as_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let h = FileHandle::open(dir.path().join("sparse"), OpenOptions::CREATE).unwrap();
    h.set_len(1 << 30).unwrap();
    h.write_all_at((1 << 30) - 4, b"tail").unwrap();
    let mut buf = vec![7u8; 8192];
    h.read_exact_at(1 << 29, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    let mut tail = [0u8; 4];
    h.read_exact_at((1 << 30) - 4, &mut tail).unwrap();
    assert_eq!(&tail, b"tail");
}

#[test]
fn files_round_trip_through_device_memory() {
    let p = probe(BackendPreference::Auto).unwrap();
    let gpu = &p.gpus[0];
    let io = LocalIo::new(LocalIoConfig {
        chunk_size: 64 << 10,
    });
    let len = (1 << 20) + 333;
    let src = patterned_file(len + 10, 3);
    let src = io.open(src.path(), OpenOptions::READ).unwrap();
    let dev = gpu.alloc(len + 7).unwrap();
    io.read_to_device(&src, 10, &dev, 7, len).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = io
        .open(dir.path().join("out"), OpenOptions::CREATE)
        .unwrap();
    io.write_from_device(&dev, 7, &out, 5, len).unwrap();
    let mut back = vec![0u8; len];
    out.read_exact_at(5, &mut back).unwrap();
    assert_eq!(pattern::first_deviation(&back, 10, 3), None);

    // Past the end of the file: a typed error, not a short success.
    let err = io.read_to_device(&src, 20, &dev, 0, len).unwrap_err();
    assert!(matches!(err, LocalIoError::UnexpectedEof { .. }), "{err}");
    // Past the end of the device buffer.
    let err = io.read_to_device(&src, 0, &dev, 8, len).unwrap_err();
    assert_eq!(err.code(), ErrorCode::InvalidArg);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn positioned_reads_match_the_file(off in 0u64..300_000, len in 0usize..100_000) {
        let total = 262_144usize;
        let f = patterned_file(total, 9);
        let h = FileHandle::open(f.path(), OpenOptions::READ).unwrap();
        let mut buf = vec![0u8; len];
        let got = h.read_at(off, &mut buf).unwrap();
        let expect = (total as u64).saturating_sub(off).min(len as u64) as usize;
        prop_assert_eq!(got, expect);
        prop_assert_eq!(pattern::first_deviation(&buf[..got], off, 9), None);
    }
}
