//! Bandwidth against transfer size, gpuio (solid) and its peer (dashed), one colour per case.

use crate::Record;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

pub(crate) fn bandwidth_plot(
    path: &Path,
    suite: &str,
    records: &[Record],
) -> Result<(), Box<dyn std::error::Error>> {
    let mut cases: BTreeMap<&str, Vec<&Record>> = BTreeMap::new();
    for r in records {
        cases
            .entry(r.case.split('/').next().unwrap_or(&r.case))
            .or_default()
            .push(r);
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
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let device = records.first().map_or("", |r| r.device.as_str());
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("gpuio {suite} on {device} (solid: gpuio, dashed: peer)"),
            ("sans-serif", 20),
        )
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
        .draw()?;
    for (i, (case, rs)) in cases.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let ours: Vec<(f64, f64)> = rs.iter().map(|r| (log2(r.bytes), r.value)).collect();
        let peer: Vec<(f64, f64)> = rs.iter().map(|r| (log2(r.bytes), r.peer_value)).collect();
        chart
            .draw_series(LineSeries::new(ours, color.stroke_width(2)))?
            .label(*case)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(DashedLineSeries::new(peer, 6, 4, color.stroke_width(1)))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()?;
    Ok(())
}
