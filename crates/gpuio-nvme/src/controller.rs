//! The host's NVMe controller driver: reset and enable, the admin queue, Identify, I/O queue
//! pairs, and block reads and writes by polling. It drives any register file and DMA mapper:
//! a BAR0 under VFIO, or the software controller.
//!
//! A command that does not complete in time, or a controller that reports a fatal status,
//! disables the controller before the error returns, so no DMA can land in a buffer the
//! caller has taken back; every later command then fails with a typed error.

use super::dma::{DmaBuffer, DmaMapper, DmaTarget, Mmio};
use super::peer::PeerBuffer;
use super::queue::QueuePair;
use super::spec::{
    Cap, ControllerIdentity, NamespaceIdentity, PAGE, Sqe, Status, admin, cc, csts, io, reg,
};
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::sync::MutexExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Admin queue entries.
const ADMIN_DEPTH: u16 = 32;

/// How the driver brings a controller up.
#[derive(Clone, Copy, Debug)]
pub struct ControllerOptions {
    /// How long one command may take before the controller is disabled and the command fails.
    pub command_timeout: Duration,
}

impl Default for ControllerOptions {
    fn default() -> Self {
        Self {
            command_timeout: Duration::from_secs(10),
        }
    }
}

/// An enabled NVMe controller. Dropping the last handle (this, or an [`IoQueuePair`])
/// disables it.
pub struct Controller {
    shared: Arc<Shared>,
}

struct Shared {
    regs: Arc<Mmio>,
    mapper: Arc<dyn DmaMapper>,
    cap: Cap,
    identity: ControllerIdentity,
    namespaces: Vec<u32>,
    admin: Mutex<QueuePair>,
    /// I/O queue identifiers not in use.
    free_qids: Mutex<Vec<u16>>,
    options: ControllerOptions,
    /// The register file registered with GPUs (by ordinal), for their kernels' doorbells.
    gpu_registers: Mutex<Vec<(u32, RegisterPin)>>,
}

/// The register file registered with one GPU.
struct RegisterPin {
    // Field order is drop order: unregister, then let the mapping go.
    _pin: gpuio_hal::PinGuard,
    _owner: Arc<dyn std::any::Any + Send + Sync>,
    addr: u64,
}

/// One namespace: its identifier and format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Namespace {
    /// The namespace identifier (from 1).
    pub nsid: u32,
    /// Its size and block format.
    pub identity: NamespaceIdentity,
}

/// One block transfer between a namespace and a DMA buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockIo {
    /// A write to the namespace (else a read from it).
    pub write: bool,
    /// The first logical block.
    pub lba: u64,
    /// Where in the buffer (a multiple of 4 bytes).
    pub offset: usize,
    /// Bytes (a multiple of the namespace's block size).
    pub len: usize,
}

impl BlockIo {
    /// A write (`write`) or read of `len` bytes between block `lba` and the buffer at `offset`.
    pub fn new(write: bool, lba: u64, offset: usize, len: usize) -> Self {
        Self {
            write,
            lba,
            offset,
            len,
        }
    }
}

impl Controller {
    /// Resets the controller behind `regs`, sets up its admin queue with memory mapped
    /// through `mapper`, enables it, and reads its identity and active namespaces.
    pub fn enable(
        regs: Mmio,
        mapper: Arc<dyn DmaMapper>,
        options: ControllerOptions,
    ) -> Result<Self> {
        let regs = Arc::new(regs);
        let raw_cap = regs.read64(reg::CAP)?;
        if raw_cap == u64::MAX {
            return Err(HalError::NvmeController {
                reason: "CAP reads as all ones: the device does not answer".into(),
            });
        }
        let cap = Cap::from_raw(raw_cap);
        if !cap.nvm_command_set || cap.mpsmin != 0 {
            return Err(HalError::Unsupported {
                what: "this NVMe controller",
                reason: format!(
                    "the driver needs the NVM command set and 4 KiB memory pages (CAP {raw_cap:#x})"
                ),
            });
        }
        if regs.read32(reg::CC)? & cc::EN != 0 {
            regs.write32(reg::CC, 0)?;
        }
        wait_ready(&regs, false, cap.timeout)?;
        let depth = ADMIN_DEPTH.min(cap.max_queue_entries.min(4096) as u16);
        let admin = QueuePair::new(0, depth, cap.dstrd, regs.clone(), &mapper)?;
        let (asq, acq) = admin.addresses();
        let size = depth as u32 - 1;
        regs.write32(reg::AQA, size << 16 | size)?;
        regs.write64(reg::ASQ, asq)?;
        regs.write64(reg::ACQ, acq)?;
        // From here on, dropping `shared` (on any error below) disables the controller before
        // the admin queue's memory is freed.
        let mut shared = Shared {
            regs: regs.clone(),
            mapper,
            cap,
            identity: ControllerIdentity::parse(&[0; PAGE]),
            namespaces: Vec::new(),
            admin: Mutex::new(admin),
            // Set once the controller says how many pairs it gives (Set Features).
            free_qids: Mutex::new(Vec::new()),
            options,
            gpu_registers: Mutex::new(Vec::new()),
        };
        // Interrupts stay masked: the driver polls.
        regs.write32(reg::INTMS, u32::MAX)?;
        regs.write32(reg::CC, cc::EN | cc::IOSQES_64 | cc::IOCQES_16)?;
        wait_ready(&regs, true, cap.timeout)?;
        // Ask for 64 I/O queue pairs; the controller says how many it gives (0-based).
        let mut queues = Sqe::new(admin::SET_FEATURES, 0);
        queues.cdw10 = admin::FEATURE_NUMBER_OF_QUEUES;
        queues.cdw11 = 63 | 63 << 16;
        let granted = shared.admin_command("Set Features (Number of Queues)", queues)?;
        let pairs = ((granted & 0xffff).min(granted >> 16) + 1).min(64) as u16;
        *shared.free_qids.lock_unpoisoned() = (1..=pairs).rev().collect();
        let data = shared.identify(admin::CNS_CONTROLLER, 0)?;
        shared.identity = ControllerIdentity::parse(&data);
        let list = shared.identify(admin::CNS_ACTIVE_NAMESPACES, 0)?;
        shared.namespaces = list
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .take_while(|&n| n != 0)
            .collect();
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// The controller's capabilities.
    pub fn cap(&self) -> Cap {
        self.shared.cap
    }

    /// What Identify Controller said.
    pub fn identity(&self) -> &ControllerIdentity {
        &self.shared.identity
    }

    /// The active namespaces' identifiers, ascending.
    pub fn namespaces(&self) -> &[u32] {
        &self.shared.namespaces
    }

    /// Namespace `nsid`'s format. Formats with metadata are refused (the driver moves data
    /// only).
    pub fn namespace(&self, nsid: u32) -> Result<Namespace> {
        let data = self.shared.identify(admin::CNS_NAMESPACE, nsid)?;
        let identity = NamespaceIdentity::parse(&data).ok_or_else(|| {
            HalError::InvalidArgument(format!("NVMe namespace {nsid} is not active"))
        })?;
        if identity.metadata != 0 {
            return Err(HalError::Unsupported {
                what: "NVMe namespaces with metadata",
                reason: format!(
                    "namespace {nsid} carries {} metadata bytes per block",
                    identity.metadata
                ),
            });
        }
        Ok(Namespace { nsid, identity })
    }

    /// Creates an I/O queue pair of `depth` entries (2 up to the controller's limit).
    pub fn io_queue_pair(&self, depth: u16) -> Result<IoQueuePair> {
        let s = &self.shared;
        if depth as u32 > s.cap.max_queue_entries {
            return Err(HalError::InvalidArgument(format!(
                "the controller's queues hold at most {} entries",
                s.cap.max_queue_entries
            )));
        }
        let qid =
            s.free_qids.lock_unpoisoned().pop().ok_or_else(|| {
                HalError::Busy("every NVMe I/O queue identifier is in use".into())
            })?;
        let created = (|| {
            let qp = QueuePair::new(qid, depth, s.cap.dstrd, s.regs.clone(), &s.mapper)
                .map_err(|e| (e, true))?;
            let (sq, cq) = qp.addresses();
            let size = (depth as u32 - 1) << 16 | qid as u32;
            let mut create_cq = Sqe::new(admin::CREATE_CQ, 0);
            create_cq.prp1 = cq;
            create_cq.cdw10 = size;
            create_cq.cdw11 = 1; // physically contiguous, interrupts off
            s.admin_command("Create I/O Completion Queue", create_cq)
                .map_err(|e| (e, true))?;
            let mut create_sq = Sqe::new(admin::CREATE_SQ, 0);
            create_sq.prp1 = sq;
            create_sq.cdw10 = size;
            create_sq.cdw11 = (qid as u32) << 16 | 1; // its CQ; physically contiguous
            if let Err(e) = s.admin_command("Create I/O Submission Queue", create_sq) {
                // The identifier is free again only if its completion queue is gone too.
                return Err((e, s.delete_queue(admin::DELETE_CQ, qid).is_ok()));
            }
            Ok(qp)
        })();
        match created {
            Ok(qp) => Ok(IoQueuePair {
                qp,
                shared: s.clone(),
                abandoned: false,
            }),
            Err((e, free)) => {
                if free {
                    s.free_qids.lock_unpoisoned().push(qid);
                }
                Err(e)
            }
        }
    }

    /// Where `gpu`'s kernels reach this controller's register file (its doorbells): the
    /// register file registered with the GPU once, for the controller's life (as IO memory
    /// where it is a BAR).
    pub(crate) fn doorbells_for(&self, gpu: &gpuio_hal::gpu::Gpu) -> Result<u64> {
        let s = &self.shared;
        let mut pins = s.gpu_registers.lock_unpoisoned();
        if let Some((_, pin)) = pins.iter().find(|(g, _)| *g == gpu.ordinal()) {
            return Ok(pin.addr);
        }
        let (base, len, io, owner) = s.regs.parts();
        // SAFETY: `owner` keeps the register file mapped, and RegisterPin drops the pin before
        // its reference to the owner.
        let pin =
            unsafe { gpu.pin_mapped(base, len, io) }.map_err(|e| HalError::NvmeController {
                reason: format!(
                    "the controller's doorbells cannot be registered with {gpu}{}: {e}",
                    if io { " as IO memory" } else { "" }
                ),
            })?;
        let addr = pin.device_addr();
        pins.push((
            gpu.ordinal(),
            RegisterPin {
                _pin: pin,
                _owner: owner,
                addr,
            },
        ));
        Ok(addr)
    }

    /// DMA memory this controller can reach, `len` bytes rounded up to pages.
    pub fn dma_buffer(&self, len: usize) -> Result<DmaBuffer> {
        DmaBuffer::new(len, self.shared.mapper.clone())
    }

    /// Maps the dma-buf `fd` — another device's memory, such as a GPU's
    /// ([`DeviceBuffer::export_dmabuf`](gpuio_hal::DeviceBuffer::export_dmabuf)) — for this
    /// controller to reach peer-to-peer (Tier 2). Only a controller bound to gpuio's kernel
    /// module can; the others refuse with the reason.
    pub fn import_dmabuf(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<PeerBuffer> {
        self.shared.mapper.import_dmabuf(fd)
    }

    /// Whether the controller is enabled and ready.
    pub fn is_ready(&self) -> bool {
        self.shared.is_ready()
    }

    /// Disables the controller (CC.EN to 0) and waits until it stops. Every queue pair's
    /// later commands fail.
    pub fn disable(&self) -> Result<()> {
        self.shared.disable()
    }
}

impl Shared {
    fn is_ready(&self) -> bool {
        self.regs
            .read32(reg::CSTS)
            .is_ok_and(|s| s != u32::MAX && s & csts::RDY != 0 && s & csts::CFS == 0)
    }

    fn disable(&self) -> Result<()> {
        self.regs.write32(reg::CC, 0)?;
        wait_ready(&self.regs, false, self.cap.timeout)
    }

    /// Runs one admin command; its completion's result dword.
    fn admin_command(&self, what: &'static str, sqe: Sqe) -> Result<u32> {
        self.admin_with_data(what, sqe, None)
    }

    fn admin_with_data(
        &self,
        what: &'static str,
        sqe: Sqe,
        data: Option<&DmaBuffer>,
    ) -> Result<u32> {
        let mut admin = self.admin.lock_unpoisoned();
        let (iova, len) = data.map_or((0, 0), |d| (d.iova(), d.len()));
        let cid = admin.submit(sqe, iova, len)?;
        let cqe = match admin.wait(cid, self.options.command_timeout) {
            Ok(cqe) => cqe,
            Err(e) => {
                let _ = self.disable();
                return Err(e);
            }
        };
        command_status(what, cqe.status())?;
        Ok(cqe.result)
    }

    fn identify(&self, cns: u32, nsid: u32) -> Result<[u8; PAGE]> {
        let buf = DmaBuffer::new(PAGE, self.mapper.clone())?;
        let mut sqe = Sqe::new(admin::IDENTIFY, nsid);
        sqe.cdw10 = cns;
        self.admin_with_data("Identify", sqe, Some(&buf))?;
        let mut out = [0u8; PAGE];
        buf.read(0, &mut out)?;
        Ok(out)
    }

    fn delete_queue(&self, opcode: u8, qid: u16) -> Result<u32> {
        let mut sqe = Sqe::new(opcode, 0);
        sqe.cdw10 = qid as u32;
        self.admin_command("Delete I/O Queue", sqe)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // No DMA may follow the queues' and buffers' memory being freed.
        if let Err(e) = self.disable() {
            tracing::warn!(error = %e, "NVMe controller did not stop");
        }
    }
}

/// An I/O submission/completion queue pair on one controller, for one thread at a time.
/// Dropping it deletes its queues.
pub struct IoQueuePair {
    qp: QueuePair,
    shared: Arc<Shared>,
    /// A wait failed (the controller was disabled then): commands may still be counted in
    /// flight that will never complete, so the pair takes no more.
    abandoned: bool,
}

impl IoQueuePair {
    /// The queue identifier.
    pub fn qid(&self) -> u16 {
        self.qp.qid()
    }

    /// Entries per queue.
    pub fn depth(&self) -> u16 {
        self.qp.depth()
    }

    /// Disables the controller this pair is on (a GPU batch on it timed out).
    pub(crate) fn disable_controller(&self) -> Result<()> {
        self.shared.disable()
    }

    /// The SQ's, the CQ's and the PRP list pages' memory (for registering with a GPU).
    pub(crate) fn queue_memory(&self) -> (&DmaBuffer, &DmaBuffer, &DmaBuffer) {
        self.qp.memory()
    }

    /// Register offsets of the SQ tail and CQ head doorbells.
    pub(crate) fn doorbell_offsets(&self) -> (usize, usize) {
        self.qp.doorbells()
    }

    /// Reads `len` bytes from `lba` into `buf` at `offset`.
    pub fn read(
        &mut self,
        ns: &Namespace,
        lba: u64,
        buf: &impl DmaTarget,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        self.run(ns, buf, &[BlockIo::new(false, lba, offset, len)])
    }

    /// Writes `len` bytes of `buf` from `offset` to `lba`.
    pub fn write(
        &mut self,
        ns: &Namespace,
        lba: u64,
        buf: &impl DmaTarget,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        self.run(ns, buf, &[BlockIo::new(true, lba, offset, len)])
    }

    /// Makes the namespace's completed writes durable (FLUSH).
    pub fn flush(&mut self, ns: &Namespace) -> Result<()> {
        let cid = self.qp.submit(Sqe::new(io::FLUSH, ns.nsid), 0, 0)?;
        let cqe = self.wait(cid)?;
        command_status("Flush", cqe.status())
    }

    /// Runs `ops` against `buf` (a [`DmaBuffer`], or a [`PeerBuffer`](super::PeerBuffer) in
    /// another device's memory), as many in flight at once as the queue holds, each split
    /// into commands the controller accepts (at its transfer limit, and where the buffer's bus
    /// addresses stop being contiguous, which must be at a block boundary). Returns once none
    /// is in flight: with the first error where any failed.
    pub fn run(&mut self, ns: &Namespace, buf: &impl DmaTarget, ops: &[BlockIo]) -> Result<()> {
        if self.abandoned {
            return Err(HalError::NvmeController {
                reason: format!(
                    "queue pair {} was given up after an earlier failure (its commands' \
                     completions are unaccounted for): make a new one",
                    self.qp.qid()
                ),
            });
        }
        let block = ns.identity.block_size as usize;
        let max = self
            .shared
            .identity
            .max_transfer()
            .unwrap_or(usize::MAX)
            .min(super::prp::MAX_TRANSFER)
            / block
            * block;
        if max == 0 {
            return Err(HalError::Unsupported {
                what: "this namespace's block size",
                reason: format!(
                    "one command moves at most {:?} bytes, less than a {block}-byte block",
                    self.shared.identity.max_transfer()
                ),
            });
        }
        if buf.mapped_by() != super::dma::mapper_id(&self.shared.mapper) {
            return Err(HalError::InvalidArgument(
                "the buffer is mapped for another NVMe controller: its addresses mean nothing \
                 (or something else) to this one"
                    .into(),
            ));
        }
        let mut commands = Vec::new();
        for op in ops {
            gpuio_hal::error::check_range(
                "NVMe transfer buffer",
                op.offset,
                op.len,
                buf.target_len(),
            )?;
            if op.len == 0 || op.len % block != 0 {
                return Err(HalError::InvalidArgument(format!(
                    "an NVMe transfer is whole {block}-byte blocks, not {} bytes",
                    op.len
                )));
            }
            let mut done = 0;
            while done < op.len {
                let (addr, contiguous) = buf.bus_run(op.offset + done).ok_or_else(|| {
                    HalError::InvalidArgument("an NVMe transfer runs past its buffer".into())
                })?;
                let n = (op.len - done).min(max).min(contiguous);
                // Checked here, before any command goes: PRPs need dword-aligned addresses.
                if !addr.is_multiple_of(4) {
                    return Err(HalError::InvalidArgument(format!(
                        "an NVMe transfer needs a dword-aligned buffer offset, not {}",
                        op.offset + done
                    )));
                }
                if n % block != 0 {
                    return Err(HalError::InvalidArgument(format!(
                        "the buffer's bus addresses break {} bytes into a {block}-byte block \
                         (at byte {} of the buffer)",
                        n % block,
                        op.offset + done + n
                    )));
                }
                let lba = op.lba.checked_add((done / block) as u64).ok_or_else(|| {
                    HalError::InvalidArgument(format!(
                        "LBA {} plus {} bytes overflows",
                        op.lba, op.len
                    ))
                })?;
                let opcode = if op.write { io::WRITE } else { io::READ };
                let sqe = Sqe::rw(opcode, ns.nsid, lba, (n / block) as u32);
                commands.push((sqe, addr, n));
                done += n;
            }
        }
        let mut flying = std::collections::VecDeque::new();
        let mut first_error = None;
        for (sqe, iova, n) in commands {
            if self.qp.room() == 0 {
                let cid = flying.pop_front().ok_or_else(|| HalError::NvmeController {
                    reason: format!(
                        "queue pair {} has no command identifier free",
                        self.qp.qid()
                    ),
                })?;
                self.settle(cid, &mut first_error)?;
            }
            if first_error.is_some() {
                break;
            }
            match self.qp.submit(sqe, iova, n) {
                Ok(cid) => flying.push_back(cid),
                Err(e) => {
                    first_error = Some(e);
                    break;
                }
            }
        }
        for cid in flying {
            self.settle(cid, &mut first_error)?;
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Waits for `cid`; a failed status becomes `first_error` (if none yet). A wait that
    /// fails (timeout, fatal or disabled controller) returns at once: the controller is
    /// disabled by then, so nothing is left in flight.
    fn settle(&mut self, cid: u16, first_error: &mut Option<HalError>) -> Result<()> {
        let cqe = self.wait(cid)?;
        if let Err(e) = command_status("I/O command", cqe.status()) {
            first_error.get_or_insert(e);
        }
        Ok(())
    }

    fn wait(&mut self, cid: u16) -> Result<super::spec::Cqe> {
        self.qp
            .wait(cid, self.shared.options.command_timeout)
            .inspect_err(|_| {
                self.abandoned = true;
                let _ = self.shared.disable();
            })
    }
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("identity", &self.shared.identity)
            .field("namespaces", &self.shared.namespaces)
            .finish()
    }
}

impl std::fmt::Debug for IoQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoQueuePair")
            .field("qid", &self.qp.qid())
            .field("depth", &self.qp.depth())
            .finish()
    }
}

impl Drop for IoQueuePair {
    fn drop(&mut self) {
        let s = &self.shared;
        if s.is_ready() {
            let qid = self.qp.qid();
            let deleted = s
                .delete_queue(admin::DELETE_SQ, qid)
                .and_then(|_| s.delete_queue(admin::DELETE_CQ, qid));
            match deleted {
                Ok(_) => s.free_qids.lock_unpoisoned().push(qid),
                Err(e) => tracing::warn!(qid, error = %e, "NVMe queue pair not deleted"),
            }
        }
    }
}

/// A failed completion status as the typed error.
fn command_status(op: &'static str, status: Status) -> Result<()> {
    if status.is_success() {
        Ok(())
    } else {
        Err(HalError::NvmeCommand { op, status })
    }
}

/// Waits until CSTS.RDY is `ready`, failing on CSTS.CFS or after `timeout`.
fn wait_ready(regs: &Mmio, ready: bool, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    let mut polls = 0u32;
    loop {
        polls = polls.saturating_add(1);
        let status = regs.read32(reg::CSTS)?;
        if status == u32::MAX {
            return Err(HalError::NvmeController {
                reason: "CSTS reads as all ones: the device does not answer".into(),
            });
        }
        if ready && status & csts::CFS != 0 {
            return Err(HalError::NvmeController {
                reason: "the controller reports a fatal status (CSTS.CFS) while enabling".into(),
            });
        }
        if (status & csts::RDY != 0) == ready {
            return Ok(());
        }
        if start.elapsed() > timeout {
            return Err(HalError::TimedOut {
                what: if ready {
                    "NVMe controller enable (CSTS.RDY)"
                } else {
                    "NVMe controller reset (CSTS.RDY clear)"
                },
                after: timeout,
            });
        }
        // A controller that answers within microseconds (the software one, or a device
        // sharing the core) is seen without a sleep's delay; a real one takes milliseconds.
        if polls < 128 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}
