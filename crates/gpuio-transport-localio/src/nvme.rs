//! NVMe namespaces as LocalIO block devices (`nvme://0000:00:04.0/1`), driven by gpuio's own
//! user-space driver instead of the kernel's: the controller bound to `vfio-pci` or to the
//! kernel module, opened once per process and shared by every namespace opened on it.
//!
//! Byte ranges become whole blocks here: a read moves the blocks that cover it through a DMA
//! bounce buffer; a write whose edges fall inside blocks reads those blocks first and writes
//! them back whole (read-modify-write), exclusively, so that two writes of different bytes of
//! one block cannot undo each other; aligned writes run side by side. Each IO takes a lane —
//! an I/O queue pair and its bounce buffer — from a small pool, so that several threads drive
//! the controller at once.

use crate::plan::Piece;
use crate::{Durability, FileHandle, IoEngine, LocalIo, LocalIoError, Result, Transfer};
use gpuio_hal::sync::{CondvarExt, MutexExt, RwLockExt};
use gpuio_hal::{DeviceBuffer, HostBuffer};
use gpuio_nvme::{Controller, ControllerOptions, DmaBuffer, IoQueuePair, Namespace};
use gpuio_staging::LANE_WAIT;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};

/// Lanes (queue pairs) per open namespace.
const LANES: usize = 4;
/// Bytes one lane moves per round of commands.
const BOUNCE: usize = 1 << 20;
/// Entries per lane's queues.
const DEPTH: u16 = 64;

/// Controllers this process has opened, by PCI address: a controller is reset when opened, so
/// a second open of the same one (another namespace, another handle) must share the first.
static CONTROLLERS: Mutex<Vec<(String, Weak<Controller>)>> = Mutex::new(Vec::new());

/// Each namespace's edge lock, by (controller, nsid): every handle on one namespace must take
/// the same one, however it was opened. A live lock keeps its controller alive (its holders
/// own the controller), so the controller's address is not reused while its entry counts.
type EdgeKey = (usize, u32);
static EDGES: Mutex<Vec<(EdgeKey, Weak<RwLock<()>>)>> = Mutex::new(Vec::new());

fn edge_lock(controller: &Arc<Controller>, nsid: u32) -> Arc<RwLock<()>> {
    let key = (Arc::as_ptr(controller) as usize, nsid);
    let mut all = EDGES.lock_unpoisoned();
    all.retain(|(_, l)| l.strong_count() > 0);
    if let Some(l) = all
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, l)| l.upgrade())
    {
        return l;
    }
    let l = Arc::new(RwLock::new(()));
    all.push((key, Arc::downgrade(&l)));
    l
}

/// One namespace of an NVMe controller driven by gpuio's driver, as a block device of fixed
/// size.
pub struct NvmeDevice {
    // Field order is drop order: the lanes' queue pairs are deleted before the controller
    // handle goes.
    lanes: Mutex<Lanes>,
    lane_freed: Condvar,
    /// The namespace's edge lock: held exclusively by writes with partial blocks, shared by
    /// the rest, across every handle on the namespace.
    edges: Arc<RwLock<()>>,
    controller: Arc<Controller>,
    ns: Namespace,
    name: String,
}

struct Lanes {
    idle: Vec<Lane>,
    made: usize,
}

struct Lane {
    qp: IoQueuePair,
    bounce: DmaBuffer,
}

impl fmt::Debug for NvmeDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvmeDevice")
            .field("name", &self.name)
            .field("namespace", &self.ns)
            .finish()
    }
}

impl NvmeDevice {
    /// Namespace `nsid` of the controller at PCI address `address`, opened through the driver
    /// it is bound to (the controller is brought up on first use in this process).
    pub fn open(address: &str, nsid: u32) -> Result<Self> {
        let address = gpuio_nvme::full_address(address)?;
        let controller = {
            let mut open = CONTROLLERS.lock_unpoisoned();
            open.retain(|(_, c)| c.strong_count() > 0);
            match open
                .iter()
                .find_map(|(a, c)| (*a == address).then(|| c.upgrade()))
            {
                Some(Some(c)) => c,
                _ => {
                    let c = Arc::new(gpuio_nvme::open(&address, ControllerOptions::default())?);
                    open.push((address.clone(), Arc::downgrade(&c)));
                    c
                }
            }
        };
        Self::on(controller, nsid, format!("nvme://{address}/{nsid}"))
    }

    /// Namespace `nsid` of a controller the caller brought up (the software controller, say),
    /// shown as `name`.
    pub fn on(controller: Arc<Controller>, nsid: u32, name: String) -> Result<Self> {
        if !controller.namespaces().contains(&nsid) {
            return Err(LocalIoError::Hal(gpuio_hal::HalError::InvalidArgument(
                format!(
                    "{name}: the controller has no active namespace {nsid} (it has {:?})",
                    controller.namespaces()
                ),
            )));
        }
        let ns = controller.namespace(nsid)?;
        Ok(Self {
            lanes: Mutex::new(Lanes {
                idle: Vec::new(),
                made: 0,
            }),
            lane_freed: Condvar::new(),
            edges: edge_lock(&controller, nsid),
            controller,
            ns,
            name,
        })
    }

    /// How it is shown: `nvme://<address>/<nsid>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's identifier and format.
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        // Saturating: a controller's Identify data is not trusted to multiply.
        self.ns.identity.blocks.saturating_mul(self.block() as u64)
    }

    /// Whether it has no blocks (never, for an active namespace).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether both are the same namespace of the same controller.
    pub fn same_namespace(&self, other: &NvmeDevice) -> bool {
        Arc::ptr_eq(&self.controller, &other.controller) && self.ns.nsid == other.ns.nsid
    }

    fn block(&self) -> usize {
        self.ns.identity.block_size as usize
    }

    /// Reads into `buf` from `offset` until it is full or the namespace ends; the bytes read.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let want = usize::try_from(self.len().saturating_sub(offset))
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let block = self.block();
        self.with_lane(|lane| {
            let mut done = 0;
            while done < want {
                let at = offset + done as u64;
                let head = (at % block as u64) as usize;
                let n = (want - done).min(BOUNCE - head);
                let span = (head + n).next_multiple_of(block);
                lane.qp
                    .read(&self.ns, at / block as u64, &lane.bounce, 0, span)?;
                lane.bounce.read(head, &mut buf[done..done + n])?;
                done += n;
            }
            Ok(want)
        })
    }

    /// Writes all of `buf` at `offset`. A write that would run past the namespace's end is
    /// refused whole ([`LocalIoError::NoSpace`], nothing written).
    pub fn write_at(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > self.len()) {
            return Err(LocalIoError::NoSpace {
                path: self.name.clone().into(),
                offset,
                wanted: buf.len(),
                written: 0,
            });
        }
        let block = self.block() as u64;
        let partial = !offset.is_multiple_of(block) || !(buf.len() as u64).is_multiple_of(block);
        let (_exclusive, _shared) = if partial {
            (Some(self.edges.write_unpoisoned()), None)
        } else {
            (None, Some(self.edges.read_unpoisoned()))
        };
        let block = block as usize;
        self.with_lane(|lane| {
            let mut done = 0;
            while done < buf.len() {
                let at = offset + done as u64;
                let lba = at / block as u64;
                let head = (at % block as u64) as usize;
                let n = (buf.len() - done).min(BOUNCE - head);
                let span = (head + n).next_multiple_of(block);
                // Partial blocks at either edge keep the bytes around the write.
                if head != 0 {
                    lane.qp.read(&self.ns, lba, &lane.bounce, 0, block)?;
                }
                if !(head + n).is_multiple_of(block) {
                    let last = span - block;
                    let last_lba = lba + (last / block) as u64;
                    if last != 0 || head == 0 {
                        lane.qp
                            .read(&self.ns, last_lba, &lane.bounce, last, block)?;
                    }
                }
                lane.bounce.write(head, &buf[done..done + n])?;
                lane.qp.write(&self.ns, lba, &lane.bounce, 0, span)?;
                done += n;
            }
            Ok(())
        })
    }

    /// Makes completed writes durable (NVMe FLUSH).
    pub fn flush(&self) -> Result<()> {
        self.with_lane(|lane| Ok(lane.qp.flush(&self.ns)?))
    }

    /// Runs `f` on an idle lane, making one while fewer than [`LANES`] exist, else waiting
    /// for one. A lane whose IO failed is dropped (its queues deleted) rather than reused.
    fn with_lane<T>(&self, f: impl FnOnce(&mut Lane) -> Result<T>) -> Result<T> {
        let mut lane = {
            let mut lanes = self.lanes.lock_unpoisoned();
            loop {
                if let Some(l) = lanes.idle.pop() {
                    break l;
                }
                if lanes.made < LANES {
                    lanes.made += 1;
                    drop(lanes);
                    match self.new_lane() {
                        Ok(l) => break l,
                        Err(e) => {
                            self.lanes.lock_unpoisoned().made -= 1;
                            self.lane_freed.notify_one();
                            return Err(e);
                        }
                    }
                }
                lanes = self.lane_freed.wait_unpoisoned(lanes);
            }
        };
        // Counted as made until it is back or given up, a panic in `f` included.
        let mut guard = LaneGuard {
            device: self,
            lane: None,
        };
        let result = f(&mut lane);
        if result.is_ok() {
            guard.lane = Some(lane);
        }
        drop(guard);
        result
    }

    fn new_lane(&self) -> Result<Lane> {
        let depth = DEPTH.min(self.controller.cap().max_queue_entries.min(u16::MAX as u32) as u16);
        Ok(Lane {
            qp: self.controller.io_queue_pair(depth)?,
            bounce: self.controller.dma_buffer(BOUNCE)?,
        })
    }
}

/// Hands a lane back to the idle ones (or, where its IO failed or panicked, gives up its
/// count) and wakes a waiter.
struct LaneGuard<'a> {
    device: &'a NvmeDevice,
    lane: Option<Lane>,
}

impl Drop for LaneGuard<'_> {
    fn drop(&mut self) {
        let mut lanes = self.device.lanes.lock_unpoisoned();
        match self.lane.take() {
            Some(l) => lanes.idle.push(l),
            None => lanes.made -= 1,
        }
        drop(lanes);
        self.device.lane_freed.notify_one();
    }
}

impl LocalIo {
    /// GPU transfers of namespaces gpuio's driver serves: each piece moves through a pinned
    /// host buffer (the driver's DMA memory is not the GPU's), a chunk at a time. The lanes,
    /// cuFile and the page cache all need a kernel file, which these namespaces have none of.
    pub(crate) fn nvme_read_pieces(
        &self,
        files: &[&FileHandle],
        pieces: &[Piece],
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<Transfer> {
        let stream = dst.gpu().stream()?;
        self.nvme_staged(pieces, dst.gpu(), |host, p, done| {
            files[p.file].read_exact_at(p.offset + done, host)?;
            Ok(stream.upload(host, dst, dst_offset + (p.dev_off + done) as usize)?)
        })
    }

    /// GPU memory to namespaces gpuio's driver serves, through a pinned host buffer; FLUSHed
    /// when durability asks.
    pub(crate) fn nvme_write_pieces(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        files: &[&FileHandle],
        pieces: &[Piece],
        durability: Durability,
    ) -> Result<Transfer> {
        let stream = src.gpu().stream()?;
        let t = self.nvme_staged(pieces, src.gpu(), |host, p, done| {
            stream.download(src, src_offset + (p.dev_off + done) as usize, host)?;
            files[p.file].write_all_at(p.offset + done, host)
        })?;
        if durability == Durability::DataSync {
            for file in files {
                file.sync_data()?;
            }
        }
        Ok(t)
    }

    /// Runs `chunk` over `pieces` a piece at a time in chunks of one staging buffer (leased
    /// from the staging pool, pinned for `gpu`), with each chunk's bytes in the buffer after
    /// the call (a read) or before it (a write); their crc32c in device order when checksums
    /// are on.
    fn nvme_staged(
        &self,
        pieces: &[Piece],
        gpu: &gpuio_hal::Gpu,
        mut chunk: impl FnMut(&mut [u8], &Piece, u64) -> Result<()>,
    ) -> Result<Transfer> {
        let total: u64 = pieces.iter().map(|p| p.len).sum();
        let len = total.clamp(1, BOUNCE as u64) as usize;
        let (mut bufs, lease) = self.staging.lease_for(gpu, len, 1, LANE_WAIT)?;
        let mut crc = self.config.checksum.then_some(0u32);
        let mut run = |host: &mut HostBuffer| -> Result<()> {
            for p in pieces {
                let mut done = 0;
                while done < p.len {
                    let n = (p.len - done).min(len as u64) as usize;
                    chunk(&mut host[..n], p, done)?;
                    crc = crc.map(|c| crc32c::crc32c_append(c, &host[..n]));
                    done += n as u64;
                }
            }
            Ok(())
        };
        let result = match bufs.first_mut() {
            Some(host) => run(host),
            None => Err(LocalIoError::Internal(
                "the staging pool leased no buffer".into(),
            )),
        };
        lease.give_back(bufs);
        result?;
        Ok(Transfer {
            bytes: total,
            engine: IoEngine::Nvme,
            lanes: 1,
            crc32c: crc,
            page_cache_bytes: 0,
        })
    }
}
