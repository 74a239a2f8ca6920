//! How a transfer between file ranges and a device range is cut into chunks: one staging slot
//! of IO each, over one file or a stripe set of several; each chunk says which file, which
//! (aligned) IO covers it, and where its bytes go.
//!
//! Workers (lanes, cuFile threads) each take a contiguous run of the chunks, front to back,
//! and an idle one takes the back half of the longest run left. A buffered read of pages the
//! page cache lacks gets the kernel's readahead only while each reader's offsets ascend: on
//! the H200 machine a cold 4 GiB read went from 1.21–1.29 GB/s with chunks taken in turn to
//! 1.59–1.70, and the cached pages it left read back at 46 GB/s instead of 21 (docs/PERF.md,
//! "Cold reads").
//!
//! O_DIRECT: a chunk's IO covers its aligned superset; only the wanted bytes move. Chunk
//! boundaries inside a file range are aligned, so only a range's first and last chunk can
//! have partial blocks.

use crate::file::FileHandle;
use gpuio_hal::sync::MutexExt;
use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

/// A contiguous range of one file and where it sits in the transfer's device range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Index of the file in the transfer's file list.
    pub(crate) file: usize,
    /// File offset.
    pub(crate) offset: u64,
    /// Bytes.
    pub(crate) len: u64,
    /// Offset in the transfer's device range.
    pub(crate) dev_off: u64,
}

/// Pieces `(file, offset, len)` laid end to end in device order.
pub(crate) fn end_to_end(pieces: impl IntoIterator<Item = (usize, u64, u64)>) -> Vec<Piece> {
    let mut dev_off = 0;
    pieces
        .into_iter()
        .map(|(file, offset, len)| {
            let p = Piece {
                file,
                offset,
                len,
                dev_off,
            };
            dev_off += len;
            p
        })
        .collect()
}

/// Splits pieces into their `block`-aligned bodies and the partial blocks at their edges.
pub(crate) fn split_at_blocks(pieces: &[Piece], block: u64) -> (Vec<Piece>, Vec<Piece>) {
    let (mut bodies, mut edges) = (Vec::new(), Vec::new());
    let part = |v: &mut Vec<Piece>, p: &Piece, from: u64, to: u64| {
        if to > from {
            v.push(Piece {
                offset: from,
                len: to - from,
                dev_off: p.dev_off + (from - p.offset),
                ..*p
            });
        }
    };
    for p in pieces {
        let end = p.offset + p.len;
        let body_start = p.offset.next_multiple_of(block).min(end);
        let body_end = (end / block * block).max(body_start);
        part(&mut edges, p, p.offset, body_start);
        part(&mut bodies, p, body_start, body_end);
        part(&mut edges, p, body_end, end);
    }
    (bodies, edges)
}

/// One chunk: the IO a slot does and the bytes of it the transfer wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// Index of the file in the transfer's file list.
    pub(crate) file: usize,
    /// Aligned start of the IO.
    pub(crate) io_start: u64,
    /// Aligned length of the IO.
    pub(crate) io_len: usize,
    /// Where the wanted bytes start inside the IO.
    pub(crate) head: usize,
    /// Wanted bytes.
    pub(crate) len: usize,
    /// Where the wanted bytes sit in the transfer's device range.
    pub(crate) dev_off: usize,
}

impl Chunk {
    /// File offset of the wanted bytes.
    pub(crate) fn start(&self) -> u64 {
        self.io_start + self.head as u64
    }

    /// Whether the IO carries bytes the transfer does not want (partial edge blocks).
    pub(crate) fn is_partial(&self) -> bool {
        self.head != 0 || self.head + self.len != self.io_len
    }
}

/// The chunks of one transfer, in device (logical) order, the runs its workers claim them
/// from and, when asked for, one crc32c slot per chunk.
#[derive(Debug)]
pub(crate) struct Plan {
    chunks: Vec<Chunk>,
    /// Each worker's unclaimed chunks. Claims are a few per millisecond of IO, so one lock
    /// costs nothing measurable and keeps stealing simple.
    runs: Mutex<Vec<Range<usize>>>,
    /// Workers that have started claiming: the next one owns run `joined % runs`.
    joined: AtomicUsize,
    /// One per chunk when checksums are kept, else none.
    crcs: Option<Vec<AtomicU32>>,
}

impl Plan {
    /// A plan over `pieces`, in device order; `chunk` bytes of IO at most per chunk, aligned
    /// as each file needs; dealt as contiguous runs to up to `workers` workers.
    pub(crate) fn new(
        files: &[&FileHandle],
        pieces: &[Piece],
        chunk: u64,
        checksum: bool,
        workers: usize,
    ) -> Self {
        let mut chunks = Vec::new();
        for p in pieces {
            let align = files[p.file].required_alignment() as u64;
            push_range(
                &mut chunks,
                p.file,
                p.offset,
                p.len,
                p.dev_off,
                align,
                chunk,
            );
        }
        let crcs = checksum.then(|| chunks.iter().map(|_| AtomicU32::new(0)).collect());
        let n = workers.clamp(1, chunks.len().max(1));
        let runs = (0..n)
            .map(|w| w * chunks.len() / n..(w + 1) * chunks.len() / n)
            .collect();
        Self {
            chunks,
            runs: Mutex::new(runs),
            joined: AtomicUsize::new(0),
            crcs,
        }
    }

    pub(crate) fn count(&self) -> usize {
        self.chunks.len()
    }

    pub(crate) fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }

    /// A new worker's claims: it owns the next run.
    pub(crate) fn worker(&self) -> Claims<'_> {
        let runs = self.runs.lock_unpoisoned().len();
        Claims {
            plan: self,
            run: self.joined.fetch_add(1, Ordering::Relaxed) % runs,
        }
    }

    pub(crate) fn chunk(&self, k: usize) -> Option<Chunk> {
        self.chunks.get(k).copied()
    }

    /// Records chunk `k`'s bytes for the transfer's checksum (a no-op when none is kept).
    pub(crate) fn checksum(&self, k: usize, bytes: &[u8]) {
        if let Some(slot) = self.crcs.as_ref().and_then(|c| c.get(k)) {
            slot.store(crc32c::crc32c(bytes), Ordering::Relaxed);
        }
    }

    /// The crc32c of all the transfer's bytes in device order, when checksums were kept.
    pub(crate) fn crc32c(&self) -> Option<u32> {
        let crcs = self.crcs.as_ref()?;
        Some(self.chunks.iter().zip(crcs).fold(0, |crc, (c, k)| {
            crc32c::crc32c_combine(crc, k.load(Ordering::Relaxed), c.len)
        }))
    }
}

/// One worker's claims on a [`Plan`].
pub(crate) struct Claims<'a> {
    plan: &'a Plan,
    run: usize,
}

impl Claims<'_> {
    /// The next chunk: the front of this worker's run, else the middle of the longest run
    /// left, whose back half becomes this worker's; `None` when every chunk is claimed.
    pub(crate) fn next(&mut self) -> Option<(usize, Chunk)> {
        let mut runs = self.plan.runs.lock_unpoisoned();
        let own = runs.get(self.run)?;
        let k = if own.is_empty() {
            let (victim, left) = runs
                .iter()
                .enumerate()
                .map(|(i, r)| (i, r.len()))
                .max_by_key(|&(_, n)| n)?;
            if left == 0 {
                return None;
            }
            let end = runs[victim].end;
            let mid = end - left.div_ceil(2);
            runs[victim].end = mid;
            runs[self.run] = mid + 1..end;
            mid
        } else {
            let k = own.start;
            runs[self.run].start += 1;
            k
        };
        drop(runs);
        self.plan.chunk(k).map(|c| (k, c))
    }
}

/// Appends the chunks of `len` bytes of `file` at `offset`, landing at `dev_off`.
fn push_range(
    out: &mut Vec<Chunk>,
    file: usize,
    offset: u64,
    len: u64,
    dev_off: u64,
    align: u64,
    chunk: u64,
) {
    if len == 0 {
        return;
    }
    let chunk = (chunk / align * align).max(align);
    let end = offset + len;
    let io_end = end.next_multiple_of(align);
    let mut io_start = offset / align * align;
    while io_start < io_end {
        let io_stop = (io_start + chunk).min(io_end);
        let start = io_start.max(offset);
        let stop = io_stop.min(end);
        out.push(Chunk {
            file,
            io_start,
            io_len: (io_stop - io_start) as usize,
            head: (start - io_start) as usize,
            len: (stop - start) as usize,
            dev_off: (dev_off + start - offset) as usize,
        });
        io_start = io_stop;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(offset: u64, len: u64, align: u64, chunk: u64) -> Vec<Chunk> {
        let mut v = Vec::new();
        push_range(&mut v, 0, offset, len, 0, align, chunk);
        v
    }

    #[test]
    fn chunks_cover_exactly_and_align_inside() {
        // Direct: 512-byte alignment, unaligned range.
        let c = chunks(700, 5000, 512, 2048);
        let mut prev_end = 700;
        for k in &c {
            assert_eq!(k.io_start % 512, 0);
            assert_eq!(k.io_len % 512, 0);
            assert_eq!(k.start(), prev_end);
            assert!(k.head + k.len <= k.io_len);
            assert_eq!(k.dev_off as u64, k.start() - 700);
            prev_end = k.start() + k.len as u64;
        }
        assert_eq!(c.iter().map(|k| k.len).sum::<usize>(), 5000);
        assert_eq!(prev_end, 5700);
        assert!(c[0].is_partial() && c[c.len() - 1].is_partial());
        assert!(!c[1].is_partial());
        // Buffered: no alignment.
        let w: Vec<_> = chunks(3, 10, 1, 4)
            .iter()
            .map(|k| (k.start(), k.len))
            .collect();
        assert_eq!(w, vec![(3, 4), (7, 4), (11, 2)]);
        assert!(chunks(5, 0, 512, 4096).is_empty());
    }

    #[test]
    fn checksums_combine_in_device_order() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let file = FileHandle::from_file(tempfile::tempfile().unwrap(), "t", false);
        let plan = Plan::new(&[&file], &end_to_end([(0, 0, 10_000)]), 4096, true, 2);
        assert_eq!(plan.count(), 3);
        // Chunks finish out of order; the result does not depend on it.
        for k in [2, 0, 1] {
            let c = plan.chunk(k).unwrap();
            plan.checksum(k, &data[c.dev_off..c.dev_off + c.len]);
        }
        assert_eq!(plan.crc32c(), Some(crc32c::crc32c(&data)));
        let ten = end_to_end([(0, 0, 10)]);
        assert_eq!(Plan::new(&[&file], &ten, 4096, false, 1).crc32c(), None);
        assert_eq!(Plan::new(&[&file], &[], 4096, true, 8).crc32c(), Some(0));
    }

    fn plan(chunks: u64, workers: usize) -> Plan {
        let file = FileHandle::from_file(tempfile::tempfile().unwrap(), "t", false);
        Plan::new(
            &[&file],
            &end_to_end([(0, 0, chunks * 10)]),
            10,
            false,
            workers,
        )
    }

    #[test]
    fn workers_read_contiguous_runs_and_the_idle_split_the_longest() {
        let p = plan(10, 3);
        let (mut a, mut b, mut c) = (p.worker(), p.worker(), p.worker());
        let take = |w: &mut Claims<'_>| w.next().map(|(k, c)| (k, c.dev_off / 10));
        // Runs 0..3, 3..6, 6..10, each front to back.
        assert_eq!(take(&mut a), Some((0, 0)));
        assert_eq!(take(&mut b), Some((3, 3)));
        assert_eq!(take(&mut c), Some((6, 6)));
        assert_eq!(take(&mut a), Some((1, 1)));
        assert_eq!(take(&mut a), Some((2, 2)));
        // `a` is out: it takes the back half of the longest run left (c's 7..10).
        assert_eq!(take(&mut a), Some((8, 8)));
        assert_eq!(take(&mut a), Some((9, 9)));
        assert_eq!(take(&mut c), Some((7, 7)));
        // Left: b's 4..6. `c` splits it; the last one goes to whoever asks first.
        assert_eq!(take(&mut c), Some((5, 5)));
        assert_eq!(take(&mut a), Some((4, 4)));
        for w in [&mut a, &mut b, &mut c] {
            assert_eq!(take(w), None);
        }
        // A worker past the runs shares one; an empty plan has nothing to claim.
        assert_eq!(p.worker().next(), None);
        assert_eq!(plan(0, 4).worker().next(), None);
    }

    #[test]
    fn every_chunk_is_claimed_once_by_racing_workers() {
        let p = plan(5000, 8);
        let claimed: Vec<Vec<usize>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..5)
                .map(|_| {
                    s.spawn(|| {
                        let mut w = p.worker();
                        std::iter::from_fn(|| w.next().map(|(k, _)| k)).collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Three of the eight runs had no worker of their own: the five took them over.
        let mut all: Vec<usize> = claimed.concat();
        all.sort_unstable();
        assert_eq!(all, (0..5000).collect::<Vec<_>>());
    }

    #[test]
    fn pieces_split_into_aligned_bodies_and_edges() {
        let pieces = end_to_end([(0, 100, 10_000), (1, 8192, 4096), (0, 5, 10)]);
        let (bodies, edges) = split_at_blocks(&pieces, 4096);
        let span = |v: &[Piece]| -> Vec<(usize, u64, u64, u64)> {
            v.iter()
                .map(|p| (p.file, p.offset, p.len, p.dev_off))
                .collect()
        };
        assert_eq!(
            span(&bodies),
            vec![(0, 4096, 4096, 3996), (1, 8192, 4096, 10_000)]
        );
        assert_eq!(
            span(&edges),
            vec![(0, 100, 3996, 0), (0, 8192, 1908, 8092), (0, 5, 10, 14_096)]
        );
        let total: u64 = bodies.iter().chain(&edges).map(|p| p.len).sum();
        assert_eq!(total, 14_106);
    }
}
