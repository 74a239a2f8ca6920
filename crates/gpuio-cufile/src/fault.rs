//! How a call fails: a cuFile error code (with the CUDA driver's code where the driver is the
//! cause) and, for whoever debugs it, why. `GPUIO_CUFILE_DEBUG=1` prints the reason of every
//! failure on standard error: cuFile programs see only the code.

use crate::abi::{self, CUfileError_t};
use gpuio_api::{Error, ErrorCode};
use std::ffi::c_int;

/// A failed call.
#[derive(Debug)]
pub struct Fault {
    /// A `CU_FILE_*` code, or (for calls that return `ssize_t`) an errno value.
    pub code: c_int,
    /// Why, in words.
    pub why: String,
}

/// The result of a call.
pub type Result<T, E = Fault> = std::result::Result<T, E>;

impl Fault {
    /// A failure with cuFile's `code`.
    pub fn new(code: c_int, why: impl Into<String>) -> Self {
        Self {
            code,
            why: why.into(),
        }
    }

    /// `CU_FILE_INVALID_VALUE`: an argument cuFile refuses.
    pub fn invalid(why: impl Into<String>) -> Self {
        Self::new(abi::CU_FILE_INVALID_VALUE, why)
    }

    /// The status a `CUfileError_t` call returns.
    pub fn status(self) -> CUfileError_t {
        self.report();
        CUfileError_t {
            err: self.code,
            cu_err: abi::CUDA_SUCCESS,
        }
    }

    /// What a call returning `ssize_t` returns: the code, negated.
    pub fn negated(self) -> isize {
        self.report();
        -(self.code as isize)
    }

    fn report(&self) {
        if std::env::var_os("GPUIO_CUFILE_DEBUG").is_some_and(|v| v == "1") {
            eprintln!("gpuio libcufile: error {}: {}", self.code, self.why);
        }
    }
}

impl From<Error> for Fault {
    fn from(e: Error) -> Self {
        let code = match e.code() {
            ErrorCode::InvalidArg | ErrorCode::NotFound => abi::CU_FILE_INVALID_VALUE,
            ErrorCode::NoMem => abi::CU_FILE_NOMEM_ERROR,
            ErrorCode::Unsupported => abi::CU_FILE_IO_NOT_SUPPORTED,
            ErrorCode::Permission => abi::CU_FILE_PERMISSION_DENIED,
            ErrorCode::Io => abi::CU_FILE_IO_ERROR,
            _ => abi::CU_FILE_INTERNAL_ERROR,
        };
        Self::new(code, e.to_string())
    }
}

/// Success, as a `CUfileError_t`.
pub const SUCCESS: CUfileError_t = CUfileError_t {
    err: abi::CU_FILE_SUCCESS,
    cu_err: abi::CUDA_SUCCESS,
};
