//! Records, the printed table, and the files under the output directory.

use crate::{BenchError, Result, human};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// One measurement against its peer.
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
    /// For cases that gather rows: how many of the bytes a call delivers are distinct rows.
    #[serde(flatten)]
    pub rows: Option<RowBytes>,
}

impl Record {
    /// gpuio's `value` against the peer's in `suite`'s `case`; the ratio says how many times
    /// better gpuio is (`higher_is_better` for rates, else for times; a zero is floored so the
    /// ratio stays finite). Bytes, route and device are left for the caller to set.
    pub fn versus(
        suite: &str,
        (case, metric, unit): (&str, &str, &str),
        value: f64,
        peer: &str,
        peer_value: f64,
        higher_is_better: bool,
    ) -> Self {
        let ratio = if higher_is_better {
            value / peer_value.max(1e-9)
        } else {
            peer_value / value.max(0.01)
        };
        Self {
            suite: suite.into(),
            case: case.into(),
            metric: metric.into(),
            value,
            unit: unit.into(),
            peer: peer.into(),
            peer_value,
            ratio,
            bytes: 0,
            route: String::new(),
            device: String::new(),
            reps: 0,
            rows: None,
        }
    }
}

/// What one call of a row-gathering case moves. Both sides of the race gather the same index
/// list, so one pair serves both. Where rows repeat, delivered bytes outrun the bytes that had
/// to cross the link: a repeat may be served from a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RowBytes {
    /// Rows × row size.
    pub delivered_bytes: u64,
    /// Distinct rows × row size.
    pub unique_bytes: u64,
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

/// The table printed at the end of a run; columns as wide as their longest entry. A suite
/// whose records gather rows gets two more columns: bytes delivered per call and how much of
/// that is distinct rows.
pub fn render_table(records: &[Record], targets: &[Target]) -> String {
    let mut out = String::new();
    let case_of = |r: &Record| r.case.split('/').next().unwrap_or(&r.case).to_string();
    let value = |v: f64, unit: &str| format!("{v:.2} {unit}");
    let delivered = |r: &Record| r.rows.map_or(String::new(), |b| size(b.delivered_bytes));
    let unique = |r: &Record| {
        r.rows.map_or(String::new(), |b| {
            let share = b.unique_bytes as f64 / b.delivered_bytes.max(1) as f64;
            format!("{} ({:.0}%)", size(b.unique_bytes), 100.0 * share)
        })
    };
    let width = |f: &dyn Fn(&Record) -> String| records.iter().map(|r| f(r).len()).max();
    let cw = width(&case_of).unwrap_or(0);
    let pw = width(&|r| r.peer.clone()).unwrap_or(0);
    let vw = records
        .iter()
        .flat_map(|r| [value(r.value, &r.unit), value(r.peer_value, &r.unit)])
        .map(|v| v.len())
        .max()
        .unwrap_or(0);
    let dw = width(&delivered).unwrap_or(0).max("delivered".len());
    let uw = width(&unique).unwrap_or(0).max("unique".len());
    let mut suite = "";
    let mut rows = false;
    for r in records {
        if r.suite != suite {
            suite = &r.suite;
            rows = records.iter().any(|o| o.suite == suite && o.rows.is_some());
            let head = format!("[{suite}] case");
            let moved = if rows {
                format!(" {:>dw$} {:>uw$}", "delivered", "unique")
            } else {
                String::new()
            };
            out.push_str(&format!(
                "\n{head:<cw$} {:>9}{moved} {:>vw$} {:<pw$} {:>vw$} {:>7}  route\n",
                "size",
                "gpuio",
                "peer",
                "peer value",
                "ratio",
                cw = cw.max(head.len()),
            ));
        }
        let moved = if rows {
            format!(" {:>dw$} {:>uw$}", delivered(r), unique(r))
        } else {
            String::new()
        };
        out.push_str(&format!(
            "{:<cw$} {:>9}{moved} {:>vw$} {:<pw$} {:>vw$} {:>6.2}x  {}\n",
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

/// A byte count to one decimal in the largest binary unit it fills.
fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / (1u64 << 10) as f64),
        b => format!("{b} B"),
    }
}

/// Writes `<suite>.json` (records, targets, notes such as peers that could not run) and
/// `<suite>.svg` (the plot; none without records) into `dir`.
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
    if !records.is_empty() {
        let svg = dir.join(format!("{suite}.svg"));
        crate::plot::plot(&svg, suite, records).map_err(|e| fail(&svg, &e))?;
        files.push(svg);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(suite: &str, case: &str, rows: Option<RowBytes>) -> Record {
        Record {
            suite: suite.into(),
            case: case.into(),
            metric: "throughput".into(),
            value: 64.6,
            unit: "GB/s".into(),
            peer: "naive kernel".into(),
            peer_value: 47.1,
            ratio: 64.6 / 47.1,
            bytes: 656,
            route: "Sorted".into(),
            device: "gpu0".into(),
            reps: 5,
            rows,
        }
    }

    #[test]
    fn gathers_show_unique_beside_delivered_bytes() {
        let rows = RowBytes {
            delivered_bytes: 256 << 20,
            unique_bytes: 161 << 20,
        };
        let records = [
            record("memio", "h2d/1 MiB", None),
            record("gather", "gather_656B_pool256M", Some(rows)),
        ];
        let table = render_table(&records, &[]);
        let lines: Vec<&str> = table.lines().filter(|l| !l.is_empty()).collect();
        assert!(!lines[0].contains("delivered"), "{table}");
        assert!(lines[2].contains("delivered") && lines[2].contains("unique"));
        assert!(lines[3].contains("256.0 MiB") && lines[3].contains("161.0 MiB (63%)"));
        // In JSON the pair sits beside the record's other keys.
        let json = serde_json::to_value(&records[1]).unwrap();
        assert_eq!(json["delivered_bytes"], 256 << 20);
        assert_eq!(json["unique_bytes"], 161 << 20);
        assert!(
            serde_json::to_value(&records[0])
                .unwrap()
                .get("unique_bytes")
                .is_none()
        );
    }
}
