//! The batch API (`cuFileBatchIO*`): a batch holds up to the `nr` entries it was set up with;
//! each submitted entry runs on the batch worker threads (`EXECUTION_MAX_IO_THREADS` of them,
//! shared by all batches) through [`io::run`], and its completion waits in the batch until
//! `cuFileBatchIOGetStatus` collects it.

use crate::abi::{self, CUfileIOEvents_t};
use crate::driver::DRIVER;
use crate::fault::{Fault, Result};
use crate::io::{self, Io};
use crate::params::MAX_IO_THREADS;
use crossbeam_channel::{Sender, unbounded};
use gpuio_api::Session;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// One finished entry.
#[derive(Clone, Copy)]
struct Done {
    cookie: usize,
    status: abi::CUfileStatus_t,
    ret: usize,
}

#[derive(Default)]
struct Slots {
    /// Submitted and not yet collected.
    outstanding: usize,
    /// Running on a worker now.
    running: usize,
    done: VecDeque<Done>,
}

/// A batch.
pub struct Batch {
    capacity: usize,
    slots: Mutex<Slots>,
    changed: Condvar,
    /// Bumped by every cancel: an entry submitted before it does not start.
    epoch: AtomicU64,
}

type Job = Box<dyn FnOnce() + Send>;

/// The workers' queue, started with the first submission.
fn workers() -> &'static Sender<Job> {
    static QUEUE: OnceLock<Sender<Job>> = OnceLock::new();
    QUEUE.get_or_init(|| {
        let (tx, rx) = unbounded::<Job>();
        let n = DRIVER.params().size(MAX_IO_THREADS).max(1);
        for i in 0..n {
            let rx = rx.clone();
            // A worker that cannot start leaves the others; with none, submit fails below.
            let _ = std::thread::Builder::new()
                .name(format!("cufile-batch-{i}"))
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                });
        }
        tx
    })
}

impl Batch {
    /// `cuFileBatchIOSetUp`: a batch of up to `nr` entries.
    pub fn new(nr: usize) -> Result<Self> {
        let most = DRIVER.params().size(crate::params::IO_BATCHSIZE);
        if nr == 0 || nr > most {
            return Err(Fault::invalid(format!(
                "a batch holds 1 to {most} entries (PROPERTIES_IO_BATCHSIZE), not {nr}"
            )));
        }
        Ok(Self {
            capacity: nr,
            slots: Mutex::new(Slots::default()),
            changed: Condvar::new(),
            epoch: AtomicU64::new(0),
        })
    }

    fn slots(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `cuFileBatchIOSubmit`: every entry is checked before any runs.
    pub fn submit(
        self: &Arc<Self>,
        session: &Arc<Session>,
        entries: &[abi::CUfileIOParams_t],
    ) -> Result<()> {
        let mut ios = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let direction = match e.opcode {
                abi::CUFILE_READ => io::Direction::Read,
                abi::CUFILE_WRITE => io::Direction::Write,
                op => return Err(Fault::invalid(format!("entry {i}: opcode {op}"))),
            };
            if e.mode != abi::CUFILE_BATCH {
                return Err(Fault::invalid(format!("entry {i}: mode {}", e.mode)));
            }
            io::handle(e.fh as usize)?;
            let io = Io {
                direction,
                handle: e.fh as usize,
                base: e.batch.devPtr_base as u64,
                buf_offset: e.batch.devPtr_offset,
                size: e.batch.size,
                file_offset: e.batch.file_offset,
            };
            ios.push((io, e.cookie as usize));
        }
        {
            let mut s = self.slots();
            if s.outstanding + ios.len() > self.capacity {
                return Err(Fault::new(
                    abi::CU_FILE_BATCH_FULL,
                    format!(
                        "{} entries outstanding, {} more, in a batch of {}",
                        s.outstanding,
                        ios.len(),
                        self.capacity
                    ),
                ));
            }
            s.outstanding += ios.len();
        }
        let epoch = self.epoch.load(Ordering::Relaxed);
        let queue = workers();
        for (io, cookie) in ios {
            let (batch, session) = (self.clone(), session.clone());
            DRIVER.stats.batch_enqueued.count(true);
            let job: Job = Box::new(move || batch.run(&session, io, cookie, epoch));
            if let Err(e) = queue.send(job) {
                // No worker is left to run it: it fails, and says so in its event.
                (e.into_inner())();
            }
        }
        Ok(())
    }

    fn run(&self, session: &Session, io: Io, cookie: usize, epoch: u64) {
        {
            let mut s = self.slots();
            if self.epoch.load(Ordering::Relaxed) != epoch {
                s.done.push_back(Done {
                    cookie,
                    status: abi::CUFILE_CANCELED,
                    ret: 0,
                });
                self.changed.notify_all();
                return;
            }
            s.running += 1;
        }
        let result = io::run(session, io);
        if let Ok(n) = result {
            let bytes = match io.direction {
                io::Direction::Read => &DRIVER.stats.batch_read_bytes,
                io::Direction::Write => &DRIVER.stats.batch_write_bytes,
            };
            bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
        DRIVER.stats.batch_complete.count(result.is_ok());
        let done = match result {
            Ok(n) => Done {
                cookie,
                status: abi::CUFILE_COMPLETE,
                ret: n,
            },
            Err(f) => Done {
                cookie,
                status: abi::CUFILE_FAILED,
                ret: f.negated() as usize,
            },
        };
        let mut s = self.slots();
        s.running -= 1;
        s.done.push_back(done);
        self.changed.notify_all();
    }

    /// `cuFileBatchIOGetStatus`: waits until `min_nr` entries have finished (or `timeout`
    /// passes), then hands over up to `events.len()` of them; how many.
    pub fn collect(
        &self,
        min_nr: usize,
        events: &mut [CUfileIOEvents_t],
        timeout: Option<Duration>,
    ) -> Result<usize> {
        if min_nr > events.len() {
            return Err(Fault::invalid(format!(
                "min_nr {min_nr} is more than the {} events asked for",
                events.len()
            )));
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut s = self.slots();
        while s.done.len() < min_nr.min(s.outstanding) {
            s = match deadline {
                None => self.changed.wait(s).unwrap_or_else(PoisonError::into_inner),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    self.changed
                        .wait_timeout(s, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
        let n = s.done.len().min(events.len());
        for ev in events.iter_mut().take(n) {
            let Some(d) = s.done.pop_front() else { break };
            *ev = CUfileIOEvents_t {
                cookie: d.cookie as *mut std::ffi::c_void,
                status: d.status,
                ret: d.ret,
            };
        }
        s.outstanding -= n;
        Ok(n)
    }

    /// `cuFileBatchIOCancel`: entries not yet started finish as canceled.
    pub fn cancel(&self) {
        // Under the lock, so that no entry is between its check and its start.
        let _s = self.slots();
        self.epoch.fetch_add(1, Ordering::Relaxed);
    }

    /// Cancels, then waits for the entries already running (their memory may be freed once
    /// the program destroys the batch).
    pub fn cancel_and_wait(&self) {
        self.cancel();
        let mut s = self.slots();
        while s.running > 0 {
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Batch {
    /// The entries it holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}
