//! File extents: the text form an extent list is saved in (taken while the file system is
//! mounted, read once the controller is handed to gpuio's driver), FIEMAP's answers, and the
//! block reads planned from them.
//!
//! What must hold: text either gives extents that cover the file in order without holes or
//! is a typed error; accepted extents save as text that reads back the same; the block reads
//! planned for a namespace are whole blocks, in the buffer the file rounded up to a block
//! needs, and never wrap around.

use crate::Target;
use arbitrary::{Arbitrary, Unstructured};
use gpuio_hal::file::Extent;
use gpuio_nvme::FileExtents;

pub const TARGET: Target = Target {
    name: "extents",
    parses: "file-extent text, FIEMAP extents, block-read plans",
    sources: &["crates/gpuio-nvme/src/extents.rs"],
    run,
    seeds,
};

/// The first byte picks the form: even, extent text; odd, FIEMAP extents built from the rest.
fn run(data: &[u8]) {
    let Some((mode, rest)) = data.split_first() else {
        return;
    };
    let read = if mode & 1 == 0 {
        let Ok(text) = std::str::from_utf8(rest) else {
            return;
        };
        let Ok(e) = FileExtents::from_text(text) else {
            return;
        };
        e
    } else {
        let mut u = Unstructured::new(rest);
        let (Ok(len), Ok(start), Ok(found)) = (
            u64::arbitrary(&mut u),
            u64::arbitrary(&mut u),
            Vec::<(u64, u64, u64, u32)>::arbitrary(&mut u),
        ) else {
            return;
        };
        let found: Vec<Extent> = found
            .into_iter()
            .map(|(logical, physical, length, flags)| Extent {
                logical,
                physical,
                length,
                flags,
            })
            .collect();
        let Ok(e) = FileExtents::from_fiemap(len, &found, start) else {
            return;
        };
        e
    };
    let text = read.to_text();
    assert_eq!(
        FileExtents::from_text(&text).ok().as_ref(),
        Some(&read),
        "{text:?}"
    );
    let block = 512u64 << (mode >> 1 & 7);
    if let Ok(reads) = read.block_reads(block) {
        let room = read.len.next_multiple_of(block);
        for r in &reads {
            assert!(
                !r.write && r.len > 0 && (r.len as u64).is_multiple_of(block),
                "{r:?}"
            );
            let end = (r.offset as u64).checked_add(r.len as u64);
            assert!(end.is_some_and(|e| e <= room), "{r:?} past {room} bytes");
        }
    }
}

fn seeds() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = [
        "len 12288\n0 1048576 8192\n8192 4194304 4096\n",
        "len 100\n0 4096 4096\n",
        "len 0\n",
        "len 5\n0 0 2\n2 512 3\n",
    ]
    .iter()
    .map(|t| [&[0u8][..], t.as_bytes()].concat())
    .collect();
    out.push(vec![
        1, 0, 48, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]);
    out
}
