//! Bandwidth against transfer size: gpuio (solid, with a marker per size) and its peer
//! (dashed), one colour and marker shape per case.

use super::{GPUIO, PlotResult, device, other};
use crate::Record;
use plotters::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The case a record belongs to: its name before the size (`h2d_pinned/64 MiB`).
fn case_of(r: &Record) -> &str {
    r.case.split('/').next().unwrap_or(&r.case)
}

/// Whether `records` sweep sizes: one unit, and every case measured at two sizes or more (a
/// line through one point shows nothing).
pub(super) fn is_sweep(records: &[Record]) -> bool {
    let mut sizes: BTreeMap<&str, BTreeSet<usize>> = BTreeMap::new();
    for r in records {
        sizes.entry(case_of(r)).or_default().insert(r.bytes);
    }
    let units: BTreeSet<&str> = records.iter().map(|r| r.unit.as_str()).collect();
    !sizes.is_empty() && units.len() == 1 && sizes.values().all(|s| s.len() > 1)
}

/// Draws the sweep.
pub(super) fn plot(path: &Path, suite: &str, records: &[Record]) -> PlotResult {
    let mut cases: BTreeMap<&str, Vec<&Record>> = BTreeMap::new();
    for r in records {
        cases.entry(case_of(r)).or_default().push(r);
    }
    // Bandwidths span three decades (host links ~50 GB/s, device copies ~2 TB/s): log y.
    let values = || {
        records
            .iter()
            .flat_map(|r| [r.value, r.peer_value])
            .filter(|v| *v > 0.0)
    };
    let max_y = values().fold(1.0f64, f64::max) * 1.5;
    let min_y = values().fold(max_y, f64::min) / 1.5;
    // x in log2(bytes), so ticks fall on powers of two and read as sizes.
    let log2 = |b: usize| (b.max(1) as f64).log2();
    let min_x = records
        .iter()
        .map(|r| log2(r.bytes))
        .fold(f64::MAX, f64::min);
    let max_x = records.iter().map(|r| log2(r.bytes)).fold(0.0f64, f64::max);
    let (min_x, max_x) = (min_x.min(max_x) - 0.3, max_x + 0.3);
    let root = SVGBackend::new(path, (1100, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let peers: BTreeSet<&str> = records.iter().map(|r| r.peer.as_str()).collect();
    let peers: Vec<&str> = peers.into_iter().collect();
    let body = root.titled(
        &format!("gpuio {suite} on {}", device(records)),
        ("sans-serif", 20),
    )?;
    // The legend right of the chart: inside it would cover whichever corner the data reach.
    let (plot_area, legend) = body.split_horizontally(900);
    let mut chart = ChartBuilder::on(&plot_area)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(min_x..max_x, (min_y..max_y).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("bytes per transfer")
        .y_desc(records.first().map_or("GB/s", |r| r.unit.as_str()))
        .x_labels(((max_x - min_x) as usize).clamp(2, 20))
        .x_label_formatter(&|v| {
            if (v - v.round()).abs() < 1e-6 && *v >= 0.0 {
                crate::human(1usize << (v.round() as u32))
            } else {
                String::new()
            }
        })
        .label_style(("sans-serif", 12))
        .axis_desc_style(("sans-serif", 12))
        .draw()?;
    let font = ("sans-serif", 13);
    let mut y = 20;
    for (i, (case, rs)) in cases.iter().enumerate() {
        let color = if i == 0 { GPUIO } else { other(i - 1) };
        let ours: Vec<(f64, f64)> = rs.iter().map(|r| (log2(r.bytes), r.value)).collect();
        let peer: Vec<(f64, f64)> = rs.iter().map(|r| (log2(r.bytes), r.peer_value)).collect();
        chart.draw_series(LineSeries::new(ours.clone(), color.stroke_width(2)))?;
        chart.draw_series(DashedLineSeries::new(peer, 6, 4, color.stroke_width(1)))?;
        legend.draw(&PathElement::new(
            vec![(0, y + 7), (24, y + 7)],
            color.stroke_width(2),
        ))?;
        // A marker shape per case, so cases whose lines coincide (pinned copies either way
        // run at the same rate) still both show.
        let at = (12, y + 7);
        match i % 4 {
            0 => {
                chart.draw_series(ours.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
                legend.draw(&Circle::new(at, 3, color.filled()))?;
            }
            1 => {
                let ring = color.stroke_width(2);
                chart.draw_series(ours.into_iter().map(|p| Circle::new(p, 6, ring)))?;
                legend.draw(&Circle::new(at, 6, ring))?;
            }
            2 => {
                let cross = color.stroke_width(2);
                chart.draw_series(ours.into_iter().map(|p| Cross::new(p, 5, cross)))?;
                legend.draw(&Cross::new(at, 5, cross))?;
            }
            _ => {
                let tri = color.filled();
                chart.draw_series(ours.into_iter().map(|p| TriangleMarker::new(p, 6, tri)))?;
                legend.draw(&TriangleMarker::new(at, 6, tri))?;
            }
        }
        legend.draw(&Text::new(case.to_string(), (32, y), font))?;
        y += 22;
    }
    y += 10;
    for line in [
        "solid, markers: gpuio".to_string(),
        format!("dashed: {}", peers.join(" / ")),
    ] {
        legend.draw(&Text::new(line, (0, y), font))?;
        y += 20;
    }
    root.present()?;
    Ok(())
}
