//! gpuio's AI memory tier, on top of the library (nothing in gpuio depends on it): KV-cache
//! compression and tiers for sparse attention, Engram tables, graph gathers for retrieval, and
//! the context that maps AI work onto the scheduler's priority classes.
//!
//! - [`compress`]: KV quantization (FP16, FP8 E4M3, INT8, 4-bit) with error bounds, and LZ4 /
//!   ZSTD frames verified by crc32c.
//! - [`graph`]: Graph RAG — top-k candidates, k-hop expansion over CSR adjacency, and the
//!   subgraph's embeddings gathered from host memory or a file into one device buffer.

pub mod compress;
pub mod graph;

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
            Self::Api(e) => e.code(),
        }
    }
}

/// gpuio-ai's result type.
pub type Result<T, E = AiError> = std::result::Result<T, E>;
