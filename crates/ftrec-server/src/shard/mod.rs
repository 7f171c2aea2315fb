//! One server's part of the model and the update pipeline every push goes through.
//!
//! The shard is stored as a [`ModelState`] of a *shard configuration* (the global model with
//! each table cut to the rows this server owns), so the checkpoint engine writes and
//! restores it unchanged. The server's dense range is packed at the front of the dense
//! buffers: parameters `[0, len)`, optimizer state `[0, state_len(len))` laid out as the
//! optimizer lays out a `len`-parameter model (Adam: `m` then `v`).
//!
//! The pipeline, built for the fault-tolerance layers that plug into it (the server runs
//! it on every push: stage, pre-commit observers, commit, post-commit observers):
//! - [`Shard::stage`] computes the new rows of an update, keeping their old bytes beside
//!   them, without touching the shard; [`Shard::commit`] installs them (or the staged
//!   update is dropped: abort). A [`PreCommit`] observer sees the whole staged update
//!   between the two and may await or veto (ECRec sends `old XOR new` to parity holders);
//!   a [`PostCommit`] observer sees the rows installed (delta tracking for checkpoints).
//! - [`Shard::commit`] is the only writer of rows and the dense range; the server calls it
//!   from one place (`Core::install`, `pipeline.rs`).

use std::ops::Range;

use ftrec_model::{DenseState, EmbeddingTable, ModelConfig, ModelState, Optimizer};

pub mod dense_code;
mod pending;
mod redundancy;

pub use pending::Pending;
pub use redundancy::{DenseReplica, Redundancy};

use ftrec_proto::placement::{GlobalRow, Layout};
use ftrec_rpc::PsError;

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
/// state]`, `stride` words each), before and after.
#[derive(Clone, Debug, Default)]
pub struct StagedRows {
    pub table: usize,
    pub globals: Vec<u32>,
    pub locals: Vec<u32>,
    pub old: Vec<f32>,
    pub new: Vec<f32>,
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
}

impl StagedUpdate {
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

pub struct Shard {
    server: usize,
    layout: Layout,
    global: ModelConfig,
    state: ModelState,
    dense_range: Range<usize>,
    /// Parity rows and the dense replica this server keeps for others (erasure coding).
    redundancy: Option<Redundancy>,
    /// A replacement rebuilding in the background: the slots not yet decoded.
    pending: Option<Pending>,
}

/// A shard configuration's dense state holding one server's range packed at the front:
/// `params`, then `state` (the optimizer's layout for that many parameters), zeros after.
pub(crate) fn packed_dense(
    config: &ModelConfig,
    seed: u64,
    params: &[f32],
    state: &[f32],
    step: u64,
) -> Result<DenseState, PsError> {
    let mut dense = DenseState::initial(config, seed)?;
    if params.len() > dense.params.len() || state.len() > dense.optimizer_state.len() {
        return Err(PsError::BadRequest(format!(
            "a dense range of {} parameters and {} state values does not fit a model of {} and {}",
            params.len(),
            state.len(),
            dense.params.len(),
            dense.optimizer_state.len()
        )));
    }
    dense.params.fill(0.0);
    dense.optimizer_state.fill(0.0);
    dense.params[..params.len()].copy_from_slice(params);
    dense.optimizer_state[..state.len()].copy_from_slice(state);
    dense.step = step;
    Ok(dense)
}

impl Shard {
    /// The configuration of `server`'s shard: the global model with each table holding the
    /// rows the placement gives the server.
    pub fn shard_config(
        global: &ModelConfig,
        layout: Layout,
        server: usize,
    ) -> Result<ModelConfig, PsError> {
        let mut config = global.clone();
        for (t, rows) in config.table_rows.iter_mut().enumerate() {
            if *rows < 2 * layout.servers() {
                return Err(PsError::Config(format!(
                    "model.table_rows[{t}] = {rows}: each of the {} servers needs at least 2 rows of every table",
                    layout.servers()
                )));
            }
            *rows = layout.local_rows(t, server, *rows);
        }
        Ok(config)
    }

    /// The initial shard: the rows and dense range a single-process model initialised from
    /// `seed` has, bit for bit.
    pub fn initial(
        global: &ModelConfig,
        seed: u64,
        layout: Layout,
        server: usize,
    ) -> Result<Self, PsError> {
        let config = Self::shard_config(global, layout, server)?;
        let stride = global.row_stride();
        let stripes = layout.stripes();
        let mut redundancy = match stripes {
            Some(_) => Some(Redundancy::empty(global, layout, server)?),
            None => None,
        };
        let mut tables = Vec::with_capacity(global.tables());
        for t in 0..global.tables() {
            let local_rows = config.table_rows[t];
            let mut data = vec![0.0f32; local_rows * stride];
            redundancy::for_each_initial_row(global, seed, t, |r, row| {
                let g = GlobalRow(r as u32);
                let (owner, local) = layout.primary(t, g);
                if owner == server {
                    let local = local.index();
                    data[local * stride..(local + 1) * stride].copy_from_slice(row);
                }
                if let (Some(red), Some(stripes)) = (&mut redundancy, &stripes) {
                    red.fold_initial(stripes, server, t, r, bytemuck::cast_slice(row));
                }
            });
            tables.push(
                EmbeddingTable::from_data(local_rows, global.dim, stride, data)
                    .ok_or_else(|| PsError::Config("shard table shape".into()))?,
            );
        }
        let full = DenseState::initial(global, seed)?;
        if let Some(red) = &mut redundancy {
            red.replica = Redundancy::initial_replica(global, layout, server, &full)?;
            red.init_dense_parity(global, layout, server, &full)?;
        }
        let range = layout.dense_range(server, full.params.len());
        let mut range_state = vec![0.0f32; global.dense_optimizer.dense_state_len(range.len())?];
        global.dense_optimizer.init_dense_state(&mut range_state);
        let dense = packed_dense(&config, seed, &full.params[range], &range_state, full.step)?;
        let state = ModelState::from_parts(config, tables, dense)?;
        let mut shard = Self::from_state(global, layout, server, state)?;
        shard.redundancy = redundancy;
        Ok(shard)
    }

    /// An erasure-coded replacement's shard before its rebuild: the right shape, zeros,
    /// without generating the initial tables (the rebuild overwrites every slot).
    pub fn awaiting_rebuild(
        global: &ModelConfig,
        seed: u64,
        layout: Layout,
        server: usize,
    ) -> Result<Self, PsError> {
        let config = Self::shard_config(global, layout, server)?;
        let stride = global.row_stride();
        let tables = config
            .table_rows
            .iter()
            .map(|&rows| {
                EmbeddingTable::from_data(rows, global.dim, stride, vec![0.0; rows * stride])
                    .ok_or_else(|| PsError::Config("shard table shape".into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let dense = DenseState::initial(&config, seed)?;
        let state = ModelState::from_parts(config, tables, dense)?;
        let mut shard = Self::from_state(global, layout, server, state)?;
        let mut redundancy = Redundancy::empty(global, layout, server)?;
        let full = DenseState::initial(global, seed)?;
        redundancy.replica = Redundancy::initial_replica(global, layout, server, &full)?;
        shard.redundancy = Some(redundancy);
        Ok(shard)
    }

    /// A shard around a restored state, which must have this server's shard configuration.
    pub fn from_state(
        global: &ModelConfig,
        layout: Layout,
        server: usize,
        state: ModelState,
    ) -> Result<Self, PsError> {
        let config = Self::shard_config(global, layout, server)?;
        if state.config() != &config {
            return Err(PsError::Config(format!(
                "the state is not server {server}'s shard of this model (another shard, server count or model)"
            )));
        }
        let total = ftrec_model::MlpSpec::dlrm_pair(global).1.end();
        Ok(Self {
            server,
            layout,
            global: global.clone(),
            dense_range: layout.dense_range(server, total),
            state,
            redundancy: None,
            pending: None,
        })
    }

    pub fn server(&self) -> usize {
        self.server
    }

    pub fn state(&self) -> &ModelState {
        &self.state
    }

    pub fn dense_range(&self) -> Range<usize> {
        self.dense_range.clone()
    }

    fn dense_state_len(&self) -> usize {
        // Validated at construction: the global dense optimizer accepts this length.
        self.global
            .dense_optimizer
            .dense_state_len(self.dense_range.len())
            .unwrap_or(0)
    }

    pub fn dense_params(&self) -> &[f32] {
        &self.state.dense.params[..self.dense_range.len()]
    }

    pub fn dense_optimizer_state(&self) -> &[f32] {
        &self.state.dense.optimizer_state[..self.dense_state_len()]
    }

    /// xxh3 of the shard exactly as `gather` hashes what it fetches: each table's local
    /// rows in order, then the dense range, its optimizer state and the dense step.
    pub fn digest(&self) -> String {
        let mut hash = xxhash_rust::xxh3::Xxh3::new();
        for table in self.state().tables() {
            hash.update(table.as_bytes());
        }
        hash.update(bytemuck::cast_slice(self.dense_params()));
        hash.update(bytemuck::cast_slice(self.dense_optimizer_state()));
        hash.update(&self.dense_step().to_le_bytes());
        format!("{:016x}", hash.digest())
    }

    pub fn dense_step(&self) -> u64 {
        self.state.dense.step
    }

    fn local(&self, table: usize, row: u32) -> Result<usize, PsError> {
        let rows = self
            .global
            .table_rows
            .get(table)
            .ok_or_else(|| PsError::BadRequest(format!("table {table} does not exist")))?;
        if row as usize >= *rows {
            return Err(PsError::BadRequest(format!(
                "row {row} is outside table {table} ({rows} rows)"
            )));
        }
        let (owner, local) = self.layout.primary(table, GlobalRow(row));
        if owner != self.server {
            return Err(PsError::NotOwner {
                table: table as u32,
                row,
                owner: owner as u32,
            });
        }
        Ok(local.index())
    }

    /// Appends the embeddings (not the optimizer state) of `rows` of `table`, as f32 LE.
    pub fn gather(&self, table: usize, rows: &[u32], out: &mut Vec<u8>) -> Result<(), PsError> {
        let dim = self.global.dim;
        out.reserve(rows.len() * dim * 4);
        for &row in rows {
            let local = self.local(table, row)?;
            self.check_not_pending(table, row, local)?;
            let emb = self.state.tables()[table].embedding(local);
            out.extend_from_slice(bytemuck::cast_slice(emb));
        }
        Ok(())
    }

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
            let mut out = StagedRows {
                table: *table,
                globals: Vec::with_capacity(rows.len()),
                locals: Vec::with_capacity(rows.len()),
                old: Vec::with_capacity(rows.len() * stride),
                new: Vec::with_capacity(rows.len() * stride),
            };
            for (&row, grad) in rows.iter().zip(grads.chunks_exact(dim)) {
                let local = self.local(*table, row)?;
                self.check_not_pending(*table, row, local)?;
                let current = stored.row(local);
                out.old.extend_from_slice(current);
                let start = out.new.len();
                out.new.extend_from_slice(current);
                optimizer.apply_row(&mut out.new[start..], grad);
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

    /// Parity rows and dense replica (erasure coding only).
    pub fn redundancy(&self) -> Option<&Redundancy> {
        self.redundancy.as_ref()
    }

    pub fn redundancy_mut(&mut self) -> Option<&mut Redundancy> {
        self.redundancy.as_mut()
    }

    /// Installs a rebuilt shard: rows, dense range, parity and replica (erasure coding).
    pub fn install_rebuilt(
        &mut self,
        state: ModelState,
        redundancy: Redundancy,
    ) -> Result<(), PsError> {
        self.replace_state(state)?;
        self.redundancy = Some(redundancy);
        Ok(())
    }

    /// Replaces the parity rows and dense replica (re-derived after a rollback).
    pub fn set_redundancy(&mut self, redundancy: Redundancy) {
        self.redundancy = Some(redundancy);
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn global_config(&self) -> &ModelConfig {
        &self.global
    }

    /// Replaces the whole state (a restore). The state must be this server's shard.
    pub fn replace_state(&mut self, state: ModelState) -> Result<(), PsError> {
        let config = Self::shard_config(&self.global, self.layout, self.server)?;
        if state.config() != &config {
            return Err(PsError::Config(format!(
                "the restored state is not server {}'s shard",
                self.server
            )));
        }
        self.state = state;
        self.pending = None;
        Ok(())
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

#[cfg(test)]
pub(crate) mod tests;
