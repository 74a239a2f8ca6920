//! KV quantization and its inverse, and brute-force similarity scores (`kernels/ai.cu`). The
//! checks live here; the host backend runs no kernels and refuses them (gpuio-ai keeps the CPU
//! reference the kernels are checked against, and uses it there).

use crate::kernels::AiKernel;
use gpuio_hal::error::{HalError, Result};
use gpuio_hal::gpu::check_disjoint;
use gpuio_hal::gpu::{
    CudaRun, DevArg, DeviceBuffer, DeviceOp, HostArg, HostRun, KernelArgs, Stream,
};
use gpuio_hal::memory::HostBuffer;

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
    fn code(self) -> i32 {
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

/// Quantizes `n` f32 values of `src` (from byte `src_offset`, 4-aligned) into `out` (FP16
/// data 2-aligned), one scale per `block` values (ignored for FP16), on `stream`, and waits. A
/// value that is not finite (or, for FP16, beyond ±65504) is an error naming the first such,
/// the output then unspecified.
pub fn quantize(
    stream: &Stream,
    kind: QuantKind,
    block: usize,
    src: &DeviceBuffer,
    src_offset: usize,
    n: usize,
    out: QuantizedAt<'_>,
) -> Result<()> {
    let block = check_block(kind, block, n)?;
    let (data, scales) = quantized_args(stream, kind, block, n, &out)?;
    let src = aligned_arg(stream, "quantize source", src, src_offset, n, 4)?;
    disjoint(
        [&src, &data, &scales],
        "quantization source, data and scales",
    )?;
    if n == 0 {
        return Ok(());
    }
    let err = stream.gpu().alloc(8)?;
    stream.upload(&[0xff; 8], &err, 0)?;
    stream.run(&Quantize {
        kind,
        block: block as u64,
        n: n as u64,
        src,
        data,
        scales,
        err: stream.arg("quantize report", &err, 0, 8)?,
    })?;
    match stream.download_u64s(&err, 1)?[0] {
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

/// The `n` values `from` holds back as f32s into `dst` from byte `dst_offset` (4-aligned), on
/// `stream`, and waits.
pub fn dequantize(
    stream: &Stream,
    kind: QuantKind,
    block: usize,
    from: QuantizedAt<'_>,
    n: usize,
    dst: &DeviceBuffer,
    dst_offset: usize,
) -> Result<()> {
    let block = check_block(kind, block, n)?;
    let (data, scales) = quantized_args(stream, kind, block, n, &from)?;
    let out = aligned_arg(stream, "dequantize destination", dst, dst_offset, n, 4)?;
    disjoint(
        [&data, &scales, &out],
        "dequantization data, scales and destination",
    )?;
    if n == 0 {
        return Ok(());
    }
    stream.run(&Dequantize {
        kind,
        block: block as u64,
        n: n as u64,
        data,
        scales,
        out,
    })
}

/// Scores every row of `rows` against `query` (`dim` f32s at the start of `query`) on
/// `stream`: `scores` gets `count` f32s, `scores[r]` = the dot product of row `r` (of `dim`
/// values, f32 or, with `fp8`, E4M3 bytes) with the query. Waits.
pub fn dot_scores(
    stream: &Stream,
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
            let r = stream.arg("scored rows", b, 0, table_len)?;
            if !fp8 && !r.addr().is_multiple_of(4) {
                return Err(HalError::InvalidArgument(
                    "f32 rows must be 4-aligned".into(),
                ));
            }
            Table::Device(r)
        }
        ScoreRows::Pinned(h) => Table::Pinned(stream.host_arg("scored rows", h, 0, table_len)?),
    };
    let query = aligned_arg(stream, "query", query, 0, dim, 4)?;
    let scores = aligned_arg(stream, "scores", scores, 0, count, 4)?;
    let mut spans = vec![(query.addr(), query.len()), (scores.addr(), scores.len())];
    if let Table::Device(t) = &table {
        spans.push((t.addr(), t.len()));
    }
    check_disjoint(spans, "scored rows, query and scores")?;
    if count == 0 {
        return Ok(());
    }
    stream.run(&Scores {
        table,
        rows: count as u64,
        dim: dim as u64,
        fp8,
        query,
        scores,
    })
}

/// The packed data's and the scales' ranges of `n` values.
fn quantized_args<'b>(
    stream: &Stream,
    kind: QuantKind,
    block: usize,
    n: usize,
    at: &QuantizedAt<'b>,
) -> Result<(DevArg<'b>, DevArg<'b>)> {
    // FP16 data is stored a half at a time.
    let data = match kind {
        QuantKind::F16 => aligned_arg(stream, "quantized data", at.data, at.data_offset, n, 2)?,
        _ => stream.arg(
            "quantized data",
            at.data,
            at.data_offset,
            kind.data_bytes(n),
        )?,
    };
    let scales = aligned_arg(
        stream,
        "quantization scales",
        at.scales,
        at.scales_offset,
        kind.scale_count(n, block),
        4,
    )?;
    Ok((data, scales))
}

/// `n` items of `size` bytes of `buf` from `offset`, checked and `size`-aligned.
fn aligned_arg<'b>(
    stream: &Stream,
    what: &'static str,
    buf: &'b DeviceBuffer,
    offset: usize,
    n: usize,
    size: usize,
) -> Result<DevArg<'b>> {
    let len = n
        .checked_mul(size)
        .ok_or_else(|| HalError::InvalidArgument(format!("{what}: {n} values overflow")))?;
    let r = stream.arg(what, buf, offset, len)?;
    if !r.addr().is_multiple_of(size as u64) {
        return Err(HalError::InvalidArgument(format!(
            "{what} at byte {offset} is not {size}-aligned"
        )));
    }
    Ok(r)
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

fn disjoint(ranges: [&DevArg<'_>; 3], what: &str) -> Result<()> {
    check_disjoint(ranges.iter().map(|r| (r.addr(), r.len())).collect(), what)
}

/// What the host backend says instead of running these kernels.
fn refuse(host: &HostRun<'_>) -> HalError {
    host.no_kernels(
        "the AI tier's kernels",
        "gpuio-ai runs its CPU reference instead",
    )
}

/// `n` f32s of `src` quantized into `data` and `scales` (one per `block`); the first value the
/// format cannot take is reported (atomic minimum) into `err`.
struct Quantize<'a> {
    kind: QuantKind,
    block: u64,
    n: u64,
    src: DevArg<'a>,
    data: DevArg<'a>,
    scales: DevArg<'a>,
    err: DevArg<'a>,
}

impl DeviceOp for Quantize<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(refuse(host))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let (n, block, format) = (self.n, self.block, self.kind.code());
        if self.kind != QuantKind::F16 {
            let args = KernelArgs::new()
                .ptr(&self.src)
                .u64(n)
                .u64(block)
                .i32(format)
                .ptr(&self.scales)
                .ptr(&self.err);
            // SAFETY: matches gpuio_quant_scales(const float*, u64, u64, int, float*, u64*):
            // it reads the n checked source values and writes one scale per block into the
            // checked scales range, and the report word; the synchronize below ends the call.
            // A warp per block.
            unsafe {
                cuda.launch(
                    AiKernel::QuantScales,
                    cuda.grid_stride(n.div_ceil(block) * 32),
                    &args,
                )?
            };
        }
        let bytes = if self.kind == QuantKind::Int4 {
            n.div_ceil(2)
        } else {
            n
        };
        let args = KernelArgs::new()
            .ptr(&self.src)
            .u64(n)
            .u64(block)
            .i32(format)
            .ptr(&self.scales)
            .ptr(&self.data)
            .ptr(&self.err);
        // SAFETY: matches gpuio_quant_data(const float*, u64, u64, int, const float*,
        // unsigned char*, u64*): it reads the source values and their scales (written by the
        // launch before, in stream order) and writes the checked data range (its size for the
        // format) and the report word; the synchronize below ends the call.
        unsafe { cuda.launch(AiKernel::QuantData, cuda.grid_stride(bytes), &args)? };
        cuda.synchronize()
    }
}

/// `n` values of `data` and `scales` back into f32s at `out`.
struct Dequantize<'a> {
    kind: QuantKind,
    block: u64,
    n: u64,
    data: DevArg<'a>,
    scales: DevArg<'a>,
    out: DevArg<'a>,
}

impl DeviceOp for Dequantize<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(refuse(host))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let args = KernelArgs::new()
            .ptr(&self.data)
            .ptr(&self.scales)
            .u64(self.n)
            .u64(self.block)
            .i32(self.kind.code())
            .ptr(&self.out);
        // SAFETY: matches gpuio_dequant(const unsigned char*, const float*, u64, u64, int,
        // float*): it reads the checked data and scales of n values and writes n f32s into the
        // checked output range; the synchronize below ends the call.
        unsafe { cuda.launch(AiKernel::Dequant, cuda.grid_stride(self.n), &args)? };
        cuda.synchronize()
    }
}

/// Where the scored rows are.
enum Table<'a> {
    Device(DevArg<'a>),
    Pinned(HostArg<'a>),
}

/// One dot product per row of `table` with `query` into `scores`.
struct Scores<'a> {
    table: Table<'a>,
    rows: u64,
    dim: u64,
    fp8: bool,
    query: DevArg<'a>,
    scores: DevArg<'a>,
}

impl DeviceOp for Scores<'_> {
    type Output = ();

    fn host(&self, host: &HostRun<'_>) -> Result<()> {
        Err(refuse(host))
    }

    fn cuda(&self, cuda: &CudaRun<'_>) -> Result<()> {
        let table = match &self.table {
            Table::Device(t) => t.addr(),
            Table::Pinned(h) => h.addr(),
        };
        let args = KernelArgs::new()
            .u64(table)
            .u64(self.rows)
            .u64(self.dim)
            .i32(i32::from(self.fp8))
            .ptr(&self.query)
            .ptr(&self.scores);
        // SAFETY: matches gpuio_dot_scores(const void*, u64, u64, int, const float*, float*):
        // it reads `rows` rows of `dim` values of the checked table (device memory, or pinned
        // host memory whose borrow keeps it registered for the call) and the query, and writes
        // one score per row into the checked scores range; the synchronize below ends the call.
        unsafe { cuda.launch(AiKernel::DotScores, cuda.grid_stride(self.rows * 32), &args)? };
        cuda.synchronize()
    }
}
