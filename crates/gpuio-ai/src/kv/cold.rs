//! The KV pool's cold tier: entries evicted from host memory, each compressed into a frame
//! (LZ4 or ZSTD, with its length and crc32c) appended to a file, or to another node's export
//! (RemoteIO: compressed on the wire and at rest). A frame is read back, checked and
//! decompressed when its entry is next selected, and the entry goes back to host memory. The
//! store is a log: a frame whose entry is written again or promoted is left behind, not reused.

use crate::compress::{Codec, decompress};
use crate::{AiError, Result};
use gpuio_api::{Dest, Endpoint, FileHandle, Session, Source};
use std::sync::Arc;

/// Where the frames are kept.
#[derive(Debug)]
enum Store {
    File(FileHandle),
    /// An endpoint (another node's export) of `capacity` bytes, reached through the session.
    Remote {
        session: Arc<Session>,
        at: Endpoint,
        capacity: u64,
    },
}

/// Compressed entries in a file or another node's export.
#[derive(Debug)]
pub struct ColdTier {
    store: Store,
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
            store: Store::File(file),
            codec,
            end: 0,
            frames: Vec::new(),
            raw: 0,
        })
    }

    /// A cold tier in `capacity` bytes of another node's export at `at` (a `remoteio://`
    /// endpoint opened for update), written and read through `session`, compressing with
    /// `codec`. What the export held there is overwritten frame by frame; a frame that would
    /// pass `capacity` is refused ([`AiError::TierFull`]).
    pub fn remote(
        session: &Arc<Session>,
        at: Endpoint,
        capacity: u64,
        codec: Codec,
    ) -> Result<Self> {
        if !matches!(at, Endpoint::Remote { .. }) {
            return Err(AiError::InvalidArgument(format!(
                "a remote cold tier needs another node's export, not {at}"
            )));
        }
        Ok(Self {
            store: Store::Remote {
                session: Arc::clone(session),
                at,
                capacity,
            },
            codec,
            end: 0,
            frames: Vec::new(),
            raw: 0,
        })
    }

    /// Compresses `entry` into a new frame; its index.
    pub(crate) fn put(&mut self, entry: &[u8]) -> Result<u64> {
        let frame = self.codec.compress(entry)?;
        match &self.store {
            Store::File(file) => file
                .write_all_at(self.end, &frame)
                .map_err(gpuio_api::Error::from)?,
            Store::Remote {
                session,
                at,
                capacity,
            } => {
                if self.end + frame.len() as u64 > *capacity {
                    return Err(AiError::TierFull(format!(
                        "the remote cold tier's {capacity} bytes hold {} of frames; a {}-byte \
                         frame does not fit",
                        self.end,
                        frame.len()
                    )));
                }
                let to = at.advanced(self.end as usize);
                session.transfer(Source::Host(&frame), to.dest(), frame.len())?;
            }
        }
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
        match &self.store {
            Store::File(file) => file
                .read_exact_at(offset, &mut frame)
                .map_err(gpuio_api::Error::from)?,
            Store::Remote { session, at, .. } => {
                let from = at.advanced(offset as usize);
                session.transfer(from.source(), Dest::Host(&mut frame), len as usize)?;
            }
        }
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

    /// Bytes in the file or export (frames, including ones left behind).
    pub fn file_bytes(&self) -> u64 {
        self.end
    }

    /// Bytes of the entries put here, before compression.
    pub fn raw_bytes(&self) -> u64 {
        self.raw
    }
}
