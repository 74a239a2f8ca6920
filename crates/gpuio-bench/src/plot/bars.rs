//! Named cases against their peers: horizontal bars, a panel per metric, gpuio's bar first in
//! each case and every bar labelled with who it is and its figure (peers' names are too long
//! and too many for a legend).

use super::{GPUIO, PlotResult, device, figure, other, power_of_ten, text_width, tick};
use crate::Record;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

const WIDTH: u32 = 1100;
const BAR: f64 = 15.0;
const BAR_GAP: f64 = 2.0;
const GROUP_GAP: f64 = 10.0;
const FONT: f64 = 12.0;

struct Bar {
    who: String,
    value: f64,
    color: RGBColor,
}

/// One case: gpuio's bar and its peers'.
struct Group {
    label: String,
    bars: Vec<Bar>,
}

/// One metric in one unit.
struct Panel {
    title: String,
    unit: String,
    groups: Vec<Group>,
}

impl Panel {
    fn bars(&self) -> usize {
        self.groups.iter().map(|g| g.bars.len()).sum()
    }

    /// Pixels the bars take.
    fn height(&self) -> f64 {
        self.bars() as f64 * (BAR + BAR_GAP) + self.groups.len() as f64 * GROUP_GAP
    }
}

/// Sorts records into panels (by metric and unit) and cases, in the order they came.
fn panels(records: &[Record]) -> Vec<Panel> {
    // One colour per peer across the suite.
    let mut peers: Vec<&str> = Vec::new();
    let mut panels: Vec<Panel> = Vec::new();
    for r in records {
        if !peers.contains(&r.peer.as_str()) {
            peers.push(&r.peer);
        }
        let color = other(peers.iter().position(|p| *p == r.peer).unwrap_or(0));
        let title = format!(
            "{} ({}), {} is better",
            r.metric,
            r.unit,
            better(records, r)
        );
        let panel = match panels.iter().position(|p| p.title == title) {
            Some(i) => &mut panels[i],
            None => {
                panels.push(Panel {
                    title,
                    unit: r.unit.clone(),
                    groups: Vec::new(),
                });
                panels.last_mut().expect("just pushed")
            }
        };
        // A case measured more than once against one peer (a sweep of settings) is told apart
        // by its route.
        let repeated = records
            .iter()
            .filter(|o| o.case == r.case && o.metric == r.metric && o.peer == r.peer)
            .count()
            > 1;
        let label = if repeated && !r.route.is_empty() {
            format!("{}: {}", r.case, r.route)
        } else {
            r.case.clone()
        };
        let peer = Bar {
            who: r.peer.clone(),
            value: r.peer_value,
            color,
        };
        match panel.groups.iter_mut().find(|g| g.label == label) {
            Some(g) => g.bars.push(peer),
            None => panel.groups.push(Group {
                label,
                bars: vec![
                    Bar {
                        who: "gpuio".into(),
                        value: r.value,
                        color: GPUIO,
                    },
                    peer,
                ],
            }),
        }
    }
    panels
}

/// Which way is better for `r`'s metric: a record's ratio is oriented so that above 1 favours
/// gpuio, so a ratio other than gpuio / peer means lower figures win (latencies, misses).
fn better(records: &[Record], r: &Record) -> &'static str {
    let lower = records
        .iter()
        .filter(|o| o.metric == r.metric && o.unit == r.unit)
        .find(|o| o.peer_value > 0.0 && o.value != o.peer_value)
        .is_some_and(|o| {
            let higher = o.value / o.peer_value;
            (o.ratio - higher).abs() > 1e-6 * higher.max(1.0)
        });
    if lower { "lower" } else { "higher" }
}

/// Draws the panels one under another.
pub(super) fn plot(path: &Path, suite: &str, records: &[Record]) -> PlotResult {
    let panels = panels(records);
    let label_w = panels
        .iter()
        .flat_map(|p| &p.groups)
        .map(|g| text_width(&g.label, FONT))
        .fold(80.0f64, f64::max)
        .min(460.0);
    // Each panel: a caption, its bars, an axis.
    let chrome = 30.0 + 34.0;
    let height = 40.0 + panels.iter().map(|p| p.height() + chrome).sum::<f64>();
    let root = SVGBackend::new(path, (WIDTH, height.ceil() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut rest = root.titled(
        &format!(
            "gpuio {suite} on {}: gpuio against its peers",
            device(records)
        ),
        ("sans-serif", 20),
    )?;
    for panel in &panels {
        let (area, below) = rest.split_vertically((panel.height() + chrome) as u32);
        rest = below;
        draw_panel(&root, &area, panel, label_w)?;
    }
    root.present()?;
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    area: &DrawingArea<DB, plotters::coord::Shift>,
    panel: &Panel,
    label_w: f64,
) -> PlotResult
where
    DB::ErrorType: 'static,
{
    let values: Vec<f64> = panel
        .groups
        .iter()
        .flat_map(|g| g.bars.iter().map(|b| b.value))
        .collect();
    let positive = values.iter().copied().filter(|v| *v > 0.0);
    let max = values.iter().copied().fold(0.0f64, f64::max);
    let min = positive.fold(f64::MAX, f64::min);
    // Log x where peers differ by orders of magnitude (random IOPS: millions against tens of
    // thousands); linear where a zero means something (no deadline missed).
    let log = values.iter().all(|v| *v > 0.0) && max / min > 30.0;
    let x = |v: f64| if log { v.log10() } else { v };
    let lo = if log { min.log10().floor() - 0.2 } else { 0.0 };
    // Room right of the longest bar for its label.
    let plot_w = WIDTH as f64 - label_w - 50.0;
    let label = |b: &Bar| format!("{} {}", b.who, figure(b.value));
    let hi = panel
        .groups
        .iter()
        .flat_map(|g| &g.bars)
        .map(|b| {
            let room = plot_w / (plot_w - text_width(&label(b), FONT) - 10.0).max(0.2 * plot_w);
            lo + (x(b.value) - lo) * room
        })
        // All zeros still get an axis.
        .fold(if log { lo + 1.0 } else { 1e-3 }, f64::max);
    let slots = panel.height();
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 15))
        .margin_right(20)
        .margin_left(8)
        .x_label_area_size(30)
        .y_label_area_size(label_w as u32 + 10)
        .build_cartesian_2d(lo..hi, 0.0..slots)?;
    let unit = panel.unit.clone();
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_labels(8)
        .x_label_formatter(&|v| {
            if !log {
                tick(*v, hi - lo)
            } else if (v - v.round()).abs() < 1e-6 {
                power_of_ten(v.round() as i32)
            } else {
                String::new()
            }
        })
        .label_style(("sans-serif", FONT))
        .axis_desc_style(("sans-serif", FONT))
        .x_desc(unit)
        .draw()?;
    let text = |anchor| {
        TextStyle::from(("sans-serif", FONT).into_font()).pos(Pos::new(anchor, VPos::Center))
    };
    // y counts pixels down from the top of the bars.
    let mut y = 0.0;
    for group in &panel.groups {
        let top = y;
        for bar in &group.bars {
            let (y0, y1) = (slots - y, slots - y - BAR);
            let end = x(bar.value).max(lo);
            chart.draw_series(std::iter::once(Rectangle::new(
                [(lo, y0), (end, y1)],
                bar.color.filled(),
            )))?;
            chart.draw_series(std::iter::once(
                EmptyElement::at((end, slots - y - BAR / 2.0))
                    + Text::new(label(bar), (4, 0), text(HPos::Left)),
            ))?;
            y += BAR + BAR_GAP;
        }
        // The case's name left of the axis, level with its bars' middle.
        let (px, py) = chart.backend_coord(&(lo, slots - (top + y - BAR_GAP) / 2.0));
        root.draw(&Text::new(
            group.label.clone(),
            (px - 8, py),
            text(HPos::Right),
        ))?;
        y += GROUP_GAP;
    }
    Ok(())
}
