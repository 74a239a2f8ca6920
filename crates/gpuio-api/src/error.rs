//! gpuio-api's error type: every failure a user of the library or the CLI can meet, each
//! mapped to an SDD §7.1 code.

use gpuio_core::{CoreError, ErrorCode};
use gpuio_hal::HalError;
use gpuio_transport_localio::LocalIoError;
use gpuio_transport_memio::MemIoError;
use std::fmt;

/// What is wrong with a URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UriProblem {
    /// Nothing was given.
    Empty,
    /// A scheme gpuio does not know.
    UnknownScheme(String),
    /// A scheme with characters a scheme cannot have.
    BadScheme(String),
    /// The resource part is missing.
    MissingResource {
        /// What was expected there.
        expected: &'static str,
    },
    /// A resource this engine does not have.
    UnknownResource {
        /// What was found.
        found: String,
        /// What is allowed.
        expected: &'static str,
    },
    /// A path that must be absolute is not.
    NotAbsolute(String),
    /// A parameter value of the wrong form.
    BadParam {
        /// The parameter.
        name: String,
        /// Its value.
        value: String,
        /// What it must be.
        expected: &'static str,
    },
    /// A parameter this URI kind does not take.
    UnknownParam {
        /// The parameter.
        name: String,
        /// The ones it takes.
        allowed: &'static str,
    },
    /// A parameter given twice.
    DuplicateParam(String),
    /// A `key` without `=value`.
    MissingValue(String),
    /// A port that is not 1–65535.
    BadPort(String),
    /// A remote URI without a host or segment.
    MissingHost,
    /// A `%` not followed by two hex digits.
    BadPercentEncoding,
    /// `gpu` followed by something other than a device number.
    BadGpuShorthand(String),
}

impl fmt::Display for UriProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => write!(f, "empty URI"),
            Self::UnknownScheme(s) => write!(
                f,
                "unknown scheme {s:?} (expected memio, localio, remoteio, file, gpuio, or gpu<N>)"
            ),
            Self::BadScheme(s) => write!(f, "{s:?} is not a valid scheme"),
            Self::MissingResource { expected } => {
                write!(f, "missing resource: expected {expected}")
            }
            Self::UnknownResource { found, expected } => {
                write!(f, "unknown resource {found:?}: expected {expected}")
            }
            Self::NotAbsolute(p) => write!(f, "path {p:?} must be absolute (scheme:///path)"),
            Self::BadParam {
                name,
                value,
                expected,
            } => write!(f, "parameter {name}={value:?}: expected {expected}"),
            Self::UnknownParam { name, allowed } => {
                write!(f, "unknown parameter {name:?} (allowed: {allowed})")
            }
            Self::DuplicateParam(n) => write!(f, "parameter {n:?} given twice"),
            Self::MissingValue(n) => write!(f, "parameter {n:?} has no value (expected {n}=...)"),
            Self::BadPort(p) => write!(f, "port {p:?} is not a number from 1 to 65535"),
            Self::MissingHost => write!(f, "missing host:port or segment name"),
            Self::BadPercentEncoding => write!(f, "'%' must be followed by two hex digits"),
            Self::BadGpuShorthand(s) => {
                write!(
                    f,
                    "{s:?} is not a GPU: expected gpu<N> with N a device number"
                )
            }
        }
    }
}

/// gpuio-api's errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A transfer, allocation or device operation failed.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// RemoteIO failed (network, protocol, authentication, or the agent refused).
    #[error(transparent)]
    Remote(#[from] gpuio_transport_remoteio::RemoteIoError),
    /// A malformed resource URI.
    #[error("invalid URI {input:?}: {problem} (at byte {position})")]
    Uri {
        /// The URI as given.
        input: String,
        /// Byte offset where the problem starts.
        position: usize,
        /// What is wrong.
        problem: UriProblem,
    },
    /// A configuration file or value that cannot be used.
    #[error("configuration {source_name}: {message}")]
    Config {
        /// The file (or `<built-in>`, or `the environment`).
        source_name: String,
        /// What is wrong.
        message: String,
    },
    /// An environment override that does not parse.
    #[error("environment variable {var}={value:?}: expected {expected}")]
    ConfigEnv {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
        /// What it must be.
        expected: String,
    },
    /// A request that cannot be carried out as asked.
    #[error("{0}")]
    Invalid(String),
    /// A named resource that does not exist (e.g. a segment no agent serves).
    #[error("not found: {0}")]
    NotFound(String),
    /// A path gpuio has but this build or machine does not.
    #[error("{what} is not supported: {reason}")]
    Unsupported {
        /// What was asked.
        what: String,
        /// Why not.
        reason: String,
    },
    /// Verification found the copy differs from its source.
    #[error("verification failed: source crc32c {src:08x}, destination crc32c {dst:08x}")]
    VerifyMismatch {
        /// Source checksum.
        src: u32,
        /// Destination checksum.
        dst: u32,
    },
}

impl Error {
    /// The SDD §7.1 code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Core(e) => e.code(),
            Self::Remote(e) => e.code(),
            Self::Uri { .. } | Self::Config { .. } | Self::ConfigEnv { .. } | Self::Invalid(_) => {
                ErrorCode::InvalidArg
            }
            Self::Unsupported { .. } => ErrorCode::Unsupported,
            Self::NotFound(_) => ErrorCode::NotFound,
            Self::VerifyMismatch { .. } => ErrorCode::Io,
        }
    }
}

impl From<HalError> for Error {
    fn from(e: HalError) -> Self {
        Self::Core(e.into())
    }
}

impl From<MemIoError> for Error {
    fn from(e: MemIoError) -> Self {
        Self::Core(e.into())
    }
}

impl From<LocalIoError> for Error {
    fn from(e: LocalIoError) -> Self {
        Self::Core(e.into())
    }
}

/// gpuio-api's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
