//! Failures and their recoveries: the slots waiting for a replacement, the servers
//! rebuilding in the background, the recoveries done, the backoff of a recovery that keeps
//! failing, the suspicion that holds grants back after a lost step, and why the run ended.

use std::time::Duration;

use tokio::time::Instant;

use crate::summary::Recovery;

/// A failed recovery is tried again after this, at most this many times in a row.
const RECOVERY_RETRY: Duration = Duration::from_millis(200);
const MAX_RECOVERY_FAILURES: u32 = 50;

#[derive(Default)]
pub(crate) struct Recoveries {
    /// Slots waiting for their replacement, with the detection time.
    pub(crate) failed: Vec<(usize, f64)>,
    /// Servers rebuilding in the background, with the epoch their rebuild began in.
    pub(crate) rebuilding: Vec<(usize, u64)>,
    /// A new leader's record had these slots rebuilding in the background: its last write
    /// may lag a rebuild's end, so the takeover asks their processes
    /// (`leader/finished_rebuilds.rs`).
    pub(crate) rebuilds_to_ask: Vec<usize>,
    pub(crate) recoveries: Vec<Recovery>,
    /// Slots an earlier leader recovered through an etcd outage without a record, whose
    /// replacement this leader kept (`leader/spare_claims.rs`): their recoveries' times
    /// died with that leader, so they are named apart from `recoveries`.
    pub(crate) unrecorded_kept: Vec<usize>,
    /// Recovery attempts that failed in a row, and when to try the next.
    pub(crate) recovery_failures: u32,
    pub(crate) recover_after: Option<Instant>,
    /// A worker lost a step to a server error: no new grants until the failure detector
    /// confirms a failure (or this passes), so the schedule is not burnt on a dead server.
    pub(crate) suspect_until: Option<Instant>,
    /// Steps trained again after rollbacks, over the run: once per rollback, whether a
    /// server's failure or a partly applied step caused it (a recovery record exists only
    /// for a failed server, and several failed at once share one rollback).
    pub(crate) steps_rolled_back: u64,
    /// Why the run cannot go on (a crash loop); ends it with this error.
    pub(crate) fatal: Option<String>,
    /// When the recovery waiting for a slot's process last said so (see
    /// `control::say_who_is_awaited`).
    pub(crate) awaited_said: Option<Instant>,
}

/// What a failed recovery attempt leads to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum AttemptFailed {
    /// Tried again after `RECOVERY_RETRY`; `say`: this failure is to be reported (the
    /// first and every tenth, not each of a loop).
    Retry { say: bool },
    /// Failed too often in a row: the cause does not pass (a missing cut, a shard of
    /// another server), and the run ends with it.
    GiveUp { failures: u32 },
}

impl Recoveries {
    /// Server `id` was declared dead at `t` (the timeline's clock): it waits for its
    /// replacement, its background rebuild (if any) died with it, and the suspicion that
    /// led here is confirmed.
    pub(crate) fn server_lost(&mut self, id: usize, t: f64) {
        self.rebuilding.retain(|&(r, _)| r != id);
        self.failed.push((id, t));
        self.suspect_until = None;
    }

    /// A recovery waits for its retry time.
    pub(crate) fn backing_off(&self, now: Instant) -> bool {
        self.recover_after.is_some_and(|t| now < t)
    }

    /// A recovery cannot go on now (etcd did not record its epoch): tried again shortly,
    /// without counting as a failure.
    pub(crate) fn retry_soon(&mut self, now: Instant) {
        self.recover_after = Some(now + RECOVERY_RETRY);
    }

    /// Counts a failed recovery attempt at `now`.
    pub(crate) fn attempt_failed(&mut self, now: Instant) -> AttemptFailed {
        self.recovery_failures += 1;
        if self.recovery_failures >= MAX_RECOVERY_FAILURES {
            return AttemptFailed::GiveUp {
                failures: self.recovery_failures,
            };
        }
        self.recover_after = Some(now + RECOVERY_RETRY);
        AttemptFailed::Retry {
            say: self.recovery_failures % 10 == 1,
        }
    }

    /// A recovery went through: the next failure starts a fresh count.
    pub(crate) fn attempt_succeeded(&mut self) {
        self.recovery_failures = 0;
        self.recover_after = None;
    }

    /// Grants wait: a lost step made a member suspect, and the detector has not decided.
    pub(crate) fn suspecting(&self, now: Instant) -> bool {
        self.suspect_until.is_some_and(|t| now < t)
    }

    /// The earliest detection among the slots waiting for this recovery.
    pub(crate) fn first_detected(&self) -> Option<f64> {
        let t = self
            .failed
            .iter()
            .map(|&(_, t)| t)
            .fold(f64::INFINITY, f64::min);
        t.is_finite().then_some(t)
    }

    /// `server`'s background rebuild begun in `epoch` ended. False when it was no longer
    /// followed (superseded by a rollback, or the server died).
    pub(crate) fn rebuild_ended(&mut self, server: usize, epoch: u64) -> bool {
        let before = self.rebuilding.len();
        self.rebuilding
            .retain(|&(r, e)| !(r == server && e == epoch));
        self.rebuilding.len() != before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_recovery_backs_off_says_every_tenth_and_gives_up_at_the_bound() {
        let mut r = Recoveries::default();
        let now = Instant::now();
        let mut said = Vec::new();
        for n in 1..MAX_RECOVERY_FAILURES {
            match r.attempt_failed(now) {
                AttemptFailed::Retry { say } => said.push(say.then_some(n)),
                AttemptFailed::GiveUp { .. } => panic!("gave up after {n}"),
            }
            assert!(r.backing_off(now));
            assert!(!r.backing_off(now + RECOVERY_RETRY));
        }
        let said: Vec<u32> = said.into_iter().flatten().collect();
        assert_eq!(said, vec![1, 11, 21, 31, 41]);
        assert_eq!(
            r.attempt_failed(now),
            AttemptFailed::GiveUp {
                failures: MAX_RECOVERY_FAILURES
            }
        );
    }

    #[test]
    fn a_recovery_that_succeeds_starts_the_count_over() {
        let mut r = Recoveries::default();
        let now = Instant::now();
        for _ in 0..(MAX_RECOVERY_FAILURES - 1) {
            r.attempt_failed(now);
        }
        r.attempt_succeeded();
        assert!(!r.backing_off(now));
        assert_eq!(r.attempt_failed(now), AttemptFailed::Retry { say: true });
    }

    #[test]
    fn a_lost_server_ends_its_rebuild_and_the_suspicion() {
        let mut r = Recoveries::default();
        let now = Instant::now();
        r.rebuilding = vec![(1, 4), (2, 4)];
        r.suspect_until = Some(now + Duration::from_secs(5));
        assert!(r.suspecting(now));
        r.server_lost(1, 3.5);
        assert_eq!(r.rebuilding, vec![(2, 4)]);
        assert!(!r.suspecting(now));
        r.server_lost(0, 2.0);
        assert_eq!(r.first_detected(), Some(2.0));
        // Only the rebuild of that server in that epoch ends.
        assert!(!r.rebuild_ended(2, 5));
        assert!(r.rebuild_ended(2, 4));
        assert!(r.rebuilding.is_empty());
        assert_eq!(Recoveries::default().first_detected(), None);
    }
}
