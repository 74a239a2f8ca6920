#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod cached;
mod config;
mod copy;
mod error;
mod partial;
pub mod safetensors;
mod session;
mod uri;

pub use cached::CachedFile;
pub use config::{
    API_VERSION, AgentExport, AgentKey, AgentSection, CacheSection, Config, DEFAULT_TOML,
    LocalIoSection, MAX_CACHE_BLOCKS, MAX_CACHE_L3, MAX_CACHE_MEMORY, MAX_CONFIG_BYTES,
    MAX_SECRET_BYTES, MIN_CACHE_BLOCK, MemIoSection, PoolSize, WritePolicy,
};
pub use copy::{CopyOptions, CopyReport};
pub use error::{Error, Result, UriProblem, escape, escape_path};
pub use partial::discard_partial_copies;
pub use session::{Access, REGISTRY_ABSENT, Resource, Session};
pub use uri::{MAX_URI_NESTING, RemoteTarget, RemoteTransport, Uri};

pub use gpuio_core::cache::{CacheStats, Level as CacheLevel, LevelStats as CacheLevelStats};
pub use gpuio_core::ondemand::{
    ArrayMode, ArrayStats, Element, OnDemandArray, PageCache, PageCacheConfig, ResidentArray,
};
pub use gpuio_core::{
    BatchHandle, BatchReport, Completion, Dest, Endpoint, EngineKind, ErrorCode, HostMemory, Lease,
    Lessor, Outcome, Policy, Priority, RemoteResource, RemoteVia, Request, RequestFlags,
    RequestHandle, RequestId, Route, Source, Status, Ticket,
};
pub use gpuio_hal::{Backend, DeviceBuffer, Gpu};
pub use gpuio_ring::DEVICE_HEADER;
pub use gpuio_ring::ondemand::{ArrayDevice, ResidentDevice};
pub use gpuio_staging::{PoolStats, StagingPool};
pub use gpuio_transport_localio::{
    Durability, FileHandle, GdsPolicy, IoEngine, OpenOptions, PageCachePolicy, PageCacheStats,
    StripeSet, Transfer,
};
pub use gpuio_transport_memio::{HostPlacement, Route as MemIoRoute};
