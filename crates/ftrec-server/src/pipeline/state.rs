//! The update pipeline's state: the shard, the record of which steps it holds, the epoch
//! and applied floor published to waiting pulls, the commit turn, erasure coding's
//! prepared steps, and the observers an update passes.
//!
//! Invariants this type keeps:
//! - the applied steps change only under the shard's write lock ([`UpdatePipeline::install`],
//!   and callers of [`UpdatePipeline::publish`] that hold the lock), so a reader under the
//!   shard lock sees rows and steps that agree;
//! - every change of the steps is published with the epoch at once ([`Live`]), so a
//!   waiting pull sees both change together;
//! - an install checks the epoch under the write lock it installs under, and refuses a
//!   staged update whose dense ranges moved since it was staged.

use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use tokio::sync::{OwnedMutexGuard, watch};

use super::{apply_parity_difference, flip_installed_row};
use crate::ec::EcState;
use crate::shard::{PostCommit, PreCommit, Shard, StagedUpdate};
use ftrec_faults::Faults;
use ftrec_proto::applied::AppliedSteps;
use ftrec_proto::proto::{AppliedReply, ParityUpdateRequest};
use ftrec_rpc::PsError;
use ftrec_rpc::metrics::Metrics;

/// The epoch and the first step not applied (every step below it is), published together
/// so a waiting pull sees both change at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Live {
    pub(crate) epoch: u64,
    pub(crate) applied: u64,
}

pub(crate) struct UpdatePipeline {
    shard: RwLock<Shard>,
    /// Which steps the shard holds. Changed only under the shard's write lock, so the two
    /// always agree.
    steps: Mutex<AppliedSteps>,
    live: watch::Sender<Live>,
    /// One update at a time goes through stage, pre-commit, commit and post-commit, in
    /// arrival order (tokio's mutex is fair), so each is staged from the state its
    /// predecessor left. The shard lock is held only to stage (read) and to install
    /// (write): pulls are served while a pre-commit observer awaits. Restores, epoch changes
    /// and cuts take this turn too, so no update straddles them.
    commit_turn: Arc<tokio::sync::Mutex<()>>,
    /// Erasure coding: prepared steps and staged parity differences (`ec/mod.rs`).
    ec: Option<EcState>,
    pre_commit: Vec<Arc<dyn PreCommit>>,
    post_commit: Vec<Arc<dyn PostCommit>>,
    /// The applied-steps gauge is set where the steps are published.
    metrics: Arc<Metrics>,
    /// The planted faults an install and a parity fold may fire (`install`, `fold-parity`).
    faults: Faults,
}

impl UpdatePipeline {
    /// A pipeline over `shard` in `epoch`, with no step applied and no observer yet;
    /// `erasure_coded` keeps 2PC's prepared state beside it.
    pub(crate) fn new(
        shard: Shard,
        epoch: u64,
        erasure_coded: bool,
        metrics: Arc<Metrics>,
        faults: Faults,
    ) -> Self {
        Self {
            shard: RwLock::new(shard),
            steps: Mutex::new(AppliedSteps::default()),
            live: watch::Sender::new(Live { epoch, applied: 0 }),
            commit_turn: Arc::new(tokio::sync::Mutex::new(())),
            ec: erasure_coded.then(EcState::default),
            pre_commit: Vec::new(),
            post_commit: Vec::new(),
            metrics,
            faults,
        }
    }

    /// Observers run in the order added.
    pub(crate) fn add_pre_commit(&mut self, observer: Arc<dyn PreCommit>) {
        self.pre_commit.push(observer);
    }

    pub(crate) fn add_post_commit(&mut self, observer: Arc<dyn PostCommit>) {
        self.post_commit.push(observer);
    }

    pub(crate) fn live(&self) -> Live {
        *self.live.borrow()
    }

    /// Follows the epoch and applied floor (the parity propagator abandons an update of
    /// an epoch left behind).
    pub(crate) fn live_watch(&self) -> watch::Receiver<Live> {
        self.live.subscribe()
    }

    pub(crate) fn check_epoch(&self, epoch: u64) -> Result<(), PsError> {
        let current = self.live().epoch;
        if epoch != current {
            return Err(PsError::StaleEpoch {
                got: epoch,
                current,
            });
        }
        Ok(())
    }

    /// Restores and epoch changes only move forward: a delayed one from an older recovery
    /// must not undo a newer one.
    pub(crate) fn check_epoch_forward(&self, epoch: u64) -> Result<(), PsError> {
        let current = self.live().epoch;
        if epoch < current {
            return Err(PsError::StaleEpoch {
                got: epoch,
                current,
            });
        }
        Ok(())
    }

    pub(crate) fn shard_read(&self) -> Result<RwLockReadGuard<'_, Shard>, PsError> {
        self.shard
            .read()
            .map_err(|_| PsError::Internal("shard lock poisoned".into()))
    }

    pub(crate) fn shard_write(&self) -> Result<RwLockWriteGuard<'_, Shard>, PsError> {
        self.shard
            .write()
            .map_err(|_| PsError::Internal("shard lock poisoned".into()))
    }

    pub(crate) fn steps(&self) -> MutexGuard<'_, AppliedSteps> {
        self.steps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Which of `steps` are applied here, as the Applied and Fence RPCs answer it, with
    /// the range of steps applied.
    pub(crate) fn applied_of(&self, steps: &[u64]) -> AppliedReply {
        let applied = self.steps();
        AppliedReply {
            applied: steps.iter().map(|&s| applied.contains(s)).collect(),
            shard_digest: String::new(),
            applied_low: applied.low(),
            applied_end: applied.end(),
            rebuild_unfinished: false,
        }
    }

    /// Changes this shard's record of applied steps in place, adopts `epoch`, and wakes
    /// the waiting pulls and pushes. Returns how many steps are applied. The caller holds
    /// the shard's write lock.
    pub(crate) fn publish(&self, epoch: u64, change: impl FnOnce(&mut AppliedSteps)) -> u64 {
        let mut steps = self.steps();
        change(&mut steps);
        let (low, count) = (steps.low(), steps.count());
        drop(steps);
        self.metrics.set("ftrec_applied_steps", count as f64);
        self.live.send_replace(Live {
            epoch,
            applied: low,
        });
        count
    }

    /// Deterministic mode: waits (at most `timeout`) until every step below `target` is
    /// applied. Whether `target` itself is applied already is the caller's question.
    /// `server` names this server in the timeout's error.
    pub(crate) async fn wait_applied(
        &self,
        epoch: u64,
        target: u64,
        timeout: Duration,
        server: usize,
    ) -> Result<(), PsError> {
        let mut rx = self.live.subscribe();
        let waited = tokio::time::timeout(
            timeout,
            rx.wait_for(|l| l.epoch != epoch || l.applied >= target),
        )
        .await;
        let live = match waited {
            Ok(Ok(l)) => *l,
            Ok(Err(_)) => return Err(PsError::Unavailable("server shutting down".into())),
            Err(_) => {
                return Err(PsError::Timeout(format!(
                    "server {server} waited {timeout:?} for step {target} (at {})",
                    self.live().applied
                )));
            }
        };
        if live.epoch != epoch {
            return Err(PsError::StaleEpoch {
                got: epoch,
                current: live.epoch,
            });
        }
        Ok(())
    }

    /// The commit turn, held for as long as the guard lives.
    pub(crate) async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.commit_turn.lock().await
    }

    /// The commit turn, as a guard that can move into a blocking task or a prepared step.
    pub(crate) async fn owned_turn(&self) -> OwnedMutexGuard<()> {
        self.commit_turn.clone().lock_owned().await
    }

    pub(crate) fn ec(&self) -> Result<&EcState, PsError> {
        self.ec.as_ref().ok_or_else(|| {
            PsError::Config("this cluster does not erasure code (cluster.ft)".into())
        })
    }

    /// Erasure coding's state, where the job erasure codes.
    pub(crate) fn ec_state(&self) -> Option<&EcState> {
        self.ec.as_ref()
    }

    /// The pre-commit observers, in order; the first veto ends it.
    pub(crate) async fn pre_commit(&self, staged: &StagedUpdate) -> Result<(), PsError> {
        for observer in &self.pre_commit {
            observer.pre_commit(staged).await?;
        }
        Ok(())
    }

    /// Applies a staged update to the shard, with `parity` (the differences other servers
    /// staged for the same step), and records the step as applied. The caller holds the
    /// commit turn (or the prepared update that holds it).
    pub(crate) fn install(
        &self,
        epoch: u64,
        staged: &StagedUpdate,
        parity: &[ParityUpdateRequest],
    ) -> Result<u64, PsError> {
        let steps = {
            let mut shard = self.shard_write()?;
            // Restores and recoveries take the turn too, so this holds; checked where it
            // matters anyway, under the lock that installs.
            self.check_epoch(epoch)?;
            self.install_locked(&mut shard, epoch, staged, parity)?
        };
        self.after_commit(staged);
        Ok(steps)
    }

    /// [`UpdatePipeline::install`]'s change, under the shard's write lock the caller holds
    /// (2PC's commit checks the epoch fence under the same lock). The caller then runs
    /// [`UpdatePipeline::after_commit`].
    pub(crate) fn install_locked(
        &self,
        shard: &mut Shard,
        epoch: u64,
        staged: &StagedUpdate,
        parity: &[ParityUpdateRequest],
    ) -> Result<u64, PsError> {
        // The commit turn keeps the dense ranges as staged; a change between would make
        // the staged gradient apply to other values than the step's.
        if !shard.dense_unchanged_since(staged) {
            return Err(PsError::Internal(format!(
                "step {}: the dense range changed between stage and commit",
                staged.step
            )));
        }
        for request in parity {
            apply_parity_difference(shard, request, &self.faults)?;
        }
        shard.commit(staged);
        flip_installed_row(shard, staged, &self.faults)?;
        Ok(self.publish(epoch, |steps| {
            steps.insert(staged.step);
        }))
    }

    /// The post-commit observers, once the shard lock is released.
    pub(crate) fn after_commit(&self, staged: &StagedUpdate) {
        for observer in &self.post_commit {
            observer.post_commit(staged.rows());
        }
    }
}

#[cfg(test)]
mod tests;
