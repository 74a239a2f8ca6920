//! The HAL's error type and the error codes every gpuio error maps to
//! (docs/REFERENCE.md#error-codes).

use serde::Serialize;
use std::fmt;

mod nvme;
pub use nvme::NvmeStatus;

/// The error codes (docs/REFERENCE.md#error-codes). Every error enum in gpuio maps onto one of
/// these, so that callers (and the C-shaped world around them) can branch on a stable code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[repr(i32)]
pub enum ErrorCode {
    /// `GPUIO_ERROR_GENERAL`: an internal or otherwise unclassified failure.
    General = -1,
    /// `GPUIO_ERROR_NOMEM`: host, pinned or device memory exhausted.
    NoMem = -2,
    /// `GPUIO_ERROR_INVALID_ARG`: the caller asked for something malformed or out of range.
    InvalidArg = -3,
    /// `GPUIO_ERROR_NOT_FOUND`: a named resource, device or NUMA node does not exist.
    NotFound = -4,
    /// `GPUIO_ERROR_TIMEOUT`: an operation (or its retries) ran out of time.
    Timeout = -5,
    /// `GPUIO_ERROR_IO`: a storage or device IO failure.
    Io = -6,
    /// `GPUIO_ERROR_NETWORK`: a network failure.
    Network = -7,
    /// `GPUIO_ERROR_UNSUPPORTED`: the path exists in gpuio but not on this machine or build.
    Unsupported = -8,
    /// `GPUIO_ERROR_PERMISSION`: the OS or a peer refused access.
    Permission = -9,
    /// `GPUIO_ERROR_BUSY`: a transient resource shortage; trying again may succeed.
    Busy = -10,
    /// `GPUIO_ERROR_CANCELED`: the request was cancelled before it completed.
    Canceled = -11,
}

impl ErrorCode {
    /// Every code, from -1 down to -11.
    pub const ALL: [ErrorCode; 11] = [
        Self::General,
        Self::NoMem,
        Self::InvalidArg,
        Self::NotFound,
        Self::Timeout,
        Self::Io,
        Self::Network,
        Self::Unsupported,
        Self::Permission,
        Self::Busy,
        Self::Canceled,
    ];

    /// The numeric value (`GPUIO_SUCCESS` is 0 and has no variant).
    pub fn as_i32(self) -> i32 {
        self as i32
    }

    /// The code with value `n`, if there is one.
    pub fn from_i32(n: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_i32() == n)
    }

    /// The C macro name, e.g. `GPUIO_ERROR_NOMEM`.
    pub fn name(self) -> &'static str {
        match self {
            Self::General => "GPUIO_ERROR_GENERAL",
            Self::NoMem => "GPUIO_ERROR_NOMEM",
            Self::InvalidArg => "GPUIO_ERROR_INVALID_ARG",
            Self::NotFound => "GPUIO_ERROR_NOT_FOUND",
            Self::Timeout => "GPUIO_ERROR_TIMEOUT",
            Self::Io => "GPUIO_ERROR_IO",
            Self::Network => "GPUIO_ERROR_NETWORK",
            Self::Unsupported => "GPUIO_ERROR_UNSUPPORTED",
            Self::Permission => "GPUIO_ERROR_PERMISSION",
            Self::Busy => "GPUIO_ERROR_BUSY",
            Self::Canceled => "GPUIO_ERROR_CANCELED",
        }
    }

    /// Whether the retry policy (docs/REFERENCE.md#retry-policy) may try again after this error.
    pub fn is_retryable(self) -> bool {
        matches!(self, Self::Timeout | Self::Network | Self::Busy)
    }

    /// The code for an OS error number (`errno`).
    pub fn from_errno(errno: i32) -> Self {
        match errno {
            libc::ENOMEM => Self::NoMem,
            libc::EINVAL | libc::EFAULT | libc::ERANGE | libc::EISDIR | libc::ENOTDIR => {
                Self::InvalidArg
            }
            libc::ENOENT | libc::ENODEV | libc::ENXIO => Self::NotFound,
            libc::ETIMEDOUT => Self::Timeout,
            libc::EACCES | libc::EPERM | libc::EROFS => Self::Permission,
            libc::EAGAIN | libc::EBUSY | libc::EINTR => Self::Busy,
            libc::ENOSYS | libc::EOPNOTSUPP => Self::Unsupported,
            libc::ECONNRESET | libc::ECONNREFUSED | libc::EPIPE | libc::ENETUNREACH => {
                Self::Network
            }
            libc::ECANCELED => Self::Canceled,
            _ => Self::Io,
        }
    }

    /// The code for a [`std::io::Error`].
    pub fn from_io(err: &std::io::Error) -> Self {
        match err.raw_os_error() {
            Some(errno) => Self::from_errno(errno),
            None => match err.kind() {
                std::io::ErrorKind::NotFound => Self::NotFound,
                std::io::ErrorKind::PermissionDenied => Self::Permission,
                std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData => {
                    Self::InvalidArg
                }
                std::io::ErrorKind::TimedOut => Self::Timeout,
                std::io::ErrorKind::OutOfMemory => Self::NoMem,
                std::io::ErrorKind::Unsupported => Self::Unsupported,
                std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock => Self::Busy,
                _ => Self::Io,
            },
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.as_i32())
    }
}

// ---------------------------------------------------------------------------------------------
// Request-ring results: the negative `result` a completion publishes is an error code, -1 to
// -11, or one of the two codes of the ring itself. They live here, beside the codes, so that
// `HalError::RingRequest` reads them without depending on the ring (gpuio-ring re-exports
// them).

/// `GPUIO_ERROR_RING_UNREGISTERED`: the request's device range is not inside one device
/// buffer registered with the proxy (nothing was read or written).
pub const RESULT_UNREGISTERED: i64 = -64;
/// `GPUIO_ERROR_RING_SHUTDOWN`: the ring shut down before the request was served.
pub const RESULT_SHUT_DOWN: i64 = -65;

/// The `result` a completion publishes for an error of code `code` (docs/REFERENCE.md#error-codes) (a negative
/// result is either such a code, -1 to -11, or one of the two ring codes).
pub fn result_of(code: ErrorCode) -> i64 {
    i64::from(code.as_i32())
}

/// The error code of a negative `result` (the ring codes map to `InvalidArg` and
/// `Canceled`); `None` for a success (≥ 0).
pub fn error_code_of(result: i64) -> Option<ErrorCode> {
    use ErrorCode::*;
    if result >= 0 {
        return None;
    }
    Some(match result {
        RESULT_UNREGISTERED => InvalidArg,
        RESULT_SHUT_DOWN => Canceled,
        _ => i32::try_from(result)
            .ok()
            .and_then(ErrorCode::from_i32)
            .unwrap_or(General),
    })
}

/// The C name of a negative `result`, e.g. `GPUIO_ERROR_NOT_FOUND`.
pub fn result_name(result: i64) -> &'static str {
    match result {
        r if r >= 0 => "success",
        RESULT_UNREGISTERED => "GPUIO_ERROR_RING_UNREGISTERED",
        RESULT_SHUT_DOWN => "GPUIO_ERROR_RING_SHUTDOWN",
        r => match error_code_of(r) {
            Some(c) if result_of(c) == r => c.name(),
            _ => "unknown error",
        },
    }
}

/// What an on-demand array's failure code means: the three the page cache records itself
/// (an index past the end, a store to a read-only array, no frame to be had), else the
/// ring's name for it.
fn ondemand_reason(code: i64) -> String {
    match code {
        -3 => "an index past the array's end (GPUIO_ERROR_INVALID_ARG)".into(),
        -9 => "a store to a read-only array (GPUIO_ERROR_PERMISSION)".into(),
        -10 => "no cache frame could be freed: every frame was pinned or being filled; the \
                cache is too small for the threads using it (GPUIO_ERROR_BUSY)"
            .into(),
        other => format!("{} ({other})", result_name(other)),
    }
}

/// Everything that can go wrong in the HAL.
#[derive(Debug, thiserror::Error)]
pub enum HalError {
    /// A CUDA driver call failed.
    #[error("{op}: CUDA error {name}: {message}")]
    Cuda {
        /// The driver call (or the HAL operation) that failed.
        op: &'static str,
        /// The `CUresult` name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
        /// The driver's description of the error.
        message: String,
        /// The code this maps to.
        code: ErrorCode,
    },
    /// The CUDA backend was asked for but cannot run here.
    #[error("CUDA is not available: {reason}")]
    CudaUnavailable {
        /// Why (no libcuda, cuInit failed, no devices, built without the `cuda` feature).
        reason: String,
    },
    /// NVRTC could not compile a kernel source.
    #[error("NVRTC could not compile {kernel}: {log}")]
    Compile {
        /// The kernel source's name.
        kernel: String,
        /// The compiler's log, or why the compiler could not be loaded.
        log: String,
    },
    /// A kernel module could not be loaded: neither its embedded PTX nor NVRTC's build of its
    /// source.
    #[error("kernel module {kernel} could not be loaded: {reason}")]
    KernelLoad {
        /// The module's name (its file in `kernels/`).
        kernel: String,
        /// What failed, for each way tried.
        reason: String,
    },
    /// An operating-system call failed.
    #[error("{op}: {source}")]
    Os {
        /// What the HAL was doing.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A range reaches outside the buffer it addresses.
    #[error("{what}: range {offset}..{offset}+{len} is outside its {limit}-byte buffer")]
    OutOfRange {
        /// Which side of the operation was out of range.
        what: &'static str,
        /// Start of the requested range.
        offset: u64,
        /// Length of the requested range.
        len: u64,
        /// The buffer's length.
        limit: u64,
    },
    /// A row index names a row past the end of its pool.
    #[error("row index at position {position} is past the pool's {rows} rows")]
    IndexOutOfRange {
        /// Position of the (first) offending index in the index list.
        position: u64,
        /// Rows in the pool.
        rows: u64,
    },
    /// Two sides of an operation disagree on their length.
    #[error("{what}: source has {src} bytes but destination has {dst}")]
    LengthMismatch {
        /// The operation.
        what: &'static str,
        /// Source length.
        src: usize,
        /// Destination length.
        dst: usize,
    },
    /// A malformed argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A NUMA node that this machine does not have.
    #[error("NUMA node {node} is not present (online nodes: {online})")]
    NoSuchNumaNode {
        /// The requested node.
        node: u32,
        /// The nodes that are online, as the kernel lists them.
        online: String,
    },
    /// A GPU ordinal that this machine does not have.
    #[error("GPU {ordinal} is not present ({count} {backend} device(s) found)")]
    NoSuchDevice {
        /// The requested ordinal.
        ordinal: u32,
        /// How many devices the backend has.
        count: usize,
        /// The backend asked.
        backend: &'static str,
    },
    /// A buffer was used with a device it does not belong to.
    #[error("{what} belongs to {owner}, not to {expected}")]
    WrongDevice {
        /// The buffer.
        what: &'static str,
        /// The device that owns it.
        owner: String,
        /// The device the operation runs on.
        expected: String,
    },
    /// Memory could not be allocated.
    #[error("out of memory: could not allocate {len} bytes of {what}")]
    OutOfMemory {
        /// Which kind of memory.
        what: &'static str,
        /// The size asked for.
        len: usize,
    },
    /// More host memory than the machine can back now, beside what this process has
    /// admitted and not yet touched: refused before any page is touched (the kernel does not
    /// reserve them, so it would end in the OOM killer instead).
    #[error(
        "out of memory: {len} bytes of host memory asked for, but this machine can back about \
         {available} bytes more now (available memory and swap, within its cgroup's limit, \
         less {reserved} bytes this process has admitted and not yet touched)"
    )]
    HostMemoryExceeded {
        /// The size asked for.
        len: usize,
        /// What the machine could back when asked, less what was reserved.
        available: u64,
        /// What this process had admitted and not yet touched.
        reserved: u64,
    },
    /// A feature exists but not on this machine or in this build.
    #[error("{what} is not supported here: {reason}")]
    Unsupported {
        /// The feature.
        what: &'static str,
        /// Why not.
        reason: String,
    },
    /// An RDMA verb failed (gpuio-rdma: the HAL defines the variant so that RDMA errors are
    /// `HalError`s like every other device's, and the layers above convert them as they do
    /// the rest).
    #[error("RDMA {op}: {message}")]
    Rdma {
        /// What was being done.
        op: &'static str,
        /// The verbs library's or the completion's description.
        message: String,
        /// The code this maps to (a peer refusing access is `Permission`, a peer that stopped
        /// answering `Network`).
        code: ErrorCode,
    },
    /// A NIXL call failed (gpuio-nixl: defined here for the reason [`HalError::Rdma`] is).
    #[error("NIXL {op}: {message}")]
    Nixl {
        /// What was being done.
        op: &'static str,
        /// NIXL's description.
        message: String,
        /// The code this maps to.
        code: ErrorCode,
    },
    /// The GPU request ring is shutting down or closed: the request was refused, or the ring
    /// shut down before serving it.
    #[error("the request ring is shut down")]
    RingShutDown,
    /// A GPU request-ring request completed with an error result.
    #[error("ring request failed: {} ({code})", result_name(*code))]
    RingRequest {
        /// The negative result the proxy published (an error code or a ring code).
        code: i64,
    },
    /// An on-demand array access failed on the device side of the page cache (an index past
    /// the end, a store to a read-only array, no frame to be had), or a GPU thread's miss or
    /// write-back did (the ring's result code).
    #[error("on-demand array access failed: {}", ondemand_reason(*code))]
    OnDemand {
        /// The negative result recorded (a `GPUIO_ERROR_*` or ring code).
        code: i64,
    },
    /// An NVMe command completed with an error status.
    #[error("NVMe {op} failed: {status}")]
    NvmeCommand {
        /// The command.
        op: &'static str,
        /// The controller's status.
        status: NvmeStatus,
    },
    /// An NVMe controller cannot be driven: it failed (fatal status), is disabled, broke the
    /// queue protocol, or could not be opened.
    #[error("NVMe controller: {reason}")]
    NvmeController {
        /// What happened.
        reason: String,
    },
    /// No NVMe controller at a PCI address (no device there, or one of another class).
    #[error("NVMe controller: no NVMe controller at PCI address {address}")]
    NoSuchNvmeController {
        /// The address, `0000:00:04.0`.
        address: String,
    },
    /// A transient shortage (the staging pool has no room now); trying again later may
    /// succeed.
    #[error("busy: {0}")]
    Busy(String),
    /// A wait ran past its deadline.
    #[error("{what}: timed out after {after:?}")]
    TimedOut {
        /// What was waited for.
        what: &'static str,
        /// How long.
        after: std::time::Duration,
    },
}

impl HalError {
    /// This error's code.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Cuda { code, .. } => *code,
            Self::CudaUnavailable { .. } | Self::Unsupported { .. } => ErrorCode::Unsupported,
            Self::Compile { .. } | Self::KernelLoad { .. } => ErrorCode::General,
            Self::Os { source, .. } => ErrorCode::from_io(source),
            Self::OutOfRange { .. }
            | Self::IndexOutOfRange { .. }
            | Self::LengthMismatch { .. }
            | Self::InvalidArgument(_)
            | Self::WrongDevice { .. } => ErrorCode::InvalidArg,
            Self::NoSuchNumaNode { .. }
            | Self::NoSuchDevice { .. }
            | Self::NoSuchNvmeController { .. } => ErrorCode::NotFound,
            Self::OutOfMemory { .. } | Self::HostMemoryExceeded { .. } => ErrorCode::NoMem,
            Self::RingShutDown => ErrorCode::Canceled,
            Self::RingRequest { code } | Self::OnDemand { code } => {
                error_code_of(*code).unwrap_or(ErrorCode::General)
            }
            Self::TimedOut { .. } => ErrorCode::Timeout,
            Self::Busy(_) => ErrorCode::Busy,
            Self::Rdma { code, .. } | Self::Nixl { code, .. } => *code,
            Self::NvmeCommand { status, .. } => status.error_code(),
            Self::NvmeController { .. } => ErrorCode::Io,
        }
    }

    /// An [`HalError::Os`] from the calling thread's `errno`.
    pub fn last_os(op: &'static str) -> Self {
        Self::Os {
            op,
            source: std::io::Error::last_os_error(),
        }
    }
}

/// The HAL's result type.
pub type Result<T, E = HalError> = std::result::Result<T, E>;

/// Checks that `offset..offset+len` lies inside a buffer of `limit` bytes, without overflow.
pub fn check_range(what: &'static str, offset: usize, len: usize, limit: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= limit => Ok(()),
        _ => Err(HalError::OutOfRange {
            what,
            offset: offset as u64,
            len: len as u64,
            limit: limit as u64,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_match_their_c_values() {
        assert_eq!(ErrorCode::General.as_i32(), -1);
        assert_eq!(ErrorCode::Canceled.as_i32(), -11);
        assert_eq!(ErrorCode::NoMem.name(), "GPUIO_ERROR_NOMEM");
        assert!(ErrorCode::Busy.is_retryable());
        assert!(!ErrorCode::InvalidArg.is_retryable());
    }

    #[test]
    fn range_checks_catch_overflow() {
        assert!(check_range("x", 0, 10, 10).is_ok());
        assert!(check_range("x", 10, 0, 10).is_ok());
        assert!(check_range("x", 1, 10, 10).is_err());
        assert!(check_range("x", usize::MAX, 2, 10).is_err());
    }

    #[test]
    fn errno_mapping() {
        assert_eq!(ErrorCode::from_errno(libc::ENOSPC), ErrorCode::Io);
        assert_eq!(ErrorCode::from_errno(libc::EACCES), ErrorCode::Permission);
        assert_eq!(ErrorCode::from_errno(libc::ENOENT), ErrorCode::NotFound);
    }
}
