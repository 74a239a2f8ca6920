#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod batch;
pub mod cache;
pub mod endpoint;
pub mod engine;
mod error;
pub mod metrics;
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
