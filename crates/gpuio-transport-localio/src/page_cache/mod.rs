//! Warm reads straight from the page cache: the file's range is mapped and its pages
//! registered read-only with the device, whose copy engine reads them where they are, with no
//! CPU copy into staging.
//!
//! Registering and unregistering cost the driver about as much as the copy itself (4 GiB on
//! the H200: 130-160 ms to register populated pages, 100-140 ms to unregister, 80 ms to copy;
//! the three do not overlap), so a one-off read this way runs near 17 GB/s: what two staged
//! lanes give, well under eight. Two uses follow:
//! - **Hot files** ([`kept`]): a file read a second time, unchanged (or read more than once
//!   over in reads below the threshold), keeps its registration, and every later read, of any
//!   size, is one copy from pinned pages at the copy engine's rate, with no CPU work. This
//!   is the case of weights loaded again and again, and onto several GPUs.
//! - **Few lanes**: with at most two lanes configured, one-off reads of warm chunks go this
//!   way (threads register the next chunks while the calling thread copies one, and another
//!   unregisters those behind it; cold chunks go through the lanes meanwhile).
//!
//! A file rewritten or truncated meanwhile may leave registered pages holding its old bytes,
//! so the file's identity (size, modification and change times, inode) is read before and
//! after: if it changed, the read is done again through the lanes, which read the file as it
//! is then, and a kept registration of it is let go.

mod kept;

pub(crate) use kept::KeptFiles;
pub use kept::PageCacheStats;

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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Instant;

/// Bytes registered and copied as one. Registration costs the driver a fixed amount per call on
/// top of its per-page work, so small chunks are slow (16 MiB ran at a fraction of the rate of
/// 256 MiB); larger ones pin more of the page cache at once.
const CHUNK: usize = 256 << 20;

/// One-off reads from this many lanes up are staged: the lanes are faster (a staged lane moves
/// 6-8 GB/s, a one-off registered read about 17 GB/s; see the module's docs).
const LANES_THAT_BEAT_IT: usize = 3;

/// A chunk is read from the page cache when at least three quarters of it is resident; the
/// registration reads the rest in from the file.
fn is_warm(resident: usize, len: usize) -> bool {
    resident.saturating_mul(4) >= len.saturating_mul(3)
}

/// What identifies a file's contents for the length of a read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    ino: u64,
    dev: u64,
}

impl Identity {
    /// Whether both name the same file (whatever its contents).
    fn same_file(&self, other: &Identity) -> bool {
        (self.dev, self.ino) == (other.dev, other.ino)
    }
}

impl Identity {
    /// The identity of an open file, and its number of names (links).
    fn of(file: &std::fs::File) -> std::io::Result<(Identity, u64)> {
        let m = file.metadata()?;
        let id = Identity {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
            ino: m.ino(),
            dev: m.dev(),
        };
        Ok((id, m.nlink()))
    }
}

fn identity(file: &FileHandle) -> Result<Identity> {
    Identity::of(&*file.os_file()?)
        .map(|(id, _)| id)
        .map_err(|e| file.io("stat", 0, e))
}

/// `len` bytes from file offset `offset` cut into chunks of about `size` bytes whose
/// boundaries fall on page boundaries of the file (two chunks registered at once must not
/// share a page), as ranges of the wanted bytes.
fn chunks(offset: u64, len: usize, page: usize, size: usize) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(len.div_ceil(size));
    let mut start = 0;
    while start < len {
        let file_end = (offset + (start + size) as u64) / page as u64 * page as u64;
        let end = ((file_end - offset) as usize).clamp(start + 1, len);
        out.push(start..end);
        start = end;
    }
    out
}

impl LocalIo {
    /// Whether the policy sends reads of this file through the page cache, before looking at
    /// the pages.
    fn page_cache_applies(&self, file: &FileHandle, gpu: &Gpu) -> bool {
        self.config.page_cache == PageCachePolicy::Auto
            && file.nvme_device().is_none()
            && !self.config.checksum
            && !file.is_direct()
            && file.gds() != Some(true)
            && gpu.info().page_cache_dma.available
    }

    /// Reads `len` bytes of `file` at `offset` into `dst` from the page cache where the policy
    /// applies and the pages are warm; `None` where it does not (the caller uses the lanes).
    /// A read below the threshold registers nothing: it takes a hot file's kept registration
    /// (one copy from pinned pages beats staging at any size) and counts towards keeping one.
    pub(crate) fn read_from_page_cache(
        &self,
        file: &FileHandle,
        offset: u64,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<Option<Transfer>> {
        if !self.page_cache_applies(file, dst.gpu()) {
            return Ok(None);
        }
        let small = len < self.config.page_cache_threshold.max(1);
        let before = identity(file)?;
        // A range past the end, or not a regular file: the lanes report it properly.
        if offset.saturating_add(len as u64) > before.len || before.len == 0 {
            return Ok(None);
        }
        let read = if small {
            kept::Read::Small(len as u64)
        } else {
            kept::Read::Large(len as u64)
        };
        let kept = self.kept.get(&before, read);
        if kept.is_none()
            && let Some(patience) = self.kept.wants(&before, read)
        {
            // Kept for later reads; this one does not wait for it.
            self.kept.register_in_background(
                file.clone(),
                before.clone(),
                dst.gpu().clone(),
                patience,
            );
        }
        let transfer = if let Some(kept) = kept {
            let copied = dst
                .gpu()
                .stream()
                .map_err(LocalIoError::from)
                .and_then(|s| kept.copy(&s, offset, len, dst, dst_offset));
            if let Err(e) = copied {
                tracing::warn!(error = %e, "a kept page cache registration failed; using the lanes");
                self.kept.forget(&before);
                return Ok(None);
            }
            Transfer {
                bytes: len as u64,
                engine: IoEngine::PageCache,
                lanes: 0,
                crc32c: None,
                page_cache_bytes: len as u64,
            }
        } else if !small && self.config.lanes < LANES_THAT_BEAT_IT {
            match self.read_registering(file, &before, offset, dst, dst_offset, len)? {
                Some(t) => t,
                None => return Ok(None),
            }
        } else {
            return Ok(None);
        };
        if identity(file)? != before {
            tracing::warn!(path = %file.path().display(),
                "the file changed during a page cache read; reading it again through the lanes");
            self.kept.forget(&before);
            let pieces = pieces(offset, std::slice::from_ref(&(0..len)));
            return self
                .read_pieces(&[file], &pieces, dst, dst_offset, len)
                .map(Some);
        }
        Ok(Some(transfer))
    }

    /// A one-off read: warm chunks registered and copied, cold ones through the lanes at the
    /// same time. `None` where no chunk is warm.
    fn read_registering(
        &self,
        file: &FileHandle,
        before: &Identity,
        offset: u64,
        dst: &DeviceBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<Option<Transfer>> {
        debug_assert!(offset + len as u64 <= before.len);
        let mut warm = Vec::new();
        let mut cold = Vec::new();
        let Some(map) = map_warm(file, offset, len, |map| {
            for c in chunks(offset, len, map.page_size(), CHUNK) {
                if is_warm(map.resident(c.clone())?, c.len()) {
                    warm.push(c);
                } else {
                    cold.push(c);
                }
            }
            Ok(!warm.is_empty())
        }) else {
            return Ok(None);
        };
        let threads = self.config.page_cache_threads.clamp(1, 8).min(warm.len());
        let (copied, result) = std::thread::scope(|s| {
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
        result?;
        Ok(Some(Transfer {
            bytes: len as u64,
            engine: IoEngine::PageCache,
            lanes: threads,
            crc32c: None,
            page_cache_bytes: copied as u64,
        }))
    }

    /// The kept registrations' counters (`gpuio stat`).
    pub fn page_cache_stats(&self) -> PageCacheStats {
        self.kept.stats()
    }

    /// Waits until the registrations being made in the background for hot files are kept (or
    /// given up): reads after it use them.
    pub fn wait_for_page_cache(&self) {
        self.kept.wait();
    }

    /// Lets go of every registration kept for hot files, unpinning their pages (a read in
    /// flight finishes first with the one it holds). Pinned pages stay in the page cache
    /// whatever is asked of it, `posix_fadvise(DONTNEED)` included: let go of them before
    /// dropping a file's cached pages to read it cold.
    pub fn release_page_cache(&self) {
        self.kept.clear();
    }
}

/// Registers `len` bytes of `file` from `offset` with `gpu` for kernels to read in place (an
/// on-demand array's misses, say), where the device can register page cache pages and the
/// range is warm (three quarters resident: registering reads in the rest, and an on-demand
/// source is not meant to be read whole). The pin holds the pages until it drops; a file
/// rewritten meanwhile may leave it holding the old bytes.
pub(crate) fn pin_warm(
    file: &FileHandle,
    offset: u64,
    len: usize,
    gpu: &Gpu,
) -> Result<MappingPin> {
    let refuse = |reason: String| {
        LocalIoError::Hal(gpuio_hal::HalError::Unsupported {
            what: "reading a file in place from kernels",
            reason,
        })
    };
    if !gpu.info().page_cache_dma.available {
        return Err(refuse(gpu.info().page_cache_dma.detail.clone()));
    }
    let map = FileMapping::new(&*file.os_file()?, offset, len)?;
    let resident = map.resident(0..len)?;
    if !is_warm(resident, len) {
        return Err(refuse(format!(
            "{} has {resident} of these {len} bytes in the page cache (a quarter or more \
             would be read in whole to register them)",
            file.path().display()
        )));
    }
    Ok(gpu.pin_mapping(&Arc::new(map), 0..len)?)
}

/// Maps `len` bytes of `file` from `offset` when `warm` says the mapping is worth reading from;
/// `None` where it is not, or where the kernel refuses the mapping or its residency (logged:
/// the read then goes through the lanes, which report any real fault of the file).
fn map_warm(
    file: &FileHandle,
    offset: u64,
    len: usize,
    warm: impl FnOnce(&FileMapping) -> gpuio_hal::Result<bool>,
) -> Option<Arc<FileMapping>> {
    let file_ref = file.os_file().ok()?;
    let mapped =
        FileMapping::new(&file_ref, offset, len).and_then(|map| Ok(warm(&map)?.then_some(map)));
    match mapped {
        Ok(map) => map.map(Arc::new),
        Err(e) => {
            tracing::debug!(path = %file.path().display(), error = %e,
                "no page cache read: the file could not be mapped");
            None
        }
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
    let timing = Timing::default();
    let timing = &timing;
    let started = Instant::now();
    let result = std::thread::scope(|s| {
        // Bounded, so pinned chunks waiting to be unregistered cannot pile up.
        let (unpin, unpinned) = mpsc::sync_channel::<MappingPin>(1);
        s.spawn(move || {
            for pin in unpinned {
                timing.time(&timing.unpin, || drop(pin));
            }
        });
        let pins: Vec<mpsc::Receiver<gpuio_hal::Result<MappingPin>>> = (0..threads)
            .map(|k| {
                let (tx, rx) = mpsc::sync_channel(1);
                let gpu = dst.gpu().clone();
                s.spawn(move || {
                    for range in warm.iter().skip(k).step_by(threads) {
                        // Populated pages register faster (4 GiB on the H200: 130-160 ms
                        // against 210-225), and populating runs outside the driver's lock.
                        let _ = timing.time(&timing.populate, || map.populate(range.clone()));
                        let pin = timing.time(&timing.pin, || gpu.pin_mapping(map, range.clone()));
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
            let pin = timing
                .time(&timing.wait, || pins[i % threads].recv())
                .map_err(|_| LocalIoError::Internal("a registering thread stopped".into()))??;
            timing.time(&timing.copy, || {
                pin.copy_to_device(range.clone(), &stream, dst, dst_offset + range.start)
            })?;
            done += 1;
            // Unregistering takes about half as long as the copy: not on this thread.
            let _ = unpin.send(pin);
        }
        Ok(())
    });
    let ms = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e6;
    tracing::debug!(
        chunks = done,
        threads,
        total_ms = started.elapsed().as_secs_f64() * 1e3,
        populate_ms = ms(&timing.populate),
        pin_ms = ms(&timing.pin),
        copy_ms = ms(&timing.copy),
        copier_waited_ms = ms(&timing.wait),
        unpin_ms = ms(&timing.unpin),
        "page cache read (thread times summed)"
    );
    (done, result)
}

/// Where a page cache read's time went (nanoseconds, summed over threads), for `-vv` logs.
#[derive(Default)]
struct Timing {
    populate: AtomicU64,
    pin: AtomicU64,
    wait: AtomicU64,
    copy: AtomicU64,
    unpin: AtomicU64,
}

impl Timing {
    fn time<T>(&self, into: &AtomicU64, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        into.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }
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
            let cs = chunks(offset, len, 4096, CHUNK);
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
