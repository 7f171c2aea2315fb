//! The pipeline's seams on the shard: an update decoded from a push is *staged* (its new
//! rows computed beside the old ones, nothing changed) and later *committed* (installed) or
//! dropped. [`Shard::commit`] is the only writer of rows and the dense range.

use std::sync::atomic::{AtomicU64, Ordering};

use ftrec_model::Optimizer;
use ftrec_rpc::PsError;

use super::{Shard, dense_code};

/// Sees a staged update before it is installed. It may await (ECRec: parity differences
/// sent to their holders and acknowledged) and may veto the update with an error, which
/// aborts it: nothing of it is installed.
#[tonic::async_trait]
pub trait PreCommit: Send + Sync {
    async fn pre_commit(&self, staged: &StagedUpdate) -> Result<(), PsError>;
}

/// Sees the rows an update installed, before the push
/// is acknowledged.
pub trait PostCommit: Send + Sync {
    fn post_commit(&self, rows: &[StagedRows]);
}

/// The rows of one table an update changes: whole rows (`[embedding | optimizer
/// state]`, `stride` words each) as they will be.
#[derive(Clone, Debug, Default)]
pub struct StagedRows {
    pub table: usize,
    pub globals: Vec<u32>,
    pub locals: Vec<u32>,
    pub new: Vec<f32>,
    /// Erasure coded: each row's `old XOR new` bit pattern, `stride` words a row, what
    /// goes to its parity holders (ECRec §3.2); empty otherwise. Taken while the old row
    /// is in cache, so the old values are never copied out and read again.
    pub delta: Vec<u32>,
}

impl StagedRows {
    /// Row `n`'s difference as bytes (erasure coded only), `None` if the row is unchanged.
    pub fn changed_delta(&self, n: usize, stride: usize) -> Option<&[u8]> {
        let words = self.delta.get(n * stride..(n + 1) * stride)?;
        words
            .iter()
            .any(|&w| w != 0)
            .then(|| bytemuck::cast_slice(words))
    }
}

/// The gradients of one push, as decoded from the wire.
#[derive(Clone, Debug, Default)]
pub struct Update {
    pub step: u64,
    /// Per entry: table, global rows (ascending), gradients (`dim` per row).
    pub sparse: Vec<(usize, Vec<u32>, Vec<f32>)>,
    pub dense: Vec<f32>,
    /// Erasure coding: the gradient of the dense range this server replicates.
    pub replica_dense: Vec<f32>,
    /// 2PC: the try of the step (`PushRequest.attempt`; 0: not known).
    pub attempt: u64,
}

impl Update {
    /// The update a push carries, and its payload bytes. Only lengths are checked here;
    /// [`Shard::stage`] checks tables, rows and shapes against the shard.
    pub fn from_push(req: &ftrec_proto::proto::PushRequest) -> Result<(Self, usize), PsError> {
        use ftrec_proto::wire::{bytes_to_f32s, bytes_to_u32s};
        let mut in_bytes = req.dense.len();
        let mut update = Update {
            step: req.step,
            dense: bytes_to_f32s(&req.dense, "push dense gradient")?,
            replica_dense: bytes_to_f32s(&req.replica_dense, "push replica dense gradient")?,
            sparse: Vec::with_capacity(req.tables.len()),
            attempt: req.attempt,
        };
        for t in &req.tables {
            in_bytes += t.rows.len() + t.grads.len();
            update.sparse.push((
                t.table as usize,
                bytes_to_u32s(&t.rows, "push rows")?,
                bytes_to_f32s(&t.grads, "push gradients")?,
            ));
        }
        Ok((update, in_bytes))
    }
}

/// How [`Shard::commit`] changes a dense range (the server's own, or the replica it keeps).
#[derive(Debug)]
enum StagedDense {
    /// The optimizer runs at commit, in place, on this gradient. Nothing needs the new
    /// values before then (no parity difference of the range goes out), and the commit
    /// turn, held from stage to commit, keeps the range as staged meanwhile: the result is
    /// bit for bit what staging it would give, without copying the range and its
    /// optimizer state (Adam: three times the parameters) out and back on every step.
    /// `step` is the range's dense step at stage, checked at install.
    Gradient { grad: Vec<f32>, step: u64 },
    /// The new values, computed at stage: the dense range is coded, and its difference
    /// goes to the parity holders before the commit.
    Values { params: Vec<f32>, state: Vec<f32> },
}

impl Default for StagedDense {
    fn default() -> Self {
        Self::Gradient {
            grad: Vec::new(),
            step: 0,
        }
    }
}

/// What [`Shard::stage`] decided, not yet visible.
#[derive(Debug, Default)]
pub struct StagedUpdate {
    pub step: u64,
    rows: Vec<StagedRows>,
    dense: StagedDense,
    /// The dense replica's update.
    replica: Option<StagedDense>,
    /// Dense ranges coded (`ec.replicate_dense = false`): the dense row's `old XOR new`.
    dense_delta: Option<Vec<u8>>,
    /// 2PC: the try of the step this update is prepared for. A step granted again in the
    /// same epoch finds its first try's update prepared and adopts it (a new try number,
    /// its differences sent again under it), so an abort of the first try that lands late
    /// no longer matches it.
    attempt: AtomicU64,
    /// The try whose differences every parity holder acknowledged since the update was
    /// last adopted by another try (0: none). A copy of that very try (a hedged or retried
    /// phase 1) then has nothing to send again: its differences, under its own tag, are
    /// staged at the holders already, and only an abort of that same try, whose worker
    /// never commits it, could have dropped them.
    propagated: AtomicU64,
}

impl StagedUpdate {
    /// The try of the step this update is prepared for (0: not known).
    pub fn attempt(&self) -> u64 {
        self.attempt.load(Ordering::Relaxed)
    }

    /// A later try of the same step adopts this prepared update. Returns whether the
    /// try's differences are at every holder already ([`StagedUpdate::propagated`]).
    /// The caller serializes adoptions (`EcState::adopt_prepared` takes them under the
    /// prepared map's lock), so the check and the retag are one step.
    pub fn adopt(&self, attempt: u64) -> bool {
        if attempt == 0 {
            return false;
        }
        if self.attempt.swap(attempt, Ordering::SeqCst) == attempt {
            return self.propagated.load(Ordering::SeqCst) == attempt;
        }
        // Another try's tag: whatever was acknowledged was under that tag.
        self.propagated.store(0, Ordering::SeqCst);
        false
    }

    /// Every parity holder acknowledged the differences sent under the try `attempt`.
    /// Marked only while that is still the update's try. A retag racing with this mark
    /// leaves `propagated` naming a try that is not `attempt` any more, which no
    /// [`StagedUpdate::adopt`] takes for acknowledged: a copy then sends again, as before.
    pub fn mark_propagated(&self, attempt: u64) {
        if attempt != 0 && self.attempt() == attempt {
            self.propagated.store(attempt, Ordering::SeqCst);
        }
    }

    pub fn rows_changed(&self) -> usize {
        self.rows.iter().map(|r| r.locals.len()).sum()
    }

    /// The changed rows, per table.
    pub fn rows(&self) -> &[StagedRows] {
        &self.rows
    }

    /// Dense ranges coded: the difference of this server's dense row.
    pub fn dense_delta(&self) -> Option<&[u8]> {
        self.dense_delta.as_deref()
    }
}

impl Shard {
    /// Computes the update's new rows (and, dense ranges coded, the new dense range)
    /// without changing the shard.
    pub fn stage(&self, update: &Update) -> Result<StagedUpdate, PsError> {
        let dense = (update.dense.clone(), update.replica_dense.clone());
        self.stage_with(update, dense)
    }

    /// [`Shard::stage`], keeping the update's dense gradients rather than copying them
    /// (the pipeline's path: it has no further use for the update).
    pub fn stage_owned(&self, mut update: Update) -> Result<StagedUpdate, PsError> {
        let dense = (
            std::mem::take(&mut update.dense),
            std::mem::take(&mut update.replica_dense),
        );
        self.stage_with(&update, dense)
    }

    /// `dense` is the update's own and replica dense gradients, taken out of `update`.
    fn stage_with(
        &self,
        update: &Update,
        (dense, replica_dense): (Vec<f32>, Vec<f32>),
    ) -> Result<StagedUpdate, PsError> {
        let dim = self.global.dim;
        let optimizer: Optimizer = self.global.sparse_optimizer;
        let mut staged = StagedUpdate {
            step: update.step,
            attempt: AtomicU64::new(update.attempt),
            propagated: AtomicU64::new(0),
            ..Default::default()
        };
        for (table, rows, grads) in &update.sparse {
            if grads.len() != rows.len() * dim {
                return Err(PsError::BadRequest(format!(
                    "table {table}: {} gradient values for {} rows of dim {dim}",
                    grads.len(),
                    rows.len()
                )));
            }
            let Some(stored) = self.state.tables().get(*table) else {
                return Err(PsError::BadRequest(format!("table {table} does not exist")));
            };
            // Each row once: two updates of one row staged from the same stored value
            // would keep only the last, while its parity folded both differences.
            if let Some(w) = rows.windows(2).find(|w| w[0] >= w[1]) {
                return Err(PsError::BadRequest(format!(
                    "table {table}: rows must be strictly ascending, got {} then {}",
                    w[0], w[1]
                )));
            }
            let stride = stored.stride();
            let coded = self.layout.stripes().is_some();
            let mut out = StagedRows {
                table: *table,
                globals: Vec::with_capacity(rows.len()),
                locals: Vec::with_capacity(rows.len()),
                new: Vec::with_capacity(rows.len() * stride),
                delta: Vec::with_capacity(if coded { rows.len() * stride } else { 0 }),
            };
            let locals = self.locals_of(*table, rows)?;
            for (n, ((&row, &local), grad)) in rows
                .iter()
                .zip(&locals)
                .zip(grads.chunks_exact(dim))
                .enumerate()
            {
                if let Some(&ahead) = locals.get(n + super::PREFETCH_AHEAD) {
                    ftrec_model::prefetch::prefetch_read(stored.row(ahead));
                }
                let current = stored.row(local);
                let start = out.new.len();
                out.new.extend_from_slice(current);
                optimizer.apply_row(&mut out.new[start..], grad);
                if coded {
                    out.delta.extend(
                        current
                            .iter()
                            .zip(&out.new[start..])
                            .map(|(old, new)| old.to_bits() ^ new.to_bits()),
                    );
                }
                out.globals.push(row);
                out.locals.push(local as u32);
            }
            staged.rows.push(out);
        }
        let len = self.dense_range.len();
        if dense.len() != len {
            return Err(PsError::BadRequest(format!(
                "dense gradient has {} values, server {} holds {len} parameters",
                dense.len(),
                self.server
            )));
        }
        staged.dense = if self.layout.dense_coded() {
            let mut params = self.dense_params().to_vec();
            let mut state = self.dense_optimizer_state().to_vec();
            let mut step = self.state.dense.step;
            self.global
                .dense_optimizer
                .apply_dense(&mut params, &mut state, &dense, &mut step);
            let len = dense_code::row_len(&self.global, self.layout, self.server)?;
            let old = dense_code::pack(
                self.dense_params(),
                self.dense_optimizer_state(),
                self.state.dense.step,
                len,
            );
            // `commit` advances the dense step by one.
            let new = dense_code::pack(&params, &state, self.state.dense.step + 1, len);
            let mut delta = vec![0u8; len];
            ftrec_ec::xor_into(&old, &new, &mut delta);
            staged.dense_delta = Some(delta);
            StagedDense::Values { params, state }
        } else {
            StagedDense::Gradient {
                grad: dense,
                step: self.state.dense.step,
            }
        };
        if let Some(replica) = self.redundancy.as_ref().and_then(|r| r.replica.as_ref()) {
            if replica_dense.len() != replica.range.len() {
                return Err(PsError::BadRequest(format!(
                    "replica dense gradient has {} values, server {} replicates {} parameters of server {}",
                    replica_dense.len(),
                    self.server,
                    replica.range.len(),
                    replica.of
                )));
            }
            staged.replica = Some(StagedDense::Gradient {
                grad: replica_dense,
                step: replica.step,
            });
        }
        Ok(staged)
    }

    /// Installs a staged update.
    pub fn commit(&mut self, staged: &StagedUpdate) {
        for rows in &staged.rows {
            let stored = &mut self.state.tables_mut()[rows.table];
            let stride = stored.stride();
            for (&local, new) in rows.locals.iter().zip(rows.new.chunks_exact(stride)) {
                stored.row_mut(local as usize).copy_from_slice(new);
            }
        }
        let len = self.dense_range.len();
        let state_len = self.dense_state_len();
        let dense = &mut self.state.dense;
        apply_staged_dense(
            &self.global.dense_optimizer,
            &staged.dense,
            &mut dense.params[..len],
            &mut dense.optimizer_state[..state_len],
            &mut dense.step,
        );
        if let (Some(update), Some(replica)) = (
            &staged.replica,
            self.redundancy.as_mut().and_then(|r| r.replica.as_mut()),
        ) {
            apply_staged_dense(
                &self.global.dense_optimizer,
                update,
                &mut replica.params,
                &mut replica.state,
                &mut replica.step,
            );
        }
    }

    /// Whether the dense ranges are as `staged` found them (a staged gradient applies only
    /// to the values it was staged against).
    pub fn dense_unchanged_since(&self, staged: &StagedUpdate) -> bool {
        let own = match staged.dense {
            StagedDense::Gradient { step, .. } => step == self.state.dense.step,
            StagedDense::Values { .. } => true,
        };
        let replica = match (
            &staged.replica,
            self.redundancy.as_ref().and_then(|r| r.replica.as_ref()),
        ) {
            (Some(StagedDense::Gradient { step, .. }), Some(replica)) => *step == replica.step,
            _ => true,
        };
        own && replica
    }
}

/// Installs one staged dense change: runs the optimizer in place, or copies the values
/// staged. Advances `step` by one either way.
fn apply_staged_dense(
    optimizer: &Optimizer,
    staged: &StagedDense,
    params: &mut [f32],
    state: &mut [f32],
    step: &mut u64,
) {
    match staged {
        StagedDense::Gradient { grad, .. } => optimizer.apply_dense(params, state, grad, step),
        StagedDense::Values {
            params: new_params,
            state: new_state,
        } => {
            params.copy_from_slice(new_params);
            state.copy_from_slice(new_state);
            *step += 1;
        }
    }
}
