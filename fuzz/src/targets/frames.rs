//! gpuio-ai's compressed frames (LZ4 or ZSTD with a header of gpuio's own), as read back
//! from files and peers.
//!
//! What must hold: a frame decompresses to at most the bound the reader gives, or is a typed
//! error, with nothing allocated past that bound; a frame that decompresses has a header of
//! gpuio's (reserved bytes zero) that tells its length and checksum truly; its contents
//! compress again into a frame that gives them back.

use crate::Target;
use gpuio_ai::AiError;
use gpuio_ai::compress::{Codec, decompress, frame_info};

pub const TARGET: Target = Target {
    name: "frames",
    parses: "gpuio-ai compressed frames (header, LZ4 and ZSTD payloads, crc32c)",
    sources: &["crates/gpuio-ai/src/compress/codec.rs"],
    run,
    seeds,
};

/// The first two bytes are the reader's bound (in KiB), the rest the frame.
fn run(data: &[u8]) {
    let Some((bound, frame)) = data.split_first_chunk::<2>() else {
        return;
    };
    let max_len = usize::from(u16::from_le_bytes(*bound)) << 10;
    let info = frame_info(frame);
    match decompress(frame, max_len) {
        Ok(raw) => {
            let info = info.expect("a frame that decompresses has a header");
            assert!(raw.len() <= max_len);
            assert_eq!(info.raw_len, raw.len() as u64);
            assert_eq!(info.frame_len, frame.len() as u64);
            assert_eq!(info.crc32c, crc32c::crc32c(&raw));
            assert_eq!(frame[5..8], [0, 0, 0], "reserved header bytes taken");
            let again = info.codec.compress(&raw).expect("compresses");
            assert_eq!(decompress(&again, max_len).expect("decompresses"), raw);
        }
        Err(AiError::Corrupt(_) | AiError::InvalidArgument(_)) => {}
        Err(e) => panic!("not a typed frame error: {e}"),
    }
}

fn seeds() -> Vec<Vec<u8>> {
    let text = b"gpuio gpuio gpuio KV cache blocks compress well: 0000000000000000";
    let mut out = Vec::new();
    for codec in [
        Codec::Lz4,
        Codec::Zstd { level: 1 },
        Codec::Zstd { level: 9 },
    ] {
        for data in [&text[..], &[][..], &[7u8; 4000][..]] {
            let frame = codec.compress(data).expect("compresses");
            out.push([&[64u8, 0][..], &frame].concat());
        }
    }
    out
}
