//! Files ↔ host memory on the IO threads: bytes checked over ranges that cut pieces at odd
//! places, buffered and O_DIRECT (aligned memory in place, unaligned through the bounce
//! buffer), writes that grow a direct file, end of file, a full disk and read-only handles.

use super::localio::{open, patterned_file};
use gpuio_hal::{HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_localio::{
    Durability, FileHandle, IoEngine, LocalIo, LocalIoConfig, LocalIoError, OpenOptions,
};

const RW: OpenOptions = OpenOptions {
    write: true,
    ..OpenOptions::READ
};

/// An engine with `n` host-copy threads and 1 MiB chunks (pieces of 256 KiB to 1 MiB).
fn threads(n: usize, checksum: bool) -> LocalIo {
    LocalIo::new(LocalIoConfig {
        host_threads: n,
        chunk_size: 1 << 20,
        checksum,
        ..LocalIoConfig::default()
    })
    .unwrap()
}

fn file_bytes(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[test]
fn reads_land_whole_in_caller_memory_on_many_threads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let len = (9 << 20) + 12_345;
    patterned_file(&path, len, 3);
    let io = threads(4, true);
    for direct in [false, true] {
        let opts = if direct {
            OpenOptions::READ.direct()
        } else {
            OpenOptions::READ
        };
        let Some(f) = open(&io, &path, opts) else {
            continue;
        };
        // (offset, length, offset into the destination): inline, a piece's edge, odd
        // offsets and memory, the whole file.
        for (offset, n, at) in [
            (0, 4096, 0),
            (777, 300_000, 1),
            (1 << 20, 2 << 20, 0),
            (4095, (5 << 20) + 3, 3),
            (0, len, 0),
        ] {
            let mut dst = vec![0u8; n + at];
            let t = io.read_to_host(&f, offset as u64, &mut dst[at..]).unwrap();
            assert_eq!(
                pattern::first_deviation(&dst[at..], offset as u64, 3),
                None,
                "direct {direct}, {offset}+{n} at +{at}"
            );
            assert_eq!((t.bytes, t.engine), (n as u64, IoEngine::HostCopy));
            assert_eq!(t.crc32c, Some(crc32c::crc32c(&dst[at..])), "{t}");
            if n >= 4 << 20 {
                assert!(t.lanes > 1, "{n} bytes on one thread: {t}");
            }
        }
        // Aligned memory: read in place on a direct file.
        let mut aligned = HostBuffer::alloc(len, &HostAllocOptions::default()).unwrap();
        io.read_to_host(&f, 0, &mut aligned[..len]).unwrap();
        assert_eq!(pattern::first_deviation(&aligned[..len], 0, 3), None);
    }
}

#[test]
fn a_read_past_the_end_says_how_far_the_file_goes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    patterned_file(&path, 3 << 20, 5);
    let io = threads(3, false);
    let f = io.open(&path, OpenOptions::READ).unwrap();
    let mut dst = vec![0u8; 2 << 20];
    let err = io.read_to_host(&f, 2 << 20, &mut dst).unwrap_err();
    assert!(
        matches!(
            err,
            LocalIoError::UnexpectedEof { offset, wanted, got, .. }
                if offset == 2 << 20 && wanted == 2 << 20 && got == 1 << 20
        ),
        "{err:?}"
    );
    let err = io.read_to_host(&f, u64::MAX - 10, &mut dst).unwrap_err();
    assert!(matches!(err, LocalIoError::Hal(_)), "{err:?}");
}

#[test]
fn writes_from_many_threads_keep_the_bytes_around_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    let len = 6 << 20;
    let mut src = vec![0u8; (7 << 20) + 1];
    pattern::fill(&mut src, 0, 8);
    let io = threads(4, true);
    for direct in [false, true] {
        patterned_file(&path, len, 4);
        let opts = if direct { RW.direct() } else { RW };
        let Some(f) = open(&io, &path, opts) else {
            continue;
        };
        // Unaligned edges in the middle: the blocks around them keep the file's bytes.
        let (at, n) = (1001, (3 << 20) + 999);
        let t = io
            .write_from_host(&src[1..=n], &f, at, Durability::DataSync)
            .unwrap();
        assert!(t.lanes > 1, "{t}");
        assert_eq!(t.crc32c, Some(crc32c::crc32c(&src[1..=n])));
        let back = file_bytes(&path);
        assert_eq!(back.len(), len, "direct {direct}");
        assert_eq!(pattern::first_deviation(&back[..1001], 0, 4), None);
        assert_eq!(back[1001..1001 + n], src[1..=n], "direct {direct}");
        assert_eq!(
            pattern::first_deviation(&back[1001 + n..], (1001 + n) as u64, 4),
            None
        );
        // Past the end, to an unaligned length: the padding is trimmed once, after all pieces.
        let grow = (len - 5) as u64;
        io.write_from_host(&src, &f, grow, Durability::None)
            .unwrap();
        let back = file_bytes(&path);
        assert_eq!(
            back.len() as u64,
            grow + src.len() as u64,
            "direct {direct}"
        );
        assert_eq!(back[grow as usize..], src[..], "direct {direct}");
    }
}

#[test]
fn a_full_disk_or_a_read_only_file_loses_nothing_silently() {
    let io = threads(4, false);
    let src = vec![7u8; 4 << 20];
    if std::path::Path::new("/dev/full").exists() {
        let full = FileHandle::open("/dev/full", RW).unwrap();
        let err = io
            .write_from_host(&src, &full, 0, Durability::None)
            .unwrap_err();
        assert!(
            matches!(err, LocalIoError::NoSpace { wanted, written: 0, .. } if wanted == 4 << 20),
            "{err:?}"
        );
    } else {
        eprintln!("skipped the full disk: /dev/full is not available here");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    patterned_file(&path, 1 << 20, 1);
    let ro = io.open(&path, OpenOptions::READ).unwrap();
    let err = io
        .write_from_host(&src, &ro, 0, Durability::None)
        .unwrap_err();
    assert!(matches!(err, LocalIoError::ReadOnly(_)), "{err:?}");
    assert_eq!(pattern::first_deviation(&file_bytes(&path), 0, 1), None);
}
