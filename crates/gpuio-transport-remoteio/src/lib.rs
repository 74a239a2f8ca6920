#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod agent;
pub mod auth;
#[cfg(any(feature = "rdma", feature = "nixl"))]
mod channels;
pub mod connection;
pub mod files;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod peer;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod registry;
pub mod tls;
pub mod wire;

pub use agent::{
    Access, Agent, AgentConfig, AgentStats, Export, ExportSource, SharedMemory, shared_memory,
};
pub use auth::{Key, Role};
pub use connection::{Connection, Credentials, ExportInfo, NixlOffer};
pub use peer::{PeerConfig, PeerStats, RemoteExport, RemotePeer};
#[cfg(feature = "registry")]
pub use registry::{Registry, SegmentRegistration};
pub use registry::{RegistryConfig, SegmentMember};
pub use tls::{TlsClient, TlsServer};

use gpuio_hal::ErrorCode;

/// RemoteIO's errors.
#[derive(Debug, thiserror::Error)]
pub enum RemoteIoError {
    /// The network failed (connect, read, write, a peer that went away).
    #[error("network: {0}")]
    Network(#[from] std::io::Error),
    /// The peer broke the protocol.
    #[error("protocol: {0}")]
    Protocol(#[from] wire::WireError),
    /// The handshake failed: unknown key, wrong key, or a server that could not prove it holds
    /// the key.
    #[error("authentication failed: {0}")]
    Auth(String),
    /// The agent refused or failed a request.
    #[error("the agent answered {code:?}: {message}")]
    Remote {
        /// The error code it sent.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
    /// An export an agent was configured with cannot be served (missing, a directory, not
    /// permitted).
    #[error("export {export:?} ({path:?}): {source}")]
    Export {
        /// The export's name.
        export: String,
        /// Its file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A bad argument on this side (configuration, sizes).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The agent was restarted since the export was first used: it is another instance now,
    /// whose memory exports started afresh. The transfer stopped before it moved any byte to
    /// or from the new instance, so nothing mixes the two; a new [`RemoteExport`] (a resource
    /// opened again) uses the new instance.
    #[error(
        "the agent at {agent} was restarted: export {export:?} is another instance now \
         ({now:#018x}, was {was:#018x}); the transfer stopped before mixing their bytes (open \
         it again to use the new instance)"
    )]
    Restarted {
        /// The agent's address.
        agent: std::net::SocketAddr,
        /// The export's name.
        export: String,
        /// The instance the export was first used on.
        was: u64,
        /// The instance answering now.
        now: u64,
    },
    /// The peer did not answer in time.
    #[error("timed out: {0}")]
    TimedOut(String),
    /// The registry (etcd) failed or could not be reached.
    #[error("registry: {0}")]
    Registry(String),
    /// A local verb or memory operation failed (RDMA, host memory).
    #[error(transparent)]
    Hal(#[from] gpuio_hal::HalError),
}

impl RemoteIoError {
    /// This error's code (docs/REFERENCE.md#error-codes).
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Network(_) | Self::Registry(_) => ErrorCode::Network,
            // A peer that breaks the protocol (or speaks another version) will do it again:
            // not retryable.
            Self::Protocol(_) => ErrorCode::InvalidArg,
            Self::Auth(_) => ErrorCode::Permission,
            Self::Remote { code, .. } => *code,
            // Not retryable: every retry would meet the new instance again.
            Self::Restarted { .. } => ErrorCode::Io,
            Self::InvalidArgument(_) => ErrorCode::InvalidArg,
            Self::Export { source, .. } => ErrorCode::from_io(source),
            Self::TimedOut(_) => ErrorCode::Timeout,
            Self::Hal(e) => e.code(),
        }
    }
}

/// RemoteIO's result type.
pub type Result<T, E = RemoteIoError> = std::result::Result<T, E>;

/// The error code with number `n` (an unknown number is `General`).
pub(crate) fn code_from_i32(n: i32) -> ErrorCode {
    ErrorCode::from_i32(n).unwrap_or(ErrorCode::General)
}
