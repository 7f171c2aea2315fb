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
//!   from one place (`UpdatePipeline::install`, `pipeline/state.rs`). Staging and committing
//!   live in `stage.rs`.

use std::ops::Range;

use ftrec_model::{DenseState, EmbeddingTable, ModelConfig, ModelState};

pub mod dense_code;
mod pending;
mod redundancy;
mod stage;

pub use pending::Pending;
pub use redundancy::{DenseReplica, Redundancy};
pub use stage::{PostCommit, PreCommit, StagedRows, StagedUpdate, Update};

/// How many rows ahead a loop over a table's rows asks for them (`prefetch_read`): far
/// enough to cover a memory latency with the work on the rows between, near enough that
/// they are still in cache when their turn comes.
pub(crate) const PREFETCH_AHEAD: usize = 8;

use ftrec_proto::placement::{GlobalRow, Layout};
use ftrec_rpc::PsError;

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
    /// A replacement's zeros, until a rebuild or a restore installs the slot's rows.
    awaiting_rows: bool,
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

/// The optimizer state of the dense parameters in `range`, laid out as the optimizer lays
/// out a model of that many parameters (Adam: `m` of the range, then `v`), from the
/// global model's `full` state (each state vector over every parameter, one after another).
pub(crate) fn dense_range_state(
    global: &ModelConfig,
    full: &DenseState,
    range: Range<usize>,
) -> Result<Vec<f32>, PsError> {
    let total = full.params.len();
    let per_param = global.dense_optimizer.dense_state_len(1)?;
    let mut state = Vec::with_capacity(per_param * range.len());
    for j in 0..per_param {
        let vector = full
            .optimizer_state
            .get(j * total + range.start..j * total + range.end)
            .ok_or_else(|| {
                PsError::Internal(format!(
                    "dense optimizer state of {} values is short of {} vectors of {total}",
                    full.optimizer_state.len(),
                    per_param
                ))
            })?;
        state.extend_from_slice(vector);
    }
    Ok(state)
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
        Self::from_global_rows(global, seed, layout, server, |sink| {
            for t in 0..global.tables() {
                redundancy::for_each_initial_row(global, seed, t, |r, row| sink(t, r, row));
            }
            Ok(DenseState::initial(global, seed)?)
        })
    }

    /// `server`'s shard of the global model whose rows `rows` hands to its sink, each
    /// once and in any order, as `(table, global row, row)`, and then returns the global
    /// dense state of: the rows it owns, and under erasure coding the parity of its
    /// stripes and its dense replica and parity, all derived here. The initial model's
    /// rows come from the seed; a resumed job's from another job's cut (`resume.rs`).
    /// `seed` only shapes the dense buffers, which are overwritten.
    pub(crate) fn from_global_rows(
        global: &ModelConfig,
        seed: u64,
        layout: Layout,
        server: usize,
        rows: impl FnOnce(&mut dyn FnMut(usize, usize, &[f32])) -> Result<DenseState, PsError>,
    ) -> Result<Self, PsError> {
        let config = Self::shard_config(global, layout, server)?;
        let stride = global.row_stride();
        let stripes = layout.stripes();
        let mut redundancy = match stripes {
            Some(_) => Some(Redundancy::empty(global, layout, server)?),
            None => None,
        };
        let mut data: Vec<Vec<f32>> = config
            .table_rows
            .iter()
            .map(|&local_rows| vec![0.0f32; local_rows * stride])
            .collect();
        let full = rows(&mut |t, r, row| {
            let (owner, local) = layout.primary(t, GlobalRow(r as u32));
            if owner == server {
                let local = local.index();
                data[t][local * stride..(local + 1) * stride].copy_from_slice(row);
            }
            if let (Some(red), Some(stripes)) = (&mut redundancy, &stripes) {
                red.fold_initial(stripes, server, t, r, bytemuck::cast_slice(row));
            }
        })?;
        let tables = data
            .into_iter()
            .zip(&config.table_rows)
            .map(|(data, &local_rows)| {
                EmbeddingTable::from_data(local_rows, global.dim, stride, data)
                    .ok_or_else(|| PsError::Config("shard table shape".into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(red) = &mut redundancy {
            red.replica = Redundancy::initial_replica(global, layout, server, &full)?;
            red.init_dense_parity(global, layout, server, &full)?;
        }
        let range = layout.dense_range(server, full.params.len());
        let range_state = dense_range_state(global, &full, range.clone())?;
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
        shard.awaiting_rows = true;
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
            awaiting_rows: false,
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
        let locals = self.locals_of(table, rows)?;
        let Some(stored) = self.state.tables().get(table) else {
            return Err(PsError::BadRequest(format!("table {table} does not exist")));
        };
        out.reserve(rows.len() * dim * 4);
        for (n, &local) in locals.iter().enumerate() {
            if let Some(&ahead) = locals.get(n + PREFETCH_AHEAD) {
                ftrec_model::prefetch::prefetch_read(stored.embedding(ahead));
            }
            out.extend_from_slice(bytemuck::cast_slice(stored.embedding(local)));
        }
        Ok(())
    }

    /// The local slots of `rows` of `table`, each checked as [`Shard::gather`] and
    /// staging need it: owned here and not still being rebuilt.
    pub(crate) fn locals_of(&self, table: usize, rows: &[u32]) -> Result<Vec<usize>, PsError> {
        rows.iter()
            .map(|&row| {
                let local = self.local(table, row)?;
                self.check_not_pending(table, row, local)?;
                Ok(local)
            })
            .collect()
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
        self.awaiting_rows = false;
        Ok(())
    }

    /// Whether every row of the slot is here: not a replacement waiting for its rebuild,
    /// nor one whose background rebuild has slots left. A leader that takes over from one
    /// whose record lags a rebuild's end asks it (`AppliedReply::rebuild_unfinished`).
    pub fn holds_its_rows(&self) -> bool {
        !self.awaiting_rows && self.pending.is_none()
    }
}

#[cfg(test)]
pub(crate) mod tests;
