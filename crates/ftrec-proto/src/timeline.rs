//! The run's timeline: samples trained per second and an event log (failures, detection,
//! recovery, checkpoints), written as CSV and JSON (the
//! `ftrec` binary plots it like ECRec's Fig. 6).

use std::path::Path;
use std::time::Instant;

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
}
