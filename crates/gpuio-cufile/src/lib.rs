#![doc = include_str!("../README.md")]
// A C ABI crate: C hands over raw pointers, and only the `exports` modules turn them into Rust
// values, each at one call site with its SAFETY note (docs/ARCHITECTURE.md, I2).
#![deny(unsafe_op_in_unsafe_fn)]

pub mod abi;
mod batch;
mod driver;
mod exports;
mod fault;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod handle;
mod io;
mod memory;
mod params;
mod stats;

/// The cuFile API version this library implements (`cuFileGetVersion`: 1.20).
pub const CUFILE_VERSION: i32 = 1200;

/// Present only in gpuio's `libcufile.so.0`: `gpuio info` looks it up to tell this library
/// from NVIDIA's, and gpuio's own cuFile path refuses to run on it.
#[unsafe(no_mangle)]
pub extern "C" fn gpuio_cufile_version() -> *const std::ffi::c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
