//! safetensors headers: the JSON after a checkpoint's 8-byte length, checked against the
//! length of the file it heads (`gpuio_api::safetensors`).
//!
//! What must hold: a header either is refused with a reason or gives tensors in file order
//! that tile the data from its first byte to the file's end without gaps or overlaps, each
//! as many bytes as its shape and dtype say; and a header written back from what was read is
//! read the same.

use crate::Target;
use gpuio_api::safetensors::SafetensorsHeader;

pub const TARGET: Target = Target {
    name: "safetensors",
    parses: "safetensors checkpoint headers (JSON, offsets, dtypes, shapes)",
    sources: &["crates/gpuio-api/src/safetensors.rs"],
    run,
    seeds,
};

/// The first two bytes are how many data bytes the file has past the header; the rest is the
/// header.
fn run(data: &[u8]) {
    let [a, b, json @ ..] = data else {
        return;
    };
    let data_len = u64::from(u16::from_le_bytes([*a, *b]));
    let file_len = 8 + json.len() as u64 + data_len;
    let Ok(h) = SafetensorsHeader::parse(json, file_len) else {
        return;
    };
    assert_eq!(h.data_start, 8 + json.len() as u64);
    let mut at = 0;
    for t in &h.tensors {
        assert_eq!(t.bytes.start, at, "{}: a gap or an overlap", t.name);
        let elements: u64 = t.shape.iter().map(|&d| d as u64).product();
        assert_eq!(
            elements * t.dtype.bitsize() as u64,
            (t.bytes.end - t.bytes.start) * 8,
            "{}: size against shape",
            t.name
        );
        at = t.bytes.end;
    }
    assert_eq!(h.data_start + at, file_len);
    assert_eq!(h.data_len(), at);
    let written = render(&h);
    let again = SafetensorsHeader::parse(&written, 8 + written.len() as u64 + at)
        .expect("a header written from what was read");
    assert_eq!(again.tensors, h.tensors);
    assert_eq!(again.metadata, h.metadata);
}

/// `h` as header JSON.
fn render(h: &SafetensorsHeader) -> Vec<u8> {
    let mut doc = serde_json::Map::new();
    if let Some(m) = &h.metadata {
        doc.insert("__metadata__".into(), serde_json::json!(m));
    }
    for t in &h.tensors {
        doc.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": t.dtype.to_string(),
                "shape": t.shape,
                "data_offsets": [t.bytes.start, t.bytes.end],
            }),
        );
    }
    serde_json::to_vec(&doc).expect("JSON of strings and numbers")
}

fn seeds() -> Vec<Vec<u8>> {
    [
        (20u16, r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[2,2],"data_offsets":[4,20]},"__metadata__":{"format":"pt"}}"#),
        (0, r#"{"e":{"dtype":"U8","shape":[0,3],"data_offsets":[0,0]}}"#),
        (8, r#"{"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]}}"#),
        (1, r#"{"f":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}"#),
        (0, "{}"),
    ]
    .iter()
    .map(|(n, json)| {
        let mut v = n.to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v
    })
    .collect()
}
