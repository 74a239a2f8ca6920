//! KV quantization: FP16, FP8 (E4M3) and INT8 with a scale per block, and 4-bit integers with
//! a scale per group — the formats KV caches are kept in (DeepSeek's FP8 KV with scales,
//! 4-bit KV for cold tiers). This is the reference the GPU kernels are checked against, and
//! what the host uses for tiers it compresses itself.
//!
//! Every format has a documented error bound ([`KvFormat::error_bound`]) that the tests check
//! element by element: a dequantized value differs from the original by at most that much.

use crate::{AiError, Result};
use float8::F8E4M3;
use gpuio_ai_device::QuantKind;
use half::f16;

/// The largest magnitude E4M3 represents.
const FP8_MAX: f32 = 448.0;
/// The largest finite half-precision magnitude.
const F16_MAX: f32 = 65504.0;

/// How KV values are quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvFormat {
    /// IEEE half precision; no scales. Values must be finite and at most 65504 in magnitude.
    F16,
    /// FP8 E4M3 with one `f32` scale per `block` values: the block's largest magnitude maps
    /// to 448, E4M3's largest.
    Fp8 {
        /// Values per scale.
        block: usize,
    },
    /// Signed 8-bit integers, symmetric, one scale per `block` values (largest magnitude → 127).
    Int8 {
        /// Values per scale.
        block: usize,
    },
    /// Signed 4-bit integers in −7..=7, two per byte (the first in the low nibble), one scale
    /// per `group` values (largest magnitude → 7).
    Int4 {
        /// Values per scale.
        group: usize,
    },
}

/// Quantized values: the packed data and the scales, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedKv {
    format: KvFormat,
    len: usize,
    data: Vec<u8>,
    scales: Vec<f32>,
}

impl KvFormat {
    /// Values per scale (`None` for FP16).
    pub fn block(self) -> Option<usize> {
        match self {
            Self::F16 => None,
            Self::Fp8 { block } | Self::Int8 { block } => Some(block),
            Self::Int4 { group } => Some(group),
        }
    }

    /// Stored bits per value, scales included, for `len` values.
    pub fn bits_per_value(self, len: usize) -> f64 {
        let (data, scales) = self.sizes(len);
        if len == 0 {
            return 0.0;
        }
        ((data + 4 * scales) * 8) as f64 / len as f64
    }

    /// Bytes of data and number of scales for `len` values (the kernels' layout, so one
    /// definition serves both sides).
    pub(super) fn sizes(self, len: usize) -> (usize, usize) {
        let (kind, block) = self.kind();
        (kind.data_bytes(len), kind.scale_count(len, block))
    }

    /// The kernels' name for the format, and its block (1 for FP16).
    pub(super) fn kind(self) -> (QuantKind, usize) {
        match self {
            Self::F16 => (QuantKind::F16, 1),
            Self::Fp8 { block } => (QuantKind::Fp8, block),
            Self::Int8 { block } => (QuantKind::Int8, block),
            Self::Int4 { group } => (QuantKind::Int4, group),
        }
    }

    /// The most a dequantized value may differ from `x`, where `scale` is its block's scale
    /// ([`QuantizedKv::scales`]; ignored for FP16):
    ///
    /// - FP16: half a unit in the last place, `max(|x|·2⁻¹¹, 2⁻²⁵)`.
    /// - FP8 E4M3: its three mantissa bits give `max(|x|·2⁻⁴, scale·2⁻¹⁰)` (the second term is
    ///   half the subnormal spacing).
    /// - INT8 and INT4: half a step, `scale / 2`.
    ///
    /// Each with a margin of a few `f32` roundings (dividing by the scale and multiplying back).
    pub fn error_bound(self, x: f32, scale: f32) -> f32 {
        let x = x.abs();
        let rounding = 4.0 * f32::EPSILON * x;
        rounding
            + match self {
                Self::F16 => (x * 2f32.powi(-11)).max(2f32.powi(-25)),
                Self::Fp8 { .. } => (x * 2f32.powi(-4)).max(scale * 2f32.powi(-10)),
                Self::Int8 { .. } | Self::Int4 { .. } => scale / 2.0,
            }
    }

    /// Quantizes `values`. Non-finite values, FP16 values beyond its range and a block or
    /// group of 0 are [`AiError::InvalidArgument`].
    pub fn quantize(self, values: &[f32]) -> Result<QuantizedKv> {
        if self.block() == Some(0) {
            return Err(AiError::InvalidArgument(format!(
                "{self:?}: a block of 0 values"
            )));
        }
        // The first value the format cannot take (for FP16 also one beyond its range).
        let f16 = self == Self::F16;
        let bad = |v: &f32| !v.is_finite() || (f16 && v.abs() > F16_MAX);
        if let Some(i) = values.iter().position(bad) {
            let why = if values[i].is_finite() {
                format!("beyond FP16's ±{F16_MAX}")
            } else {
                "not finite: only finite values quantize".into()
            };
            return Err(AiError::InvalidArgument(format!(
                "KV value {i} ({}) is {why}",
                values[i]
            )));
        }
        let (data_len, scale_count) = self.sizes(values.len());
        let mut data = vec![0u8; data_len];
        let mut scales = Vec::with_capacity(scale_count);
        match self {
            Self::F16 => {
                for (out, v) in data.chunks_exact_mut(2).zip(values) {
                    out.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
                }
            }
            Self::Fp8 { block } => {
                for (k, chunk) in values.chunks(block).enumerate() {
                    let scale = scale_for(chunk, FP8_MAX);
                    scales.push(scale);
                    for (i, v) in chunk.iter().enumerate() {
                        // Clamped: x / scale can round past 448, which E4M3 would make NaN.
                        let y = (v / scale).clamp(-FP8_MAX, FP8_MAX);
                        data[k * block + i] = F8E4M3::from_f32(y).to_bits();
                    }
                }
            }
            Self::Int8 { block } => {
                for (k, chunk) in values.chunks(block).enumerate() {
                    let scale = scale_for(chunk, 127.0);
                    scales.push(scale);
                    for (i, v) in chunk.iter().enumerate() {
                        data[k * block + i] = level(*v, scale, 127.0) as u8;
                    }
                }
            }
            Self::Int4 { group } => {
                for (k, chunk) in values.chunks(group).enumerate() {
                    let scale = scale_for(chunk, 7.0);
                    scales.push(scale);
                    for (i, v) in chunk.iter().enumerate() {
                        let at = k * group + i;
                        let nibble = (level(*v, scale, 7.0) as u8) & 0xf;
                        data[at / 2] |= nibble << (4 * (at % 2));
                    }
                }
            }
        }
        Ok(QuantizedKv {
            format: self,
            len: values.len(),
            data,
            scales,
        })
    }
}

/// The scale that maps a block's largest magnitude to `top`; 1 where that is 0 (an all-zero
/// block, or one so small that its scale underflows: every level is then 0, within bound).
fn scale_for(chunk: &[f32], top: f32) -> f32 {
    let max = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = max / top;
    if scale == 0.0 { 1.0 } else { scale }
}

/// `v / scale` rounded to the nearest integer level in `-top..=top`.
fn level(v: f32, scale: f32, top: f32) -> i8 {
    (v / scale).round().clamp(-top, top) as i8
}

impl QuantizedKv {
    /// Values and scales as a device produced them (`device.rs`).
    pub(super) fn from_parts(
        format: KvFormat,
        len: usize,
        data: Vec<u8>,
        scales: Vec<f32>,
    ) -> Self {
        Self {
            format,
            len,
            data,
            scales,
        }
    }

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

    /// The packed values.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// One scale per block or group, in order (none for FP16).
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Bytes stored, data and scales.
    pub fn stored_bytes(&self) -> usize {
        self.data.len() + 4 * self.scales.len()
    }

    /// The scale of value `i` (1 for FP16).
    pub fn scale_of(&self, i: usize) -> f32 {
        match self.format.block() {
            Some(b) => self.scales.get(i / b).copied().unwrap_or(1.0),
            None => 1.0,
        }
    }

    /// The values back, approximately ([`KvFormat::error_bound`] says how closely).
    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.len).map(|i| self.value(i)).collect()
    }

    fn value(&self, i: usize) -> f32 {
        let scale = self.scale_of(i);
        match self.format {
            KvFormat::F16 => f16::from_le_bytes([self.data[2 * i], self.data[2 * i + 1]]).to_f32(),
            KvFormat::Fp8 { .. } => F8E4M3::from_bits(self.data[i]).to_f32() * scale,
            KvFormat::Int8 { .. } => self.data[i] as i8 as f32 * scale,
            KvFormat::Int4 { .. } => {
                let nibble = (self.data[i / 2] >> (4 * (i % 2))) & 0xf;
                // Sign-extend the 4-bit two's complement value.
                (((nibble << 4) as i8) >> 4) as f32 * scale
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const FORMATS: [KvFormat; 4] = [
        KvFormat::F16,
        KvFormat::Fp8 { block: 64 },
        KvFormat::Int8 { block: 32 },
        KvFormat::Int4 { group: 16 },
    ];

    fn check_bound(format: KvFormat, values: &[f32]) {
        let q = format.quantize(values).unwrap();
        assert_eq!(q.len(), values.len());
        for (i, (x, y)) in values.iter().zip(q.dequantize()).enumerate() {
            let bound = format.error_bound(*x, q.scale_of(i));
            assert!(
                (x - y).abs() <= bound,
                "{format:?} value {i}: {x} came back as {y}, off by {} > {bound}",
                (x - y).abs()
            );
        }
    }

    proptest! {
        #[test]
        fn every_value_is_within_its_formats_bound(
            values in proptest::collection::vec(-1000f32..1000.0, 0..400),
            outlier in proptest::option::of((0usize..400, -60000f32..60000.0)),
        ) {
            let mut values = values;
            if let Some((at, v)) = outlier && at < values.len() {
                values[at] = v;
            }
            for f in FORMATS {
                check_bound(f, &values);
            }
        }

        #[test]
        fn small_values_beside_large_ones_stay_bounded(
            tiny in proptest::collection::vec(-1e-3f32..1e-3, 1..200),
        ) {
            let mut v = tiny;
            v.push(300.0);
            for f in FORMATS {
                check_bound(f, &v);
            }
        }
    }

    #[test]
    fn sizes_scales_and_edge_blocks() {
        let v: Vec<f32> = (0..100).map(|i| i as f32 - 50.0).collect();
        let q = KvFormat::Int4 { group: 32 }.quantize(&v).unwrap();
        assert_eq!((q.data().len(), q.scales().len()), (50, 4));
        assert_eq!(q.stored_bytes(), 50 + 16);
        let q = KvFormat::Fp8 { block: 64 }.quantize(&v).unwrap();
        assert_eq!((q.data().len(), q.scales().len()), (100, 2));
        // DeepSeek V3.2's KV: 656 bytes per token per layer is 512 FP8 values with 4 scales of
        // 128, plus 64 BF16 rope values; the FP8 part here is 8.25 bits per value.
        assert_eq!(KvFormat::Fp8 { block: 128 }.bits_per_value(512), 8.25);
        // All zeros: exact.
        let z = KvFormat::Int8 { block: 8 }.quantize(&[0.0; 20]).unwrap();
        assert!(z.dequantize().iter().all(|&x| x == 0.0));
        // The largest magnitude in a block comes back exactly in the integer formats.
        let q = KvFormat::Int8 { block: 4 }
            .quantize(&[0.5, -3.0, 1.0, 2.0])
            .unwrap();
        assert_eq!(q.dequantize()[1], -3.0);
        assert!(KvFormat::F16.quantize(&[]).unwrap().is_empty());
    }

    #[test]
    fn bad_input_is_refused() {
        for f in FORMATS {
            assert!(f.quantize(&[1.0, f32::NAN]).is_err(), "{f:?}");
            assert!(f.quantize(&[f32::INFINITY]).is_err(), "{f:?}");
        }
        assert!(KvFormat::Int8 { block: 0 }.quantize(&[1.0]).is_err());
        let e = KvFormat::F16.quantize(&[1.0, 70000.0]).unwrap_err();
        assert!(e.to_string().contains("value 1"), "{e}");
    }
}
