//! `py_ai_*`: what `gpuio.ai`'s calls cost over the gpuio-ai calls they wrap. Each side builds
//! the same structures (`Shape`, handed to the Python side as JSON so both read one
//! definition) and times the same call one at a time; the binding's overhead is the
//! difference of the p50s (target ≤ 2 µs). The calls are small on purpose (a 64-entry
//! selection that hits the hot buffer after the warm-up; 64 Engram rows), so the fixed cost
//! is what is measured. The two sides run in different processes, whose p50s of the same
//! call drift by a few microseconds from one process to the next, so they take turns,
//! [`ROUNDS`] times, and each side's figure is the median of its rounds.

use crate::{Record, Result, Target, peers};
use gpuio_ai::engram::{EngramTable, TableLookup};
use gpuio_ai::kv::{
    KvBatch, KvPool, KvPoolConfig, SwapInBatch, SwapInConfig, SwapInKv, SwapInTarget,
};
use gpuio_api::{HostPlacement, Session};
use std::time::Instant;

/// Rounds each side runs.
pub const ROUNDS: usize = 5;

/// The suite's records and targets, or why the Python side could not run.
pub type Cases = std::result::Result<(Vec<Record>, Vec<Target>), String>;

/// The `py_ai_*` records and targets, or why the Python side could not run.
pub fn cases(session: &Session, calls: usize) -> Result<Cases> {
    // Steps of B1 (~150 µs each) and B2: enough for a steady p50.
    let steps = (calls / 10).max(200);
    let shape = serde_json::to_string(&SHAPE).unwrap_or_default();
    let positions: Vec<String> = positions(&SHAPE).iter().map(u64::to_string).collect();
    let args = [
        calls.to_string(),
        shape,
        positions.join(","),
        steps.to_string(),
    ];
    let (mut calls_ns, mut b1, mut b2, mut py) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        calls_ns.push(rust_p50s(session, calls)?);
        b1.push(rust_b1_p50(session, steps)?);
        b2.push(rust_b2_p50s(session, steps)?);
        match peers::python_binding("ai", &args) {
            Ok(v) => py.push(v),
            Err(why) => return Ok(Err(why)),
        }
    }
    let rust = [0, 1, 2].map(|i| median(calls_ns.iter().map(|r| r[i])));
    let b1 = (
        median(b1.iter().map(|b| b.0)),
        median(b1.iter().map(|b| b.1)),
    );
    let b2: Vec<f64> = (0..SHAPE.b2_tokens.len())
        .map(|i| median(b2.iter().filter_map(|b: &Vec<f64>| b.get(i).copied())))
        .collect();
    let py = median_json(&py);
    let (mut records, mut targets) = records(rust, &py);
    for (r, t) in b1_record(b1, &py).into_iter().chain(b2_records(&b2, &py)) {
        records.push(r);
        targets.push(t);
    }
    Ok(Ok((records, targets)))
}

/// The median of `values` (NaN where there are none).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The Python side's rounds as one: each number (and each number of a list) the median of
/// the rounds'.
fn median_json(rounds: &[serde_json::Value]) -> serde_json::Value {
    use serde_json::Value;
    let Some(Value::Object(first)) = rounds.first() else {
        return Value::Null;
    };
    let at = |key: &str, i: Option<usize>| {
        median(rounds.iter().filter_map(|r| match i {
            None => r[key].as_f64(),
            Some(i) => r[key].get(i).and_then(Value::as_f64),
        }))
    };
    let merged = first
        .iter()
        .map(|(key, v)| {
            let m = match v {
                Value::Array(a) => (0..a.len())
                    .map(|i| Value::from(at(key, Some(i))))
                    .collect(),
                _ => Value::from(at(key, None)),
            };
            (key.clone(), m)
        })
        .collect();
    Value::Object(merged)
}

/// B1's decode step from both sides: a `KvBatch` of `b1_batch` requests, each a top-`b1_topk`
/// of `b1_tokens` stored tokens, the selection moving every 10 steps (a 90% overlap).
pub fn b1_selection(shape: &Shape, step: usize, req: usize) -> Vec<u64> {
    let epoch = (step / 10) as u64;
    (0..shape.b1_topk as u64)
        .map(|i| (i * 31 + req as u64 * 104_729 + epoch * 7919) % shape.b1_tokens)
        .collect()
}

/// The structures both sides build.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Shape {
    /// B1: requests per step, tokens each, and the top-k.
    pub b1_batch: usize,
    pub b1_tokens: u64,
    pub b1_topk: usize,
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
    /// B2: rows of each of its two tables, the first `b2_hot` of them in the GPU hot tier,
    /// the tokens per step and the ids each token reads from each table.
    pub b2_rows: u64,
    pub b2_hot: u64,
    pub b2_tokens: [usize; 2],
    pub b2_ids_per_token: usize,
}

/// The suite's shape: DeepSeek V3.2's entry, a 64-entry selection, 256-byte Engram rows.
pub const SHAPE: Shape = Shape {
    b1_batch: 8,
    b1_tokens: 32 << 10,
    b1_topk: 2048,
    entry_bytes: 656,
    tokens: 8192,
    selection: 64,
    rows: 1 << 16,
    row_bytes: 256,
    b2_rows: 1 << 20,
    b2_hot: 1 << 17,
    b2_tokens: [1, 16],
    b2_ids_per_token: 24,
};

/// B2's ids for `step` of an `n`-token lookup in table `table`: `b2_ids_per_token` per
/// token, five in six of them in the hot tier's range (B2's trace reads 83–84% there).
pub fn b2_ids(shape: &Shape, step: usize, table: usize, n: usize) -> Vec<u64> {
    (0..(n * shape.b2_ids_per_token) as u64)
        .map(|i| {
            let x = i * 7919 + step as u64 * 104_729 + table as u64 * 15_485_863;
            x % if i % 6 == 0 {
                shape.b2_rows
            } else {
                shape.b2_hot
            }
        })
        .collect()
}

/// The Rust side's B2 steps: p50 ns of one `EngramTable::lookup_tables` of both tables
/// (each with a hot tier) for each of `b2_tokens` tokens per step, over `steps` steps.
pub fn rust_b2_p50s(session: &Session, steps: usize) -> Result<Vec<f64>> {
    let s = SHAPE;
    let hot: Vec<u64> = (0..s.b2_hot).collect();
    let tables = (0..2)
        .map(|_| {
            let t = EngramTable::new(
                session,
                s.b2_rows,
                s.row_bytes,
                HostPlacement::Dram { numa: None },
            )?;
            t.keep_hot(session, 0, &hot)?;
            Ok(t)
        })
        .collect::<gpuio_ai::Result<Vec<_>>>()
        .map_err(ai_err)?;
    let mut out = Vec::new();
    for n in s.b2_tokens {
        let bytes = n * s.b2_ids_per_token * s.row_bytes;
        let dsts = [
            session.alloc_device(0, bytes)?,
            session.alloc_device(0, bytes)?,
        ];
        let ids: Vec<[Vec<u64>; 2]> = (0..steps)
            .map(|step| [0, 1].map(|t| b2_ids(&s, step, t, n)))
            .collect();
        let mut lat = Vec::with_capacity(steps);
        for (step, ids) in ids.iter().enumerate() {
            let lookups: Vec<TableLookup<'_>> = (0..2)
                .map(|t| TableLookup {
                    table: &tables[t],
                    ids: &ids[t],
                    dst: &dsts[t],
                    dst_offset: 0,
                })
                .collect();
            let t = Instant::now();
            EngramTable::lookup_tables(session, &lookups).map_err(ai_err)?;
            if step >= steps / 10 {
                lat.push(t.elapsed().as_nanos() as f64);
            }
        }
        lat.sort_by(f64::total_cmp);
        out.push(lat[lat.len() / 2]);
    }
    Ok(out)
}

/// B2's steps from Python against Rust: a record and a target (within 1.1x) per size.
pub fn b2_records(rust_ns: &[f64], py: &serde_json::Value) -> Vec<(Record, Target)> {
    let s = SHAPE;
    let Some(py_ns) = py["b2_step_p50_ns"].as_array() else {
        return Vec::new();
    };
    s.b2_tokens
        .iter()
        .zip(rust_ns)
        .zip(py_ns.iter().filter_map(serde_json::Value::as_f64))
        .map(|((&n, &rust), py)| {
            let case = format!("py_ai_b2_step_{n}");
            let mut r = Record::versus(
                super::SUITE,
                (&case, "p50", "us"),
                py / 1e3,
                "Rust call",
                rust / 1e3,
                false,
            );
            r.bytes = 2 * n * s.b2_ids_per_token * s.row_bytes;
            r.route = format!(
                "EngramTable.lookup_tables of 2 tables, {n} tokens of {} ids each; \
                 {} of {} rows in each hot tier",
                s.b2_ids_per_token, s.b2_hot, s.b2_rows
            );
            let ratio = py / rust.max(1.0);
            let t = Target {
                description: format!("B2's {n}-token step from Python within 1.1x of Rust (p50)"),
                measured: Some(format!("{ratio:.3}x")),
                met: Some(ratio <= 1.1),
            };
            (r, t)
        })
        .collect()
}

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

/// The Rust side's B1 step: p50 ns of a timed `KvBatch::load` over `steps` steps, wall and
/// device.
pub fn rust_b1_p50(session: &Session, steps: usize) -> Result<(f64, f64)> {
    let s = SHAPE;
    let stored = s.b1_tokens as usize * s.entry_bytes;
    let src = session.alloc_device(0, stored)?;
    let mut pools = Vec::with_capacity(s.b1_batch);
    let mut outs = Vec::with_capacity(s.b1_batch);
    for _ in 0..s.b1_batch {
        let mut pool = KvPool::new(
            session,
            KvPoolConfig {
                layers: 1,
                entry_bytes: s.entry_bytes,
                max_tokens: s.b1_tokens,
                warm_entries: s.b1_tokens,
                hot_slots: 2 * s.b1_topk,
                max_selection: s.b1_topk,
                gpu: 0,
                placement: HostPlacement::Dram { numa: None },
            },
        )
        .map_err(ai_err)?;
        pool.store(session, 0, 0, s.b1_tokens as usize, &src, 0, None)
            .map_err(ai_err)?;
        pools.push(pool);
        outs.push(session.alloc_device(0, s.b1_topk * s.entry_bytes)?);
    }
    let selections: Vec<Vec<Vec<u64>>> = (0..steps)
        .map(|step| (0..s.b1_batch).map(|r| b1_selection(&s, step, r)).collect())
        .collect();
    let mut batch = KvBatch::new();
    let (mut lat, mut dev) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
    for (step, sels) in selections.iter().enumerate() {
        let t = Instant::now();
        let mut loads = crate::ai::step_loads(&mut pools, sels, &outs);
        let (_, device) = batch.load_timed(&mut loads).map_err(ai_err)?;
        if step >= steps / 10 {
            lat.push(t.elapsed().as_nanos() as f64);
            dev.push(device.as_nanos() as f64);
        }
    }
    for v in [&mut lat, &mut dev] {
        v.sort_by(f64::total_cmp);
    }
    Ok((lat[lat.len() / 2], dev[dev.len() / 2]))
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

/// B1's step from Python against Rust: its record and target (within 1.1x).
pub fn b1_record(
    (rust_ns, rust_device_ns): (f64, f64),
    py: &serde_json::Value,
) -> Option<(Record, Target)> {
    let py_ns = py["b1_step_p50_ns"].as_f64()?;
    let py_device_ns = py["b1_step_device_p50_ns"].as_f64().unwrap_or(f64::NAN);
    let s = SHAPE;
    let mut r = Record::versus(
        super::SUITE,
        ("py_ai_b1_step", "p50", "us"),
        py_ns / 1e3,
        "Rust call",
        rust_ns / 1e3,
        false,
    );
    r.bytes = s.b1_batch * s.b1_topk * s.entry_bytes;
    r.route = format!(
        "KvBatch.load of {} requests, top-{} of {} tokens, 90% overlap; device p50 {:.1} us \
         from Python, {:.1} us from Rust",
        s.b1_batch,
        s.b1_topk,
        s.b1_tokens,
        py_device_ns / 1e3,
        rust_device_ns / 1e3
    );
    let ratio = py_ns / rust_ns.max(1.0);
    let t = Target {
        description: "B1's decode step from Python within 1.1x of Rust (p50)".into(),
        measured: Some(format!("{ratio:.3}x")),
        met: Some(ratio <= 1.1),
    };
    Some((r, t))
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
