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
    /// Training lost to the recovery, in seconds of the failure-free `ec` run: from the
    /// SIGKILL to full redundancy, the integral of 1 − committed rate / failure-free rate,
    /// plus any retrained steps.
    pub lost_training_seconds: Option<f64>,
    pub ckpt_resume: Option<f64>,
    pub ckpt_step_seconds: f64,
    /// The failure-free job's step (the `none` run's): what a retrained step costs.
    pub failure_free_step_seconds: f64,
    pub ckpt_recovery: Option<f64>,
    /// The checkpoint run's steps trained again after its rollback.
    pub ckpt_retrained_steps: u64,
    /// Its cuts' mean pause: what one checkpoint interval pays for the cut it rolls back to.
    pub ckpt_pause_seconds: Option<f64>,
    /// Checkpoints' training lost to the same SIGKILL: the restore (detection included, as
    /// ECRec's), the retrained steps at the failure-free step, and the pause of the
    /// interval's cut.
    pub ckpt_lost_training_seconds: Option<f64>,
    /// The servers' peak resident sets summed, or `None` where one could not be read; and
    /// a waiting spare's (0 without spares).
    pub rss_none: Option<u64>,
    pub rss_ec: Option<u64>,
    pub spare_rss_none: Option<u64>,
    pub spare_rss_ec: Option<u64>,
    /// Every job process's CPU seconds over the rebuild window of the SIGKILL run, and
    /// per step in the failure-free `ec` run.
    pub rebuild_cpu: Option<f64>,
    pub cpu_per_step: Option<f64>,
}

impl RoundFigures {
    /// The rebuild's CPU beyond training's, per gigabyte rebuilt, every process counted.
    pub fn rebuild_core_seconds_per_gb(&self) -> Option<f64> {
        let training = self.committed_while_degraded? * self.cpu_per_step?;
        let gb = self.rebuild_bytes as f64 / 1e9;
        let cpu = self.rebuild_cpu?;
        (gb > 0.0).then(|| (cpu - training).max(0.0) / gb)
    }

    /// What the redundancy's memory measured: the servers' and a waiting spare's peaks
    /// under `ec` less those under `none`, in bytes (negative where `ec` used less).
    pub fn redundancy_rss_bytes(&self) -> Option<f64> {
        let ec = self.rss_ec? + self.spare_rss_ec?;
        let none = self.rss_none? + self.spare_rss_none?;
        Some(ec as f64 - none as f64)
    }
}

/// Steps committed while the replacement rebuilt in the background, as samples per second
/// over the window from the resume to full redundancy, or to the last step if that came
/// first ([`ftrec_coordinator::Recovery::committed_rate_while_degraded`]), and their count.
pub(crate) fn rate_while_degraded(r: &RunRecord, batch: f64) -> (Option<f64>, Option<f64>) {
    let background = r.recoveries.first().filter(|x| x.background_rebuild);
    (
        background.and_then(|x| x.committed_rate_while_degraded(r.last_step_at, batch)),
        background.map(|x| x.steps_committed_while_degraded as f64),
    )
}

/// From the SIGKILL to full redundancy (or to the last step, if that came first), less the
/// failure-free time of the steps committed in it, plus the retrained steps' time. The
/// steps between the kill and the resume are counted as none: no step commits without a
/// 2PC participant, so at most one straddling the kill is left out, and the figure errs
/// high.
pub(crate) fn lost_training_seconds(
    r: &RunRecord,
    kill_to_resume: Option<f64>,
    batch: f64,
    failure_free_rate: f64,
) -> Option<f64> {
    let x = r.recoveries.first().filter(|x| x.background_rebuild)?;
    let end = x.degraded_until(r.last_step_at);
    let window = kill_to_resume? + (end - x.resumed_at).max(0.0);
    let step = batch / failure_free_rate.max(1e-9);
    let committed = x.steps_committed_while_degraded as f64 * step;
    Some((window - committed).max(0.0) + r.steps_rolled_back as f64 * step)
}

fn summed_peak_rss(r: &RunRecord) -> Option<u64> {
    if r.server_peak_rss_bytes.is_empty() {
        return None;
    }
    r.server_peak_rss_bytes.iter().copied().sum()
}

/// A waiting spare's peak: 0 for a run without spares, unknown where one was not read.
fn spare_rss(r: &RunRecord, spares: usize) -> Option<u64> {
    if spares == 0 {
        return Some(0);
    }
    r.waiting_spare_peak_rss_bytes
}

/// The mean pause of the run's cuts (prioritised saves left out), if it made any.
fn mean_cut_pause(r: &RunRecord) -> Option<f64> {
    let pauses: Vec<f64> = r
        .checkpoints
        .iter()
        .filter(|c| !c.priority)
        .map(|c| c.pause_seconds)
        .collect();
    (!pauses.is_empty()).then(|| pauses.iter().sum::<f64>() / pauses.len() as f64)
}

pub(crate) fn rpcs_per_step(r: &RunRecord) -> f64 {
    r.server_rpcs as f64 / r.steps.max(1) as f64
}

pub(crate) fn server_bytes_per_sample(r: &RunRecord) -> f64 {
    r.server_rpc_bytes as f64 / r.samples.max(1) as f64
}

/// `batch`: samples per step; `spares`: waiting spares in every run.
pub(crate) fn round_figures(
    r: &Round,
    batch: f64,
    checkpoint_every: u64,
    spares: usize,
) -> RoundFigures {
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
    let ckpt_pause_seconds = mean_cut_pause(s);
    let ckpt_lost_training_seconds = ckpt_resume.map(|k| {
        k + s.steps_rolled_back as f64 * failure_free_step_seconds
            + ckpt_pause_seconds.unwrap_or(0.0)
    });
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
        lost_training_seconds: lost_training_seconds(
            &r.ec_kill,
            kill_to_resume,
            batch,
            rate(&r.ec),
        ),
        ckpt_resume,
        ckpt_step_seconds,
        failure_free_step_seconds,
        ckpt_recovery: ckpt_resume
            .map(|k| k + checkpoint_every as f64 / 2.0 * failure_free_step_seconds),
        ckpt_retrained_steps: s.steps_rolled_back,
        ckpt_pause_seconds,
        ckpt_lost_training_seconds,
        rss_none: summed_peak_rss(&r.none),
        rss_ec: summed_peak_rss(&r.ec),
        spare_rss_none: spare_rss(&r.none, spares),
        spare_rss_ec: spare_rss(&r.ec, spares),
        rebuild_cpu: r
            .ec_kill
            .cpu_rebuilds
            .first()
            .copied()
            .flatten()
            .map(|w| w.cpu_seconds),
        cpu_per_step: r
            .ec
            .cpu_training
            .map(|w| w.cpu_seconds / r.ec.steps.max(1) as f64),
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
            "cpu_rebuilds": [{ "from": 12.0, "to": 16.0, "cpu_seconds": 9.0 }],
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
                "cpu_training": { "from": 0.0, "to": 10.0, "cpu_seconds": 5.0 },
            })),
            ec_no_2pc: plain(980.0),
            ec_no_replication: plain(960.0),
            ec_kill,
            ckpt_kill,
            scaled: Vec::new(),
        }
    }

    #[test]
    fn a_round_gives_recovery_times_from_known_events() {
        // 100 steps plus 20 rolled back in 60 s: 0.5 s a step; resumed 7 s after the kill.
        let cut = |pause: f64, priority: bool| {
            json!({
                "step": 40, "started_at": 1.0, "pause_seconds": pause, "bytes": 1,
                "ids": [], "priority": priority,
            })
        };
        let ckpt = run(json!({
            "steps": 100, "steps_rolled_back": 20, "train_seconds": 60.0,
            "kill_to_resume_seconds": [7.0], "samples_per_sec": 500.0,
            "checkpoints": [cut(0.5, false), cut(9.0, true), cut(0.3, false)],
        }));
        let f = round_figures(&round(ec_kill(Some(30.0)), ckpt), 10.0, 40, 0);
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
        // Kill to full redundancy is 6 s, in which 40 steps of 10 samples were committed:
        // 0.42 s at the failure-free `ec` run's 950 samples/s.
        let lost = f.lost_training_seconds.unwrap();
        assert!((lost - (6.0 - 400.0 / 950.0)).abs() < 1e-9, "{lost}");
        // The checkpoint run: resumed after 7 s, 20 steps retrained at 0.01 s, and its cuts'
        // mean pause of 0.4 s (the prioritised save left out).
        assert_eq!(f.ckpt_retrained_steps, 20);
        assert_eq!(f.ckpt_pause_seconds, Some(0.4));
        let ckpt_lost = f.ckpt_lost_training_seconds.unwrap();
        assert!((ckpt_lost - 7.6).abs() < 1e-9, "{ckpt_lost}");
    }

    #[test]
    fn a_round_without_a_recovery_or_a_kill_has_no_recovery_figures() {
        let f = round_figures(&round(run(json!({})), run(json!({}))), 10.0, 40, 1);
        assert_eq!(f.kill_to_resume, None);
        assert_eq!(f.kill_to_full_redundancy, None);
        assert_eq!(f.detection, None);
        assert_eq!((f.rebuild_seconds, f.rebuild_bytes), (0.0, 0));
        assert_eq!(f.ckpt_recovery, None);
        // An empty run's step time is 0, not NaN.
        assert_eq!(f.ckpt_step_seconds, 0.0);
        assert_eq!(f.rebuild_core_seconds_per_gb(), None);
        assert_eq!(f.lost_training_seconds, None);
        assert_eq!(f.ckpt_lost_training_seconds, None);
        // A spare's peak not read (with a spare in the runs) leaves the memory unknown.
        assert_eq!(f.redundancy_rss_bytes(), None);
    }

    #[test]
    fn the_measured_redundancy_counts_a_waiting_spares_reserve() {
        let with_spare = |rss: serde_json::Value, spare: u64| {
            run(json!({ "server_peak_rss_bytes": rss, "waiting_spare_peak_rss_bytes": spare }))
        };
        let mut r = round(run(json!({})), run(json!({})));
        r.none = with_spare(json!([100, 200]), 10);
        r.ec = with_spare(json!([150, 250]), 160);
        // Servers +100, the spare's reserve +150.
        let f = round_figures(&r, 10.0, 40, 1);
        assert_eq!(f.redundancy_rss_bytes(), Some(250.0));
        // Without spares a run has no spare to read: 0 on both sides.
        let f = round_figures(&r, 10.0, 40, 0);
        assert_eq!(f.redundancy_rss_bytes(), Some(100.0));
    }

    #[test]
    fn lost_training_ends_at_the_last_step_and_adds_retrained_steps() {
        // The job ended at 14 s, before full redundancy at 16 s: the window is the kill's
        // 2 s to resume plus 12..14 s, less 40 steps of 10 samples at 1,000 samples/s,
        // plus 3 steps retrained.
        let mut k = ec_kill(Some(14.0));
        k.steps_rolled_back = 3;
        let lost = lost_training_seconds(&k, Some(2.0), 10.0, 1000.0).unwrap();
        assert!((lost - (4.0 - 0.4 + 0.03)).abs() < 1e-9, "{lost}");
        assert_eq!(lost_training_seconds(&k, None, 10.0, 1000.0), None);
    }

    #[test]
    fn a_kill_without_its_resume_time_has_no_time_to_full_redundancy() {
        // The recovery was recorded, but no kill-to-resume (the kill's event missing).
        let mut k = ec_kill(None);
        k.kill_to_resume_seconds.clear();
        let f = round_figures(&round(k, run(json!({}))), 10.0, 40, 0);
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
