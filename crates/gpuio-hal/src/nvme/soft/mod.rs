//! A software NVMe controller: host threads that serve the NVMe queue protocol from host
//! memory, as a device would, so the driver and GPU threads can be tested where no NVMe is
//! reachable. Its register page (CAP, CC, CSTS, AQA, ASQ, ACQ and the doorbells) is host
//! memory the driver maps as its BAR0; it reaches queue and data memory only through the IO
//! addresses its [`SoftMapper`] handed out, so an unmapped address is a data transfer error,
//! as under an IOMMU. Namespaces live in RAM.
//!
//! One thread (`admin`) watches CC, serves the admin queue and keeps the table of I/O queues;
//! `io_threads` workers (`worker`) serve the I/O queues, each the queues whose completion
//! queue number is its own modulo the worker count. A change to the table (a queue created or
//! deleted, a reset) completes only once every worker has taken it up, so a deleted queue is
//! never served after its deletion completes, and no DMA follows a reset.
//!
//! Faults can be injected ([`SoftFaults`]): bad blocks, completions held back and posted in
//! reverse order, late completions, a controller that stops answering, and a fatal status.

mod admin;
mod queues;
mod worker;

use super::dma::{DmaMapper, DmaMemory, IovaSpace, Mmio};
use super::spec::{Cap, doorbell, reg};
use crate::error::{HalError, Result};
use crate::sync::{MutexExt, RwLockExt};
use queues::QueueTable;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
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
    /// Maximum entries per queue (2 to 4096).
    pub max_queue_entries: u32,
    /// Threads serving the I/O queues (1 to 64).
    pub io_threads: usize,
}

impl Default for SoftConfig {
    fn default() -> Self {
        Self {
            namespaces: vec![16384],
            block_size: 512,
            mdts: 5,
            max_queue_entries: 1024,
            io_threads: 1,
        }
    }
}

/// IO addresses for the software controller: a table from IO address to host memory, which
/// its threads consult (holding the table for reading) for every access.
#[derive(Debug)]
pub struct SoftMapper {
    space: IovaSpace,
    table: RwLock<BTreeMap<u64, (usize, usize)>>,
}

impl DmaMapper for SoftMapper {
    fn map(&self, mem: &DmaMemory) -> Result<u64> {
        let iova = self.space.take(mem.len())?;
        self.table
            .write_unpoisoned()
            .insert(iova, (mem.addr(0) as usize, mem.len()));
        Ok(iova)
    }

    fn unmap(&self, iova: u64, _len: usize) {
        self.table.write_unpoisoned().remove(&iova);
    }
}

impl SoftMapper {
    fn new() -> Self {
        Self {
            space: IovaSpace::new(0x10_0000, 1 << 39),
            table: RwLock::new(BTreeMap::new()),
        }
    }

    /// Copies `len` bytes between IO address `iova` and `host` (`to_device`: host → IO
    /// memory). False where the range is not inside one mapping.
    ///
    /// # Safety
    /// `host..host+len` must be valid for reads (and writes, unless `to_device`), and not
    /// inside memory mapped here.
    unsafe fn copy(&self, iova: u64, host: *mut u8, len: usize, to_device: bool) -> bool {
        let table = self.table.read_unpoisoned();
        let Some((&base, &(addr, size))) = table.range(..=iova).next_back() else {
            return false;
        };
        let off = (iova - base) as usize;
        if off.checked_add(len).is_none_or(|end| end > size) {
            return false;
        }
        let at = (addr + off) as *mut u8;
        // SAFETY: [at, at+len) lies inside a live DmaMemory mapping: entries leave the table
        // (under its write lock, excluded here) before their memory is unmapped. `host` is
        // valid and distinct from it (the caller's contract).
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
        // SAFETY: `out` is the caller's own buffer, never DMA memory.
        unsafe { self.copy(iova, out.as_mut_ptr(), out.len(), false) }
    }

    fn write_from(&self, iova: u64, data: &[u8]) -> bool {
        // SAFETY: as above; the copy only reads `data`.
        unsafe { self.copy(iova, data.as_ptr().cast_mut(), data.len(), true) }
    }

    /// Copies between IO memory and `bytes` bytes of namespace memory at `offset` (which the
    /// caller checked lies inside it).
    fn with_namespace(
        &self,
        iova: u64,
        ns: &DmaMemory,
        offset: usize,
        bytes: usize,
        to_device: bool,
    ) -> bool {
        // SAFETY: the caller checked the range lies in `ns`, a mapping of its own that is
        // never mapped for DMA.
        unsafe { self.copy(iova, ns.addr(offset), bytes, to_device) }
    }
}

/// What the controller's threads share.
struct State {
    stop: AtomicBool,
    config: SoftConfig,
    regs: Arc<DmaMemory>,
    mapper: Arc<SoftMapper>,
    faults: Mutex<SoftFaults>,
    /// Bumped whenever `faults` changes, so workers re-read it only then.
    faults_version: AtomicU64,
    namespaces: Vec<DmaMemory>,
    served: AtomicU64,
    /// A fatal status is set: nothing is served until a reset.
    fatal: AtomicBool,
    queues: Mutex<QueueTable>,
    /// Bumped whenever `queues` changes; each worker acknowledges the version it serves.
    queues_version: AtomicU64,
    acked: Vec<AtomicU64>,
}

impl State {
    fn reg(&self, offset: usize) -> u32 {
        self.regs.load(offset).unwrap_or(u32::MAX)
    }

    fn set_reg(&self, offset: usize, value: u32) {
        let _ = self.regs.store(offset, value);
    }

    /// Sets the fatal status: every thread stops serving until a reset.
    fn go_fatal(&self) {
        self.fatal.store(true, Ordering::SeqCst);
        self.set_reg(reg::CSTS, super::spec::csts::RDY | super::spec::csts::CFS);
    }

    /// Waits while `cond` holds, sleeping a little between looks, until the controller stops.
    fn idle(&self, rounds: &mut u32) {
        *rounds = rounds.saturating_add(1);
        if *rounds > 2048 {
            std::thread::sleep(Duration::from_micros(50));
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The software controller; its threads stop when this is dropped.
pub struct SoftController {
    state: Arc<State>,
    threads: Vec<JoinHandle<()>>,
}

impl SoftController {
    /// Starts a controller with zeroed namespaces.
    pub fn start(config: SoftConfig) -> Result<Self> {
        if !config.block_size.is_power_of_two()
            || !(9..=16).contains(&config.block_size.trailing_zeros())
            || !(2..=4096).contains(&config.max_queue_entries)
            || !(1..=64).contains(&config.io_threads)
        {
            return Err(HalError::InvalidArgument(format!(
                "software NVMe controller: block size {}, queue size {} or {} I/O threads out \
                 of range",
                config.block_size, config.max_queue_entries, config.io_threads
            )));
        }
        let mut namespaces = Vec::new();
        for blocks in &config.namespaces {
            let bytes = blocks
                .checked_mul(config.block_size as u64)
                .and_then(|b| usize::try_from(b).ok())
                .filter(|&b| b > 0)
                .ok_or_else(|| HalError::InvalidArgument("namespace size out of range".into()))?;
            crate::memory::backing::check(bytes, true)?;
            namespaces.push(DmaMemory::new(bytes)?);
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
        let workers = config.io_threads;
        let state = Arc::new(State {
            stop: AtomicBool::new(false),
            config,
            regs,
            mapper: Arc::new(SoftMapper::new()),
            faults: Mutex::new(SoftFaults::default()),
            faults_version: AtomicU64::new(0),
            namespaces,
            served: AtomicU64::new(0),
            fatal: AtomicBool::new(false),
            queues: Mutex::new(QueueTable::default()),
            queues_version: AtomicU64::new(0),
            acked: (0..workers).map(|_| AtomicU64::new(0)).collect(),
        });
        let mut controller = Self {
            state: state.clone(),
            threads: Vec::new(),
        };
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|source| HalError::Os {
                    op: "spawn a software NVMe controller thread",
                    source,
                })
        };
        let s = state.clone();
        controller.threads.push(spawn(
            "gpuio-soft-nvme".into(),
            Box::new(move || admin::Admin::new(s).serve()),
        )?);
        for w in 0..workers {
            let s = state.clone();
            controller.threads.push(spawn(
                format!("gpuio-soft-nvme-io{w}"),
                Box::new(move || worker::Worker::new(s, w).serve()),
            )?);
        }
        Ok(controller)
    }

    /// Its register file, as the driver maps a BAR0.
    pub fn registers(&self) -> Mmio {
        Mmio::over(self.state.regs.clone())
    }

    /// Its DMA mapper.
    pub fn mapper(&self) -> Arc<dyn DmaMapper> {
        self.state.mapper.clone()
    }

    /// Replaces the injected faults.
    pub fn set_faults(&self, faults: SoftFaults) {
        *self.state.faults.lock_unpoisoned() = faults;
        self.state.faults_version.fetch_add(1, Ordering::Release);
    }

    /// Commands served so far (admin and I/O).
    pub fn served(&self) -> u64 {
        self.state.served.load(Ordering::Relaxed)
    }

    /// Fills namespace `nsid` with the data pattern of `seed` (byte `i` of the namespace is
    /// pattern byte `i`).
    pub fn fill_pattern(&self, nsid: u32, seed: u64) -> Result<()> {
        let ns = self.namespace(nsid)?;
        let mut chunk = vec![0u8; 1 << 20];
        for at in (0..ns.len()).step_by(chunk.len()) {
            let n = chunk.len().min(ns.len() - at);
            crate::pattern::fill(&mut chunk[..n], at as u64, seed);
            ns.write(at, &chunk[..n])?;
        }
        Ok(())
    }

    /// A copy of namespace `nsid`'s bytes (`None`: no such namespace).
    pub fn namespace_bytes(&self, nsid: u32) -> Option<Vec<u8>> {
        let ns = self.namespace(nsid).ok()?;
        let mut out = vec![0u8; ns.len()];
        ns.read(0, &mut out).ok()?;
        Some(out)
    }

    fn namespace(&self, nsid: u32) -> Result<&DmaMemory> {
        (nsid as usize)
            .checked_sub(1)
            .and_then(|i| self.state.namespaces.get(i))
            .ok_or_else(|| HalError::InvalidArgument(format!("no namespace {nsid}")))
    }
}

impl Drop for SoftController {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
