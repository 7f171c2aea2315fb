//! The run's timeline: samples trained per second and an event log (failures, detection,
//! recovery, checkpoints), written as CSV and JSON and plotted like ECRec's Fig. 6.

use std::path::Path;
use std::time::Instant;

use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::PsError;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Seconds since the timeline started.
    pub t: f64,
    pub kind: String,
    pub detail: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TimelineData {
    /// Samples whose step finished in second `i`.
    pub samples_per_second: Vec<u64>,
    pub events: Vec<Event>,
}

pub struct Timeline {
    start: Instant,
    pub data: TimelineData,
}

impl Timeline {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            data: TimelineData::default(),
        }
    }

    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub fn samples(&mut self, n: u64) {
        let second = self.now() as usize;
        let v = &mut self.data.samples_per_second;
        if v.len() <= second {
            v.resize(second + 1, 0);
        }
        v[second] += n;
    }

    pub fn event(&mut self, kind: &str, detail: impl Into<String>) -> f64 {
        let t = self.now();
        let detail = detail.into();
        tracing::info!("[{t:7.2}s] {kind}: {detail}");
        self.data.events.push(Event {
            t,
            kind: kind.to_string(),
            detail,
        });
        t
    }
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> PsError + '_ {
    move |error| PsError::Io {
        path: path.display().to_string(),
        error,
    }
}

impl TimelineData {
    /// Writes `throughput.csv`, `events.csv` and `timeline.json` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), PsError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut csv = String::from("second,samples_per_sec\n");
        for (i, n) in self.samples_per_second.iter().enumerate() {
            csv.push_str(&format!("{i},{n}\n"));
        }
        let p = dir.join("throughput.csv");
        ftrec_fsio::write_atomic(&p, csv.as_bytes())?;
        let mut csv = String::from("t,kind,detail\n");
        for e in &self.events {
            csv.push_str(&format!(
                "{:.3},{},\"{}\"\n",
                e.t,
                e.kind,
                e.detail.replace('"', "'")
            ));
        }
        let p = dir.join("events.csv");
        ftrec_fsio::write_atomic(&p, csv.as_bytes())?;
        let p = dir.join("timeline.json");
        let json = serde_json::to_vec_pretty(self).map_err(|e| PsError::Config(e.to_string()))?;
        Ok(ftrec_fsio::write_atomic(&p, &json)?)
    }

    pub fn read(path: &Path) -> Result<Self, PsError> {
        let bytes = std::fs::read(path).map_err(io(path))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| PsError::Config(format!("{}: not a timeline: {e}", path.display())))
    }

    /// Throughput against time with failure, detection and recovery marked.
    pub fn plot(&self, out: &Path, title: &str) -> Result<(), PsError> {
        let err = |e: String| PsError::Config(format!("{}: {e}", out.display()));
        let root = BitMapBackend::new(out, (1000, 500)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let seconds = self.samples_per_second.len().max(1) as f64;
        let top = self
            .samples_per_second
            .iter()
            .copied()
            .max()
            .unwrap_or(1)
            .max(1) as f64
            * 1.15;
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
                self.samples_per_second
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| (i as f64 + 0.5, n as f64)),
                BLUE.stroke_width(2),
            ))
            .map_err(|e| err(e.to_string()))?
            .label("throughput")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        for (kind, color) in [
            ("killed", RED),
            ("failure-detected", MAGENTA),
            ("rebuild-start", RGBColor(230, 140, 0)),
            ("rebuild-end", RGBColor(120, 60, 0)),
            // CPR: where a shard reloaded its checkpoint (the event states the PLS).
            ("partial-restore", RGBColor(0, 150, 150)),
            ("recovery-end", GREEN),
            ("checkpoint-end", RGBColor(150, 150, 150)),
        ] {
            let xs: Vec<f64> = self
                .events
                .iter()
                .filter(|e| e.kind == kind)
                .map(|e| e.t)
                .collect();
            if xs.is_empty() {
                continue;
            }
            chart
                .draw_series(
                    xs.into_iter()
                        .map(|x| PathElement::new(vec![(x, 0.0), (x, top)], color.stroke_width(1))),
                )
                .map_err(|e| err(e.to_string()))?
                .label(kind)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        root.present().map_err(|e| err(e.to_string()))
    }
}
