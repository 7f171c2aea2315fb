//! `cpr.uncoordinated`: this server saves its own shard while training goes on.
//!
//! A cut needs one step that every server has applied and none beyond, so the coordinator
//! stops granting steps and waits for the pipeline to drain, and every server waits with
//! it. Partial recovery reloads a lost shard from its own save and keeps everyone else's
//! progress, so an own save needs no such step. It is taken as the shard stands:
//!
//! - under the shard's read lock (pushes to this shard wait; pulls and every other server
//!   go on) the state is copied into a snapshot buffer kept between saves, with the steps
//!   it holds: every step below the applied floor, and the few asynchronous pushes applied
//!   ahead of a gap, which the save's identity records;
//! - the write then runs from the snapshot, with no lock that training needs.
//!
//! The save is labelled with the floor. A restore counts the floor and the steps ahead
//! applied, so a re-sent push of one of those is not applied twice.

use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use ftrec_ckpt::{Checkpointer, Checkpoints, Manifest};
use ftrec_model::ModelState;
use ftrec_proto::identity::ShardIdentity;
use ftrec_rpc::PsError;

use super::CheckpointContext;
use crate::pipeline::UpdatePipeline;

/// The own saves' snapshot buffer and checkpointer. A mutex of its own, not the cuts'
/// checkpointer: the update pipeline's tracking locks that one at every commit, and must
/// never wait on this disk write. Restores, history changes and pruning take this one
/// too, so none runs beside a save in progress.
#[derive(Default)]
pub(crate) struct OwnSaveSlot {
    snapshot: Option<ModelState>,
    checkpointer: Option<Checkpointer>,
}

pub(super) fn lock(slot: &Mutex<OwnSaveSlot>) -> MutexGuard<'_, OwnSaveSlot> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

impl OwnSaveSlot {
    /// The history it wrote belongs to a state left behind (a restore, a restart): the
    /// next save starts a new checkpointer on the new writer. The buffer is kept.
    pub(super) fn forget_history(&mut self) {
        self.checkpointer = None;
    }
}

/// A committed own save.
pub(crate) struct OwnSave {
    pub manifest: Manifest,
    /// The applied floor it was taken at.
    pub step: u64,
    /// How long the copy held the shard's lock, seconds: what it cost training.
    pub stall_seconds: f64,
}

impl CheckpointContext {
    pub(crate) fn write_own_save(
        &self,
        pipeline: &UpdatePipeline,
        checkpoints: &Checkpoints,
    ) -> Result<OwnSave, PsError> {
        let mut slot = lock(&self.own_save);
        let OwnSaveSlot {
            snapshot,
            checkpointer,
        } = &mut *slot;
        let snapshot = match snapshot {
            Some(snapshot) => snapshot,
            // The first save's room, allocated outside the shard lock: faulting in a
            // shard's worth of fresh pages takes several times as long as the copy.
            None => {
                let config = pipeline.shard_read()?.state().config().clone();
                snapshot.insert(ModelState::zeroed_resident(&config)?)
            }
        };
        let copying = Instant::now();
        let (step, identity) = {
            let shard = pipeline.shard_read()?;
            // Steps change only under the shard's write lock: this read agrees with the
            // state copied below.
            let steps = pipeline.steps();
            let (step, ahead) = (steps.low(), steps.ahead().collect());
            drop(steps);
            let identity = ShardIdentity {
                applied_ahead: ahead,
                ..self.identity(&shard, pipeline.live().epoch, step)
            };
            snapshot.clone_from(shard.state());
            (step, identity)
        };
        let stall_seconds = copying.elapsed().as_secs_f64();
        // A save at this floor is committed already: the floor has not moved since, so it
        // stands for this one (asynchronous pushes applied ahead of the floor since then
        // wait for the next save; the PLS counts from the floor either way).
        if let Some(manifest) = self.committed_part(checkpoints, step)? {
            return Ok(OwnSave {
                manifest,
                step,
                stall_seconds,
            });
        }
        if checkpointer.is_none() {
            let tables = snapshot.tables().len();
            *checkpointer = Checkpointer::start_configured(
                self.writer(checkpoints)?,
                self.job.config.checkpoint.strategy_config()?,
                tables,
            )?;
        }
        let Some(ck) = checkpointer.as_mut() else {
            return Err(PsError::Config(
                "checkpoint.strategy is none: a server cannot save its shard".into(),
            ));
        };
        let written = ck
            .checkpoints()
            .pin_step(step)
            .and_then(|()| ck.checkpoint(&*snapshot, step, identity.to_json()));
        let manifest = match written {
            Ok(m) => m,
            Err(e) => {
                *checkpointer = None;
                return Err(e.into());
            }
        };
        drop(slot);
        if !self.cut_committed(checkpoints, step)? {
            return Err(PsError::Internal(format!(
                "server {}: its own save of step {step} is not listed as committed",
                self.id
            )));
        }
        Ok(OwnSave {
            manifest,
            step,
            stall_seconds,
        })
    }
}
