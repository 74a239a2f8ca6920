//! # gpuio-core
//!
//! The core layer (SAD §2.2): the request model and its status machine (SDD §2.3), the SDD
//! §7.1 error codes (re-exported from the HAL) on one error type, the retry policy of SDD §7.2,
//! the [`Engine`] abstraction that adapts each transport, the transport manager
//! ([`Engines`]) that routes transfers, batch planning (SDD §8.1) and dispatch onto worker
//! threads with exactly-once completions.
//!
//! This is the first cut; the scheduler with priorities, deadlines and fairness, the caches
//! and the memory pool build on these types.

#![forbid(unsafe_code)]

pub mod batch;
pub mod endpoint;
pub mod engine;
mod error;
pub mod metrics;
pub mod request;
pub mod resources;
pub mod retry;
pub mod sched;

pub use endpoint::{Dest, Endpoint, EndpointKind, HostMemory, Source};
pub use engine::{Engine, Engines, LocalIoEngine, MemIoEngine, Outcome};
pub use error::{CoreError, Result};
pub use gpuio_hal::ErrorCode;
pub use request::{
    EngineKind, Priority, Request, RequestFlags, RequestId, RequestType, Status, StatusCell,
};
pub use resources::{Load, ResourceReport, ResourceTracker};
pub use retry::RetryPolicy;
pub use sched::{
    BatchHandle, BatchReport, Completion, Policy, RequestHandle, SchedSession, SchedStats,
    Scheduler, SchedulerConfig, SessionOptions, Ticket,
};
