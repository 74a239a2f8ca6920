//! Compression in the `ai` suite: KV quantization on the GPU against the CPU reference (value
//! GB/s, the error measured against each format's bound), and the lossless codecs (LZ4, ZSTD)
//! on the CPU — GB/s and ratio on FP8 KV (quantized from a synthetic attention-like
//! distribution: most values small, a few channels with outliers, as KV caches have) and on an
//! embedding table. The codecs run on the CPU only: no GPU codec library is on the machines.

use super::ai;
use crate::{Record, Result, Target};
use gpuio_ai::compress::{Codec, KvFormat, decompress};
use gpuio_api::Session;
use gpuio_hal::pattern::mix64;
use std::time::Instant;

/// Values quantized per call (64 MiB of f32).
const VALUES: usize = 16 << 20;

/// KV-like values: per channel (of 512) a spread, a few channels 20× wider (outliers), each
/// value a sum of uniforms (roughly normal).
fn kv_values(n: usize, seed: u64) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let channel = i % 512;
            let spread = if mix64(channel ^ seed).is_multiple_of(32) {
                20.0
            } else {
                1.0
            };
            let h = mix64(i ^ seed.rotate_left(7));
            let u = |k: u32| ((h >> (16 * k)) & 0xffff) as f32 / 65536.0 - 0.5;
            spread * (u(0) + u(1) + u(2) + u(3))
        })
        .collect()
}

/// Runs the compression measurements; a GPU is needed for the quantization kernels.
pub(super) fn run(
    session: &Session,
    device: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Record>, Vec<Target>, Vec<String>)> {
    let (mut records, mut notes) = (Vec::new(), Vec::new());
    let values = kv_values(VALUES, crate::fresh_seed());
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let src = session.alloc_device(0, bytes.len())?;
    src.gpu().stream()?.upload(&bytes, &src, 0)?;
    let input_gb = bytes.len() as f64 / 1e9;
    for format in [
        KvFormat::F16,
        KvFormat::Fp8 { block: 128 },
        KvFormat::Int8 { block: 128 },
        KvFormat::Int4 { group: 32 },
    ] {
        progress(&format!("compression: {format:?}"));
        let mut gpu_times = Vec::new();
        let mut quantized = None;
        for _ in 0..6 {
            let t = Instant::now();
            let q = format.quantize_device(&src, 0, VALUES).map_err(ai)?;
            gpu_times.push(t.elapsed().as_secs_f64());
            quantized = Some(q);
        }
        let cpu_t = Instant::now();
        let reference = format.quantize(&values).map_err(ai)?;
        let cpu_s = cpu_t.elapsed().as_secs_f64();
        let host = quantized.map(|q| q.to_host()).transpose().map_err(ai)?;
        if host.as_ref() != Some(&reference) {
            notes.push(format!(
                "compression: {format:?} on the GPU differs from the CPU reference"
            ));
        }
        let back = reference.dequantize();
        let worst = values
            .iter()
            .zip(&back)
            .enumerate()
            .map(|(i, (x, y))| (x - y).abs() / format.error_bound(*x, reference.scale_of(i)))
            .fold(0f32, f32::max);
        let gpu_gbs = input_gb / crate::median_f64(gpu_times[1..].to_vec());
        let case = format!("quantize {format:?}");
        let mut r = Record::versus(
            super::SUITE,
            (&case, "input rate", "GB/s"),
            gpu_gbs,
            "CPU reference (one core)",
            input_gb / cpu_s,
            true,
        );
        r.route = format!(
            "{:.2} bits per value, worst error {:.2} of its bound",
            format.bits_per_value(VALUES),
            worst
        );
        r.device = device.to_string();
        r.bytes = bytes.len();
        records.push(r);
    }
    // The codecs on FP8 KV and on an FP8 embedding table (rows of Zipf-ish magnitudes).
    let fp8 = KvFormat::Fp8 { block: 128 }
        .quantize(&values[..VALUES / 4])
        .map_err(ai)?;
    let table: Vec<u8> = (0..(4usize << 20) as u64)
        .map(|i| (mix64(i / 256) % 64) as u8 ^ (mix64(i) % 4) as u8)
        .collect();
    for (what, data) in [("FP8 KV", fp8.data()), ("FP8 embedding rows", &table[..])] {
        for codec in [
            Codec::Lz4,
            Codec::Zstd { level: 1 },
            Codec::Zstd { level: 3 },
        ] {
            progress(&format!("compression: {codec:?} on {what}"));
            let t = Instant::now();
            let frame = codec.compress(data).map_err(ai)?;
            let c = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let back = decompress(&frame, data.len()).map_err(ai)?;
            let d = t.elapsed().as_secs_f64();
            if back != data {
                notes.push(format!("compression: {codec:?} did not round-trip {what}"));
            }
            notes.push(format!(
                "compression: {codec:?} on {what} ({} MiB, CPU, one core): ratio {:.3}, \
                 compress {:.2} GB/s, decompress {:.2} GB/s",
                data.len() >> 20,
                data.len() as f64 / frame.len() as f64,
                data.len() as f64 / c / 1e9,
                data.len() as f64 / d / 1e9
            ));
        }
    }
    let targets = vec![Target::judge(
        "compression: KV quantization on the GPU at least as fast as the CPU reference",
        &records,
        |r| r.case.starts_with("quantize"),
        |r| r.ratio,
        1.0,
        "x",
    )];
    Ok((records, targets, notes))
}
