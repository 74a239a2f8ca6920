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
    let max_y = records
        .iter()
        .map(|r| r.value.max(r.peer_value))
        .fold(1.0f64, f64::max)
        * 1.1;
    let (min_x, max_x) = records.iter().fold((f64::MAX, 1.0f64), |(lo, hi), r| {
        (lo.min(r.bytes as f64), hi.max(r.bytes as f64))
    });
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
        .build_cartesian_2d((min_x.min(max_x)..max_x * 1.5).log_scale(), 0.0..max_y)?;
    chart
        .configure_mesh()
        .x_desc("bytes per transfer")
        .y_desc(records.first().map_or("GB/s", |r| r.unit.as_str()))
        .x_label_formatter(&|v| crate::human(*v as usize))
        .draw()?;
    for (i, (case, rs)) in cases.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let ours: Vec<(f64, f64)> = rs.iter().map(|r| (r.bytes as f64, r.value)).collect();
        let peer: Vec<(f64, f64)> = rs.iter().map(|r| (r.bytes as f64, r.peer_value)).collect();
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
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    Ok(())
}
