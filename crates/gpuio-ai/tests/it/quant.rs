//! KV quantization of values in device memory (`KvFormat::quantize_device`) against the CPU
//! reference, bit for bit: every packed byte, every scale, every value restored. On the GPU
//! machine this checks the kernels (FP8 rounding and subnormals, FP16 ties, 4-bit nibbles that
//! straddle groups); on the host backend it checks the fallback through host memory.

use gpuio_ai::compress::KvFormat;
use gpuio_api::{Config, DeviceBuffer, Session};
use proptest::prelude::*;

fn upload(session: &Session, values: &[f32]) -> DeviceBuffer {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let buf = session.alloc_device(0, bytes.len().max(4) + 4).unwrap();
    buf.gpu().stream().unwrap().upload(&bytes, &buf, 4).unwrap();
    buf
}

fn check(session: &Session, format: KvFormat, values: &[f32]) -> Result<(), TestCaseError> {
    let src = upload(session, values);
    let q = format.quantize_device(&src, 4, values.len()).unwrap();
    let want = format.quantize(values).unwrap();
    let got = q.to_host().unwrap();
    prop_assert_eq!(got.data(), want.data(), "{:?}: packed data", format);
    let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    prop_assert_eq!(
        bits(got.scales()),
        bits(want.scales()),
        "{:?}: scales",
        format
    );
    prop_assert_eq!(q.stored_bytes(), want.stored_bytes());
    let out = session
        .alloc_device(0, 4 * values.len().max(1) + 8)
        .unwrap();
    q.dequantize_into(&out, 8).unwrap();
    let mut raw = vec![0u8; 4 * values.len()];
    out.gpu()
        .stream()
        .unwrap()
        .download(&out, 8, &mut raw)
        .unwrap();
    let back: Vec<u32> = raw
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    prop_assert_eq!(
        back,
        bits(&want.dequantize()),
        "{:?}: values restored",
        format
    );
    Ok(())
}

/// Values that probe the conversions: FP8 subnormals and the ties between its steps, FP16
/// ties, exact block maxima, zeros of both signs.
fn edgy() -> impl Strategy<Value = f32> {
    prop_oneof![
        -500f32..500.0,
        -1e-3f32..1e-3,
        (0u32..2048).prop_map(|k| (k as f32 + 0.5) / 512.0 / 64.0),
        (0u32..4096).prop_map(|k| 1.0 + (2 * k + 1) as f32 / 2f32.powi(12)),
        Just(0.0f32),
        Just(-0.0f32),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn device_quantization_matches_the_reference_bit_for_bit(
        values in proptest::collection::vec(edgy(), 0..700),
        block in prop::sample::select(vec![1usize, 7, 32, 128]),
    ) {
        let session = Session::new(Config::default()).unwrap();
        for format in [
            KvFormat::F16,
            KvFormat::Fp8 { block },
            KvFormat::Int8 { block },
            KvFormat::Int4 { group: block },
        ] {
            check(&session, format, &values)?;
        }
    }
}

#[test]
fn values_the_format_cannot_take_are_refused_on_the_device_too() {
    let session = Session::new(Config::default()).unwrap();
    let src = upload(&session, &[1.0, 2.0, f32::NAN, 70000.0]);
    for format in [KvFormat::Fp8 { block: 2 }, KvFormat::Int4 { group: 3 }] {
        let e = format.quantize_device(&src, 4, 4).unwrap_err();
        assert!(e.to_string().contains("2"), "{format:?}: {e}");
    }
    let e = KvFormat::F16.quantize_device(&src, 4, 2).map(drop);
    assert!(e.is_ok(), "the first two values are fine: {e:?}");
    let src = upload(&session, &[1.0, 70000.0]);
    let e = KvFormat::F16.quantize_device(&src, 4, 2).unwrap_err();
    assert!(e.to_string().contains("1"), "{e}");
    assert!(
        KvFormat::Int8 { block: 0 }
            .quantize_device(&src, 4, 2)
            .is_err()
    );
}

/// Cases that once differed on the GPU, kept as plain tests.
#[test]
fn known_cases_match_the_reference() {
    let session = Session::new(Config::default()).unwrap();
    for values in [
        vec![-485.15594f32],
        vec![1.0 + 1.0 / 2048.0, -0.0, 3.0e-5, 65504.0],
    ] {
        for format in [
            KvFormat::F16,
            KvFormat::Fp8 { block: 3 },
            KvFormat::Int4 { group: 1 },
        ] {
            check(&session, format, &values).unwrap();
        }
    }
}

/// Blocks whose scale underflows to 0 (they take a scale of 1, every level 0), and blocks
/// longer than the values (one scale for all): the device matches the reference, and every
/// value comes back finite.
#[test]
fn tiny_blocks_and_long_blocks_match_the_reference() {
    let session = Session::new(Config::default()).unwrap();
    for values in [
        vec![1e-45f32, 0.0],
        vec![7e-45, 0.0, -4e-45],
        vec![3.0, -1.0, 0.25],
    ] {
        for block in [2, usize::MAX] {
            for format in [
                KvFormat::Fp8 { block },
                KvFormat::Int8 { block },
                KvFormat::Int4 { group: block },
            ] {
                check(&session, format, &values).unwrap();
                let q = format.quantize(&values).unwrap();
                assert!(q.dequantize().iter().all(|v| v.is_finite()), "{format:?}");
            }
        }
    }
}
