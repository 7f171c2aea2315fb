//! `ftrec bench cpr`: the CPR emulation study (cpr.txt §5.1, §6) in one process.
//!
//! One synchronous training run per strategy and failure fraction, each one epoch over the
//! same data from the same initial model. Failures come at uniformly random steps (the
//! same steps for every run); each one loses a fraction of `servers` emulated embedding
//! servers, row `r` of table `t` living on server `(r + t) % servers` (the cluster's placement). Partial recovery resets the lost
//! servers' rows to their last saved values and keeps going (dense parameters are
//! replicated on the trainers, so they survive); full recovery rolls the whole model and
//! the data position back to the last checkpoint and re-trains the lost steps.
//!
//! Checkpoints are copies into an in-memory "store" of the model; their cost is not the
//! memcpy's but the one the cost frame ([`costs`]) gives them, so the overheads are those
//! of the emulated job (§5.1 scales production overheads to the emulation's length).

pub mod bench;
pub mod correlation;
pub mod costs;
pub mod failures;
pub mod many_failures;
mod plot;
pub mod probe;
pub mod report;
mod run;
pub mod sensitivity;

use ftrec_config::{CprPriority, JobConfig};
use ftrec_data::Dataset;
use serde::Serialize;

pub use correlation::{Correlation, CorrelationConfig};
pub use costs::{CostFrame, CostOverrides};
use ftrec_train::TrainError;
pub use report::{RunResult, StudyReport};

/// The six strategies of §5.1, and CPR-vanilla with uncoordinated per-server saves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Full recovery at `T_save,full = sqrt(2·O_save·T_fail)`.
    Full,
    /// Partial recovery at the same interval.
    Partial,
    /// Partial recovery at the interval of the target PLS (Eq. 4).
    CprVanilla,
    /// CPR-vanilla with uncoordinated per-server checkpoints: each server saves its own
    /// rows every `T_save`, server `s` offset by `s/N` of the interval, with no cut
    /// across servers (partial recovery needs no consistent global state). A failure
    /// loses what each lost server trained since its own last save.
    CprUncoordinated,
    /// CPR with `r·N` rows of the prioritised tables every `r·T_save`, by L2 change.
    CprScar,
    /// ... by access counts.
    CprMfu,
    /// ... by a sub-sampled list of used rows.
    CprSsu,
}

impl Strategy {
    pub const ALL: [Self; 7] = [
        Self::Full,
        Self::Partial,
        Self::CprVanilla,
        Self::CprUncoordinated,
        Self::CprScar,
        Self::CprMfu,
        Self::CprSsu,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Partial => "partial",
            Self::CprVanilla => "cpr_vanilla",
            Self::CprUncoordinated => "cpr_uncoordinated",
            Self::CprScar => "cpr_scar",
            Self::CprMfu => "cpr_mfu",
            Self::CprSsu => "cpr_ssu",
        }
    }

    pub fn priority(self) -> Option<CprPriority> {
        match self {
            Self::CprScar => Some(CprPriority::Scar),
            Self::CprMfu => Some(CprPriority::Mfu),
            Self::CprSsu => Some(CprPriority::Ssu),
            _ => None,
        }
    }

    /// Whether the interval comes from the target PLS rather than Eq. 1's optimum.
    pub fn pls_interval(self) -> bool {
        !matches!(self, Self::Full | Self::Partial)
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|x| x.name()).collect();
                format!("unknown strategy {s:?} (known: {})", names.join(", "))
            })
    }
}

#[derive(Clone, Debug)]
pub struct StudyConfig {
    /// Model, optimizers, batch size, seed, threads and the `[cpr]` section.
    pub job: JobConfig,
    /// Shares of the embedding servers each failure loses.
    pub fractions: Vec<f64>,
    pub failures: usize,
    /// Emulated embedding servers, N_emb.
    pub servers: usize,
    pub strategies: Vec<Strategy>,
    pub costs: CostOverrides,
    /// Partial recovery must save at least this share of Eq. 1 to be chosen (§4.2).
    pub min_benefit: f64,
    /// Extra CPR-vanilla runs at these target PLS values (every fraction), so the AUC–PLS
    /// correlation of §6.5 is measured over a PLS range like the paper's, not only the
    /// one target of the main runs.
    pub pls_sweep: Vec<f64>,
    /// Independent runs (seeds x Poisson schedules) for the AUC-PLS correlation; `None`
    /// skips them and the correlation falls back to the single-schedule population.
    pub correlation: Option<CorrelationConfig>,
    /// Also run the sensitivity studies of §6.3 (target PLS) and §6.4 (failures).
    pub sensitivity: bool,
    /// The many-failure runs of §6.5 (1-32 failures of 6.25-50%); 0 skips them.
    pub many_failures: usize,
}

impl StudyConfig {
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Config(m));
        if self.servers == 0 {
            return bad("--servers must be at least 1".into());
        }
        if self.fractions.is_empty() {
            return bad("--fractions: at least one fraction".into());
        }
        if let Some(f) = self
            .fractions
            .iter()
            .find(|&&f| !(f > 0.0 && f <= 1.0) || failures::servers_lost(f, self.servers) == 0)
        {
            return bad(format!(
                "--fractions: {f} of {} servers is not a whole number of servers in 1..={}",
                self.servers, self.servers
            ));
        }
        if self.strategies.is_empty() {
            return bad("--strategies: at least one strategy".into());
        }
        if !(0.0..1.0).contains(&self.min_benefit) {
            return bad(format!(
                "--min-benefit {} must be in [0, 1)",
                self.min_benefit
            ));
        }
        if let Some(p) = self.pls_sweep.iter().find(|&&p| !(p > 0.0 && p <= 1.0)) {
            return bad(format!("--pls-sweep: target PLS {p} must be in (0, 1]"));
        }
        self.costs.validate()?;
        Ok(())
    }
}

/// Runs the study: a failure-free baseline (which also times the job when the cost frame
/// is measured), then every strategy at every fraction. `full` does not depend on the
/// fraction (it reloads everything), so it runs once and is reported under each.
pub fn run_study(
    config: &StudyConfig,
    train: &Dataset,
    test: &Dataset,
    progress: &mut dyn FnMut(&str),
) -> Result<StudyReport, TrainError> {
    config.validate()?;
    let job = &config.job;
    let total_steps = if job.train.steps > 0 {
        job.train.steps
    } else {
        (train.len() as u64).div_ceil(job.train.batch_size as u64)
    };
    let schedule = failures::Schedule::draw(
        job.seed,
        total_steps,
        config.failures,
        config.servers,
        &config.fractions,
    )?;
    progress("no failures (baseline)");
    let baseline = run::Run::baseline(config, total_steps).execute(train, test)?;
    let frame = CostFrame::measure(config, total_steps, baseline.train_seconds)?;
    tracing::info!(?frame, "cost frame");
    let mut runs = Vec::new();
    let mut decisions = Vec::new();
    let mut prioritized_decisions = Vec::new();
    let mut full: Option<RunResult> = None;
    for (fi, &fraction) in config.fractions.iter().enumerate() {
        let decision = frame.decision(config, fraction)?;
        tracing::info!("fraction {fraction}: {decision}");
        decisions.push((fraction, decision));
        for &strategy in &config.strategies {
            if strategy.priority().is_some() {
                let d = probe::prioritized_decision(config, &frame, fraction, strategy, train)?;
                tracing::info!("fraction {fraction}, {}: {}", strategy.name(), d.decision);
                prioritized_decisions.push((fraction, strategy, d));
            }
        }
        for &strategy in &config.strategies {
            if strategy == Strategy::Full
                && let Some(done) = &full
            {
                runs.push(RunResult {
                    fraction,
                    ..done.clone()
                });
                continue;
            }
            progress(&format!("{} at fraction {fraction}", strategy.name()));
            let result = run::Run::new(config, &frame, &schedule, fi, strategy, total_steps)?
                .execute(train, test)?
                .result;
            if strategy == Strategy::Full {
                full = Some(result.clone());
            }
            runs.push(result);
        }
    }
    let mut sweep = Vec::new();
    for &target in &config.pls_sweep {
        let mut swept = config.clone();
        swept.job.cpr.target_pls = target;
        for (fi, &fraction) in config.fractions.iter().enumerate() {
            progress(&format!(
                "PLS sweep: cpr_vanilla at target {target}, fraction {fraction}"
            ));
            let result = run::Run::new(
                &swept,
                &frame,
                &schedule,
                fi,
                Strategy::CprVanilla,
                total_steps,
            )?
            .execute(train, test)?
            .result;
            sweep.push(report::SweepRun {
                target_pls: target,
                fraction,
                auc: result.auc,
                logloss: result.logloss,
                pls: result.pls,
            });
        }
    }
    let independent = match &config.correlation {
        Some(c) => Some(correlation::run_correlation(
            config,
            c,
            &frame,
            total_steps,
            train,
            test,
            progress,
        )?),
        None => None,
    };
    let many_failures = if config.many_failures > 0 {
        Some(many_failures::run_many_failures(
            config,
            &frame,
            config.many_failures,
            baseline.result.auc,
            train,
            test,
            progress,
        )?)
    } else {
        None
    };
    let sensitivity = if config.sensitivity {
        Some(sensitivity::run_sensitivity(
            config, &frame, train, test, progress,
        )?)
    } else {
        None
    };
    let failure_steps = schedule.failures.iter().map(|f| f.at_step).collect();
    Ok(StudyReport::new(
        config,
        frame,
        baseline,
        decisions,
        prioritized_decisions,
        failure_steps,
        report::StudyRuns {
            runs,
            sweep,
            correlation: independent,
            sensitivity,
            many_failures,
        },
    ))
}
