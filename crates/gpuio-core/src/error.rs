//! gpuio-core's error type.

use crate::request::{RequestId, Status};
use gpuio_hal::{ErrorCode, HalError};
use gpuio_transport_localio::LocalIoError;
use gpuio_transport_memio::MemIoError;

/// Everything that can go wrong in the core, including the transports' errors it passes on.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// The HAL failed.
    #[error(transparent)]
    Hal(#[from] HalError),
    /// The MemIO transport failed.
    #[error(transparent)]
    MemIo(#[from] MemIoError),
    /// The LocalIO transport failed.
    #[error(transparent)]
    LocalIo(#[from] LocalIoError),
    /// A request that cannot be carried out as described.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// No engine of this build serves the request.
    #[error("{what} is not supported: {reason}")]
    Unsupported {
        /// What was asked.
        what: String,
        /// Why it cannot be done.
        reason: String,
    },
    /// The request was cancelled before it ran.
    #[error("request {0} was cancelled")]
    Cancelled(RequestId),
    /// A status change the state machine forbids (SDD §2.3).
    #[error("request {id}: illegal status change {from:?} -> {to:?}")]
    IllegalTransition {
        /// The request.
        id: RequestId,
        /// Its status.
        from: Status,
        /// The status asked for.
        to: Status,
    },
    /// Every retry of the SDD §7.2 policy failed.
    #[error("gave up after {attempts} attempts: {last}")]
    RetriesExhausted {
        /// Attempts made.
        attempts: u32,
        /// The last error.
        last: Box<CoreError>,
    },
    /// The dispatcher is shut down (or its workers died).
    #[error("the dispatcher is shut down")]
    ShutDown,
}

impl CoreError {
    /// The SDD §7.1 code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Hal(e) => e.code(),
            Self::MemIo(e) => e.code(),
            Self::LocalIo(e) => e.code(),
            Self::InvalidRequest(_) => ErrorCode::InvalidArg,
            Self::Unsupported { .. } => ErrorCode::Unsupported,
            Self::Cancelled(_) => ErrorCode::Canceled,
            Self::IllegalTransition { .. } | Self::ShutDown => ErrorCode::General,
            Self::RetriesExhausted { .. } => ErrorCode::Timeout,
        }
    }
}

/// The core's result type.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;
