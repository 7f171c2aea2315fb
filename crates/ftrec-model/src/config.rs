use serde::{Deserialize, Serialize};

use crate::{ModelError, Optimizer};

/// The architecture and optimizers of a DLRM (Naumov et al. 2019, as in the DLRM reference
/// and TorchRec): bottom MLP over dense features, one embedding table per sparse feature,
/// dot interaction, top MLP ending in one logit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Number of dense input features (13 for Criteo).
    pub num_dense: usize,
    /// Rows of each embedding table; ids are hashed into this range.
    pub table_rows: Vec<usize>,
    /// Embedding dimension; also the width of the bottom MLP's last layer.
    pub dim: usize,
    /// Bottom MLP layer widths after the input, e.g. `[512, 256, 64]`.
    pub bottom: Vec<usize>,
    /// Top MLP layer widths after the interaction, ending in 1, e.g. `[512, 256, 1]`.
    pub top: Vec<usize>,
    /// Optimizer applied lazily to touched embedding rows.
    pub sparse_optimizer: Optimizer,
    /// Optimizer applied to the dense MLP parameters.
    pub dense_optimizer: Optimizer,
}

/// Table sizes, shortened when all are equal (the usual `num_tables x rows_per_table`).
fn rows(table_rows: &[usize]) -> String {
    match table_rows {
        [first, rest @ ..] if rest.iter().all(|r| r == first) => {
            format!("{} tables x {first} rows", table_rows.len())
        }
        _ => format!("{table_rows:?}"),
    }
}

/// Width of the interaction output: the bottom output concatenated with the dot products
/// of all distinct pairs among the bottom output and the pooled embeddings.
pub fn interaction_width(tables: usize, dim: usize) -> usize {
    let vectors = tables + 1;
    dim + vectors * (vectors - 1) / 2
}

impl ModelConfig {
    /// Checks the architecture; errors name the offending `model.*` field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let err = |m: String| Err(ModelError::Config(m));
        if self.table_rows.is_empty() {
            return err("model.table_rows: at least one embedding table is required".into());
        }
        if let Some((i, _)) = self
            .table_rows
            .iter()
            .enumerate()
            .find(|&(_, &r)| r < 2 || r > u32::MAX as usize)
        {
            return err(format!(
                "model.table_rows[{i}]: a table needs 2..=4294967295 rows (row 0 is reserved for missing ids), got {}",
                self.table_rows[i]
            ));
        }
        if self.dim == 0 {
            return err("model.dim must be positive".into());
        }
        if self.num_dense == 0 {
            return err("model.num_dense must be positive".into());
        }
        if self.bottom.last() != Some(&self.dim) {
            return err(format!(
                "model.bottom: the last bottom layer must have width model.dim = {}, got {:?}",
                self.dim, self.bottom
            ));
        }
        if self.top.last() != Some(&1) {
            return err(format!(
                "model.top: the last top layer must have width 1 (the logit), got {:?}",
                self.top
            ));
        }
        if self.bottom.iter().chain(&self.top).any(|&w| w == 0) {
            return err("model.bottom/model.top: layer widths must be positive".into());
        }
        self.sparse_optimizer.validate("optimizer.sparse")?;
        self.dense_optimizer.validate("optimizer.dense")?;
        self.dense_optimizer.dense_state_len(1)?;
        Ok(())
    }

    /// The settings that differ between `self` and `other`, one line each, named by
    /// their configuration key, with `self`'s value first.
    pub fn differences(&self, other: &Self) -> Vec<String> {
        let mut out = Vec::new();
        let mut field = |key: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{key}: {a} vs {b}"));
            }
        };
        field(
            "model.num_dense",
            self.num_dense.to_string(),
            other.num_dense.to_string(),
        );
        field(
            "model.table_rows",
            rows(&self.table_rows),
            rows(&other.table_rows),
        );
        field("model.dim", self.dim.to_string(), other.dim.to_string());
        field(
            "model.bottom",
            format!("{:?}", self.bottom),
            format!("{:?}", other.bottom),
        );
        field(
            "model.top",
            format!("{:?}", self.top),
            format!("{:?}", other.top),
        );
        field(
            "optimizer.sparse",
            format!("{:?}", self.sparse_optimizer),
            format!("{:?}", other.sparse_optimizer),
        );
        field(
            "optimizer.dense",
            format!("{:?}", self.dense_optimizer),
            format!("{:?}", other.dense_optimizer),
        );
        out
    }

    pub fn tables(&self) -> usize {
        self.table_rows.len()
    }

    /// f32 words per stored row: embedding plus the sparse optimizer's state.
    pub fn row_stride(&self) -> usize {
        self.dim + self.sparse_optimizer.row_state_len(self.dim)
    }

    pub fn interaction_width(&self) -> usize {
        interaction_width(self.tables(), self.dim)
    }
}
