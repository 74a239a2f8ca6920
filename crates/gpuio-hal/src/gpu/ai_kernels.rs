//! The AI tier's kernels (`kernels/ai.cu`): KV quantization and its inverse, and brute-force
//! similarity scores. The checks live here; the host backend runs no kernels and refuses them
//! (gpuio-ai keeps the CPU reference the kernels are checked against, and uses it there).

use super::backend::{AiLaunch, DevRange, RowMem};
use super::tiered::check_disjoint;
use super::{DeviceBuffer, Stream};
use crate::error::{HalError, Result};
use crate::memory::HostBuffer;

/// A KV quantization format, as the kernels take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    /// IEEE half precision, two bytes a value, no scales.
    F16,
    /// FP8 E4M3, a byte a value, a block's largest magnitude mapped to 448.
    Fp8,
    /// Signed bytes, a block's largest magnitude mapped to 127.
    Int8,
    /// Signed 4-bit levels in −7..=7, two a byte (the first in the low nibble), a group's
    /// largest magnitude mapped to 7.
    Int4,
}

impl QuantKind {
    /// The kernels' code for it.
    pub(crate) fn code(self) -> i32 {
        match self {
            Self::F16 => 0,
            Self::Fp8 => 1,
            Self::Int8 => 2,
            Self::Int4 => 3,
        }
    }

    /// Bytes of packed data for `n` values.
    pub fn data_bytes(self, n: usize) -> usize {
        match self {
            Self::F16 => n.saturating_mul(2),
            Self::Fp8 | Self::Int8 => n,
            Self::Int4 => n.div_ceil(2),
        }
    }

    /// Scales for `n` values in blocks of `block` (none for FP16).
    pub fn scale_count(self, n: usize, block: usize) -> usize {
        match self {
            Self::F16 => 0,
            _ => n.div_ceil(block.max(1)),
        }
    }
}

/// Where quantized values live on the device: packed data, then one f32 scale per block.
#[derive(Debug, Clone, Copy)]
pub struct QuantizedAt<'a> {
    /// The packed data's buffer.
    pub data: &'a DeviceBuffer,
    /// Its byte offset.
    pub data_offset: usize,
    /// The scales' buffer (one of this device's; unused for FP16, but still checked).
    pub scales: &'a DeviceBuffer,
    /// Its byte offset (a multiple of 4).
    pub scales_offset: usize,
}

/// The table a similarity query scores: rows of `dim` values, f32 or FP8 E4M3 bytes.
#[derive(Debug, Clone, Copy)]
pub enum ScoreRows<'a> {
    /// In device memory.
    Device(&'a DeviceBuffer),
    /// In pinned host memory, read by the device over the bus (nothing copied first).
    Pinned(&'a HostBuffer),
}

impl Stream {
    /// Quantizes `n` f32 values of `src` (from byte `src_offset`, 4-aligned) into `out` (FP16
    /// data 2-aligned), one scale per `block` values (ignored for FP16), and waits. A value that is not finite (or,
    /// for FP16, beyond ±65504) is an error naming the first such, the output then
    /// unspecified.
    pub fn quantize(
        &self,
        kind: QuantKind,
        block: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        n: usize,
        out: QuantizedAt<'_>,
    ) -> Result<()> {
        let block = check_block(kind, block, n)?;
        let (data, scales) = self.quantized_ranges(kind, block, n, &out)?;
        let src = self.aligned_range("quantize source", src, src_offset, n, 4)?;
        disjoint(
            [&src, &data, &scales],
            "quantization source, data and scales",
        )?;
        if n == 0 {
            return Ok(());
        }
        let err = self.gpu.alloc(8)?;
        self.upload(&[0xff; 8], &err, 0)?;
        let launch = AiLaunch::Quantize {
            kind,
            block: block as u64,
            n: n as u64,
            src,
            data,
            scales,
            err: err.range("quantize report", 0, 8)?,
        };
        // SAFETY: device memory only, every range checked and borrowed for the call, which
        // waits for the kernels.
        unsafe { self.inner.ai_kernel(launch)? };
        match self.download_u64s(&err, 1)?[0] {
            u64::MAX => Ok(()),
            i => Err(HalError::InvalidArgument(format!(
                "{kind:?} quantization: value {i} is not finite{}",
                if kind == QuantKind::F16 {
                    " or is beyond ±65504"
                } else {
                    ""
                }
            ))),
        }
    }

    /// The `n` values `from` holds back as f32s into `dst` from byte `dst_offset`
    /// (4-aligned), and waits.
    pub fn dequantize(
        &self,
        kind: QuantKind,
        block: usize,
        from: QuantizedAt<'_>,
        n: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> Result<()> {
        let block = check_block(kind, block, n)?;
        let (data, scales) = self.quantized_ranges(kind, block, n, &from)?;
        let out = self.aligned_range("dequantize destination", dst, dst_offset, n, 4)?;
        disjoint(
            [&data, &scales, &out],
            "dequantization data, scales and destination",
        )?;
        if n == 0 {
            return Ok(());
        }
        let launch = AiLaunch::Dequantize {
            kind,
            block: block as u64,
            n: n as u64,
            data,
            scales,
            out,
        };
        // SAFETY: device memory only, every range checked and borrowed for the call, which
        // waits for the kernel.
        unsafe { self.inner.ai_kernel(launch) }
    }

    /// Scores every row of `rows` against `query` (`dim` f32s at the start of `query`):
    /// `scores` gets `count` f32s, `scores[r]` = the dot product of row `r` (of `dim` values,
    /// f32 or, with `fp8`, E4M3 bytes) with the query. Waits.
    pub fn dot_scores(
        &self,
        rows: ScoreRows<'_>,
        count: usize,
        dim: usize,
        fp8: bool,
        query: &DeviceBuffer,
        scores: &DeviceBuffer,
    ) -> Result<()> {
        if dim == 0 {
            return Err(HalError::InvalidArgument("rows of 0 values".into()));
        }
        let row_bytes = if fp8 { dim } else { dim.saturating_mul(4) };
        let table_len = count
            .checked_mul(row_bytes)
            .ok_or_else(|| HalError::InvalidArgument(format!("{count} rows of {dim} values")))?;
        let table = match rows {
            ScoreRows::Device(b) => {
                self.gpu.check_owns("scored rows", b)?;
                let r = b.range("scored rows", 0, table_len)?;
                if !fp8 && !r.addr().is_multiple_of(4) {
                    return Err(HalError::InvalidArgument(
                        "f32 rows must be 4-aligned".into(),
                    ));
                }
                RowMem::Device(r)
            }
            ScoreRows::Pinned(h) => {
                crate::check_range("scored rows", 0, table_len, h.len())?;
                self.host_pool(h)?
            }
        };
        let query = self.aligned_range("query", query, 0, dim, 4)?;
        let scores = self.aligned_range("scores", scores, 0, count, 4)?;
        let mut spans = vec![(query.addr(), query.len), (scores.addr(), scores.len)];
        if let RowMem::Device(t) = &table {
            spans.push((t.addr(), t.len));
        }
        check_disjoint(spans, "scored rows, query and scores")?;
        if count == 0 {
            return Ok(());
        }
        let launch = AiLaunch::Scores {
            table,
            rows: count as u64,
            dim: dim as u64,
            fp8,
            query,
            scores,
        };
        // SAFETY: a pinned table is borrowed (registered and valid) until this call returns,
        // which waits for the kernel; the rest is checked device memory.
        unsafe { self.inner.ai_kernel(launch) }
    }

    /// The packed data's and the scales' ranges of `n` values.
    fn quantized_ranges<'b>(
        &self,
        kind: QuantKind,
        block: usize,
        n: usize,
        at: &QuantizedAt<'b>,
    ) -> Result<(super::backend::DevRange<'b>, super::backend::DevRange<'b>)> {
        // FP16 data is stored a half at a time.
        let data = match kind {
            QuantKind::F16 => {
                self.aligned_range("quantized data", at.data, at.data_offset, n, 2)?
            }
            _ => {
                self.gpu.check_owns("quantized data", at.data)?;
                at.data
                    .range("quantized data", at.data_offset, kind.data_bytes(n))?
            }
        };
        let scales = self.aligned_range(
            "quantization scales",
            at.scales,
            at.scales_offset,
            kind.scale_count(n, block),
            4,
        )?;
        Ok((data, scales))
    }

    /// `n` items of `size` bytes of `buf` from `offset`, checked and `size`-aligned.
    fn aligned_range<'b>(
        &self,
        what: &'static str,
        buf: &'b DeviceBuffer,
        offset: usize,
        n: usize,
        size: usize,
    ) -> Result<super::backend::DevRange<'b>> {
        self.gpu.check_owns(what, buf)?;
        let len = n
            .checked_mul(size)
            .ok_or_else(|| HalError::InvalidArgument(format!("{what}: {n} values overflow")))?;
        let r = buf.range(what, offset, len)?;
        if !r.addr().is_multiple_of(size as u64) {
            return Err(HalError::InvalidArgument(format!(
                "{what} at byte {offset} is not {size}-aligned"
            )));
        }
        Ok(r)
    }
}

/// A block of at least one value for the scaled formats (FP16 takes any), at most `n`: a
/// longer block means the same (one scale for every value) and keeps the kernels' block count
/// from overflowing.
fn check_block(kind: QuantKind, block: usize, n: usize) -> Result<usize> {
    match (kind, block) {
        (QuantKind::F16, _) => Ok(1),
        (_, 0) => Err(HalError::InvalidArgument(format!(
            "{kind:?} quantization: a block of 0 values"
        ))),
        (_, b) => Ok(b.min(n.max(1))),
    }
}

fn disjoint(ranges: [&DevRange<'_>; 3], what: &str) -> Result<()> {
    check_disjoint(ranges.iter().map(|r| (r.addr(), r.len)).collect(), what)
}
