//! The final cut: a job with checkpoints ends with a cut of its last step, whatever the
//! schedule, so that an export, a restore or a resume starts from the end of the job and
//! not from its last scheduled cut. The run does not end until that cut commits, or until
//! its tries are used up (`FINAL_CUT_TRIES`, 3, each `FINAL_CUT_RETRY`, 2 s, after a failed
//! one; `state/cuts.rs`).

use tokio::time::Instant;

use crate::Shared;
use crate::state::{Phase, SaveDue, State};

impl Shared {
    /// The final cut, of the state after the job's last step, is due: every step has
    /// settled, none of its attempts is under way, and tries are left. A resume, an export
    /// or `ckpt restore` then starts from the end of the job, not its last scheduled cut.
    /// With `cpr.uncoordinated` it is every server's own save, asked of those whose newest
    /// is older: after the last step they are all saves of one state.
    pub(crate) fn final_cut_due(&self, s: &State) -> Option<SaveDue> {
        let total = s.steps.ledger.total();
        let ready = !self.final_cut_kept(s)
            && !self.final_cut_in_flight(s)
            && s.steps.ledger.done()
            && s.recovery.rebuilding.is_empty()
            && s.cuts.final_cut_may_start(Instant::now());
        if !ready {
            return None;
        }
        match &s.cuts.own_saves {
            Some(own) => Some(SaveDue::Own(own.not_saved_at(total))),
            None => Some(SaveDue::Cut { priority: false }),
        }
    }

    /// The job checkpoints, and its final cut has neither committed nor used up its
    /// tries: the run does not end yet.
    pub(crate) fn final_cut_outstanding(&self, s: &State) -> bool {
        !self.final_cut_kept(s) && (self.final_cut_in_flight(s) || s.cuts.final_cut_tries_left())
    }

    /// The final cut committed, or the job takes none (no checkpoints, or no steps).
    pub(crate) fn final_cut_kept(&self, s: &State) -> bool {
        let total = s.steps.ledger.total();
        if !self.job.config.cluster.ft.checkpoints() || total == 0 {
            return true;
        }
        match &s.cuts.own_saves {
            Some(own) => own.not_saved_at(total).is_empty() && !own.any_busy(),
            None => s.saves.last_checkpoint == Some(total),
        }
    }

    /// An attempt at a save is under way: a cut pausing the grants, one committing in the
    /// background, or own saves asked for or being taken.
    fn final_cut_in_flight(&self, s: &State) -> bool {
        s.phase == Phase::Checkpointing
            || s.saves.pending().is_some()
            || s.cuts.own_saves.as_ref().is_some_and(|o| o.any_busy())
    }
}
