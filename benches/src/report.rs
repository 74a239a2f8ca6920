//! Records, the printed table, and the files under the output directory.

use crate::{BenchError, Result, human};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// One measurement against its peer (DESIGN.md §6).
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// Suite, e.g. `memio`.
    pub suite: String,
    /// Case, e.g. `h2d_pinned/64 MiB`.
    pub case: String,
    /// What was measured, e.g. `bandwidth`.
    pub metric: String,
    /// gpuio's figure.
    pub value: f64,
    /// Its unit, e.g. `GB/s`.
    pub unit: String,
    /// The peer, e.g. `cudaMemcpy`.
    pub peer: String,
    /// The peer's figure.
    pub peer_value: f64,
    /// `value / peer_value` (higher is better for gpuio).
    pub ratio: f64,
    /// Bytes per operation.
    pub bytes: usize,
    /// The route gpuio took.
    pub route: String,
    /// The device measured on.
    pub device: String,
    /// Timed runs per side.
    pub reps: usize,
}

/// A performance target and whether this run met it.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// What the target says.
    pub description: String,
    /// The worst figure among the records it covers, with its unit (e.g. `3.97x`).
    pub measured: Option<String>,
    /// Whether it was met (`None`: not measured in this run).
    pub met: Option<bool>,
}

impl Target {
    /// Judges `records` matching `select`: the worst `figure` must reach `need`.
    pub fn judge(
        description: &str,
        records: &[Record],
        select: impl Fn(&Record) -> bool,
        figure: impl Fn(&Record) -> f64,
        need: f64,
        unit: &str,
    ) -> Self {
        let worst = records
            .iter()
            .filter(|r| select(r))
            .map(&figure)
            .fold(None, |w: Option<f64>, v| Some(w.map_or(v, |w| w.min(v))));
        Self {
            description: description.into(),
            measured: worst.map(|w| format!("{w:.2}{unit}")),
            met: worst.map(|w| w >= need),
        }
    }
}

/// The table printed at the end of a run; columns as wide as their longest entry.
pub fn render_table(records: &[Record], targets: &[Target]) -> String {
    let mut out = String::new();
    let case_of = |r: &Record| r.case.split('/').next().unwrap_or(&r.case).to_string();
    let value = |v: f64, unit: &str| format!("{v:.2} {unit}");
    let cw = records.iter().map(|r| case_of(r).len()).max().unwrap_or(0);
    let pw = records.iter().map(|r| r.peer.len()).max().unwrap_or(0);
    let vw = records
        .iter()
        .flat_map(|r| [value(r.value, &r.unit), value(r.peer_value, &r.unit)])
        .map(|v| v.len())
        .max()
        .unwrap_or(0);
    let mut suite = "";
    for r in records {
        if r.suite != suite {
            suite = &r.suite;
            let head = format!("[{suite}] case");
            out.push_str(&format!(
                "\n{head:<cw$} {:>9} {:>vw$} {:<pw$} {:>vw$} {:>7}  route\n",
                "size",
                "gpuio",
                "peer",
                "peer value",
                "ratio",
                cw = cw.max(head.len()),
            ));
        }
        out.push_str(&format!(
            "{:<cw$} {:>9} {:>vw$} {:<pw$} {:>vw$} {:>6.2}x  {}\n",
            case_of(r),
            human(r.bytes),
            value(r.value, &r.unit),
            r.peer,
            value(r.peer_value, &r.unit),
            r.ratio,
            r.route,
            cw = cw.max(suite.len() + 7),
        ));
    }
    if !targets.is_empty() {
        out.push_str("\ntargets:\n");
        for t in targets {
            let verdict = match (t.met, &t.measured) {
                (Some(true), Some(w)) => format!("met (worst {w})"),
                (Some(false), Some(w)) => format!("MISSED (worst {w})"),
                _ => "not measured in this run".into(),
            };
            out.push_str(&format!("  {:<62} {verdict}\n", t.description));
        }
    }
    out
}

/// Writes `<suite>.json` (records, targets, notes such as peers that could not run) and
/// `<suite>.svg` (the plot) into `dir`.
pub fn write_outputs(
    dir: &Path,
    suite: &str,
    records: &[Record],
    targets: &[Target],
    notes: &[String],
) -> Result<Vec<PathBuf>> {
    let fail = |path: &Path, e: &dyn std::fmt::Display| BenchError::Output {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| fail(dir, &e))?;
    let json = dir.join(format!("{suite}.json"));
    let doc = serde_json::json!({ "records": records, "targets": targets, "notes": notes });
    let text = serde_json::to_string_pretty(&doc).map_err(|e| fail(&json, &e))?;
    std::fs::write(&json, text).map_err(|e| fail(&json, &e))?;
    let mut files = vec![json];
    // A bandwidth plot over sizes only where the suite sweeps sizes.
    let sizes: std::collections::BTreeSet<usize> = records
        .iter()
        .filter(|r| r.unit == "GB/s")
        .map(|r| r.bytes)
        .collect();
    if sizes.len() > 1 {
        let svg = dir.join(format!("{suite}.svg"));
        crate::plot::bandwidth_plot(&svg, suite, records).map_err(|e| fail(&svg, &e))?;
        files.push(svg);
    }
    Ok(files)
}
