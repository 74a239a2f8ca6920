//! The AI tier's device work, as ops ([`crate::gpu::DeviceOp`]): KV quantization and its
//! inverse and similarity scores (`quant.rs`, `kernels/ai.cu`). Each public function takes the
//! [`Stream`](crate::gpu::Stream) it runs on first, checks its arguments, and runs a private op
//! whose host side does the work on the CPU or says why it cannot.

mod quant;

pub use quant::{QuantKind, QuantizedAt, ScoreRows, dequantize, dot_scores, quantize};

use crate::error::{HalError, Result};

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
