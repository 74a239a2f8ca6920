//! Warm reads straight from the page cache: the file's range is mapped, the resident chunks
//! registered read-only with the device and read by its copy engine, with no CPU copy into
//! staging. Threads register the next chunks while the calling thread copies one, and another
//! unregisters the chunks behind it; cold chunks go through the lanes at the same time.
//!
//! A file rewritten or truncated meanwhile may leave registered pages holding its old bytes,
//! so the file's identity (size, modification and change times, inode) is read before and
//! after: if it changed, the read is done again through the lanes, which read the file as it
//! is then.

use crate::config::PageCachePolicy;
use crate::file::FileHandle;
use crate::plan::Piece;
use crate::queue::IoEngine;
use crate::{LocalIo, LocalIoError, Result, Transfer};
use gpuio_hal::memory::mapped::{FileMapping, MappingPin};
use gpuio_hal::{DeviceBuffer, Gpu};
use std::ops::Range;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::mpsc;

/// Bytes registered and copied as one. Registration costs the driver a fixed amount per call on
/// top of its per-page work, so small chunks are slow (16 MiB ran at a fraction of the rate of
/// 256 MiB); larger ones pin more of the page cache at once.
const CHUNK: usize = 256 << 20;

/// A chunk is read from the page cache when at least three quarters of it is resident; the
/// registration reads the rest in from the file.
fn is_warm(resident: usize, len: usize) -> bool {
    resident.saturating_mul(4) >= len.saturating_mul(3)
}

/// What identifies a file's contents for the length of a read.
#[derive(Debug, PartialEq, Eq)]
struct Identity {
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    ino: u64,
    dev: u64,
}

fn identity(file: &FileHandle) -> Result<Identity> {
    let m = file
        .shared()
        .metadata()
        .map_err(|e| file.io("stat", 0, e))?;
    Ok(Identity {
        len: m.len(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
        ino: m.ino(),
        dev: m.dev(),
    })
}

/// `len` bytes from file offset `offset` cut into chunks whose boundaries fall on page
/// boundaries of the file (two chunks registered at once must not share a page), as ranges of
/// the wanted bytes.
fn chunks(offset: u64, len: usize, page: usize) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(len.div_ceil(CHUNK));
    let mut start = 0;
    while start < len {
        let file_end = (offset + (start + CHUNK) as u64) / page as u64 * page as u64;
        let end = ((file_end - offset) as usize).clamp(start + 1, len);
        out.push(start..end);
        start = end;
    }
    out
}

impl LocalIo {
    /// Whether the policy sends this read through the page cache, before looking at the pages.
    fn page_cache_applies(&self, file: &FileHandle, gpu: &Gpu, len: usize) -> bool {
        self.config.page_cache == PageCachePolicy::Auto
            && len >= self.config.page_cache_threshold.max(1)
            && !self.config.checksum
            && !file.is_direct()
            && file.gds() != Some(true)
            && gpu.info().page_cache_dma.available
    }

    /// Reads `len` bytes of `file` at `offset` into `dst` from the page cache where the policy
    /// applies and the pages are warm; `None` where it does not (the caller uses the lanes).
    pub(crate) fn read_from_page_cache(
        &self,
        file: &FileHandle,
        offset: u64,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<Option<Transfer>> {
        if !self.page_cache_applies(file, dst.gpu(), len) {
            return Ok(None);
        }
        let before = identity(file)?;
        // A range past the end, or not a regular file: the lanes report it properly.
        if offset.saturating_add(len as u64) > before.len || before.len == 0 {
            return Ok(None);
        }
        let map = Arc::new(FileMapping::new(&file.shared(), offset, len)?);
        let mut warm = Vec::new();
        let mut cold = Vec::new();
        for c in chunks(offset, len, map.page_size()) {
            if is_warm(map.resident(c.clone())?, c.len()) {
                warm.push(c);
            } else {
                cold.push(c);
            }
        }
        if warm.is_empty() {
            return Ok(None);
        }
        let threads = self.config.page_cache_threads.clamp(1, 8).min(warm.len());
        let (copied, registered) = std::thread::scope(|s| {
            let cold_read = (!cold.is_empty()).then(|| {
                let pieces = pieces(offset, &cold);
                s.spawn(move || self.read_pieces(&[file], &pieces, dst, dst_offset, len))
            });
            let (done, registered) = copy_registered(&map, &warm, threads, dst, dst_offset);
            // Chunks the registered path did not finish go through the lanes.
            let rest = match &registered {
                Ok(()) => Ok(()),
                Err(e) => {
                    tracing::warn!(error = %e, "page cache read fell back to the lanes");
                    let pieces = pieces(offset, &warm[done..]);
                    self.read_pieces(&[file], &pieces, dst, dst_offset, len)
                        .map(drop)
                }
            };
            let cold = match cold_read.map(|h| h.join()) {
                None => Ok(()),
                Some(Ok(r)) => r.map(drop),
                Some(Err(_)) => Err(LocalIoError::Internal(
                    "a cold-chunk reader panicked".into(),
                )),
            };
            let copied: usize = warm[..done].iter().map(Range::len).sum();
            (copied, rest.and(cold))
        });
        registered?;
        if identity(file)? != before {
            tracing::warn!(path = %file.path().display(),
                "the file changed during a page cache read; reading it again through the lanes");
            let pieces = pieces(offset, std::slice::from_ref(&(0..len)));
            return self
                .read_pieces(&[file], &pieces, dst, dst_offset, len)
                .map(Some);
        }
        Ok(Some(Transfer {
            bytes: len as u64,
            engine: IoEngine::PageCache,
            lanes: threads,
            crc32c: None,
            page_cache_bytes: copied as u64,
        }))
    }
}

/// The pieces (of file 0) that read `ranges` of the wanted bytes from file offset `offset`.
fn pieces(offset: u64, ranges: &[Range<usize>]) -> Vec<Piece> {
    ranges
        .iter()
        .map(|r| Piece {
            file: 0,
            offset: offset + r.start as u64,
            len: r.len() as u64,
            dev_off: r.start as u64,
        })
        .collect()
}

/// Copies the `warm` chunks of `map` into `dst` in order on the calling thread while `threads`
/// threads register the next ones (chunk `i` by thread `i % threads`, at most one waiting
/// each) and another unregisters those copied. Returns how many chunks were copied, and the
/// first failure.
fn copy_registered(
    map: &Arc<FileMapping>,
    warm: &[Range<usize>],
    threads: usize,
    dst: &DeviceBuffer,
    dst_offset: usize,
) -> (usize, Result<()>) {
    let stream = match dst.gpu().stream() {
        Ok(s) => s,
        Err(e) => return (0, Err(e.into())),
    };
    let mut done = 0;
    let result = std::thread::scope(|s| {
        // Bounded, so pinned chunks waiting to be unregistered cannot pile up.
        let (unpin, unpinned) = mpsc::sync_channel::<MappingPin>(1);
        s.spawn(move || unpinned.into_iter().for_each(drop));
        let pins: Vec<mpsc::Receiver<gpuio_hal::Result<MappingPin>>> = (0..threads)
            .map(|k| {
                let (tx, rx) = mpsc::sync_channel(1);
                let gpu = dst.gpu().clone();
                s.spawn(move || {
                    for range in warm.iter().skip(k).step_by(threads) {
                        let pin = gpu.pin_mapping(map, range.clone());
                        let failed = pin.is_err();
                        // The copier stopped (its receiver is gone), or this one failed.
                        if tx.send(pin).is_err() || failed {
                            return;
                        }
                    }
                });
                rx
            })
            .collect();
        for (i, range) in warm.iter().enumerate() {
            let pin = pins[i % threads]
                .recv()
                .map_err(|_| LocalIoError::Internal("a registering thread stopped".into()))??;
            pin.copy_to_device(&stream, dst, dst_offset + range.start)?;
            done += 1;
            // Unregistering takes about half as long as the copy: not on this thread.
            let _ = unpin.send(pin);
        }
        Ok(())
    });
    (done, result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_range_and_meet_on_page_boundaries() {
        for (offset, len) in [
            (0u64, 1usize),
            (0, CHUNK),
            (1, CHUNK),
            (4095, 3 * CHUNK + 17),
            (12345, 2 * CHUNK),
            (4096, 5),
        ] {
            let cs = chunks(offset, len, 4096);
            assert_eq!(cs.first().unwrap().start, 0);
            assert_eq!(cs.last().unwrap().end, len);
            for w in cs.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert_eq!(
                    (offset + w[0].end as u64) % 4096,
                    0,
                    "{offset} {len} {cs:?}"
                );
            }
            assert!(cs.iter().all(|c| !c.is_empty() && c.len() <= CHUNK));
        }
    }

    #[test]
    fn three_quarters_resident_is_warm() {
        assert!(is_warm(3, 4));
        assert!(!is_warm(2, 4));
        assert!(is_warm(0, 0));
    }
}
