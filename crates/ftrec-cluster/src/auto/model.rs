//! The model behind `--ft auto` and the shoot-out's predictions: the expected effective
//! training time ratio (ETT, DECK's metric: wall time spent on steps whose updates survive
//! into the final model, at failure-free speed, over the wall time) of each strategy, from
//! measured costs and a mean time between failures.
//!
//! With failures arriving as a Poisson process of mean `M` seconds:
//! - **checkpoint**, a cut every `T` s costing `S` s of pause: a failure throws away on
//!   average half a cut period `(T + S) / 2` and costs the recovery `R` (detection, a
//!   new process, every server reloading its shard); ETT = `T / (T + S) · (1 − ((T + S) / 2
//!   + R) / M)`, maximised over `T` (Young's `T ≈ √(2 S M)` for `S ≪ M`);
//! - **ec**: every step slower by the normal-mode overhead `o`, nothing rolls back, a
//!   failure costs detection plus the resume, plus the rebuild's time at the throughput it
//!   takes from training; ETT = `(1 − o) · (1 − (D + resume + rebuild · slowdown) / M)`;
//!   possible only when the parity and replicas fit in memory;
//! - **none** keeps only what was trained after the last failure: over a job of `L` s,
//!   ETT = `M (1 − e^(−L/M)) / L`. Reported, never chosen: it does not recover.
//!
//! Only strategies that end with the failure-free model's state are chosen: partial
//! recovery's ETT is close to checkpoint's, but it loses updates, which this model cannot
//! price in AUC.

use serde::Serialize;

/// A cost, where it came from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Measured {
    pub value: f64,
    /// How it was obtained: "measured: ...", "cached: FILE ...", "config: KEY" or
    /// "given: --mtbf".
    pub source: String,
}

impl Measured {
    pub fn new(value: f64, source: impl Into<String>) -> Self {
        Self {
            value,
            source: source.into(),
        }
    }
}

/// The costs the choice is made from, in seconds unless named otherwise.
#[derive(Clone, Debug, Serialize)]
pub struct Costs {
    pub mtbf_seconds: Measured,
    /// The job's expected failure-free wall time.
    pub job_seconds: Measured,
    /// A consistent cut's pause.
    pub checkpoint_save_seconds: Measured,
    /// Reloading the cut after a failure.
    pub checkpoint_load_seconds: Measured,
    /// Silence to declared dead.
    pub detection_seconds: Measured,
    /// A replacement process started and joined.
    pub restart_seconds: Measured,
    /// Erasure coding: detection to training going on in degraded mode, less detection.
    pub ec_resume_seconds: Measured,
    /// Erasure coding: the share of normal-mode throughput it costs.
    pub ec_overhead: Measured,
    /// Erasure coding: bytes of one server's state to rebuild, and the rebuild's rate.
    pub ec_shard_bytes: Measured,
    pub ec_rebuild_bytes_per_sec: Measured,
    /// Erasure coding: the share of throughput training loses while a rebuild runs.
    pub ec_rebuild_slowdown: Measured,
    /// Why erasure coding cannot run this job, if it cannot (memory, too few servers).
    pub ec_refused: Option<String>,
    /// What choosing cost this run: the calibration (0 when cached) and the timing
    /// checkpoint. Paid whatever is chosen, so it lowers the ETT auto predicts, not the
    /// choice.
    pub calibration_seconds: Measured,
    /// The calibration's cost when it was measured (what a job that finds no cached one
    /// pays).
    pub calibration_measured_seconds: f64,
}

/// An ETT with `overhead_seconds` of wall time spent before the job's `job_seconds`.
pub fn with_calibration(ett: f64, job_seconds: f64, overhead_seconds: f64) -> f64 {
    if overhead_seconds <= 0.0 {
        return ett;
    }
    let job = job_seconds.max(1e-9);
    ett * job / (job + overhead_seconds)
}

/// One strategy's predicted ETT (and, for checkpoints, the interval it assumes).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    pub strategy: &'static str,
    pub ett: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub every_seconds: Option<f64>,
    /// Why the strategy is not a candidate, if it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub excluded: Option<String>,
}

/// What `--ft auto` chose, and why.
#[derive(Clone, Debug, Serialize)]
pub struct Choice {
    /// `checkpoint` or `ec`.
    pub strategy: &'static str,
    /// The cut interval, for `checkpoint`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub every_seconds: Option<f64>,
    /// The chosen strategy's ETT with this run's calibration counted.
    pub predicted_ett: f64,
    /// The same without it (the predictions' own).
    pub predicted_ett_before_calibration: f64,
    pub predictions: Vec<Prediction>,
    pub costs: Costs,
    pub why: String,
}

/// Checkpoint ETT with a cut every `every` seconds. An interval as long as the job takes
/// no cut before the end: no pauses, and a failure loses what was trained since the start,
/// half the job on average.
pub fn checkpoint_ett(c: &Costs, every: f64) -> f64 {
    let (s, m, job) = (
        c.checkpoint_save_seconds.value,
        c.mtbf_seconds.value,
        c.job_seconds.value,
    );
    let recovery =
        c.detection_seconds.value + c.restart_seconds.value + c.checkpoint_load_seconds.value;
    let ett = if every >= job {
        1.0 - (job / 2.0 + recovery) / m
    } else {
        every / (every + s) * (1.0 - ((every + s) / 2.0 + recovery) / m)
    };
    ett.max(0.0)
}

/// The cut interval that maximises [`checkpoint_ett`]: a golden-section search over
/// `[S, job length)` (the ETT is unimodal there, with Young's `√(2 S M)` near its top for
/// `S ≪ M`), or the whole job (no cut before the end) when that is better.
pub fn best_checkpoint_interval(c: &Costs) -> f64 {
    let s = c.checkpoint_save_seconds.value.max(1e-3);
    let job = c.job_seconds.value;
    if job <= s {
        return job.max(s);
    }
    let (mut lo, mut hi) = (s, job * (1.0 - 1e-9));
    let phi = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..200 {
        let a = hi - phi * (hi - lo);
        let b = lo + phi * (hi - lo);
        if checkpoint_ett(c, a) < checkpoint_ett(c, b) {
            lo = a;
        } else {
            hi = b;
        }
    }
    let inside = (lo + hi) / 2.0;
    if checkpoint_ett(c, job) > checkpoint_ett(c, inside) {
        job
    } else {
        inside
    }
}

pub fn ec_ett(c: &Costs) -> f64 {
    let rebuild = c.ec_shard_bytes.value / c.ec_rebuild_bytes_per_sec.value.max(1.0);
    let per_failure = c.detection_seconds.value
        + c.ec_resume_seconds.value
        + rebuild * c.ec_rebuild_slowdown.value;
    ((1.0 - c.ec_overhead.value) * (1.0 - per_failure / c.mtbf_seconds.value)).max(0.0)
}

pub fn none_ett(c: &Costs) -> f64 {
    let (m, l) = (c.mtbf_seconds.value, c.job_seconds.value.max(1e-9));
    m * (1.0 - (-l / m).exp()) / l
}

/// Every strategy's prediction, and the best of the candidates (checkpoint or ec).
pub fn choose(costs: Costs) -> Choice {
    let every = best_checkpoint_interval(&costs);
    let checkpoint = Prediction {
        strategy: "checkpoint",
        ett: checkpoint_ett(&costs, every),
        every_seconds: Some(every),
        excluded: None,
    };
    let ec = Prediction {
        strategy: "ec",
        ett: ec_ett(&costs),
        every_seconds: None,
        excluded: costs.ec_refused.clone(),
    };
    let none = Prediction {
        strategy: "none",
        ett: none_ett(&costs),
        every_seconds: None,
        excluded: Some("does not recover a lost shard".into()),
    };
    let best = if ec.excluded.is_none() && ec.ett > checkpoint.ett {
        ec.clone()
    } else {
        checkpoint.clone()
    };
    let cuts = if every >= costs.job_seconds.value {
        format!(
            "checkpoints, no cut before the end of the {:.0} s job",
            costs.job_seconds.value
        )
    } else {
        format!("checkpoints every {every:.1} s")
    };
    let why = match (&best.every_seconds, &ec.excluded) {
        (Some(_), Some(refused)) => format!(
            "{cuts} (predicted ETT {:.3}); erasure coding is out: {refused}",
            checkpoint.ett
        ),
        (Some(_), None) => format!(
            "{cuts}: predicted ETT {:.3} against {:.3} for erasure \
             coding, whose {:.1}% normal-mode overhead costs more than the rollbacks of one \
             failure per {:.0} s",
            checkpoint.ett,
            ec.ett,
            100.0 * costs.ec_overhead.value,
            costs.mtbf_seconds.value
        ),
        (None, _) => format!(
            "erasure coding: predicted ETT {:.3} against {:.3} for the best checkpoint \
             interval ({every:.1} s): one failure per {:.0} s rolls back more than its \
             {:.1}% normal-mode overhead costs",
            ec.ett,
            checkpoint.ett,
            costs.mtbf_seconds.value,
            100.0 * costs.ec_overhead.value
        ),
    };
    let predicted_ett = with_calibration(
        best.ett,
        costs.job_seconds.value,
        costs.calibration_seconds.value,
    );
    let why = if costs.calibration_seconds.value > 0.0 {
        format!(
            "{why}; the {:.1} s spent choosing makes it {predicted_ett:.3}",
            costs.calibration_seconds.value
        )
    } else {
        why
    };
    Choice {
        strategy: best.strategy,
        every_seconds: best.every_seconds,
        predicted_ett,
        predicted_ett_before_calibration: best.ett,
        predictions: vec![checkpoint, ec, none],
        costs,
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The tiny job's measured costs (BENCHMARKS.md) at a given MTBF.
    fn costs(mtbf: f64) -> Costs {
        let m = |v: f64| Measured::new(v, "test");
        Costs {
            mtbf_seconds: m(mtbf),
            job_seconds: m(600.0),
            checkpoint_save_seconds: m(0.07),
            checkpoint_load_seconds: m(0.02),
            detection_seconds: m(1.0),
            restart_seconds: m(0.5),
            ec_resume_seconds: m(0.35),
            ec_overhead: m(0.08),
            ec_shard_bytes: m(8e6),
            ec_rebuild_bytes_per_sec: m(3.5e8),
            ec_rebuild_slowdown: m(0.1),
            ec_refused: None,
            calibration_seconds: m(0.0),
            calibration_measured_seconds: 12.0,
        }
    }

    /// What choosing cost is paid whatever is chosen: it lowers the predicted ETT by the
    /// job's share, never changes the choice.
    #[test]
    fn the_calibration_lowers_the_predicted_ett_not_the_choice() {
        let free = choose(costs(8.0));
        let mut c = costs(8.0);
        c.calibration_seconds = Measured::new(60.0, "test");
        let paid = choose(c);
        assert_eq!(paid.strategy, free.strategy);
        assert_eq!(paid.predicted_ett_before_calibration, free.predicted_ett);
        let expected = free.predicted_ett * 600.0 / 660.0;
        assert!(
            (paid.predicted_ett - expected).abs() < 1e-12,
            "{}",
            paid.predicted_ett
        );
        assert!(paid.why.contains("60.0 s spent choosing"), "{}", paid.why);
    }

    #[test]
    fn frequent_failures_choose_erasure_coding() {
        let c = choose(costs(8.0));
        assert_eq!(c.strategy, "ec", "{}", c.why);
        assert!(c.why.contains("erasure coding"), "{}", c.why);
    }

    #[test]
    fn rare_failures_choose_checkpoints_with_a_long_interval() {
        let frequent = best_checkpoint_interval(&costs(60.0));
        let c = choose(costs(3600.0));
        assert_eq!(c.strategy, "checkpoint", "{}", c.why);
        let every = c.every_seconds.unwrap();
        assert!(every > 5.0 * frequent, "{every} vs {frequent}");
        // Young's interval, √(2 S M), for S ≪ M.
        let young = (2.0 * 0.07 * 3600.0f64).sqrt();
        assert!((every / young - 1.0).abs() < 0.1, "{every} vs {young}");
    }

    #[test]
    fn a_short_job_with_rare_failures_takes_no_cut_before_its_end() {
        let mut c = costs(1e6);
        c.job_seconds = Measured::new(0.5, "test");
        let choice = choose(c);
        assert_eq!(choice.strategy, "checkpoint", "{}", choice.why);
        assert_eq!(choice.every_seconds, Some(0.5));
        // Its ETT is what one failure from the start would cost, and beats erasure coding's
        // overhead.
        assert!(choice.predicted_ett > 0.99, "{}", choice.predicted_ett);
    }

    #[test]
    fn erasure_coding_that_does_not_fit_is_never_chosen() {
        let mut c = costs(8.0);
        c.ec_refused = Some("the parity rows need 3 GB more than this host has".into());
        let choice = choose(c);
        assert_eq!(choice.strategy, "checkpoint");
        assert!(choice.why.contains("3 GB more"), "{}", choice.why);
    }

    #[test]
    fn none_keeps_only_what_follows_the_last_failure() {
        // No failures expected: everything is kept; one per job length: 1 - 1/e.
        assert!((none_ett(&costs(1e12)) - 1.0).abs() < 1e-6);
        let e = none_ett(&costs(600.0));
        assert!((e - (1.0 - (-1f64).exp())).abs() < 1e-9, "{e}");
    }

    proptest! {
        /// The chosen interval beats its neighbours, and grows with the MTBF.
        #[test]
        fn the_interval_is_a_maximum_and_grows_with_the_mtbf(mtbf in 5.0f64..10_000.0) {
            let c = costs(mtbf);
            let t = best_checkpoint_interval(&c);
            let e = checkpoint_ett(&c, t);
            prop_assert!(e + 1e-9 >= checkpoint_ett(&c, t * 0.8));
            prop_assert!(e + 1e-9 >= checkpoint_ett(&c, t * 1.25));
            prop_assert!(e + 1e-9 >= checkpoint_ett(&c, 600.0));
            let longer = best_checkpoint_interval(&costs(mtbf * 2.0));
            prop_assert!(longer + 1e-6 >= t, "{} then {}", t, longer);
            let choice = choose(c);
            let best = choice.predictions.iter()
                .filter(|p| p.excluded.is_none())
                .map(|p| p.ett)
                .fold(0.0, f64::max);
            prop_assert_eq!(choice.predicted_ett_before_calibration, best);
        }
    }
}
