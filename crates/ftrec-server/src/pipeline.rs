//! The server's one update pipeline. Every push reaches the tables through here, and only
//! through here: stage, pre-commit observers (which may await or veto), then a commit
//! decided by the [`CommitMode`], then post-commit observers.
//!
//! Two functions change state, and nothing else does:
//! - [`Core::install`] applies a staged update (rows, dense range, replica, applied steps),
//!   with the parity differences staged for the same step (its body, `install_locked`, is
//!   what 2PC's commit runs under the lock it checks the epoch fence under);
//! - [`apply_parity_difference`] folds one data server's differences into parity rows.
//!
//! Two-phase commit is a mode of this pipeline, not a second path: phase 1 runs the same
//! stages and parks the staged update with the commit turn (`ec.rs`); phase 2 calls
//! [`Core::install`] as an immediate commit does.

use ftrec_faults::points;
use ftrec_proto::proto::ParityUpdateRequest;
use ftrec_proto::wire::bytes_to_u32s;
use ftrec_rpc::PsError;

use crate::Core;
use crate::shard::dense_code::DENSE_TABLE;
use crate::shard::{Shard, StagedUpdate, Update};

/// How a staged update is decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CommitMode {
    /// Installed as soon as the pre-commit observers agree (no redundancy, or ECRec's
    /// one-round propagation).
    Immediate,
    /// 2PC phase 1: held, with the commit turn, until phase 2 commits or aborts it.
    TwoPhase,
}

/// What became of a push.
pub(crate) enum Pushed {
    /// Installed; the shard now holds this many steps, and the update changed these rows.
    Applied { steps: u64, rows: usize },
    /// The step was applied here already (a dead worker's step granted again): ignored.
    Duplicate { steps: u64 },
    /// 2PC phase 1 done: staged and held until phase 2.
    Prepared { rows: usize },
}

impl Core {
    pub(crate) async fn run_update(
        &self,
        epoch: u64,
        update: Update,
        mode: CommitMode,
    ) -> Result<Pushed, PsError> {
        let turn = match mode {
            CommitMode::Immediate => self.commit_turn.clone().lock_owned().await,
            CommitMode::TwoPhase => match self.turn_or_prepared(epoch, update.step).await? {
                Ok(turn) => turn,
                Err(staged) => {
                    // A retried phase 1, or the step granted again, finds it prepared
                    // already. Its differences go out again: an abort may have dropped
                    // them at the holders since (a phase 1 that finished after its worker
                    // gave up on it). Holders replace a resent difference: idempotent.
                    for observer in &self.pre_commit {
                        observer.pre_commit(&staged).await?;
                    }
                    return Ok(Pushed::Prepared { rows: 0 });
                }
            },
        };
        self.check_epoch(epoch)?;
        if self.steps().contains(update.step) {
            self.metrics.add("ftrec_duplicate_pushes_total", 1);
            return Ok(Pushed::Duplicate {
                steps: self.steps().count(),
            });
        }
        // A replacement rebuilding in the background decodes the rows this update needs
        // first (it holds the commit turn, so its own steps stand still meanwhile).
        self.materialize_update(&update).await?;
        let staged = self.shard_read()?.stage_owned(update)?;
        for observer in &self.pre_commit {
            // A veto aborts the update: the staged rows are dropped, nothing is installed.
            observer.pre_commit(&staged).await?;
        }
        let rows = staged.rows_changed();
        match mode {
            CommitMode::Immediate => {
                let steps = self.install(epoch, &staged, &[])?;
                drop(turn);
                Ok(Pushed::Applied { steps, rows })
            }
            CommitMode::TwoPhase => {
                // A slow member (`prepare:N=delay-MS`): its differences are out, its answer
                // is late; the worker may give up on it meanwhile.
                if let Some(pause) = self.faults.delay_at(points::PREPARE, Some(staged.step)) {
                    tokio::time::sleep(pause).await;
                }
                self.ec()?.hold_prepared(self, epoch, staged, turn)?;
                Ok(Pushed::Prepared { rows })
            }
        }
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

    /// [`Core::install`]'s change, under the shard's write lock the caller holds (2PC's
    /// commit checks the epoch fence under the same lock). The caller then runs
    /// [`Core::after_commit`].
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

    /// 2PC phase 1 waits for the commit turn, unless its step is (or becomes, while it
    /// waits) prepared here in `epoch`: then the turn is held by that very step, and the
    /// wait would last until the step is decided, which needs this call's answer. A
    /// retry that arrives while the first attempt is still running is the common case.
    async fn turn_or_prepared(
        &self,
        epoch: u64,
        step: u64,
    ) -> Result<Result<tokio::sync::OwnedMutexGuard<()>, std::sync::Arc<StagedUpdate>>, PsError>
    {
        let ec = self.ec()?;
        loop {
            let changed = ec.prepared_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(staged) = ec.prepared(step, epoch) {
                return Ok(Err(staged));
            }
            // Biased, as every select on a path the simulation drives: tokio picks among
            // ready branches at random otherwise, and a seed would not replay.
            tokio::select! {
                biased;
                turn = self.commit_turn.clone().lock_owned() => return Ok(Ok(turn)),
                _ = changed => {}
            }
        }
    }

    /// Decodes the pending rows an update touches (a replacement rebuilding in the
    /// background); nothing when no rebuild is under way.
    async fn materialize_update(&self, update: &Update) -> Result<(), PsError> {
        if self.shard_read()?.pending().is_none() {
            return Ok(());
        }
        let wanted: Vec<(usize, Vec<u32>)> = update
            .sparse
            .iter()
            .map(|(table, rows, _)| (*table, rows.clone()))
            .collect();
        self.materialize_tables(&wanted, true).await?;
        Ok(())
    }
}

/// Bad RAM (`install:N=flip`, a planted fault): one bit of the first row step N installed
/// flips after its parity differences went out, so its stripe no longer encodes. Not
/// while a background rebuild runs (the shard is replaced whole, which would end it); the
/// spec then stays armed.
fn flip_installed_row(
    shard: &mut Shard,
    staged: &StagedUpdate,
    faults: &ftrec_faults::Faults,
) -> Result<(), PsError> {
    if shard.pending().is_none() && faults.flip_at(points::INSTALL, Some(staged.step)) {
        // The lowest bit of the first value of the first row (the model trains on).
        // The shard has no row writer beside `Shard::commit`, so a copy of its state
        // with the bit flipped replaces it: costly, and only ever once, for a planted
        // fault.
        let first = staged
            .rows()
            .iter()
            .find_map(|rows| Some((rows.table, *rows.locals.first()?, *rows.globals.first()?)));
        if let Some((table, local, row)) = first {
            let mut state = shard.state().clone();
            let bits = &mut state.tables_mut()[table].row_mut(local as usize)[0];
            *bits = f32::from_bits(bits.to_bits() ^ 1);
            shard.replace_state(state)?;
            tracing::warn!(
                "fault install: flipped a bit of table {table} row {row} (server {} local \
                 slot {local}) at step {}",
                shard.server(),
                staged.step
            );
        } else {
            tracing::warn!(
                "fault install: step {} installed no embedding row; nothing flipped",
                staged.step
            );
        }
    }
    Ok(())
}

/// Folds every difference of `req` into the shard's parity slots: the one way a parity row
/// changes between rebuilds. `faults` may drop it (the planted bug `fold-parity=skip`, which
/// the parity checks must catch).
pub(crate) fn apply_parity_difference(
    shard: &mut Shard,
    req: &ParityUpdateRequest,
    faults: &ftrec_faults::Faults,
) -> Result<(), PsError> {
    if faults.skip_at(points::FOLD_PARITY, Some(req.step)) {
        tracing::warn!(
            "fault fold-parity: dropped step {}'s parity difference from server {}",
            req.step,
            req.source
        );
        return Ok(());
    }
    let Some(red) = shard.redundancy() else {
        return Err(PsError::Config("this server holds no parity".into()));
    };
    let row_bytes = red.row_bytes;
    // `fold-parity:N=flip`: asked once, at the first parity row this request folds.
    let mut flip_asked = false;
    for t in &req.tables {
        let locals = bytes_to_u32s(&t.locals, "parity slots")?;
        if t.table == DENSE_TABLE {
            let (Some(&stripe), Some(&coef)) = (locals.first(), t.coefs.first()) else {
                return Err(PsError::BadRequest("an empty dense difference".into()));
            };
            let Some(red) = shard.redundancy_mut() else {
                return Err(PsError::Config("this server holds no parity".into()));
            };
            red.fold_dense(stripe as usize, coef, &t.deltas)?;
            continue;
        }
        for (n, (&local, &coef)) in locals.iter().zip(t.coefs.iter()).enumerate() {
            let delta = t
                .deltas
                .get(n * row_bytes..(n + 1) * row_bytes)
                .ok_or_else(|| PsError::BadRequest("parity differences are short".into()))?;
            // A slot still being rebuilt is encoded from data rows that hold this
            // difference already (`degraded.rs`).
            if shard.parity_pending(t.table as usize, local as usize) {
                continue;
            }
            let flip = !flip_asked && faults.flip_at(points::FOLD_PARITY, Some(req.step));
            flip_asked = true;
            let server = shard.server();
            let Some(red) = shard.redundancy_mut() else {
                return Err(PsError::Config("this server holds no parity".into()));
            };
            if flip {
                // A parity row silently corrupted: the difference folds with one bit
                // flipped (the top bit of its first byte, so that it never cancels an
                // `install` flip of the same stripe, which flips the lowest), and the row
                // no longer encodes its stripe.
                let mut flipped = delta.to_vec();
                if let Some(first) = flipped.first_mut() {
                    *first ^= 0x80;
                }
                red.fold(t.table as usize, local as usize, coef, &flipped)?;
                tracing::warn!(
                    "fault fold-parity: flipped a bit of step {}'s difference from server {} \
                     into table {} parity slot {local} (server {server})",
                    req.step,
                    req.source,
                    t.table
                );
                continue;
            }
            red.fold(t.table as usize, local as usize, coef, delta)?;
        }
    }
    Ok(())
}
