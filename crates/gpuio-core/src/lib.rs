//! # gpuio-core
//!
//! The core engine layer (docs/REFERENCE.md#layers): many clients with different priorities and
//! deadlines share the transports fairly, fast and safely.
//!
//! - The request model and its status machine (docs/REFERENCE.md#requests); one error type
//!   with the error codes (docs/REFERENCE.md#error-codes); the retry policy
//!   (docs/REFERENCE.md#retry-policy).
//! - [`Engines`], the transport manager: routing to the transport [`Engine`]s, retries,
//!   failover across replicas, load per resource ([`ResourceTracker`]).
//! - [`Scheduler`] (docs/REFERENCE.md#scheduling): per-engine queues, EDF, CFS fairness across
//!   sessions, the AI priority classes, work-stealing workers, chunking and coalescing,
//!   backpressure, exactly-once completions; batch planning (docs/REFERENCE.md#batches).
//! - [`cache::BlockCache`] (docs/REFERENCE.md#block-cache): L1 GPU / L2 host / L3 SSD with
//!   coherence states and a prefetcher; [`pool::StagingPool`]: pinned staging memory under a limit;
//!   [`regcache::RegistrationCache`] (docs/REFERENCE.md#registration-cache).
//! - [`RingProxy`]: the host side of the GPU→host request ring — serves the
//!   IO requests GPU threads post, through the engines.
//! - [`metrics`]: what all of this reports through the `metrics` facade.

#![forbid(unsafe_code)]

pub mod batch;
pub mod cache;
pub mod endpoint;
pub mod engine;
mod error;
pub mod metrics;
pub mod pool;
pub mod regcache;
pub mod request;
pub mod resources;
pub mod retry;
pub mod ring;
pub mod sched;

pub use endpoint::{Dest, Endpoint, EndpointKind, HostMemory, RemoteResource, Source};
pub use engine::{Engine, Engines, LocalIoEngine, MemIoEngine, Outcome, RemoteIoEngine};
pub use error::{CoreError, Result};
pub use gpuio_hal::ErrorCode;
pub use request::{
    EngineKind, Priority, Request, RequestFlags, RequestId, RequestType, Status, StatusCell,
};
pub use resources::{Load, ResourceReport, ResourceTracker};
pub use retry::RetryPolicy;
pub use ring::{RingConfig, RingProxy, RingStats};
pub use sched::{
    BatchHandle, BatchReport, Completion, Policy, RequestHandle, SchedSession, SchedStats,
    Scheduler, SchedulerConfig, SessionOptions, Ticket,
};
