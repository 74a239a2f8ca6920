//! The software controller's admin thread: enable and reset (CC.EN, CSTS.RDY), the admin
//! queue (Identify, Create and Delete I/O queues), and the table of I/O queues, each change
//! taking effect only once every worker has taken it up.

use super::super::spec::{PAGE, Sqe, Status, admin, cc, csts, doorbell, reg};
use super::queues::{self, CqSpec, QueueTable, Server, SoftCq, SoftSq, SqSpec};
use super::{DSTRD, MapView, SOFT_QUEUES, SoftFaults, State};
use gpuio_hal::sync::MutexExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub(super) struct Admin {
    state: Arc<State>,
    enabled: bool,
    queue: Option<(SoftSq, SoftCq)>,
    view: Option<MapView>,
}

/// The admin thread's index among the controller's threads (workers follow).
const INDEX: usize = 0;

impl Admin {
    pub(super) fn new(state: Arc<State>) -> Self {
        let view = state.mapper.view(INDEX);
        Self {
            state,
            enabled: false,
            queue: None,
            view: Some(view),
        }
    }

    pub(super) fn serve(mut self) {
        let mut idle = 0u32;
        while !self.state.stop.load(Ordering::Relaxed) {
            let cc = self.state.reg(reg::CC);
            if cc & cc::EN != 0 && !self.enabled {
                self.enable();
            } else if cc & cc::EN == 0 && self.enabled {
                self.reset();
            }
            let mut view = self
                .view
                .take()
                .unwrap_or_else(|| self.state.mapper.view(INDEX));
            self.state.mapper.refresh(&mut view);
            let worked = match self.queue.take() {
                Some((mut sq, mut cq)) if !self.state.fatal.load(Ordering::Relaxed) => {
                    let none = SoftFaults::default();
                    let state = self.state.clone();
                    let mut srv = Server {
                        state: &state,
                        view: &mut view,
                        index: INDEX,
                    };
                    let worked = queues::serve(&mut srv, 0, &mut sq, &mut cq, &none, |srv, sqe| {
                        self.admin(srv, sqe)
                    });
                    self.queue = Some((sq, cq));
                    worked
                }
                other => {
                    self.queue = other;
                    false
                }
            };
            self.view = Some(view);
            if worked {
                idle = 0;
            } else {
                self.state.idle(&mut idle);
            }
        }
    }

    /// A controller reset: I/O queues deleted (and no longer served), doorbells cleared, then
    /// CSTS.RDY cleared.
    fn reset(&mut self) {
        self.update(|t| *t = QueueTable::default());
        self.queue = None;
        for qid in 0..=SOFT_QUEUES {
            self.state.set_reg(doorbell(qid, false, DSTRD), 0);
            self.state.set_reg(doorbell(qid, true, DSTRD), 0);
        }
        self.enabled = false;
        self.state.fatal.store(false, Ordering::SeqCst);
        self.state.set_reg(reg::CSTS, 0);
    }

    fn enable(&mut self) {
        let s = &self.state;
        let aqa = s.reg(reg::AQA);
        let asq = s.reg(reg::ASQ) as u64 | (s.reg(reg::ASQ + 4) as u64) << 32;
        let acq = s.reg(reg::ACQ) as u64 | (s.reg(reg::ACQ + 4) as u64) << 32;
        let (sq_size, cq_size) = ((aqa & 0xfff) as u16 + 1, (aqa >> 16 & 0xfff) as u16 + 1);
        let page = PAGE as u64;
        if sq_size < 2 || cq_size < 2 || !asq.is_multiple_of(page) || !acq.is_multiple_of(page) {
            s.go_fatal();
        } else {
            s.set_reg(doorbell(0, false, DSTRD), 0);
            s.set_reg(doorbell(0, true, DSTRD), 0);
            let sq = SoftSq::new(SqSpec {
                base: asq,
                size: sq_size,
                cqid: 0,
            });
            let cq = SoftCq::new(
                0,
                CqSpec {
                    base: acq,
                    size: cq_size,
                },
            );
            self.queue = Some((sq, cq));
            s.set_reg(reg::CSTS, csts::RDY);
        }
        self.enabled = true;
    }

    /// Changes the I/O queue table, then waits until every worker serves the new one.
    fn update<R>(&self, change: impl FnOnce(&mut QueueTable) -> R) -> R {
        let s = &self.state;
        let result = change(&mut s.queues.lock_unpoisoned());
        let version = s.queues_version.fetch_add(1, Ordering::AcqRel) + 1;
        let mut idle = 0u32;
        while !s.stop.load(Ordering::Relaxed)
            && s.acked.iter().any(|a| a.load(Ordering::Acquire) < version)
        {
            s.idle(&mut idle);
        }
        result
    }

    fn admin(&mut self, srv: &mut Server<'_>, sqe: &Sqe) -> (Status, u32) {
        let qid = sqe.cdw10 as u16;
        let size = (sqe.cdw10 >> 16) + 1;
        let bad_size = size < 2 || size > self.state.config.max_queue_entries;
        let bad_memory = sqe.cdw11 & 1 == 0 || !sqe.prp1.is_multiple_of(PAGE as u64);
        let status = match sqe.opcode() {
            admin::IDENTIFY => self.identify(srv, sqe),
            admin::CREATE_CQ => self.update(|t| {
                if qid == 0 || qid > SOFT_QUEUES || t.cqs.contains_key(&qid) {
                    Status::INVALID_QUEUE_ID
                } else if bad_size {
                    Status::INVALID_QUEUE_SIZE
                } else if bad_memory {
                    Status::INVALID_FIELD
                } else {
                    // A new queue starts at 0, whatever its doorbell was written to before.
                    self.state.set_reg(doorbell(qid, true, DSTRD), 0);
                    let spec = CqSpec {
                        base: sqe.prp1,
                        size: size as u16,
                    };
                    t.cqs.insert(qid, spec);
                    Status::SUCCESS
                }
            }),
            admin::CREATE_SQ => self.update(|t| {
                let cqid = (sqe.cdw11 >> 16) as u16;
                if qid == 0 || qid > SOFT_QUEUES || t.sqs.contains_key(&qid) {
                    Status::INVALID_QUEUE_ID
                } else if bad_size {
                    Status::INVALID_QUEUE_SIZE
                } else if cqid == 0 || !t.cqs.contains_key(&cqid) {
                    Status::INVALID_CQ
                } else if bad_memory {
                    Status::INVALID_FIELD
                } else {
                    self.state.set_reg(doorbell(qid, false, DSTRD), 0);
                    let spec = SqSpec {
                        base: sqe.prp1,
                        size: size as u16,
                        cqid,
                    };
                    t.sqs.insert(qid, spec);
                    Status::SUCCESS
                }
            }),
            admin::DELETE_SQ => self.update(|t| match t.sqs.remove(&qid) {
                Some(_) if qid != 0 => Status::SUCCESS,
                _ => Status::INVALID_QUEUE_ID,
            }),
            admin::DELETE_CQ => self.update(|t| {
                if qid == 0 || !t.cqs.contains_key(&qid) {
                    Status::INVALID_QUEUE_ID
                } else if t.sqs.values().any(|sq| sq.cqid == qid) {
                    Status::specific(0x0c) // invalid queue deletion
                } else {
                    t.cqs.remove(&qid);
                    Status::SUCCESS
                }
            }),
            admin::SET_FEATURES if sqe.cdw10 & 0xff == admin::FEATURE_NUMBER_OF_QUEUES => {
                // Every doorbell the register page has: SOFT_QUEUES pairs.
                let n = (SOFT_QUEUES - 1) as u32;
                return (Status::SUCCESS, n | n << 16);
            }
            admin::SET_FEATURES => Status::INVALID_FIELD,
            _ => Status::INVALID_OPCODE,
        };
        (status, 0)
    }

    fn identify(&self, srv: &mut Server<'_>, sqe: &Sqe) -> Status {
        let config = &self.state.config;
        let count = config.namespaces.len() as u32;
        let forged = (self.state.faults.lock_unpoisoned().identify.iter())
            .find(|(cns, _)| u32::from(*cns) == sqe.cdw10 & 0xff)
            .map(|(_, page)| page.clone());
        if let Some(page) = forged {
            return queues::transfer_out(srv, sqe, &page);
        }
        let mut data = [0u8; PAGE];
        match sqe.cdw10 & 0xff {
            admin::CNS_CONTROLLER => {
                data[0..2].copy_from_slice(&0x1d1du16.to_le_bytes());
                put_text(&mut data[4..24], "gpuio-soft-0001");
                put_text(&mut data[24..64], "gpuio software NVMe controller");
                put_text(&mut data[64..72], "1.0");
                data[77] = config.mdts;
                data[516..520].copy_from_slice(&count.to_le_bytes());
            }
            admin::CNS_NAMESPACE => {
                if sqe.nsid == 0 || sqe.nsid > count {
                    return Status::INVALID_NAMESPACE;
                }
                let blocks = config.namespaces[sqe.nsid as usize - 1];
                for at in [0, 8, 16] {
                    data[at..at + 8].copy_from_slice(&blocks.to_le_bytes());
                }
                data[128 + 2] = config.block_size.trailing_zeros() as u8;
            }
            admin::CNS_ACTIVE_NAMESPACES => {
                for (i, nsid) in (sqe.nsid.saturating_add(1)..=count).take(1024).enumerate() {
                    data[4 * i..4 * i + 4].copy_from_slice(&nsid.to_le_bytes());
                }
            }
            _ => return Status::INVALID_FIELD,
        }
        queues::transfer_out(srv, sqe, &data)
    }
}

fn put_text(field: &mut [u8], text: &str) {
    field.fill(b' ');
    let n = text.len().min(field.len());
    field[..n].copy_from_slice(&text.as_bytes()[..n]);
}
