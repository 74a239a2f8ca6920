//! The KV pool's cold tier: entries evicted from host memory, each compressed into a frame
//! (LZ4 or ZSTD, with its length and crc32c) appended to a file. A frame is read back, checked
//! and decompressed when its entry is next selected, and the entry goes back to host memory.
//! The file is a log: a frame whose entry is written again or promoted is left behind, not
//! reused.

use crate::compress::{Codec, decompress};
use crate::{AiError, Result};
use gpuio_api::FileHandle;

/// Compressed entries in a file.
#[derive(Debug)]
pub struct ColdTier {
    file: FileHandle,
    codec: Codec,
    /// Where the next frame goes.
    end: u64,
    /// Each frame's offset and length.
    frames: Vec<(u64, u32)>,
    /// Bytes of the entries put here (before compression).
    raw: u64,
}

impl ColdTier {
    /// A cold tier in `file` (opened for writing; its old contents are dropped) compressing
    /// with `codec`.
    pub fn new(file: FileHandle, codec: Codec) -> Result<Self> {
        if !file.is_writable() {
            return Err(AiError::InvalidArgument(format!(
                "a cold tier needs a writable file, and {} is read-only",
                file.path().display()
            )));
        }
        file.set_len(0).map_err(gpuio_api::Error::from)?;
        Ok(Self {
            file,
            codec,
            end: 0,
            frames: Vec::new(),
            raw: 0,
        })
    }

    /// Compresses `entry` into a new frame; its index.
    pub(crate) fn put(&mut self, entry: &[u8]) -> Result<u64> {
        let frame = self.codec.compress(entry)?;
        self.file
            .write_all_at(self.end, &frame)
            .map_err(gpuio_api::Error::from)?;
        self.frames.push((self.end, frame.len() as u32));
        self.end += frame.len() as u64;
        self.raw += entry.len() as u64;
        Ok(self.frames.len() as u64 - 1)
    }

    /// Frame `index`, checked and decompressed into `out` (exactly its length).
    pub(crate) fn get(&self, index: u64, out: &mut [u8]) -> Result<()> {
        let &(offset, len) = self
            .frames
            .get(index as usize)
            .ok_or_else(|| AiError::Corrupt(format!("cold tier: no frame {index}")))?;
        let mut frame = vec![0u8; len as usize];
        self.file
            .read_exact_at(offset, &mut frame)
            .map_err(gpuio_api::Error::from)?;
        let entry = decompress(&frame, out.len())?;
        if entry.len() != out.len() {
            return Err(AiError::Corrupt(format!(
                "cold tier: frame {index} holds {} bytes, not an entry's {}",
                entry.len(),
                out.len()
            )));
        }
        out.copy_from_slice(&entry);
        Ok(())
    }

    /// Bytes in the file (frames, including ones left behind).
    pub fn file_bytes(&self) -> u64 {
        self.end
    }

    /// Bytes of the entries put here, before compression.
    pub fn raw_bytes(&self) -> u64 {
        self.raw
    }
}
