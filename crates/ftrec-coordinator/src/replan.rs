//! Re-planning the cut interval as failures are measured (`checkpoint.planned_mtbf_seconds`,
//! which `--ft auto` sets when it chooses checkpoints).
//!
//! The interval was chosen before the run for an MTBF the user gave or assumed. The
//! coordinator sees every failure, so it estimates the MTBF as the run goes: the planned
//! MTBF counts as one failure-free period already observed (a prior that a single early
//! failure cannot overturn), so after `n` failures in `t` seconds of training the estimate
//! is `(planned + t) / (1 + n)`. At each failure, the interval becomes Young's optimum
//! `sqrt(2 · O_save · MTBF)` with `O_save` the pause of the last cut, measured, and every
//! later cut re-derives it from its own pause, so that the interval in force always follows
//! the latest measurement. Without a measured cut yet, the planned interval stays; before
//! the first failure it stays too, since the plan already priced the planned MTBF.

/// The re-planned interval, and what it was planned from.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Replan {
    pub planned_mtbf_seconds: f64,
    pub planned_every_seconds: f64,
    pub failures: u64,
    /// The MTBF estimate at the last failure (the planned one before any).
    pub mtbf_seconds: f64,
    /// The cut interval in force.
    pub every_seconds: f64,
    /// The pause of the last cut, seconds.
    pub measured_save_seconds: Option<f64>,
}

impl Replan {
    pub fn new(planned_mtbf_seconds: f64, planned_every_seconds: f64) -> Self {
        Self {
            planned_mtbf_seconds,
            planned_every_seconds,
            failures: 0,
            mtbf_seconds: planned_mtbf_seconds,
            every_seconds: planned_every_seconds,
            measured_save_seconds: None,
        }
    }

    /// A cut committed after `pause` seconds. Once a failure has re-planned the interval,
    /// the interval follows this newest pause.
    pub fn on_cut(&mut self, pause: f64) {
        if pause.is_finite() && pause > 0.0 {
            self.measured_save_seconds = Some(pause);
            if self.failures > 0 {
                self.every_seconds = Self::young(pause, self.mtbf_seconds);
            }
        }
    }

    fn young(save: f64, mtbf: f64) -> f64 {
        (2.0 * save * mtbf).sqrt().max(1e-3)
    }

    /// A failure struck after `train_seconds` of training: re-estimates the MTBF and, with
    /// a measured cut, the interval. Returns the line for the event log.
    pub fn on_failure(&mut self, train_seconds: f64) -> String {
        self.failures += 1;
        self.mtbf_seconds =
            (self.planned_mtbf_seconds + train_seconds.max(0.0)) / (1 + self.failures) as f64;
        let before = self.every_seconds;
        match self.measured_save_seconds {
            Some(save) => {
                self.every_seconds = Self::young(save, self.mtbf_seconds);
                format!(
                    "re-planned after failure {}: MTBF {:.1} s measured ({} failures in {:.1} s \
                     of training, the planned {:.1} s counted as one period); a cut every \
                     {:.2} s (was {:.2} s) = sqrt(2 x O_save {:.3} s measured x MTBF)",
                    self.failures,
                    self.mtbf_seconds,
                    self.failures,
                    train_seconds,
                    self.planned_mtbf_seconds,
                    self.every_seconds,
                    before,
                    save
                )
            }
            None => format!(
                "MTBF {:.1} s measured after failure {}; the interval stays {:.2} s until a \
                 cut has been timed",
                self.mtbf_seconds, self.failures, self.every_seconds
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_sooner_than_planned_shorten_the_interval() {
        // Planned for one failure an hour, a cut every 60 s.
        let mut r = Replan::new(3600.0, 60.0);
        let text = r.on_failure(100.0);
        assert!(text.contains("until a cut has been timed"), "{text}");
        assert_eq!(r.every_seconds, 60.0);
        assert_eq!(r.mtbf_seconds, (3600.0 + 100.0) / 2.0);
        r.on_cut(0.5);
        // Three more failures by 400 s: MTBF (3600 + 400) / 5 = 800 s.
        r.on_failure(200.0);
        r.on_failure(300.0);
        let text = r.on_failure(400.0);
        assert_eq!(r.failures, 4);
        assert!((r.mtbf_seconds - 800.0).abs() < 1e-9);
        // Young: sqrt(2 * 0.5 * 800) = 28.28 s.
        assert!((r.every_seconds - 800f64.sqrt()).abs() < 1e-9, "{text}");
        assert!(text.contains("a cut every 28.28 s"), "{text}");
        // Failures as rare as planned keep the estimate near the plan.
        let mut calm = Replan::new(3600.0, 60.0);
        calm.on_cut(0.5);
        calm.on_failure(3600.0);
        assert_eq!(calm.mtbf_seconds, 3600.0);
        assert!((calm.every_seconds - 3600f64.sqrt()).abs() < 1e-9);
    }

    /// A cut after the re-plan re-derives the interval from its own pause: the report's
    /// interval and measured pause always agree with Young's formula.
    #[test]
    fn cuts_after_a_failure_re_derive_the_interval() {
        let mut r = Replan::new(600.0, 0.25);
        r.on_cut(0.02);
        assert_eq!(r.every_seconds, 0.25, "no failure yet: the plan stands");
        r.on_failure(2.0);
        assert!((r.every_seconds - (2.0 * 0.02 * 301.0f64).sqrt()).abs() < 1e-9);
        r.on_cut(0.036);
        assert!((r.every_seconds - (2.0 * 0.036 * 301.0f64).sqrt()).abs() < 1e-9);
        assert_eq!(r.measured_save_seconds, Some(0.036));
    }
}
