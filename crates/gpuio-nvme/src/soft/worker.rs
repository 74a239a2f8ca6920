//! A software controller worker: serves the I/O queues whose completion queue number is its
//! own modulo the worker count, reading and writing the RAM namespaces.

use super::super::spec::{Sqe, Status, io};
use super::queues::{self, Server, SoftCq, SoftSq};
use super::{MapView, SoftFaults, State};
use gpuio_hal::sync::MutexExt;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub(super) struct Worker {
    state: Arc<State>,
    index: usize,
    /// The queue table version served.
    version: u64,
    sqs: BTreeMap<u16, SoftSq>,
    cqs: BTreeMap<u16, SoftCq>,
    faults: SoftFaults,
    faults_version: u64,
    view: MapView,
}

impl Worker {
    pub(super) fn new(state: Arc<State>, index: usize) -> Self {
        // Thread 0 is the admin thread.
        let view = state.mapper.view(index + 1);
        Self {
            view,
            state,
            index,
            version: 0,
            sqs: BTreeMap::new(),
            cqs: BTreeMap::new(),
            faults: SoftFaults::default(),
            faults_version: 0,
        }
    }

    pub(super) fn serve(mut self) {
        let mut idle = 0u32;
        while !self.state.stop.load(Ordering::Relaxed) {
            let version = self.state.queues_version.load(Ordering::Acquire);
            if version != self.version {
                self.sync(version);
            }
            let faults_version = self.state.faults_version.load(Ordering::Acquire);
            if faults_version != self.faults_version {
                self.faults = self.state.faults.lock_unpoisoned().clone();
                self.faults_version = faults_version;
            }
            self.state.mapper.refresh(&mut self.view);
            let mut worked = false;
            if !self.faults.hang && !self.state.fatal.load(Ordering::Relaxed) {
                let state = &*self.state;
                let faults = &self.faults;
                let mut srv = Server {
                    state,
                    view: &mut self.view,
                    index: self.index + 1,
                };
                for (&qid, sq) in self.sqs.iter_mut() {
                    let Some(cq) = self.cqs.get_mut(&sq.spec.cqid) else {
                        continue;
                    };
                    worked |= queues::serve(&mut srv, qid, sq, cq, faults, |srv, sqe| {
                        (execute(srv, sqe, faults), 0)
                    });
                    if state.fatal.load(Ordering::Relaxed) {
                        break;
                    }
                }
            }
            if worked {
                idle = 0;
            } else {
                self.state.idle(&mut idle);
            }
        }
    }

    /// Takes up queue table `version`: its own queues, keeping the state of those unchanged;
    /// then acknowledges it, after which it no longer touches queues the table dropped.
    fn sync(&mut self, version: u64) {
        let workers = self.state.acked.len();
        let mine = |cqid: u16| cqid as usize % workers == self.index;
        {
            let table = self.state.queues.lock_unpoisoned();
            let mut cqs = BTreeMap::new();
            for (&id, &spec) in table.cqs.iter().filter(|(id, _)| mine(**id)) {
                let cq = match self.cqs.remove(&id) {
                    Some(cq) if cq.spec == spec => cq,
                    _ => SoftCq::new(id, spec),
                };
                cqs.insert(id, cq);
            }
            let mut sqs = BTreeMap::new();
            for (&id, &spec) in table.sqs.iter().filter(|(_, s)| mine(s.cqid)) {
                let sq = match self.sqs.remove(&id) {
                    Some(sq) if sq.spec == spec => sq,
                    _ => SoftSq::new(spec),
                };
                sqs.insert(id, sq);
            }
            (self.sqs, self.cqs) = (sqs, cqs);
        }
        self.version = version;
        self.state.acked[self.index].store(version, Ordering::Release);
    }
}

/// Runs one I/O command against the namespaces.
fn execute(srv: &mut Server<'_>, sqe: &Sqe, faults: &SoftFaults) -> Status {
    let state = srv.state;
    let config = &state.config;
    let count = config.namespaces.len() as u32;
    if sqe.nsid == 0 || sqe.nsid > count {
        return Status::INVALID_NAMESPACE;
    }
    match sqe.opcode() {
        io::FLUSH => Status::SUCCESS,
        op @ (io::READ | io::WRITE) => {
            let index = sqe.nsid as usize - 1;
            let blocks = config.namespaces[index];
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
            let bs = config.block_size as usize;
            let (from, len) = (lba as usize * bs, n as usize * bs);
            let ns = &state.namespaces[index];
            // A read moves namespace bytes to the device side; a write the other way.
            queues::transfer(srv, sqe, len, |srv, at, off, piece| {
                let view = &mut *srv.view;
                state
                    .mapper
                    .with_namespace(view, at, ns, from + off, piece, read)
            })
        }
        _ => Status::INVALID_OPCODE,
    }
}
