#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod compress;
pub mod context;
pub mod engram;
pub mod graph;
pub mod kv;

use gpuio_hal::ErrorCode;

/// gpuio-ai's errors.
#[derive(Debug, thiserror::Error)]
pub enum AiError {
    /// An argument outside what the call takes.
    #[error("{0}")]
    InvalidArgument(String),
    /// Data that fails its own checks (a damaged frame, a checksum that does not match).
    #[error("{0}")]
    Corrupt(String),
    /// A tier has no room for what must go there.
    #[error("{0}")]
    TierFull(String),
    /// A fault inside gpuio-ai (a worker thread that panicked).
    #[error("internal error: {0}")]
    Internal(String),
    /// The library below failed.
    #[error(transparent)]
    Api(#[from] gpuio_api::Error),
}

impl AiError {
    /// This error's code (docs/REFERENCE.md#error-codes).
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::InvalidArgument(_) => ErrorCode::InvalidArg,
            Self::Corrupt(_) => ErrorCode::Io,
            Self::TierFull(_) => ErrorCode::NoMem,
            Self::Internal(_) => ErrorCode::General,
            Self::Api(e) => e.code(),
        }
    }
}

impl From<gpuio_hal::HalError> for AiError {
    fn from(e: gpuio_hal::HalError) -> Self {
        Self::Api(e.into())
    }
}

impl From<gpuio_hal::workers::WorkerPanic> for AiError {
    fn from(p: gpuio_hal::workers::WorkerPanic) -> Self {
        Self::Internal(p.to_string())
    }
}

/// gpuio-ai's result type.
pub type Result<T, E = AiError> = std::result::Result<T, E>;

pub use context::{AiContext, AiWork, Criticality, InferenceQos};
