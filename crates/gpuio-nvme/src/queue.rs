//! One submission/completion queue pair as the host drives it: entries written into the SQ
//! and announced by its tail doorbell; completions found by their phase tag and released by
//! the CQ head doorbell.
//!
//! At most `depth - 1` commands are in flight, each under its own command identifier with its
//! own PRP list page, so neither queue can overflow: an SQ slot is free again once a
//! completion reports the controller past it, and the CQ has a slot for every command.

use super::dma::{DmaBuffer, DmaMapper, Mmio};
use super::prp::{self, Prp2};
use super::spec::{Cqe, PAGE, Sqe, csts, doorbell, reg};
use gpuio_hal::error::{HalError, Result};
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

/// How often a waiting poll also reads CSTS (a register read crosses the bus).
const STATUS_EVERY: u32 = 1024;
/// How often a waiting poll gives its core away: often enough that a controller sharing the
/// core (the software one, or the thread feeding a GPU) answers within microseconds rather
/// than a scheduler tick; a yield with nothing else to run returns at once.
const YIELD_EVERY: u32 = 32;

/// A queue pair's memory and the host's view of its indices.
pub(crate) struct QueuePair {
    qid: u16,
    depth: u16,
    sq: DmaBuffer,
    cq: DmaBuffer,
    /// One PRP list page per command identifier.
    lists: DmaBuffer,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
    sq_doorbell: usize,
    cq_doorbell: usize,
    regs: Arc<Mmio>,
    free: Vec<u16>,
    in_flight: Vec<bool>,
    done: Vec<Option<Cqe>>,
}

impl QueuePair {
    /// Memory for queue `qid` with `depth` entries (2..=4096), doorbells at stride `dstrd`.
    pub(crate) fn new(
        qid: u16,
        depth: u16,
        dstrd: u8,
        regs: Arc<Mmio>,
        mapper: &Arc<dyn DmaMapper>,
    ) -> Result<Self> {
        if !(2..=4096).contains(&depth) {
            return Err(HalError::InvalidArgument(format!(
                "an NVMe queue holds 2 to 4096 entries, not {depth}"
            )));
        }
        let (sq_doorbell, cq_doorbell) = (doorbell(qid, false, dstrd), doorbell(qid, true, dstrd));
        if cq_doorbell + 4 > regs.len() {
            return Err(HalError::InvalidArgument(format!(
                "queue {qid}'s doorbells lie past the controller's {}-byte register file",
                regs.len()
            )));
        }
        let entries = depth as usize;
        Ok(Self {
            qid,
            depth,
            sq: DmaBuffer::new(entries * size_of::<Sqe>(), mapper.clone())?,
            cq: DmaBuffer::new(entries * size_of::<Cqe>(), mapper.clone())?,
            lists: DmaBuffer::new((entries - 1) * PAGE, mapper.clone())?,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
            sq_doorbell,
            cq_doorbell,
            regs,
            free: (0..depth - 1).rev().collect(),
            in_flight: vec![false; entries - 1],
            done: vec![None; entries - 1],
        })
    }

    /// The queue identifier.
    pub(crate) fn qid(&self) -> u16 {
        self.qid
    }

    /// Entries per queue.
    pub(crate) fn depth(&self) -> u16 {
        self.depth
    }

    /// IO addresses of the SQ and the CQ (for Create I/O Queue, or AQA/ASQ/ACQ).
    pub(crate) fn addresses(&self) -> (u64, u64) {
        (self.sq.iova(), self.cq.iova())
    }

    /// The SQ's, the CQ's and the PRP list pages' memory.
    pub(crate) fn memory(&self) -> (&DmaBuffer, &DmaBuffer, &DmaBuffer) {
        (&self.sq, &self.cq, &self.lists)
    }

    /// Register offsets of the SQ tail and CQ head doorbells.
    pub(crate) fn doorbells(&self) -> (usize, usize) {
        (self.sq_doorbell, self.cq_doorbell)
    }

    /// Commands that can be submitted before one completes.
    pub(crate) fn room(&self) -> usize {
        self.free.len()
    }

    /// Submits `sqe` moving `len` bytes at IO address `data` (none for `len` 0); returns its
    /// command identifier. `Busy` where every identifier is in flight.
    pub(crate) fn submit(&mut self, mut sqe: Sqe, data: u64, len: usize) -> Result<u16> {
        let cid = *self
            .free
            .last()
            .ok_or_else(|| HalError::Busy(format!("NVMe queue {} is full", self.qid)))?;
        if len > 0 {
            let (prp1, prp2) = prp::entries(data, len)?;
            sqe.prp1 = prp1;
            sqe.prp2 = match prp2 {
                Prp2::Unused => 0,
                Prp2::Page(p) => p,
                Prp2::List(pages) => {
                    let at = cid as usize * PAGE;
                    for (i, p) in pages.iter().enumerate() {
                        self.lists.memory().store(at + 8 * i, *p)?;
                    }
                    self.lists.iova() + at as u64
                }
            };
        }
        sqe.set_cid(cid);
        self.free.pop();
        self.in_flight[cid as usize] = true;
        self.sq
            .memory()
            .store(self.sq_tail as usize * size_of::<Sqe>(), sqe)?;
        self.sq_tail = (self.sq_tail + 1) % self.depth;
        // The entry (and its PRP list) must be visible before the doorbell announces it.
        fence(Ordering::SeqCst);
        self.regs.write32(self.sq_doorbell, self.sq_tail as u32)?;
        Ok(cid)
    }

    /// Moves every posted completion into the done table and releases its CQ slots; returns
    /// how many it found. A completion for an identifier not in flight is a controller fault.
    pub(crate) fn reap(&mut self) -> Result<usize> {
        let mut found = 0;
        loop {
            let at = self.cq_head as usize * size_of::<Cqe>();
            let status: u16 = self.cq.memory().load(at + 14)?;
            if (status & 1 == 1) != self.phase {
                break;
            }
            // The rest of the entry was written before its phase tag.
            fence(Ordering::Acquire);
            let cqe: Cqe = self.cq.memory().load(at)?;
            let cid = cqe.cid as usize;
            match self.in_flight.get_mut(cid) {
                Some(flying) if *flying => {
                    *flying = false;
                    self.done[cid] = Some(cqe);
                }
                _ => {
                    return Err(HalError::NvmeController {
                        reason: format!(
                            "completion for command {} on queue {}, which is not in flight",
                            cqe.cid, self.qid
                        ),
                    });
                }
            }
            self.cq_head = (self.cq_head + 1) % self.depth;
            if self.cq_head == 0 {
                self.phase = !self.phase;
            }
            found += 1;
        }
        if found > 0 {
            self.regs.write32(self.cq_doorbell, self.cq_head as u32)?;
        }
        Ok(found)
    }

    /// Takes `cid`'s completion if it has arrived.
    pub(crate) fn take(&mut self, cid: u16) -> Option<Cqe> {
        let cqe = self.done.get_mut(cid as usize)?.take()?;
        self.free.push(cid);
        Some(cqe)
    }

    /// Waits for `cid`'s completion until `timeout`; fails early if the controller reports a
    /// fatal status or is no longer ready.
    pub(crate) fn wait(&mut self, cid: u16, timeout: Duration) -> Result<Cqe> {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            if let Some(cqe) = self.take(cid) {
                return Ok(cqe);
            }
            if self.reap()? > 0 {
                continue;
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(STATUS_EVERY) {
                let status = self.regs.read32(reg::CSTS)?;
                if status & csts::CFS != 0 || status == u32::MAX {
                    return Err(HalError::NvmeController {
                        reason: "the controller reports a fatal status (CSTS.CFS)".into(),
                    });
                }
                if status & csts::RDY == 0 {
                    return Err(HalError::NvmeController {
                        reason: "the controller is disabled (CSTS.RDY is 0)".into(),
                    });
                }
                if start.elapsed() > timeout {
                    return Err(HalError::TimedOut {
                        what: "NVMe command",
                        after: timeout,
                    });
                }
            }
            if polls.is_multiple_of(YIELD_EVERY) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
