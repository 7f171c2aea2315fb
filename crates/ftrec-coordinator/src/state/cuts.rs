//! When the next save is due: the checkpoint interval (in steps, in seconds, re-planned
//! at each failure, or CPR's Eq. 4), a cut owed after one that did not count, the backoff
//! after a failed cut, the pause of the cut under way, and `cpr.uncoordinated`'s own
//! saves, which keep a schedule per server.

use std::time::Duration;

use tokio::time::Instant;

use ftrec_rpc::PsError;
use ftrec_rpc::job::Job;

use crate::cpr::{CprState, own_saves::OwnSaves};
use crate::replan::Replan;

/// The first wait after a failed cut; it doubles on each failure in a row up to the cap.
const FIRST_CUT_BACKOFF: Duration = Duration::from_secs(2);
const MAX_CUT_BACKOFF: Duration = Duration::from_secs(300);
/// Attempts at the final cut (at the job's last step) before the job ends without it: a
/// cut fails for a dead server (recovered, then tried again) or a full disk (which no
/// wait mends, and the model is still written by `--save`).
pub(crate) const FINAL_CUT_TRIES: u32 = 3;
/// The wait after a failed final cut. Not the cut backoff, which cuts failing all run long
/// (a full disk) leave at minutes: the job's end would wait that long for each try.
const FINAL_CUT_RETRY: Duration = Duration::from_secs(2);

pub(crate) struct CutSchedule {
    /// The cut being taken is a CPR prioritised save.
    pub(crate) priority: bool,
    /// When the cut under way stopped fresh grants.
    pause_started: Option<Instant>,
    /// After a failed cut: no new one before this instant, and the wait after the next
    /// failure (doubling, bounded), so a full disk is neither hammered nor logged 45 times a
    /// second.
    backoff: Option<(Instant, Duration)>,
    /// The step of a cut that did not count (abandoned by a new epoch, failed, or dropped
    /// while committing) when training did not roll back past it: with
    /// `checkpoint.every_steps` the cut is due again at the first fresh step at or past it
    /// ([`step_cut_due`]), not a whole interval later. A job with erasure coding under its
    /// cuts (`ec+checkpoint`) loses no steps to a failure, so otherwise a failure during a
    /// cut left it without a new one for twice the interval. Cleared by a committed cut at or
    /// past it.
    owed: Option<u64>,
    /// When the last consistent cut committed (or training started): the clock of
    /// `checkpoint.every_seconds`.
    last_cut_at: Instant,
    /// `checkpoint.planned_mtbf_seconds`: the cut interval re-planned at each failure.
    pub(crate) replan: Option<Replan>,
    /// `cpr.uncoordinated`: every server's own saves and schedule.
    pub(crate) own_saves: Option<OwnSaves>,
    /// `cluster.ft = "partial"`: PLS, interval and the full-or-partial choice.
    pub(crate) cpr: Option<CprState>,
    /// Attempts started at the final cut, the one at the job's last step.
    final_cut_tries: u32,
    /// After a failed final cut: no other attempt before this instant.
    final_cut_retry_at: Option<Instant>,
}

/// What [`CutSchedule::due`] found due.
pub(crate) enum SaveDue {
    /// A cut of every server (or CPR's prioritised save): granting pauses for it.
    Cut { priority: bool },
    /// `cpr.uncoordinated`: these servers' own saves, taken while training goes on.
    Own(Vec<usize>),
}

impl CutSchedule {
    /// The schedule of `job`, whose steps hold `total_samples`.
    pub(crate) fn new(job: &Job, total_samples: u64) -> Result<Self, PsError> {
        let c = &job.config;
        let replan = match (
            c.checkpoint.every_seconds,
            c.checkpoint.planned_mtbf_seconds,
        ) {
            (Some(every), Some(mtbf)) if c.cluster.ft.checkpoints() => {
                Some(Replan::new(mtbf, every))
            }
            _ => None,
        };
        let own_saves = c
            .cpr
            .uncoordinated
            .then(|| OwnSaves::new(c.cluster.servers, c.checkpoint.keep));
        Ok(Self {
            priority: false,
            pause_started: None,
            backoff: None,
            owed: None,
            last_cut_at: Instant::now(),
            replan,
            own_saves,
            cpr: CprState::new(job, total_samples)?,
            final_cut_tries: 0,
            final_cut_retry_at: None,
        })
    }

    /// Which save is due at `next`, the next fresh step, at `now`. `may_save`: nothing
    /// else holds saves back (the caller checks what other groups know: a cut pending, a
    /// rebuild, the end of the run), `have_cut`: a consistent cut exists to save against.
    pub(crate) fn due(
        &self,
        job: &Job,
        next: u64,
        now: Instant,
        may_save: bool,
        have_cut: bool,
    ) -> Option<SaveDue> {
        let c = &job.config;
        let every = c.checkpoint.every_steps;
        let may_save = may_save && self.backoff.is_none_or(|(until, _)| now >= until);
        if let Some(own) = &self.own_saves {
            // Servers whose save is asked for or running are not due again (`due`).
            let servers = own.due(next, every, now);
            return (may_save && !servers.is_empty()).then_some(SaveDue::Own(servers));
        }
        // CPR with a target PLS sets the interval in seconds (Eq. 4); else
        // `checkpoint.every_seconds` of wall time; else every N steps.
        let cut = match self.cpr.as_ref().filter(|cpr| cpr.interval().is_some()) {
            Some(cpr) => cpr.cut_due(now),
            None => match c.checkpoint.every_seconds {
                Some(planned) => {
                    let seconds = self.replan.as_ref().map_or(planned, |r| r.every_seconds);
                    now.duration_since(self.last_cut_at).as_secs_f64() >= seconds
                }
                None => step_cut_due(next, every, self.owed),
            },
        };
        // Prioritised saves go between cuts, once a cut exists to save against.
        let priority = !cut
            && have_cut
            && self
                .cpr
                .as_ref()
                .is_some_and(|cpr| cpr.priority_due(now, next, every));
        (may_save && (cut || priority)).then_some(SaveDue::Cut { priority })
    }

    /// Another attempt at the final cut may start at `now`: tries are left, and the
    /// last failed one was [`FINAL_CUT_RETRY`] ago.
    pub(crate) fn final_cut_may_start(&self, now: Instant) -> bool {
        self.final_cut_tries_left() && self.final_cut_retry_at.is_none_or(|t| now >= t)
    }

    /// An attempt at the final cut starts.
    pub(crate) fn final_cut_started(&mut self) {
        self.final_cut_tries += 1;
    }

    /// Tries of the final cut are left.
    pub(crate) fn final_cut_tries_left(&self) -> bool {
        self.final_cut_tries < FINAL_CUT_TRIES
    }

    /// An attempt at the final cut failed at `now`.
    pub(crate) fn final_cut_failed(&mut self, now: Instant) {
        self.final_cut_retry_at = Some(now + FINAL_CUT_RETRY);
    }

    /// Training starts (or a cut committed) at `now`: the interval in seconds counts
    /// from here.
    pub(crate) fn restart_clock(&mut self, now: Instant) {
        self.last_cut_at = now;
    }

    /// A coordinated cut (or prioritised save) begins at `now`: fresh grants pause.
    pub(crate) fn pause(&mut self, priority: bool, now: Instant) {
        self.priority = priority;
        self.pause_started = Some(now);
    }

    /// The cut under way is over (or given up): the pause it caused, seconds.
    pub(crate) fn end_pause(&mut self) -> f64 {
        self.pause_started
            .take()
            .map_or(0.0, |t| t.elapsed().as_secs_f64())
    }

    /// A rollback took over from the cut under way: its pause counts nowhere.
    pub(crate) fn drop_pause(&mut self) {
        self.pause_started = None;
    }

    /// Notes that the coordinated cut of `step` did not count: it is owed (see
    /// [`CutSchedule::owed`]). Prioritised saves owe nothing: the next one comes on its own.
    pub(crate) fn owe(&mut self, step: u64, priority: bool) {
        if !priority {
            self.owed = Some(self.owed.map_or(step, |o| o.min(step)));
        }
    }

    /// A save of `step` committed: a consistent cut pays what was owed up to it, and ends
    /// the backoff; the interval in seconds starts over at `now`.
    pub(crate) fn committed(&mut self, step: u64, priority: bool, now: Instant) {
        if priority {
            return;
        }
        if self.owed.is_some_and(|owed| step >= owed) {
            self.owed = None;
        }
        self.last_cut_at = now;
        self.backoff = None;
    }

    /// A save failed at `now`: the next waits, twice as long as after the previous failure
    /// in a row (bounded). Returns the wait.
    pub(crate) fn failed(&mut self, now: Instant) -> Duration {
        let wait = self
            .backoff
            .map_or(FIRST_CUT_BACKOFF, |(_, d)| (d * 2).min(MAX_CUT_BACKOFF));
        self.backoff = Some((now + wait, wait));
        wait
    }

    /// The next save is tried on time: own saves went through, or the failure that made
    /// a cut fail (most likely a dead server's) has been recovered from.
    /// A failed cut's backoff still runs at `now`.
    pub(crate) fn backing_off(&self, now: Instant) -> bool {
        self.backoff.is_some_and(|(until, _)| now < until)
    }

    pub(crate) fn clear_backoff(&mut self) {
        self.backoff = None;
    }
}

/// With `checkpoint.every_steps = every`: a cut is due at every multiple of it, and at
/// the first fresh step at or past `owed`, the step of a cut that did not count.
fn step_cut_due(next: u64, every: u64, owed: Option<u64>) -> bool {
    every > 0 && (next.is_multiple_of(every) || owed.is_some_and(|o| next >= o))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule() -> CutSchedule {
        CutSchedule {
            priority: false,
            pause_started: None,
            backoff: None,
            owed: None,
            last_cut_at: Instant::now(),
            replan: None,
            own_saves: None,
            cpr: None,
            final_cut_tries: 0,
            final_cut_retry_at: None,
        }
    }

    #[test]
    fn an_owed_cut_is_due_at_the_first_fresh_step_at_or_past_it() {
        // Every 40 steps, nothing owed: the multiples only.
        assert!(step_cut_due(40, 40, None));
        assert!(!step_cut_due(41, 40, None));
        // The cut of step 40 did not count and training went on (no rollback): due at
        // once, not at 80.
        assert!(step_cut_due(41, 40, Some(40)));
        assert!(step_cut_due(57, 40, Some(40)));
        // Rolled back to an older cut: not due before the owed step comes round again.
        assert!(!step_cut_due(21, 40, Some(40)));
        assert!(step_cut_due(40, 40, Some(40)));
        // No interval in steps: never.
        assert!(!step_cut_due(50, 0, Some(40)));
    }

    #[test]
    fn the_oldest_owed_cut_stands_until_a_cut_at_or_past_it_commits() {
        let mut c = schedule();
        let now = Instant::now();
        c.owe(80, false);
        c.owe(40, false);
        c.owe(120, false);
        assert_eq!(c.owed, Some(40));
        // Prioritised saves owe nothing and pay nothing.
        c.owe(10, true);
        c.committed(90, true, now);
        assert_eq!(c.owed, Some(40));
        // A cut below the owed step (after a rollback) does not pay it.
        c.committed(20, false, now);
        assert_eq!(c.owed, Some(40));
        c.committed(40, false, now);
        assert_eq!(c.owed, None);
    }

    #[test]
    fn the_backoff_doubles_up_to_its_cap_and_a_cut_ends_it() {
        let mut c = schedule();
        let now = Instant::now();
        let waits: Vec<u64> = (0..10).map(|_| c.failed(now).as_secs()).collect();
        assert_eq!(waits, vec![2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert!(matches!(c.backoff, Some((until, _)) if until == now + MAX_CUT_BACKOFF));
        // A committed prioritised save says nothing of the disk the cuts fail on.
        c.committed(5, true, now);
        assert!(c.backoff.is_some());
        c.committed(5, false, now);
        assert_eq!(c.failed(now), FIRST_CUT_BACKOFF);
        c.clear_backoff();
        assert_eq!(c.failed(now), FIRST_CUT_BACKOFF);
    }

    fn job(every_steps: u64) -> Job {
        let mut c = ftrec_config::JobConfig::preset("tiny").unwrap();
        c.data.dir = Some("unused".into());
        c.checkpoint.dir = Some("unused".into());
        c.checkpoint.every_steps = every_steps;
        c.cluster.ft = ftrec_config::FaultTolerance::Checkpoint;
        Job::new(c).unwrap()
    }

    #[test]
    fn the_final_cut_is_tried_a_bounded_number_of_times_whatever_the_backoff() {
        let mut c = schedule();
        let now = Instant::now();
        // Cuts that failed all run long left a long backoff: the final cut ignores it.
        for _ in 0..8 {
            c.failed(now);
        }
        assert!(c.final_cut_may_start(now));
        for tried in 1..=FINAL_CUT_TRIES {
            c.final_cut_started();
            c.final_cut_failed(now);
            assert!(!c.final_cut_may_start(now));
            let later = now + FINAL_CUT_RETRY;
            assert_eq!(c.final_cut_may_start(later), tried < FINAL_CUT_TRIES);
        }
    }

    #[test]
    fn a_cut_is_due_on_schedule_but_not_while_held_back_or_backing_off() {
        let job = job(10);
        let mut c = CutSchedule::new(&job, 10_000).unwrap();
        let now = Instant::now();
        let due = |c: &CutSchedule, next, may_save| c.due(&job, next, now, may_save, true);
        assert!(matches!(
            due(&c, 20, true),
            Some(SaveDue::Cut { priority: false })
        ));
        assert!(due(&c, 21, true).is_none());
        // Another group holds it back (a cut pending, a rebuild, the end of the run).
        assert!(due(&c, 20, false).is_none());
        // A failed cut: none before the backoff passes, then on schedule again.
        let wait = c.failed(now);
        assert!(due(&c, 20, true).is_none());
        assert!(c.due(&job, 20, now + wait, true, true).is_some());
        // The cut of step 20 did not count: due at the next fresh step, not at 30.
        c.clear_backoff();
        c.owe(20, false);
        assert!(due(&c, 21, true).is_some());
    }

    #[test]
    fn a_pause_is_counted_once() {
        let mut c = schedule();
        assert_eq!(c.end_pause(), 0.0);
        c.pause(true, Instant::now() - Duration::from_millis(50));
        assert!(c.priority);
        assert!(c.end_pause() >= 0.05);
        assert_eq!(c.end_pause(), 0.0);
        c.pause(false, Instant::now());
        c.drop_pause();
        assert_eq!(c.end_pause(), 0.0);
    }
}
