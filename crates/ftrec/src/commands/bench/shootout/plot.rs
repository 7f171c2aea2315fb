//! The shoot-out drawn: one bar group per metric and rate (every strategy a bar), and
//! each rate's throughput over time for every strategy, with the schedule's failures
//! marked; and the table printed for a person.

use std::path::Path;

use anyhow::{Result, anyhow};
use ftrec_cluster::failure_schedule::FailureSchedule;
use ftrec_proto::timeline::{EventKind, TimelineData};
use plotters::prelude::*;
use serde_json::Value;

use super::STRATEGIES;

/// Metrics drawn, with their axis label and the factor from the JSON's unit.
const BARS: [(&str, &str, f64); 6] = [
    ("ett", "ETT", 1.0),
    ("auc", "AUC", 1.0),
    ("lost_samples", "lost or retrained samples (k)", 1e-3),
    ("bytes_written", "checkpoint MB written", 1e-6),
    ("peak_rss_bytes", "peak RSS per server (MB)", 1e-6),
    ("resume_seconds", "failure to resume (s)", 1.0),
];

const COLORS: [RGBColor; 9] = [
    RGBColor(120, 120, 120),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(23, 190, 207),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(0, 0, 0),
];

/// One row of panels per rate, one panel per metric, one bar per strategy.
pub fn plot_bars(summary: &Value, out: &Path) -> Result<()> {
    let err = |e: String| anyhow!("{}: {e}", out.display());
    let root = BitMapBackend::new(out, (1800, 820)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let (legend, body) = root.split_vertically(40);
    for (i, (name, color)) in STRATEGIES.iter().zip(COLORS).enumerate() {
        let x = 20 + i as i32 * 195;
        legend
            .draw(&Rectangle::new([(x, 12), (x + 18, 30)], color.filled()))
            .map_err(|e| err(e.to_string()))?;
        legend
            .draw(&Text::new(*name, (x + 24, 14), ("sans-serif", 18)))
            .map_err(|e| err(e.to_string()))?;
    }
    let rows = body.split_evenly((2, BARS.len()));
    for (r, rate) in ["rare", "frequent"].iter().enumerate() {
        let strategies = &summary["by_rate"][rate]["strategies"];
        for (m, (key, label, scale)) in BARS.iter().enumerate() {
            let values: Vec<f64> = STRATEGIES
                .iter()
                .map(|s| strategies[s][key].as_f64().unwrap_or(0.0) * scale)
                .collect();
            let highest = values.iter().copied().fold(0.0, f64::max).max(1e-9);
            // AUC differences are in the third decimal: the axis spans the values, not 0..1.
            let (bottom, top) = if *key == "auc" {
                let lowest = values
                    .iter()
                    .copied()
                    .filter(|v| *v > 0.0)
                    .fold(highest, f64::min);
                (lowest - 0.003, highest + 0.003)
            } else {
                (0.0, highest * 1.15)
            };
            let area = &rows[r * BARS.len() + m];
            let mut chart = ChartBuilder::on(area)
                .caption(format!("{label}, {rate}"), ("sans-serif", 16))
                .margin(8)
                .y_label_area_size(55)
                .x_label_area_size(10)
                .build_cartesian_2d(0f64..STRATEGIES.len() as f64, bottom..top)
                .map_err(|e| err(e.to_string()))?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .disable_x_axis()
                .draw()
                .map_err(|e| err(e.to_string()))?;
            chart
                .draw_series(values.iter().enumerate().map(|(i, &v)| {
                    Rectangle::new(
                        [(i as f64 + 0.1, bottom), (i as f64 + 0.9, v.max(bottom))],
                        COLORS[i].filled(),
                    )
                }))
                .map_err(|e| err(e.to_string()))?;
        }
    }
    root.present().map_err(|e| err(e.to_string()))
}

/// Round 1's throughput of every strategy at `rate`, aligned on training start, with the
/// schedule's failures marked (red: SIGKILL, purple: freeze).
pub fn plot_throughput(
    runs: &Path,
    rate: &str,
    schedule: &FailureSchedule,
    out: &Path,
) -> Result<()> {
    let err = |e: String| anyhow!("{}: {e}", out.display());
    let mut lines = Vec::new();
    for strategy in STRATEGIES {
        let dir = runs.join(format!("{rate}-{}-r1", strategy.replace('+', "-")));
        let Ok(t) = TimelineData::read(&dir.join("timeline.json")) else {
            continue;
        };
        let start = t.of(EventKind::TrainingStart).next().map_or(0.0, |e| e.t);
        let points: Vec<(f64, f64)> = t
            .samples_per_second
            .iter()
            .enumerate()
            .map(|(i, &n)| (i as f64 + 0.5 - start, n as f64))
            .filter(|(x, _)| *x >= 0.0)
            .collect();
        lines.push((strategy, points));
    }
    let right = lines
        .iter()
        .flat_map(|(_, p)| p.last().map(|l| l.0))
        .fold(1.0, f64::max);
    let top = lines
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(1.0, f64::max)
        * 1.15;
    let root = BitMapBackend::new(out, (1200, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "throughput under the {rate} schedule (MTBF {:.1} s)",
                schedule.mtbf_seconds
            ),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..right, 0f64..top)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("seconds since training started")
        .y_desc("samples / s")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (name, points)) in lines.into_iter().enumerate() {
        let color = COLORS[STRATEGIES.iter().position(|s| *s == name).unwrap_or(i) % COLORS.len()];
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    for f in &schedule.failures {
        let color = if f.freeze { RGBColor(150, 0, 150) } else { RED };
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(f.at_seconds, 0.0), (f.at_seconds, top)],
                color.stroke_width(2),
            )))
            .map_err(|e| err(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))
}

/// The table BENCHMARKS.md quotes, one block per rate.
pub fn print_table(summary: &Value) -> Result<()> {
    let num = |v: &Value, digits: usize| {
        v.as_f64()
            .map_or("-".to_string(), |x| format!("{x:.digits$}"))
    };
    for rate in ["rare", "frequent"] {
        let r = &summary["by_rate"][rate];
        outln!(
            "{rate}: MTBF {} s, {} failures; failure-free AUC {}; auto chose {}",
            num(&r["mtbf_seconds"], 1),
            r["schedule"]["failures"].as_array().map_or(0, Vec::len),
            num(&r["failure_free_auc"], 4),
            r["auto_choice"]["strategy"].as_str().unwrap_or("-")
        );
        outln!(
            "| strategy | ETT | AUC | logloss | lost samples | MB written | peak RSS MB | resume s | full redundancy s |"
        );
        outln!("|---|---|---|---|---|---|---|---|---|");
        for s in STRATEGIES {
            let v = &r["strategies"][s];
            let mb = |k: &str| {
                v[k].as_f64()
                    .map_or("-".into(), |x| format!("{:.0}", x / 1e6))
            };
            outln!(
                "| {s} | {} | {} | {} | {} | {} | {} | {} | {} |",
                num(&v["ett"], 3),
                num(&v["auc"], 4),
                num(&v["logloss"], 4),
                num(&v["lost_samples"], 0),
                mb("bytes_written"),
                mb("peak_rss_bytes"),
                num(&v["resume_seconds"], 2),
                num(&v["full_redundancy_seconds"], 2)
            );
        }
    }
    Ok(())
}
