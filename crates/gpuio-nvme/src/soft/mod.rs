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
//! reverse order, late completions, a controller that stops answering, a fatal status, and a
//! hostile controller's data: completions rewritten ([`CqeTamper`]) and Identify pages of the
//! test's choosing.

mod admin;
mod queues;
mod worker;

use super::dma::{DmaMapper, DmaMemory, IovaSpace, Mmio};
use super::spec::{Cap, PAGE, doorbell, reg};
use crossbeam_utils::CachePadded;
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::sync::{MutexExt, RwLockExt};
use queues::QueueTable;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// I/O queue pairs the software controller has doorbells for.
pub const SOFT_QUEUES: u16 = 64;

/// The doorbell stride exponent (CAP.DSTRD): doorbells 64 bytes apart, each on a cache line
/// of its own, so the threads serving different queues and the GPU writing them share none.
const DSTRD: u8 = 4;

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
    /// I/O completions rewritten before they are posted, the first entry for the first one
    /// posted after these faults are set, and so on; later completions are honest.
    pub tamper: Vec<CqeTamper>,
    /// Identify pages answered instead of the controller's own, by CNS (0: namespace, 1:
    /// controller, 2: active namespace list).
    pub identify: Vec<(u8, Box<[u8; PAGE]>)>,
}

/// How a buggy or hostile controller rewrites one completion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct CqeTamper {
    /// XORed into the command identifier: a completion for another command, or for none.
    pub cid_xor: u16,
    /// The status field posted instead (without the phase tag): success for a failed
    /// command, or any failure.
    pub status: Option<u16>,
    /// XORed into the command-specific result.
    pub result_xor: u32,
    /// Posted a second time.
    pub duplicate: bool,
    /// Never posted: the command is lost.
    pub lose: bool,
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

/// Where mapped IO addresses lead: IO address → (host address, length).
type Table = BTreeMap<u64, (usize, usize)>;

/// IO addresses for the software controller: a table from IO address to host memory. Each
/// controller thread reads a snapshot of it, without locking; a thread takes a new snapshot
/// at the top of its loop (and on a miss), and acknowledges the version it holds. Unmapping
/// waits until every thread holds a snapshot without the range, so no thread can still reach
/// memory that is about to be freed.
#[derive(Debug)]
pub struct SoftMapper {
    space: IovaSpace,
    table: RwLock<Arc<Table>>,
    version: AtomicU64,
    acked: Vec<CachePadded<AtomicU64>>,
    /// The controller's threads have ended: nothing reads the table any more.
    stopped: AtomicBool,
}

/// One controller thread's snapshot of the mapper's table.
pub(super) struct MapView {
    snapshot: Arc<Table>,
    version: u64,
    index: usize,
}

impl DmaMapper for SoftMapper {
    unsafe fn map(&self, mem: &DmaMemory) -> Result<u64> {
        let iova = self.space.take(mem.len())?;
        self.change(|t| {
            t.insert(iova, (mem.addr(0) as usize, mem.len()));
        });
        Ok(iova)
    }

    fn unmap(&self, iova: u64, _len: usize) {
        let version = self.change(|t| {
            t.remove(&iova);
        });
        let mut rounds = 0u32;
        while !self.stopped.load(Ordering::Acquire)
            && self
                .acked
                .iter()
                .any(|a| a.load(Ordering::Acquire) < version)
        {
            rounds = rounds.saturating_add(1);
            if rounds > 64 {
                std::thread::sleep(Duration::from_micros(20));
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl SoftMapper {
    fn new(threads: usize) -> Self {
        Self {
            space: IovaSpace::new(0x10_0000, 1 << 39),
            table: RwLock::new(Arc::new(Table::new())),
            version: AtomicU64::new(0),
            acked: (0..threads)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
            stopped: AtomicBool::new(false),
        }
    }

    /// Publishes a changed table; its version.
    fn change(&self, f: impl FnOnce(&mut Table)) -> u64 {
        let mut table = self.table.write_unpoisoned();
        let mut next = Table::clone(&table);
        f(&mut next);
        *table = Arc::new(next);
        self.version.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Thread `index`'s view, holding the current table.
    pub(super) fn view(&self, index: usize) -> MapView {
        let mut view = MapView {
            snapshot: Arc::new(Table::new()),
            version: u64::MAX,
            index,
        };
        self.refresh(&mut view);
        view
    }

    /// Takes the current table where it changed, and acknowledges its version.
    pub(super) fn refresh(&self, view: &mut MapView) {
        let version = self.version.load(Ordering::Acquire);
        if version != view.version {
            view.snapshot = self.table.read_unpoisoned().clone();
            view.version = version;
            self.acked[view.index].store(version, Ordering::Release);
        }
    }

    /// Copies `len` bytes between IO address `iova` and `host` (`to_device`: host → IO
    /// memory). False where the range is not inside one mapping (after a fresh look).
    ///
    /// # Safety
    /// `host..host+len` must be valid for reads (and writes, unless `to_device`), and not
    /// inside memory mapped here.
    unsafe fn copy(
        &self,
        view: &mut MapView,
        iova: u64,
        host: *mut u8,
        len: usize,
        to_device: bool,
    ) -> bool {
        let mut at = find(&view.snapshot, iova, len);
        if at.is_none() {
            // A buffer mapped since this thread last looked.
            self.refresh(view);
            at = find(&view.snapshot, iova, len);
        }
        let Some(at) = at else {
            return false;
        };
        // SAFETY: [at, at+len) lies inside a DmaMemory mapping in this thread's snapshot; its
        // memory is not freed before this thread acknowledges a table without it (`unmap`
        // waits), which it does only between copies. `host` is valid and distinct from it
        // (the caller's contract).
        unsafe {
            if to_device {
                std::ptr::copy_nonoverlapping(host, at, len);
            } else {
                std::ptr::copy_nonoverlapping(at, host, len);
            }
        }
        true
    }

    pub(super) fn read_into(&self, view: &mut MapView, iova: u64, out: &mut [u8]) -> bool {
        // SAFETY: `out` is the caller's own buffer, never DMA memory.
        unsafe { self.copy(view, iova, out.as_mut_ptr(), out.len(), false) }
    }

    pub(super) fn write_from(&self, view: &mut MapView, iova: u64, data: &[u8]) -> bool {
        // SAFETY: as above; the copy only reads `data`.
        unsafe { self.copy(view, iova, data.as_ptr().cast_mut(), data.len(), true) }
    }

    /// Copies between IO memory and `bytes` bytes of namespace memory at `offset` (which the
    /// caller checked lies inside it).
    pub(super) fn with_namespace(
        &self,
        view: &mut MapView,
        iova: u64,
        ns: &DmaMemory,
        offset: usize,
        bytes: usize,
        to_device: bool,
    ) -> bool {
        // SAFETY: the caller checked the range lies in `ns`, a mapping of its own that is
        // never mapped for DMA.
        unsafe { self.copy(view, iova, ns.addr(offset), bytes, to_device) }
    }
}

/// Where `len` bytes at `iova` lie in host memory, if inside one mapping of `table`.
fn find(table: &Table, iova: u64, len: usize) -> Option<*mut u8> {
    let (&base, &(addr, size)) = table.range(..=iova).next_back()?;
    let off = (iova - base) as usize;
    off.checked_add(len)
        .filter(|&end| end <= size)
        .map(|_| (addr + off) as *mut u8)
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
    /// I/O completions posted since the faults were last set (the index into `tamper`).
    posted: AtomicU64,
    namespaces: Vec<DmaMemory>,
    /// Commands served, per thread (the admin thread first).
    served: Vec<CachePadded<AtomicU64>>,
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

    /// Commands served by all threads.
    fn served_total(&self) -> u64 {
        self.served.iter().map(|s| s.load(Ordering::Relaxed)).sum()
    }

    /// One idle round of a controller thread: a short spin, then yields for a while (a
    /// driver that shares the core gets it at once, and its next doorbell is seen without a
    /// sleep's delay: on one core each sleep costs a command ~100 µs), then short sleeps.
    fn idle(&self, rounds: &mut u32) {
        *rounds = rounds.saturating_add(1);
        if *rounds > 4096 {
            std::thread::sleep(Duration::from_micros(50));
        } else if *rounds > 16 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Held by each controller thread: when the thread ends, however it ends (a panic
/// included), it stops counting in the acknowledgements others wait for, so no unmap and no
/// queue-table change waits for a thread that is gone.
struct Departure {
    state: Arc<State>,
    /// The thread's index among all (the admin thread is 0).
    index: usize,
}

impl Drop for Departure {
    fn drop(&mut self) {
        self.state.mapper.acked[self.index].store(u64::MAX, Ordering::Release);
        if let Some(worker) = self.index.checked_sub(1) {
            self.state.acked[worker].store(u64::MAX, Ordering::Release);
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
            gpuio_hal::memory::backing::check(bytes, true)?;
            namespaces.push(DmaMemory::new(bytes)?);
        }
        let regs = Arc::new(DmaMemory::new(doorbell(SOFT_QUEUES, true, DSTRD) + 4)?);
        let cap = Cap {
            max_queue_entries: config.max_queue_entries,
            contiguous_queues: true,
            timeout: Duration::from_millis(2000),
            dstrd: DSTRD,
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
            mapper: Arc::new(SoftMapper::new(workers + 1)),
            faults: Mutex::new(SoftFaults::default()),
            faults_version: AtomicU64::new(0),
            posted: AtomicU64::new(0),
            namespaces,
            served: (0..=workers)
                .map(|_| CachePadded::new(AtomicU64::new(0)))
                .collect(),
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
            Box::new(move || {
                let _leaving = Departure {
                    state: s.clone(),
                    index: 0,
                };
                admin::Admin::new(s).serve()
            }),
        )?);
        for w in 0..workers {
            let s = state.clone();
            controller.threads.push(spawn(
                format!("gpuio-soft-nvme-io{w}"),
                Box::new(move || {
                    let _leaving = Departure {
                        state: s.clone(),
                        index: w + 1,
                    };
                    worker::Worker::new(s, w).serve()
                }),
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
        let mut held = self.state.faults.lock_unpoisoned();
        *held = faults;
        self.state.posted.store(0, Ordering::Relaxed);
        self.state.faults_version.fetch_add(1, Ordering::Release);
    }

    /// Commands served so far (admin and I/O).
    pub fn served(&self) -> u64 {
        self.state.served_total()
    }

    /// Fills namespace `nsid` with the data pattern of `seed` (byte `i` of the namespace is
    /// pattern byte `i`).
    pub fn fill_pattern(&self, nsid: u32, seed: u64) -> Result<()> {
        let ns = self.namespace(nsid)?;
        let mut chunk = vec![0u8; 1 << 20];
        for at in (0..ns.len()).step_by(chunk.len()) {
            let n = chunk.len().min(ns.len() - at);
            gpuio_hal::pattern::fill(&mut chunk[..n], at as u64, seed);
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
        // Only now is no thread reading the mapper's table: unmapping need not wait.
        self.state.mapper.stopped.store(true, Ordering::Release);
    }
}
