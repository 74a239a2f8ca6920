//! `py_lmcache_*`: gpuio's LMCache connector (`gpuio.lmcache`) against LMCache's own stores,
//! all driven through LMCache's interfaces on the same KV chunks (`peers/lmcache_peer.py`):
//! chunks in files (gpuio with no host tier, against LMCache's filesystem L2 adapter, both
//! warm in the page cache) and chunks in host memory (gpuio's pinned tier against LMCache's
//! engine CPU backend). Every chunk read back is compared with what was stored; one wrong
//! chunk fails the suite.

use crate::{BenchError, Record, Result, Target};

/// One store's figures from the peer script.
struct Store {
    store_gbps: f64,
    retrieve_gbps: f64,
    chunk_p50_us: f64,
}

fn store(py: &serde_json::Value, name: &str, notes: &mut Vec<String>) -> Result<Option<Store>> {
    let Some(s) = py["stores"]
        .as_array()
        .and_then(|all| all.iter().find(|s| s["name"] == name))
    else {
        notes.push(format!("py_lmcache: no figures for {name}"));
        return Ok(None);
    };
    if let Some(why) = s["absent"].as_str() {
        notes.push(format!("py_lmcache: {name} could not run: {why}"));
        return Ok(None);
    }
    match s["problems"].as_array() {
        Some(p) if p.is_empty() => {}
        Some(p) => {
            let p: Vec<&str> = p.iter().filter_map(serde_json::Value::as_str).collect();
            return Err(BenchError::Options(format!(
                "py_lmcache: {name}: {}",
                p.join("; ")
            )));
        }
        None => {
            return Err(BenchError::Options(format!(
                "py_lmcache: {name}: no account of its chunks"
            )));
        }
    }
    let f = |k: &str| s[k].as_f64().unwrap_or(f64::NAN);
    Ok(Some(Store {
        store_gbps: f("store_bps") / 1e9,
        retrieve_gbps: f("retrieve_bps") / 1e9,
        chunk_p50_us: f("chunk_p50_us"),
    }))
}

/// A record of `case` against `peer`, chunk-sized.
fn versus(
    case: (&str, &str, &str),
    chunk: usize,
    ours: f64,
    peer: (&str, f64),
    higher: bool,
) -> Record {
    Record {
        bytes: chunk,
        ..Record::versus(super::SUITE, case, ours, peer.0, peer.1, higher)
    }
}

/// Judges `r`'s ratio against `need`.
fn target(description: String, r: &Record, need: f64) -> Target {
    Target {
        description,
        measured: Some(format!("{:.2}x", r.ratio)),
        met: Some(r.ratio >= need),
    }
}

/// The records and targets of the peer's JSON `py`.
pub fn records(
    py: &serde_json::Value,
    notes: &mut Vec<String>,
) -> Result<(Vec<Record>, Vec<Target>)> {
    let chunk = py["chunk_bytes"].as_u64().unwrap_or(0) as usize;
    let (mut records, mut targets) = (Vec::new(), Vec::new());
    let file = store(py, "gpuio file", notes)?;
    let pinned = store(py, "gpuio pinned", notes)?;
    let fs = store(py, "LMCache fs", notes)?;
    let cpu = store(py, "LMCache CPU", notes)?;
    if let (Some(ours), Some(peer)) = (&file, &fs) {
        let case = "py_lmcache_file";
        let peer_of = |v: f64| ("LMCache fs", v);
        let retrieve = versus(
            (case, "retrieve", "GB/s"),
            chunk,
            ours.retrieve_gbps,
            peer_of(peer.retrieve_gbps),
            true,
        );
        let stored = versus(
            (case, "store", "GB/s"),
            chunk,
            ours.store_gbps,
            peer_of(peer.store_gbps),
            true,
        );
        targets.push(target(
            "LMCache connector: retrieve of warm chunks >= 2x LMCache fs".into(),
            &retrieve,
            2.0,
        ));
        targets.push(target(
            "LMCache connector: store >= 1x LMCache fs".into(),
            &stored,
            1.0,
        ));
        records.extend([
            retrieve,
            stored,
            versus(
                (case, "chunk_p50", "us"),
                chunk,
                ours.chunk_p50_us,
                peer_of(peer.chunk_p50_us),
                false,
            ),
        ]);
    }
    if let (Some(ours), Some(peer)) = (&pinned, &cpu) {
        let case = "py_lmcache_pinned";
        let peer_of = |v: f64| ("LMCache CPU", v);
        let retrieve = versus(
            (case, "retrieve", "GB/s"),
            chunk,
            ours.retrieve_gbps,
            peer_of(peer.retrieve_gbps),
            true,
        );
        targets.push(target(
            "LMCache connector: retrieve from pinned memory >= 1x LMCache CPU".into(),
            &retrieve,
            1.0,
        ));
        let mut r = versus(
            (case, "chunk_p50", "us"),
            chunk,
            ours.chunk_p50_us,
            peer_of(peer.chunk_p50_us),
            false,
        );
        r.route = format!(
            "gpuio pinned store {:.1} GB/s (LMCache CPU keeps the object it is handed)",
            ours.store_gbps
        );
        records.extend([retrieve, r]);
    }
    Ok((records, targets))
}
