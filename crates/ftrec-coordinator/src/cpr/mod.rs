//! CPR in the coordinator (`cluster.ft = "partial"`, cpr.txt §4): the PLS of the run
//! (Eq. 3), the checkpoint interval from the target PLS (Eq. 4), and the full-or-partial
//! choice (Eq. 1 against Eq. 2), made once the first checkpoint has measured `O_save`.
//! The arithmetic lives in `ftrec-cpr`; this file feeds it what the cluster measured.

pub(crate) mod own_saves;

use std::time::Duration;

use tokio::time::Instant;

use ftrec_cpr::{CostInputs, Decision, Pls, PrioritizedCosts, Recovery};

use ftrec_rpc::Job;
use ftrec_rpc::PsError;

/// Partial recovery is chosen only when it saves at least this share of full recovery's
/// expected overhead: it costs lost updates, so a marginal gain is not worth them.
pub const MIN_BENEFIT: f64 = 0.1;

/// What the prioritised saves cost (cpr.txt Table 1), summed over the servers.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct PriorityReport {
    /// `mfu`, `ssu` or `scar`.
    pub priority: ftrec_cpr::CprPriority,
    pub saves: u64,
    /// The trackers' memory beside the tables, all servers, at the last save.
    pub tracker_bytes: u64,
    /// Choosing the rows: the slowest server's time, summed over the saves.
    pub select_seconds: f64,
    /// Recording accesses, all the run to the last save: the most any one server spent
    /// (each records on its own pushes' path, side by side with the others).
    pub tracking_seconds: f64,
}

/// What one prioritised save measured, for [`CprState::on_priority_save`].
pub(super) struct PrioritySaveCosts {
    /// The trackers' memory, all servers.
    pub tracker_bytes: u64,
    /// Choosing the rows, the slowest server.
    pub select_seconds: f64,
    /// The pause it caused.
    pub pause: f64,
    /// Recording accesses, the most any server spent, all the run so far.
    pub tracking_seconds: f64,
    /// Training time so far, seconds.
    pub train_seconds: f64,
}

pub(super) struct CprState {
    /// `cpr.priority` is not `none`: prioritised saves every `r` of the cut interval.
    priority: Option<PriorityReport>,
    r: f64,
    last_save_at: Option<Instant>,
    pls: Pls,
    /// The choice in force: partial until a comparison says otherwise.
    partial: bool,
    decision: Option<Decision>,
    /// The comparison is made (or skipped) until a new measurement asks for it again.
    decided: bool,
    /// Measured by the last partial restore: reloading (`O_load`) and detection to
    /// replacement ready (`O_res`), seconds. Estimated until then.
    measured_load: Option<f64>,
    measured_res: Option<f64>,
    /// The pause of the last prioritised save, seconds: with prioritised saves, the
    /// decision waits for it and prices Eq. 2 with it.
    measured_priority_save: Option<f64>,
    /// Recording accesses as a share of the training time, measured at the last
    /// prioritised save: Eq. 2's tracking term.
    tracking_share: f64,
    /// Eq. 4's interval, when `cpr.mtbf_seconds` is set; else cuts follow
    /// `checkpoint.every_steps`.
    interval: Option<Duration>,
    last_cut_at: Option<Instant>,
    target_pls: f64,
    mtbf_seconds: Option<f64>,
    servers: usize,
    failure_timeout: Duration,
}

impl CprState {
    /// `None` unless the job recovers partially.
    pub(super) fn new(job: &Job, total_samples: u64) -> Result<Option<Self>, PsError> {
        let c = &job.config;
        if c.cluster.ft != ftrec_config::FaultTolerance::Partial {
            return Ok(None);
        }
        let cpr = |e: ftrec_cpr::CprError| PsError::Config(format!("[cpr]: {e}"));
        let servers = c.cluster.servers;
        let interval = match c.cpr.mtbf_seconds {
            Some(t_fail) => {
                let seconds =
                    ftrec_cpr::formulas::partial_interval(c.cpr.target_pls, servers, 1, t_fail)
                        .map_err(cpr)?;
                Some(Duration::try_from_secs_f64(seconds).map_err(|e| {
                    PsError::Config(format!(
                        "[cpr]: the checkpoint interval from cpr.target_pls and \
                         cpr.mtbf_seconds ({seconds} s) is not a duration: {e}"
                    ))
                })?)
            }
            None => None,
        };
        let priority =
            (c.cpr.priority != ftrec_config::CprPriority::None).then(|| PriorityReport {
                priority: c.cpr.priority,
                ..PriorityReport::default()
            });
        Ok(Some(Self {
            priority,
            r: c.cpr.r,
            last_save_at: None,
            pls: Pls::new(total_samples.max(1), servers).map_err(cpr)?,
            partial: true,
            decision: None,
            decided: false,
            measured_load: None,
            measured_res: None,
            measured_priority_save: None,
            tracking_share: 0.0,
            interval,
            last_cut_at: None,
            target_pls: c.cpr.target_pls,
            mtbf_seconds: c.cpr.mtbf_seconds,
            servers,
            failure_timeout: Duration::from_millis(c.cluster.failure_timeout_ms),
        }))
    }

    pub(super) fn partial(&self) -> bool {
        self.partial
    }

    pub(super) fn pls(&self) -> f64 {
        self.pls.value
    }

    pub(super) fn interval(&self) -> Option<Duration> {
        self.interval
    }

    pub(super) fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    pub(super) fn start(&mut self, now: Instant) {
        self.last_cut_at = Some(now);
        self.last_save_at = Some(now);
    }

    /// Whether a prioritised save is due: every `r` of the cut interval (seconds when
    /// Eq. 4 sets it, else `r · checkpoint.every_steps` steps), while partial recovery is
    /// in force.
    pub(super) fn priority_due(&self, now: Instant, next_step: u64, every_steps: u64) -> bool {
        if self.priority.is_none() || !self.partial {
            return false;
        }
        match (self.interval, self.last_save_at) {
            (Some(interval), Some(last)) => now.duration_since(last) >= interval.mul_f64(self.r),
            _ => {
                let period = ((self.r * every_steps as f64).round() as u64).max(1);
                every_steps > 0 && next_step.is_multiple_of(period)
            }
        }
    }

    /// A prioritised save committed. The first one lets the deferred decision be made at
    /// the next cut, with its pause and the tracking share measured so far.
    pub(super) fn on_priority_save(&mut self, now: Instant, costs: PrioritySaveCosts) {
        self.last_save_at = Some(now);
        if self.measured_priority_save.replace(costs.pause).is_none() {
            self.decided = false;
        }
        if costs.train_seconds > 0.0 {
            self.tracking_share = costs.tracking_seconds / costs.train_seconds;
        }
        if let Some(p) = self.priority.as_mut() {
            p.saves += 1;
            p.tracker_bytes = costs.tracker_bytes;
            p.select_seconds += costs.select_seconds;
            p.tracking_seconds = costs.tracking_seconds;
        }
    }

    pub(super) fn priority_report(&self) -> Option<PriorityReport> {
        self.priority.clone()
    }

    /// Whether Eq. 4's interval has passed since the last cut (or the start).
    pub(super) fn cut_due(&self, now: Instant) -> bool {
        match (self.interval, self.last_cut_at) {
            (Some(interval), Some(last)) => now.duration_since(last) >= interval,
            _ => false,
        }
    }

    /// A cut committed, after `o_save` seconds of pause. The first one also decides full
    /// against partial, from what the run measured so far: `T_total` extrapolated from
    /// `train_seconds` over `steps_done` of `total_steps`. Returns the decision to log.
    pub(super) fn on_cut(
        &mut self,
        now: Instant,
        o_save: f64,
        train_seconds: f64,
        steps_done: u64,
        total_steps: u64,
    ) -> Option<String> {
        self.last_cut_at = Some(now);
        self.last_save_at = Some(now);
        if std::mem::replace(&mut self.decided, true) {
            return None;
        }
        let Some(t_fail) = self.mtbf_seconds else {
            self.partial = true;
            return Some(
                "partial recovery without the full-or-partial comparison: cpr.mtbf_seconds \
                 (T_fail) is not set"
                    .into(),
            );
        };
        let inputs = CostInputs {
            o_save,
            // Until a restore is measured: reading a shard back costs about what writing
            // it did.
            o_load: self.measured_load.unwrap_or(o_save),
            // Until measured: detection is bounded by the failure timeout, and a spare or
            // a new process joins within about the same time.
            o_res: self
                .measured_res
                .unwrap_or(2.0 * self.failure_timeout.as_secs_f64()),
            t_fail,
            t_total: (train_seconds / steps_done.max(1) as f64 * total_steps as f64).max(1e-3),
        };
        // Prioritised saves cost far less than the whole-table saves plain Eq. 2 prices
        // (BENCHMARKS: Eq. 2 chose full recovery where CPR-SSU was 2-6x cheaper), so with
        // them the decision waits for one to be timed.
        let decided = match (&self.priority, self.measured_priority_save) {
            (Some(_), None) => {
                self.partial = true;
                self.decided = false;
                return Some(
                    "partial recovery; the full-or-partial comparison waits until a \
                     prioritised save has been timed"
                        .into(),
                );
            }
            (Some(_), Some(pause)) => ftrec_cpr::formulas::decide_prioritized(
                inputs,
                self.target_pls,
                self.servers,
                1,
                MIN_BENEFIT,
                PrioritizedCosts {
                    r: self.r,
                    o_save: pause,
                    // Each server times its recording on its pushes' path; the slowest
                    // one's share of the training time is what tracking cost the steps.
                    tracking_share: self.tracking_share,
                    min_save_interval: train_seconds / steps_done.max(1) as f64,
                },
            ),
            (None, _) => {
                ftrec_cpr::formulas::decide(inputs, self.target_pls, self.servers, 1, MIN_BENEFIT)
            }
        };
        match decided {
            Ok(d) => {
                self.partial = d.recovery == Recovery::Partial;
                // Full recovery's own optimum from now on (`T_save,full`), partial keeps
                // Eq. 4's.
                let interval = if self.partial {
                    d.t_save_partial
                } else {
                    d.t_save_full
                };
                self.interval = Duration::try_from_secs_f64(interval.max(1e-3)).ok();
                let text = d.to_string();
                self.decision = Some(d);
                Some(text)
            }
            Err(e) => {
                self.partial = true;
                Some(format!(
                    "partial recovery; the full-or-partial comparison failed: {e}"
                ))
            }
        }
    }

    /// A partial restore measured `O_load` and `O_res`: the next cut compares again with
    /// them.
    pub(super) fn on_measured(&mut self, o_load: f64, o_res: f64) {
        self.measured_load = Some(o_load);
        self.measured_res = Some(o_res);
        self.decided = false;
    }

    /// One server reloaded its shard from the cut at sample `s_ckpt`; it failed at sample
    /// `s_i`. Returns the increment of the PLS (Eq. 3).
    pub(super) fn on_partial_restore(&mut self, s_i: u64, s_ckpt: u64) -> f64 {
        self.pls
            .on_server_failure(s_i, s_ckpt.min(s_i))
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(mtbf: Option<f64>) -> Job {
        let mut c = ftrec_config::JobConfig::preset("tiny").unwrap();
        c.data.dir = Some("unused".into());
        c.checkpoint.dir = Some("unused".into());
        c.checkpoint.every_steps = 10;
        c.cluster.ft = ftrec_config::FaultTolerance::Partial;
        c.cluster.servers = 4;
        c.cpr.target_pls = 0.02;
        c.cpr.mtbf_seconds = mtbf;
        Job::new(c).unwrap()
    }

    #[test]
    fn the_interval_follows_eq4_and_pls_follows_eq3() {
        let mut cpr = CprState::new(&job(Some(100.0)), 10_000).unwrap().unwrap();
        // 2 · PLS · N_emb · T_fail = 2 · 0.02 · 4 · 100 s.
        assert_eq!(cpr.interval(), Some(Duration::from_secs(16)));
        let t0 = Instant::now();
        cpr.start(t0);
        assert!(!cpr.cut_due(t0 + Duration::from_secs(15)));
        assert!(cpr.cut_due(t0 + Duration::from_secs(16)));
        // (S_i − S_ckpt) / (S_total · N_emb) = (3000 − 1000) / (10000 · 4).
        assert_eq!(cpr.on_partial_restore(3000, 1000), 0.05);
        assert_eq!(cpr.on_partial_restore(5000, 5000), 0.0);
        assert_eq!(cpr.pls(), 0.05);
    }

    #[test]
    fn the_first_cut_decides_and_a_costly_save_keeps_partial() {
        let mut cpr = CprState::new(&job(Some(100.0)), 10_000).unwrap().unwrap();
        let t0 = Instant::now();
        cpr.start(t0);
        // A 2 s save on a 1000 s job failing every 100 s: full recovery re-trains half
        // an interval per failure, partial does not; partial wins by far.
        let text = cpr.on_cut(t0, 2.0, 10.0, 10, 1000).unwrap();
        assert!(cpr.partial(), "{text}");
        assert!(
            text.contains("Partial") && text.contains("O_save 2.0000s"),
            "{text}"
        );
        assert!(
            cpr.on_cut(t0, 2.0, 10.0, 10, 1000).is_none(),
            "decided once"
        );
        // Without T_fail there is nothing to compare: partial, and said so.
        let mut plain = CprState::new(&job(None), 10_000).unwrap().unwrap();
        assert_eq!(plain.interval(), None);
        assert!(
            plain
                .on_cut(t0, 1.0, 1.0, 1, 10)
                .unwrap()
                .contains("mtbf_seconds")
        );
        assert!(plain.on_cut(t0, 1.0, 1.0, 2, 10).is_none(), "said once");
        // A measured restore makes the next cut compare again, with the measurements.
        cpr.on_measured(0.25, 3.5);
        let again = cpr.on_cut(t0, 2.0, 10.0, 10, 1000).unwrap();
        assert!(again.contains("O_load 0.2500s O_res 3.5000s"), "{again}");
    }

    #[test]
    fn with_prioritised_saves_the_decision_waits_for_one_and_prices_it() {
        let mut c = job(Some(100.0)).config;
        c.cpr.priority = ftrec_config::CprPriority::Ssu;
        // Eq. 4 at this target asks for a whole-table save every 1.6 s, far dearer than
        // full recovery: plain Eq. 2 would fall back to full recovery.
        c.cpr.target_pls = 0.002;
        let job = Job::new(c).unwrap();
        let mut cpr = CprState::new(&job, 10_000).unwrap().unwrap();
        let t0 = Instant::now();
        cpr.start(t0);
        let text = cpr.on_cut(t0, 2.0, 10.0, 10, 1000).unwrap();
        assert!(cpr.partial() && text.contains("waits"), "{text}");
        assert!(cpr.decision().is_none());
        // A prioritised save pauses 10 ms: at most one a step (1 s here), 10 s over the
        // job, against full recovery's 220 s and more.
        let save = |tracking_seconds| PrioritySaveCosts {
            tracker_bytes: 0,
            select_seconds: 0.001,
            pause: 0.01,
            tracking_seconds,
            train_seconds: 10.0,
        };
        cpr.on_priority_save(t0, save(0.05));
        let text = cpr.on_cut(t0, 2.0, 10.0, 10, 1000).unwrap();
        assert!(cpr.partial(), "{text}");
        assert!(text.contains("prioritised saves of 0.0100s"), "{text}");
        let d = cpr.decision().unwrap();
        assert_eq!(d.prioritized.unwrap().min_save_interval, 1.0);
        assert_eq!(d.prioritized.unwrap().tracking_share, 0.005);
        // Plain Eq. 2 on the same inputs chooses full recovery.
        let plain = ftrec_cpr::formulas::decide(d.inputs, 0.002, 4, 1, MIN_BENEFIT).unwrap();
        assert_eq!(plain.recovery, Recovery::Full, "{plain}");
        assert!(
            cpr.on_cut(t0, 2.0, 10.0, 10, 1000).is_none(),
            "decided once"
        );
        assert_eq!(cpr.priority_report().unwrap().tracking_seconds, 0.05);

        // Tracking that takes a third of every step costs more than full recovery's
        // cuts and rollbacks: the same job then recovers in full.
        let mut cpr = CprState::new(&job, 10_000).unwrap().unwrap();
        cpr.start(t0);
        cpr.on_cut(t0, 2.0, 10.0, 10, 1000);
        cpr.on_priority_save(t0, save(3.3));
        let text = cpr.on_cut(t0, 2.0, 10.0, 10, 1000).unwrap();
        assert!(!cpr.partial(), "{text}");
    }

    #[test]
    fn a_partial_job_without_checkpoints_is_refused() {
        let mut c = job(None).config;
        c.checkpoint.every_steps = 0;
        let e = Job::new(c).unwrap_err().to_string();
        assert!(
            e.contains("checkpoint.every_steps > 0 or cpr.mtbf_seconds"),
            "{e}"
        );
    }

    #[test]
    fn a_cheap_save_falls_back_to_full_recovery() {
        let mut cpr = CprState::new(&job(Some(100.0)), 10_000).unwrap().unwrap();
        // Saving is nearly free: full recovery's optimal interval is tiny and loses
        // almost nothing, so partial recovery's lost updates buy no benefit.
        let text = cpr.on_cut(Instant::now(), 1e-6, 1000.0, 10, 10).unwrap();
        assert!(!cpr.partial(), "{text}");
        assert!(text.contains("Full"), "{text}");
        // Cuts now follow full recovery's optimum, sqrt(2 · O_save · T_fail).
        let expected = (2.0f64 * 1e-6 * 100.0).sqrt();
        assert!((cpr.interval().unwrap().as_secs_f64() - expected).abs() < 1e-9);
    }
}
