//! # gpuio-api
//!
//! The library interface of gpuio (docs/REFERENCE.md#explicit-api): a [`Session`] built from a
//! [`Config`] (TOML, environment overrides), resources named by [`Uri`]s, and the explicit API —
//! blocking transfers, asynchronous ones (handles that are futures, or callbacks) and batches
//! that are sorted, coalesced and grouped by engine. [`Session::copy`] is what
//! `gpuio cp` runs.
//!
//! ```
//! use gpuio_api::{Config, Endpoint, Session, HostPlacement};
//! # fn main() -> gpuio_api::Result<()> {
//! let session = Session::new(Config::default())?;
//! let dev = session.alloc_device(0, 4 << 20)?;
//! let host = session.alloc_host(HostPlacement::Dram { numa: None }, 4 << 20, true)?;
//! host.write().fill(3);
//! // Asynchronous: the handle is a future, or can be waited on.
//! let done = session
//!     .transfer_async(Endpoint::host(&host, 0), Endpoint::device(&dev, 0), 4 << 20)?
//!     .wait()?;
//! assert_eq!(done.outcome.bytes, 4 << 20);
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

mod config;
mod copy;
mod error;
mod partial;
mod session;
mod uri;

pub use config::{
    API_VERSION, AgentExport, AgentKey, AgentSection, Config, DEFAULT_TOML, LocalIoSection,
    MAX_CONFIG_BYTES, MAX_SECRET_BYTES, MemIoSection,
};
pub use copy::{CopyOptions, CopyReport};
pub use error::{Error, Result, UriProblem, escape, escape_path};
pub use partial::discard_partial_copies;
pub use session::{Access, REGISTRY_ABSENT, Resource, Session};
pub use uri::{MAX_URI_NESTING, RemoteTarget, RemoteTransport, Uri};

pub use gpuio_core::{
    BatchHandle, BatchReport, Completion, Dest, Endpoint, EngineKind, ErrorCode, HostMemory,
    Outcome, Priority, RemoteResource, Request, RequestFlags, RequestHandle, RequestId, Source,
    Status,
};
pub use gpuio_hal::{DeviceBuffer, Gpu};
pub use gpuio_transport_localio::{
    Durability, FileHandle, GdsPolicy, IoEngine, OpenOptions, StripeSet, Transfer,
};
pub use gpuio_transport_memio::{HostPlacement, Route};
