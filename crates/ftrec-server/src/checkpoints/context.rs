//! What the server's checkpoints need beside the update pipeline: the shard's checkpoint
//! location, the handle that writes there (holding its writer lease), the job's
//! checkpoint strategy over the shard, the own saves' slot and CPR's priority trackers.
//!
//! Invariants this type keeps (its methods, in this folder):
//! - at most one writing handle, started once per history: on the first checkpoint of a
//!   fresh run, and again on every restore or change of history (a restore to a cut older
//!   than the newest checkpoint forks a new branch, so no committed checkpoint is ever
//!   rewritten);
//! - a checkpointer belongs to the history it tracked: a restore, a restart or a failed
//!   write drops it, and the next cut starts over with a full checkpoint;
//! - restores, history changes and pruning hold the own saves' slot, so none runs beside
//!   an own save in progress.

use std::sync::{Arc, Mutex};

use ftrec_ckpt::Checkpoints;
use ftrec_proto::placement::Layout;
use ftrec_rpc::job::Job;

use super::own_save::OwnSaveSlot;
use super::priority::{PriorityTracking, SharedPriority};
use super::{SharedCheckpointer, Tracking};
use crate::resume::ResumeSource;
use crate::shard::PostCommit;

pub(crate) struct CheckpointContext {
    pub(super) job: Job,
    pub(super) id: usize,
    pub(super) layout: Layout,
    /// The job's checkpoint strategy over this shard.
    pub(super) checkpointer: SharedCheckpointer,
    /// `cpr.uncoordinated`: the own saves' snapshot and checkpointer (`own_save.rs`).
    pub(super) own_save: Mutex<OwnSaveSlot>,
    /// CPR's row trackers for prioritised saves (`priority.rs`).
    pub(super) priority: Option<SharedPriority>,
    /// The shard's checkpoint location (for reads).
    pub(super) location: Option<Checkpoints>,
    /// The handle that writes there, holding the location's writer lease (module docs).
    pub(super) writer: Mutex<Option<Checkpoints>>,
    /// A resumed job: the cut it started from, which its slots' initial state is.
    pub(super) resume: Option<ResumeSource>,
    /// A resumed job's first writer continues this slot's own part of that cut (same
    /// layout, same location); taken by that writer.
    pub(super) resume_part: Mutex<Option<String>>,
}

impl CheckpointContext {
    /// Server `id`'s checkpoints at `location` (`None`: the job keeps none), with CPR's
    /// trackers where the job prioritises saves.
    pub(crate) fn new(
        job: Job,
        id: usize,
        layout: Layout,
        location: Option<Checkpoints>,
        priority: Option<SharedPriority>,
        resume: Option<ResumeSource>,
    ) -> Self {
        Self {
            job,
            id,
            layout,
            checkpointer: SharedCheckpointer::default(),
            own_save: Mutex::default(),
            priority,
            location,
            writer: Mutex::new(None),
            resume,
            resume_part: Mutex::new(None),
        }
    }

    /// The cut a resumed job started from.
    pub(crate) fn resume(&self) -> Option<&ResumeSource> {
        self.resume.as_ref()
    }

    /// The first step this job trains: every step below is in its initial state.
    pub(crate) fn first_step(&self) -> u64 {
        self.resume.as_ref().map_or(0, |r| r.step)
    }

    /// A resumed slot's own part of its cut, which its first writer continues.
    pub(crate) fn continue_from_part(&self, id: Option<String>) {
        *self.resume_part.lock().unwrap_or_else(|p| p.into_inner()) = id;
    }

    /// The post-commit observers that feed the checkpoints: the strategy's delta tracker,
    /// then the priority trackers if any, in the order they run.
    pub(crate) fn observers(&self) -> Vec<Arc<dyn PostCommit>> {
        let mut observers: Vec<Arc<dyn PostCommit>> =
            vec![Arc::new(Tracking::new(self.checkpointer.clone()))];
        if let Some(p) = &self.priority {
            observers.push(Arc::new(PriorityTracking(p.clone())));
        }
        observers
    }

    /// The shard's checkpoint location, if the job keeps checkpoints.
    pub(crate) fn location(&self) -> Option<&Checkpoints> {
        self.location.as_ref()
    }
}
