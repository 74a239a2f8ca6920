//! The gather grid: a panel per pool size (columns) and index list (rows: uniform with
//! repeats, then distinct rows), bars per row size for gpuio (host list, device list) and each
//! peer, all on one GB/s scale. Every side of a cell gathers the same list, so each bar's
//! share of repeated rows is the list's: that part is drawn pale over the solid unique part.

use super::{GPUIO, PlotResult, device, figure, other, tick};
use crate::gather::GridCase;
use crate::{Record, RowBytes};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::BTreeMap;
use std::path::Path;

const PANEL_W: u32 = 400;
const PANEL_H: u32 = 300;
const HEADER: u32 = 84;

/// The bars of one row size in one panel, in series order.
#[derive(Default)]
struct Cell {
    values: Vec<Option<f64>>,
    rows: Option<RowBytes>,
}

/// What to draw: `(pool MiB, distinct) → row size → cell`, and the series' names.
struct Grid {
    panels: BTreeMap<(bool, usize), BTreeMap<usize, Cell>>,
    series: Vec<String>,
}

fn collect(records: &[Record]) -> Grid {
    let mut series = vec!["gpuio, host list".to_string(), "gpuio, device list".into()];
    for r in records {
        if GridCase::parse(&r.case).is_some() && !series.contains(&r.peer) {
            series.push(r.peer.clone());
        }
    }
    let mut panels: BTreeMap<(bool, usize), BTreeMap<usize, Cell>> = BTreeMap::new();
    for r in records {
        let Some(case) = GridCase::parse(&r.case) else {
            continue;
        };
        let cell = panels
            .entry((case.distinct, case.pool_mib))
            .or_default()
            .entry(case.row)
            .or_default();
        cell.values.resize(series.len(), None);
        cell.values[usize::from(case.device_list)] = Some(r.value);
        if let Some(i) = series.iter().position(|s| *s == r.peer) {
            cell.values[i] = Some(r.peer_value);
        }
        cell.rows = cell.rows.or(r.rows);
    }
    Grid { panels, series }
}

/// Draws the grid.
pub(super) fn plot(path: &Path, records: &[Record]) -> PlotResult {
    let grid = collect(records);
    let pools: Vec<usize> = {
        let mut p: Vec<usize> = grid.panels.keys().map(|k| k.1).collect();
        p.sort_unstable();
        p.dedup();
        p
    };
    let lists: Vec<bool> = {
        let mut l: Vec<bool> = grid.panels.keys().map(|k| k.0).collect();
        l.dedup();
        l
    };
    let width = (PANEL_W * pools.len() as u32).max(900);
    // A line of text under the panels for each of the suite's other records.
    let others = records
        .iter()
        .filter(|r| GridCase::parse(&r.case).is_none())
        .count() as u32;
    let height = HEADER + PANEL_H * lists.len() as u32 + 10 + 18 * others;
    let root = SVGBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (header, rest) = root.split_vertically(HEADER);
    let (body, footer) = rest.split_vertically(PANEL_H * lists.len() as u32);
    draw_header(&header, &grid.series, device(records))?;
    let max = grid
        .panels
        .values()
        .flat_map(|cells| cells.values())
        .flat_map(|c| c.values.iter().flatten())
        .fold(0.0f64, |m, v| m.max(*v));
    let areas = body.split_evenly((lists.len(), pools.len()));
    for (i, &distinct) in lists.iter().enumerate() {
        for (j, &pool) in pools.iter().enumerate() {
            if let Some(cells) = grid.panels.get(&(distinct, pool)) {
                let title = format!(
                    "{} pool, {}",
                    crate::human(pool << 20),
                    if distinct {
                        "distinct rows"
                    } else {
                        "uniform draw (rows repeat)"
                    }
                );
                let area = &areas[i * pools.len() + j];
                draw_panel(&root, area, &title, cells, grid.series.len(), max * 1.08)?;
            }
        }
    }
    // The suite's other records (the decode layer's latency) as a line of text.
    for (i, r) in records
        .iter()
        .filter(|r| GridCase::parse(&r.case).is_none())
        .enumerate()
    {
        let peer = if r.peer_value > 0.0 {
            format!("against {} {} {}", r.peer, figure(r.peer_value), r.unit)
        } else {
            format!("({})", r.peer)
        };
        footer.draw(&Text::new(
            format!(
                "{}: {} {} {} {peer}",
                r.case,
                r.metric,
                figure(r.value),
                r.unit
            ),
            (16, 6 + 18 * i as i32),
            ("sans-serif", 13),
        ))?;
    }
    root.present()?;
    Ok(())
}

fn color(series: usize) -> RGBColor {
    // The device-list bars in a darker blue than the host list's, peers after.
    match series {
        0 => GPUIO,
        1 => RGBColor(10, 60, 110),
        s => other(s - 2),
    }
}

fn draw_header<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    series: &[String],
    device: &str,
) -> PlotResult
where
    DB::ErrorType: 'static,
{
    area.draw(&Text::new(
        format!("gpuio gather on {device}: GB/s of rows delivered, by row size"),
        (16, 8),
        ("sans-serif", 20),
    ))?;
    area.draw(&Text::new(
        "solid: distinct rows' bytes; pale: rows delivered again (a repeat may come from a cache)",
        (16, 36),
        ("sans-serif", 13),
    ))?;
    let mut x = 16;
    for (i, name) in series.iter().enumerate() {
        let c = color(i);
        area.draw(&Rectangle::new([(x, 60), (x + 14, 74)], c.filled()))?;
        area.draw(&Text::new(name.clone(), (x + 20, 61), ("sans-serif", 13)))?;
        x += 40 + (7.5 * name.len() as f64) as i32;
    }
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    area: &DrawingArea<DB, Shift>,
    title: &str,
    cells: &BTreeMap<usize, Cell>,
    series: usize,
    max: f64,
) -> PlotResult
where
    DB::ErrorType: 'static,
{
    let groups = cells.len() as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 15))
        .margin(8)
        .x_label_area_size(24)
        .y_label_area_size(48)
        .build_cartesian_2d(0.0..groups, 0.0..max.max(1e-3))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("GB/s")
        .y_label_formatter(&|v| tick(*v, max))
        .label_style(("sans-serif", 12))
        .axis_desc_style(("sans-serif", 12))
        .draw()?;
    // Bars fill 80% of each row size's slot.
    let width = 0.8 / series as f64;
    for (g, (row, cell)) in cells.iter().enumerate() {
        let unique = cell.rows.map_or(1.0, |b| {
            b.unique_bytes as f64 / b.delivered_bytes.max(1) as f64
        });
        for (s, value) in cell.values.iter().enumerate() {
            let Some(v) = *value else { continue };
            let x0 = g as f64 + 0.1 + s as f64 * width;
            let x1 = x0 + width * 0.92;
            let c = color(s);
            chart.draw_series([
                Rectangle::new([(x0, 0.0), (x1, v)], c.mix(0.3).filled()),
                Rectangle::new([(x0, 0.0), (x1, v * unique)], c.filled()),
            ])?;
        }
        let (px, py) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        root.draw(&Text::new(
            crate::human(*row),
            (px, py + 6),
            TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Center, VPos::Top)),
        ))?;
    }
    Ok(())
}
