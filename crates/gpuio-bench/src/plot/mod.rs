//! The suites' pictures (SVG), each chosen by the shape of the suite's records:
//!
//! - a size sweep (every case at several sizes, one unit: `memio`): bandwidth against size,
//!   one line per case ([`lines`]);
//! - the gather grid: bars per row size, a panel per pool size and index list, the repeated
//!   rows' share of each bar drawn pale ([`grid`]);
//! - anything else (named cases against their peers): horizontal bars, a panel per metric,
//!   every bar labelled with who it is and its figure ([`bars`]).

mod bars;
mod grid;
mod lines;

use crate::Record;
use crate::gather::GridCase;
use plotters::style::RGBColor;
use std::path::Path;

/// What drawing a chart returns.
pub(crate) type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// Draws `suite`'s `records` into an SVG file at `path`.
pub(crate) fn plot(path: &Path, suite: &str, records: &[Record]) -> PlotResult {
    if records.iter().any(|r| GridCase::parse(&r.case).is_some()) {
        grid::plot(path, records)
    } else if lines::is_sweep(records) {
        lines::plot(path, suite, records)
    } else {
        bars::plot(path, suite, records)
    }
}

/// gpuio's colour (Tableau 10's blue).
const GPUIO: RGBColor = RGBColor(31, 119, 180);

/// Colours for everything else, in order: the rest of Tableau 10, which stay apart on white
/// and for most colour-blind readers (Palette99's pale yellows do not).
const OTHERS: [RGBColor; 9] = [
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The `i`-th colour after gpuio's.
fn other(i: usize) -> RGBColor {
    OTHERS[i % OTHERS.len()]
}

/// The device the records were measured on, for captions.
fn device(records: &[Record]) -> &str {
    records
        .iter()
        .map(|r| r.device.as_str())
        .find(|d| !d.is_empty())
        .unwrap_or("")
}

/// About how wide `text` is at `size` px: SVG carries no font metrics (the viewer picks the
/// font), so this leans wide.
fn text_width(text: &str, size: f64) -> f64 {
    0.56 * size * text.chars().count() as f64
}

/// A figure to three significant digits or so, with K and M for thousands and millions.
fn figure(v: f64) -> String {
    match v.abs() {
        a if a >= 1e6 => format!("{:.2} M", v / 1e6),
        a if a >= 1e4 => format!("{:.0} K", v / 1e3),
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

/// An axis tick on a linear axis spanning `span`: as many decimals as the steps need.
fn tick(v: f64, span: f64) -> String {
    let (v, span, unit) = match span {
        s if s >= 1e6 => (v / 1e6, s / 1e6, " M"),
        s if s >= 1e4 => (v / 1e3, s / 1e3, " K"),
        s => (v, s, ""),
    };
    let decimals = match span {
        s if s >= 10.0 => 0,
        s if s >= 1.0 => 1,
        _ => 2,
    };
    format!("{v:.decimals$}{unit}")
}

/// The tick at `10^n` on a log axis.
fn power_of_ten(n: i32) -> String {
    match n {
        n if n < 0 => format!("{}", 10f64.powi(n)),
        0..=3 => format!("{}", 10u64.pow(n as u32)),
        4 | 5 => format!("{} K", 10u64.pow(n as u32 - 3)),
        n => format!("{} M", 10f64.powi(n - 6)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(suite: &str, case: &str, unit: &str, bytes: usize, peer: &str) -> Record {
        Record {
            suite: suite.into(),
            case: case.into(),
            metric: "throughput".into(),
            value: 2.0,
            unit: unit.into(),
            peer: peer.into(),
            peer_value: 1.0,
            ratio: 2.0,
            bytes,
            route: String::new(),
            device: "host".into(),
            reps: 3,
            rows: None,
        }
    }

    /// Every layout draws without error, including a single record and repeated cases.
    #[test]
    fn every_layout_draws() {
        let dir = std::env::temp_dir().join(format!("gpuio-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sweep: Vec<Record> = [4096, 1 << 20, 64 << 20]
            .iter()
            .flat_map(|&b| {
                ["h2d", "d2h"].map(|c| record("memio", &format!("{c}/{b}"), "GB/s", b, "memcpy"))
            })
            .collect();
        assert!(lines::is_sweep(&sweep));
        let mut grid = Vec::new();
        for (pool_mib, row, distinct, device_list) in [
            (64, 64, false, false),
            (64, 64, false, true),
            (64, 4096, true, false),
            (256, 64, true, true),
        ] {
            let case = GridCase {
                row,
                pool_mib,
                distinct,
                device_list,
            };
            let mut r = record("gather", &case.to_string(), "GB/s", row, "naive kernel");
            r.rows = Some(crate::RowBytes {
                delivered_bytes: 100,
                unique_bytes: if distinct { 100 } else { 63 },
            });
            grid.push(r);
        }
        let mut categorical = [
            record("localio", "seq_read/64 MiB", "GB/s", 1, "fio"),
            record("localio", "seq_read/64 MiB", "GB/s", 1, "kvikio"),
            record("localio", "rand_read/64 MiB", "IOPS", 1, "fio"),
        ];
        categorical[2].value = 5e6;
        categorical[2].peer_value = 4e4;
        for (name, records) in [
            ("sweep", &sweep[..]),
            ("grid", &grid[..]),
            ("bars", &categorical[..]),
            ("one", &categorical[..1]),
        ] {
            let path = dir.join(format!("{name}.svg"));
            plot(&path, name, records).unwrap();
            let svg = std::fs::read_to_string(&path).unwrap();
            assert!(svg.contains("<rect"), "{name}: no bars or background");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn figures_read_short() {
        assert_eq!(figure(5_324_215.0), "5.32 M");
        assert_eq!(figure(51.47), "51.5");
        assert_eq!(figure(0.27), "0.27");
        assert_eq!(figure(1237.3), "1237");
        assert_eq!(figure(430_764.4), "431 K");
        assert_eq!(tick(200_000.0, 600_000.0), "200 K");
        assert_eq!(tick(2.0, 4.4), "2.0");
        assert_eq!(tick(20.0, 120.0), "20");
        assert_eq!(power_of_ten(-1), "0.1");
        assert_eq!(power_of_ten(2), "100");
        assert_eq!(power_of_ten(5), "100 K");
        assert_eq!(power_of_ten(6), "1 M");
    }
}
