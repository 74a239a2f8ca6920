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

/// One of gpuio's stores against one of LMCache's, in chunk-sized records of `case`.
struct Race<'a> {
    case: &'static str,
    chunk: usize,
    ours: &'a Store,
    peer_name: &'static str,
    peer: &'a Store,
}

impl Race<'_> {
    /// The record of `figure` (higher better or not) from both stores.
    fn record(
        &self,
        (metric, unit): (&str, &str),
        figure: fn(&Store) -> f64,
        higher: bool,
    ) -> Record {
        Record {
            bytes: self.chunk,
            ..Record::versus(
                super::SUITE,
                (self.case, metric, unit),
                figure(self.ours),
                self.peer_name,
                figure(self.peer),
                higher,
            )
        }
    }
}

/// Judges `r`'s ratio against `need`.
fn target(description: &str, r: &Record, need: f64) -> Target {
    Target {
        description: format!("LMCache connector: {description}"),
        measured: Some(format!("{:.2}x", r.ratio)),
        met: Some(r.ratio >= need),
    }
}

/// Retrieve bandwidth, the figure each target judges.
const RETRIEVE: (&str, &str) = ("retrieve", "GB/s");

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
    let chunk_p50 = |s: &Store| s.chunk_p50_us;
    if let (Some(ours), Some(peer)) = (&file, &fs) {
        let race = Race {
            case: "py_lmcache_file",
            chunk,
            ours,
            peer_name: "LMCache fs",
            peer,
        };
        let retrieve = race.record(RETRIEVE, |s| s.retrieve_gbps, true);
        let stored = race.record(("store", "GB/s"), |s| s.store_gbps, true);
        targets.push(target(
            "retrieve of warm chunks >= 2x LMCache fs",
            &retrieve,
            2.0,
        ));
        targets.push(target("store >= 1x LMCache fs", &stored, 1.0));
        records.extend([
            retrieve,
            stored,
            race.record(("chunk_p50", "us"), chunk_p50, false),
        ]);
    }
    if let (Some(ours), Some(peer)) = (&pinned, &cpu) {
        let race = Race {
            case: "py_lmcache_pinned",
            chunk,
            ours,
            peer_name: "LMCache CPU",
            peer,
        };
        let retrieve = race.record(RETRIEVE, |s| s.retrieve_gbps, true);
        targets.push(target(
            "retrieve from pinned memory >= 1x LMCache CPU",
            &retrieve,
            1.0,
        ));
        let mut r = race.record(("chunk_p50", "us"), chunk_p50, false);
        r.route = format!(
            "gpuio pinned store {:.1} GB/s (LMCache CPU keeps the object it is handed)",
            ours.store_gbps
        );
        records.extend([retrieve, r]);
    }
    Ok((records, targets))
}
