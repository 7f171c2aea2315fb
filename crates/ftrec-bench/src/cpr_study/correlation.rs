//! The AUC–PLS correlation over independent runs (cpr.txt §6.5, measured honestly).
//!
//! The study's main population shares one seed and one failure schedule, and its `full`
//! run appears once per fraction, so its correlation rests on runs that are not
//! independent. Here each run is its own configuration: model seed `i` of `seeds`, Poisson
//! failure schedule `j` of `schedules` (drawn from both), and a target PLS taken in turn
//! from `targets`, so PLS spans a range within every seed. CPR-vanilla runs at the study's
//! largest fraction, counted once each.
//!
//! AUC differs between seeds by more than failures move it, so each run is scored by its
//! AUC minus the failure-free AUC of its own seed: the correlation of that loss with PLS
//! is what §6.5 claims. r comes with a 95% interval from Fisher's z transform.

use ftrec_data::Dataset;
use serde::Serialize;

use super::failures::Schedule;
use super::report::pearson;
use super::run::Run;
use super::{CostFrame, Strategy, StudyConfig};
use ftrec_train::TrainError;

/// What to run; `seeds * schedules` runs, plus one failure-free run per seed.
#[derive(Clone, Debug, PartialEq)]
pub struct CorrelationConfig {
    pub seeds: u64,
    pub schedules: u64,
    /// Target PLS values, used in turn.
    pub targets: Vec<f64>,
}

impl Default for CorrelationConfig {
    fn default() -> Self {
        Self {
            seeds: 5,
            schedules: 3,
            targets: vec![0.02, 0.1, 0.2, 0.4, 0.8],
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct CorrelationRun {
    pub seed: u64,
    pub schedule: u64,
    pub target_pls: f64,
    pub failures: usize,
    pub auc: f64,
    /// The failure-free AUC of the same seed.
    pub failure_free_auc: f64,
    pub auc_loss: f64,
    pub pls: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Correlation {
    /// Pearson r of `auc - failure_free_auc` against PLS over the runs.
    pub r: f64,
    /// 95% interval of r (Fisher z; NaN with fewer than 4 runs).
    pub r_low: f64,
    pub r_high: f64,
    /// The same over the runs whose schedule drew at least one failure (a Poisson draw of
    /// none gives PLS 0 and no loss, a point that only agrees), with its run count.
    pub r_with_failures: f64,
    pub runs_with_failures: usize,
    pub runs: Vec<CorrelationRun>,
    pub fraction: f64,
    /// Mean failures per schedule (the study's `--failures`).
    pub mean_failures: f64,
}

/// 95% interval of a Pearson r over `n` pairs, by Fisher's z transform.
pub fn fisher_interval(r: f64, n: usize) -> (f64, f64) {
    if n < 4 || !r.is_finite() {
        return (f64::NAN, f64::NAN);
    }
    let z = r.clamp(-0.999_999, 0.999_999).atanh();
    let half = 1.959_964 / ((n - 3) as f64).sqrt();
    ((z - half).tanh(), (z + half).tanh())
}

pub(super) fn run_correlation(
    config: &StudyConfig,
    correlation: &CorrelationConfig,
    frame: &CostFrame,
    total_steps: u64,
    train: &Dataset,
    test: &Dataset,
    progress: &mut dyn FnMut(&str),
) -> Result<Correlation, TrainError> {
    if correlation.targets.is_empty() || correlation.seeds == 0 || correlation.schedules == 0 {
        return Err(TrainError::Config(
            "the correlation runs need at least one seed, one schedule and one target PLS".into(),
        ));
    }
    let (fraction_index, fraction) = config
        .fractions
        .iter()
        .copied()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .ok_or_else(|| TrainError::Config("--fractions: at least one fraction".into()))?;
    let mean_failures = config.failures.max(1) as f64;
    let mut runs = Vec::new();
    for i in 0..correlation.seeds {
        let mut seeded = config.clone();
        seeded.job.seed = config.job.seed.wrapping_add(1000 + i);
        progress(&format!("correlation: seed {i}, no failures"));
        let free = Run::baseline(&seeded, total_steps)
            .execute(train, test)?
            .result
            .auc;
        for j in 0..correlation.schedules {
            let n = (i * correlation.schedules + j) as usize;
            let target = correlation.targets[n % correlation.targets.len()];
            seeded.job.cpr.target_pls = target;
            let schedule = Schedule::poisson(
                seeded.job.seed.wrapping_mul(0x9E37_79B9).wrapping_add(j),
                total_steps,
                mean_failures,
                config.servers,
                &config.fractions,
            )?;
            progress(&format!(
                "correlation: seed {i}, schedule {j} ({} failures), target PLS {target}",
                schedule.failures.len()
            ));
            let result = Run::new(
                &seeded,
                frame,
                &schedule,
                fraction_index,
                Strategy::CprVanilla,
                total_steps,
            )?
            .execute(train, test)?
            .result;
            runs.push(CorrelationRun {
                seed: i,
                schedule: j,
                target_pls: target,
                failures: schedule.failures.len(),
                auc: result.auc,
                failure_free_auc: free,
                auc_loss: result.auc - free,
                pls: result.pls,
            });
        }
    }
    let points: Vec<(f64, f64)> = runs.iter().map(|r| (r.pls, r.auc_loss)).collect();
    let r = pearson(&points);
    let (r_low, r_high) = fisher_interval(r, points.len());
    let struck: Vec<(f64, f64)> = runs
        .iter()
        .filter(|r| r.failures > 0)
        .map(|r| (r.pls, r.auc_loss))
        .collect();
    Ok(Correlation {
        r,
        r_low,
        r_high,
        r_with_failures: pearson(&struck),
        runs_with_failures: struck.len(),
        runs,
        fraction,
        mean_failures,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fisher_interval_brackets_r_and_narrows_with_n() {
        let (lo, hi) = fisher_interval(-0.85, 15);
        assert!(lo < -0.85 && -0.85 < hi, "{lo} {hi}");
        // By hand: atanh(-0.85) = -1.2562, half-width 1.96 / sqrt(12) = 0.5658.
        assert!((lo - (-1.8220f64).tanh()).abs() < 1e-3, "{lo}");
        assert!((hi - (-0.6904f64).tanh()).abs() < 1e-3, "{hi}");
        let (lo2, hi2) = fisher_interval(-0.85, 60);
        assert!(hi2 - lo2 < hi - lo);
        assert!(fisher_interval(0.5, 3).0.is_nan());
    }
}
