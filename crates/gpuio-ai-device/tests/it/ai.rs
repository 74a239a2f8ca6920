//! The AI tier's kernels at the HAL: similarity scores (`ai::dot_scores`) against a CPU
//! dot product, rows of f32 in device memory and rows of FP8 bytes read from pinned host
//! memory; on the host backend, the typed refusal (gpuio-ai runs its reference there).

use gpuio_ai_device::{self as ai, ScoreRows};
use gpuio_hal::{
    Backend, BackendPreference, ErrorCode, HostAllocOptions, HostBuffer, pattern, probe,
};

/// E4M3 decoded on the CPU (no NaN in the rows used here).
fn e4m3(b: u8) -> f32 {
    let (e, m) = (((b >> 3) & 0xf) as i32, (b & 7) as f32);
    let a = if e == 0 {
        m / 512.0
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    if b & 0x80 != 0 { -a } else { a }
}

#[test]
fn dot_scores_match_a_cpu_dot_product() {
    for gpu in probe(BackendPreference::Auto).unwrap().gpus {
        let stream = gpu.stream().unwrap();
        let (rows, dim) = (300usize, 96usize);
        let query: Vec<f32> = (0..dim).map(|d| (d as f32 * 0.37).sin()).collect();
        let qbytes: Vec<u8> = query.iter().flat_map(|v| v.to_le_bytes()).collect();
        let q = gpu.alloc(qbytes.len()).unwrap();
        stream.upload(&qbytes, &q, 0).unwrap();
        let scores = gpu.alloc(rows * 4).unwrap();
        // f32 rows in device memory.
        let table: Vec<f32> = (0..rows * dim)
            .map(|i| (pattern::mix64(i as u64) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let tbytes: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = gpu.alloc(tbytes.len()).unwrap();
        stream.upload(&tbytes, &t, 0).unwrap();
        // FP8 rows (any byte but the NaNs) in pinned host memory.
        let mut fp8 =
            HostBuffer::alloc_pinned(rows * dim, &HostAllocOptions::default(), &gpu).unwrap();
        pattern::fill(&mut fp8, 0, 9);
        fp8.iter_mut()
            .filter(|b| **b & 0x7f == 0x7f)
            .for_each(|b| *b ^= 1);
        let cases: [(ScoreRows<'_>, bool); 2] = [
            (ScoreRows::Device(&t), false),
            (ScoreRows::Pinned(&fp8), true),
        ];
        for (table_rows, is_fp8) in cases {
            let done = ai::dot_scores(&stream, table_rows, rows, dim, is_fp8, &q, &scores);
            if gpu.backend() == Backend::Host {
                assert_eq!(done.unwrap_err().code(), ErrorCode::Unsupported);
                continue;
            }
            done.unwrap();
            let mut raw = vec![0u8; rows * 4];
            stream.download(&scores, 0, &mut raw).unwrap();
            for r in 0..rows {
                let got = f32::from_le_bytes(raw[4 * r..4 * r + 4].try_into().unwrap());
                let want: f32 = (0..dim)
                    .map(|d| {
                        let v = if is_fp8 {
                            e4m3(fp8[r * dim + d])
                        } else {
                            table[r * dim + d]
                        };
                        v * query[d]
                    })
                    .sum();
                let scale: f32 = (0..dim).map(|d| query[d].abs()).sum::<f32>().max(1.0);
                let tol = 1e-5 * scale * if is_fp8 { 448.0 } else { 1.0 };
                assert!(
                    (got - want).abs() <= tol,
                    "fp8 {is_fp8} row {r}: {got} vs {want}"
                );
            }
        }
        // Shapes refused before anything runs.
        let e = ai::dot_scores(
            &stream,
            ScoreRows::Device(&t),
            rows + 1,
            dim,
            false,
            &q,
            &scores,
        );
        assert_eq!(e.unwrap_err().code(), ErrorCode::InvalidArg);
        let e = ai::dot_scores(&stream, ScoreRows::Device(&t), rows, 0, false, &q, &scores);
        assert_eq!(e.unwrap_err().code(), ErrorCode::InvalidArg);
    }
}

/// FP16 and FP8 codes of values worked out by hand: every byte as the formats define it
/// (round to nearest, ties to even); the host backend refuses.
#[test]
fn quantized_bytes_are_the_formats_own() {
    use gpuio_ai_device::{QuantKind, QuantizedAt};
    for gpu in probe(BackendPreference::Auto).unwrap().gpus {
        let stream = gpu.stream().unwrap();
        let values = [
            -485.15594f32,
            1.0,
            0.5,
            300.0,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
        ];
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let src = gpu.alloc(raw.len()).unwrap();
        stream.upload(&raw, &src, 0).unwrap();
        let data = gpu.alloc(2 * values.len()).unwrap();
        let scales = gpu.alloc(64).unwrap();
        let at = QuantizedAt {
            data: &data,
            data_offset: 0,
            scales: &scales,
            scales_offset: 0,
        };
        let done = ai::quantize(&stream, QuantKind::F16, 1, &src, 0, values.len(), at);
        if gpu.backend() == Backend::Host {
            assert_eq!(done.unwrap_err().code(), ErrorCode::Unsupported);
            continue;
        }
        done.unwrap();
        let mut got = vec![0u8; 2 * values.len()];
        stream.download(&data, 0, &mut got).unwrap();
        let words: Vec<u16> = got
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        // 1 + 2^-11 is a tie that rounds down to even, 1 + 3·2^-11 one that rounds up.
        assert_eq!(
            words,
            [0xdf95, 0x3c00, 0x3800, 0x5cb0, 0x3c00, 0x3c02],
            "{got:02x?}"
        );
        // In place (data over the source it reads): refused before anything runs.
        let onto_src = QuantizedAt { data: &src, ..at };
        let e =
            ai::quantize(&stream, QuantKind::Int8, 4, &src, 0, values.len(), onto_src).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        // FP8 with one block: the largest magnitude (485.15594) maps to 448 (0xfe, negative).
        ai::quantize(&stream, QuantKind::Fp8, 8, &src, 0, values.len(), at).unwrap();
        let mut fp8 = vec![0u8; values.len()];
        stream.download(&data, 0, &mut fp8).unwrap();
        assert_eq!(fp8[0], 0xfe, "{fp8:02x?}");
    }
}
