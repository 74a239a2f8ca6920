//! The staging pipeline for pageable host memory: `cudaMemcpy` from pageable memory reaches
//! only ~10 GB/s because the driver bounces it through one small pinned buffer, one chunk at a
//! time. Here several lanes (a thread, a stream, and a few pinned staging buffers each) pull
//! chunks from a shared queue; each lane's CPU copy of one chunk overlaps the DMA of its
//! previous ones, and the lanes' copies run in parallel.
//!
//! The staging buffers come from the session's [`StagingPool`], which bounds the pinned
//! staging of MemIO and LocalIO together. A lane leases its buffers once, when it is made, and
//! keeps them while it is cached between transfers (in a [`LaneSet`]); it gives them back to
//! the pool only when it goes (a lane that lost a buffer to an error, the pool asking for idle
//! buffers, the engine dropped). So a transfer costs the pool nothing: no lock and no
//! allocation per chunk, none per transfer once its lanes exist — the same as when each lane
//! pinned its own.

use crate::{MemIoError, Result};
use gpuio_hal::sync::MutexExt;
use gpuio_hal::{DeviceBuffer, Gpu, HostBuffer, Inflight, Stream};
use gpuio_staging::{LaneSet, StagingLane, StagingLease, StagingPool};
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// One lane: a stream and its pinned staging buffers, leased from the pool.
pub(crate) struct Lane {
    stream: Stream,
    slots: Vec<HostBuffer>,
    /// `Some` until Drop gives the buffers back.
    lease: Option<StagingLease>,
}

impl Drop for Lane {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.give_back(self.slots.drain(..));
        }
    }
}

/// The lanes of one GPU, created on demand and reused across transfers (pinning memory costs
/// milliseconds; a transfer must not pay it).
pub(crate) type LanePool = LaneSet<Lane>;

/// The lanes of `gpu`: `slots_per_lane` staging buffers of `chunk` bytes each, from
/// `staging` (registered there as a holder of the idle ones).
pub(crate) fn lane_pool(
    gpu: Gpu,
    chunk: usize,
    slots_per_lane: usize,
    staging: StagingPool,
) -> Arc<LanePool> {
    LaneSet::new(gpu, staging, chunk, slots_per_lane, ())
}

impl StagingLane for Lane {
    type Spec = ();
    type Error = MemIoError;

    fn make(_: &(), gpu: &Gpu, slots: Vec<HostBuffer>, lease: StagingLease) -> Result<Self> {
        match gpu.stream() {
            Ok(stream) => Ok(Lane {
                stream,
                slots,
                lease: Some(lease),
            }),
            Err(e) => {
                lease.give_back(slots);
                Err(e.into())
            }
        }
    }

    /// A lane that lost a staging buffer to an error is not whole.
    fn is_whole(&self, buffers: usize) -> bool {
        self.slots.len() == buffers
    }

    fn lease(&self) -> Option<&StagingLease> {
        self.lease.as_ref()
    }
}

/// How a transfer is cut into chunks: `small` chunks at both ends and `large` ones between.
/// Small first chunks start every lane's DMA within microseconds; small last ones keep the
/// DMA backlog short when all lanes finish together (CPU copies and DMA run at about the same
/// rate, ~50 GB/s on an H200 host); large middle ones keep DMA efficient (the copy engine pays
/// ~7 us per copy, so 512 KiB chunks cap it near 30 GB/s, 2 MiB ones reach ~46).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Schedule {
    pub(crate) small: usize,
    pub(crate) large: usize,
    /// Small chunks at each end.
    pub(crate) ramp: usize,
}

impl Schedule {
    /// Bytes at each end cut into small chunks, for a transfer of `len` bytes.
    fn ramp_bytes(&self, len: usize) -> usize {
        (self.ramp * self.small).min(len / 2)
    }

    /// The size of the chunk starting at `offset` of a `len`-byte transfer.
    fn size_at(&self, offset: usize, len: usize) -> usize {
        let ramp = self.ramp_bytes(len);
        let size = if offset < ramp || offset >= len - ramp {
            self.small
        } else {
            // Middle chunks stop where the closing ramp begins.
            self.large.min(len - ramp - offset)
        };
        size.max(1).min(len - offset)
    }

    /// Number of chunks a transfer of `len` bytes is cut into.
    pub(crate) fn count(&self, len: usize) -> usize {
        let (mut at, mut n) = (0, 0);
        while at < len {
            at += self.size_at(at, len);
            n += 1;
        }
        n
    }

    /// The chunks of a transfer of `len` units (bytes, or rows of a gather), in order.
    pub(crate) fn ranges(self, len: usize) -> impl Iterator<Item = Range<usize>> {
        let mut at = 0;
        std::iter::from_fn(move || {
            let start = at;
            at += (at < len).then(|| self.size_at(start, len))?;
            Some(start..at)
        })
    }

    /// The chunks of `data`, each with its offset.
    pub(crate) fn pieces(self, data: &[u8]) -> Pieces<'_> {
        Pieces {
            len: data.len(),
            rest: data,
            offset: 0,
            schedule: self,
        }
    }

    /// The chunks of `data`, mutably (disjoint), each with its offset.
    pub(crate) fn pieces_mut(self, data: &mut [u8]) -> PiecesMut<'_> {
        PiecesMut {
            len: data.len(),
            rest: data,
            offset: 0,
            schedule: self,
        }
    }
}

/// Iterator over a transfer's chunks (offset, bytes).
pub(crate) struct Pieces<'a> {
    rest: &'a [u8],
    len: usize,
    offset: usize,
    schedule: Schedule,
}

impl<'a> Iterator for Pieces<'a> {
    type Item = (usize, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let n = self.schedule.size_at(self.offset, self.len);
        let (piece, rest) = self.rest.split_at(n);
        self.rest = rest;
        let at = self.offset;
        self.offset += n;
        Some((at, piece))
    }
}

/// Iterator over a transfer's chunks (offset, mutable bytes).
pub(crate) struct PiecesMut<'a> {
    rest: &'a mut [u8],
    len: usize,
    offset: usize,
    schedule: Schedule,
}

impl<'a> Iterator for PiecesMut<'a> {
    type Item = (usize, &'a mut [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let n = self.schedule.size_at(self.offset, self.len);
        let (piece, rest) = std::mem::take(&mut self.rest).split_at_mut(n);
        self.rest = rest;
        let at = self.offset;
        self.offset += n;
        Some((at, piece))
    }
}

/// A lost staging buffer: the lane had none free and none in flight.
/// What a chunk of an upload is made from knows its length in bytes.
pub(crate) trait ChunkLen {
    fn chunk_len(&self) -> usize;
}

impl ChunkLen for &[u8] {
    fn chunk_len(&self) -> usize {
        self.len()
    }
}

fn no_slot() -> MemIoError {
    MemIoError::Internal("staging lane has no buffer free or in flight".into())
}

impl Lane {
    /// Copies chunks taken from `work` (offset, bytes) into `dst` at `dst_offset + offset`.
    pub(crate) fn upload<'a>(
        &mut self,
        work: &Mutex<impl Iterator<Item = (usize, &'a [u8])>>,
        abort: &AtomicBool,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        let pieces = || work.lock_unpoisoned().next();
        self.upload_filled(pieces, abort, dst, dst_offset, |piece, buf| {
            buf.copy_from_slice(piece);
            Ok(())
        })
    }

    /// Uploads chunks that `fill` writes into staging: `next` yields (offset, what to
    /// fill), `fill` writes a chunk's bytes into its staging buffer (the slice's length is
    /// the chunk's), and the chunk goes to `dst` at `dst_offset + offset`.
    pub(crate) fn upload_filled<W>(
        &mut self,
        mut next: impl FnMut() -> Option<(usize, W)>,
        abort: &AtomicBool,
        dst: &DeviceBuffer,
        dst_offset: usize,
        fill: impl Fn(W, &mut [u8]) -> Result<()>,
    ) -> Result<()>
    where
        W: ChunkLen,
    {
        let mut pending: VecDeque<Inflight<HostBuffer>> = VecDeque::new();
        loop {
            if abort.load(Ordering::Relaxed) {
                break;
            }
            let Some((at, what)) = next() else {
                break;
            };
            let mut buf = match self.slots.pop() {
                Some(b) => b,
                None => pending.pop_front().ok_or_else(no_slot)?.wait()?,
            };
            let len = what.chunk_len();
            if let Err(e) = fill(what, &mut buf[..len]) {
                self.slots.push(buf);
                for p in pending {
                    self.slots.push(p.wait()?);
                }
                return Err(e);
            }
            let off = dst_offset + at;
            pending.push_back(self.stream.upload_async(buf, 0..len, dst, off)?);
        }
        for p in pending {
            self.slots.push(p.wait()?);
        }
        Ok(())
    }

    /// Fills chunks taken from `work` (offset, destination bytes) from `src` at
    /// `src_offset + offset`.
    pub(crate) fn download<'a>(
        &mut self,
        work: &Mutex<impl Iterator<Item = (usize, &'a mut [u8])>>,
        abort: &AtomicBool,
        src: &DeviceBuffer,
        src_offset: usize,
    ) -> Result<()> {
        let mut pending: VecDeque<(&'a mut [u8], Inflight<HostBuffer>)> = VecDeque::new();
        let drain_one = |pending: &mut VecDeque<(&'a mut [u8], Inflight<HostBuffer>)>| {
            let (out, inflight) = pending.pop_front().ok_or_else(no_slot)?;
            let buf = inflight.wait()?;
            out.copy_from_slice(&buf[..out.len()]);
            Ok::<_, MemIoError>(buf)
        };
        loop {
            if abort.load(Ordering::Relaxed) {
                break;
            }
            let Some((at, out)) = work.lock_unpoisoned().next() else {
                break;
            };
            let buf = match self.slots.pop() {
                Some(b) => b,
                None => drain_one(&mut pending)?,
            };
            let off = src_offset + at;
            let n = out.len();
            pending.push_back((out, self.stream.download_async(src, off, buf, 0..n)?));
        }
        while !pending.is_empty() {
            let buf = drain_one(&mut pending)?;
            self.slots.push(buf);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_ramp_up_and_down_and_cover_the_transfer_exactly() {
        let s = Schedule {
            small: 4,
            large: 10,
            ramp: 2,
        };
        let data: Vec<u8> = (0..45).collect();
        let pieces: Vec<(usize, usize)> = s.pieces(&data).map(|(o, p)| (o, p.len())).collect();
        assert_eq!(
            pieces,
            vec![(0, 4), (4, 4), (8, 10), (18, 10), (28, 9), (37, 4), (41, 4)]
        );
        assert_eq!(s.count(45), 7);
        let ranges: Vec<(usize, usize)> = s.ranges(45).map(|r| (r.start, r.len())).collect();
        assert_eq!(ranges, pieces);
        // Short transfers are all small chunks.
        let short: Vec<usize> = s.pieces(&data[..10]).map(|(_, p)| p.len()).collect();
        assert_eq!(short, vec![4, 4, 2]);
        for len in 0..60 {
            let mut buf = vec![0u8; len];
            let n: usize = s.pieces_mut(&mut buf).map(|(_, p)| p.len()).sum();
            assert_eq!(n, len);
            assert_eq!(s.count(len), s.pieces(&buf).count());
        }
    }
}
