//! The AI context: the pools one serving or training process holds (KV sequences, Engram
//! tables) beside its session, and the mapping of AI work onto the scheduler's priority classes
//! and deadlines. Inference IO gets the realtime class and a deadline that leaves room for the
//! compute after it; training, checkpoints, Engram write-back and prefetch get their classes,
//! in that order of urgency.
//!
//! The tier's own IO — KV loads and stores, Engram lookups, stores, prefetch and write-back,
//! graph gathers — runs outside the scheduler's workers (device gathers and scatters), so each
//! call holds a scheduler lease of its work's class ([`AiWork::lease`]) while it moves data:
//! less urgent leases and queued requests wait for it, so a decode step's loads are not
//! queued behind a prefetch or a checkpoint.

use crate::kv::{KvPool, KvPoolConfig};
use crate::{AiError, Result, engram::EngramTable};
use gpuio_api::{Endpoint, Lease, Lessor, Priority, Request, RequestHandle, Session};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How much an inference request matters when IO is short.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Criticality {
    /// May wait behind training's foreground IO.
    BestEffort,
    /// Realtime: ahead of everything but never preempting what runs.
    #[default]
    Standard,
}

/// An inference request's quality of service: when its answer is due, how long its compute
/// takes once its data is there, and how much it matters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InferenceQos {
    /// From submission to when the answer is due.
    pub deadline: Duration,
    /// The compute that follows the IO.
    pub estimated_duration: Duration,
    /// How it ranks against other IO.
    pub criticality: Criticality,
}

/// Work the AI tier does IO for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AiWork {
    /// A decode or prefill step whose deadline is not given: the realtime class, no deadline.
    /// What the KV pools and Engram lookups do IO for unless told otherwise.
    Decode,
    /// Serving a request.
    Inference(InferenceQos),
    /// A training step's forward (or, `backward`, backward) pass.
    TrainingStep {
        /// The backward pass.
        backward: bool,
    },
    /// Writing a checkpoint.
    Checkpoint,
    /// Writing Engram rows back.
    EngramSync,
    /// Reading ahead of need.
    Prefetch,
}

impl AiWork {
    /// The scheduler class.
    pub fn priority(&self) -> Priority {
        match self {
            Self::Inference(q) if q.criticality == Criticality::BestEffort => {
                Priority::TrainingForward
            }
            Self::Decode | Self::Inference(_) => Priority::InferenceRealtime,
            Self::TrainingStep { backward: false } => Priority::TrainingForward,
            Self::TrainingStep { backward: true } => Priority::TrainingBackward,
            Self::Checkpoint => Priority::Checkpoint,
            Self::EngramSync => Priority::EngramSync,
            Self::Prefetch => Priority::Background,
        }
    }

    /// When the IO must be done for work submitted `now` (inference only: its deadline less
    /// its compute). An inference whose compute alone outlasts its deadline is refused: no IO
    /// could be on time.
    pub fn io_deadline(&self, now: Instant) -> Result<Option<Instant>> {
        match self {
            Self::Inference(q) => {
                let slack = q.deadline.checked_sub(q.estimated_duration).ok_or_else(|| {
                    AiError::InvalidArgument(format!(
                        "an inference due in {:?} whose compute takes {:?} leaves no time for IO",
                        q.deadline, q.estimated_duration
                    ))
                })?;
                now.checked_add(slack).map(Some).ok_or_else(|| {
                    AiError::InvalidArgument(format!("an inference due in {:?}", q.deadline))
                })
            }
            _ => Ok(None),
        }
    }
}

impl AiWork {
    /// Holds this work's class on `lessor`'s scheduler, with its IO deadline where it has one
    /// (counted as met or missed when the lease ends), for IO that runs outside the workers.
    pub fn lease(&self, lessor: &Lessor) -> Result<Lease> {
        Ok(lessor.lease(self.priority(), self.io_deadline(Instant::now())?))
    }

    /// This work, refused where it leaves no time for IO (what `set_work` takes).
    pub fn checked(self) -> Result<Self> {
        self.io_deadline(Instant::now())?;
        Ok(self)
    }

    /// [`lease`](Self::lease) on `session`'s scheduler.
    pub fn lease_in(&self, session: &Session) -> Result<Lease> {
        session.check_process()?;
        Ok(session.lease(self.priority(), self.io_deadline(Instant::now())?))
    }
}

/// The pools of one process and the session they move data through.
#[derive(Debug)]
pub struct AiContext {
    session: Arc<Session>,
    sequences: HashMap<u64, KvPool>,
    engram: Vec<EngramTable>,
}

impl AiContext {
    /// A context over `session`, holding nothing yet.
    pub fn new(session: Arc<Session>) -> Self {
        Self {
            session,
            sequences: HashMap::new(),
            engram: Vec::new(),
        }
    }

    /// The session.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Opens sequence `id`'s KV pool (an error if it is open).
    pub fn open_sequence(&mut self, id: u64, cfg: KvPoolConfig) -> Result<&mut KvPool> {
        if self.sequences.contains_key(&id) {
            return Err(AiError::InvalidArgument(format!("sequence {id} is open")));
        }
        let pool = KvPool::new(&self.session, cfg)?;
        Ok(self.sequences.entry(id).or_insert(pool))
    }

    /// Sequence `id`'s KV pool, with the session to load through.
    pub fn sequence(&mut self, id: u64) -> Option<(&Session, &mut KvPool)> {
        let s = &*self.session;
        self.sequences.get_mut(&id).map(|p| (s, p))
    }

    /// Closes sequence `id`, freeing its memory; whether it was open.
    pub fn close_sequence(&mut self, id: u64) -> bool {
        self.sequences.remove(&id).is_some()
    }

    /// Adds an Engram table; its index.
    pub fn add_engram_table(&mut self, table: EngramTable) -> usize {
        self.engram.push(table);
        self.engram.len() - 1
    }

    /// Engram table `i`.
    pub fn engram_table(&self, i: usize) -> Option<&EngramTable> {
        self.engram.get(i)
    }

    /// A request for `work`: its class, and its deadline where it has one.
    pub fn request(
        &self,
        work: &AiWork,
        src: Endpoint,
        dst: Endpoint,
        len: usize,
    ) -> Result<Request> {
        let mut req = Request::new(src, dst, len)
            .map_err(gpuio_api::Error::from)?
            .with_priority(work.priority());
        if let Some(d) = work.io_deadline(Instant::now())? {
            req = req.with_deadline(d);
        }
        Ok(req)
    }

    /// Queues a request for `work` on the session's scheduler.
    pub fn submit(
        &self,
        work: &AiWork,
        src: Endpoint,
        dst: Endpoint,
        len: usize,
    ) -> Result<RequestHandle> {
        Ok(self.session.submit(self.request(work, src, dst, len)?)?)
    }
}
