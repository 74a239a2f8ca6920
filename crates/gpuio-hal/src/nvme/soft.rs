//! A software NVMe controller: a host thread that serves the NVMe queue protocol from host
//! memory, as a device would, so the driver (and later GPU threads) can be tested where no
//! NVMe is reachable. Its register page (CAP, CC, CSTS, AQA, ASQ, ACQ and the doorbells) is
//! host memory the driver maps as its BAR0; it reaches queue and data memory only through the
//! IO addresses its [`SoftMapper`] handed out, so an unmapped address is a data transfer
//! error, as under an IOMMU. Namespaces live in RAM.
//!
//! Faults can be injected ([`SoftFaults`]): bad blocks, completions held back and posted in
//! reverse order, late completions, a controller that stops answering, and a fatal status.

use super::dma::{DmaMapper, DmaMemory, IovaSpace, Mmio};
use super::prp;
use super::spec::{Cap, Cqe, PAGE, Sqe, Status, admin, cc, csts, doorbell, io, reg};
use crate::error::{HalError, Result};
use crate::sync::MutexExt;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// I/O queue pairs the software controller has doorbells for.
pub const SOFT_QUEUES: u16 = 64;

/// Faults the software controller injects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SoftFaults {
    /// Reads touching these blocks of these namespaces fail with "unrecovered read error".
    pub bad_blocks: Vec<(u32, Range<u64>)>,
    /// Completions held back and posted in reverse order, up to this many at a time.
    pub reorder: usize,
    /// How late each completion is posted.
    pub delay: Duration,
    /// I/O queues are no longer served (a hung controller; admin commands still are).
    pub hang: bool,
    /// The controller reports a fatal status after serving this many more commands.
    pub fatal_after: Option<u64>,
}

/// How the software controller is built.
#[derive(Clone, Debug)]
pub struct SoftConfig {
    /// Each namespace's size in blocks (namespace 1 first).
    pub namespaces: Vec<u64>,
    /// The block size, 512 to 65536 bytes.
    pub block_size: u32,
    /// Maximum data transfer size as 2^n pages (0: no limit).
    pub mdts: u8,
    /// Maximum entries per queue.
    pub max_queue_entries: u32,
}

impl Default for SoftConfig {
    fn default() -> Self {
        Self {
            namespaces: vec![16384],
            block_size: 512,
            mdts: 5,
            max_queue_entries: 1024,
        }
    }
}

/// IO addresses for the software controller: a table from IO address to host memory, which
/// its thread consults (holding the table) for every access.
#[derive(Debug)]
pub struct SoftMapper {
    space: IovaSpace,
    table: Mutex<BTreeMap<u64, (usize, usize)>>,
}

impl DmaMapper for SoftMapper {
    fn map(&self, mem: &DmaMemory) -> Result<u64> {
        let iova = self.space.take(mem.len())?;
        self.table
            .lock_unpoisoned()
            .insert(iova, (mem.addr(0) as usize, mem.len()));
        Ok(iova)
    }

    fn unmap(&self, iova: u64, _len: usize) {
        self.table.lock_unpoisoned().remove(&iova);
    }
}

impl SoftMapper {
    fn new() -> Self {
        Self {
            space: IovaSpace::new(0x10_0000, 1 << 39),
            table: Mutex::new(BTreeMap::new()),
        }
    }

    /// Copies between `len` bytes at IO address `iova` and `host` (`to_device`: host → IO
    /// memory). False where the range is not inside one mapping.
    fn copy(&self, iova: u64, host: *mut u8, len: usize, to_device: bool) -> bool {
        let table = self.table.lock_unpoisoned();
        let Some((&base, &(addr, size))) = table.range(..=iova).next_back() else {
            return false;
        };
        let off = (iova - base) as usize;
        if off.checked_add(len).is_none_or(|end| end > size) {
            return false;
        }
        let at = (addr + off) as *mut u8;
        // SAFETY: [at, at+len) lies inside a live DmaMemory mapping: entries leave the table
        // (under this lock, held here) before their memory is unmapped. `host` is the
        // caller's own buffer of `len` bytes, which is never DMA memory.
        unsafe {
            if to_device {
                std::ptr::copy_nonoverlapping(host, at, len);
            } else {
                std::ptr::copy_nonoverlapping(at, host, len);
            }
        }
        true
    }

    fn read_into(&self, iova: u64, out: &mut [u8]) -> bool {
        self.copy(iova, out.as_mut_ptr(), out.len(), false)
    }

    fn write_from(&self, iova: u64, data: &[u8]) -> bool {
        self.copy(iova, data.as_ptr().cast_mut(), data.len(), true)
    }
}

struct State {
    stop: AtomicBool,
    faults: Mutex<SoftFaults>,
    namespaces: Mutex<Vec<Vec<u8>>>,
    served: AtomicU64,
}

/// The software controller; its thread stops when this is dropped.
pub struct SoftController {
    regs: Arc<DmaMemory>,
    mapper: Arc<SoftMapper>,
    state: Arc<State>,
    thread: Option<JoinHandle<()>>,
}

impl SoftController {
    /// Starts a controller with zeroed namespaces.
    pub fn start(config: SoftConfig) -> Result<Self> {
        if !(9..=16).contains(&config.block_size.trailing_zeros())
            || !config.block_size.is_power_of_two()
            || !(2..=4096).contains(&config.max_queue_entries)
        {
            return Err(HalError::InvalidArgument(format!(
                "software NVMe controller: block size {} or queue size {} out of range",
                config.block_size, config.max_queue_entries
            )));
        }
        let mut namespaces = Vec::new();
        for blocks in &config.namespaces {
            let bytes = blocks
                .checked_mul(config.block_size as u64)
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| HalError::InvalidArgument("namespace too large".into()))?;
            crate::memory::backing::check(bytes, true)?;
            namespaces.push(vec![0u8; bytes]);
        }
        let regs = Arc::new(DmaMemory::new(doorbell(SOFT_QUEUES, true, 0) + 4)?);
        let cap = Cap {
            max_queue_entries: config.max_queue_entries,
            contiguous_queues: true,
            timeout: Duration::from_millis(2000),
            dstrd: 0,
            nvm_command_set: true,
            mpsmin: 0,
            mpsmax: 0,
        };
        regs.store(reg::CAP, cap.to_raw())?;
        regs.store(reg::VS, 0x0001_0400u32)?;
        let mapper = Arc::new(SoftMapper::new());
        let state = Arc::new(State {
            stop: AtomicBool::new(false),
            faults: Mutex::new(SoftFaults::default()),
            namespaces: Mutex::new(namespaces),
            served: AtomicU64::new(0),
        });
        let mut device = Device {
            regs: regs.clone(),
            mapper: mapper.clone(),
            state: state.clone(),
            config,
            enabled: false,
            sqs: BTreeMap::new(),
            cqs: BTreeMap::new(),
            fatal: false,
        };
        let thread = std::thread::Builder::new()
            .name("gpuio-soft-nvme".into())
            .spawn(move || device.serve())
            .map_err(|source| HalError::Os {
                op: "spawn the software NVMe controller",
                source,
            })?;
        Ok(Self {
            regs,
            mapper,
            state,
            thread: Some(thread),
        })
    }

    /// Its register file, as the driver maps a BAR0.
    pub fn registers(&self) -> Mmio {
        Mmio::over(self.regs.clone())
    }

    /// Its DMA mapper.
    pub fn mapper(&self) -> Arc<dyn DmaMapper> {
        self.mapper.clone()
    }

    /// Replaces the injected faults.
    pub fn set_faults(&self, faults: SoftFaults) {
        *self.state.faults.lock_unpoisoned() = faults;
    }

    /// Commands served so far (admin and I/O).
    pub fn served(&self) -> u64 {
        self.state.served.load(Ordering::Relaxed)
    }

    /// Fills namespace `nsid` with the data pattern of `seed` (byte `i` of the namespace is
    /// pattern byte `i`).
    pub fn fill_pattern(&self, nsid: u32, seed: u64) -> Result<()> {
        let mut namespaces = self.state.namespaces.lock_unpoisoned();
        let ns = (nsid as usize)
            .checked_sub(1)
            .and_then(|i| namespaces.get_mut(i))
            .ok_or_else(|| HalError::InvalidArgument(format!("no namespace {nsid}")))?;
        crate::pattern::fill(ns, 0, seed);
        Ok(())
    }

    /// A copy of namespace `nsid`'s bytes (`None`: no such namespace).
    pub fn namespace_bytes(&self, nsid: u32) -> Option<Vec<u8>> {
        let namespaces = self.state.namespaces.lock_unpoisoned();
        namespaces.get((nsid as usize).checked_sub(1)?).cloned()
    }
}

impl Drop for SoftController {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct SoftSq {
    base: u64,
    size: u16,
    head: u16,
    cqid: u16,
}

struct SoftCq {
    base: u64,
    size: u16,
    tail: u16,
    phase: bool,
    /// Completions held back (reordering).
    held: Vec<Cqe>,
}

/// The controller's side: owned by its thread.
struct Device {
    regs: Arc<DmaMemory>,
    mapper: Arc<SoftMapper>,
    state: Arc<State>,
    config: SoftConfig,
    enabled: bool,
    sqs: BTreeMap<u16, SoftSq>,
    cqs: BTreeMap<u16, SoftCq>,
    fatal: bool,
}

impl Device {
    fn reg(&self, offset: usize) -> u32 {
        self.regs.load(offset).unwrap_or(u32::MAX)
    }

    fn set_reg(&self, offset: usize, value: u32) {
        let _ = self.regs.store(offset, value);
    }

    fn serve(&mut self) {
        let mut idle = 0u32;
        while !self.state.stop.load(Ordering::Relaxed) {
            let cc = self.reg(reg::CC);
            if cc & cc::EN != 0 && !self.enabled {
                self.enable();
            } else if cc & cc::EN == 0 && self.enabled {
                self.reset();
            }
            let worked = self.enabled && !self.fatal && self.poll_queues();
            if worked {
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
                if idle > 256 {
                    std::thread::sleep(Duration::from_micros(50));
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }

    /// A controller reset: queues deleted, doorbells cleared, then CSTS.RDY cleared.
    fn reset(&mut self) {
        self.sqs.clear();
        self.cqs.clear();
        for qid in 0..=SOFT_QUEUES {
            self.set_reg(doorbell(qid, false, 0), 0);
            self.set_reg(doorbell(qid, true, 0), 0);
        }
        self.enabled = false;
        self.fatal = false;
        self.set_reg(reg::CSTS, 0);
    }

    fn enable(&mut self) {
        let aqa = self.reg(reg::AQA);
        let asq = self.reg(reg::ASQ) as u64 | (self.reg(reg::ASQ + 4) as u64) << 32;
        let acq = self.reg(reg::ACQ) as u64 | (self.reg(reg::ACQ + 4) as u64) << 32;
        let (sq_size, cq_size) = ((aqa & 0xfff) as u16 + 1, (aqa >> 16 & 0xfff) as u16 + 1);
        if sq_size < 2
            || cq_size < 2
            || !asq.is_multiple_of(PAGE as u64)
            || !acq.is_multiple_of(PAGE as u64)
        {
            self.set_reg(reg::CSTS, csts::RDY | csts::CFS);
            self.fatal = true;
        } else {
            self.set_reg(doorbell(0, false, 0), 0);
            self.set_reg(doorbell(0, true, 0), 0);
            self.cqs.insert(0, SoftCq::new(acq, cq_size));
            self.sqs.insert(0, SoftSq::new(asq, sq_size, 0));
            self.set_reg(reg::CSTS, csts::RDY);
        }
        self.enabled = true;
    }

    /// Serves every submission queue once; whether anything was done.
    fn poll_queues(&mut self) -> bool {
        let faults = self.state.faults.lock_unpoisoned().clone();
        let qids: Vec<u16> = self.sqs.keys().copied().collect();
        let mut worked = false;
        for qid in qids {
            if qid != 0 && faults.hang {
                continue;
            }
            worked |= self.serve_queue(qid, &faults);
            if self.fatal {
                break;
            }
        }
        worked
    }

    fn serve_queue(&mut self, qid: u16, faults: &SoftFaults) -> bool {
        let tail = self.reg(doorbell(qid, false, 0));
        let Some(sq) = self.sqs.get(&qid) else {
            return false;
        };
        if tail >= sq.size as u32 {
            // An invalid doorbell write is a fatal error for a real controller too.
            return self.go_fatal();
        }
        let (tail, cqid) = (tail as u16, sq.cqid);
        let mut worked = false;
        while self.sqs.get(&qid).is_some_and(|sq| sq.head != tail) {
            if !self.cq_has_room(cqid) {
                break;
            }
            let sq = &self.sqs[&qid];
            let mut raw = [0u8; size_of::<Sqe>()];
            if !self
                .mapper
                .read_into(sq.base + sq.head as u64 * raw.len() as u64, &mut raw)
            {
                return self.go_fatal();
            }
            let sqe = sqe_from_bytes(&raw);
            let sq = self.sqs.get_mut(&qid).expect("present above");
            sq.head = (sq.head + 1) % sq.size;
            let head = sq.head;
            let (status, result) = if qid == 0 {
                self.admin(&sqe)
            } else {
                (self.io(&sqe, faults), 0)
            };
            let cqe = Cqe {
                result,
                rsvd: 0,
                sq_head: head,
                sq_id: qid,
                cid: sqe.cid(),
                status: status.0 << 1,
            };
            self.complete(cqid, cqe, faults);
            worked = true;
            let served = self.state.served.fetch_add(1, Ordering::Relaxed) + 1;
            if faults.fatal_after.is_some_and(|n| served >= n) {
                return self.go_fatal();
            }
        }
        // Post what reordering holds once the queue runs dry.
        if let Some(cq) = self.cqs.get_mut(&cqid)
            && !cq.held.is_empty()
        {
            let held = std::mem::take(&mut cq.held);
            for cqe in held.into_iter().rev() {
                self.post(cqid, cqe, faults);
            }
        }
        worked
    }

    fn go_fatal(&mut self) -> bool {
        self.fatal = true;
        self.set_reg(reg::CSTS, csts::RDY | csts::CFS);
        true
    }

    /// Whether completion queue `cqid` has room for one more entry (counting held ones).
    fn cq_has_room(&self, cqid: u16) -> bool {
        let Some(cq) = self.cqs.get(&cqid) else {
            return false;
        };
        let (size, head) = (cq.size as u32, self.reg(doorbell(cqid, true, 0)));
        let used = (cq.tail as u32 + size - head % size) % size + cq.held.len() as u32;
        used + 1 < size
    }

    fn complete(&mut self, cqid: u16, cqe: Cqe, faults: &SoftFaults) {
        if faults.reorder > 1 {
            let Some(cq) = self.cqs.get_mut(&cqid) else {
                return;
            };
            cq.held.push(cqe);
            if cq.held.len() >= faults.reorder {
                let held = std::mem::take(&mut cq.held);
                for cqe in held.into_iter().rev() {
                    self.post(cqid, cqe, faults);
                }
            }
        } else {
            self.post(cqid, cqe, faults);
        }
    }

    /// Writes a completion: its body, then (after a release fence) its status and phase.
    fn post(&mut self, cqid: u16, mut cqe: Cqe, faults: &SoftFaults) {
        if !faults.delay.is_zero() {
            std::thread::sleep(faults.delay);
        }
        let Some(cq) = self.cqs.get_mut(&cqid) else {
            return;
        };
        let at = cq.base + cq.tail as u64 * size_of::<Cqe>() as u64;
        cqe.status |= cq.phase as u16;
        let bytes = cqe_to_bytes(&cqe);
        cq.tail = (cq.tail + 1) % cq.size;
        if cq.tail == 0 {
            cq.phase = !cq.phase;
        }
        let body = self.mapper.write_from(at, &bytes[..14]);
        fence(Ordering::Release);
        if !body || !self.mapper.write_from(at + 14, &bytes[14..]) {
            self.go_fatal();
        }
    }

    fn admin(&mut self, sqe: &Sqe) -> (Status, u32) {
        let qid = sqe.cdw10 as u16;
        let size = (sqe.cdw10 >> 16) + 1;
        let bad_size = size < 2 || size > self.config.max_queue_entries;
        match sqe.opcode() {
            admin::IDENTIFY => (self.identify(sqe), 0),
            admin::CREATE_CQ => {
                if qid == 0 || qid > SOFT_QUEUES || self.cqs.contains_key(&qid) {
                    (Status::INVALID_QUEUE_ID, 0)
                } else if bad_size {
                    (Status::INVALID_QUEUE_SIZE, 0)
                } else if sqe.cdw11 & 1 == 0 || !sqe.prp1.is_multiple_of(PAGE as u64) {
                    (Status::INVALID_FIELD, 0)
                } else {
                    // A new queue starts at 0, whatever its doorbell was written to before.
                    self.set_reg(doorbell(qid, true, 0), 0);
                    self.cqs.insert(qid, SoftCq::new(sqe.prp1, size as u16));
                    (Status::SUCCESS, 0)
                }
            }
            admin::CREATE_SQ => {
                let cqid = (sqe.cdw11 >> 16) as u16;
                if qid == 0 || qid > SOFT_QUEUES || self.sqs.contains_key(&qid) {
                    (Status::INVALID_QUEUE_ID, 0)
                } else if bad_size {
                    (Status::INVALID_QUEUE_SIZE, 0)
                } else if cqid == 0 || !self.cqs.contains_key(&cqid) {
                    (Status::INVALID_CQ, 0)
                } else if sqe.cdw11 & 1 == 0 || !sqe.prp1.is_multiple_of(PAGE as u64) {
                    (Status::INVALID_FIELD, 0)
                } else {
                    self.set_reg(doorbell(qid, false, 0), 0);
                    self.sqs
                        .insert(qid, SoftSq::new(sqe.prp1, size as u16, cqid));
                    (Status::SUCCESS, 0)
                }
            }
            admin::DELETE_SQ if qid != 0 && self.sqs.remove(&qid).is_some() => {
                self.set_reg(doorbell(qid, false, 0), 0);
                (Status::SUCCESS, 0)
            }
            admin::DELETE_CQ if qid != 0 && self.cqs.contains_key(&qid) => {
                if self.sqs.values().any(|sq| sq.cqid == qid) {
                    (Status::specific(0x0c), 0) // invalid queue deletion
                } else {
                    self.cqs.remove(&qid);
                    self.set_reg(doorbell(qid, true, 0), 0);
                    (Status::SUCCESS, 0)
                }
            }
            admin::DELETE_SQ | admin::DELETE_CQ => (Status::INVALID_QUEUE_ID, 0),
            _ => (Status::INVALID_OPCODE, 0),
        }
    }

    fn identify(&mut self, sqe: &Sqe) -> Status {
        let count = self.config.namespaces.len() as u32;
        let mut data = [0u8; PAGE];
        match sqe.cdw10 & 0xff {
            admin::CNS_CONTROLLER => {
                data[0..2].copy_from_slice(&0x1d1du16.to_le_bytes());
                put_text(&mut data[4..24], "gpuio-soft-0001");
                put_text(&mut data[24..64], "gpuio software NVMe controller");
                put_text(&mut data[64..72], "1.0");
                data[77] = self.config.mdts;
                data[516..520].copy_from_slice(&count.to_le_bytes());
            }
            admin::CNS_NAMESPACE => {
                if sqe.nsid == 0 || sqe.nsid > count {
                    return Status::INVALID_NAMESPACE;
                }
                let blocks = self.config.namespaces[sqe.nsid as usize - 1];
                for at in [0, 8, 16] {
                    data[at..at + 8].copy_from_slice(&blocks.to_le_bytes());
                }
                data[128 + 2] = self.config.block_size.trailing_zeros() as u8;
            }
            admin::CNS_ACTIVE_NAMESPACES => {
                for (i, nsid) in (sqe.nsid + 1..=count).take(1024).enumerate() {
                    data[4 * i..4 * i + 4].copy_from_slice(&nsid.to_le_bytes());
                }
            }
            _ => return Status::INVALID_FIELD,
        }
        self.transfer(sqe, &mut data, true)
    }

    fn io(&mut self, sqe: &Sqe, faults: &SoftFaults) -> Status {
        let count = self.config.namespaces.len() as u32;
        if sqe.nsid == 0 || sqe.nsid > count {
            return Status::INVALID_NAMESPACE;
        }
        match sqe.opcode() {
            io::FLUSH => Status::SUCCESS,
            op @ (io::READ | io::WRITE) => {
                let blocks = self.config.namespaces[sqe.nsid as usize - 1];
                let (lba, n) = (sqe.lba(), sqe.blocks() as u64);
                if lba.checked_add(n).is_none_or(|end| end > blocks) {
                    return Status::LBA_OUT_OF_RANGE;
                }
                let read = op == io::READ;
                if read
                    && faults
                        .bad_blocks
                        .iter()
                        .any(|(ns, r)| *ns == sqe.nsid && r.start < lba + n && lba < r.end)
                {
                    return Status::UNRECOVERED_READ;
                }
                let bs = self.config.block_size as usize;
                let (from, len) = (lba as usize * bs, n as usize * bs);
                let state = self.state.clone();
                let mut namespaces = state.namespaces.lock_unpoisoned();
                let bytes = &mut namespaces[sqe.nsid as usize - 1][from..from + len];
                self.transfer(sqe, bytes, read)
            }
            _ => Status::INVALID_OPCODE,
        }
    }

    /// Moves `host` to (`to_device`) or from the memory the command's PRPs name.
    fn transfer(&self, sqe: &Sqe, host: &mut [u8], to_device: bool) -> Status {
        if !sqe.prp1.is_multiple_of(4) {
            return Status::INVALID_PRP_OFFSET;
        }
        let pieces = prp::walk(sqe.prp1, sqe.prp2, host.len(), |at, n| {
            let mut raw = vec![0u8; 8 * n];
            self.mapper.read_into(at, &mut raw).then(|| {
                raw.chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect()
            })
        });
        let Some(pieces) = pieces else {
            return Status::DATA_TRANSFER_ERROR;
        };
        let mut done = 0;
        for (at, n) in pieces {
            let part = &mut host[done..done + n];
            let ok = if to_device {
                self.mapper.write_from(at, part)
            } else {
                self.mapper.read_into(at, part)
            };
            if !ok {
                return Status::DATA_TRANSFER_ERROR;
            }
            done += n;
        }
        Status::SUCCESS
    }
}

impl SoftSq {
    fn new(base: u64, size: u16, cqid: u16) -> Self {
        Self {
            base,
            size,
            head: 0,
            cqid,
        }
    }
}

impl SoftCq {
    fn new(base: u64, size: u16) -> Self {
        Self {
            base,
            size,
            tail: 0,
            phase: true,
            held: Vec::new(),
        }
    }
}

fn put_text(field: &mut [u8], text: &str) {
    field.fill(b' ');
    let n = text.len().min(field.len());
    field[..n].copy_from_slice(&text.as_bytes()[..n]);
}

fn sqe_from_bytes(raw: &[u8; 64]) -> Sqe {
    let d =
        |i: usize| u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]]);
    let q = |i: usize| d(i) as u64 | (d(i + 1) as u64) << 32;
    Sqe {
        cdw0: d(0),
        nsid: d(1),
        cdw2: d(2),
        cdw3: d(3),
        mptr: q(4),
        prp1: q(6),
        prp2: q(8),
        cdw10: d(10),
        cdw11: d(11),
        cdw12: d(12),
        cdw13: d(13),
        cdw14: d(14),
        cdw15: d(15),
    }
}

fn cqe_to_bytes(cqe: &Cqe) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&cqe.result.to_le_bytes());
    b[4..8].copy_from_slice(&cqe.rsvd.to_le_bytes());
    b[8..10].copy_from_slice(&cqe.sq_head.to_le_bytes());
    b[10..12].copy_from_slice(&cqe.sq_id.to_le_bytes());
    b[12..14].copy_from_slice(&cqe.cid.to_le_bytes());
    b[14..16].copy_from_slice(&cqe.status.to_le_bytes());
    b
}
