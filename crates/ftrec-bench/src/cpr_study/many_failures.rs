//! The many-failure runs of cpr.txt §6.5: does PLS alone predict the accuracy loss,
//! however the loss came about?
//!
//! As in the paper, each run draws 1-32 failures, each clearing 6.25-50% of the embedding
//! servers, and a checkpoint interval chosen so that the expected PLS falls in 0-1 (a
//! target PLS drawn uniformly, Eq. 4 giving the interval at that run's `T_fail =
//! T_total / failures`); CPR-vanilla, no prioritised saves. The emulation uses 16 servers
//! here, so 1 of 16 is the paper's 6.25%. Every run keeps the study's model seed, so the
//! failure-free AUC is one number and the loss is the run's AUC minus it.
//!
//! Reported: r(loss, PLS) with its 95% interval, and the paper's second claim, that at
//! equal PLS neither the number of failures, nor the share each clears, nor when they
//! strike moves the loss: r of each against the loss left after the linear fit on PLS.

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::Serialize;

use ftrec_data::Dataset;
use ftrec_train::TrainError;

use super::correlation::fisher_interval;
use super::failures::Schedule;
use super::report::{linear_fit, pearson};
use super::run::Run;
use super::{CostFrame, Strategy, StudyConfig};

/// Servers of the emulation in these runs: the smallest failure is one of them, 6.25%.
pub const SERVERS: usize = 16;
pub const MAX_FAILURES: usize = 32;
/// Target PLS is drawn from this range, so the expected PLS spans it (Eq. 4).
const TARGETS: (f64, f64) = (0.01, 1.0);

#[derive(Clone, Debug, Serialize)]
pub struct ManyFailureRun {
    pub failures: usize,
    /// Share of the servers each failure clears.
    pub fraction: f64,
    pub target_pls: f64,
    pub interval_steps: u64,
    /// Mean step of the failures over the job's steps (0 = at the start, 1 = at the end).
    pub mean_failure_time: f64,
    pub pls: f64,
    pub auc: f64,
    pub auc_loss: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ManyFailures {
    pub servers: usize,
    pub failure_free_auc: f64,
    /// Pearson r of the AUC loss against PLS, with its 95% interval.
    pub r: f64,
    pub r_low: f64,
    pub r_high: f64,
    /// The least-squares fit `loss = slope·PLS + intercept`.
    pub slope: f64,
    pub intercept: f64,
    /// r of the loss left after the fit on PLS against the failure count, the share each
    /// failure clears, and the mean failure time: near 0 if PLS alone explains the loss.
    pub residual_r_failures: f64,
    pub residual_r_fraction: f64,
    pub residual_r_failure_time: f64,
    pub runs: Vec<ManyFailureRun>,
}

pub(super) fn run_many_failures(
    config: &StudyConfig,
    frame: &CostFrame,
    count: usize,
    failure_free_auc: f64,
    train: &Dataset,
    test: &Dataset,
    progress: &mut dyn FnMut(&str),
) -> Result<ManyFailures, TrainError> {
    let total_steps = frame.total_steps;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(config.job.seed ^ 0x0065_0006_5000);
    let mut runs = Vec::with_capacity(count);
    for i in 0..count {
        let failures = rng.gen_range(1..=MAX_FAILURES);
        let lost = rng.gen_range(1..=SERVERS / 2);
        let fraction = lost as f64 / SERVERS as f64;
        let target = rng.gen_range(TARGETS.0..=TARGETS.1);
        let mut c = config.clone();
        c.servers = SERVERS;
        c.fractions = vec![fraction];
        c.failures = failures;
        c.job.cpr.target_pls = target;
        let mut f = frame.clone();
        f.t_fail = f.t_total / failures as f64;
        let schedule = Schedule::draw(
            config.job.seed.wrapping_add(0x65 + i as u64),
            total_steps,
            failures,
            SERVERS,
            &c.fractions,
        )?;
        progress(&format!(
            "many failures: run {i}, {failures} failures of {:.2}%, target PLS {target:.3}",
            100.0 * fraction
        ));
        let result = Run::new(&c, &f, &schedule, 0, Strategy::CprVanilla, total_steps)?
            .execute(train, test)?
            .result;
        let mean_failure_time = schedule
            .failures
            .iter()
            .map(|x| x.at_step as f64 / total_steps.max(1) as f64)
            .sum::<f64>()
            / schedule.failures.len().max(1) as f64;
        runs.push(ManyFailureRun {
            failures,
            fraction,
            target_pls: target,
            interval_steps: result.interval_steps.unwrap_or(0),
            mean_failure_time,
            pls: result.pls,
            auc: result.auc,
            auc_loss: result.auc - failure_free_auc,
        });
    }
    Ok(summarise(runs, failure_free_auc))
}

fn summarise(runs: Vec<ManyFailureRun>, failure_free_auc: f64) -> ManyFailures {
    let points: Vec<(f64, f64)> = runs.iter().map(|r| (r.pls, r.auc_loss)).collect();
    let r = pearson(&points);
    let (r_low, r_high) = fisher_interval(r, points.len());
    let fit = linear_fit(&points);
    let residual = |run: &ManyFailureRun| run.auc_loss - (fit.slope * run.pls + fit.intercept);
    let unexplained: f64 = runs.iter().map(|run| residual(run).powi(2)).sum();
    let against = |x: &dyn Fn(&ManyFailureRun) -> f64| {
        // Nothing left once PLS is fitted: nothing for anything else to explain (r of
        // rounding noise would be a number without meaning).
        if unexplained < 1e-24 {
            return 0.0;
        }
        let pts: Vec<(f64, f64)> = runs.iter().map(|run| (x(run), residual(run))).collect();
        pearson(&pts)
    };
    ManyFailures {
        servers: SERVERS,
        failure_free_auc,
        r,
        r_low,
        r_high,
        slope: fit.slope,
        intercept: fit.intercept,
        residual_r_failures: against(&|run| run.failures as f64),
        residual_r_fraction: against(&|run| run.fraction),
        residual_r_failure_time: against(&|run| run.mean_failure_time),
        runs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(failures: usize, fraction: f64, pls: f64, loss: f64) -> ManyFailureRun {
        ManyFailureRun {
            failures,
            fraction,
            target_pls: pls,
            interval_steps: 1,
            mean_failure_time: 0.5,
            pls,
            auc: 0.8 + loss,
            auc_loss: loss,
        }
    }

    #[test]
    fn a_loss_explained_by_pls_leaves_no_residual_to_the_failure_count() {
        // loss = -0.01 * PLS exactly, failure counts scattered: r = -1, residuals 0.
        let runs = vec![
            run(1, 0.5, 0.1, -0.001),
            run(30, 0.0625, 0.2, -0.002),
            run(5, 0.25, 0.4, -0.004),
            run(12, 0.125, 0.8, -0.008),
        ];
        let s = summarise(runs, 0.8);
        assert!((s.r + 1.0).abs() < 1e-9, "{}", s.r);
        assert!((s.slope + 0.01).abs() < 1e-12, "{}", s.slope);
        assert_eq!(s.residual_r_failures, 0.0);

        // A loss that also grows with the failure count shows in the residual.
        let runs: Vec<ManyFailureRun> = [
            (1, 0.1),
            (30, 0.2),
            (5, 0.4),
            (12, 0.8),
            (25, 0.5),
            (8, 0.3),
        ]
        .into_iter()
        .map(|(n, pls)| run(n, 0.25, pls, -0.01 * pls - 0.0003 * n as f64))
        .collect();
        let s = summarise(runs, 0.8);
        assert!(s.residual_r_failures < -0.5, "{}", s.residual_r_failures);
    }
}
