//! # gpuio-hal
//!
//! The bottom layer of gpuio: the vocabulary every other crate shares, and every line of
//! `unsafe` code in the project, each behind a safe type.
//!
//! - [`gpu`]: GPU devices with two run-time backends — `host` (always there) and `cuda`
//!   (cudarc, loaded at run time; the binary builds and runs without CUDA). [`probe`] picks
//!   one and says why; [`Gpu`], [`DeviceBuffer`], [`Stream`] and [`Inflight`] are the handles.
//! - [`memory`]: memory regions (where bytes live, how many, whether registered for DMA),
//!   [`HostBuffer`] (mmap'd, huge-page and NUMA aware, pinnable), NUMA topology (a CXL memory
//!   expander is a CPU-less NUMA node).
//! - [`pattern`]: the deterministic byte pattern tests and benchmarks fill buffers with, also
//!   computed on the GPU by `kernels/pattern.cu`.
//! - [`sync`]: poison-tolerant locking, shared by every crate above.
//! - [`ErrorCode`]: the error codes every gpuio error maps to (docs/REFERENCE.md#error-codes).
//!
//! ```
//! use gpuio_hal::{probe, BackendPreference, HostBuffer, HostAllocOptions};
//! let gpus = probe(BackendPreference::Auto).unwrap();
//! let gpu = &gpus.gpus[0];
//! let dev = gpu.alloc(1 << 20).unwrap();
//! let mut host = HostBuffer::alloc_pinned(1 << 20, &HostAllocOptions::default(), gpu).unwrap();
//! gpuio_hal::pattern::fill(&mut host, 0, 42);
//! let stream = gpu.stream().unwrap();
//! stream.upload(&host, &dev, 0).unwrap();
//! let mut back = vec![0u8; 1 << 20];
//! stream.download(&dev, 0, &mut back).unwrap();
//! assert_eq!(&back[..], &host[..]);
//! ```

pub mod error;
pub mod file;
pub mod gpu;
pub mod kernels;
pub mod memory;
pub mod pattern;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod ring;
pub mod sync;
mod sys;
pub mod uring;

pub use error::{ErrorCode, HalError, Result, check_range};
pub use gpu::{
    Backend, BackendPreference, Capability, DeviceBuffer, DeviceInfo, Event, GdsFile, GdsMode, Gpu,
    Inflight, PcieLink, PinGuard, Probe, RowIndices, RowKernel, SharedPin, Stream, probe,
    probe_with,
};
pub use memory::numa::{NumaNode, NumaTopology};
pub use memory::{
    DmaRegistration, HostAllocOptions, HostBuffer, Location, MemoryRegion, MemoryTier,
};
pub use sys::{
    HUGE_PAGE, clear_nonblocking, page_size, peek_nonblocking, prefetch, raise_fd_limit,
    write_u64s_streaming,
};
