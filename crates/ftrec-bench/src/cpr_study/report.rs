//! What the study reports: one [`RunResult`] per run, grouped by fraction, the AUC–PLS
//! correlation (§6.5) and the paper's targets as measured.

use std::collections::BTreeMap;

use ftrec_cpr::Decision;

use super::many_failures::ManyFailures;
use super::probe::PrioritizedDecision;
use serde::Serialize;

use super::correlation::{Correlation, fisher_interval};
use super::sensitivity::Sensitivity;
use super::{CostFrame, Strategy, StudyConfig};

/// Checkpoint-related overhead of one run, seconds of the job frame.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OverheadSeconds {
    pub save: f64,
    pub load: f64,
    pub reschedule: f64,
    /// Re-training the steps full recovery rolled back.
    pub lost: f64,
    /// Recording row accesses for the priority trackers (MFU counters, SSU samples, SCAR's
    /// nothing): measured wall time, scaled into the frame.
    pub tracking: f64,
    /// Choosing the prioritised rows at each save: measured, scaled likewise. (Copying them
    /// is the save, priced by `O_save` as for every strategy.)
    pub selection: f64,
    /// The same saves and loads priced by their bytes alone, without a save's fixed part
    /// (the accounting before issue 45): reported beside, never added to the totals.
    pub save_bytes_only: f64,
    pub load_bytes_only: f64,
}

impl OverheadSeconds {
    /// Eq. 1 / Eq. 2's terms: saves, loads, reschedules and lost work, without what
    /// prioritising rows costs (the paper's accounting).
    pub fn total(&self) -> f64 {
        self.save + self.load + self.reschedule + self.lost
    }

    /// Every cost, tracking and selection included.
    pub fn total_all(&self) -> f64 {
        self.total() + self.tracking + self.selection
    }

    /// [`OverheadSeconds::total_all`] with saves and loads priced by bytes alone.
    pub fn total_all_bytes_only(&self) -> f64 {
        self.total_all() - self.save - self.load + self.save_bytes_only + self.load_bytes_only
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    pub strategy: String,
    pub fraction: f64,
    pub auc: f64,
    pub logloss: f64,
    pub pls: f64,
    /// Eq. 1 (full) or Eq. 2 (partial) evaluated on the run's own events: its checkpoints
    /// at their byte-proportional cost, its failures' reloads and reschedules, and the
    /// steps it re-trained, over T_total. Excludes tracking and selection (the paper's
    /// accounting); [`RunResult::overhead_fraction_all_costs`] includes them.
    pub overhead_fraction: f64,
    /// The same with every cost: plus the measured time spent recording accesses and
    /// choosing prioritised rows.
    pub overhead_fraction_all_costs: f64,
    /// The same with saves and loads priced by their bytes alone (no fixed part per save).
    pub overhead_fraction_all_costs_bytes_only: f64,
    /// Eq. 1 / Eq. 2 in expectation at the run's interval (failures at the MTBF rate).
    pub overhead_fraction_expected: f64,
    pub overhead_seconds: OverheadSeconds,
    pub checkpoints: u64,
    pub bytes: u64,
    pub interval_steps: Option<u64>,
    pub interval_seconds: f64,
    pub failures: usize,
    pub steps_executed: u64,
    pub steps_rolled_back: u64,
    /// MFU counters, SSU list and bitmap, or SCAR's saved copy (Table 1).
    pub tracker_memory_bytes: u64,
    /// The same over the bytes of the prioritised tables (rows with optimizer state).
    pub tracker_memory_share: f64,
    /// Wall seconds recording accesses, and choosing prioritised rows.
    pub tracking_seconds: f64,
    pub select_seconds: f64,
    pub train_seconds: f64,
    /// Digest of the final model, for determinism checks.
    pub digest: String,
}

/// The `{auc, logloss, pls, overhead_fraction, checkpoints, bytes}` object of the JSON.
#[derive(Clone, Debug, Serialize)]
pub struct RunSummary {
    pub auc: f64,
    pub logloss: f64,
    pub pls: f64,
    /// Without tracking and selection (the paper's accounting).
    pub overhead_fraction: f64,
    /// Every cost included.
    pub overhead_fraction_all_costs: f64,
    /// Every cost, saves and loads priced by bytes alone.
    pub overhead_fraction_all_costs_bytes_only: f64,
    pub checkpoints: u64,
    pub bytes: u64,
}

/// One CPR-vanilla run of the PLS sweep.
#[derive(Clone, Debug, Serialize)]
pub struct SweepRun {
    pub target_pls: f64,
    pub fraction: f64,
    pub auc: f64,
    pub logloss: f64,
    pub pls: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct LinearFit {
    pub slope: f64,
    pub intercept: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StudyReport {
    pub by_fraction: BTreeMap<String, BTreeMap<String, RunSummary>>,
    /// Pearson r of AUC against PLS over independent runs, each counted once: with the
    /// correlation runs (the default), each run's AUC less its seed's failure-free AUC
    /// over seeds x Poisson schedules (`correlation`); without them, the single-schedule
    /// population below.
    pub auc_pls_correlation: f64,
    /// Runs behind `auc_pls_correlation`.
    pub correlation_runs: usize,
    /// Its 95% interval (Fisher z).
    pub auc_pls_correlation_interval: [f64; 2],
    pub correlation: Option<Correlation>,
    /// §6.3 and §6.4, when asked for (`--sensitivity`).
    pub sensitivity: Option<Sensitivity>,
    /// §6.5's many-failure runs, when asked for (`--many-failures`).
    pub many_failures: Option<ManyFailures>,
    /// Pearson r over the one schedule's runs: every main run (`full` once per fraction)
    /// and the PLS sweep. Not independent: one seed, one schedule.
    pub auc_pls_correlation_single_schedule: f64,
    /// The same over the main runs only (one target PLS).
    pub auc_pls_correlation_main_runs: f64,
    pub pls_sweep: Vec<SweepRun>,
    pub auc_pls_fit: LinearFit,
    /// The same over the runs without prioritised saving (full, partial, CPR-vanilla),
    /// the population of the paper's §6.5.
    pub auc_pls_correlation_unprioritised: f64,
    pub no_failure: RunResult,
    pub costs: CostFrame,
    pub decisions: BTreeMap<String, Decision>,
    /// CPR's decision for each prioritised strategy, by fraction: Eq. 2 priced with that
    /// strategy's probed saves rather than whole-table ones.
    pub prioritized_decisions: BTreeMap<String, BTreeMap<String, PrioritizedDecision>>,
    pub targets: Targets,
    pub failures: usize,
    /// Executed steps after which the failures struck (the same in every run).
    pub failure_steps: Vec<u64>,
    pub servers: usize,
    pub target_pls: f64,
    pub r: f64,
    pub runs: Vec<RunResult>,
}

/// The targets, each as measured; `None` when a strategy did not run.
#[derive(Clone, Debug, Serialize)]
pub struct Targets {
    /// Smallest `1 − overhead / full's overhead` of CPR-MFU and CPR-SSU over the fractions,
    /// every cost included (target ≥ 0.5).
    pub mfu_ssu_overhead_reduction_min: Option<f64>,
    /// The same without tracking and selection, the paper's accounting (its claim: ≥ 0.9).
    pub mfu_ssu_overhead_reduction_min_excluding_tracking: Option<f64>,
    /// The same cut with saves and loads priced by bytes alone, no fixed part per save: the
    /// cut both ways.
    pub mfu_ssu_overhead_reduction_min_bytes_only: Option<f64>,
    /// Largest `|AUC − full's AUC|` over the CPR-MFU and CPR-SSU runs (target ≤ 0.001).
    pub mfu_ssu_auc_gap_max: Option<f64>,
    /// Largest `|AUC − full's AUC|` over all CPR runs.
    pub cpr_auc_gap_max: Option<f64>,
    pub overhead_met: Option<bool>,
    pub auc_met: Option<bool>,
    /// `|r(AUC, PLS)| ≥ 0.8` over at least 15 independent runs.
    pub correlation_met: bool,
}

/// Every run of a study: the main runs, the PLS sweep, and the independent correlation runs.
pub(super) struct StudyRuns {
    pub runs: Vec<RunResult>,
    pub sweep: Vec<SweepRun>,
    pub correlation: Option<Correlation>,
    pub sensitivity: Option<Sensitivity>,
    pub many_failures: Option<ManyFailures>,
}

/// Whether `full`'s one run (the same PLS and AUC under every fraction) is counted already.
fn distinct_full_seen(counted: &[(f64, f64)], run: &RunResult) -> bool {
    counted
        .iter()
        .any(|&(pls, auc)| pls == run.pls && auc == run.auc)
}

pub fn fraction_key(f: f64) -> String {
    format!("{f}")
}

/// Pearson correlation of `(x, y)` pairs; NaN when either has no variance.
pub fn pearson(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let (mx, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for &(x, y) in points {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx) * (x - mx);
        syy += (y - my) * (y - my);
    }
    sxy / (sxx * syy).sqrt()
}

/// Least-squares `y = slope·x + intercept`.
pub fn linear_fit(points: &[(f64, f64)]) -> LinearFit {
    let n = points.len() as f64;
    let (mx, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    LinearFit {
        slope,
        intercept: my - slope * mx,
    }
}

impl StudyReport {
    pub(super) fn new(
        config: &StudyConfig,
        costs: CostFrame,
        baseline: super::run::Outcome,
        decisions: Vec<(f64, Decision)>,
        prioritized: Vec<(f64, Strategy, PrioritizedDecision)>,
        failure_steps: Vec<u64>,
        StudyRuns {
            runs,
            sweep,
            correlation: independent,
            sensitivity,
            many_failures,
        }: StudyRuns,
    ) -> Self {
        let mut by_fraction: BTreeMap<String, BTreeMap<String, RunSummary>> = BTreeMap::new();
        for r in &runs {
            by_fraction
                .entry(fraction_key(r.fraction))
                .or_default()
                .insert(
                    r.strategy.clone(),
                    RunSummary {
                        auc: r.auc,
                        logloss: r.logloss,
                        pls: r.pls,
                        overhead_fraction: r.overhead_fraction,
                        overhead_fraction_all_costs: r.overhead_fraction_all_costs,
                        overhead_fraction_all_costs_bytes_only: r
                            .overhead_fraction_all_costs_bytes_only,
                        checkpoints: r.checkpoints,
                        bytes: r.bytes,
                    },
                );
        }
        let main_points: Vec<(f64, f64)> = runs.iter().map(|r| (r.pls, r.auc)).collect();
        let points: Vec<(f64, f64)> = main_points
            .iter()
            .copied()
            .chain(sweep.iter().map(|r| (r.pls, r.auc)))
            .collect();
        let unprioritised: Vec<(f64, f64)> = runs
            .iter()
            .filter(|r| {
                [
                    Strategy::Full,
                    Strategy::Partial,
                    Strategy::CprVanilla,
                    Strategy::CprUncoordinated,
                ]
                .iter()
                .any(|s| s.name() == r.strategy)
            })
            .map(|r| (r.pls, r.auc))
            .chain(sweep.iter().map(|r| (r.pls, r.auc)))
            .collect();
        // `full` is one run reported under each fraction: counted once here.
        let mut distinct: Vec<(f64, f64)> = Vec::new();
        for r in &runs {
            if r.strategy == Strategy::Full.name() && distinct_full_seen(&distinct, r) {
                continue;
            }
            distinct.push((r.pls, r.auc));
        }
        distinct.extend(sweep.iter().map(|r| (r.pls, r.auc)));
        let single = pearson(&points);
        let (correlation, n) = match &independent {
            Some(c) => (c.r, c.runs.len()),
            None => (pearson(&distinct), distinct.len()),
        };
        let (low, high) = match &independent {
            Some(c) => (c.r_low, c.r_high),
            None => fisher_interval(correlation, n),
        };
        Self {
            targets: Targets::measure(&runs, correlation, n),
            by_fraction,
            auc_pls_correlation: correlation,
            correlation_runs: n,
            auc_pls_correlation_interval: [low, high],
            correlation: independent,
            sensitivity,
            many_failures,
            auc_pls_correlation_single_schedule: single,
            auc_pls_correlation_main_runs: pearson(&main_points),
            pls_sweep: sweep,
            auc_pls_fit: linear_fit(&points),
            auc_pls_correlation_unprioritised: pearson(&unprioritised),
            no_failure: baseline.result,
            costs,
            decisions: decisions
                .into_iter()
                .map(|(f, d)| (fraction_key(f), d))
                .collect(),
            prioritized_decisions: prioritized.into_iter().fold(
                BTreeMap::new(),
                |mut m: BTreeMap<String, BTreeMap<String, PrioritizedDecision>>, (f, s, d)| {
                    m.entry(fraction_key(f))
                        .or_default()
                        .insert(s.name().to_string(), d);
                    m
                },
            ),
            failures: config.failures,
            failure_steps,
            servers: config.servers,
            target_pls: config.job.cpr.target_pls,
            r: config.job.cpr.r,
            runs,
        }
    }
}

impl Targets {
    fn measure(runs: &[RunResult], correlation: f64, correlation_runs: usize) -> Self {
        let full_of = |f: f64| {
            runs.iter()
                .find(|r| r.strategy == Strategy::Full.name() && r.fraction == f)
        };
        let mut reduction: Option<f64> = None;
        let mut reduction_excluding: Option<f64> = None;
        let mut reduction_bytes_only: Option<f64> = None;
        let mut gap: Option<f64> = None;
        let mut cpr_gap: Option<f64> = None;
        for r in runs {
            let Some(full) = full_of(r.fraction) else {
                continue;
            };
            let d = (r.auc - full.auc).abs();
            if r.strategy.starts_with("cpr_") {
                cpr_gap = Some(cpr_gap.map_or(d, |g| g.max(d)));
            }
            if r.strategy == Strategy::CprMfu.name() || r.strategy == Strategy::CprSsu.name() {
                let red = 1.0 - r.overhead_fraction_all_costs / full.overhead_fraction_all_costs;
                reduction = Some(reduction.map_or(red, |x| x.min(red)));
                let red = 1.0 - r.overhead_fraction / full.overhead_fraction;
                reduction_excluding = Some(reduction_excluding.map_or(red, |x| x.min(red)));
                let red = 1.0
                    - r.overhead_fraction_all_costs_bytes_only
                        / full.overhead_fraction_all_costs_bytes_only;
                reduction_bytes_only = Some(reduction_bytes_only.map_or(red, |x| x.min(red)));
                gap = Some(gap.map_or(d, |g| g.max(d)));
            }
        }
        Self {
            mfu_ssu_overhead_reduction_min: reduction,
            mfu_ssu_overhead_reduction_min_excluding_tracking: reduction_excluding,
            mfu_ssu_overhead_reduction_min_bytes_only: reduction_bytes_only,
            mfu_ssu_auc_gap_max: gap,
            cpr_auc_gap_max: cpr_gap,
            overhead_met: reduction.map(|r| r >= 0.5),
            auc_met: gap.map(|g| g <= 0.001),
            correlation_met: correlation.abs() >= 0.8 && correlation_runs >= 15,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn correlation_and_fit_by_hand() {
        let pts = [(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)];
        assert!((pearson(&pts) - 1.0).abs() < 1e-12);
        let f = linear_fit(&pts);
        assert!((f.slope - 2.0).abs() < 1e-12 && (f.intercept - 1.0).abs() < 1e-12);
        let anti = [(0.0, 2.0), (1.0, 1.0), (2.0, 0.5), (3.0, 0.0)];
        let r = pearson(&anti);
        assert!(r < -0.95 && r > -1.0, "{r}");
        assert!(pearson(&[(1.0, 1.0), (1.0, 2.0)]).is_nan());
        assert_eq!(fraction_key(0.125), "0.125");
        assert_eq!(fraction_key(0.5), "0.5");
    }
}
