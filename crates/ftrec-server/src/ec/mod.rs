//! Erasure coding on a server (ECRec §3.2, §3.5): difference propagation as a pre-commit
//! observer, parity differences received from other servers, and two-phase commit.
//!
//! Two-phase commit, as built here (a commit mode of the one pipeline, `pipeline/`):
//! - Phase 1 (`Push` with `prepare`): the server takes its commit turn, stages the update,
//!   sends `old XOR new` of every changed row to the stripe's parity holders, which *stage*
//!   them, and keeps the staged update with the turn until phase 2. Holding the turn keeps
//!   the next update from being staged against rows that are about to change.
//! - Phase 2 (`CommitStep`): the update is installed and the parity holders fold what they
//!   staged for the step; `AbortStep` drops both.
//! - Nothing here decides a step on its own: no timer aborts a prepared step, and staged
//!   differences are never aged out. A step is decided by whoever drives it: its worker
//!   (commit or abort), the coordinator's orphan resolution (commit where prepared, or grant
//!   it again: a regrant in the same epoch reuses the prepared update and sends its
//!   differences again, since an abort may have dropped them at the holders), or a
//!   recovery. A recovery first *fences* the old epoch: under the shard's write lock, the
//!   same lock a commit installs under, so every commit of that epoch is either installed
//!   before the fence (and the recovery sees it applied) or refused after it. The
//!   recovery then tells each survivor which fenced steps some server had committed
//!   (`SetEpoch.finish`): those are committed where prepared, the rest dropped. So a step
//!   ends applied on every server or on none, whatever the timing of the fence.

mod peers;
mod propagate;
#[cfg(test)]
mod tries_tests;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::OwnedMutexGuard;

pub(crate) use peers::Peers;
pub(crate) use propagate::ParityPropagator;

use crate::Core;
use crate::pipeline::apply_parity_difference;
use crate::shard::StagedUpdate;
use crate::shard::dense_code::DENSE_TABLE;
use ftrec_faults::points;
use ftrec_proto::proto::*;
use ftrec_proto::wire::bytes_to_u32s;
use ftrec_rpc::PsError;

/// A phase-1 update waiting for its decision, holding the commit turn.
struct Prepared {
    epoch: u64,
    staged: Arc<StagedUpdate>,
    _turn: OwnedMutexGuard<()>,
}

/// Parity differences staged for a step, from any data server.
struct StagedParity {
    epoch: u64,
    request: ParityUpdateRequest,
}

/// The erasure-coding state of a server beside its shard.
pub(super) struct EcState {
    prepared: Mutex<BTreeMap<u64, Prepared>>,
    staged_parity: Mutex<BTreeMap<u64, Vec<StagedParity>>>,
    /// One-round mode: the (source, step, epoch) of recent folds, so a retried update is
    /// not folded twice (XOR would cancel it).
    folded: Mutex<std::collections::VecDeque<(u32, u64, u64)>>,
    /// The newest epoch a recovery announced; a step of an older one may no longer be
    /// prepared or committed here, even before the recovery gets the commit turn. Raised
    /// only under the shard's write lock and the `prepared` lock (`Core::raise_fence`), and
    /// read under one of them where it decides anything.
    fence: tokio::sync::watch::Sender<u64>,
    /// Woken whenever a step is prepared here (a phase 1 waiting for the turn checks
    /// whether it was its own step).
    pub(crate) prepared_changed: tokio::sync::Notify,
}

impl Default for EcState {
    fn default() -> Self {
        Self {
            prepared: Mutex::default(),
            staged_parity: Mutex::default(),
            folded: Mutex::default(),
            fence: tokio::sync::watch::Sender::new(0),
            prepared_changed: tokio::sync::Notify::new(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EcState {
    /// Raises the fence (callers hold the shard's write lock and the `prepared` lock), and
    /// wakes whatever waits on an older epoch's peers: a parity propagation of a fenced
    /// step holds the commit turn the recovery needs, and its peer may be the silent one.
    fn raise(&self, epoch: u64) {
        self.fence.send_if_modified(|fence| {
            let raised = epoch > *fence;
            *fence = (*fence).max(epoch);
            raised
        });
    }

    /// Follows the fence (the parity propagator abandons a fenced update at once).
    pub(crate) fn fence_watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.fence.subscribe()
    }

    fn fenced_past(&self, epoch: u64) -> bool {
        *self.fence.borrow() > epoch
    }

    fn fenced(&self, epoch: u64) -> PsError {
        PsError::StaleEpoch {
            got: epoch,
            current: *self.fence.borrow(),
        }
    }

    /// The staged update of `step` if it is prepared here in `epoch`: a retried phase 1, or
    /// a step granted again after its first phase 1 ran here. The try `attempt` adopts it
    /// under the lock an abort takes it under, so an abort of an earlier try either took
    /// it first (and the new try prepares afresh) or no longer matches it. With it,
    /// whether the try's differences are at every holder already ([`StagedUpdate::adopt`]).
    pub(crate) fn adopt_prepared(
        &self,
        step: u64,
        epoch: u64,
        attempt: u64,
    ) -> Option<(Arc<StagedUpdate>, bool)> {
        lock(&self.prepared)
            .get(&step)
            .filter(|p| p.epoch == epoch)
            .map(|p| {
                let propagated = p.staged.adopt(attempt);
                (p.staged.clone(), propagated)
            })
    }

    /// Takes `step` out of the prepared map if it was prepared here in `epoch`; dropping
    /// it releases the commit turn it holds.
    fn take_prepared(&self, step: u64, epoch: u64) -> Option<Prepared> {
        self.take_prepared_try(step, epoch, 0)
    }

    /// [`EcState::take_prepared`], only if it is prepared for the try `attempt` (0: any).
    fn take_prepared_try(&self, step: u64, epoch: u64, attempt: u64) -> Option<Prepared> {
        let mut all = lock(&self.prepared);
        let mine = all
            .get(&step)
            .is_some_and(|p| p.epoch == epoch && (attempt == 0 || p.staged.attempt() == attempt));
        if mine { all.remove(&step) } else { None }
    }

    /// Drops the differences staged for `step` in `epoch` by the try `attempt` (0: by any
    /// try); those of other tries stay for their commit.
    fn drop_staged_parity_try(&self, step: u64, epoch: u64, attempt: u64) {
        let mut staged = lock(&self.staged_parity);
        if let Some(entries) = staged.get_mut(&step) {
            entries
                .retain(|s| !(s.epoch == epoch && (attempt == 0 || s.request.attempt == attempt)));
            if entries.is_empty() {
                staged.remove(&step);
            }
        }
    }

    /// Takes the differences staged for `step` in `epoch`.
    fn take_staged_parity(&self, step: u64, epoch: u64) -> Vec<ParityUpdateRequest> {
        lock(&self.staged_parity)
            .remove(&step)
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.epoch == epoch)
            .map(|s| s.request)
            .collect()
    }

    /// The end of 2PC phase 1 (the pipeline's two-phase mode): the update is staged and
    /// its differences are staged at the parity holders; it waits here, with the commit
    /// turn, for phase 2.
    pub(crate) fn hold_prepared(
        &self,
        faults: &ftrec_faults::Faults,
        epoch: u64,
        staged: StagedUpdate,
        turn: OwnedMutexGuard<()>,
    ) -> Result<(), PsError> {
        let step = staged.step;
        faults.kill_at(points::PREPARE, Some(step));
        let mut prepared = lock(&self.prepared);
        // Under the lock the fence is raised under: a recovery that fenced this epoch finds
        // the step here (and decides it) or it is never prepared.
        if self.fenced_past(epoch) {
            return Err(self.fenced(epoch));
        }
        prepared.insert(
            step,
            Prepared {
                epoch,
                staged: Arc::new(staged),
                _turn: turn,
            },
        );
        drop(prepared);
        self.prepared_changed.notify_waiters();
        Ok(())
    }
}

impl Core {
    /// Folds (or stages, under 2PC) parity differences from a data server.
    pub(super) fn parity_update(&self, req: ParityUpdateRequest) -> Result<(), PsError> {
        self.pipeline.check_epoch(req.epoch)?;
        let ec = self.pipeline.ec()?;
        // Checked whole, up front, so a staged request folds without an error at commit
        // and a bad one changes nothing.
        validate_parity_update(&*self.pipeline.shard_read()?, &req)?;
        if req.staged {
            let mut staged = lock(&ec.staged_parity);
            // This server committed the step already, with every difference staged for it
            // then: a late or resent one has nothing left to join.
            if self.pipeline.steps().contains(req.step) {
                return Ok(());
            }
            let entries = staged.entry(req.step).or_default();
            // A retried update (its reply was lost) replaces the first: folding the same
            // difference twice would cancel it.
            entries.retain(|s| !(s.request.source == req.source && s.epoch == req.epoch));
            entries.push(StagedParity {
                epoch: req.epoch,
                request: req,
            });
            return Ok(());
        }
        let key = (req.source, req.step, req.epoch);
        let mut folded = lock(&ec.folded);
        if folded.contains(&key) {
            return Ok(());
        }
        let mut shard = self.pipeline.shard_write()?;
        apply_parity_difference(&mut shard, &req, &self.faults)?;
        folded.push_back(key);
        if folded.len() > 4096 {
            folded.pop_front();
        }
        Ok(())
    }

    /// 2PC phase 2, abort: drops what phase 1 prepared for `step` and the parity
    /// differences staged for it, by the try `attempt` only (0: by any try). An abort
    /// that lands late, once the step was granted again in the same epoch, would drop the
    /// new try's differences from a parity holder whose data servers then commit without
    /// them: a stripe whose parity no longer encodes it. Returns the applied-step count.
    pub(super) fn abort_step(&self, epoch: u64, step: u64, attempt: u64) -> Result<u64, PsError> {
        self.pipeline.check_epoch(epoch)?;
        let ec = self.pipeline.ec()?;
        let dropped = ec.take_prepared_try(step, epoch, attempt);
        ec.drop_staged_parity_try(step, epoch, attempt);
        tracing::debug!(
            "abort step {step} (try {attempt:x}) in epoch {epoch}: prepared here {}",
            dropped.is_some()
        );
        // Dropping the prepared update releases the commit turn.
        drop(dropped);
        Ok(self.pipeline.steps().count())
    }

    /// 2PC phase 2, commit: installs what phase 1 prepared for `step` with the parity
    /// differences staged for it. Returns the applied-step count.
    pub(super) async fn commit_step(&self, epoch: u64, step: u64) -> Result<u64, PsError> {
        self.pipeline.check_epoch(epoch)?;
        let ec = self.pipeline.ec()?;
        if ec.fenced_past(epoch) {
            return Err(ec.fenced(epoch));
        }
        // A slow member (`commit:N=delay-MS`): the decision is in, the install is late, and
        // a recovery may fence the epoch meanwhile: the check below, not the one above,
        // is the one that counts.
        if let Some(pause) = self
            .faults
            .delay_at(points::COMMIT, Some(step))
            .or_else(|| self.faults.delay_at(points::INSTALL, Some(step)))
        {
            tokio::time::sleep(pause).await;
        }
        self.faults.kill_at(points::COMMIT, Some(step));
        let (prepared, applied) = {
            let mut shard = self.pipeline.shard_write()?;
            // The epoch, the fence and the install are one step under this lock, which
            // every fence is raised under: a commit lands before a recovery's fence (which
            // then counts it applied) or is refused after it.
            self.pipeline.check_epoch(epoch)?;
            if ec.fenced_past(epoch) {
                return Err(ec.fenced(epoch));
            }
            let prepared = ec.take_prepared(step, epoch);
            let Some(prepared) = prepared else {
                if self.pipeline.steps().contains(step) {
                    // A retried commit whose first attempt went through.
                    return Ok(self.pipeline.steps().count());
                }
                return Err(PsError::NotPrepared {
                    server: self.id as u32,
                    step,
                    epoch,
                });
            };
            let parity = ec.take_staged_parity(step, epoch);
            let applied =
                self.pipeline
                    .install_locked(&mut shard, epoch, &prepared.staged, &parity)?;
            (prepared, applied)
        };
        self.pipeline.after_commit(&prepared.staged);
        // Dropping `prepared` here releases the commit turn for the next update.
        drop(prepared);
        Ok(applied)
    }

    /// Raises the fence to `epoch`: from now on no step of an older epoch is prepared or
    /// committed here. Under the shard's write lock, so no commit straddles it.
    pub(super) fn raise_fence(&self, epoch: u64) -> Result<(), PsError> {
        let Some(ec) = self.pipeline.ec_state() else {
            return Ok(());
        };
        let _shard = self.pipeline.shard_write()?;
        let _prepared = lock(&ec.prepared);
        ec.raise(epoch);
        Ok(())
    }

    /// A recovery decides what older epochs left prepared or staged here: the fence goes
    /// up to `epoch` (if it is not there yet), the steps in `finish` (committed on some
    /// server before the fence) are committed where prepared, with the differences staged
    /// for them, and everything else of older epochs is dropped.
    pub(super) fn settle_older_epochs(&self, epoch: u64, finish: &[u64]) -> Result<(), PsError> {
        let Some(ec) = self.pipeline.ec_state() else {
            return Ok(());
        };
        let mut finished = Vec::new();
        let mut dropped = Vec::new();
        {
            let mut shard = self.pipeline.shard_write()?;
            let mut prepared = lock(&ec.prepared);
            ec.raise(epoch);
            let older: Vec<u64> = prepared
                .iter()
                .filter(|(_, p)| p.epoch < epoch)
                .map(|(&step, _)| step)
                .collect();
            for step in older {
                let Some(p) = prepared.remove(&step) else {
                    continue;
                };
                if finish.contains(&step) {
                    let parity = ec.take_staged_parity(step, p.epoch);
                    let live = self.pipeline.live().epoch;
                    self.pipeline
                        .install_locked(&mut shard, live, &p.staged, &parity)?;
                    tracing::info!(
                        "step {step} of epoch {}: committed by the recovery",
                        p.epoch
                    );
                    finished.push(p);
                } else {
                    dropped.push(p);
                }
            }
            let mut staged = lock(&ec.staged_parity);
            for entries in staged.values_mut() {
                entries.retain(|s| s.epoch >= epoch);
            }
            staged.retain(|_, v| !v.is_empty());
        }
        for p in &finished {
            self.pipeline.after_commit(&p.staged);
        }
        // The turns they held go with them.
        drop(finished);
        drop(dropped);
        Ok(())
    }
}

/// Checks a parity update whole against this server's parity slots.
fn validate_parity_update(
    shard: &crate::shard::Shard,
    req: &ParityUpdateRequest,
) -> Result<(), PsError> {
    let Some(red) = shard.redundancy() else {
        return Err(PsError::Config("this server holds no parity".into()));
    };
    for t in &req.tables {
        let what = || {
            format!(
                "parity update from server {} for step {}, table {}",
                req.source, req.step, t.table
            )
        };
        if t.table == DENSE_TABLE {
            let stripes = bytes_to_u32s(&t.locals, "dense stripes")?;
            let ([stripe], [_]) = (stripes.as_slice(), &t.coefs[..]) else {
                return Err(PsError::BadRequest(format!(
                    "{}: a dense difference names {} stripes and {} coefficients",
                    what(),
                    stripes.len(),
                    t.coefs.len()
                )));
            };
            match red.dense_parity_row(*stripe as usize) {
                Some(row) if row.len() == t.deltas.len() => continue,
                Some(row) => {
                    return Err(PsError::BadRequest(format!(
                        "{}: {} difference bytes for dense rows of {}",
                        what(),
                        t.deltas.len(),
                        row.len()
                    )));
                }
                None => {
                    return Err(PsError::BadRequest(format!(
                        "{}: this server holds no parity of dense stripe {stripe}",
                        what()
                    )));
                }
            }
        }
        let locals = bytes_to_u32s(&t.locals, "parity slots")?;
        let Some(slots) = red.parity.get(t.table as usize) else {
            return Err(PsError::BadRequest(format!("{}: no such table", what())));
        };
        let capacity = slots.len() / red.row_bytes.max(1);
        if locals.len() != t.coefs.len() || t.deltas.len() != locals.len() * red.row_bytes {
            return Err(PsError::BadRequest(format!(
                "{}: {} slots, {} coefficients, {} difference bytes (rows of {} bytes)",
                what(),
                locals.len(),
                t.coefs.len(),
                t.deltas.len(),
                red.row_bytes
            )));
        }
        if let Some(bad) = locals.iter().find(|&&l| l as usize >= capacity) {
            return Err(PsError::BadRequest(format!(
                "{}: parity slot {bad} is outside this server's {capacity} slots",
                what()
            )));
        }
    }
    Ok(())
}
