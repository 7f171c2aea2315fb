//! One shoot-out run's figures, their medians over the rounds, and whether `auto` chose
//! well.

use ftrec_config::FaultTolerance;
use serde::Serialize;
use serde_json::{Value, json};

use crate::rounds;
use crate::run_record::RunRecord;

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
    /// `auto`: the seconds this run spent choosing (its calibration, 0 where a cached one
    /// was found, and the timing checkpoint), counted in `ett`; and the ETT it would have
    /// had paying the whole calibration (the first run of a configuration).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub choosing_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ett_first_run: Option<f64>,
}

impl RunFigures {
    /// `auto`'s figures with the time it spent choosing (`paid`) counted in its wall time,
    /// and with the calibration's whole cost (`measured`) for `ett_first_run`.
    pub fn charge_choosing(mut self, paid: f64, measured: f64) -> Self {
        let kept_seconds = self.ett * self.train_seconds;
        let over = |extra: f64| {
            let wall = self.train_seconds + extra;
            if wall > 0.0 { kept_seconds / wall } else { 0.0 }
        };
        self.ett_first_run = Some(over(measured));
        self.ett = over(paid);
        self.choosing_seconds = Some(paid);
        self
    }
}

/// Figures of `s`, with `ref_step_seconds` the failure-free run's wall time per step.
pub fn figures(s: &RunRecord, ft: FaultTolerance, ref_step_seconds: f64) -> RunFigures {
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
        auc: s.auc,
        logloss: s.logloss,
        lost_samples: s.lost_samples + (s.steps_rolled_back as f64 * samples_per_step) as u64,
        bytes_written: s.checkpoints.iter().map(|c| c.bytes).sum(),
        peak_rss_bytes: s.server_peak_rss_bytes.iter().flatten().copied().max(),
        resume_seconds: median(&resume),
        full_redundancy_seconds: median(&full),
        train_seconds: s.train_seconds,
        steps: s.steps,
        steps_lost,
        steps_rolled_back: s.steps_rolled_back,
        failures_injected: s.kill_to_resume_seconds.len(),
        recoveries: s.recoveries.len(),
        pls: s.pls,
        choosing_seconds: None,
        ett_first_run: None,
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

/// Keys only `auto` has, medians over the rounds beside the headline keys.
const AUTO_KEYS: [&str; 2] = ["choosing_seconds", "ett_first_run"];

/// A strategy's figures over the rounds: each headline key's median, and under
/// `spread.{key}` its minimum, maximum and every round's value.
pub fn over_rounds(runs: &[RunFigures]) -> Value {
    let values: Vec<Value> = runs
        .iter()
        .map(|r| serde_json::to_value(r).unwrap_or(Value::Null))
        .collect();
    let mut out = serde_json::Map::new();
    let mut spread = serde_json::Map::new();
    let more = [
        "train_seconds",
        "steps_lost",
        "steps_rolled_back",
        "recoveries",
    ];
    for key in KEYS.iter().chain(&more).chain(&AUTO_KEYS) {
        let column: Vec<Option<f64>> = values.iter().map(|v| v[*key].as_f64()).collect();
        if AUTO_KEYS.contains(key) && column.iter().all(Option::is_none) {
            continue;
        }
        let s = rounds::over_rounds(column);
        out.insert(key.to_string(), s["median"].clone());
        spread.insert(key.to_string(), s);
    }
    out.insert("spread".into(), Value::Object(spread));
    out.insert("runs".into(), json!(values));
    Value::Object(out)
}

/// Whether auto's measured ETT is within 5% of the best strategy's, among those whose
/// AUC is within 0.002 of the failure-free run's.
pub(crate) fn auto_verdict(
    strategies: &serde_json::Map<String, Value>,
    failure_free_auc: Option<f64>,
) -> Value {
    let eligible = |v: &Value| match (v["auc"].as_f64(), failure_free_auc) {
        (Some(auc), Some(ff)) => auc >= ff - 0.002,
        _ => false,
    };
    let best = strategies
        .iter()
        .filter(|(_, v)| eligible(v))
        .filter_map(|(name, v)| Some((name.clone(), v["ett"].as_f64()?)))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    let auto_ett = strategies.get("auto").and_then(|v| v["ett"].as_f64());
    let auto_eligible = strategies.get("auto").is_some_and(eligible);
    match (best, auto_ett) {
        (Some((name, best)), Some(auto)) => json!({
            "best": name,
            "best_ett": best,
            "auto_ett": auto,
            "auto_auc_within_0_002": auto_eligible,
            "within_5_percent": auto_eligible && auto >= 0.95 * best,
        }),
        _ => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_record::fixtures::run;

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
            choosing_seconds: None,
            ett_first_run: None,
        };
        let charged = run(0.5).charge_choosing(1.0, 3.0);
        assert!((charged.ett - 0.25).abs() < 1e-12, "{}", charged.ett);
        assert_eq!(charged.ett_first_run, Some(0.125));
        assert_eq!(charged.choosing_seconds, Some(1.0));
        let v = over_rounds(&[run(0.5), run(0.9), run(0.7)]);
        assert_eq!(v["ett"].as_f64(), Some(0.7));
        assert_eq!(v["auc"].as_f64(), Some(0.7));
        assert!(v["logloss"].is_null());
        assert_eq!(v["spread"]["ett"]["min"].as_f64(), Some(0.5));
        assert_eq!(v["runs"].as_array().map(Vec::len), Some(3));
    }

    fn strategies(entries: &[(&str, Option<f64>, Option<f64>)]) -> serde_json::Map<String, Value> {
        entries
            .iter()
            .map(|(name, ett, auc)| (name.to_string(), json!({ "ett": ett, "auc": auc })))
            .collect()
    }

    #[test]
    fn auto_is_judged_against_the_best_strategy_that_kept_the_auc() {
        // `none` has the best ETT but lost 0.01 AUC: it does not count. `ec` is the best
        // of the rest; auto at 0.9 is within 5% of its 0.93.
        let s = strategies(&[
            ("none", Some(0.99), Some(0.70)),
            ("ec", Some(0.93), Some(0.7095)),
            ("checkpoint-full", Some(0.80), Some(0.71)),
            ("auto", Some(0.90), Some(0.709)),
        ]);
        let v = auto_verdict(&s, Some(0.71));
        assert_eq!(v["best"], "ec");
        assert_eq!(v["best_ett"], 0.93);
        assert_eq!(v["auto_ett"], 0.9);
        assert_eq!(v["auto_auc_within_0_002"], true);
        assert_eq!(v["within_5_percent"], true);
    }

    #[test]
    fn auto_more_than_5_percent_behind_or_with_a_lost_auc_fails() {
        let behind = strategies(&[
            ("ec", Some(1.0), Some(0.71)),
            ("auto", Some(0.94), Some(0.71)),
        ]);
        assert_eq!(auto_verdict(&behind, Some(0.71))["within_5_percent"], false);
        // Exactly 95% of the best passes: the bound is inclusive.
        let edge = strategies(&[
            ("ec", Some(1.0), Some(0.71)),
            ("auto", Some(0.95), Some(0.71)),
        ]);
        assert_eq!(auto_verdict(&edge, Some(0.71))["within_5_percent"], true);
        // Auto's ETT is the best, but it paid in AUC.
        let lossy = strategies(&[
            ("ec", Some(0.9), Some(0.71)),
            ("auto", Some(1.0), Some(0.70)),
        ]);
        let v = auto_verdict(&lossy, Some(0.71));
        assert_eq!(v["best"], "ec");
        assert_eq!(v["auto_auc_within_0_002"], false);
        assert_eq!(v["within_5_percent"], false);
    }

    #[test]
    fn no_verdict_without_a_failure_free_auc_an_auto_run_or_any_strategy() {
        let s = strategies(&[
            ("ec", Some(1.0), Some(0.71)),
            ("auto", Some(1.0), Some(0.71)),
        ]);
        // No failure-free AUC: no strategy is eligible.
        assert!(auto_verdict(&s, None).is_null());
        let without_auto = strategies(&[("ec", Some(1.0), Some(0.71))]);
        assert!(auto_verdict(&without_auto, Some(0.71)).is_null());
        let auto_without_ett = strategies(&[("ec", Some(1.0), Some(0.71)), ("auto", None, None)]);
        assert!(auto_verdict(&auto_without_ett, Some(0.71)).is_null());
        assert!(auto_verdict(&serde_json::Map::new(), Some(0.71)).is_null());
    }

    #[test]
    fn a_run_loses_the_steps_of_its_lost_samples_and_its_rollbacks() {
        // 100 steps of 10 samples in 50 s; 200 samples lost with a shard (20 steps) and 5
        // steps rolled back. The failure-free run took 0.4 s a step: ETT 80 x 0.4 / 50.
        let r = run(json!({
            "steps": 100, "samples": 1000, "lost_samples": 200, "steps_rolled_back": 5,
            "train_seconds": 50.0, "kill_to_resume_seconds": [2.0, 3.0],
            "server_peak_rss_bytes": [10, null, 30],
            "checkpoints": [{ "step": 10, "started_at": 1.0, "pause_seconds": 0.1,
                              "bytes": 7, "ids": [], "priority": false }],
            "recoveries": [
                { "kill_to_resume_seconds": 2.0, "background_rebuild": true,
                  "detected_at": 5.0, "resumed_at": 6.0, "degraded_seconds": 4.0 },
                { "kill_to_resume_seconds": 4.0, "detected_at": 20.0, "resumed_at": 21.0 },
                { "detected_at": 30.0, "resumed_at": 31.0 },
            ],
        }));
        let f = figures(&r, FaultTolerance::Ec, 0.4);
        assert_eq!(f.steps_lost, 20.0);
        assert_eq!(f.ett, 80.0 * 0.4 / 50.0);
        assert_eq!(f.lost_samples, 250);
        assert_eq!(f.bytes_written, 7);
        assert_eq!(f.peak_rss_bytes, Some(30));
        assert_eq!(f.failures_injected, 2);
        assert_eq!(f.recoveries, 3);
        // The upper median of the two resumes, 2 and 4 s (the third had no kill).
        assert_eq!(f.resume_seconds, Some(4.0));
        // Erasure coding: the first adds its background rebuild's remaining 9 - 6 = 3 s
        // (5 s); the second rebuilt before resuming (4 s).
        assert_eq!(f.full_redundancy_seconds, Some(5.0));
        // No fault tolerance: never redundant again.
        assert_eq!(
            figures(&r, FaultTolerance::None, 0.4).full_redundancy_seconds,
            None
        );
        // Checkpoints: redundant at the resume.
        let c = figures(&r, FaultTolerance::Checkpoint, 0.4);
        assert_eq!(c.full_redundancy_seconds, Some(4.0));
    }

    #[test]
    fn an_empty_run_has_zero_ett_and_no_times() {
        let f = figures(&run(json!({})), FaultTolerance::Ec, 0.4);
        assert_eq!((f.ett, f.steps_lost, f.lost_samples), (0.0, 0.0, 0));
        assert_eq!((f.resume_seconds, f.full_redundancy_seconds), (None, None));
        assert_eq!(f.peak_rss_bytes, None);
    }
}
