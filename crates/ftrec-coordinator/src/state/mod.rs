//! The coordinator's state under its one lock, grouped by concern. Each group owns the
//! invariants that involve only its own fields (as methods, unit-tested in its file);
//! decisions that span groups (a grant, a failure, a recovery's end) are `Shared`'s and
//! the control loop's, and read as calls on the groups.
//!
//! - [`Membership`]: who holds each slot, spares, incarnations and zombies, and the
//!   evidence against a server (probes, workers' unreachable reports); spares asked of
//!   survivors' hosts ([`Hosting`]).
//! - [`LeaderState`]: etcd membership's view of this coordinator's leadership: deposed,
//!   the takeovers over the job's life, training time under earlier leaders.
//! - [`Recoveries`]: slots waiting for a replacement, background rebuilds, the recoveries
//!   done, the retry backoff of a failing recovery, suspicion, the run's fatal error.
//! - [`CutSchedule`]: when the next save is due: the pause of a cut under way, the backoff
//!   after a failed one, a cut owed, the re-planned interval, CPR, own saves.
//! - [`Saves`]: the saves made: the rollback target, the cuts kept on disk, a cut still
//!   committing in the background and its confirmation timers, pruning.
//! - [`Steps`]: the step ledger and what settled steps count (samples), lost steps,
//!   orphan resolution's retry timer, step-triggered kills.

mod cuts;
mod hosting;
mod leadership;
mod membership;
mod recoveries;
mod saves;
mod scaling;
mod steps;

pub(crate) use cuts::{CutSchedule, FINAL_CUT_TRIES, SaveDue};
pub(crate) use hosting::Hosting;
pub(crate) use leadership::LeaderState;
pub(crate) use membership::{Member, Membership, Spare};
pub(crate) use recoveries::{AttemptFailed, Recoveries};
pub(crate) use saves::Saves;
pub use scaling::MoveRecord;
pub(crate) use scaling::{PendingMove, Scaling};
pub(crate) use steps::Steps;

use serde::Serialize;

use ftrec_proto::placement::{Layout, PlacementMap};
use ftrec_proto::proto::ResumePoint;
use ftrec_proto::timeline::{EventKind, Timeline};
use ftrec_rpc::PsError;
use ftrec_rpc::job::Job;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    Starting,
    Running,
    Checkpointing,
    Recovering,
    Done,
}

pub(crate) struct State {
    pub(crate) phase: Phase,
    pub(crate) epoch: u64,
    pub(crate) placement: PlacementMap,
    pub(crate) timeline: Timeline,
    /// Tells every process to exit (heartbeat replies carry `stop`).
    pub(crate) stopping: bool,
    /// A task of the control loop (a cut, a recovery, orphan resolution) is running: no
    /// other is planned before it ends. Own saves never set it.
    pub(crate) busy: bool,
    pub(crate) members: Membership,
    pub(crate) leader: LeaderState,
    pub(crate) recovery: Recoveries,
    pub(crate) cuts: CutSchedule,
    pub(crate) saves: Saves,
    pub(crate) steps: Steps,
    pub(crate) scaling: Scaling,
}

impl State {
    /// A coordinator's state before any member joined: `total_steps` to train,
    /// `total_samples` in them.
    pub(crate) fn new(
        job: &Job,
        total_steps: u64,
        total_samples: u64,
        resumed_from: Option<ResumePoint>,
    ) -> Result<Self, PsError> {
        let cluster = &job.config.cluster;
        // The layout is checked before CPR's settings, as it always was.
        let placement = PlacementMap::new(&job.layout()?);
        Ok(Self {
            phase: Phase::Starting,
            epoch: 1,
            placement,
            timeline: Timeline::new(),
            stopping: false,
            busy: false,
            members: Membership::new(cluster.servers, cluster.workers),
            leader: LeaderState::default(),
            recovery: Recoveries::default(),
            cuts: CutSchedule::new(job, total_samples)?,
            saves: Saves::default(),
            steps: Steps::new(total_steps),
            scaling: Scaling::new(cluster.servers, resumed_from),
        })
    }

    /// The placement arithmetic of the servers the job runs on now.
    pub(crate) fn layout(&self, job: &Job) -> Result<Layout, PsError> {
        job.layout_for(self.scaling.servers)
    }

    /// Seconds since training started (0 before).
    pub(crate) fn train_seconds(&self) -> f64 {
        self.timeline
            .data
            .events
            .iter()
            .find(|e| e.kind == EventKind::TrainingStart)
            .map_or(0.0, |e| self.timeline.now() - e.t)
    }

    /// Ends the run with `why` (the caller tells the waiters: `Shared::done`).
    pub(crate) fn fail_run(&mut self, why: String) {
        self.timeline.event(EventKind::Fatal, why.clone());
        self.recovery.fatal = Some(why);
        self.phase = Phase::Done;
    }
}
