//! The exported C functions, one module per part of `cufile.h`. Each checks and converts its
//! arguments, calls into the crate, and turns the result into cuFile's return convention; a
//! panic (a bug) becomes `CU_FILE_INTERNAL_ERROR` instead of unwinding into C.

mod batch;
mod driver;
mod io;
mod params;
mod stats;

#[cfg(feature = "fuzzing")]
pub(crate) use {batch::*, driver::*, io::*, params::*, stats::*};

use crate::abi::{self, CUfileError_t};
use crate::fault::{Fault, Result, SUCCESS};
use std::panic::{AssertUnwindSafe, catch_unwind};

fn panicked() -> Fault {
    Fault::new(abi::CU_FILE_INTERNAL_ERROR, "gpuio libcufile panicked")
}

/// Runs a call that returns `CUfileError_t`.
fn status(f: impl FnOnce() -> Result<()>) -> CUfileError_t {
    match catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(panicked())) {
        Ok(()) => SUCCESS,
        Err(e) => e.status(),
    }
}

/// Runs a call that returns `ssize_t`: bytes, or a negated error code.
fn bytes(f: impl FnOnce() -> Result<usize>) -> isize {
    match catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(panicked())) {
        Ok(n) => n as isize,
        Err(e) => e.negated(),
    }
}

/// Stores `v` where the program's out-pointer `p` points.
///
/// # Safety
/// A non-null `p` is valid for writing a `T`.
unsafe fn put<T>(p: *mut T, v: T, what: &str) -> Result<()> {
    if p.is_null() {
        return Err(Fault::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and writable for a T (the caller's contract).
    unsafe { p.write(v) };
    Ok(())
}

/// Reads the program's in-pointer `p`.
///
/// # Safety
/// A non-null `p` points to an initialised `T`.
unsafe fn get<T: Copy>(p: *const T, what: &str) -> Result<T> {
    if p.is_null() {
        return Err(Fault::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null and initialised (the caller's contract); read unaligned, as C
    // programs pack structs as they like.
    Ok(unsafe { p.read_unaligned() })
}
