#![doc = include_str!("../README.md")]
// The C ABI is the one place outside the device layer where unsafe code lives
// (docs/ARCHITECTURE.md, I2): C hands over raw pointers, and only this crate turns them into Rust references, each at one call site with
// its SAFETY note (the checks on every pointer are in `ptr.rs`).
#![deny(unsafe_op_in_unsafe_fn)]
#![allow(non_camel_case_types)]

mod ai;
mod context;
mod error;
mod memory;
mod options;
mod ptr;
mod transfer;

pub use ai::{
    gpuio_engram_table_t, gpuio_kv_load_report_t, gpuio_kv_pool_config_t, gpuio_kv_pool_t,
};
pub use context::{gpuio_config_t, gpuio_context_t, gpuio_device_info_t};
pub use error::*;
pub use memory::{gpuio_handle_t, gpuio_mem_t};
pub use options::*;
pub use transfer::*;

/// The C API's version: `GPUIO_API_VERSION` goes in `gpuio_config_t.api_version`.
pub const GPUIO_API_VERSION: u32 = 1;

/// `gpuio_open` flag: open for reading (the file must exist).
pub const GPUIO_OPEN_READ: u32 = 0;
/// `gpuio_open` flag: open for writing (a file is created or truncated).
pub const GPUIO_OPEN_WRITE: u32 = 1;
