//! One DLRM training step, split into the phases a parameter-server worker also needs:
//! `prepare` (de-duplicate ids), gather the unique rows (from local tables or from servers),
//! `forward_backward` (dense and per-unique-row gradients), `apply` (optimizers).
//!
//! All buffers are allocated once for `max_batch`; a step allocates nothing of its own
//! (the `gemm` crate may allocate its packing buffers internally).

use std::time::Instant;

use rayon::prelude::*;

use crate::lanes::{self, LanesScratch};
use crate::sparse::{TableDedup, aggregate_gradients, pool_sample, pool_sample_from, prefetch_bag};
use crate::{
    Batch, EmbeddingTable, MatMul, MlpSpec, MlpWorkspace, ModelConfig, ModelError, ModelState,
};

/// Gradients of the last `forward_backward`: the dense buffer (same layout as the dense
/// parameters) and, per table, one gradient per unique row (`[unique x dim]`, rows in the
/// order of [`Dlrm::unique_rows`]).
#[derive(Clone, Debug, Default)]
pub struct Gradients {
    pub dense: Vec<f32>,
    pub sparse: Vec<Vec<f32>>,
}

/// Wall time spent in each phase since the model was built (or last reset): how the
/// benchmark tells where a step's time goes.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct PhaseTimes {
    pub steps: u64,
    pub prepare: f64,
    pub gather: f64,
    pub bottom_forward: f64,
    pub pool_interact_forward: f64,
    pub top_forward: f64,
    pub loss: f64,
    pub top_backward: f64,
    pub interact_backward: f64,
    pub bottom_backward: f64,
    pub aggregate: f64,
    pub apply_sparse: f64,
    pub apply_dense: f64,
}

/// A zeroed `f32` buffer whose first value sits on a 64-byte boundary: a `Vec` with up
/// to 15 spare values in front. The `Vec` never grows, so the boundary never moves.
#[derive(Debug)]
struct CacheAligned {
    data: Vec<f32>,
    start: usize,
    len: usize,
}

impl CacheAligned {
    fn zeroed(len: usize) -> Self {
        let data = vec![0.0f32; len + 15];
        let start = data.as_ptr().align_offset(64).min(15);
        Self { data, start, len }
    }

    fn as_slice(&self) -> &[f32] {
        &self.data[self.start..self.start + self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data[self.start..self.start + self.len]
    }
}

/// Adds the time since `*mark` to `slot` and restarts the mark.
fn lap(mark: &mut Instant, slot: &mut f64) {
    let now = Instant::now();
    *slot += (now - *mark).as_secs_f64();
    *mark = now;
}

pub struct Dlrm {
    times: PhaseTimes,
    config: ModelConfig,
    bottom: MlpSpec,
    top: MlpSpec,
    mm: Box<dyn MatMul>,
    threads: usize,
    max_batch: usize,
    batch: usize,
    bottom_acts: Vec<Vec<f32>>,
    bottom_dacts: Vec<Vec<f32>>,
    top_acts: Vec<Vec<f32>>,
    top_dacts: Vec<Vec<f32>>,
    bottom_workspace: MlpWorkspace,
    /// The batch's dense features in rows padded with zeros to the bottom MLP's input
    /// stride: 13 features become 16, so that the first layer's weight gradient is wide
    /// enough to split over the pool (gemm reduces outputs narrower than a kernel vector
    /// in an order that depends on the row count, so those are never split).
    dense_input: Vec<f32>,
    top_workspace: MlpWorkspace,
    /// Per sample `[vectors x dim]`: bottom output, then one pooled embedding per table.
    z: Vec<f32>,
    /// Cache-line aligned, so that the interaction backward can write it with streaming
    /// stores.
    dz: CacheAligned,
    /// The interaction's output, the top MLP's input: rows of `inter_stride` values, the
    /// interaction's width padded with zeros to what the top layer's products tile well.
    inter: Vec<f32>,
    dinter: Vec<f32>,
    inter_stride: usize,
    /// Per-thread `vectors x vectors` scratch for the interaction backward.
    pair_scratch: Vec<Vec<f32>>,
    /// Per-thread transposed blocks for the interaction forward.
    lanes_scratch: Vec<LanesScratch>,
    dedup: Vec<TableDedup>,
    pulled: Vec<Vec<f32>>,
    grads: Gradients,
}

/// Samples pooled and interacted together: the lanes of one AVX-512 register.
const BLOCK: usize = 16;

/// How many samples ahead pooling prefetches table rows: 4 and 8 measured alike, and
/// both about 0.4 ms a step better than none (bench-results/HISTORY.md).
const PREFETCH_SAMPLES: usize = 8;

/// `log(1 + e^z)` without overflow.
fn softplus(z: f32) -> f64 {
    let z = z as f64;
    z.max(0.0) + (-z.abs()).exp().ln_1p()
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

impl Dlrm {
    /// Workspace for batches of up to `max_batch` samples. `threads` is the size of the
    /// rayon pool the caller runs steps in; it sets how the batch is split, never the result.
    pub fn new(
        config: &ModelConfig,
        max_batch: usize,
        threads: usize,
        mm: Box<dyn MatMul>,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        if max_batch == 0 {
            return Err(ModelError::Config("batch size must be positive".into()));
        }
        let (bottom, top) = MlpSpec::dlrm_pair(config);
        let (bottom, top) = (bottom.with_padded_input(), top.with_padded_input());
        let vectors = config.tables() + 1;
        let inter_stride = top.input_stride();
        let dense_len = top.end();
        Ok(Self {
            times: PhaseTimes::default(),
            bottom_acts: bottom.activation_buffers(max_batch),
            bottom_dacts: bottom.activation_buffers(max_batch),
            top_acts: top.activation_buffers(max_batch),
            top_dacts: top.activation_buffers(max_batch),
            z: vec![0.0; max_batch * vectors * config.dim],
            dz: CacheAligned::zeroed(max_batch * vectors * config.dim),
            bottom_workspace: bottom.workspace(),
            dense_input: vec![0.0; max_batch * bottom.input_stride()],
            top_workspace: top.workspace(),
            inter: vec![0.0; max_batch * inter_stride],
            dinter: vec![0.0; max_batch * inter_stride],
            inter_stride,
            pair_scratch: vec![vec![0.0; vectors * vectors]; threads.max(1)],
            lanes_scratch: vec![LanesScratch::new(vectors, config.dim); threads.max(1)],
            dedup: vec![TableDedup::default(); config.tables()],
            pulled: vec![Vec::new(); config.tables()],
            grads: Gradients {
                dense: vec![0.0; dense_len],
                sparse: vec![Vec::new(); config.tables()],
            },
            config: config.clone(),
            bottom,
            top,
            mm,
            threads: threads.max(1),
            max_batch,
            batch: 0,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Checks the batch against the model and de-duplicates each table's ids.
    pub fn prepare(&mut self, batch: &Batch) -> Result<(), ModelError> {
        let mut mark = Instant::now();
        self.check_batch(batch)?;
        self.batch = batch.size;
        self.dedup
            .par_iter_mut()
            .zip(&batch.sparse)
            .for_each(|(d, bags)| d.build(bags));
        lap(&mut mark, &mut self.times.prepare);
        Ok(())
    }

    fn check_batch(&self, batch: &Batch) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Batch(m));
        let n = batch.size;
        if n == 0 || n > self.max_batch {
            return bad(format!("size {n} is not in 1..={}", self.max_batch));
        }
        if batch.labels.len() != n || batch.dense.len() != n * self.config.num_dense {
            return bad(format!(
                "{} labels and {} dense values for {n} samples of {} dense features",
                batch.labels.len(),
                batch.dense.len(),
                self.config.num_dense
            ));
        }
        if batch.sparse.len() != self.config.tables() {
            return bad(format!(
                "{} sparse features for {} tables",
                batch.sparse.len(),
                self.config.tables()
            ));
        }
        for (t, bags) in batch.sparse.iter().enumerate() {
            let offsets_ok = bags.offsets.len() == n + 1
                && bags.offsets[0] == 0
                && bags.offsets.windows(2).all(|w| w[0] <= w[1])
                && bags.offsets[n] as usize == bags.rows.len();
            if !offsets_ok {
                return bad(format!(
                    "table {t}: bag offsets do not describe {n} samples"
                ));
            }
            let rows = self.config.table_rows[t];
            if let Some(&r) = bags.rows.iter().find(|&&r| r as usize >= rows) {
                return Err(ModelError::RowOutOfRange {
                    table: t,
                    row: r as u64,
                    rows,
                });
            }
        }
        Ok(())
    }

    /// The unique rows of table `t` in the prepared batch, ascending.
    pub fn unique_rows(&self, t: usize) -> &[u32] {
        &self.dedup[t].unique
    }

    /// Buffer for table `t`'s unique embeddings, `[unique x dim]`, in `unique_rows` order.
    /// A parameter-server worker fills it with pulled rows.
    pub fn pulled_mut(&mut self, t: usize) -> &mut Vec<f32> {
        &mut self.pulled[t]
    }

    /// Fills the pulled buffers from local tables.
    pub fn gather_from(&mut self, state: &ModelState) {
        let mut mark = Instant::now();
        self.pulled
            .par_iter_mut()
            .zip(&self.dedup)
            .zip(state.tables())
            .for_each(|((pulled, dedup), table)| {
                pulled.clear();
                for &row in &dedup.unique {
                    pulled.extend_from_slice(table.embedding(row as usize));
                }
            });
        lap(&mut mark, &mut self.times.gather);
    }

    /// Chunk of samples each thread handles in per-sample phases.
    fn samples_per_chunk(&self) -> usize {
        self.batch.div_ceil(self.threads).max(1)
    }

    fn forward(&mut self, dense_params: &[f32], batch: &Batch, tables: Option<&[EmbeddingTable]>) {
        let n = self.batch;
        let dim = self.config.dim;
        let vectors = self.config.tables() + 1;
        let stride = self.inter_stride;
        let mut mark = Instant::now();
        let (features, stride_in) = (self.config.num_dense, self.bottom.input_stride());
        // `prepare` checked the batch it was given; a different one here is a caller's
        // bug, and would leave the previous batch's rows in the padded copy.
        assert_eq!(
            batch.dense.len(),
            n * features,
            "forward_backward got a batch other than the prepared one"
        );
        for (padded, row) in self.dense_input[..n * stride_in]
            .chunks_exact_mut(stride_in)
            .zip(batch.dense.chunks_exact(features.max(1)))
        {
            padded[..features].copy_from_slice(row);
        }
        self.bottom.forward(
            &*self.mm,
            dense_params,
            &self.dense_input,
            &mut self.bottom_acts,
            &mut self.bottom_workspace,
            n,
        );
        lap(&mut mark, &mut self.times.bottom_forward);
        let chunk = self.samples_per_chunk();
        let bottom_out = &self.bottom_acts[self.bottom_acts.len() - 1];
        let (pulled, dedup) = (&self.pulled, &self.dedup);
        self.z[..n * vectors * dim]
            .par_chunks_mut(chunk * vectors * dim)
            .zip(self.inter[..n * stride].par_chunks_mut(chunk * stride))
            .zip(self.lanes_scratch.par_iter_mut())
            .enumerate()
            .for_each(|(c, ((z, inter), scratch))| {
                let first = c * chunk;
                // Sixteen samples at a time, each with all its tables, then their
                // interaction: a sample's vectors are written contiguously, and the block
                // is still in L2 when the interaction transposes it.
                for (blk, (zb, ob)) in z
                    .chunks_mut(BLOCK * vectors * dim)
                    .zip(inter.chunks_mut(BLOCK * stride))
                    .enumerate()
                {
                    for (s, zs) in zb.chunks_exact_mut(vectors * dim).enumerate() {
                        let b = first + blk * BLOCK + s;
                        // Table rows come from memory, in no order: ask for a later
                        // sample's rows now so that they have arrived when it is pooled.
                        if let Some(tables) = tables
                            && b + PREFETCH_SAMPLES < n
                        {
                            for (bags, table) in batch.sparse.iter().zip(tables) {
                                prefetch_bag(bags, table, b + PREFETCH_SAMPLES);
                            }
                        }
                        zs[..dim].copy_from_slice(&bottom_out[b * dim..(b + 1) * dim]);
                        for (t, dst) in zs[dim..].chunks_exact_mut(dim).enumerate() {
                            match tables {
                                Some(tables) => {
                                    pool_sample_from(&batch.sparse[t], &tables[t], b, dst)
                                }
                                None => {
                                    pool_sample(&batch.sparse[t], &dedup[t], &pulled[t], b, dst)
                                }
                            }
                        }
                    }
                    lanes::forward_samples(zb, vectors, dim, ob, scratch);
                }
            });
        lap(&mut mark, &mut self.times.pool_interact_forward);
        self.top.forward(
            &*self.mm,
            dense_params,
            &self.inter,
            &mut self.top_acts,
            &mut self.top_workspace,
            n,
        );
        lap(&mut mark, &mut self.times.top_forward);
    }

    /// Forward and backward over the prepared batch, with the unique embeddings already in
    /// the pulled buffers. Returns the summed (not averaged) log loss; gradients are those
    /// of the mean loss and are left in [`Dlrm::gradients`].
    pub fn forward_backward(&mut self, dense_params: &[f32], batch: &Batch) -> f64 {
        self.forward_backward_with(dense_params, batch, None)
    }

    /// [`Dlrm::forward_backward`], pooling from `tables` when given (a single-process
    /// step: the rows are where the pulled buffers would copy them from) or else from the
    /// pulled buffers.
    fn forward_backward_with(
        &mut self,
        dense_params: &[f32],
        batch: &Batch,
        tables: Option<&[EmbeddingTable]>,
    ) -> f64 {
        let n = self.batch;
        let dim = self.config.dim;
        let vectors = self.config.tables() + 1;
        let stride = self.inter_stride;
        self.forward(dense_params, batch, tables);
        let mut mark = Instant::now();
        let logits = &self.top_acts[self.top_acts.len() - 1][..n];
        let dlogits = self
            .top_dacts
            .last_mut()
            .map(|d| &mut d[..n])
            .unwrap_or_default();
        let mut loss = 0.0f64;
        let inv_n = 1.0 / n as f32;
        for ((d, &z), &y) in dlogits.iter_mut().zip(logits).zip(&batch.labels) {
            loss += softplus(z) - y as f64 * z as f64;
            *d = (sigmoid(z) - y) * inv_n;
        }
        lap(&mut mark, &mut self.times.loss);

        self.top.backward(
            &*self.mm,
            dense_params,
            &self.inter,
            &self.top_acts,
            &mut self.top_dacts,
            &mut self.grads.dense,
            Some(&mut self.dinter[..n * stride]),
            &mut self.top_workspace,
            n,
        );
        lap(&mut mark, &mut self.times.top_backward);
        let chunk = self.samples_per_chunk();
        let last = self.bottom_dacts.len() - 1;
        self.dz.as_mut_slice()[..n * vectors * dim]
            .par_chunks_mut(chunk * vectors * dim)
            .zip(self.z[..n * vectors * dim].par_chunks(chunk * vectors * dim))
            .zip(self.dinter[..n * stride].par_chunks(chunk * stride))
            .zip(self.bottom_dacts[last][..n * dim].par_chunks_mut(chunk * dim))
            .zip(self.pair_scratch.par_iter_mut())
            .zip(self.lanes_scratch.par_iter_mut())
            .for_each(|(((((dz, z), dinter), first), pair_scratch), scratch)| {
                lanes::backward_samples(z, vectors, dim, dinter, dz, first, pair_scratch, scratch);
            });
        lap(&mut mark, &mut self.times.interact_backward);
        self.bottom.backward(
            &*self.mm,
            dense_params,
            &self.dense_input,
            &self.bottom_acts,
            &mut self.bottom_dacts,
            &mut self.grads.dense,
            None,
            &mut self.bottom_workspace,
            n,
        );
        lap(&mut mark, &mut self.times.bottom_backward);
        let dz = &self.dz.as_slice()[..n * vectors * dim];
        self.grads
            .sparse
            .par_iter_mut()
            .zip(&self.dedup)
            .zip(&batch.sparse)
            .enumerate()
            .for_each(|(t, ((grads, dedup), bags))| {
                aggregate_gradients(bags, dedup, dz, vectors * dim, (t + 1) * dim, dim, grads);
            });
        lap(&mut mark, &mut self.times.aggregate);
        self.times.steps += 1;
        loss
    }

    pub fn gradients(&self) -> &Gradients {
        &self.grads
    }

    /// Applies the optimizers: each unique row of each table once (tables in parallel),
    /// then the dense parameters.
    pub fn apply(&mut self, state: &mut ModelState) {
        let mut mark = Instant::now();
        let dim = self.config.dim;
        let sparse_opt = self.config.sparse_optimizer;
        state
            .tables_mut()
            .par_iter_mut()
            .zip(&self.dedup)
            .zip(&self.grads.sparse)
            .for_each(|((table, dedup), grads)| {
                sparse_opt.apply_rows(table, &dedup.unique, grads, dim);
            });
        lap(&mut mark, &mut self.times.apply_sparse);
        let dense = &mut state.dense;
        self.config.dense_optimizer.apply_dense(
            &mut dense.params,
            &mut dense.optimizer_state,
            &self.grads.dense,
            &mut dense.step,
        );
        lap(&mut mark, &mut self.times.apply_dense);
    }

    /// Accumulated per-phase wall time.
    pub fn phase_times(&self) -> PhaseTimes {
        self.times
    }

    pub fn reset_phase_times(&mut self) {
        self.times = PhaseTimes::default();
    }

    /// A full single-process step. Returns the summed log loss of the batch.
    pub fn train_step(&mut self, state: &mut ModelState, batch: &Batch) -> Result<f64, ModelError> {
        crate::with_pool_awake(|| {
            self.prepare(batch)?;
            // No gather: a single-process step pools straight from the tables, which
            // `apply` changes only after the backward, so the values (and bits) are the
            // pulled ones without the 13.6 MB copy (on `tiny`) written and read back.
            let loss = self.forward_backward_with(&state.dense.params, batch, Some(state.tables()));
            self.apply(state);
            Ok(loss)
        })
    }

    /// Logits for a batch (no gradients, no update), appended to `logits`.
    pub fn predict(
        &mut self,
        state: &ModelState,
        batch: &Batch,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.prepare(batch)?;
        self.forward(&state.dense.params, batch, Some(state.tables()));
        logits.extend_from_slice(&self.top_acts[self.top_acts.len() - 1][..batch.size]);
        Ok(())
    }
}
