//! The job's layout over its life: how many servers it runs on now, the cut those
//! servers' shards came from (a resumed job's, or the cut a move went through), and a
//! move to another server count (`ftrec cluster scale`) from the moment it is asked for
//! until the new servers train.
//!
//! A move goes through a consistent cut, so it is atomic by construction: until that cut
//! commits the job is on its old layout (a failure meanwhile is recovered there, and the
//! move waits for the next step boundary); once it commits, the coordinator switches to the
//! new layout in one decision under its lock, and every new server loads its rows from that
//! cut, as a resumed job's servers do. No server ever mixes the two layouts.

use serde::{Deserialize, Serialize};

use ftrec_proto::proto::ResumePoint;

/// A move asked for and not yet switched to.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PendingMove {
    pub(crate) to: usize,
    /// On the timeline's clock.
    pub(crate) asked_at: f64,
    /// The cut the move goes through, once it is taken: no fresh step is granted from then
    /// until the switch (the new layout starts at exactly that step).
    pub(crate) cut: Option<u64>,
    /// That cut committed: the switch is due.
    pub(crate) committed: bool,
}

/// A move done, for the report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoveRecord {
    pub from_servers: usize,
    pub to_servers: usize,
    /// The cut the move went through: the new layout's first step.
    pub step: u64,
    /// On the timeline's clock: asked for, switched (the cut committed), training again.
    pub asked_at: f64,
    pub switched_at: f64,
    pub resumed_at: Option<f64>,
    /// From the last step granted on the old layout to the first on the new one: the cut,
    /// the new servers' start and their loads.
    pub pause_seconds: Option<f64>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Scaling {
    /// The servers the job runs on now.
    pub(crate) servers: usize,
    /// The cut the current servers' shards came from: their initial state (a rollback
    /// before their first cut of their own goes back to it) and the job's first step.
    pub(crate) base: Option<ResumePoint>,
    /// The cut the job resumed from when it started, for the report.
    pub(crate) resumed_from: Option<ResumePoint>,
    pub(crate) pending: Option<PendingMove>,
    /// The new layout's servers are joining after a switch: a join takes a fresh slot of
    /// the new layout, not a failed one.
    pub(crate) joining: bool,
    /// When the cut of the pending move paused granting (on the timeline's clock).
    pub(crate) paused_at: Option<f64>,
    pub(crate) moves: Vec<MoveRecord>,
    /// Moves asked for ahead, each once step `.0` is reached (`cluster run --scale-at`).
    pub(crate) scheduled: Vec<(u64, usize)>,
}

impl Scaling {
    pub(crate) fn new(servers: usize, resumed_from: Option<ResumePoint>) -> Self {
        Self {
            servers,
            base: resumed_from.clone(),
            resumed_from,
            ..Self::default()
        }
    }

    /// The first step the current servers trained: every step below is in their initial
    /// state.
    pub(crate) fn first_step(&self) -> u64 {
        self.base.as_ref().map_or(0, |b| b.step)
    }

    /// The earliest scheduled move due at `next`, taken off the schedule.
    pub(crate) fn scheduled_due(&mut self, next: u64) -> Option<usize> {
        let i = (0..self.scheduled.len())
            .filter(|&i| self.scheduled[i].0 <= next)
            .min_by_key(|&i| self.scheduled[i].0)?;
        Some(self.scheduled.remove(i).1)
    }

    /// A pending move has taken its cut: fresh steps wait for the switch.
    pub(crate) fn holds_steps(&self) -> bool {
        self.pending.as_ref().is_some_and(|m| m.cut.is_some())
    }

    /// The pending move's cut (at `step`) failed or was abandoned: it is taken again at a
    /// later boundary.
    pub(crate) fn cut_lost(&mut self, step: u64) {
        if let Some(m) = self.pending.as_mut().filter(|m| m.cut == Some(step)) {
            m.cut = None;
            self.paused_at = None;
        }
    }

    /// The cut of `step` committed: true when it is the pending move's, whose switch is
    /// then due.
    pub(crate) fn cut_committed(&mut self, step: u64) -> bool {
        match self.pending.as_mut().filter(|m| m.cut == Some(step)) {
            Some(m) => {
                m.committed = true;
                true
            }
            None => false,
        }
    }

    /// The switch to the pending move's layout, through the cut at `location`: the new
    /// servers' base. Returns the move's record (its index in `moves`).
    pub(crate) fn switch(&mut self, location: String, now: f64) -> Option<usize> {
        let step = self.pending.as_ref().filter(|m| m.committed)?.cut?;
        let m = self.pending.take()?;
        self.base = Some(ResumePoint {
            location,
            step,
            servers: self.servers as u32,
        });
        self.moves.push(MoveRecord {
            from_servers: self.servers,
            to_servers: m.to,
            step,
            asked_at: m.asked_at,
            switched_at: now,
            resumed_at: None,
            pause_seconds: None,
        });
        self.servers = m.to;
        self.joining = true;
        Some(self.moves.len() - 1)
    }

    /// Every new server joined: training goes on at `now`. The pause runs from the cut
    /// that stopped granting.
    pub(crate) fn trained_again(&mut self, now: f64) -> Option<&MoveRecord> {
        if !std::mem::take(&mut self.joining) {
            return None;
        }
        let paused_at = self.paused_at.take();
        let last = self.moves.last_mut()?;
        last.resumed_at = Some(now);
        last.pause_seconds = paused_at.map(|p| now - p);
        Some(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(to: usize) -> PendingMove {
        PendingMove {
            to,
            asked_at: 1.0,
            cut: None,
            committed: false,
        }
    }

    #[test]
    fn a_move_switches_only_through_its_own_committed_cut() {
        let mut s = Scaling::new(3, None);
        s.pending = Some(asked(5));
        assert!(!s.holds_steps());
        assert_eq!(s.switch("ck".into(), 2.0), None, "no cut yet");
        s.pending.as_mut().unwrap().cut = Some(80);
        assert!(s.holds_steps());
        assert!(!s.cut_committed(70), "another cut is not the move's");
        s.cut_lost(70);
        assert!(s.holds_steps(), "another cut's loss leaves the move's");
        assert!(s.cut_committed(80));
        s.paused_at = Some(1.5);
        assert_eq!(s.switch("ck".into(), 2.0), Some(0));
        assert_eq!((s.servers, s.first_step(), s.joining), (5, 80, true));
        assert_eq!(s.base.as_ref().map(|b| b.servers), Some(3));
        let m = s.trained_again(3.0).cloned().unwrap();
        assert_eq!((m.from_servers, m.to_servers, m.step), (3, 5, 80));
        assert_eq!(m.pause_seconds, Some(1.5));
        assert!(s.trained_again(4.0).is_none(), "once per switch");
    }

    #[test]
    fn a_lost_cut_leaves_the_job_on_its_layout_and_the_move_asked() {
        let mut s = Scaling::new(4, None);
        s.pending = Some(asked(2));
        s.pending.as_mut().unwrap().cut = Some(40);
        s.cut_lost(40);
        assert!(!s.holds_steps());
        assert_eq!(s.servers, 4);
        assert!(s.pending.is_some(), "taken again at a later boundary");
        assert_eq!(s.switch("ck".into(), 1.0), None);
    }
}
