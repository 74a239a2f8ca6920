#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod config;
mod copy;
mod error;
mod partial;
mod session;
mod uri;

pub use config::{
    API_VERSION, AgentExport, AgentKey, AgentSection, Config, DEFAULT_TOML, LocalIoSection,
    MAX_CONFIG_BYTES, MAX_SECRET_BYTES, MemIoSection, PoolSize,
};
pub use copy::{CopyOptions, CopyReport};
pub use error::{Error, Result, UriProblem, escape, escape_path};
pub use partial::discard_partial_copies;
pub use session::{Access, REGISTRY_ABSENT, Resource, Session};
pub use uri::{MAX_URI_NESTING, RemoteTarget, RemoteTransport, Uri};

pub use gpuio_core::{
    BatchHandle, BatchReport, Completion, Dest, Endpoint, EngineKind, ErrorCode, HostMemory,
    Outcome, Priority, RemoteResource, RemoteVia, Request, RequestFlags, RequestHandle, RequestId,
    Route, Source, Status,
};
pub use gpuio_hal::{DeviceBuffer, Gpu, PoolStats, StagingPool};
pub use gpuio_transport_localio::{
    Durability, FileHandle, GdsPolicy, IoEngine, OpenOptions, StripeSet, Transfer,
};
pub use gpuio_transport_memio::{HostPlacement, Route as MemIoRoute};
