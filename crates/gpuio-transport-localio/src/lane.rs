//! Lanes of the file↔GPU pipeline. A lane is a thread's worth of work: an IO queue whose
//! slots are pinned staging buffers, and a GPU stream. Lanes pull chunks of a transfer from a
//! shared counter; within a lane, reads of later chunks run while earlier ones are DMA'd to the
//! GPU (and, for writes, DMAs of later chunks while earlier ones are written).
//!
//! O_DIRECT: a chunk's IO covers its aligned superset; only the wanted bytes go to the GPU.
//! Chunk boundaries inside a transfer are aligned, so only its first and last chunk can have
//! partial blocks; a write fills those from the file first (zeros past its end) and the caller
//! trims any padding past the end afterwards.

use crate::file::FileHandle;
use crate::queue::{Engine, FileId, IoQueue};
use crate::{LocalIoError, Result};
use gpuio_hal::{DeviceBuffer, Gpu, HostAllocOptions, HostBuffer, Inflight, Stream};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Pools of idle lanes and first-error slots cannot be left inconsistent by a panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Most blocks a block gather puts in one staging slot (one DMA each batch).
pub(crate) const MAX_BATCH: usize = 256;

/// One lane.
pub(crate) struct Lane {
    queue: IoQueue,
    stream: Stream,
}

/// The idle lanes of one GPU, created on demand and reused (pinning and registering staging
/// memory costs milliseconds; a transfer must not pay it).
pub(crate) struct LanePool {
    gpu: Gpu,
    engine: Engine,
    slot_len: usize,
    slots: usize,
    /// Operations a lane's ring holds: a full block batch in every slot.
    depth: u32,
    sqpoll: bool,
    lanes: Mutex<Vec<Lane>>,
}

impl LanePool {
    pub(crate) fn new(
        gpu: Gpu,
        engine: Engine,
        slot_len: usize,
        slots: usize,
        sqpoll: bool,
    ) -> Self {
        let slots = slots.max(2);
        Self {
            gpu,
            engine,
            slot_len,
            slots,
            depth: (slots * MAX_BATCH).min(4096) as u32,
            sqpoll,
            lanes: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Takes `n` lanes, creating the missing ones; staging lives on the GPU's NUMA node.
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
            let lane = (|| -> Result<Lane> {
                let buffers = (0..self.slots)
                    .map(|_| HostBuffer::alloc_pinned(self.slot_len, &opts, &self.gpu))
                    .collect::<gpuio_hal::Result<Vec<_>>>()?;
                Ok(Lane {
                    queue: IoQueue::new(self.engine, buffers, self.depth, self.sqpoll)?,
                    stream: self.gpu.stream()?,
                })
            })();
            match lane {
                Ok(l) => taken.push(l),
                Err(e) => {
                    self.give_back(taken);
                    return Err(e);
                }
            }
        }
        Ok(taken)
    }

    /// Returns lanes; one that lost a staging slot to an error is dropped.
    pub(crate) fn give_back(&self, lanes: Vec<Lane>) {
        let healthy = lanes
            .into_iter()
            .filter(|l| l.queue.in_flight() == 0 && l.queue.slots() == self.slots);
        lock(&self.lanes).extend(healthy);
    }
}

/// How a transfer between a file range and a device range is cut into chunks.
pub(crate) struct Chunks {
    file_off: u64,
    end: u64,
    /// Aligned start of the first chunk.
    base: u64,
    align: u64,
    chunk: u64,
    count: usize,
    next: AtomicUsize,
}

impl Chunks {
    /// `chunk` must be a multiple of `align` (a power of two; 1 for buffered IO).
    pub(crate) fn new(file_off: u64, len: u64, align: u64, chunk: u64) -> Self {
        let base = file_off / align * align;
        let end = file_off + len;
        let io_end = end.next_multiple_of(align);
        let count = if len == 0 {
            0
        } else {
            (io_end - base).div_ceil(chunk) as usize
        };
        Self {
            file_off,
            end,
            base,
            align,
            chunk,
            count,
            next: AtomicUsize::new(0),
        }
    }

    pub(crate) fn count(&self) -> usize {
        self.count
    }

    fn claim(&self) -> Option<usize> {
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        (k < self.count).then_some(k)
    }

    /// The (aligned) file range chunk `k`'s IO covers.
    fn io_range(&self, k: usize) -> (u64, usize) {
        let start = self.base + k as u64 * self.chunk;
        let end = (start + self.chunk).min(self.end.next_multiple_of(self.align));
        (start, (end - start) as usize)
    }

    /// The exact file bytes chunk `k` carries.
    fn wanted(&self, k: usize) -> (u64, usize) {
        let (io_start, io_len) = self.io_range(k);
        let start = io_start.max(self.file_off);
        let end = (io_start + io_len as u64).min(self.end);
        (start, (end - start) as usize)
    }

    /// Where chunk `k`'s bytes sit in the device range.
    fn device_offset(&self, k: usize) -> usize {
        (self.wanted(k).0 - self.file_off) as usize
    }
}

/// What a lane reads: file → device.
pub(crate) struct ReadJob<'a> {
    pub(crate) file: &'a FileHandle,
    pub(crate) chunks: &'a Chunks,
    pub(crate) dst: &'a DeviceBuffer,
    pub(crate) dst_offset: usize,
}

/// What a lane reads for a block gather: block `k` at `offsets[k]` → `dst[dst_offset + k*block]`.
pub(crate) struct BlocksJob<'a> {
    pub(crate) file: &'a FileHandle,
    pub(crate) offsets: &'a [u64],
    pub(crate) block: usize,
    /// Blocks per staging slot (one DMA per batch).
    pub(crate) batch: usize,
    pub(crate) dst: &'a DeviceBuffer,
    pub(crate) dst_offset: usize,
    pub(crate) next: AtomicUsize,
}

impl BlocksJob<'_> {
    fn batches(&self) -> usize {
        self.offsets.len().div_ceil(self.batch)
    }

    fn claim(&self) -> Option<usize> {
        let b = self.next.fetch_add(1, Ordering::Relaxed);
        (b < self.batches()).then_some(b)
    }

    /// The blocks of batch `b`.
    fn range(&self, b: usize) -> std::ops::Range<usize> {
        b * self.batch..((b + 1) * self.batch).min(self.offsets.len())
    }
}

/// What a lane writes: device → file.
pub(crate) struct WriteJob<'a> {
    pub(crate) file: &'a FileHandle,
    pub(crate) chunks: &'a Chunks,
    pub(crate) src: &'a DeviceBuffer,
    pub(crate) src_offset: usize,
    /// The file's length before the transfer (edges past it read as zeros).
    pub(crate) old_len: u64,
    /// Bytes confirmed written so far, by all lanes.
    pub(crate) written: &'a AtomicUsize,
    /// Start writeback of each chunk once written (the transfer ends in `fdatasync`).
    pub(crate) writeback: bool,
}

impl Lane {
    pub(crate) fn engine(&self) -> Engine {
        self.queue.engine()
    }

    /// Waits for everything the lane has in flight and returns lent slots, also after an
    /// error, so the lane can be reused.
    fn settle(&mut self, dmas: VecDeque<(usize, Inflight<HostBuffer>)>) {
        for (slot, inflight) in dmas {
            if let Ok(buf) = inflight.wait() {
                let _ = self.queue.put(slot, buf);
            }
        }
        while self.queue.in_flight() > 0 {
            if self.queue.complete(1).is_err() {
                break;
            }
        }
    }

    /// Runs a read job until its chunks run out (or `abort` is set by a failing lane).
    pub(crate) fn read(&mut self, job: &ReadJob<'_>, abort: &AtomicBool) -> Result<()> {
        let file = self.queue.attach(job.file.shared())?;
        let mut dmas = VecDeque::new();
        let result = self.read_loop(job, file, abort, &mut dmas);
        self.settle(dmas);
        self.queue.detach(file);
        result
    }

    fn read_loop(
        &mut self,
        job: &ReadJob<'_>,
        file: FileId,
        abort: &AtomicBool,
        dmas: &mut VecDeque<(usize, Inflight<HostBuffer>)>,
    ) -> Result<()> {
        let mut free: Vec<usize> = (0..self.queue.slots()).collect();
        let mut reads = 0usize;
        let mut exhausted = false;
        loop {
            // Slots whose DMA is done come back without waiting.
            while let Some((_, f)) = dmas.front()
                && f.is_complete()?
            {
                if let Some((slot, f)) = dmas.pop_front() {
                    self.queue.put(slot, f.wait()?)?;
                    free.push(slot);
                }
            }
            while !exhausted && !abort.load(Ordering::Relaxed) && !free.is_empty() {
                match job.chunks.claim() {
                    Some(k) => {
                        let slot = free.pop().ok_or_else(no_slot)?;
                        let (at, n) = job.chunks.io_range(k);
                        self.queue.read(file, at, slot, 0..n, k as u64)?;
                        reads += 1;
                    }
                    None => exhausted = true,
                }
            }
            if reads == 0 {
                match dmas.pop_front() {
                    Some((slot, f)) => {
                        self.queue.put(slot, f.wait()?)?;
                        free.push(slot);
                        continue;
                    }
                    None if exhausted || abort.load(Ordering::Relaxed) => return Ok(()),
                    None => continue,
                }
            }
            for done in self.queue.complete(1)? {
                reads -= 1;
                let k = done.tag as usize;
                let slot = done.buf.map(|b| b.0).ok_or_else(no_slot)?;
                let (io_start, _) = job.chunks.io_range(k);
                let (want_start, want_len) = job.chunks.wanted(k);
                let got = done.result.map_err(|e| job.file.io("read", io_start, e))?;
                let head = (want_start - io_start) as usize;
                if got < head + want_len {
                    return Err(job.file.eof(want_start, want_len, got.saturating_sub(head)));
                }
                let buf = self.queue.take(slot)?;
                let off = job.dst_offset + job.chunks.device_offset(k);
                dmas.push_back((
                    slot,
                    self.stream
                        .upload_async(buf, head..head + want_len, job.dst, off)?,
                ));
            }
        }
    }

    /// Runs a block-gather job until its batches run out (or `abort` is set).
    pub(crate) fn read_blocks(&mut self, job: &BlocksJob<'_>, abort: &AtomicBool) -> Result<()> {
        let file = self.queue.attach(job.file.shared())?;
        let mut dmas = VecDeque::new();
        let result = self.blocks_loop(job, file, abort, &mut dmas);
        self.settle(dmas);
        self.queue.detach(file);
        result
    }

    fn blocks_loop(
        &mut self,
        job: &BlocksJob<'_>,
        file: FileId,
        abort: &AtomicBool,
        dmas: &mut VecDeque<(usize, Inflight<HostBuffer>)>,
    ) -> Result<()> {
        let slots = self.queue.slots();
        let mut free: Vec<usize> = (0..slots).collect();
        // Per slot: its batch and the reads still outstanding.
        let mut batch_of = vec![0usize; slots];
        let mut outstanding = vec![0usize; slots];
        let mut reads = 0usize;
        let mut exhausted = false;
        loop {
            while let Some((_, f)) = dmas.front()
                && f.is_complete()?
            {
                if let Some((slot, f)) = dmas.pop_front() {
                    self.queue.put(slot, f.wait()?)?;
                    free.push(slot);
                }
            }
            while !exhausted && !abort.load(Ordering::Relaxed) && !free.is_empty() {
                let Some(b) = job.claim() else {
                    exhausted = true;
                    break;
                };
                let slot = free.pop().ok_or_else(no_slot)?;
                let range = job.range(b);
                batch_of[slot] = b;
                outstanding[slot] = range.len();
                for (j, k) in range.enumerate() {
                    let at = j * job.block;
                    let tag = ((slot as u64) << 32) | k as u64;
                    self.queue
                        .read(file, job.offsets[k], slot, at..at + job.block, tag)?;
                    reads += 1;
                }
            }
            if reads == 0 {
                match dmas.pop_front() {
                    Some((slot, f)) => {
                        self.queue.put(slot, f.wait()?)?;
                        free.push(slot);
                        continue;
                    }
                    None if exhausted || abort.load(Ordering::Relaxed) => return Ok(()),
                    None => continue,
                }
            }
            for done in self.queue.complete(1)? {
                reads -= 1;
                let slot = (done.tag >> 32) as usize;
                let k = (done.tag & 0xffff_ffff) as usize;
                let got = done
                    .result
                    .map_err(|e| job.file.io("read", job.offsets[k], e))?;
                if got < job.block {
                    return Err(job.file.eof(job.offsets[k], job.block, got));
                }
                outstanding[slot] -= 1;
                if outstanding[slot] == 0 {
                    let range = job.range(batch_of[slot]);
                    let buf = self.queue.take(slot)?;
                    let off = job.dst_offset + range.start * job.block;
                    let n = range.len() * job.block;
                    dmas.push_back((slot, self.stream.upload_async(buf, 0..n, job.dst, off)?));
                }
            }
        }
    }

    /// Runs a write job until its chunks run out (or `abort` is set by a failing lane).
    pub(crate) fn write(&mut self, job: &WriteJob<'_>, abort: &AtomicBool) -> Result<()> {
        let file = self.queue.attach(job.file.shared())?;
        let mut dmas = VecDeque::new();
        let result = self.write_loop(job, file, abort, &mut dmas);
        self.settle(dmas);
        self.queue.detach(file);
        result
    }

    fn write_loop(
        &mut self,
        job: &WriteJob<'_>,
        file: FileId,
        abort: &AtomicBool,
        dmas: &mut VecDeque<(usize, Inflight<HostBuffer>)>,
    ) -> Result<()> {
        let mut free: Vec<usize> = (0..self.queue.slots()).collect();
        let mut writes = 0usize;
        let mut exhausted = false;
        // Chunk number of each slot's DMA.
        let mut chunk_of: Vec<usize> = vec![0; self.queue.slots()];
        loop {
            while !exhausted && !abort.load(Ordering::Relaxed) && !free.is_empty() {
                match job.chunks.claim() {
                    Some(k) => {
                        let slot = free.pop().ok_or_else(no_slot)?;
                        let (io_start, io_len) = job.chunks.io_range(k);
                        let (want_start, want_len) = job.chunks.wanted(k);
                        let head = (want_start - io_start) as usize;
                        let buf = self.queue.buffer_mut(slot)?;
                        if head != 0 || head + want_len != io_len {
                            // A partial edge block keeps what the file holds there.
                            buf[..io_len].fill(0);
                            if io_start < job.old_len {
                                job.file.read_at(io_start, &mut buf[..io_len])?;
                            }
                        }
                        let buf = self.queue.take(slot)?;
                        let off = job.src_offset + job.chunks.device_offset(k);
                        chunk_of[slot] = k;
                        dmas.push_back((
                            slot,
                            self.stream
                                .download_async(job.src, off, buf, head..head + want_len)?,
                        ));
                    }
                    None => exhausted = true,
                }
            }
            // The oldest DMA done: write its slot out.
            if let Some((slot, f)) = dmas.pop_front() {
                self.queue.put(slot, f.wait()?)?;
                let k = chunk_of[slot];
                let (io_start, io_len) = job.chunks.io_range(k);
                self.queue
                    .write(file, io_start, slot, 0..io_len, k as u64)?;
                writes += 1;
            }
            if writes == 0 {
                if dmas.is_empty() && (exhausted || abort.load(Ordering::Relaxed)) {
                    return Ok(());
                }
                continue;
            }
            let wait = if dmas.is_empty() || free.is_empty() {
                1
            } else {
                0
            };
            for done in self.queue.complete(wait)? {
                writes -= 1;
                let k = done.tag as usize;
                let slot = done.buf.map(|b| b.0).ok_or_else(no_slot)?;
                free.push(slot);
                let (io_start, io_len) = job.chunks.io_range(k);
                let (_, want_len) = job.chunks.wanted(k);
                let written = job.written.load(Ordering::Relaxed);
                match done.result {
                    Ok(n) if n == io_len => {
                        job.written.fetch_add(want_len, Ordering::Relaxed);
                        if job.writeback {
                            job.file.start_writeback(io_start, io_len as u64)?;
                        }
                    }
                    Ok(n) => {
                        return Err(job
                            .file
                            .no_space(io_start, io_len, written + n.min(want_len)));
                    }
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
                        return Err(job.file.no_space(io_start, io_len, written));
                    }
                    Err(e) => return Err(job.file.io("write", io_start, e)),
                }
            }
        }
    }
}

fn no_slot() -> LocalIoError {
    LocalIoError::Internal("a staging slot went missing".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_exactly_and_align_inside() {
        // Direct: 512-byte alignment, unaligned range.
        let c = Chunks::new(700, 5000, 512, 2048);
        let mut covered = 0;
        let mut prev_end = 700;
        for k in 0..c.count() {
            let (io, n) = c.io_range(k);
            assert_eq!(io % 512, 0);
            assert_eq!(n % 512, 0);
            let (w, wn) = c.wanted(k);
            assert_eq!(w, prev_end);
            assert!(w >= io && w + wn as u64 <= io + n as u64);
            assert_eq!(c.device_offset(k), (w - 700) as usize);
            prev_end = w + wn as u64;
            covered += wn;
        }
        assert_eq!(covered, 5000);
        assert_eq!(prev_end, 5700);
        // Buffered: no alignment.
        let c = Chunks::new(3, 10, 1, 4);
        let w: Vec<_> = (0..c.count()).map(|k| c.wanted(k)).collect();
        assert_eq!(w, vec![(3, 4), (7, 4), (11, 2)]);
        assert_eq!(Chunks::new(5, 0, 512, 4096).count(), 0);
    }
}
