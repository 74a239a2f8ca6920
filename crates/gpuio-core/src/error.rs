//! gpuio-core's error type.

use crate::request::{RequestId, Status};
use gpuio_hal::{ErrorCode, HalError};
use gpuio_transport_localio::LocalIoError;
use gpuio_transport_memio::MemIoError;
use gpuio_transport_remoteio::RemoteIoError;

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
    /// The RemoteIO transport failed.
    #[error(transparent)]
    RemoteIo(#[from] RemoteIoError),
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
    /// A status change the state machine forbids (docs/REFERENCE.md#status-machine).
    #[error("request {id}: illegal status change {from:?} -> {to:?}")]
    IllegalTransition {
        /// The request.
        id: RequestId,
        /// Its status.
        from: Status,
        /// The status asked for.
        to: Status,
    },
    /// Every retry of the retry policy (docs/REFERENCE.md#retry-policy) failed. Its code is the
    /// last error's: an agent that never came back is a network error (connection refused), not a
    /// timeout.
    #[error("gave up after {attempts} attempts: {last}")]
    RetriesExhausted {
        /// Attempts made.
        attempts: u32,
        /// The last error.
        last: Box<CoreError>,
    },
    /// The scheduler is shut down (or its workers died).
    #[error("the scheduler is shut down")]
    ShutDown,
    /// An in-flight budget is full (backpressure; `try_submit`).
    #[error("busy: {0}")]
    Busy(String),
    /// The request's timeout passed before it could finish.
    #[error("request {0} timed out")]
    TimedOut(RequestId),
    /// A failure shared by several requests (e.g. the members of one coalesced transfer).
    #[error("{message}")]
    Failed {
        /// The original error's code.
        code: ErrorCode,
        /// The original error.
        message: String,
    },
    /// Some requests of a batch failed; the report names each.
    #[error("{} of {} batch requests failed; first: {}", .0.failed.len(), .0.requests,
            .0.failed.first().map_or("", |f| f.2.as_str()))]
    Batch(Box<crate::BatchReport>),
    /// A broken internal invariant, or a panic caught inside an engine (reported, never
    /// propagated).
    #[error("internal error: {0}")]
    Internal(String),
}

impl CoreError {
    /// This error's code (docs/REFERENCE.md#error-codes).
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Hal(e) => e.code(),
            Self::MemIo(e) => e.code(),
            Self::LocalIo(e) => e.code(),
            Self::RemoteIo(e) => e.code(),
            Self::InvalidRequest(_) => ErrorCode::InvalidArg,
            Self::Unsupported { .. } => ErrorCode::Unsupported,
            Self::Cancelled(_) => ErrorCode::Canceled,
            Self::IllegalTransition { .. } | Self::ShutDown | Self::Internal(_) => {
                ErrorCode::General
            }
            Self::RetriesExhausted { last, .. } => last.code(),
            Self::TimedOut(_) => ErrorCode::Timeout,
            Self::Busy(_) => ErrorCode::Busy,
            Self::Failed { code, .. } => *code,
            Self::Batch(report) => report.failed.first().map_or(ErrorCode::General, |f| f.1),
        }
    }
}

/// The core's result type.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;
