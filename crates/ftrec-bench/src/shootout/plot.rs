//! The shoot-out drawn: one bar group per metric and rate (every strategy a bar), and
//! each rate's throughput over time for every strategy, with the schedule's failures
//! marked.

use std::path::Path;

use ftrec_cluster::failure_schedule::FailureSchedule;
use ftrec_proto::timeline::{EventKind, TimelineData};
use plotters::prelude::*;
use serde_json::Value;

use super::strategies_of;
use crate::error::{BenchError, Result};

fn err(out: &Path) -> impl Fn(String) -> BenchError + '_ {
    move |e| BenchError::Plot {
        what: out.display().to_string(),
        source: e.into(),
    }
}

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
    let err = err(out);
    let root = BitMapBackend::new(out, (1800, 820)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let (legend, body) = root.split_vertically(40);
    let chosen = strategies_of(summary);
    // Every strategy a colour of its own, up to ten; past that, colours come round again.
    let legend_step = (1800 / chosen.len().max(1) as i32).min(195);
    for (i, name) in chosen.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let x = 20 + i as i32 * legend_step;
        legend
            .draw(&Rectangle::new([(x, 12), (x + 18, 30)], color.filled()))
            .map_err(|e| err(e.to_string()))?;
        legend
            .draw(&Text::new(name.as_str(), (x + 24, 14), ("sans-serif", 18)))
            .map_err(|e| err(e.to_string()))?;
    }
    let rows = body.split_evenly((2, BARS.len()));
    for (r, rate) in ["rare", "frequent"].iter().enumerate() {
        let strategies = &summary["by_rate"][rate]["strategies"];
        for (m, (key, label, scale)) in BARS.iter().enumerate() {
            let values: Vec<f64> = chosen
                .iter()
                .map(|s| strategies[s.as_str()][key].as_f64().unwrap_or(0.0) * scale)
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
                .build_cartesian_2d(0f64..chosen.len() as f64, bottom..top)
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
                        COLORS[i % COLORS.len()].filled(),
                    )
                }))
                .map_err(|e| err(e.to_string()))?;
        }
    }
    root.present().map_err(|e| err(e.to_string()))
}

/// A run's samples per second, each second at its middle, on a clock that starts with
/// training (no event: the timeline's own start); the seconds before it dropped.
fn throughput_points(t: &TimelineData) -> Vec<(f64, f64)> {
    let start = t.of(EventKind::TrainingStart).next().map_or(0.0, |e| e.t);
    t.samples_per_second
        .iter()
        .enumerate()
        .map(|(i, &n)| (i as f64 + 0.5 - start, n as f64))
        .filter(|(x, _)| *x >= 0.0)
        .collect()
}

/// Round 1's throughput of every strategy at `rate`, aligned on training start, with the
/// schedule's failures marked (red: SIGKILL, purple: freeze).
pub fn plot_throughput(
    runs: &Path,
    chosen: &[String],
    rate: &str,
    schedule: &FailureSchedule,
    out: &Path,
) -> Result<()> {
    let err = err(out);
    let mut lines = Vec::new();
    for strategy in chosen {
        let dir = runs.join(format!("{rate}-{}-r1", strategy.replace('+', "-")));
        let Ok(t) = TimelineData::read(&dir.join("timeline.json")) else {
            continue;
        };
        lines.push((strategy, throughput_points(&t)));
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
        let color = COLORS[chosen.iter().position(|s| s == name).unwrap_or(i) % COLORS.len()];
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

#[cfg(test)]
mod tests {
    use super::*;
    use ftrec_proto::timeline::Event;

    fn event(t: f64, kind: EventKind) -> Event {
        Event {
            t,
            kind,
            subject: None,
            step: None,
            detail: String::new(),
        }
    }

    #[test]
    fn throughput_is_aligned_on_training_start() {
        let t = TimelineData {
            samples_per_second: vec![0, 5, 100, 120],
            events: vec![
                event(0.2, EventKind::Killed),
                event(1.5, EventKind::TrainingStart),
                event(3.0, EventKind::TrainingStart),
            ],
        };
        // Second 0 (middle 0.5) is before the start at 1.5 s; the first start counts.
        assert_eq!(
            throughput_points(&t),
            vec![(0.0, 5.0), (1.0, 100.0), (2.0, 120.0)]
        );
    }

    #[test]
    fn a_timeline_without_a_start_event_or_samples() {
        let mut t = TimelineData {
            samples_per_second: vec![7, 8],
            events: Vec::new(),
        };
        assert_eq!(throughput_points(&t), vec![(0.5, 7.0), (1.5, 8.0)]);
        t.samples_per_second.clear();
        assert!(throughput_points(&t).is_empty());
        // Training started after the last second counted: nothing to draw.
        let late = TimelineData {
            samples_per_second: vec![1, 2],
            events: vec![event(9.0, EventKind::TrainingStart)],
        };
        assert!(throughput_points(&late).is_empty());
    }
}
