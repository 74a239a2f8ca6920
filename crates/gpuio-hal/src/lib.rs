#![doc = include_str!("../README.md")]

pub mod error;
pub mod file;
pub mod gpu;
pub mod kernels;
pub mod memory;
pub mod nvme;
pub mod ondemand;
pub mod pattern;
pub mod ring;
pub mod sync;
mod sys;
pub mod uring;
pub mod workers;

pub use error::{ErrorCode, HalError, Result, check_range};
pub use gpu::{
    Backend, BackendPreference, Capability, DeviceBuffer, DeviceInfo, DmaBufExport, Event, GdsFile,
    GdsMode, Gpu, HOT_MAX_POOL_ROWS, HOT_MAX_ROWS, HotRows, Inflight, PcieLink, PinGuard, Probe,
    QuantKind, QuantizedAt, RowIndices, RowKernel, SWAP_IN_MAX_ROW_BYTES, SWAP_IN_MAX_SELECTION,
    SWAP_IN_MAX_SLOTS, ScoreRows, SharedPin, Stream, SwapInCounts, SwapInDone, SwapInFault,
    SwapInJob, SwapInLoad, SwapInRefused, SwapInTable, TIER_MAX_HOT_ROWS, TIER_MAX_JOBS,
    TIER_MAX_WARM_ROWS, TieredRows, TieredSource, probe, probe_with, swap_in_state_len,
    tiered_stage_len,
};
pub use memory::numa::{NumaNode, NumaTopology};
pub use memory::pool::{PoolConfig, PoolStats, PooledBuffer, StagingLease, StagingPool};
pub use memory::{
    DmaRegistration, HostAllocOptions, HostBuffer, HostRead, HostWrite, Location, MappingHold,
    MemoryRegion, MemoryTier, RangeGuard, RangeRead, RangeWrite, SharedHostBuffer, WholeGuard,
};
pub use sys::{
    HUGE_PAGE, clear_nonblocking, page_size, peek_nonblocking, prefetch, raise_fd_limit,
    write_u64s_streaming,
};
