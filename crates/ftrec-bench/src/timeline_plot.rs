//! A cluster run's timeline drawn like ECRec's Fig. 6: throughput against time, with
//! failures, detection, rebuilds and recoveries marked (`cluster run` and every cluster
//! bench). Plotting lives here, the one library with plots, so that the libraries the
//! benches measure do not pull in a font and image stack.

use std::path::Path;

use ftrec_proto::timeline::{EventKind, TimelineData};
use plotters::prelude::*;

use crate::error::{BenchError, Result};

/// Throughput against time with failure, detection and recovery marked.
pub fn plot_timeline(timeline: &TimelineData, out: &Path, title: &str) -> Result<()> {
    let err = |e: String| BenchError::Plot {
        what: out.display().to_string(),
        source: e.into(),
    };
    let root = BitMapBackend::new(out, (1000, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let seconds = timeline.samples_per_second.len().max(1) as f64;
    let (top, clipped) = y_top(&timeline.samples_per_second);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..seconds, 0f64..top)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc("samples / s")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    chart
        .draw_series(LineSeries::new(
            timeline
                .samples_per_second
                .iter()
                .enumerate()
                .map(|(i, &n)| (i as f64 + 0.5, n as f64)),
            BLUE.stroke_width(2),
        ))
        .map_err(|e| err(e.to_string()))?
        .label(if clipped > 0 {
            // A backlog that settles at once after a stall lands in one second, tens of
            // times the usual rate; drawn to scale, it would flatten everything else.
            format!("throughput ({clipped} s above the top: backlogs settled at once)")
        } else {
            "throughput".to_string()
        })
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    for (kind, color) in [
        (EventKind::Killed, RED),
        (EventKind::Frozen, RGBColor(200, 0, 120)),
        (EventKind::FailureDetected, MAGENTA),
        (EventKind::RebuildStart, RGBColor(230, 140, 0)),
        (EventKind::RebuildEnd, RGBColor(120, 60, 0)),
        // CPR: where a shard reloaded its checkpoint (the event states the PLS).
        (EventKind::PartialRestore, RGBColor(0, 150, 150)),
        (EventKind::RecoveryEnd, GREEN),
        (EventKind::CheckpointEnd, RGBColor(150, 150, 150)),
    ] {
        let xs: Vec<f64> = timeline.of(kind).map(|e| e.t).collect();
        if xs.is_empty() {
            continue;
        }
        chart
            .draw_series(
                xs.into_iter()
                    .map(|x| PathElement::new(vec![(x, 0.0), (x, top)], color.stroke_width(1))),
            )
            .map_err(|e| err(e.to_string()))?
            .label(kind.name())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        // Below the curve: a run's throughput spends its time in the upper half, and only
        // a stall's dips reach down here.
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))
}

/// The plot's top, and how many seconds lie above it: 30% over the 99th percentile, so
/// that a second or two of settled backlog does not set the scale, or 15% over the peak
/// where the peak is not much above the rest.
fn y_top(samples_per_second: &[u64]) -> (f64, usize) {
    let mut sorted = samples_per_second.to_vec();
    sorted.sort_unstable();
    let peak = sorted.last().copied().unwrap_or(1).max(1) as f64;
    let p99 = sorted
        .get((sorted.len() * 99 / 100).min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or(1)
        .max(1) as f64;
    let top = (p99 * 1.3).min(peak * 1.15);
    let clipped = samples_per_second
        .iter()
        .filter(|&&n| n as f64 > top)
        .count();
    (top, clipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_settled_backlog_does_not_set_the_scale() {
        let mut run = vec![30_000u64; 600];
        run[300] = 900_000;
        let (top, clipped) = y_top(&run);
        assert!((top - 39_000.0).abs() < 1.0, "{top}");
        assert_eq!(clipped, 1);
        // No outlier: the peak sets the scale, and nothing is clipped.
        let steady: Vec<u64> = (0..600).map(|i| 29_000 + (i % 7) * 300).collect();
        let (top, clipped) = y_top(&steady);
        assert!((top - 30_800.0 * 1.15).abs() < 1.0, "{top}");
        assert_eq!(clipped, 0);
        assert_eq!(y_top(&[]), (1.15, 0));
    }
}
