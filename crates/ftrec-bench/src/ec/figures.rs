//! One round's figures, from its runs' reports.

use crate::run_record::RunRecord;

use super::Round;

/// One round's figures.
pub(crate) struct RoundFigures {
    pub rate_none: f64,
    pub rate_ec: f64,
    pub rate_ec_no_2pc: f64,
    pub rate_ec_no_replication: f64,
    pub rate_ec_kill: f64,
    pub rate_ckpt_kill: f64,
    pub kill_to_resume: Option<f64>,
    pub kill_to_first_step: Option<f64>,
    pub kill_to_full_redundancy: Option<f64>,
    pub detection: Option<f64>,
    pub rebuild_seconds: f64,
    pub rebuild_bytes: u64,
    pub degraded_rate: Option<f64>,
    pub committed_while_degraded: Option<f64>,
    pub ckpt_resume: Option<f64>,
    pub ckpt_step_seconds: f64,
    /// The failure-free job's step (the `none` run's): what a retrained step costs.
    pub failure_free_step_seconds: f64,
    pub ckpt_recovery: Option<f64>,
    /// The servers' peak resident sets summed, or `None` where one could not be read.
    pub rss_none: Option<u64>,
    pub rss_ec: Option<u64>,
    /// The servers' CPU seconds over the rebuild window of the unthrottled SIGKILL run,
    /// and per step in the failure-free `ec` run.
    pub rebuild_cpu: Option<f64>,
    pub cpu_per_step: Option<f64>,
    pub throttled: Degraded,
}

/// The throttled SIGKILL run's rebuild and the training it kept.
pub(crate) struct Degraded {
    pub rate: f64,
    pub rebuild_seconds: f64,
    pub rebuild_bytes: u64,
    pub degraded_rate: Option<f64>,
    pub committed_while_degraded: Option<f64>,
}

impl Degraded {
    pub fn rebuild_rate(&self) -> Option<f64> {
        (self.rebuild_seconds > 0.0).then(|| self.rebuild_bytes as f64 / self.rebuild_seconds)
    }
}

impl RoundFigures {
    /// The rebuild's CPU beyond training's, per gigabyte rebuilt (unthrottled run).
    pub fn rebuild_core_seconds_per_gb(&self) -> Option<f64> {
        let training = self.committed_while_degraded? * self.cpu_per_step?;
        let gb = self.rebuild_bytes as f64 / 1e9;
        let cpu = self.rebuild_cpu?;
        (gb > 0.0).then(|| (cpu - training).max(0.0) / gb)
    }
}

/// Steps committed while the replacement rebuilt in the background, as samples per second
/// over the window from the resume to full redundancy, or to the last step if that came
/// first. (A slow rebuild can outlast the steps, and the run then waits for it: counting
/// that wait as degraded training put the ratio at 0.886 for runs that trained at full
/// speed while degraded; issue 23.)
pub(crate) fn rate_while_degraded(r: &RunRecord, batch: f64) -> (Option<f64>, Option<f64>) {
    let background = r.recoveries.first().filter(|x| x.background_rebuild);
    (
        background.map(|x| {
            let redundant_at = x.detected_at + x.degraded_seconds;
            let end = r.last_step_at.map_or(redundant_at, |t| t.min(redundant_at));
            let window = end - x.resumed_at;
            x.steps_committed_while_degraded as f64 * batch / window.max(1e-9)
        }),
        background.map(|x| x.steps_committed_while_degraded as f64),
    )
}

fn summed_peak_rss(r: &RunRecord) -> Option<u64> {
    if r.server_peak_rss_bytes.is_empty() {
        return None;
    }
    r.server_peak_rss_bytes.iter().copied().sum()
}

pub(crate) fn rpcs_per_step(r: &RunRecord) -> f64 {
    r.server_rpcs as f64 / r.steps.max(1) as f64
}

pub(crate) fn server_bytes_per_sample(r: &RunRecord) -> f64 {
    r.server_rpc_bytes as f64 / r.samples.max(1) as f64
}

/// `batch`: samples per step.
pub(crate) fn round_figures(r: &Round, batch: f64, checkpoint_every: u64) -> RoundFigures {
    let rate = |r: &RunRecord| r.samples_per_sec;
    let recovery = r.ec_kill.recoveries.first();
    let kill_to_resume = r.ec_kill.kill_to_resume_seconds.first().copied();
    let (rebuild_seconds, rebuild_bytes) = recovery
        .map(|x| (x.rebuild_seconds, x.rebuild_bytes))
        .unwrap_or_default();
    // Kill to resume, plus the rest of the degraded window: kill to full redundancy.
    let kill_to_full_redundancy = recovery
        .zip(kill_to_resume)
        .map(|(x, k)| k + (x.detected_at + x.degraded_seconds - x.resumed_at).max(0.0));
    // Training while the replacement rebuilt in the background: the steps committed from
    // the resume to full redundancy, over that window.
    let (degraded_rate, committed_while_degraded) = rate_while_degraded(&r.ec_kill, batch);
    let throttled_recovery = r.ec_kill_throttled.recoveries.first();
    let (throttled_rate, throttled_committed) = rate_while_degraded(&r.ec_kill_throttled, batch);
    // Checkpoint recovery in the average case: the measured SIGKILL-to-resume (detection,
    // restore) plus retraining half an interval at the failure-free step time. The
    // checkpoint run's own mean step (retrained steps counted) includes its checkpoints'
    // pauses, which are not retraining: priced at it, the recovery looked about 1.4x
    // longer than it is (issue 45). The mean is still reported.
    let s = &r.ckpt_kill;
    let ckpt_step_seconds = s.train_seconds / (s.steps + s.steps_rolled_back).max(1) as f64;
    let failure_free_step_seconds = if rate(&r.none) > 0.0 {
        batch / rate(&r.none)
    } else {
        0.0
    };
    let ckpt_resume = s.kill_to_resume_seconds.first().copied();
    RoundFigures {
        rate_none: rate(&r.none),
        rate_ec: rate(&r.ec),
        rate_ec_no_2pc: rate(&r.ec_no_2pc),
        rate_ec_no_replication: rate(&r.ec_no_replication),
        rate_ec_kill: rate(&r.ec_kill),
        rate_ckpt_kill: rate(&r.ckpt_kill),
        kill_to_resume,
        kill_to_first_step: recovery.and_then(|x| x.kill_to_first_step_seconds),
        kill_to_full_redundancy,
        // Without the kill's time there is nothing to measure detection from (counting the
        // kill at 0 made it negative).
        detection: recovery
            .zip(kill_to_resume)
            .map(|(x, k)| k - (x.resumed_at - x.detected_at)),
        rebuild_seconds,
        rebuild_bytes,
        degraded_rate,
        committed_while_degraded,
        ckpt_resume,
        ckpt_step_seconds,
        failure_free_step_seconds,
        ckpt_recovery: ckpt_resume
            .map(|k| k + checkpoint_every as f64 / 2.0 * failure_free_step_seconds),
        rss_none: summed_peak_rss(&r.none),
        rss_ec: summed_peak_rss(&r.ec),
        rebuild_cpu: r
            .ec_kill
            .server_cpu_rebuilds
            .first()
            .copied()
            .flatten()
            .map(|w| w.cpu_seconds),
        cpu_per_step: r
            .ec
            .server_cpu_training
            .map(|w| w.cpu_seconds / r.ec.steps.max(1) as f64),
        throttled: Degraded {
            rate: rate(&r.ec_kill_throttled),
            rebuild_seconds: throttled_recovery.map_or(0.0, |x| x.rebuild_seconds),
            rebuild_bytes: throttled_recovery.map_or(0, |x| x.rebuild_bytes),
            degraded_rate: throttled_rate,
            committed_while_degraded: throttled_committed,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_record::fixtures::run;
    use serde_json::json;

    /// Killed at 10 s (resumed 2 s later, at 12 s), detected at 11 s; the rebuild in the
    /// background until 11 + 5 = 16 s; 40 steps committed meanwhile.
    fn ec_kill(last_step_at: Option<f64>) -> RunRecord {
        run(json!({
            "steps": 100, "samples_per_sec": 900.0, "last_step_at": last_step_at,
            "kill_to_resume_seconds": [2.0],
            "server_cpu_rebuilds": [{ "from": 12.0, "to": 16.0, "cpu_seconds": 9.0 }],
            "recoveries": [{
                "detected_at": 11.0, "resumed_at": 12.0, "degraded_seconds": 5.0,
                "background_rebuild": true, "steps_committed_while_degraded": 40,
                "rebuild_seconds": 4.0, "rebuild_bytes": 2_000_000_000u64,
                "kill_to_first_step_seconds": 2.5,
            }],
        }))
    }

    #[test]
    fn the_rate_while_degraded_is_committed_samples_over_resume_to_full_redundancy() {
        // Window 12..16 s: 40 steps of 10 samples in 4 s.
        let (rate, committed) = rate_while_degraded(&ec_kill(Some(30.0)), 10.0);
        assert_eq!(rate, Some(100.0));
        assert_eq!(committed, Some(40.0));
    }

    #[test]
    fn a_rebuild_that_outlasts_the_steps_ends_the_window_at_the_last_step() {
        // Issue 23: the wait after the last step (14..16 s) is not degraded training.
        let (rate, _) = rate_while_degraded(&ec_kill(Some(14.0)), 10.0);
        assert_eq!(rate, Some(200.0));
    }

    #[test]
    fn no_recovery_or_a_blocking_one_has_no_degraded_rate() {
        assert_eq!(rate_while_degraded(&run(json!({})), 10.0), (None, None));
        let blocking = run(json!({ "recoveries": [{
            "resumed_at": 3.0, "steps_committed_while_degraded": 7,
        }] }));
        assert_eq!(rate_while_degraded(&blocking, 10.0), (None, None));
    }

    #[test]
    fn a_zero_length_window_gives_a_finite_rate() {
        // The rebuild ended the moment training resumed: nothing committed, no NaN.
        let r = run(json!({ "recoveries": [{
            "detected_at": 5.0, "resumed_at": 6.0, "degraded_seconds": 1.0,
            "background_rebuild": true,
        }] }));
        assert_eq!(rate_while_degraded(&r, 10.0), (Some(0.0), Some(0.0)));
    }

    fn round(ec_kill: RunRecord, ckpt_kill: RunRecord) -> Round {
        let plain = |rate: f64| run(json!({ "samples_per_sec": rate, "steps": 100 }));
        Round {
            none: run(json!({ "samples_per_sec": 1000.0, "server_peak_rss_bytes": [100, 200] })),
            ec: run(json!({
                "samples_per_sec": 950.0, "steps": 100,
                "server_peak_rss_bytes": [150, null],
                "server_cpu_training": { "from": 0.0, "to": 10.0, "cpu_seconds": 5.0 },
            })),
            ec_no_2pc: plain(980.0),
            ec_no_replication: plain(960.0),
            ec_kill,
            ec_kill_throttled: plain(800.0),
            ckpt_kill,
            scaled: Vec::new(),
        }
    }

    #[test]
    fn a_round_gives_recovery_times_from_known_events() {
        // 100 steps plus 20 rolled back in 60 s: 0.5 s a step; resumed 7 s after the kill.
        let ckpt = run(json!({
            "steps": 100, "steps_rolled_back": 20, "train_seconds": 60.0,
            "kill_to_resume_seconds": [7.0], "samples_per_sec": 500.0,
        }));
        let f = round_figures(&round(ec_kill(Some(30.0)), ckpt), 10.0, 40);
        assert_eq!(f.kill_to_resume, Some(2.0));
        assert_eq!(f.kill_to_first_step, Some(2.5));
        // Resume at 2 s, then the degraded window's remaining 16 - 12 = 4 s.
        assert_eq!(f.kill_to_full_redundancy, Some(6.0));
        // Of the 2 s to resume, 1 s went from detection to resume: 1 s to detect.
        assert_eq!(f.detection, Some(1.0));
        assert_eq!(f.ckpt_step_seconds, 0.5);
        // 10 samples a step at the failure-free 1,000 samples/s.
        assert_eq!(f.failure_free_step_seconds, 0.01);
        // Average case: resume, then half of a 40-step interval retrained, each step at the
        // failure-free time, not the checkpoint run's mean with its pauses.
        assert_eq!(f.ckpt_recovery, Some(7.0 + 20.0 * 0.01));
        assert_eq!((f.rate_none, f.rate_ckpt_kill), (1000.0, 500.0));
        assert_eq!(f.degraded_rate, Some(100.0));
        assert_eq!(f.rss_none, Some(300));
        // A server whose peak could not be read makes the sum unknown, not smaller.
        assert_eq!(f.rss_ec, None);
        assert_eq!(f.cpu_per_step, Some(0.05));
        assert_eq!(f.rebuild_cpu, Some(9.0));
        // 9 CPU s less 40 steps x 0.05 s of training, over 2 GB.
        assert_eq!(f.rebuild_core_seconds_per_gb(), Some(3.5));
        assert_eq!(f.throttled.rebuild_rate(), None);
    }

    #[test]
    fn a_round_without_a_recovery_or_a_kill_has_no_recovery_figures() {
        let f = round_figures(&round(run(json!({})), run(json!({}))), 10.0, 40);
        assert_eq!(f.kill_to_resume, None);
        assert_eq!(f.kill_to_full_redundancy, None);
        assert_eq!(f.detection, None);
        assert_eq!((f.rebuild_seconds, f.rebuild_bytes), (0.0, 0));
        assert_eq!(f.ckpt_recovery, None);
        // An empty run's step time is 0, not NaN.
        assert_eq!(f.ckpt_step_seconds, 0.0);
        assert_eq!(f.rebuild_core_seconds_per_gb(), None);
    }

    #[test]
    fn a_kill_without_its_resume_time_has_no_time_to_full_redundancy() {
        // The recovery was recorded, but no kill-to-resume (the kill's event missing).
        let mut k = ec_kill(None);
        k.kill_to_resume_seconds.clear();
        let f = round_figures(&round(k, run(json!({}))), 10.0, 40);
        assert_eq!(f.kill_to_resume, None);
        assert_eq!(f.kill_to_full_redundancy, None);
        assert_eq!(f.detection, None);
        assert_eq!(f.kill_to_first_step, Some(2.5));
    }

    #[test]
    fn per_step_figures_of_an_empty_run_are_zero() {
        let r = run(json!({ "server_rpcs": 30, "server_rpc_bytes": 500 }));
        assert_eq!(
            (rpcs_per_step(&r), server_bytes_per_sample(&r)),
            (30.0, 500.0)
        );
    }
}
