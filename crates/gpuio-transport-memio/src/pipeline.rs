//! The staging pipeline for pageable host memory: `cudaMemcpy` from pageable memory reaches
//! only ~10 GB/s because the driver bounces it through one small pinned buffer, one chunk at a
//! time. Here several lanes (a thread, a stream, and a few pinned staging buffers each) pull
//! chunks from a shared queue; each lane's CPU copy of one chunk overlaps the DMA of its
//! previous ones, and the lanes' copies run in parallel.

use crate::{MemIoError, Result};
use gpuio_hal::{DeviceBuffer, Gpu, HostAllocOptions, HostBuffer, Inflight, Stream};
use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

/// One lane: a stream and its pinned staging buffers.
pub(crate) struct Lane {
    stream: Stream,
    slots: Vec<HostBuffer>,
}

/// The lanes of one GPU, created on demand and reused across transfers (pinning memory costs
/// milliseconds; a transfer must not pay it).
pub(crate) struct LanePool {
    gpu: Gpu,
    chunk: usize,
    slots_per_lane: usize,
    lanes: Mutex<Vec<Lane>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave their data inconsistent (a Vec of lanes,
    // a chunk iterator), so a poisoned lock is used as is.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl LanePool {
    pub(crate) fn new(gpu: Gpu, chunk: usize, slots_per_lane: usize) -> Self {
        Self {
            gpu,
            chunk,
            slots_per_lane: slots_per_lane.max(2),
            lanes: Mutex::new(Vec::new()),
        }
    }

    /// Takes `n` lanes, creating the missing ones. Staging memory lives on the GPU's NUMA
    /// node where the GPU reports one.
    pub(crate) fn take(&self, n: usize) -> Result<Vec<Lane>> {
        let mut taken = {
            let mut pool = lock(&self.lanes);
            let keep = pool.len().saturating_sub(n);
            pool.split_off(keep)
        };
        let opts = HostAllocOptions {
            numa: self.gpu.info().numa_node,
            ..HostAllocOptions::default()
        };
        while taken.len() < n {
            let slots = (0..self.slots_per_lane)
                .map(|_| HostBuffer::alloc_pinned(self.chunk, &opts, &self.gpu))
                .collect::<gpuio_hal::Result<Vec<_>>>()?;
            taken.push(Lane {
                stream: self.gpu.stream()?,
                slots,
            });
        }
        Ok(taken)
    }

    /// Returns lanes to the pool; a lane that lost staging buffers to an error is dropped.
    pub(crate) fn give_back(&self, lanes: Vec<Lane>) {
        let whole = lanes
            .into_iter()
            .filter(|l| l.slots.len() == self.slots_per_lane);
        lock(&self.lanes).extend(whole);
    }

    /// Pinned staging memory held by idle lanes, in bytes.
    pub(crate) fn staged_bytes(&self) -> usize {
        lock(&self.lanes)
            .iter()
            .map(|l| l.slots.len() * self.chunk)
            .sum()
    }
}

/// A lost staging buffer: the lane had none free and none in flight.
fn no_slot() -> MemIoError {
    MemIoError::Internal("staging lane has no buffer free or in flight".into())
}

impl Lane {
    /// Copies chunks taken from `work` (index, bytes) into `dst` at `dst_offset + index*chunk`.
    pub(crate) fn upload<'a>(
        &mut self,
        work: &Mutex<impl Iterator<Item = (usize, &'a [u8])>>,
        chunk: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        let mut pending: VecDeque<Inflight<HostBuffer>> = VecDeque::new();
        loop {
            let Some((i, piece)) = lock(work).next() else {
                break;
            };
            let mut buf = match self.slots.pop() {
                Some(b) => b,
                None => pending.pop_front().ok_or_else(no_slot)?.wait()?,
            };
            buf[..piece.len()].copy_from_slice(piece);
            let off = dst_offset + i * chunk;
            pending.push_back(self.stream.upload_async(buf, 0..piece.len(), dst, off)?);
        }
        for p in pending {
            self.slots.push(p.wait()?);
        }
        Ok(())
    }

    /// Fills chunks taken from `work` (index, destination bytes) from `src` at
    /// `src_offset + index*chunk`.
    pub(crate) fn download<'a>(
        &mut self,
        work: &Mutex<impl Iterator<Item = (usize, &'a mut [u8])>>,
        chunk: usize,
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
            let Some((i, out)) = lock(work).next() else {
                break;
            };
            let buf = match self.slots.pop() {
                Some(b) => b,
                None => drain_one(&mut pending)?,
            };
            let off = src_offset + i * chunk;
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
