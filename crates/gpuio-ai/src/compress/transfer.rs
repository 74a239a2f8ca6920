//! Compressed transfers: bytes from host or GPU memory written to a file or another node's
//! export as a run of frames ([`transfer_compressed`]: compressed on the wire and at rest), and
//! read back into memory ([`read_compressed`]: each frame's length, checksum and size checked
//! on arrival). Frames hold up to 4 MiB of raw bytes each, so a reader never holds more than
//! one chunk and one frame at a time.
//!
//! Compression runs on the host: GPU memory is staged through host memory first (the GPU codec
//! kernels are not built).

use super::{Codec, FRAME_HEADER, decompress, frame_info};
use crate::{AiError, Result};
use gpuio_api::{Dest, Endpoint, Session};

/// Raw bytes per frame.
pub const CHUNK: usize = 4 << 20;

/// What a compressed transfer moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CompressedReport {
    /// Bytes before compression.
    pub raw_bytes: u64,
    /// Bytes written or read at the compressed end (frames, headers included).
    pub stored_bytes: u64,
    /// Frames.
    pub frames: usize,
}

impl CompressedReport {
    /// Raw bytes per stored byte.
    pub fn ratio(&self) -> f64 {
        self.raw_bytes as f64 / self.stored_bytes.max(1) as f64
    }
}

/// Compresses `len` bytes at `src` (host or GPU memory) with `codec` and writes the frames one
/// after another at `dst` (a file or another node's export).
pub fn transfer_compressed(
    session: &Session,
    src: &Endpoint,
    dst: &Endpoint,
    len: usize,
    codec: Codec,
) -> Result<CompressedReport> {
    let mut raw = vec![0u8; CHUNK.min(len)];
    let mut report = CompressedReport::default();
    while (report.raw_bytes as usize) < len {
        let done = report.raw_bytes as usize;
        let n = CHUNK.min(len - done);
        let from = src.advanced(done);
        session.transfer(from.source(), Dest::Host(&mut raw[..n]), n)?;
        let frame = codec.compress(&raw[..n])?;
        let to = dst.advanced(report.stored_bytes as usize);
        session.transfer(gpuio_api::Source::Host(&frame), to.dest(), frame.len())?;
        report.raw_bytes += n as u64;
        report.stored_bytes += frame.len() as u64;
        report.frames += 1;
    }
    Ok(report)
}

/// Reads frames written by [`transfer_compressed`] at `src` (a file or export) until `len` raw
/// bytes have come back, into `dst` (host or GPU memory). A frame that is damaged, larger than
/// its chunk can be, or longer than what is left is [`AiError::Corrupt`]; what was written to
/// `dst` before it stays.
pub fn read_compressed(
    session: &Session,
    src: &Endpoint,
    dst: &Endpoint,
    len: usize,
) -> Result<CompressedReport> {
    let mut report = CompressedReport::default();
    let mut header = [0u8; FRAME_HEADER];
    let mut frame = Vec::new();
    while (report.raw_bytes as usize) < len {
        let left = len - report.raw_bytes as usize;
        let at = src.advanced(report.stored_bytes as usize);
        session.transfer(at.source(), Dest::Host(&mut header), FRAME_HEADER)?;
        let info = frame_info(&header)?;
        let expected = CHUNK.min(left) as u64;
        // A chunk's frame is at most its raw size plus the codecs' worst-case growth.
        let most = FRAME_HEADER as u64 + expected + expected / 128 + 1024;
        if info.raw_len != expected || info.frame_len > most {
            return Err(AiError::Corrupt(format!(
                "compressed frame {}: {} raw bytes in a {}-byte frame where a chunk of {expected} \
                 was due",
                report.frames, info.raw_len, info.frame_len
            )));
        }
        frame.resize(info.frame_len as usize, 0);
        let n = frame.len();
        session.transfer(at.source(), Dest::Host(&mut frame), n)?;
        let raw = decompress(&frame, expected as usize)?;
        let to = dst.advanced(report.raw_bytes as usize);
        session.transfer(gpuio_api::Source::Host(&raw), to.dest(), raw.len())?;
        report.raw_bytes += raw.len() as u64;
        report.stored_bytes += frame.len() as u64;
        report.frames += 1;
    }
    Ok(report)
}
