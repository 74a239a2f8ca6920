//! KV quantization on the GPU: values already in device memory are quantized and restored
//! there, by kernels that compute bit for bit what the CPU reference (`quant.rs`) does — the
//! GPU tests compare every byte and every scale. On the host backend (no kernels) the
//! reference itself runs, through host memory, so the same calls work everywhere.

use super::quant::{KvFormat, QuantizedKv};
use crate::{AiError, Result};
use gpuio_ai_device::{self as ai, QuantizedAt};
use gpuio_api::DeviceBuffer;
use gpuio_hal::Backend;

/// Quantized KV values in device memory: the packed data and one scale per block, as
/// [`QuantizedKv`] holds them on the host.
#[derive(Debug)]
pub struct DeviceQuantizedKv {
    format: KvFormat,
    len: usize,
    data: DeviceBuffer,
    scales: DeviceBuffer,
}

impl KvFormat {
    /// Quantizes `len` f32 values of `src` (from byte `src_offset`, 4-aligned) on `src`'s
    /// device. Refuses what [`KvFormat::quantize`] refuses (values that are not finite, FP16
    /// values beyond its range, a block of 0).
    pub fn quantize_device(
        self,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<DeviceQuantizedKv> {
        let (kind, block) = self.kind();
        if block == 0 || !src_offset.is_multiple_of(4) {
            return Err(AiError::InvalidArgument(format!(
                "{self:?} of values at byte {src_offset}: a block of at least one value, f32s \
                 at a 4-aligned offset"
            )));
        }
        let gpu = src.gpu();
        let data = gpu.alloc(kind.data_bytes(len).max(1))?;
        let scales = gpu.alloc(4 * kind.scale_count(len, block).max(1))?;
        let stream = gpu.stream()?;
        if gpu.backend() == Backend::Host {
            let mut raw = vec![0u8; 4 * len];
            stream.download(src, src_offset, &mut raw)?;
            let values: Vec<f32> = raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let q = self.quantize(&values)?;
            stream.upload(q.data(), &data, 0)?;
            let s: Vec<u8> = q.scales().iter().flat_map(|v| v.to_le_bytes()).collect();
            stream.upload(&s, &scales, 0)?;
        } else {
            let at = QuantizedAt {
                data: &data,
                data_offset: 0,
                scales: &scales,
                scales_offset: 0,
            };
            ai::quantize(&stream, kind, block, src, src_offset, len, at)?;
        }
        Ok(DeviceQuantizedKv {
            format: self,
            len,
            data,
            scales,
        })
    }
}

impl DeviceQuantizedKv {
    /// Its format.
    pub fn format(&self) -> KvFormat {
        self.format
    }

    /// Values it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes stored, data and scales.
    pub fn stored_bytes(&self) -> usize {
        let (data, scales) = self.format.sizes(self.len);
        data + 4 * scales
    }

    /// The values back, as f32s into `dst` from byte `dst_offset` (4-aligned).
    pub fn dequantize_into(&self, dst: &DeviceBuffer, dst_offset: usize) -> Result<()> {
        let (kind, block) = self.format.kind();
        if !dst_offset.is_multiple_of(4) {
            return Err(AiError::InvalidArgument(format!(
                "f32s at byte {dst_offset}: a 4-aligned offset"
            )));
        }
        let stream = dst.gpu().stream()?;
        if dst.gpu().backend() == Backend::Host {
            let values = self.to_host()?.dequantize();
            let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            return stream.upload(&raw, dst, dst_offset).map_err(AiError::from);
        }
        let at = QuantizedAt {
            data: &self.data,
            data_offset: 0,
            scales: &self.scales,
            scales_offset: 0,
        };
        ai::dequantize(&stream, kind, block, at, self.len, dst, dst_offset).map_err(AiError::from)
    }

    /// A host copy (for a cold tier, or to check against the reference).
    pub fn to_host(&self) -> Result<QuantizedKv> {
        let (kind, block) = self.format.kind();
        let stream = self.data.gpu().stream()?;
        let mut data = vec![0u8; kind.data_bytes(self.len)];
        stream.download(&self.data, 0, &mut data)?;
        let mut raw = vec![0u8; 4 * kind.scale_count(self.len, block)];
        stream.download(&self.scales, 0, &mut raw)?;
        let scales = raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(QuantizedKv::from_parts(self.format, self.len, data, scales))
    }
}
