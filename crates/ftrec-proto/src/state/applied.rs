//! Which global steps a server has applied, so that a push of a step applied already (a
//! dead worker's step granted again) is ignored rather than applied twice, and so the
//! coordinator can ask which of a dead worker's steps reached this server.

use std::collections::BTreeSet;

/// Every step below `low`, plus the steps in `above`. Asynchronous workers push out of
/// order, so `above` holds the few steps applied ahead of a gap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AppliedSteps {
    low: u64,
    above: BTreeSet<u64>,
}

impl AppliedSteps {
    /// Every step below `low` applied, none after (a restored cut, or a fresh start).
    pub fn up_to(low: u64) -> Self {
        Self {
            low,
            above: BTreeSet::new(),
        }
    }

    /// Every step below `low`, and `ahead` (another server's record, as sent on the wire).
    pub fn from_parts(low: u64, ahead: impl IntoIterator<Item = u64>) -> Self {
        let mut steps = Self::up_to(low);
        for step in ahead {
            steps.insert(step);
        }
        steps
    }

    /// The steps applied above [`AppliedSteps::low`].
    pub fn ahead(&self) -> impl Iterator<Item = u64> + '_ {
        self.above.iter().copied()
    }

    /// The first step not applied: every step below it is.
    pub fn low(&self) -> u64 {
        self.low
    }

    /// One past the newest step applied (`low` when none is applied above it).
    pub fn end(&self) -> u64 {
        self.above.last().map_or(self.low, |&s| s + 1)
    }

    /// How many steps are applied.
    pub fn count(&self) -> u64 {
        self.low + self.above.len() as u64
    }

    pub fn contains(&self, step: u64) -> bool {
        step < self.low || self.above.contains(&step)
    }

    /// Records `step`; false when it was applied already.
    pub fn insert(&mut self, step: u64) -> bool {
        if self.contains(step) {
            return false;
        }
        self.above.insert(step);
        while self.above.remove(&self.low) {
            self.low += 1;
        }
        true
    }

    /// Counts every step below `floor` as applied (never forgets one).
    pub fn raise_floor(&mut self, floor: u64) {
        if floor > self.low {
            self.low = floor;
            self.above = self.above.split_off(&floor);
        }
        while self.above.remove(&self.low) {
            self.low += 1;
        }
    }

    /// Counts every step below `end` as applied, except `unsettled` (which keep their
    /// state): what every surviving server holds after a failure without rollback.
    pub fn settle_below(&mut self, end: u64, unsettled: &[u64]) {
        let first_gap = unsettled
            .iter()
            .copied()
            .filter(|&s| s < end)
            .min()
            .unwrap_or(end);
        self.raise_floor(first_gap);
        for step in first_gap..end {
            if !unsettled.contains(&step) {
                self.insert(step);
            }
        }
    }

    /// Exactly the steps below `step` are applied: the state of a cut at `step`.
    pub fn is_cut_at(&self, step: u64) -> bool {
        self.low == step && self.above.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn out_of_order_steps_close_the_gap() {
        let mut a = AppliedSteps::up_to(3);
        assert!(a.insert(5));
        assert!(!a.is_cut_at(3));
        assert!(a.insert(3));
        assert_eq!(a.low(), 4);
        assert!(!a.insert(5), "a second push of step 5 is refused");
        assert!(a.insert(4));
        assert!(a.is_cut_at(6));
        assert_eq!(a.count(), 6);
        a.raise_floor(4);
        assert!(a.is_cut_at(6), "a lower floor changes nothing");
        a.raise_floor(9);
        assert!(a.is_cut_at(9));
    }

    #[test]
    fn settling_below_skips_the_unsettled_steps() {
        let mut fresh = AppliedSteps::default();
        fresh.settle_below(10, &[4, 7]);
        assert_eq!(fresh.low(), 4);
        assert!(!fresh.contains(4) && !fresh.contains(7) && fresh.contains(5) && fresh.contains(9));
        assert!(!fresh.contains(10));
        assert_eq!(fresh.count(), 8);
    }

    proptest! {
        /// The record equals the plain set of steps inserted, however they arrive.
        #[test]
        fn matches_a_plain_set(steps in prop::collection::vec(0u64..40, 0..120), floor in 0u64..30) {
            let mut a = AppliedSteps::default();
            let mut model = BTreeSet::new();
            for &s in &steps {
                prop_assert_eq!(a.insert(s), model.insert(s));
            }
            for s in 0..45 {
                prop_assert_eq!(a.contains(s), model.contains(&s));
            }
            prop_assert_eq!(a.count(), model.len() as u64);
            a.raise_floor(floor);
            model.extend(0..floor);
            for s in 0..45 {
                prop_assert_eq!(a.contains(s), model.contains(&s));
            }
            let low = (0..).find(|s| !model.contains(s)).unwrap();
            prop_assert_eq!(a.low(), low);
        }
    }
}
