//! Error codes (docs/REFERENCE.md#error-codes, shared with Rust's `ErrorCode` and Python's
//! `gpuio.Error`), the calling thread's last error message, and [`call`]: how every entry
//! point runs, so that no panic crosses into C.

use gpuio_api::ErrorCode;
use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

/// Success.
pub const GPUIO_SUCCESS: c_int = 0;
/// An internal or otherwise unclassified failure (a panic inside gpuio among them).
pub const GPUIO_ERROR_GENERAL: c_int = -1;
/// Host, pinned or device memory exhausted.
pub const GPUIO_ERROR_NOMEM: c_int = -2;
/// A malformed or out-of-range argument, a null pointer among them.
pub const GPUIO_ERROR_INVALID_ARG: c_int = -3;
/// A named resource, device or NUMA node does not exist.
pub const GPUIO_ERROR_NOT_FOUND: c_int = -4;
/// An operation (or its retries) ran out of time.
pub const GPUIO_ERROR_TIMEOUT: c_int = -5;
/// A storage or device IO failure.
pub const GPUIO_ERROR_IO: c_int = -6;
/// A network failure.
pub const GPUIO_ERROR_NETWORK: c_int = -7;
/// The path exists in gpuio but not on this machine or build.
pub const GPUIO_ERROR_UNSUPPORTED: c_int = -8;
/// The OS or a peer refused access.
pub const GPUIO_ERROR_PERMISSION: c_int = -9;
/// A transient shortage; trying again may succeed.
pub const GPUIO_ERROR_BUSY: c_int = -10;
/// The request was cancelled before it completed.
pub const GPUIO_ERROR_CANCELED: c_int = -11;

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// What a failed entry point reports: its code, and the message `gpuio_last_error` returns.
pub(crate) struct Failure {
    pub code: ErrorCode,
    pub message: String,
}

impl From<gpuio_api::Error> for Failure {
    fn from(e: gpuio_api::Error) -> Self {
        Self {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

/// A caller's mistake: `GPUIO_ERROR_INVALID_ARG` with `message`.
pub(crate) fn invalid(message: impl Into<String>) -> Failure {
    Failure {
        code: ErrorCode::InvalidArg,
        message: message.into(),
    }
}

fn remember(message: &str) {
    // A message with a NUL byte is cut there rather than lost.
    let text = message.split('\0').next().unwrap_or_default();
    let c = CString::new(text).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = c);
}

/// Runs an entry point's body: `GPUIO_SUCCESS`, or its failure's code with the message kept
/// for `gpuio_last_error`; a panic becomes `GPUIO_ERROR_GENERAL`.
pub(crate) fn call(body: impl FnOnce() -> Result<(), Failure>) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => GPUIO_SUCCESS,
        Ok(Err(f)) => {
            remember(&f.message);
            f.code.as_i32()
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown".into());
            remember(&format!("gpuio panicked (a bug): {what}"));
            GPUIO_ERROR_GENERAL
        }
    }
}

/// The message of the last call on this thread that failed (empty if none has). Valid until
/// the next failing call on this thread; never null.
#[unsafe(no_mangle)]
pub extern "C" fn gpuio_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

/// The macro name of an error code, e.g. "GPUIO_ERROR_IO" ("GPUIO_SUCCESS" for 0,
/// "GPUIO_ERROR_UNKNOWN" for a value outside the table). Static; never null.
#[unsafe(no_mangle)]
pub extern "C" fn gpuio_error_name(code: c_int) -> *const c_char {
    static NAMES: OnceLock<Vec<(c_int, CString)>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        ErrorCode::ALL
            .iter()
            .map(|c| (c.as_i32(), CString::new(c.name()).unwrap_or_default()))
            .collect()
    });
    match names.iter().find(|(n, _)| *n == code) {
        Some((_, name)) => name.as_ptr(),
        None if code == GPUIO_SUCCESS => c"GPUIO_SUCCESS".as_ptr(),
        None => c"GPUIO_ERROR_UNKNOWN".as_ptr(),
    }
}

/// 1 if the retry policy may try again after this code (timeouts, network errors, busy), else 0.
#[unsafe(no_mangle)]
pub extern "C" fn gpuio_error_is_retryable(code: c_int) -> c_int {
    ErrorCode::from_i32(code).is_some_and(|c| c.is_retryable()) as c_int
}
