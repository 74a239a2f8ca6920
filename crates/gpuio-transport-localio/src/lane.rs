//! Lanes of the file↔GPU pipeline. A lane is a thread's worth of work: an IO queue whose
//! slots are pinned staging buffers, and a GPU stream. Each lane claims a contiguous run of a
//! transfer's chunks (`plan.rs`); within a lane, reads of later chunks run while earlier ones
//! are DMA'd to the GPU (and, for writes, DMAs of later chunks while earlier ones are
//! written). A write fills a chunk's partial edge blocks from the file first (zeros past its
//! end); the caller trims any O_DIRECT padding past the end afterwards.
//!
//! The staging slots come from the session's [`StagingPool`] (shared with MemIO, which bounds
//! their pinned bytes together): a lane leases them once, when it is made, registers them with
//! its io_uring ring, and keeps them while it is cached between transfers. They go back to the
//! pool only when the lane goes (unregistered first): a transfer never touches the pool, so
//! nothing is locked or allocated per chunk, and the ring's registration (a page walk) is paid
//! once per lane, as when each lane pinned its own.

use crate::file::FileHandle;
use crate::plan::Plan;
use crate::queue::{FileId, IoEngine, IoQueue};
use crate::{LocalIoError, Result};
use gpuio_hal::{DeviceBuffer, Gpu, HostBuffer, Inflight, Stream};
use gpuio_staging::{LaneSet, StagingLane, StagingLease, StagingPool};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// A lane's DMAs in flight, oldest first, with the staging slot each holds.
type Dmas = VecDeque<(usize, Inflight<HostBuffer>)>;

/// Most blocks a block gather puts in one staging slot (one DMA each batch).
pub(crate) const MAX_BATCH: usize = 256;

/// One lane.
pub(crate) struct Lane {
    queue: IoQueue,
    stream: Stream,
    /// `Some` until Drop gives the slots back.
    lease: Option<StagingLease>,
}

impl Drop for Lane {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.give_back(self.queue.release_buffers());
        }
    }
}

/// The idle lanes of one GPU, created on demand and reused (pinning and registering staging
/// memory costs milliseconds; a transfer must not pay it).
pub(crate) type LanePool = LaneSet<Lane>;

/// What the lanes of a [`LanePool`] are made of.
pub(crate) struct LaneSpec {
    pub(crate) engine: IoEngine,
    pub(crate) slot_len: usize,
    pub(crate) slots: usize,
    pub(crate) sqpoll: bool,
}

/// What a lane's IO queue is made with.
pub(crate) struct QueueSpec {
    engine: IoEngine,
    /// Operations a lane's ring holds: a full block batch in every slot.
    depth: u32,
    sqpoll: bool,
}

/// The lanes of `gpu` made as `spec` says, their slots from `staging` (registered there as a
/// holder of the idle ones).
pub(crate) fn lane_pool(gpu: Gpu, spec: LaneSpec, staging: StagingPool) -> Arc<LanePool> {
    let slots = spec.slots.max(2);
    let queue = QueueSpec {
        engine: spec.engine,
        depth: (slots * MAX_BATCH).min(4096) as u32,
        sqpoll: spec.sqpoll,
    };
    LaneSet::new(gpu, staging, spec.slot_len, slots, queue)
}

impl StagingLane for Lane {
    type Spec = QueueSpec;
    type Error = LocalIoError;

    fn make(
        spec: &QueueSpec,
        gpu: &Gpu,
        buffers: Vec<HostBuffer>,
        lease: StagingLease,
    ) -> Result<Self> {
        let stream = match gpu.stream() {
            Ok(s) => s,
            Err(e) => {
                lease.give_back(buffers);
                return Err(e.into());
            }
        };
        // A queue that cannot be made drops the buffers it was given: the lease forgets them.
        let queue = IoQueue::new(spec.engine, buffers, spec.depth, spec.sqpoll)?;
        Ok(Lane {
            queue,
            stream,
            lease: Some(lease),
        })
    }

    /// A lane is kept only with nothing in flight in its ring and all its slots: one that lost
    /// a staging slot to an error is dropped.
    fn is_whole(&self, slots: usize) -> bool {
        self.queue.in_flight() == 0 && self.queue.slots() == slots
    }

    fn lease(&self) -> Option<&StagingLease> {
        self.lease.as_ref()
    }
}

/// What a lane reads: files → device.
pub(crate) struct ReadJob<'a> {
    pub(crate) files: &'a [&'a FileHandle],
    pub(crate) plan: &'a Plan,
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

/// What a lane writes: device → files.
pub(crate) struct WriteJob<'a> {
    pub(crate) files: &'a [&'a FileHandle],
    pub(crate) plan: &'a Plan,
    pub(crate) src: &'a DeviceBuffer,
    pub(crate) src_offset: usize,
    /// The files' lengths before the transfer (edges past them read as zeros).
    pub(crate) old_lens: &'a [u64],
    /// Bytes confirmed written so far, by all lanes.
    pub(crate) written: &'a AtomicUsize,
    /// Start writeback of each chunk once written (the transfer ends in `fdatasync`).
    pub(crate) writeback: bool,
}

impl Lane {
    pub(crate) fn engine(&self) -> IoEngine {
        self.queue.engine()
    }

    /// Waits for everything the lane has in flight and returns lent slots, also after an
    /// error, so the lane can be reused.
    fn settle(&mut self, dmas: Dmas) {
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

    /// Attaches `files` to the lane's queue, all or none.
    fn attach_all(&mut self, files: &[&FileHandle]) -> Result<Vec<FileId>> {
        let mut ids = Vec::with_capacity(files.len());
        for f in files {
            match f.os_file().and_then(|file| self.queue.attach(file)) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    self.detach_all(ids);
                    return Err(e);
                }
            }
        }
        Ok(ids)
    }

    fn detach_all(&mut self, ids: Vec<FileId>) {
        for id in ids {
            self.queue.detach(id);
        }
    }

    /// Attaches `files` and runs `body` with their ids and the lane's DMA queue; then waits
    /// for everything the lane started and detaches them, also after an error.
    fn with_files(
        &mut self,
        files: &[&FileHandle],
        body: impl FnOnce(&mut Self, &[FileId], &mut Dmas) -> Result<()>,
    ) -> Result<()> {
        let ids = self.attach_all(files)?;
        let mut dmas = VecDeque::new();
        let result = body(self, &ids, &mut dmas);
        self.settle(dmas);
        self.detach_all(ids);
        result
    }

    /// Puts the slots of finished DMAs back into the queue, oldest first; with `wait`, waits
    /// for the oldest if none has finished. Returns whether a slot came back.
    fn reclaim(&mut self, dmas: &mut Dmas, free: &mut Vec<usize>, wait: bool) -> Result<bool> {
        let mut any = false;
        while let Some((_, f)) = dmas.front()
            && (f.is_complete()? || (wait && !any))
        {
            if let Some((slot, f)) = dmas.pop_front() {
                self.queue.put(slot, f.wait()?)?;
                free.push(slot);
                any = true;
            }
        }
        Ok(any)
    }

    /// Runs a read job until its chunks run out (or `abort` is set by a failing lane).
    pub(crate) fn read(&mut self, job: &ReadJob<'_>, abort: &AtomicBool) -> Result<()> {
        self.with_files(job.files, |lane, ids, dmas| {
            lane.read_loop(job, ids, abort, dmas)
        })
    }

    fn read_loop(
        &mut self,
        job: &ReadJob<'_>,
        ids: &[FileId],
        abort: &AtomicBool,
        dmas: &mut Dmas,
    ) -> Result<()> {
        let mut free: Vec<usize> = (0..self.queue.slots()).collect();
        let mut claims = job.plan.worker();
        let mut reads = 0usize;
        let mut exhausted = false;
        // Reads resumed after a short transfer: where in the IO each resumption starts.
        let mut resumed: HashMap<u64, usize> = HashMap::new();
        loop {
            // Slots whose DMA is done come back without waiting.
            self.reclaim(dmas, &mut free, false)?;
            while !exhausted && !abort.load(Ordering::Relaxed) && !free.is_empty() {
                match claims.next() {
                    Some((k, c)) => {
                        let slot = free.pop().ok_or_else(no_slot)?;
                        let id = *ids.get(c.file).ok_or_else(no_file)?;
                        self.queue
                            .read(id, c.io_start, slot, 0..c.io_len, k as u64)?;
                        reads += 1;
                    }
                    None => exhausted = true,
                }
            }
            if reads == 0 {
                // Nothing to reap: wait for a DMA to free a slot, or stop when all is done.
                if !self.reclaim(dmas, &mut free, true)?
                    && (exhausted || abort.load(Ordering::Relaxed))
                {
                    return Ok(());
                }
                continue;
            }
            for done in self.queue.complete(1)? {
                reads -= 1;
                let k = done.tag as usize;
                let slot = done.buf.map(|b| b.0).ok_or_else(no_slot)?;
                let c = job.plan.chunk(k).ok_or_else(no_chunk)?;
                let file = job.files[c.file];
                let from = resumed.remove(&done.tag).unwrap_or(0);
                let got = from + done.result.map_err(|e| file.io("read", c.io_start, e))?;
                let need = c.head + c.len;
                if got < need {
                    // A short read before the end of the file (FUSE, network file systems)
                    // continues where it stopped; a read that brings nothing is the end.
                    let Some(at) = resume_at(from, got, file.required_alignment()) else {
                        return Err(file.eof(c.start(), c.len, got.saturating_sub(c.head)));
                    };
                    let id = *ids.get(c.file).ok_or_else(no_file)?;
                    self.queue
                        .read(id, c.io_start + at as u64, slot, at..c.io_len, done.tag)?;
                    resumed.insert(done.tag, at);
                    reads += 1;
                    continue;
                }
                let buf = self.queue.take(slot)?;
                let wanted = c.head..c.head + c.len;
                job.plan.checksum(k, &buf[wanted.clone()]);
                dmas.push_back((
                    slot,
                    self.stream
                        .upload_async(buf, wanted, job.dst, job.dst_offset + c.dev_off)?,
                ));
            }
        }
    }

    /// Runs a block-gather job until its batches run out (or `abort` is set).
    pub(crate) fn read_blocks(&mut self, job: &BlocksJob<'_>, abort: &AtomicBool) -> Result<()> {
        self.with_files(&[job.file], |lane, ids, dmas| {
            let file = *ids.first().ok_or_else(no_file)?;
            lane.blocks_loop(job, file, abort, dmas)
        })
    }

    fn blocks_loop(
        &mut self,
        job: &BlocksJob<'_>,
        file: FileId,
        abort: &AtomicBool,
        dmas: &mut Dmas,
    ) -> Result<()> {
        let slots = self.queue.slots();
        let mut free: Vec<usize> = (0..slots).collect();
        // Per slot: its batch and the reads still outstanding.
        let mut batch_of = vec![0usize; slots];
        let mut outstanding = vec![0usize; slots];
        let mut reads = 0usize;
        let mut exhausted = false;
        let mut resumed: HashMap<u64, usize> = HashMap::new();
        loop {
            self.reclaim(dmas, &mut free, false)?;
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
                // Nothing to reap: wait for a DMA to free a slot, or stop when all is done.
                if !self.reclaim(dmas, &mut free, true)?
                    && (exhausted || abort.load(Ordering::Relaxed))
                {
                    return Ok(());
                }
                continue;
            }
            for done in self.queue.complete(1)? {
                reads -= 1;
                let slot = (done.tag >> 32) as usize;
                let k = (done.tag & 0xffff_ffff) as usize;
                let from = resumed.remove(&done.tag).unwrap_or(0);
                let got = from
                    + done
                        .result
                        .map_err(|e| job.file.io("read", job.offsets[k], e))?;
                if got < job.block {
                    let Some(at) = resume_at(from, got, job.file.required_alignment()) else {
                        return Err(job.file.eof(job.offsets[k], job.block, got));
                    };
                    let base = (k - job.range(batch_of[slot]).start) * job.block;
                    let range = base + at..base + job.block;
                    self.queue
                        .read(file, job.offsets[k] + at as u64, slot, range, done.tag)?;
                    resumed.insert(done.tag, at);
                    reads += 1;
                    continue;
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
        self.with_files(job.files, |lane, ids, dmas| {
            lane.write_loop(job, ids, abort, dmas)
        })
    }

    fn write_loop(
        &mut self,
        job: &WriteJob<'_>,
        ids: &[FileId],
        abort: &AtomicBool,
        dmas: &mut Dmas,
    ) -> Result<()> {
        let mut free: Vec<usize> = (0..self.queue.slots()).collect();
        let mut claims = job.plan.worker();
        let mut writes = 0usize;
        let mut exhausted = false;
        // Chunk number of each slot's DMA.
        let mut chunk_of: Vec<usize> = vec![0; self.queue.slots()];
        let mut resumed: HashMap<u64, usize> = HashMap::new();
        loop {
            while !exhausted && !abort.load(Ordering::Relaxed) && !free.is_empty() {
                match claims.next() {
                    Some((k, c)) => {
                        let slot = free.pop().ok_or_else(no_slot)?;
                        let buf = self.queue.buffer_mut(slot)?;
                        if c.is_partial() {
                            // A partial edge block keeps what the file holds there.
                            buf[..c.io_len].fill(0);
                            if c.io_start < job.old_lens[c.file] {
                                job.files[c.file].read_at(c.io_start, &mut buf[..c.io_len])?;
                            }
                        }
                        let buf = self.queue.take(slot)?;
                        let off = job.src_offset + c.dev_off;
                        chunk_of[slot] = k;
                        dmas.push_back((
                            slot,
                            self.stream.download_async(
                                job.src,
                                off,
                                buf,
                                c.head..c.head + c.len,
                            )?,
                        ));
                    }
                    None => exhausted = true,
                }
            }
            // The oldest DMA done: write its slot out.
            if let Some((slot, f)) = dmas.pop_front() {
                let buf = f.wait()?;
                let k = chunk_of[slot];
                let c = job.plan.chunk(k).ok_or_else(no_chunk)?;
                job.plan.checksum(k, &buf[c.head..c.head + c.len]);
                self.queue.put(slot, buf)?;
                let id = *ids.get(c.file).ok_or_else(no_file)?;
                self.queue
                    .write(id, c.io_start, slot, 0..c.io_len, k as u64)?;
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
                let c = job.plan.chunk(k).ok_or_else(no_chunk)?;
                let file = job.files[c.file];
                let written = job.written.load(Ordering::Relaxed);
                let from = resumed.remove(&done.tag).unwrap_or(0);
                // Wanted bytes among the first `n` of the IO.
                let landed = |n: usize| n.saturating_sub(c.head).min(c.len);
                match done.result {
                    Ok(n) if from + n == c.io_len => {
                        free.push(slot);
                        job.written.fetch_add(c.len, Ordering::Relaxed);
                        if job.writeback {
                            file.start_writeback(c.io_start, c.io_len as u64)?;
                        }
                    }
                    Ok(0) => {
                        return Err(file.no_space(c.start(), c.len, written + landed(from)));
                    }
                    Ok(n) => {
                        // A short write continues; a full disk shows on the next attempt.
                        let at = from + n;
                        let id = *ids.get(c.file).ok_or_else(no_file)?;
                        self.queue.write(
                            id,
                            c.io_start + at as u64,
                            slot,
                            at..c.io_len,
                            done.tag,
                        )?;
                        resumed.insert(done.tag, at);
                        writes += 1;
                    }
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => {
                        return Err(file.no_space(c.start(), c.len, written + landed(from)));
                    }
                    Err(e) => return Err(file.io("write", c.io_start, e)),
                }
            }
        }
    }
}

/// Where to resume a read that stopped at `got` bytes of its IO, having started at `from`:
/// at `got` rounded down to the file's alignment, or `None` (the end of the file) when that
/// makes no progress.
fn resume_at(from: usize, got: usize, align: usize) -> Option<usize> {
    let at = got / align * align;
    (at > from).then_some(at)
}

fn no_slot() -> LocalIoError {
    LocalIoError::Internal("a staging slot went missing".into())
}

fn no_chunk() -> LocalIoError {
    LocalIoError::Internal("a completion names no chunk of the transfer".into())
}

fn no_file() -> LocalIoError {
    LocalIoError::Internal("a chunk names no file of the transfer".into())
}
