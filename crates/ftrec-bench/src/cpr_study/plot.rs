//! `bench cpr`'s plots: AUC against PLS, the overheads by failure fraction, the
//! sensitivity studies and §6.5's many-failure runs.

use std::path::Path;

use plotters::prelude::*;

use super::many_failures::ManyFailures;
use super::sensitivity::{PlsPoint, Sensitivity};
use super::{Strategy, StudyReport};
use crate::error::{Drawing, Result};

fn strategy_color(name: &str) -> RGBAColor {
    let i = Strategy::ALL
        .iter()
        .position(|s| s.name() == name)
        .unwrap_or(Strategy::ALL.len());
    Palette99::pick(i).to_rgba()
}

/// The label of bar group `i` at the group's centre (`i + 0.5`), none elsewhere: the axis
/// asks for ticks at every half unit.
fn group_label(labels: &[String], x: f64) -> String {
    let i = x.floor() as usize;
    if (x - i as f64 - 0.5).abs() < 1e-6 {
        labels.get(i).cloned().unwrap_or_default()
    } else {
        String::new()
    }
}

pub(crate) fn plot_auc_pls(report: &StudyReport, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).drawing(path)?;
    let runs = &report.runs;
    let sweep = &report.pls_sweep;
    let x_max = runs
        .iter()
        .map(|r| r.pls)
        .chain(sweep.iter().map(|r| r.pls))
        .fold(0.0, f64::max)
        .max(1e-6)
        * 1.1;
    let (lo, hi) = runs
        .iter()
        .map(|r| r.auc)
        .chain(sweep.iter().map(|r| r.auc))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), a| {
            (l.min(a), h.max(a))
        });
    let pad = ((hi - lo) * 0.15).max(1e-4);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "Final AUC against PLS (r = {:.3}, {} failures)",
                report.auc_pls_correlation, report.failures
            ),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, (lo - pad)..(hi + pad))
        .drawing(path)?;
    chart
        .configure_mesh()
        .x_desc("final PLS")
        .y_desc("test AUC")
        .draw()
        .drawing(path)?;
    let fit = &report.auc_pls_fit;
    chart
        .draw_series(LineSeries::new(
            [0.0, x_max].map(|x| (x, fit.slope * x + fit.intercept)),
            BLACK.stroke_width(1),
        ))
        .drawing(path)?
        .label(format!(
            "fit: AUC = {:.4} {:+.4}·PLS",
            fit.intercept, fit.slope
        ))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
    for s in Strategy::ALL {
        let color = strategy_color(s.name());
        let pts: Vec<(f64, f64)> = runs
            .iter()
            .filter(|r| r.strategy == s.name())
            .map(|r| (r.pls, r.auc))
            .collect();
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 5, color.filled())))
            .drawing(path)?
            .label(s.name())
            .legend(move |(x, y)| Circle::new((x + 9, y), 5, color.filled()));
    }
    if !sweep.is_empty() {
        let color = strategy_color(Strategy::CprVanilla.name());
        chart
            .draw_series(
                sweep
                    .iter()
                    .map(|r| Circle::new((r.pls, r.auc), 5, color.stroke_width(2))),
            )
            .drawing(path)?
            .label("cpr_vanilla, PLS sweep")
            .legend(move |(x, y)| Circle::new((x + 9, y), 5, color.stroke_width(2)));
    }
    draw_legend(&mut chart, SeriesLabelPosition::LowerLeft, path)?;
    root.present().writing(path)?;
    Ok(())
}

pub(crate) fn plot_overhead(report: &StudyReport, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).drawing(path)?;
    let fractions: Vec<&String> = report.by_fraction.keys().collect();
    let strategies: Vec<&str> = Strategy::ALL
        .iter()
        .map(|s| s.name())
        .filter(|n| report.runs.iter().any(|r| r.strategy == *n))
        .collect();
    let y_max = report
        .runs
        .iter()
        .map(|r| 100.0 * r.overhead_fraction_all_costs)
        .fold(0.0, f64::max)
        .max(1e-6)
        * 1.15;
    let groups = fractions.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Overhead, every cost included (% of the job), by failure fraction",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..groups, 0f64..y_max)
        .drawing(path)?;
    let labels: Vec<String> = fractions.iter().map(|f| format!("{f} lost")).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(fractions.len() * 2 + 1)
        .x_label_formatter(&|x| group_label(&labels, *x))
        .y_desc("overhead %")
        .draw()
        .drawing(path)?;
    let width = 0.8 / strategies.len().max(1) as f64;
    for (si, name) in strategies.iter().enumerate() {
        let color = strategy_color(name);
        let bars: Vec<Rectangle<(f64, f64)>> = fractions
            .iter()
            .enumerate()
            .filter_map(|(fi, f)| {
                let run = report.by_fraction.get(*f)?.get(*name)?;
                let x0 = fi as f64 + 0.1 + si as f64 * width;
                Some(Rectangle::new(
                    [
                        (x0, 0.0),
                        (x0 + width * 0.9, 100.0 * run.overhead_fraction_all_costs),
                    ],
                    color.filled(),
                ))
            })
            .collect();
        chart
            .draw_series(bars)
            .drawing(path)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperRight, path)?;
    root.present().writing(path)?;
    Ok(())
}

/// The sensitivity studies (`--sensitivity`), as the paper draws them: §6.3, the PLS
/// reached and the overhead paid at each target PLS; §6.4, CPR-SSU's overhead over full
/// recovery's at each failure count and fraction, each bar marked with Eq. 1-2's decision.
pub(crate) fn plot_sensitivity(s: &Sensitivity, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (1300, 520)).into_drawing_area();
    root.fill(&WHITE).drawing(path)?;
    let (left, right) = root.split_horizontally(620);
    let strategies: Vec<&str> = {
        let mut v: Vec<&str> = s.pls.iter().map(|p| p.strategy.as_str()).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let top = s
        .pls
        .iter()
        .map(|p| p.pls.max(p.target_pls).max(p.overhead_fraction_all_costs))
        .fold(0.0, f64::max)
        * 1.15;
    let right_x = s.pls.iter().map(|p| p.target_pls).fold(0.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&left)
        .caption(
            "§6.3: PLS reached (solid) and overhead (dashed) by target",
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..right_x.max(1e-3), 0f64..top.max(1e-3))
        .drawing(path)?;
    chart
        .configure_mesh()
        .x_desc("target PLS")
        .y_desc("fraction")
        .draw()
        .drawing(path)?;
    for name in &strategies {
        let color = strategy_color(name);
        let points: Vec<&PlsPoint> = s.pls.iter().filter(|p| p.strategy == *name).collect();
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.target_pls, p.pls)),
                color.stroke_width(2),
            ))
            .drawing(path)?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
        chart
            .draw_series(DashedLineSeries::new(
                points
                    .iter()
                    .map(|p| (p.target_pls, p.overhead_fraction_all_costs)),
                6,
                4,
                color.stroke_width(1),
            ))
            .drawing(path)?;
    }
    chart
        .draw_series(LineSeries::new(
            [(0.0, 0.0), (right_x, right_x)],
            BLACK.mix(0.3),
        ))
        .drawing(path)?;
    draw_legend(&mut chart, SeriesLabelPosition::UpperLeft, path)?;

    let bars = s.failures.len().max(1);
    let highest = s.failures.iter().map(|f| f.normalized).fold(1.0, f64::max) * 1.15;
    let labels: Vec<String> = s
        .failures
        .iter()
        .map(|f| format!("{}x{:.0}%", f.failures, 100.0 * f.fraction))
        .collect();
    let mut chart = ChartBuilder::on(&right)
        .caption(
            "§6.4: CPR-SSU overhead / full (green: its decision, Eq. 2 priced by probed saves, was right)",
            ("sans-serif", 18),
        )
        .margin(10)
        .x_label_area_size(36)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..bars as f64, 0f64..highest).drawing(path)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(bars * 2 + 1)
        .x_label_formatter(&|x| group_label(&labels, *x))
        .x_desc("failures x fraction lost")
        .y_desc("normalized overhead")
        .draw()
        .drawing(path)?;
    chart
        .draw_series(s.failures.iter().enumerate().map(|(i, f)| {
            let color = if f.decision_right_for_ssu { GREEN } else { RED };
            Rectangle::new(
                [(i as f64 + 0.15, 0.0), (i as f64 + 0.85, f.normalized)],
                color.mix(0.7).filled(),
            )
        }))
        .drawing(path)?;
    chart
        .draw_series(LineSeries::new(
            [(0.0, 1.0), (bars as f64, 1.0)],
            BLACK.stroke_width(1),
        ))
        .drawing(path)?;
    root.present().writing(path)?;
    Ok(())
}

/// §6.5's Figure 11: AUC loss against PLS over the many-failure runs, coloured by the
/// number of failures, with the fit on PLS.
pub(crate) fn plot_many_failures(m: &ManyFailures, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).drawing(path)?;
    let x_max = m.runs.iter().map(|r| r.pls).fold(1e-6, f64::max) * 1.1;
    let (lo, hi) = m
        .runs
        .iter()
        .map(|r| r.auc_loss)
        .fold((0.0f64, 0.0f64), |(l, h), a| (l.min(a), h.max(a)));
    let pad = ((hi - lo) * 0.15).max(1e-4);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "§6.5: AUC loss against PLS, {} runs of 1-32 failures (r = {:.3})",
                m.runs.len(),
                m.r
            ),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_max, (lo - pad)..(hi + pad))
        .drawing(path)?;
    chart
        .configure_mesh()
        .x_desc("final PLS")
        .y_desc("AUC - failure-free AUC")
        .draw()
        .drawing(path)?;
    chart
        .draw_series(LineSeries::new(
            [0.0, x_max].map(|x| (x, m.slope * x + m.intercept)),
            BLACK.stroke_width(1),
        ))
        .drawing(path)?;
    for (label, range, color) in [
        ("1-4 failures", 1..=4, BLUE),
        ("5-16 failures", 5..=16, GREEN),
        ("17-32 failures", 17..=32, RED),
    ] {
        let pts: Vec<(f64, f64)> = m
            .runs
            .iter()
            .filter(|r| range.contains(&r.failures))
            .map(|r| (r.pls, r.auc_loss))
            .collect();
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 5, color.filled())))
            .drawing(path)?
            .label(label)
            .legend(move |(x, y)| Circle::new((x + 9, y), 5, color.filled()));
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperRight, path)?;
    root.present().writing(path)?;
    Ok(())
}

/// The legend of a chart's labelled series, boxed on white, at `position`.
fn draw_legend<'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, CT>,
    position: SeriesLabelPosition,
    path: &Path,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .drawing(path)?;
    Ok(())
}
