//! Lossless frames for engrams and cold tiers: LZ4 (fast) or ZSTD (smaller), each frame
//! carrying its codec, its decompressed length and the crc32c of its decompressed bytes, so a
//! frame is verified where it arrives. A damaged or forged frame is an error, never a wrong
//! result, and a header cannot make a reader allocate more than the caller allows.
//!
//! Layout (little endian): `b"GAIZ"`, codec (1 byte: 1 LZ4, 2 ZSTD), 3 zero bytes, the
//! decompressed length (u64), its crc32c (u32), the payload's length (u32), then the codec's
//! payload — so frames laid one after another can be read back one by one.

use crate::{AiError, Result};

const MAGIC: [u8; 4] = *b"GAIZ";
/// Bytes of a frame's header.
pub const FRAME_HEADER: usize = 24;
const HEADER: usize = FRAME_HEADER;

/// A lossless codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// LZ4 block format (`lz4_flex`).
    Lz4,
    /// Zstandard at `level` (1 fastest … 19 smallest; `zstd`).
    Zstd {
        /// Compression level.
        level: i32,
    },
}

/// What a frame's header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameInfo {
    /// LZ4 or ZSTD (ZSTD's level is not recorded: it is not needed to decompress).
    pub codec: Codec,
    /// Bytes once decompressed.
    pub raw_len: u64,
    /// crc32c of the decompressed bytes.
    pub crc32c: u32,
    /// The whole frame's length, header included.
    pub frame_len: u64,
}

impl Codec {
    fn id(self) -> u8 {
        match self {
            Self::Lz4 => 1,
            Self::Zstd { .. } => 2,
        }
    }

    /// `data` as one frame.
    pub fn compress(self, data: &[u8]) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(HEADER + data.len() / 2);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&[self.id(), 0, 0, 0]);
        out.extend_from_slice(&(data.len() as u64).to_le_bytes());
        out.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
        let payload = match self {
            Self::Lz4 => lz4_flex::block::compress(data),
            Self::Zstd { level } => zstd::bulk::compress(data, level)
                .map_err(|e| AiError::InvalidArgument(format!("zstd level {level}: {e}")))?,
        };
        let payload_len = u32::try_from(payload.len()).map_err(|_| {
            AiError::InvalidArgument(format!(
                "{} bytes compress to more than a frame holds (4 GiB): compress in chunks",
                data.len()
            ))
        })?;
        out.extend_from_slice(&payload_len.to_le_bytes());
        out.extend_from_slice(&payload);
        Ok(out)
    }
}

/// Reads a frame's header.
pub fn frame_info(frame: &[u8]) -> Result<FrameInfo> {
    let corrupt = |why: &str| AiError::Corrupt(format!("compressed frame: {why}"));
    if frame.len() < HEADER {
        return Err(corrupt(&format!(
            "{} bytes, shorter than its header",
            frame.len()
        )));
    }
    if frame[..4] != MAGIC {
        return Err(corrupt("not a gpuio frame (bad magic)"));
    }
    let codec = match frame[4] {
        1 => Codec::Lz4,
        2 => Codec::Zstd { level: 0 },
        c => return Err(corrupt(&format!("unknown codec {c}"))),
    };
    if frame[5..8] != [0, 0, 0] {
        return Err(corrupt(
            "reserved header bytes are set (a newer format, or damage)",
        ));
    }
    let word = |at: usize, n: usize| {
        frame[at..at + n]
            .iter()
            .rev()
            .fold(0u64, |a, b| a << 8 | *b as u64)
    };
    Ok(FrameInfo {
        codec,
        raw_len: word(8, 8),
        crc32c: word(16, 4) as u32,
        frame_len: HEADER as u64 + word(20, 4),
    })
}

/// Decompresses a frame and verifies its crc32c. A frame that would decompress to more than
/// `max_len` bytes is refused before anything is allocated.
pub fn decompress(frame: &[u8], max_len: usize) -> Result<Vec<u8>> {
    let info = frame_info(frame)?;
    let len = usize::try_from(info.raw_len)
        .ok()
        .filter(|&l| l <= max_len)
        .ok_or_else(|| {
            AiError::InvalidArgument(format!(
                "a frame of {} bytes decompressed is more than the {max_len} allowed",
                info.raw_len
            ))
        })?;
    if frame.len() as u64 != info.frame_len {
        return Err(AiError::Corrupt(format!(
            "compressed frame: {} bytes where the header says {}",
            frame.len(),
            info.frame_len
        )));
    }
    let payload = &frame[HEADER..];
    let corrupt = |e: String| AiError::Corrupt(format!("compressed frame: {e}"));
    let data = match info.codec {
        Codec::Lz4 => {
            lz4_flex::block::decompress(payload, len).map_err(|e| corrupt(e.to_string()))?
        }
        Codec::Zstd { .. } => {
            zstd::bulk::decompress(payload, len).map_err(|e| corrupt(e.to_string()))?
        }
    };
    if data.len() != len {
        return Err(corrupt(format!(
            "{} bytes where the header says {len}",
            data.len()
        )));
    }
    let crc = crc32c::crc32c(&data);
    if crc != info.crc32c {
        return Err(corrupt(format!(
            "crc32c {crc:08x} where the header says {:08x}",
            info.crc32c
        )));
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const CODECS: [Codec; 3] = [
        Codec::Lz4,
        Codec::Zstd { level: 1 },
        Codec::Zstd { level: 9 },
    ];

    proptest! {
        #[test]
        fn frames_round_trip_byte_exact(data in proptest::collection::vec(any::<u8>(), 0..5000), runs in 0usize..3) {
            // Some runs of repeated bytes, so that there is something to compress.
            let mut data = data;
            for r in 0..runs {
                data.extend(std::iter::repeat_n(r as u8, 700));
            }
            for c in CODECS {
                let frame = c.compress(&data).unwrap();
                prop_assert_eq!(frame_info(&frame).unwrap().raw_len, data.len() as u64);
                prop_assert_eq!(decompress(&frame, data.len()).unwrap(), data.clone());
            }
        }

        #[test]
        fn damaged_frames_are_errors_never_wrong_data(
            data in proptest::collection::vec(any::<u8>(), 1..3000),
            at in any::<usize>(),
            flip in 1u8..=255,
        ) {
            for c in CODECS {
                let mut frame = c.compress(&data).unwrap();
                let i = at % frame.len();
                frame[i] ^= flip;
                match decompress(&frame, 1 << 20) {
                    Ok(back) => prop_assert_eq!(back, data.clone(), "a damaged frame decoded wrong"),
                    Err(e) => prop_assert!(matches!(e, AiError::Corrupt(_) | AiError::InvalidArgument(_)), "{}", e),
                }
            }
        }
    }

    /// Found by fuzzing: a frame with its reserved header bytes set decompressed as if they
    /// were not there; a later format's frame must not read as this one's.
    #[test]
    fn reserved_header_bytes_must_be_zero() {
        let mut frame = Codec::Lz4.compress(b"hello").unwrap();
        frame[6] = 1;
        assert!(matches!(decompress(&frame, 64), Err(AiError::Corrupt(_))));
        assert!(matches!(frame_info(&frame), Err(AiError::Corrupt(_))));
    }

    #[test]
    fn headers_cannot_ask_for_unbounded_memory() {
        let mut frame = Codec::Lz4.compress(b"hello").unwrap();
        frame[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = decompress(&frame, 1 << 30).unwrap_err();
        assert!(matches!(e, AiError::InvalidArgument(_)), "{e}");
        assert!(decompress(b"GAIZ", 10).is_err());
        // A frame cut short, or with bytes after it.
        let frame = Codec::Lz4.compress(b"hello hello").unwrap();
        assert!(decompress(&frame[..frame.len() - 1], 100).is_err());
        assert!(decompress(&[&frame[..], &[0]].concat(), 100).is_err());
        assert!(decompress(&[0; 40], 10).is_err());
        // Compressible data gets smaller.
        let zeros = vec![0u8; 1 << 16];
        for c in CODECS {
            assert!(c.compress(&zeros).unwrap().len() < 1024, "{c:?}");
        }
    }
}
