use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use rand_xoshiro::Xoshiro256PlusPlus;
use rayon::prelude::*;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::{EmbeddingTable, MlpSpec, ModelConfig, ModelError, TablePages};

/// Dense MLP parameters (bottom then top, each layer `W [out x in]` then `b [out]`), their
/// optimizer state, and the number of dense updates applied (Adam's step).
#[derive(Debug, PartialEq)]
pub struct DenseState {
    pub params: Vec<f32>,
    pub optimizer_state: Vec<f32>,
    pub step: u64,
}

/// The whole trainable state of a DLRM.
#[derive(Debug, PartialEq)]
pub struct ModelState {
    config: ModelConfig,
    tables: Vec<EmbeddingTable>,
    pub dense: DenseState,
}

// `clone_from` copies into the buffers already there: a server's snapshot of its shard,
// taken again at every save, then costs a copy and no fresh pages (a first touch of
// hundreds of MB of new pages takes longer than the copy, and the shard's pushes wait on
// it). The derive's `clone_from` would allocate anew.
impl Clone for DenseState {
    fn clone(&self) -> Self {
        Self {
            params: self.params.clone(),
            optimizer_state: self.optimizer_state.clone(),
            step: self.step,
        }
    }

    fn clone_from(&mut self, source: &Self) {
        self.params.clone_from(&source.params);
        self.optimizer_state.clone_from(&source.optimizer_state);
        self.step = source.step;
    }
}

impl Clone for ModelState {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
            tables: self.tables.clone(),
            dense: self.dense.clone(),
        }
    }

    fn clone_from(&mut self, source: &Self) {
        self.config.clone_from(&source.config);
        // Vec's `clone_from` calls each kept table's `clone_from`.
        self.tables.clone_from(&source.tables);
        self.dense.clone_from(&source.dense);
    }
}

/// A 64-bit xxh3 digest of every byte of model state, for equality checks in tests and tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StateDigest(pub u64);

impl std::fmt::Display for StateDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl DenseState {
    /// The initial dense parameters and optimizer state of `config` (DLRM reference init,
    /// deterministic in `seed`).
    pub fn initial(config: &ModelConfig, seed: u64) -> Result<Self, ModelError> {
        let (bottom, top) = MlpSpec::dlrm_pair(config);
        let total = top.end();
        let mut params = vec![0.0f32; total];
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0xD1B5_4A32_D192_ED03);
        for layer in bottom.layers().iter().chain(top.layers()) {
            // DLRM reference init: W ~ N(0, sqrt(2 / (in + out))), b ~ N(0, sqrt(1 / out)).
            let w_std = (2.0 / (layer.inputs + layer.outputs) as f64).sqrt() as f32;
            let b_std = (1.0 / layer.outputs as f64).sqrt() as f32;
            let w = Normal::new(0.0f32, w_std).map_err(|e| ModelError::Config(e.to_string()))?;
            let b = Normal::new(0.0f32, b_std).map_err(|e| ModelError::Config(e.to_string()))?;
            for p in &mut params[layer.weight..layer.weight + layer.inputs * layer.outputs] {
                *p = w.sample(&mut rng);
            }
            for p in &mut params[layer.bias..layer.bias + layer.outputs] {
                *p = b.sample(&mut rng);
            }
        }
        let mut optimizer_state = vec![0.0f32; config.dense_optimizer.dense_state_len(total)?];
        config
            .dense_optimizer
            .init_dense_state(&mut optimizer_state);
        Ok(Self {
            params,
            optimizer_state,
            step: 0,
        })
    }
}

impl ModelState {
    /// A freshly initialised model. Deterministic in `seed` and independent of the
    /// thread count (each table and the dense block have their own generator).
    pub fn new(config: &ModelConfig, seed: u64) -> Result<Self, ModelError> {
        Self::new_on(config, seed, TablePages::Default)
    }

    /// [`ModelState::new`] with the tables on the given pages: the same values.
    pub fn new_on(config: &ModelConfig, seed: u64, pages: TablePages) -> Result<Self, ModelError> {
        config.validate()?;
        let tables = config
            .table_rows
            .par_iter()
            .enumerate()
            .map(|(t, &rows)| {
                EmbeddingTable::new_initialized_on(
                    rows,
                    config.dim,
                    &config.sparse_optimizer,
                    seed,
                    t,
                    pages,
                )
            })
            .collect();
        Ok(Self {
            config: config.clone(),
            tables,
            dense: DenseState::initial(config, seed)?,
        })
    }

    /// A state from its parts; the tables and dense buffers must have the shapes `config`
    /// gives them.
    pub fn from_parts(
        config: ModelConfig,
        tables: Vec<EmbeddingTable>,
        dense: DenseState,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        let stride = config.row_stride();
        let total = MlpSpec::dlrm_pair(&config).1.end();
        let shapes_match = tables.len() == config.tables()
            && tables.iter().zip(&config.table_rows).all(|(t, &rows)| {
                t.rows() == rows && t.stride() == stride && t.dim() == config.dim
            })
            && dense.params.len() == total
            && dense.optimizer_state.len() == config.dense_optimizer.dense_state_len(total)?;
        if !shapes_match {
            return Err(ModelError::Config(
                "state parts do not have the shapes of the model configuration".into(),
            ));
        }
        Ok(Self {
            config,
            tables,
            dense,
        })
    }

    /// An all-zero state like [`ModelState::zeroed`], with every page written: a
    /// `clone_from` into it then copies and faults no page in. (Zeroed memory from the
    /// allocator is mapped lazily, so the first copy into it would fault each page, under
    /// whatever lock the copy holds.)
    pub fn zeroed_resident(config: &ModelConfig) -> Result<Self, ModelError> {
        fn resident(len: usize) -> Vec<f32> {
            // `with_capacity` + `resize` writes every element; `vec![0.0; n]` may not.
            let mut v = Vec::with_capacity(len);
            v.resize(len, 0.0);
            v
        }
        let mut state = Self::zeroed(config)?;
        for t in &mut state.tables {
            let (rows, dim, stride) = (t.rows(), t.dim(), t.stride());
            *t = EmbeddingTable::from_data(rows, dim, stride, resident(rows * stride))
                .ok_or_else(|| ModelError::Config("table shape".into()))?;
        }
        state.dense.params = resident(state.dense.params.len());
        state.dense.optimizer_state = resident(state.dense.optimizer_state.len());
        Ok(state)
    }

    /// An all-zero state with the right shapes, to be filled by a restore.
    pub fn zeroed(config: &ModelConfig) -> Result<Self, ModelError> {
        config.validate()?;
        let stride = config.row_stride();
        let tables = config
            .table_rows
            .iter()
            .map(|&rows| EmbeddingTable::zeroed(rows, config.dim, stride))
            .collect();
        let total = MlpSpec::dlrm_pair(config).1.end();
        Ok(Self {
            config: config.clone(),
            tables,
            dense: DenseState {
                params: vec![0.0; total],
                optimizer_state: vec![0.0; config.dense_optimizer.dense_state_len(total)?],
                step: 0,
            },
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn tables(&self) -> &[EmbeddingTable] {
        &self.tables
    }

    pub fn tables_mut(&mut self) -> &mut [EmbeddingTable] {
        &mut self.tables
    }

    fn table_checked(&self, table: usize, row: u64) -> Result<&EmbeddingTable, ModelError> {
        let t = self.tables.get(table).ok_or(ModelError::NoSuchTable {
            table,
            tables: self.tables.len(),
        })?;
        if row >= t.rows() as u64 {
            return Err(ModelError::RowOutOfRange {
                table,
                row,
                rows: t.rows(),
            });
        }
        Ok(t)
    }

    /// A row (embedding + optimizer state) by `(table, row)`.
    pub fn row(&self, table: usize, row: u64) -> Result<&[f32], ModelError> {
        Ok(self.table_checked(table, row)?.row(row as usize))
    }

    /// The stable little-endian byte view of a row.
    pub fn row_bytes(&self, table: usize, row: u64) -> Result<&[u8], ModelError> {
        Ok(bytemuck::cast_slice(self.row(table, row)?))
    }

    /// Overwrites a row with `values` (embedding + optimizer state).
    pub fn set_row(&mut self, table: usize, row: u64, values: &[f32]) -> Result<(), ModelError> {
        let stride = self.table_checked(table, row)?.stride();
        if values.len() != stride {
            return Err(ModelError::RowLength {
                table,
                expected: stride * 4,
                got: values.len() * 4,
            });
        }
        self.tables[table]
            .row_mut(row as usize)
            .copy_from_slice(values);
        Ok(())
    }

    /// Overwrites a row from its little-endian byte form.
    pub fn set_row_bytes(
        &mut self,
        table: usize,
        row: u64,
        bytes: &[u8],
    ) -> Result<(), ModelError> {
        let stride = self.table_checked(table, row)?.stride();
        if bytes.len() != stride * 4 {
            return Err(ModelError::RowLength {
                table,
                expected: stride * 4,
                got: bytes.len(),
            });
        }
        let dst = self.tables[table].row_mut(row as usize);
        for (d, chunk) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
            *d = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
        Ok(())
    }

    /// Every row of every table as `(table, row, values)`, in table then row order.
    pub fn iter_rows(&self) -> impl Iterator<Item = (usize, usize, &[f32])> + '_ {
        self.tables.iter().enumerate().flat_map(|(t, table)| {
            table
                .as_slice()
                .chunks_exact(table.stride())
                .enumerate()
                .map(move |(r, row)| (t, r, row))
        })
    }

    /// Digest of all rows, optimizer state, dense parameters and the dense step. Tables are
    /// hashed in parallel and their digests combined in table order, so the result does
    /// not depend on the thread count.
    pub fn digest(&self) -> StateDigest {
        let per_table: Vec<u64> = self
            .tables
            .par_iter()
            .map(|t| xxh3_64(t.as_bytes()))
            .collect();
        let mut h = Xxh3::new();
        h.update(&(self.tables.len() as u64).to_le_bytes());
        for (t, d) in self.tables.iter().zip(&per_table) {
            h.update(&(t.rows() as u64).to_le_bytes());
            h.update(&(t.stride() as u64).to_le_bytes());
            h.update(&d.to_le_bytes());
        }
        h.update(bytemuck::cast_slice(&self.dense.params));
        h.update(bytemuck::cast_slice(&self.dense.optimizer_state));
        h.update(&self.dense.step.to_le_bytes());
        StateDigest(h.digest())
    }

    /// Bytes of state held in memory (tables + dense + dense optimizer state).
    pub fn bytes(&self) -> usize {
        self.tables
            .iter()
            .map(|t| t.as_bytes().len())
            .sum::<usize>()
            + 4 * (self.dense.params.len() + self.dense.optimizer_state.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Optimizer;

    fn config(opt: Optimizer) -> ModelConfig {
        ModelConfig {
            num_dense: 3,
            table_rows: vec![10, 7],
            dim: 4,
            bottom: vec![8, 4],
            top: vec![6, 1],
            sparse_optimizer: opt,
            dense_optimizer: Optimizer::Sgd { lr: 0.1 },
        }
    }

    #[test]
    fn rows_carry_optimizer_state_and_round_trip_through_bytes() {
        let adam = Optimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
        };
        let mut s = ModelState::new(&config(adam), 7).unwrap();
        assert_eq!(s.row(1, 3).unwrap().len(), 4 + 9);
        let bytes = s.row_bytes(0, 2).unwrap().to_vec();
        assert_eq!(bytes.len(), 13 * 4);
        let before = s.digest();
        s.set_row_bytes(1, 6, &bytes).unwrap();
        assert_eq!(s.row(1, 6).unwrap(), s.row(0, 2).unwrap());
        assert_ne!(before, s.digest(), "digest must see a changed row");
        assert!(matches!(
            s.row(1, 7),
            Err(ModelError::RowOutOfRange { row: 7, .. })
        ));
        assert!(matches!(
            s.set_row(0, 1, &[0.0; 3]),
            Err(ModelError::RowLength { .. })
        ));
        assert_eq!(s.iter_rows().count(), 17);
    }

    #[test]
    fn clone_from_copies_into_the_buffers_already_there() {
        let c = config(Optimizer::Adagrad {
            lr: 0.1,
            eps: 1e-8,
            initial_accumulator: 0.0,
        });
        let source = ModelState::new(&c, 1).unwrap();
        let mut snapshot = ModelState::new(&c, 2).unwrap();
        let buffers_of = |s: &ModelState| -> Vec<*const u8> {
            s.tables()
                .iter()
                .map(|t| t.as_bytes().as_ptr())
                .chain([s.dense.params.as_ptr().cast()])
                .collect()
        };
        let buffers = buffers_of(&snapshot);
        snapshot.clone_from(&source);
        assert_eq!(snapshot, source);
        assert_eq!(snapshot.digest(), source.digest());
        assert_eq!(
            buffers_of(&snapshot),
            buffers,
            "clone_from must reuse the snapshot's buffers"
        );
        let mut resident = ModelState::zeroed_resident(&c).unwrap();
        assert_eq!(resident, ModelState::zeroed(&c).unwrap());
        resident.clone_from(&source);
        assert_eq!(resident, source);
        // Into a state of another shape it still yields an equal copy.
        let mut other = ModelState::new(&config(Optimizer::Sgd { lr: 0.1 }), 3).unwrap();
        other.clone_from(&source);
        assert_eq!(other, source);
    }

    #[test]
    fn init_is_deterministic_and_seed_sensitive() {
        let c = config(Optimizer::Sgd { lr: 0.1 });
        let a = ModelState::new(&c, 1).unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let b = pool.install(|| ModelState::new(&c, 1).unwrap());
        assert_eq!(a.digest(), b.digest());
        assert_eq!(a, b);
        assert_ne!(a.digest(), ModelState::new(&c, 2).unwrap().digest());
    }

    #[test]
    fn digest_sees_dense_step() {
        let c = config(Optimizer::Sgd { lr: 0.1 });
        let mut a = ModelState::new(&c, 1).unwrap();
        let d = a.digest();
        a.dense.step += 1;
        assert_ne!(d, a.digest());
    }
}
