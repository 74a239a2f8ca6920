//! The AI tier's device work, as ops ([`crate::gpu::DeviceOp`]): KV quantization and its
//! inverse and similarity scores (`quant.rs`, `kernels/ai.cu`), tiered row gathers
//! (`tiered.rs`, `kernels/gather.cu`), and device-planned loads (`swap_in/`, `kernels/ai.cu`). Each public function takes the
//! [`Stream`](crate::gpu::Stream) it runs on first, checks its arguments, and runs a private op
//! whose host side does the work on the CPU or says why it cannot.

mod quant;
mod swap_in;
mod tiered;

pub use quant::{QuantKind, QuantizedAt, ScoreRows, dequantize, dot_scores, quantize};
pub use swap_in::{
    SWAP_IN_MAX_ROW_BYTES, SWAP_IN_MAX_SELECTION, SWAP_IN_MAX_SLOTS, SwapInCounts, SwapInDone,
    SwapInFault, SwapInJob, SwapInLoad, SwapInRefused, SwapInTable, swap_in, swap_in_reset,
    swap_in_state_len, swap_in_table,
};
pub use tiered::{
    TIER_MAX_HOT_ROWS, TIER_MAX_JOBS, TIER_MAX_WARM_ROWS, TieredRows, TieredSource, gather_tiered,
    gather_tiered_timed, tiered_stage_len,
};

use crate::error::{HalError, Result};
use crate::gpu::{CudaRun, Event};
use std::time::Duration;

/// Refuses device ranges (address, length) of one call that overlap: a kernel writing one
/// while reading another would give unspecified bytes.
pub(crate) fn check_disjoint(mut spans: Vec<(u64, usize)>, what: &str) -> Result<()> {
    spans.retain(|&(_, len)| len > 0);
    spans.sort_unstable();
    if spans.windows(2).any(|w| w[0].0 + w[0].1 as u64 > w[1].0) {
        return Err(HalError::InvalidArgument(format!("{what} overlap")));
    }
    Ok(())
}

/// The widest piece (16, 8, 4 or 1 bytes) that divides the row size and every address a row
/// kernel starts rows at: its kernels' slot among the `_16/_8/_4/_1` variants, and the width.
fn widest_piece(row_bytes: u64, addrs: impl IntoIterator<Item = u64> + Clone) -> (usize, u64) {
    [(0, 16u64), (1, 8), (2, 4), (3, 1)]
        .into_iter()
        .find(|&(_, w)| {
            row_bytes.is_multiple_of(w) && addrs.clone().into_iter().all(|a| a.is_multiple_of(w))
        })
        .unwrap_or((3, 1))
}

/// The device's time between two timing events, where both were recorded.
fn device_time(start: Option<Event>, end: Option<Event>) -> Result<Option<Duration>> {
    match (start, end) {
        (Some(start), Some(end)) => elapsed(&start, &end).map(Some),
        _ => Ok(None),
    }
}

/// The device's time from timing event `from` to timing event `to`.
fn elapsed(from: &Event, to: &Event) -> Result<Duration> {
    let ms = to.elapsed_ms_since(from)?;
    Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
}

/// Waits for the stream on every way out of an op's CUDA side (an error, a panic) unless
/// [`wait`](Self::wait) or [`disarm`](Self::disarm) ran: kernels and copies still using what
/// the op borrows must be done before the borrows end.
struct WaitOnDrop<'r, 's>(Option<&'r CudaRun<'s>>);

impl<'r, 's> WaitOnDrop<'r, 's> {
    fn new(cuda: &'r CudaRun<'s>) -> Self {
        Self(Some(cuda))
    }

    /// Waits now, reporting an error the work ran into.
    fn wait(mut self) -> Result<()> {
        self.0.take().map_or(Ok(()), CudaRun::synchronize)
    }

    /// Lets the work run on: what it still uses outlives the op.
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for WaitOnDrop<'_, '_> {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.0.map(CudaRun::synchronize) {
            tracing::error!(error = %e, "waiting for an AI-tier op's device work failed");
        }
    }
}
