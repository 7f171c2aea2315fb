//! The step schedule's progress: the ledger (where every step stands), what settled
//! steps count (samples, the time of the last), lost steps in a row, the retry timer of
//! orphan resolution, and the kills that fire when a step is granted.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use ftrec_proto::proto::Role;

use crate::ledger::StepLedger;

/// How long to wait before asking the servers about orphan steps again after one did not
/// answer.
const RESOLVE_RETRY: Duration = Duration::from_millis(200);

/// Settled steps the job's recent rate is measured over: enough to smooth a step's
/// jitter, few enough that the rate is the last second or two of training, not the
/// warm-up's.
const RATE_WINDOW: usize = 32;

pub(crate) struct Steps {
    pub(crate) ledger: StepLedger,
    /// Samples of the settled steps (each counted once, again after a rollback).
    pub(crate) samples: u64,
    /// Samples whose updates a lost shard no longer holds.
    pub(crate) lost_samples: u64,
    /// Worker RPC payload bytes, as the workers report them.
    pub(crate) rpc_bytes: u64,
    /// Steps lost since one last finished (`service.rs` gives up past a bound).
    pub(crate) lost_in_a_row: u32,
    /// Orphan steps are not asked about again before this (a server did not answer).
    resolve_after: Option<Instant>,
    /// Kills to fire when a step is granted (`--kill server:1@step:8`): role, id, step.
    step_kills: Vec<(Role, usize, u64)>,
    /// When the last step so far was counted, on the timeline's clock.
    pub(crate) last_step_at: Option<f64>,
    /// When the last `RATE_WINDOW` steps were settled (timeline seconds), oldest first.
    recent: VecDeque<f64>,
    /// Training has started, under this leader or an earlier one: a server that joins
    /// from now on takes a slot whose state comes from elsewhere (a rebuild, a cut), never
    /// from the seed. Not the phase: a new leader is `Recovering` during its takeover
    /// whether or not the job had started, and told a joiner it replaced a member of a
    /// job that had not (issue 42, hole 6).
    pub(crate) started: bool,
}

impl Steps {
    pub(crate) fn new(total_steps: u64) -> Self {
        Self {
            ledger: StepLedger::new(total_steps),
            samples: 0,
            lost_samples: 0,
            rpc_bytes: 0,
            lost_in_a_row: 0,
            resolve_after: None,
            step_kills: Vec::new(),
            last_step_at: None,
            recent: VecDeque::with_capacity(RATE_WINDOW),
            started: false,
        }
    }

    /// Counts a settled step of `samples` samples at `t` (the timeline's clock).
    pub(crate) fn settled(&mut self, samples: u64, t: f64) {
        self.samples += samples;
        self.last_step_at = Some(t);
        if self.recent.len() == RATE_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(t);
    }

    /// Steps per second over the last settled steps, or 0 with fewer than two (unknown).
    /// Read when a recovery starts, it is the failure-free rate a background rebuild paces
    /// itself against: no step settles while a lost server's steps wait, so the window
    /// ends at the failure.
    pub(crate) fn recent_steps_per_sec(&self) -> f64 {
        match (self.recent.front(), self.recent.back()) {
            (Some(&first), Some(&last)) if last > first => {
                (self.recent.len() - 1) as f64 / (last - first)
            }
            _ => 0.0,
        }
    }

    /// Orphan resolution waits: a server did not answer the last time.
    pub(crate) fn resolving_waits(&self, now: Instant) -> bool {
        self.resolve_after.is_some_and(|t| now < t)
    }

    /// A server did not answer about the orphans: they are asked about again shortly.
    pub(crate) fn resolve_later(&mut self, now: Instant) {
        self.resolve_after = Some(now + RESOLVE_RETRY);
    }

    /// Fires `role` `id` when global step `step` is granted.
    pub(crate) fn kill_at(&mut self, role: Role, id: usize, step: u64) {
        self.step_kills.push((role, id, step));
    }

    /// The kills that a grant of `granted` reached, each once; the later ones stay armed.
    pub(crate) fn kills_due(&mut self, granted: u64) -> Vec<(Role, usize)> {
        if self.step_kills.is_empty() {
            return Vec::new();
        }
        let (due, rest): (Vec<_>, Vec<_>) = self
            .step_kills
            .iter()
            .copied()
            .partition(|&(_, _, step)| step <= granted);
        self.step_kills = rest;
        due.into_iter().map(|(role, id, _)| (role, id)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kill_fires_once_at_or_past_its_step_and_later_ones_stay_armed() {
        let mut s = Steps::new(100);
        s.kill_at(Role::Server, 1, 8);
        s.kill_at(Role::Worker, 0, 20);
        s.kill_at(Role::Server, 2, 5);
        assert!(s.kills_due(4).is_empty());
        // A grant past a kill's step (it went to another worker first) still fires it.
        assert_eq!(s.kills_due(9), vec![(Role::Server, 1), (Role::Server, 2)]);
        assert!(s.kills_due(9).is_empty());
        assert_eq!(s.kills_due(20), vec![(Role::Worker, 0)]);
        assert!(s.kills_due(1000).is_empty());
    }

    #[test]
    fn resolution_waits_only_until_its_retry_time() {
        let mut s = Steps::new(10);
        let now = Instant::now();
        assert!(!s.resolving_waits(now));
        s.resolve_later(now);
        assert!(s.resolving_waits(now));
        assert!(!s.resolving_waits(now + RESOLVE_RETRY));
    }

    #[test]
    fn the_recent_rate_is_over_the_last_window_of_settled_steps() {
        let mut s = Steps::new(1000);
        assert_eq!(s.recent_steps_per_sec(), 0.0);
        s.settled(1, 0.0);
        assert_eq!(s.recent_steps_per_sec(), 0.0, "one step is no rate");
        // A slow warm-up (a step a second), then 10 steps a second: once the window has
        // moved past the warm-up, only the fast steps count.
        for i in 1..10 {
            s.settled(1, i as f64);
        }
        for i in 1..=RATE_WINDOW {
            s.settled(1, 9.0 + i as f64 / 10.0);
        }
        assert!((s.recent_steps_per_sec() - 10.0).abs() < 1e-9);
    }

    #[test]
    fn settled_steps_add_their_samples() {
        let mut s = Steps::new(10);
        s.settled(32, 1.0);
        s.settled(16, 2.5);
        assert_eq!((s.samples, s.last_step_at), (48, Some(2.5)));
    }
}
