//! etcd membership's view of this coordinator's leadership: whether it learned it was
//! deposed, and the takeovers over the job's life (this one's included), whose failover
//! time is measured up to the first step settled under the new leader.

use crate::summary::Failover;

#[derive(Default)]
pub(crate) struct LeaderState {
    /// This coordinator learned it no longer leads.
    pub(crate) deposed: bool,
    /// Takeovers by standbys over the job's life; the last one's time is filled in when
    /// its first step settles (`failover_since_unix`: the old leader's last write).
    pub(crate) failovers: Vec<Failover>,
    pub(crate) failover_since_unix: Option<f64>,
    /// Seconds trained under earlier leaders, failovers included.
    pub(crate) train_seconds_before: f64,
    /// Every member went silent with etcd: said on the timeline once (per silence).
    pub(crate) isolated_said: bool,
}

impl LeaderState {
    /// Marks this coordinator deposed. False when it already was (said once).
    pub(crate) fn depose(&mut self) -> bool {
        !std::mem::replace(&mut self.deposed, true)
    }

    /// This coordinator took over from another whose last write to etcd was at
    /// `since_unix`: the takeover's time runs until its first step settles.
    pub(crate) fn took_over(&mut self, failover: Failover, since_unix: f64) {
        self.failovers.push(failover);
        self.failover_since_unix = Some(since_unix);
    }

    /// A step settled (`now_unix` reads the clock, only when needed): the first after a
    /// takeover completes the takeover's record. Returns what to say on the timeline then.
    pub(crate) fn step_settled(&mut self, now_unix: impl FnOnce() -> f64) -> Option<String> {
        let since = self.failover_since_unix.take()?;
        let f = self.failovers.last_mut()?;
        let now_unix = now_unix();
        f.failover_seconds = (now_unix - since).max(0.0);
        f.first_step_at_unix = Some(now_unix);
        Some(format!(
            "first step settled under {} {:.3} s after {}'s last write to etcd",
            f.to, f.failover_seconds, f.from
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failover(to: &str) -> Failover {
        Failover {
            from: "a".into(),
            to: to.into(),
            failover_seconds: 0.0,
            term: 2,
            first_step_at_unix: None,
        }
    }

    #[test]
    fn only_the_first_step_after_a_takeover_times_it() {
        let mut l = LeaderState::default();
        assert_eq!(l.step_settled(|| 100.0), None);
        l.failovers.push(failover("b"));
        l.took_over(failover("c"), 90.0);
        assert!(
            l.step_settled(|| 92.5)
                .is_some_and(|t| t.contains("under c 2.500 s"))
        );
        // The earlier takeover keeps its own figures; a later step changes nothing.
        assert_eq!(l.failovers[0].first_step_at_unix, None);
        assert_eq!(l.failovers[1].first_step_at_unix, Some(92.5));
        assert_eq!(l.step_settled(|| 200.0), None);
        assert_eq!(l.failovers[1].failover_seconds, 2.5);
    }

    #[test]
    fn a_clock_behind_the_old_leaders_counts_no_negative_failover() {
        let mut l = LeaderState::default();
        l.took_over(failover("b"), 100.0);
        l.step_settled(|| 99.0);
        assert_eq!(l.failovers[0].failover_seconds, 0.0);
    }

    #[test]
    fn deposed_is_said_once() {
        let mut l = LeaderState::default();
        assert!(l.depose());
        assert!(!l.depose());
        assert!(l.deposed);
    }
}
