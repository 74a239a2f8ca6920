//! Launches of the AI tier's kernels (`kernels/ai.cu`): quantization (a pass for the scales,
//! then one for the packed data), dequantization, similarity scores.

use super::driver::cuda_err;
use super::stream::CudaStreamBackend;
use crate::error::Result;
use crate::gpu::QuantKind;
use crate::gpu::backend::AiLaunch;
use cudarc::driver::PushKernelArg;

/// Positions of the kernels in `kernels::AI.functions`.
const SCALES: usize = 0;
const DATA: usize = 1;
const DEQUANT: usize = 2;
const SCORES: usize = 3;

impl CudaStreamBackend {
    /// Runs one AI kernel launch and waits for it.
    ///
    /// # Safety
    /// As `StreamBackend::ai_kernel`: a pinned table stays registered and valid until this
    /// returns.
    pub(super) unsafe fn launch_ai(&self, launch: AiLaunch<'_>) -> Result<()> {
        let module = self.shared.module(&crate::kernels::AI)?;
        let kernels = &module.functions;
        self.shared.bind()?;
        match launch {
            AiLaunch::Quantize {
                kind,
                block,
                n,
                src,
                data,
                scales,
                err,
            } => {
                let (x, d, s, e) = (src.addr(), data.addr(), scales.addr(), err.addr());
                let format = kind.code();
                if kind != QuantKind::F16 {
                    // A warp per block.
                    let cfg = self.shared.launch_config(n.div_ceil(block) * 32);
                    let mut l = self.stream.launch_builder(&kernels[SCALES]);
                    l.arg(&x).arg(&n).arg(&block).arg(&format).arg(&s).arg(&e);
                    // SAFETY: matches gpuio_quant_scales(const float*, u64, u64, int, float*,
                    // u64*): it reads the n checked source values and writes one scale per
                    // block into the checked scales range, and the report word.
                    unsafe { l.launch(cfg) }
                        .map_err(cuda_err("cuLaunchKernel(gpuio_quant_scales)"))?;
                }
                let bytes = if kind == QuantKind::Int4 {
                    n.div_ceil(2)
                } else {
                    n
                };
                let mut l = self.stream.launch_builder(&kernels[DATA]);
                l.arg(&x)
                    .arg(&n)
                    .arg(&block)
                    .arg(&format)
                    .arg(&s)
                    .arg(&d)
                    .arg(&e);
                // SAFETY: matches gpuio_quant_data(const float*, u64, u64, int, const float*,
                // unsigned char*, u64*): it reads the source values and their scales (written
                // by the launch before, in stream order) and writes the checked data range
                // (its size for the format) and the report word.
                unsafe { l.launch(self.shared.launch_config(bytes)) }
                    .map_err(cuda_err("cuLaunchKernel(gpuio_quant_data)"))?;
            }
            AiLaunch::Dequantize {
                kind,
                block,
                n,
                data,
                scales,
                out,
            } => {
                let (d, s, o, format) = (data.addr(), scales.addr(), out.addr(), kind.code());
                let mut l = self.stream.launch_builder(&kernels[DEQUANT]);
                l.arg(&d).arg(&s).arg(&n).arg(&block).arg(&format).arg(&o);
                // SAFETY: matches gpuio_dequant(const unsigned char*, const float*, u64, u64,
                // int, float*): it reads the checked data and scales of n values and writes n
                // f32s into the checked output range.
                unsafe { l.launch(self.shared.launch_config(n)) }
                    .map_err(cuda_err("cuLaunchKernel(gpuio_dequant)"))?;
            }
            AiLaunch::Scores {
                table,
                rows,
                dim,
                fp8,
                query,
                scores,
            } => {
                let (t, q, s, f) = (table.addr(), query.addr(), scores.addr(), i32::from(fp8));
                let mut l = self.stream.launch_builder(&kernels[SCORES]);
                l.arg(&t).arg(&rows).arg(&dim).arg(&f).arg(&q).arg(&s);
                // SAFETY: matches gpuio_dot_scores(const void*, u64, u64, int, const float*,
                // float*): it reads `rows` rows of `dim` values of the checked table (device
                // memory, or pinned host memory registered for the call) and the query, and
                // writes one score per row into the checked scores range.
                unsafe { l.launch(self.shared.launch_config(rows * 32)) }
                    .map_err(cuda_err("cuLaunchKernel(gpuio_dot_scores)"))?;
            }
        }
        self.stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))
    }
}
