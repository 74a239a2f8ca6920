#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod batch;
pub mod cache;
pub mod endpoint;
pub mod engine;
mod error;
pub mod metrics;
pub mod ondemand;
pub mod outcome;
pub mod regcache;
pub mod request;
pub mod resources;
pub mod retry;
pub mod ring;
pub mod route;
pub mod sched;

pub use endpoint::{Dest, Endpoint, EndpointKind, HostMemory, RemoteResource, Source};
pub use engine::{Engine, Engines, LocalIoEngine, MemIoEngine, RemoteIoEngine};
pub use error::{CoreError, Result};
pub use gpuio_hal::ErrorCode;
pub use outcome::{Outcome, RemoteVia, Route};
pub use request::{Priority, Request, RequestFlags, RequestId, RequestType, Status};
pub use resources::{Load, ResourceTracker};
pub use retry::RetryPolicy;
pub use ring::{RingConfig, RingProxy, RingStats};
pub use route::{EngineKind, Transfer};
pub use sched::{
    BatchHandle, BatchReport, Completion, Lease, Lessor, Policy, RequestHandle, SchedSession,
    SchedStats, Scheduler, SchedulerConfig, SessionOptions, Ticket,
};
