//! The scheduler's classes and deadlines as C gives them (`gpuio_submit_options_t`, for the
//! `_ex` forms of `gpuio_submit` and `gpuio_batch_submit`).

use crate::error::{Failure, invalid};
use gpuio_api::{Priority, Request};
use std::time::{Duration, Instant};

/// How the scheduler treats a request (`gpuio_submit_ex`, `gpuio_batch_submit_ex`):
/// zero-initialise it for the defaults.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gpuio_submit_options_t {
    /// The class, a `GPUIO_PRIORITY_*` (0 is `GPUIO_PRIORITY_DEFAULT`): a class runs ahead of
    /// the ones after it, never preempting what runs.
    pub priority: i32,
    /// Reserved: 0.
    pub flags: u32,
    /// Due this many nanoseconds from the call (0: no deadline): orders requests within a
    /// class, earliest first, and counts as met or missed in the scheduler's statistics.
    pub deadline_ns: u64,
}

/// The scheduler class: the default, training's forward pass (ordinary foreground work).
pub const GPUIO_PRIORITY_DEFAULT: i32 = 0;
/// User-facing inference: ahead of every other class.
pub const GPUIO_PRIORITY_INFERENCE_REALTIME: i32 = 1;
/// Training's forward pass.
pub const GPUIO_PRIORITY_TRAINING_FORWARD: i32 = 2;
/// Training's backward pass.
pub const GPUIO_PRIORITY_TRAINING_BACKWARD: i32 = 3;
/// Checkpoint writes.
pub const GPUIO_PRIORITY_CHECKPOINT: i32 = 4;
/// Engram write-back.
pub const GPUIO_PRIORITY_ENGRAM_SYNC: i32 = 5;
/// Prefetch and cleanup: behind every other class.
pub const GPUIO_PRIORITY_BACKGROUND: i32 = 6;

/// What `gpuio_submit_options_t` asks of the scheduler, checked once: a class and a deadline,
/// each where given.
#[derive(Clone, Copy, Default)]
pub(crate) struct Scheduling {
    priority: Option<Priority>,
    deadline: Option<Instant>,
}

impl Scheduling {
    /// The options at `opts` (NULL: none), refused where a field is out of range; a deadline
    /// is taken from now.
    ///
    /// # Safety
    /// `opts` is NULL or readable.
    pub(crate) unsafe fn of(opts: *const gpuio_submit_options_t) -> Result<Self, Failure> {
        // SAFETY: the caller's contract.
        let Some(o) = (unsafe { opts.as_ref() }) else {
            return Ok(Self::default());
        };
        if o.flags != 0 {
            return Err(invalid(format!("submit flags {:#x}: reserved, 0", o.flags)));
        }
        let priority = match o.priority {
            GPUIO_PRIORITY_DEFAULT | GPUIO_PRIORITY_TRAINING_FORWARD => Priority::TrainingForward,
            GPUIO_PRIORITY_INFERENCE_REALTIME => Priority::InferenceRealtime,
            GPUIO_PRIORITY_TRAINING_BACKWARD => Priority::TrainingBackward,
            GPUIO_PRIORITY_CHECKPOINT => Priority::Checkpoint,
            GPUIO_PRIORITY_ENGRAM_SYNC => Priority::EngramSync,
            GPUIO_PRIORITY_BACKGROUND => Priority::Background,
            p => return Err(invalid(format!("priority {p}: one of GPUIO_PRIORITY_*"))),
        };
        let deadline = match o.deadline_ns {
            0 => None,
            ns => Some(
                Instant::now()
                    .checked_add(Duration::from_nanos(ns))
                    .ok_or_else(|| invalid(format!("a deadline {ns} ns away")))?,
            ),
        };
        Ok(Self {
            priority: Some(priority),
            deadline,
        })
    }

    /// `req` in this class and with this deadline.
    pub(crate) fn apply(&self, mut req: Request) -> Request {
        if let Some(p) = self.priority {
            req = req.with_priority(p);
        }
        if let Some(d) = self.deadline {
            req = req.with_deadline(d);
        }
        req
    }
}
