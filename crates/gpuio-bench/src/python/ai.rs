//! `py_ai_*`: what `gpuio.ai`'s calls cost over the gpuio-ai calls they wrap. Each side builds
//! the same structures (`Shape`, handed to the Python side as JSON so both read one
//! definition) and times the same call one at a time; the binding's overhead is the
//! difference of the p50s (target ≤ 2 µs). The calls are small on purpose (a 64-entry
//! selection that hits the hot buffer after the warm-up; 64 Engram rows), so the fixed cost
//! is what is measured.

use crate::{Record, Result, Target};
use gpuio_ai::engram::EngramTable;
use gpuio_ai::kv::{KvPool, KvPoolConfig, SwapInBatch, SwapInConfig, SwapInKv, SwapInTarget};
use gpuio_api::{HostPlacement, Session};
use std::time::Instant;

/// The structures both sides build.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Shape {
    /// Bytes per KV entry.
    pub entry_bytes: usize,
    /// Tokens stored.
    pub tokens: u64,
    /// Entries one load selects (and Engram rows one lookup reads).
    pub selection: usize,
    /// Engram table rows.
    pub rows: u64,
    /// Engram row bytes.
    pub row_bytes: usize,
}

/// The suite's shape: DeepSeek V3.2's entry, a 64-entry selection, 256-byte Engram rows.
pub const SHAPE: Shape = Shape {
    entry_bytes: 656,
    tokens: 8192,
    selection: 64,
    rows: 1 << 16,
    row_bytes: 256,
};

/// The positions (and Engram ids) every call reads: spread over the stored range.
pub fn positions(shape: &Shape) -> Vec<u64> {
    (0..shape.selection as u64)
        .map(|i| i * 127 % shape.tokens)
        .collect()
}

/// p50 ns of `calls` runs of `f`, after a warm-up.
fn p50_ns(calls: usize, mut f: impl FnMut() -> gpuio_ai::Result<()>) -> Result<f64> {
    for _ in 0..calls.min(1000) {
        f().map_err(ai_err)?;
    }
    let mut lat = Vec::with_capacity(calls);
    for _ in 0..calls {
        let t = Instant::now();
        f().map_err(ai_err)?;
        lat.push(t.elapsed().as_nanos() as f64);
    }
    lat.sort_by(f64::total_cmp);
    Ok(lat[lat.len() / 2])
}

fn ai_err(e: gpuio_ai::AiError) -> crate::BenchError {
    crate::BenchError::Options(format!("py_ai (the Rust side): {e}"))
}

/// The Rust side's p50s, ns: KvPool.load, SwapInBatch.load, EngramTable.lookup.
pub fn rust_p50s(session: &Session, calls: usize) -> Result<[f64; 3]> {
    let s = SHAPE;
    let dram = HostPlacement::Dram { numa: None };
    let stored = s.tokens as usize * s.entry_bytes;
    let sel = positions(&s);

    let mut pool = KvPool::new(
        session,
        KvPoolConfig {
            layers: 1,
            entry_bytes: s.entry_bytes,
            max_tokens: s.tokens,
            warm_entries: s.tokens,
            hot_slots: 2 * s.selection,
            max_selection: s.selection,
            gpu: 0,
            placement: dram,
        },
    )
    .map_err(ai_err)?;
    let src = session.alloc_device(0, stored)?;
    pool.store(session, 0, 0, s.tokens as usize, &src, 0, None)
        .map_err(ai_err)?;
    let dst = session.alloc_device(0, s.selection * s.entry_bytes)?;
    let kv_load = p50_ns(calls, || pool.load(0, &sel, &dst, 0).map(drop))?;

    let kv = SwapInKv::new(
        session,
        SwapInConfig {
            layers: 1,
            entry_bytes: s.entry_bytes,
            max_tokens: s.tokens,
            hot_slots: 2 * s.selection,
            max_selection: s.selection,
            gpu: 0,
            placement: dram,
        },
    )
    .map_err(ai_err)?;
    kv.append(0, &vec![0u8; stored]).map_err(ai_err)?;
    let selection = session.alloc_device(0, 4 * s.selection)?;
    let words: Vec<u8> = sel.iter().flat_map(|&p| (p as u32).to_le_bytes()).collect();
    session.upload(&words, &selection, 0)?;
    let target = SwapInTarget {
        kv: &kv,
        selection: &selection,
        dst: &dst,
        dst_offset: 0,
    };
    let mut batch = SwapInBatch::new(session, 0, &[target]).map_err(ai_err)?;
    let counts = [s.selection];
    let swap_load = p50_ns(calls, || batch.load(&counts).map(drop))?;

    let table = EngramTable::new(session, s.rows, s.row_bytes, dram).map_err(ai_err)?;
    let out = session.alloc_device(0, s.selection * s.row_bytes)?;
    let lookup = p50_ns(calls, || table.lookup(session, &sel, &out, 0).map(drop))?;
    Ok([kv_load, swap_load, lookup])
}

/// The records and targets of the three cases from both sides' p50s.
pub fn records(rust: [f64; 3], py: &serde_json::Value) -> (Vec<Record>, Vec<Target>) {
    let cases = [
        ("py_ai_kv_load", "kv_load_p50_ns", "KvPool.load"),
        (
            "py_ai_swap_in_load",
            "swap_in_load_p50_ns",
            "SwapInBatch.load",
        ),
        (
            "py_ai_engram_lookup",
            "engram_lookup_p50_ns",
            "EngramTable.lookup",
        ),
    ];
    let (mut records, mut targets) = (Vec::new(), Vec::new());
    for ((case, key, call), rust_ns) in cases.into_iter().zip(rust) {
        let Some(py_ns) = py[key].as_f64() else {
            continue;
        };
        let over = (py_ns - rust_ns) / 1e3;
        records.push(Record {
            bytes: SHAPE.selection * SHAPE.entry_bytes,
            ..Record::versus(
                super::SUITE,
                (case, "p50", "us"),
                py_ns / 1e3,
                "Rust call",
                rust_ns / 1e3,
                false,
            )
        });
        targets.push(Target {
            description: format!("gpuio.ai {call} overhead per call, p50 <= 2 us over Rust"),
            measured: Some(format!("{over:.2} us")),
            met: Some(over <= 2.0),
        });
    }
    (records, targets)
}
