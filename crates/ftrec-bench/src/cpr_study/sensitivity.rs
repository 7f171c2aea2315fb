//! The sensitivity studies of cpr.txt §6.3 and §6.4, in the main study's cost frame.
//!
//! - §6.3, target PLS: CPR-vanilla and CPR-SSU at targets 0.02, 0.1 and 0.2 (the middle
//!   fraction), trading accuracy for overhead.
//! - §6.4, failures: 2, 20 and 40 failures per epoch at every fraction, target PLS 0.02,
//!   full recovery against CPR-vanilla and CPR-SSU. CPR's decision (Eq. 1 against Eq. 2)
//!   says whether partial recovery pays; the runs say whether it did. Eq. 2 models
//!   CPR-vanilla (whole tables at every save), so the decision is judged against that run,
//!   and CPR-SSU (which saves at most `r` of the rows per save, and which the paper plots)
//!   is judged against its own decision, Eq. 2 priced with its probed saves
//!   ([`super::probe`]), and against the plain Eq. 2 decision for comparison. The paper's claim: every setup judged not worth it was indeed worse than
//!   full recovery, and CPR gains less as failures grow more frequent.
//!
//! Every run shares the main study's frame (its `O_save`, `O_load` and `T_total` given as
//! overrides), so the runs differ only in what is varied. Overheads include every cost.

use ftrec_cpr::Recovery;
use ftrec_data::Dataset;
use serde::Serialize;

use super::report::fraction_key;
use super::{CostFrame, CostOverrides, Strategy, StudyConfig, run_study};
use ftrec_train::TrainError;

pub const PLS_TARGETS: [f64; 3] = [0.02, 0.1, 0.2];
pub const FAILURE_COUNTS: [usize; 3] = [2, 20, 40];
const FAILURES_TARGET_PLS: f64 = 0.02;

#[derive(Clone, Debug, Serialize)]
pub struct PlsPoint {
    pub target_pls: f64,
    pub strategy: String,
    pub fraction: f64,
    pub auc: f64,
    pub pls: f64,
    pub overhead_fraction_all_costs: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct FailurePoint {
    pub failures: usize,
    pub fraction: f64,
    /// CPR's choice from Eq. 1 and Eq. 2: `partial` when partial recovery pays.
    pub decision: Recovery,
    pub full_overhead: f64,
    /// CPR-vanilla and CPR-SSU run anyway, as the paper plots what they would have cost.
    pub vanilla_overhead: f64,
    pub ssu_overhead: f64,
    /// `ssu_overhead / full_overhead`.
    pub normalized: f64,
    /// The decision agrees with the CPR-vanilla run (what Eq. 2 models): partial chosen and
    /// cheaper, or full chosen and partial no cheaper.
    pub decision_right: bool,
    /// CPR-SSU's own decision: Eq. 2 priced with its probed saves.
    pub ssu_decision: Recovery,
    /// ... and the overhead it expected for the run, every cost included.
    pub ssu_overhead_expected: f64,
    /// `ssu_decision` agrees with the CPR-SSU run.
    pub decision_right_for_ssu: bool,
    /// The plain Eq. 2 decision (`decision`) against the CPR-SSU run, as the paper decides.
    pub eq2_decision_right_for_ssu: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct Sensitivity {
    pub pls: Vec<PlsPoint>,
    pub failures: Vec<FailurePoint>,
    /// Failure setups whose decision the CPR-vanilla run contradicts.
    pub wrong_decisions: usize,
    /// CPR-SSU's own decisions the CPR-SSU run contradicts.
    pub wrong_decisions_for_ssu: usize,
    /// The plain Eq. 2 decisions the CPR-SSU run contradicts.
    pub wrong_decisions_for_ssu_by_eq2: usize,
}

/// The main study's config, with the frame fixed to `frame` and nothing extra run.
fn in_frame(config: &StudyConfig, frame: &CostFrame) -> StudyConfig {
    let mut c = config.clone();
    c.costs = CostOverrides {
        o_save: Some(frame.o_save),
        o_load: Some(frame.o_load),
        o_save_fixed: Some(frame.o_save_fixed),
        o_load_fixed: Some(frame.o_load_fixed),
        o_res: Some(frame.o_res),
        job_seconds: Some(frame.t_total),
        storage_dir: None,
    };
    c.pls_sweep = Vec::new();
    c.correlation = None;
    c.sensitivity = false;
    c.many_failures = 0;
    c
}

pub(super) fn run_sensitivity(
    config: &StudyConfig,
    frame: &CostFrame,
    train: &Dataset,
    test: &Dataset,
    progress: &mut dyn FnMut(&str),
) -> Result<Sensitivity, TrainError> {
    let base = in_frame(config, frame);
    let middle = base.fractions[base.fractions.len() / 2];
    let mut pls = Vec::new();
    for target in PLS_TARGETS {
        let mut c = base.clone();
        c.job.cpr.target_pls = target;
        c.fractions = vec![middle];
        c.strategies = vec![Strategy::CprVanilla, Strategy::CprSsu];
        progress(&format!("sensitivity: target PLS {target}"));
        let report = run_study(&c, train, test, &mut |_| {})?;
        for r in report.runs {
            pls.push(PlsPoint {
                target_pls: target,
                strategy: r.strategy,
                fraction: r.fraction,
                auc: r.auc,
                pls: r.pls,
                overhead_fraction_all_costs: r.overhead_fraction_all_costs,
            });
        }
    }
    let mut failures = Vec::new();
    for count in FAILURE_COUNTS {
        let mut c = base.clone();
        c.failures = count;
        c.job.cpr.target_pls = FAILURES_TARGET_PLS;
        // T_fail follows the count (T_total / failures), as in the paper.
        c.job.cpr.mtbf_seconds = None;
        c.strategies = vec![Strategy::Full, Strategy::CprVanilla, Strategy::CprSsu];
        progress(&format!("sensitivity: {count} failures"));
        let report = run_study(&c, train, test, &mut |_| {})?;
        for &fraction in &c.fractions {
            let key = fraction_key(fraction);
            let runs = report.by_fraction.get(&key);
            let overhead = |s: Strategy| {
                runs.and_then(|r| r.get(s.name()))
                    .map(|r| r.overhead_fraction_all_costs)
            };
            let ssu_decision = report
                .prioritized_decisions
                .get(&key)
                .and_then(|d| d.get(Strategy::CprSsu.name()));
            let (Some(full), Some(vanilla), Some(ssu), Some(decision), Some(ssu_decision)) = (
                overhead(Strategy::Full),
                overhead(Strategy::CprVanilla),
                overhead(Strategy::CprSsu),
                report.decisions.get(&key),
                ssu_decision,
            ) else {
                return Err(TrainError::Config(format!(
                    "sensitivity: {count} failures at {fraction}: a run is missing"
                )));
            };
            let right = |chosen: Recovery, partial: f64| match chosen {
                Recovery::Partial => partial < full,
                Recovery::Full => partial >= full,
            };
            failures.push(FailurePoint {
                failures: count,
                fraction,
                decision: decision.recovery,
                full_overhead: full,
                vanilla_overhead: vanilla,
                ssu_overhead: ssu,
                normalized: ssu / full.max(f64::MIN_POSITIVE),
                decision_right: right(decision.recovery, vanilla),
                ssu_decision: ssu_decision.decision.recovery,
                ssu_overhead_expected: ssu_decision.overhead_fraction_expected,
                decision_right_for_ssu: right(ssu_decision.decision.recovery, ssu),
                eq2_decision_right_for_ssu: right(decision.recovery, ssu),
            });
        }
    }
    let wrong_decisions = failures.iter().filter(|f| !f.decision_right).count();
    let wrong_decisions_for_ssu = failures
        .iter()
        .filter(|f| !f.decision_right_for_ssu)
        .count();
    let wrong_decisions_for_ssu_by_eq2 = failures
        .iter()
        .filter(|f| !f.eq2_decision_right_for_ssu)
        .count();
    Ok(Sensitivity {
        pls,
        failures,
        wrong_decisions,
        wrong_decisions_for_ssu,
        wrong_decisions_for_ssu_by_eq2,
    })
}
