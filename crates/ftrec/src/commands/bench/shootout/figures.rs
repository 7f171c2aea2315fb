//! One shoot-out run's figures, and their medians over the rounds.

use ftrec_cluster::launch::LaunchReport;
use ftrec_config::FaultTolerance;
use serde::Serialize;
use serde_json::{Value, json};

/// What one run of one strategy reports.
#[derive(Clone, Debug, Serialize)]
pub struct RunFigures {
    /// Effective training time ratio: the steps whose updates survive into the final
    /// model, costed at the failure-free run's step time, over this run's wall time.
    pub ett: f64,
    pub auc: Option<f64>,
    pub logloss: Option<f64>,
    /// Samples whose updates a lost shard no longer holds, plus samples trained again
    /// after a rollback.
    pub lost_samples: u64,
    /// Checkpoint bytes written to storage.
    pub bytes_written: u64,
    /// The largest server's peak resident set.
    pub peak_rss_bytes: Option<u64>,
    /// Median over the failures: from the failure to training resumed.
    pub resume_seconds: Option<f64>,
    /// Median over the failures: from the failure to the cluster surviving another (erasure
    /// coding: the rebuild done; checkpoints: the resume, from a cut that survives; none:
    /// never, null).
    pub full_redundancy_seconds: Option<f64>,
    pub train_seconds: f64,
    pub steps: u64,
    pub steps_lost: f64,
    pub steps_rolled_back: u64,
    pub failures_injected: usize,
    pub recoveries: usize,
    /// Partial recovery: the run's portion of lost samples (CPR Eq. 3), the key the CPR
    /// emulation (`bench cpr`) reports, from real processes and real checkpoint writes.
    pub pls: Option<f64>,
}

/// Figures of `r`, with `ref_step_seconds` the failure-free run's wall time per step.
pub fn figures(r: &LaunchReport, ft: FaultTolerance, ref_step_seconds: f64) -> RunFigures {
    let s = &r.summary;
    let samples_per_step = s.samples as f64 / s.steps.max(1) as f64;
    let steps_lost = (s.lost_samples as f64 / samples_per_step.max(1.0)).min(s.steps as f64);
    let kept = s.steps as f64 - steps_lost;
    let ett = if s.train_seconds > 0.0 {
        (kept * ref_step_seconds / s.train_seconds).max(0.0)
    } else {
        0.0
    };
    let resume: Vec<f64> = s
        .recoveries
        .iter()
        .filter_map(|rec| rec.kill_to_resume_seconds)
        .collect();
    let full: Vec<f64> = s
        .recoveries
        .iter()
        .filter_map(|rec| {
            let k = rec.kill_to_resume_seconds?;
            match ft {
                FaultTolerance::None => None,
                FaultTolerance::Ec | FaultTolerance::EcCheckpoint if rec.background_rebuild => {
                    Some(k + (rec.detected_at + rec.degraded_seconds - rec.resumed_at).max(0.0))
                }
                _ => Some(k),
            }
        })
        .collect();
    RunFigures {
        ett,
        auc: r.auc,
        logloss: r.logloss,
        lost_samples: s.lost_samples + (s.steps_rolled_back as f64 * samples_per_step) as u64,
        bytes_written: s.checkpoints.iter().map(|c| c.bytes).sum(),
        peak_rss_bytes: r.server_peak_rss_bytes.iter().flatten().copied().max(),
        resume_seconds: median(&resume),
        full_redundancy_seconds: median(&full),
        train_seconds: s.train_seconds,
        steps: s.steps,
        steps_lost,
        steps_rolled_back: s.steps_rolled_back,
        failures_injected: r.kill_to_resume_seconds.len(),
        recoveries: s.recoveries.len(),
        pls: s.pls,
    }
}

fn median(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| ftrec_ckpt::timing::median(v))
}

/// The headline keys, as `by_rate.{rate}.strategies.{name}.{key}`: each the median over
/// the rounds.
pub const KEYS: [&str; 8] = [
    "ett",
    "auc",
    "logloss",
    "lost_samples",
    "bytes_written",
    "peak_rss_bytes",
    "resume_seconds",
    "full_redundancy_seconds",
];

/// A strategy's figures over the rounds: each headline key's median, and under
/// `spread.{key}` its minimum, maximum and every round's value.
pub fn over_rounds(runs: &[RunFigures]) -> Value {
    let values: Vec<Value> = runs
        .iter()
        .map(|r| serde_json::to_value(r).unwrap_or(Value::Null))
        .collect();
    let mut out = serde_json::Map::new();
    let mut spread = serde_json::Map::new();
    for key in KEYS.iter().chain(&[
        "train_seconds",
        "steps_lost",
        "steps_rolled_back",
        "recoveries",
    ]) {
        let column: Vec<Option<f64>> = values.iter().map(|v| v[*key].as_f64()).collect();
        let s = crate::commands::bench::ec::over_rounds(column);
        out.insert(key.to_string(), s["median"].clone());
        spread.insert(key.to_string(), s);
    }
    out.insert("spread".into(), Value::Object(spread));
    out.insert("runs".into(), json!(values));
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_go_under_the_headline_keys() {
        let run = |ett: f64| RunFigures {
            ett,
            auc: Some(0.7),
            logloss: None,
            lost_samples: 10,
            bytes_written: 0,
            peak_rss_bytes: Some(5),
            resume_seconds: None,
            full_redundancy_seconds: None,
            train_seconds: 1.0,
            steps: 3,
            steps_lost: 0.0,
            steps_rolled_back: 0,
            failures_injected: 1,
            recoveries: 1,
            pls: None,
        };
        let v = over_rounds(&[run(0.5), run(0.9), run(0.7)]);
        assert_eq!(v["ett"].as_f64(), Some(0.7));
        assert_eq!(v["auc"].as_f64(), Some(0.7));
        assert!(v["logloss"].is_null());
        assert_eq!(v["spread"]["ett"]["min"].as_f64(), Some(0.5));
        assert_eq!(v["runs"].as_array().map(Vec::len), Some(3));
    }
}
