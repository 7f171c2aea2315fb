//! The saves made: the newest consistent cut (the rollback target) and the newest save of
//! any kind, every save for the report, the cuts kept on disk, a cut copied by every
//! server but still committing in the background (with its confirmation timers), and
//! whether pruning old cuts fails.

use std::time::Duration;

use tokio::time::Instant;

use crate::summary::CheckpointRecord;

/// How often to ask whether a cut committing in the background is done.
const CONFIRM_RETRY: Duration = Duration::from_millis(50);

#[derive(Default)]
pub(crate) struct Saves {
    /// The newest committed consistent cut: where a rollback goes.
    pub(crate) last_checkpoint: Option<u64>,
    /// The newest committed checkpoint of any kind (a cut or a CPR prioritised save), or
    /// the step at which own saves were last asked for: no save is due twice at a step.
    pub(crate) last_save: Option<u64>,
    /// Every save over the run, for the report.
    pub(crate) checkpoints: Vec<CheckpointRecord>,
    /// The committed cuts still on disk, oldest first (`checkpoint.keep` of them at most).
    pub(crate) retained_cuts: Vec<CheckpointRecord>,
    /// A cut every server has copied, committing in the background (DECK, IncrCP): it
    /// becomes the rollback target once every server confirms. No new cut starts before.
    pending_cut: Option<CheckpointRecord>,
    /// When the pending cut was copied: one that does not commit within the RPC timeout
    /// fails.
    pending_since: Option<Instant>,
    /// The servers are not asked about the pending cut again before this.
    confirm_after: Option<Instant>,
    /// The last prune failed (said once, until one succeeds).
    prune_failing: bool,
}

impl Saves {
    /// Counts a committed save: a consistent cut becomes the rollback target. Returns the
    /// cuts to keep when `keep` (0: all) leaves older ones to delete.
    pub(crate) fn commit(
        &mut self,
        record: CheckpointRecord,
        keep: usize,
    ) -> Option<Vec<CheckpointRecord>> {
        self.last_save = Some(record.step);
        // A prioritised save is not a consistent state: a partial restore reloads it, a
        // rollback never goes to it.
        if !record.priority {
            self.last_checkpoint = Some(record.step);
        }
        self.checkpoints.push(record.clone());
        self.retained_cuts.push(record);
        let excess = self.retained_cuts.len().saturating_sub(keep);
        (keep > 0 && excess > 0).then(|| {
            self.retained_cuts.drain(..excess);
            self.retained_cuts.clone()
        })
    }

    /// Every server copied the cut of `record` at `now`; it commits in the background.
    pub(crate) fn copied(&mut self, record: CheckpointRecord, now: Instant) {
        self.pending_cut = Some(record);
        self.pending_since = Some(now);
    }

    /// A cut still committing in the background.
    pub(crate) fn pending(&self) -> Option<&CheckpointRecord> {
        self.pending_cut.as_ref()
    }

    /// The pending cut's step when its servers are to be asked about it at `now`; the
    /// next question waits for [`Saves::confirm_later`].
    pub(crate) fn confirmation_due(&mut self, now: Instant) -> Option<u64> {
        let step = self.pending_cut.as_ref()?.step;
        if self.confirm_after.is_some_and(|t| now < t) {
            return None;
        }
        self.confirm_after = None;
        Some(step)
    }

    /// Some server has not committed the pending cut yet: asked again shortly.
    pub(crate) fn confirm_later(&mut self, now: Instant) {
        self.confirm_after = Some(now + CONFIRM_RETRY);
    }

    /// The pending cut was copied longer than `limit` ago.
    pub(crate) fn pending_overdue(&self, limit: Duration) -> bool {
        self.pending_since.is_some_and(|t| t.elapsed() > limit)
    }

    /// Ends the pending cut (committed, failed or dropped).
    pub(crate) fn take_pending(&mut self) -> Option<CheckpointRecord> {
        self.pending_cut.take()
    }

    /// How a prune went. True when its failure is to be said: the first in a row only.
    pub(crate) fn pruned(&mut self, ok: bool) -> bool {
        !std::mem::replace(&mut self.prune_failing, !ok) && !ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(step: u64, priority: bool) -> CheckpointRecord {
        CheckpointRecord {
            step,
            started_at: 0.0,
            pause_seconds: 0.0,
            bytes: 1,
            ids: Vec::new(),
            priority,
        }
    }

    fn steps(v: &[CheckpointRecord]) -> Vec<u64> {
        v.iter().map(|r| r.step).collect()
    }

    #[test]
    fn committing_keeps_the_newest_cuts_and_only_a_consistent_one_is_a_target() {
        let mut s = Saves::default();
        assert!(s.commit(record(10, false), 2).is_none());
        assert!(s.commit(record(15, true), 2).is_none());
        assert_eq!((s.last_checkpoint, s.last_save), (Some(10), Some(15)));
        // The third goes past `keep`: the two newest are kept, the oldest deleted.
        let kept = s.commit(record(20, false), 2);
        assert_eq!(kept.as_deref().map(steps), Some(vec![15, 20]));
        assert_eq!(steps(&s.retained_cuts), vec![15, 20]);
        assert_eq!(steps(&s.checkpoints), vec![10, 15, 20]);
        assert_eq!(s.last_checkpoint, Some(20));
        // keep = 0 keeps every cut.
        let mut all = Saves::default();
        for step in 0..5 {
            assert!(all.commit(record(step, false), 0).is_none());
        }
        assert_eq!(all.retained_cuts.len(), 5);
    }

    #[test]
    fn a_pending_cut_is_asked_about_once_per_retry_period() {
        let mut s = Saves::default();
        let now = Instant::now();
        assert_eq!(s.confirmation_due(now), None);
        s.copied(record(30, false), now);
        assert_eq!(s.confirmation_due(now), Some(30));
        s.confirm_later(now);
        assert_eq!(s.confirmation_due(now), None);
        assert_eq!(s.confirmation_due(now + CONFIRM_RETRY), Some(30));
        assert!(!s.pending_overdue(Duration::from_secs(60)));
        assert_eq!(s.take_pending().map(|r| r.step), Some(30));
        assert_eq!(s.confirmation_due(now + CONFIRM_RETRY), None);
    }

    #[test]
    fn a_failing_prune_is_said_once_until_one_succeeds() {
        let mut s = Saves::default();
        assert!(s.pruned(false));
        assert!(!s.pruned(false));
        assert!(!s.pruned(true));
        assert!(s.pruned(false));
    }
}
