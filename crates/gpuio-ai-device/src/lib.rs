//! The AI tier's device work, as ops ([`gpuio_hal::gpu::DeviceOp`]): KV quantization and its
//! inverse and similarity scores (`quant.rs`, `kernels/ai.cu`) and device-planned loads
//! (`swap_in/`, `kernels/ai.cu`), with the tiered row gather they load through (a row
//! primitive of `gpu/`, re-exported here). Each public function takes the
//! [`Stream`](gpuio_hal::gpu::Stream) it runs on first, checks its arguments, and runs a private op
//! whose host side does the work on the CPU or says why it cannot.

#![deny(unsafe_op_in_unsafe_fn)]

#[rustfmt::skip]
pub mod kernels;
mod quant;
mod swap_in;

pub use gpuio_hal::gpu::tiered::{
    TIER_MAX_HOT_ROWS, TIER_MAX_JOBS, TIER_MAX_WARM_ROWS, TieredRows, TieredSource, gather_tiered,
    gather_tiered_timed, tiered_stage_len,
};
pub use quant::{QuantKind, QuantizedAt, ScoreRows, dequantize, dot_scores, quantize};
pub use swap_in::{
    SWAP_IN_MAX_ROW_BYTES, SWAP_IN_MAX_SELECTION, SWAP_IN_MAX_SLOTS, SwapInCounts, SwapInDone,
    SwapInFault, SwapInJob, SwapInLoad, SwapInOutcome, SwapInRefused, SwapInTable, swap_in,
    swap_in_queued, swap_in_reset, swap_in_state_len, swap_in_table,
};
