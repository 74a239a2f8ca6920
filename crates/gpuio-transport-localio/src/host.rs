//! Files ↔ host memory. Here the CPU moves the bytes, between the page cache (or the disk,
//! for O_DIRECT files) and the caller's memory, and one thread copies about 8 GB/s: a large
//! transfer is cut into pieces at file offsets that are multiples of the piece size, and the
//! engine's IO threads take them, each reading or writing straight into or out of the caller's
//! memory. No staging and no pinning: pageable memory (a NumPy array, a `Vec`) is as good a
//! destination as a pinned buffer. Small transfers stay on the calling thread.
//!
//! O_DIRECT files are read and written in place where the memory is aligned, through a small
//! bounce buffer where not; pieces are whole blocks except at the transfer's edges, so no two
//! share a block, and a write that grew the file trims its padding once, after all pieces.

use crate::file::FileHandle;
use crate::queue::IoEngine;
use crate::{Durability, LocalIo, LocalIoError, Result, Transfer, file_range};
use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The smallest piece handed to another thread: below it the handoff costs more than the
/// copy saves (256 KiB copy in ~30 µs).
const MIN_PIECE: usize = 256 << 10;

impl LocalIo {
    /// Reads `dst.len()` bytes of `file` at `offset` into `dst`, on up to
    /// [`host_threads`](crate::LocalIoConfig::host_threads) threads at once. A file shorter than the range
    /// is [`LocalIoError::UnexpectedEof`], never a short success.
    pub fn read_to_host(&self, file: &FileHandle, offset: u64, dst: &mut [u8]) -> Result<Transfer> {
        let len = dst.len();
        file_range(offset, len as u64)?;
        let pieces = cut_mut(dst, offset, &self.piece_lens(file, offset, len));
        let threads = pieces.len().min(self.config.host_threads);
        let checksum = self.config.checksum;
        let read = |(at, buf): (u64, &mut [u8])| -> Result<(usize, Option<u32>)> {
            file.read_exact_at(at, buf)?;
            Ok((buf.len(), checksum.then(|| crc32c::crc32c(buf))))
        };
        let crcs = self
            .each_piece(pieces, threads, read)
            .map_err(|e| match e {
                // One piece ran out: say how far the file goes from the request's start.
                LocalIoError::UnexpectedEof { .. } => {
                    let got = file.len().map_or(0, |l| l.saturating_sub(offset) as usize);
                    file.eof(offset, len, got.min(len))
                }
                other => other,
            })?;
        Ok(host_transfer(len, threads, &crcs))
    }

    /// Writes all of `src` to `file` at `offset`, on up to
    /// [`host_threads`](crate::LocalIoConfig::host_threads) threads at once, durable as asked. A full disk
    /// is [`LocalIoError::NoSpace`] counting the bytes that did reach the file.
    pub fn write_from_host(
        &self,
        src: &[u8],
        file: &FileHandle,
        offset: u64,
        durability: Durability,
    ) -> Result<Transfer> {
        let len = src.len();
        file_range(offset, len as u64)?;
        if !file.is_writable() {
            return Err(LocalIoError::ReadOnly(file.path().to_path_buf()));
        }
        let old_len = if file.is_direct() { file.len()? } else { 0 };
        let pieces = cut(src, offset, &self.piece_lens(file, offset, len));
        let threads = pieces.len().min(self.config.host_threads);
        let (checksum, writeback) = (self.config.checksum, durability == Durability::DataSync);
        let written = AtomicUsize::new(0);
        let write = |(at, buf): (u64, &[u8])| -> Result<(usize, Option<u32>)> {
            let crc = checksum.then(|| crc32c::crc32c(buf));
            match file.write_padded_at(at, buf, old_len) {
                Err(LocalIoError::NoSpace { written: w, .. }) => {
                    written.fetch_add(w, Ordering::Relaxed);
                    return Err(file.no_space(offset, len, 0));
                }
                other => other?,
            }
            written.fetch_add(buf.len(), Ordering::Relaxed);
            // The flush at the end then finds most of the transfer on its way to the disk.
            if writeback {
                file.start_writeback(at, buf.len() as u64)?;
            }
            Ok((buf.len(), crc))
        };
        let crcs = self
            .each_piece(pieces, threads, write)
            .map_err(|e| match e {
                LocalIoError::NoSpace { .. } => {
                    file.no_space(offset, len, written.load(Ordering::Relaxed))
                }
                other => other,
            })?;
        file.trim_padding(old_len, offset + len as u64)?;
        if writeback {
            file.sync_data()?;
        }
        Ok(host_transfer(len, threads, &crcs))
    }

    /// `f` of every piece, in order: on the calling thread for one, else on the IO threads
    /// (the first failure stops the rest).
    fn each_piece<P: Send, T: Send>(
        &self,
        pieces: Vec<P>,
        threads: usize,
        f: impl Fn(P) -> Result<T> + Sync + Send,
    ) -> Result<Vec<T>> {
        if threads <= 1 {
            pieces.into_iter().map(f).collect()
        } else {
            self.pool
                .install(|| pieces.into_par_iter().map(f).collect())
        }
    }

    /// The lengths of the pieces `len` bytes from file offset `offset` are cut into: enough
    /// for every IO thread, none under [`MIN_PIECE`] or over a chunk, cut at multiples of the
    /// piece size (whole blocks of a direct file).
    fn piece_lens(&self, file: &FileHandle, offset: u64, len: usize) -> Vec<usize> {
        // gpuio's NVMe driver takes one request at a time from a handle.
        if file.nvme_device().is_some() || len < 2 * MIN_PIECE {
            return vec![len];
        }
        let piece = (len / self.config.host_threads)
            .clamp(MIN_PIECE, self.config.chunk_size.max(MIN_PIECE))
            .next_multiple_of(MIN_PIECE.max(file.required_alignment()));
        let mut out = Vec::with_capacity(len.div_ceil(piece) + 1);
        let mut at = offset;
        let end = offset + len as u64;
        while at < end {
            let next = (at / piece as u64 + 1) * piece as u64;
            out.push((next.min(end) - at) as usize);
            at = next.min(end);
        }
        out
    }
}

/// `buf` cut into consecutive pieces of `lens`, each with its file offset from `offset`.
fn cut_mut<'a>(mut buf: &'a mut [u8], offset: u64, lens: &[usize]) -> Vec<(u64, &'a mut [u8])> {
    let mut at = offset;
    lens.iter()
        .map(|&n| {
            let (piece, rest) = std::mem::take(&mut buf).split_at_mut(n);
            buf = rest;
            at += n as u64;
            (at - n as u64, piece)
        })
        .collect()
}

/// [`cut_mut`] for bytes to write.
fn cut<'a>(mut buf: &'a [u8], offset: u64, lens: &[usize]) -> Vec<(u64, &'a [u8])> {
    let mut at = offset;
    lens.iter()
        .map(|&n| {
            let (piece, rest) = buf.split_at(n);
            buf = rest;
            at += n as u64;
            (at - n as u64, piece)
        })
        .collect()
}

/// What a host transfer of `len` bytes on `threads` threads did; the pieces' checksums
/// combined where kept.
fn host_transfer(len: usize, threads: usize, pieces: &[(usize, Option<u32>)]) -> Transfer {
    let crc32c = pieces.iter().try_fold(0, |crc, &(n, piece)| {
        piece.map(|p| crc32c::crc32c_combine(crc, p, n))
    });
    Transfer {
        bytes: len as u64,
        engine: IoEngine::HostCopy,
        lanes: threads.max(1),
        crc32c,
        page_cache_bytes: 0,
    }
}
