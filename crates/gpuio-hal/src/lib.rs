#![doc = include_str!("../README.md")]
// Without the CUDA backend, what only its launches read (kernel arguments, device addresses,
// PCI facts) is unused; that build exists to prove the host backend stands alone.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

pub mod error;
pub mod file;
pub mod gpu;
pub mod kernels;
pub mod memory;
pub mod pattern;
pub mod sync;
pub mod sys;
pub mod uring;
pub mod workers;

pub use error::{ErrorCode, HalError, Result, check_range};
pub use gpu::{
    Allocation, Backend, BackendPreference, Capability, DeviceBuffer, DeviceInfo, DmaBufExport,
    Event, GdsFile, GdsMode, Gpu, HOT_MAX_JOBS, HOT_MAX_POOL_ROWS, HOT_MAX_ROWS, HotGather,
    HotRows, Inflight, ManagedBuffer, PcieLink, Piece2d, PinGuard, Probe, RESIDENT_MAX_BYTES,
    RESIDENT_MAX_ROWS, ResidentJob, ResidentRows, ResidentStats, RowIndices, RowKernel, SharedPin,
    Stream, keeping_cuda_context, probe, probe_with, without_cuda_context,
};
pub use memory::numa::{NumaNode, NumaTopology};
pub use memory::{
    BufferInfo, DmaRegistration, HostAllocOptions, HostBuffer, HostRead, HostWrite, Location,
    MappingHold, MemoryRegion, MemoryTier, RangeGuard, RangeRead, RangeWrite, SharedHostBuffer,
    WholeGuard,
};
pub use sys::{
    HUGE_PAGE, clear_nonblocking, copy_streaming, page_size, peek_nonblocking, prefetch,
    raise_fd_limit, write_u64s_streaming,
};
