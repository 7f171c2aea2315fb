//! The server's one update pipeline. Every push reaches the tables through here, and only
//! through here: stage, pre-commit observers (which may await or veto), then a commit
//! decided by the [`CommitMode`], then post-commit observers.
//!
//! Two functions change state, and nothing else does:
//! - [`UpdatePipeline::install`] (`state.rs`) applies a staged update (rows, dense range,
//!   replica, applied steps), with the parity differences staged for the same step (its
//!   body, `install_locked`, is what 2PC's commit runs under the lock it checks the epoch
//!   fence under);
//! - [`apply_parity_difference`] folds one data server's differences into parity rows.
//!
//! Two-phase commit is a mode of this pipeline, not a second path: phase 1 runs the same
//! stages and parks the staged update with the commit turn (`ec/mod.rs`); phase 2 calls
//! [`UpdatePipeline::install`] as an immediate commit does.
//!
//! `state.rs` holds the pipeline's state ([`UpdatePipeline`]); this file drives an update
//! through it, with what else of the server an update needs (a background rebuild decodes
//! the rows it touches first).

mod state;

pub(crate) use state::{Live, UpdatePipeline};

use ftrec_faults::points;
use ftrec_proto::proto::ParityUpdateRequest;
use ftrec_proto::wire::bytes_to_u32s;
use ftrec_rpc::PsError;

use crate::Core;
use crate::shard::dense_code::DENSE_TABLE;
use crate::shard::{PREFETCH_AHEAD, Shard, StagedUpdate, Update};

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
            CommitMode::Immediate => self.pipeline.owned_turn().await,
            CommitMode::TwoPhase => match self
                .turn_or_prepared(epoch, update.step, update.attempt)
                .await?
            {
                Ok(turn) => turn,
                Err((staged, propagated)) => {
                    // A retried phase 1, or the step granted again, finds it prepared
                    // already. A new try's differences go out again under its tag: an
                    // abort of the old try may have dropped them at the holders since (a
                    // phase 1 that finished after its worker gave up on it). Holders
                    // replace a resent difference: idempotent. A copy of the try that
                    // prepared it (a hedged call, whose first answer was lost on a lossy
                    // link) answers at once: resending cost it another crossing of that
                    // link, and a copy of a prepare was no faster than the prepare.
                    if !propagated {
                        self.pipeline.pre_commit(&staged).await?;
                        staged.mark_propagated(update.attempt);
                    }
                    return Ok(Pushed::Prepared { rows: 0 });
                }
            },
        };
        let pipeline = &self.pipeline;
        pipeline.check_epoch(epoch)?;
        if pipeline.steps().contains(update.step) {
            self.metrics.add("ftrec_duplicate_pushes_total", 1);
            return Ok(Pushed::Duplicate {
                steps: pipeline.steps().count(),
            });
        }
        // A replacement rebuilding in the background decodes the rows this update needs
        // first (it holds the commit turn, so its own steps stand still meanwhile).
        self.materialize_update(&update).await?;
        let staged = pipeline.shard_read()?.stage_owned(update)?;
        // A veto aborts the update: the staged rows are dropped, nothing is installed.
        pipeline.pre_commit(&staged).await?;
        staged.mark_propagated(staged.attempt());
        let rows = staged.rows_changed();
        match mode {
            CommitMode::Immediate => {
                // A slow install (`install:N=delay-MS`): step N is held, the commit turn
                // with it, so the job stands still there for as long (a test's window).
                if let Some(pause) = self.faults.delay_at(points::INSTALL, Some(staged.step)) {
                    tokio::time::sleep(pause).await;
                }
                let steps = pipeline.install(epoch, &staged, &[])?;
                drop(turn);
                Ok(Pushed::Applied { steps, rows })
            }
            CommitMode::TwoPhase => {
                // A slow member (`prepare:N=delay-MS`): its differences are out, its answer
                // is late; the worker may give up on it meanwhile.
                if let Some(pause) = self.faults.delay_at(points::PREPARE, Some(staged.step)) {
                    tokio::time::sleep(pause).await;
                }
                pipeline
                    .ec()?
                    .hold_prepared(&self.faults, epoch, staged, turn)?;
                Ok(Pushed::Prepared { rows })
            }
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
        attempt: u64,
    ) -> Result<
        Result<tokio::sync::OwnedMutexGuard<()>, (std::sync::Arc<StagedUpdate>, bool)>,
        PsError,
    > {
        let ec = self.pipeline.ec()?;
        loop {
            let changed = ec.prepared_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(staged) = ec.adopt_prepared(step, epoch, attempt) {
                return Ok(Err(staged));
            }
            // Biased, as every select on a path the simulation drives: tokio picks among
            // ready branches at random otherwise, and a seed would not replay.
            tokio::select! {
                biased;
                turn = self.pipeline.owned_turn() => return Ok(Ok(turn)),
                _ = changed => {}
            }
        }
    }

    /// Decodes the pending rows an update touches (a replacement rebuilding in the
    /// background); nothing when no rebuild is under way.
    async fn materialize_update(&self, update: &Update) -> Result<(), PsError> {
        if self.pipeline.shard_read()?.pending().is_none() {
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
            if let (Some(&ahead), Some(red)) = (locals.get(n + PREFETCH_AHEAD), shard.redundancy())
            {
                red.prefetch_slot(t.table as usize, ahead as usize);
            }
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
