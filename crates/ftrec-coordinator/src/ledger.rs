//! Where every step of the schedule stands, so that no step is lost and none is applied
//! twice.
//!
//! A step is *fresh* (not granted yet), *outstanding* (granted to a worker in an epoch),
//! an *orphan* (its worker died or lost it, and nobody knows yet which servers applied its
//! push), *to regrant* (known to be safe to hand out again), or settled. Orphans are
//! resolved by asking every server whether it applied the step ([`Applied`]): everywhere
//! settles it; nowhere makes it a regrant; partly is repaired by a regrant (servers ignore
//! a push of a step they already applied) or, where that would not be exact, by rolling
//! back to the last cut.

use std::collections::BTreeMap;

/// A granted step's holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub worker: usize,
    pub epoch: u64,
}

/// How many servers applied an orphan step's push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    Everywhere,
    Nowhere,
    Partly,
}

/// What resolving an orphan decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// Every server applied it: the step is done.
    Settled,
    /// It goes to the next worker that asks.
    Regranted,
    /// Some servers applied it and a regrant would not be exact: roll back to the cut.
    NeedsRollback,
    /// It was no orphan (settled meanwhile, or rolled back).
    Unknown,
}

#[derive(Debug, Default)]
pub struct StepLedger {
    total: u64,
    next: u64,
    outstanding: BTreeMap<u64, Grant>,
    /// Orphans and steps to regrant, each with the epoch it was last granted in: only a
    /// report of that epoch may settle it (an older one describes pushes the epoch fence
    /// threw away).
    orphans: BTreeMap<u64, u64>,
    regrant: BTreeMap<u64, u64>,
    /// The worker each lost step was granted to (it reported the step lost, or a
    /// recovery orphaned it): if its push failed after it computed the step, that worker
    /// keeps the step's gradients, computed from the state the step still applies to,
    /// since nothing was rolled back since (a rewind forgets them all).
    lost_by: BTreeMap<u64, usize>,
}

/// A step taken from the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Taken {
    pub step: u64,
    /// The asking worker lost this step itself: it may push the gradients it kept.
    pub own_loss: bool,
}

impl StepLedger {
    pub fn new(total: u64) -> Self {
        Self {
            total,
            ..Self::default()
        }
    }

    /// The first step never granted.
    pub fn next_step(&self) -> u64 {
        self.next
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    /// A step for `worker`: a regrant first (they hold the cut and, in deterministic mode,
    /// every later step back), then a fresh one when `fresh` allows it. A worker asks only
    /// once done with its step, so a step it still holds here is one whose grant never
    /// reached it (a lost reply): that step becomes an orphan.
    pub fn take(&mut self, worker: usize, epoch: u64, fresh: bool) -> Option<u64> {
        self.take_preferring(worker, epoch, fresh, false)
            .map(|t| t.step)
    }

    /// [`StepLedger::take`]; `own_first`: a regrant this worker lost itself before the
    /// others (asynchronous workers: a deterministic run needs its lowest step first, or a
    /// later one's pull waits for it).
    pub fn take_preferring(
        &mut self,
        worker: usize,
        epoch: u64,
        fresh: bool,
        own_first: bool,
    ) -> Option<Taken> {
        self.worker_died(worker);
        let own = own_first
            .then(|| {
                self.regrant
                    .keys()
                    .copied()
                    .find(|s| self.lost_by.get(s) == Some(&worker))
            })
            .flatten();
        let step = match own {
            Some(step) => {
                self.regrant.remove(&step);
                step
            }
            None => match self.regrant.pop_first() {
                Some((step, _)) => step,
                None if fresh && self.next < self.total => {
                    self.next += 1;
                    self.next - 1
                }
                None => return None,
            },
        };
        let own_loss = self.lost_by.remove(&step) == Some(worker);
        self.outstanding.insert(step, Grant { worker, epoch });
        Some(Taken { step, own_loss })
    }

    /// `worker` reports `step` (granted in `epoch`) pushed to every server. True when that
    /// settles a step, so the caller counts its samples once. A late report of a step that
    /// became an orphan or a regrant in the same epoch settles it too: the push reached
    /// every server.
    pub fn finish(&mut self, step: u64, worker: usize, epoch: u64) -> bool {
        if self.outstanding.get(&step) == Some(&Grant { worker, epoch }) {
            self.outstanding.remove(&step);
            return true;
        }
        for pending in [&mut self.orphans, &mut self.regrant] {
            if pending.get(&step) == Some(&epoch) {
                pending.remove(&step);
                self.lost_by.remove(&step);
                return true;
            }
        }
        false
    }

    /// `worker` lost `step` (a server refused or failed its push): it becomes an orphan.
    /// False for a report that does not match the current grant (an older epoch's).
    pub fn lose(&mut self, step: u64, worker: usize, epoch: u64) -> bool {
        if self.outstanding.get(&step) != Some(&Grant { worker, epoch }) {
            return false;
        }
        self.outstanding.remove(&step);
        self.orphans.insert(step, epoch);
        self.lost_by.insert(step, worker);
        true
    }

    /// A dead worker's steps (or those of a worker that never got their grant) become
    /// orphans; returns how many.
    pub fn worker_died(&mut self, worker: usize) -> usize {
        let held: Vec<(u64, u64)> = self
            .outstanding
            .iter()
            .filter(|(_, g)| g.worker == worker)
            .map(|(s, g)| (*s, g.epoch))
            .collect();
        for (step, epoch) in &held {
            self.outstanding.remove(step);
            self.orphans.insert(*step, *epoch);
        }
        held.len()
    }

    /// Every outstanding step becomes an orphan (a server died and the run keeps its state).
    pub fn orphan_outstanding(&mut self) {
        let all = std::mem::take(&mut self.outstanding);
        for (step, g) in all {
            self.orphans.insert(step, g.epoch);
            // Its worker's loss report comes after this (the failure was declared on
            // another's): it may hold the step's gradients all the same.
            self.lost_by.insert(step, g.worker);
        }
    }

    /// Whether an orphan not resolved yet was granted to `worker`: it may hold the
    /// step's gradients, which its regrant would push again.
    pub fn holds_unresolved(&self, worker: usize) -> bool {
        self.orphans
            .keys()
            .any(|s| self.lost_by.get(s) == Some(&worker))
    }

    pub fn has_orphans(&self) -> bool {
        !self.orphans.is_empty()
    }

    pub fn orphans(&self) -> Vec<u64> {
        self.orphans.keys().copied().collect()
    }

    /// Decides an orphan's fate from what the servers say. `partial_regrant`: a partly
    /// applied step may be granted again (the run does not promise bit-exactness after a
    /// failure), rather than rolled back.
    pub fn resolve(&mut self, step: u64, applied: Applied, partial_regrant: bool) -> Resolution {
        let Some(&epoch) = self.orphans.get(&step) else {
            return Resolution::Unknown;
        };
        match applied {
            Applied::Everywhere => {
                self.orphans.remove(&step);
                self.lost_by.remove(&step);
                Resolution::Settled
            }
            Applied::Partly if !partial_regrant => Resolution::NeedsRollback,
            Applied::Nowhere | Applied::Partly => {
                self.orphans.remove(&step);
                self.regrant.insert(step, epoch);
                Resolution::Regranted
            }
        }
    }

    /// Forgets the steps in flight: a rollback will train them again, so their late reports
    /// must count nothing.
    pub fn forget_outstanding(&mut self) {
        self.outstanding.clear();
        self.lost_by.clear();
    }

    /// A rollback to the cut at `step`: everything from there is trained again.
    pub fn rewind(&mut self, step: u64) {
        self.outstanding.clear();
        self.orphans.clear();
        self.regrant.clear();
        self.lost_by.clear();
        self.next = step;
    }

    /// No step is in flight or unresolved: every step below `next_step` is applied on
    /// every server, which is what a cut needs.
    pub fn quiet(&self) -> bool {
        self.outstanding.is_empty() && self.orphans.is_empty() && self.regrant.is_empty()
    }

    pub fn done(&self) -> bool {
        self.next >= self.total && self.quiet()
    }

    /// The first step not known to be applied everywhere: every step below it is.
    pub fn settled_through(&self) -> u64 {
        [
            self.outstanding.keys().next(),
            self.orphans.keys().next(),
            self.regrant.keys().next(),
        ]
        .into_iter()
        .flatten()
        .copied()
        .fold(self.next, u64::min)
    }

    /// The settled steps at or above `from` (asynchronous workers settle out of order).
    pub fn settled_from(&self, from: u64) -> Vec<u64> {
        (from..self.next)
            .filter(|s| {
                !self.outstanding.contains_key(s)
                    && !self.orphans.contains_key(s)
                    && !self.regrant.contains_key(s)
            })
            .collect()
    }

    /// A new leader's ledger (etcd membership): every step below `from` settled, the
    /// steps in `from..end` orphans of `epoch` (which servers applied them is asked, as
    /// for a dead worker's), and none granted from `end` on.
    pub fn taken_over(total: u64, from: u64, end: u64, epoch: u64) -> Self {
        Self {
            total,
            next: end.max(from),
            orphans: (from..end).map(|s| (s, epoch)).collect(),
            ..Self::default()
        }
    }

    /// The steps granted but not known to be applied everywhere.
    pub fn unsettled(&self) -> Vec<u64> {
        let mut all: Vec<u64> = self
            .outstanding
            .keys()
            .chain(self.orphans.keys())
            .chain(self.regrant.keys())
            .copied()
            .collect();
        all.sort_unstable();
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_dead_workers_step_is_granted_again_before_fresh_ones() {
        let mut l = StepLedger::new(10);
        assert_eq!(l.take(0, 1, true), Some(0));
        assert_eq!(l.take(1, 1, true), Some(1));
        assert_eq!(l.worker_died(0), 1);
        assert!(!l.quiet());
        assert_eq!(l.unsettled(), vec![0, 1]);
        assert_eq!(l.resolve(0, Applied::Nowhere, false), Resolution::Regranted);
        // Even while a cut is pending (no fresh steps), the regrant goes out.
        assert_eq!(l.take(1, 1, false), Some(0));
        assert_eq!(l.take(1, 1, false), None);
        assert!(l.finish(0, 1, 1));
        assert!(l.finish(1, 1, 1));
        assert!(l.quiet());
        assert!(l.unsettled().is_empty());
        assert_eq!(l.next_step(), 2);
    }

    /// After a server's loss both workers' steps are orphaned, and each goes back to the
    /// worker it was granted to (which may hold its gradients), lowest first only where
    /// asked; a rollback forgets who held what.
    #[test]
    fn a_lost_step_goes_back_to_its_own_worker_unless_rolled_back() {
        let mut l = StepLedger::new(10);
        assert_eq!(l.take(0, 1, true), Some(0));
        assert_eq!(l.take(1, 1, true), Some(1));
        l.orphan_outstanding();
        assert!(l.holds_unresolved(0) && l.holds_unresolved(1));
        assert!(
            !l.lose(1, 1, 1),
            "the report after the recovery matches no grant"
        );
        for step in [0, 1] {
            assert_eq!(
                l.resolve(step, Applied::Nowhere, false),
                Resolution::Regranted
            );
        }
        assert!(!l.holds_unresolved(1));
        let own = |step| {
            Some(Taken {
                step,
                own_loss: true,
            })
        };
        assert_eq!(l.take_preferring(1, 2, true, true), own(1));
        assert_eq!(l.take_preferring(0, 2, true, true), own(0));
        // In step order (deterministic workers), worker 1 takes step 0: not its own.
        let mut l = StepLedger::new(10);
        l.take(0, 1, true);
        l.take(1, 1, true);
        assert!(l.lose(0, 0, 1) && l.lose(1, 1, 1));
        for step in [0, 1] {
            l.resolve(step, Applied::Nowhere, false);
        }
        let taken = l.take_preferring(1, 2, true, false);
        assert_eq!(
            taken,
            Some(Taken {
                step: 0,
                own_loss: false
            })
        );
        // A rewind: the steps are trained again from the cut, none from kept gradients.
        l.rewind(0);
        assert_eq!(
            l.take_preferring(1, 3, true, true),
            Some(Taken {
                step: 0,
                own_loss: false
            })
        );
        assert_eq!(
            l.take_preferring(0, 3, true, true),
            Some(Taken {
                step: 1,
                own_loss: false
            })
        );
    }

    #[test]
    fn a_grant_whose_reply_was_lost_is_orphaned_when_the_worker_asks_again() {
        let mut l = StepLedger::new(10);
        assert_eq!(l.take(0, 1, true), Some(0));
        // The reply never reached worker 0; it asks again with nothing to report.
        assert_eq!(l.take(0, 1, true), Some(1));
        assert_eq!(l.orphans(), vec![0]);
    }

    #[test]
    fn stale_reports_do_not_touch_a_newer_grant() {
        let mut l = StepLedger::new(10);
        l.take(0, 1, true);
        l.rewind(0);
        assert_eq!(l.take(1, 2, true), Some(0));
        // Worker 0's report of epoch 1 arrives after the rollback.
        assert!(!l.lose(0, 0, 1));
        assert!(!l.finish(0, 0, 1));
        assert!(!l.quiet());
        assert!(l.finish(0, 1, 2));
    }

    #[test]
    fn partly_applied_steps_roll_back_unless_regrants_are_allowed() {
        let mut l = StepLedger::new(10);
        l.take(0, 1, true);
        assert!(l.lose(0, 0, 1));
        assert_eq!(
            l.resolve(0, Applied::Partly, false),
            Resolution::NeedsRollback
        );
        assert_eq!(l.orphans(), vec![0]);
        assert_eq!(l.resolve(0, Applied::Partly, true), Resolution::Regranted);
        assert_eq!(l.resolve(0, Applied::Everywhere, true), Resolution::Unknown);
    }

    #[test]
    fn a_report_from_an_older_epoch_never_settles_a_newer_orphan() {
        let mut l = StepLedger::new(5);
        l.take(0, 1, true);
        l.rewind(0);
        assert_eq!(l.take(1, 2, true), Some(0));
        l.worker_died(1);
        // Worker 0's epoch-1 push was fenced off; its late report must not count.
        assert!(!l.finish(0, 0, 1));
        assert_eq!(l.orphans(), vec![0]);
        assert!(l.finish(0, 1, 2));
    }

    #[test]
    fn a_late_finish_settles_an_orphan_once() {
        let mut l = StepLedger::new(3);
        l.take(0, 1, true);
        l.worker_died(0);
        assert!(l.finish(0, 0, 1));
        assert!(!l.finish(0, 0, 1));
        assert_eq!(
            l.resolve(0, Applied::Everywhere, false),
            Resolution::Unknown
        );
    }

    proptest! {
        /// Whatever workers die and whatever the servers answer, every step is settled
        /// exactly once (or rolled back and trained again), and the run ends.
        #[test]
        fn every_step_is_settled_exactly_once(
            events in prop::collection::vec((0usize..3, 0u8..4, 0u8..3), 1..200)
        ) {
            let total = 25;
            let mut l = StepLedger::new(total);
            let mut settled = vec![0u32; total as usize];
            let epoch = 1;
            for (worker, what, answer) in events {
                match what {
                    0 | 1 => {
                        if let Some(step) = l.take(worker, epoch, true)
                            && what == 0 && l.finish(step, worker, epoch)
                        {
                            settled[step as usize] += 1;
                        }
                    }
                    2 => { l.worker_died(worker); }
                    _ => {
                        for step in l.orphans() {
                            let applied = [Applied::Everywhere, Applied::Nowhere, Applied::Partly]
                                [answer as usize];
                            if l.resolve(step, applied, true) == Resolution::Settled {
                                settled[step as usize] += 1;
                            }
                        }
                    }
                }
            }
            // Drain: one healthy worker finishes everything.
            for step in l.orphans() {
                l.resolve(step, Applied::Nowhere, true);
            }
            let held: Vec<u64> = l.outstanding.keys().copied().collect();
            for step in held {
                let g = l.outstanding[&step];
                prop_assert!(l.finish(step, g.worker, g.epoch));
                settled[step as usize] += 1;
            }
            while let Some(step) = l.take(0, epoch, true) {
                prop_assert!(l.finish(step, 0, epoch));
                settled[step as usize] += 1;
            }
            prop_assert!(l.done());
            prop_assert!(settled.iter().all(|&n| n == 1), "{settled:?}");
        }
    }
}
