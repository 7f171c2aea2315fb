//! `bench ckpt`'s plots: per checkpoint, each strategy's restore time, blocking time and
//! storage; DECK's training time lost over the steps.

use std::path::Path;

use plotters::prelude::*;

use super::{CheckpointRow, CkptBenchReport};
use crate::error::{Drawing, Result};

type Series = Vec<(String, Vec<(f64, f64)>)>;

fn by_strategy(report: &CkptBenchReport, value: impl Fn(&CheckpointRow) -> Option<f64>) -> Series {
    report
        .summaries
        .iter()
        .map(|s| {
            let points = report
                .rows
                .iter()
                .filter(|r| r.strategy == s.strategy)
                .filter_map(|r| value(r).map(|v| (r.index as f64 + 1.0, v)))
                .collect();
            (s.strategy.clone(), points)
        })
        .collect()
}

/// `restore.png`, `construction.png`, `storage.png` and, with DECK's runs, `deck.png`.
pub(super) fn plot(report: &CkptBenchReport, out: &Path) -> Result<()> {
    line_chart(
        &out.join("restore.png"),
        "Restore time beyond the baseline (cold cache)",
        "checkpoint",
        "seconds",
        &by_strategy(report, |r| r.restore_seconds),
    )?;
    line_chart(
        &out.join("construction.png"),
        "Blocking construction time",
        "checkpoint",
        "seconds",
        &by_strategy(report, |r| Some(r.blocking_seconds)),
    )?;
    line_chart(
        &out.join("storage.png"),
        "Cumulative storage",
        "checkpoint",
        "GB",
        &by_strategy(report, |r| Some(r.storage_bytes as f64 / 1e9)),
    )?;
    if !report.deck.is_empty() {
        let series: Series = report
            .deck
            .iter()
            .map(|r| {
                (
                    format!("{} ({} checkpoints)", r.name, r.checkpoints),
                    r.blocking_timeline
                        .iter()
                        .map(|&(s, b)| (s as f64, b))
                        .collect(),
                )
            })
            .collect();
        line_chart(
            &out.join("deck.png"),
            "Training time lost to checkpoints",
            "step",
            "cumulative blocking seconds",
            &series,
        )?;
    }
    Ok(())
}

fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &Series,
) -> Result<()> {
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).drawing(path)?;
    let points = series.iter().flat_map(|(_, p)| p.iter());
    let x_max = points.clone().map(|p| p.0).fold(1.0, f64::max);
    let y_max = points.map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .drawing(path)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .drawing(path)?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .drawing(path)?
            .label(name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .drawing(path)?;
    root.present().writing(path)?;
    Ok(())
}
