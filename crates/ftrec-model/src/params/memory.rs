//! What a model and one training step of it hold in memory, computed from the
//! configuration alone, so a size that cannot fit is refused before anything is
//! allocated (an allocation failure aborts the process, it cannot be reported).

use crate::ModelConfig;

/// Bytes, in `u128` so that no configuration (4 billion rows x 100,000 wide) overflows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Embedding rows with their sparse optimizer state.
    pub tables: u128,
    /// Bottom MLP: parameters, their optimizer state and gradients, and the activations
    /// (and their gradients) of a batch.
    pub bottom: u128,
    /// Top MLP, likewise.
    pub top: u128,
    /// The other buffers sized by the batch: the interaction, the batch itself, and the
    /// rows a step gathers (at most one per sample and table for one-hot features).
    pub batch: u128,
}

impl MemoryEstimate {
    pub fn total(&self) -> u128 {
        self.tables + self.bottom + self.top + self.batch
    }
}

const F32: u128 = 4;

/// Words of an MLP's parameters (weights and biases) and the sum of its layer widths.
fn mlp_words(inputs: usize, widths: &[usize]) -> (u128, u128) {
    let (mut params, mut outputs, mut prev) = (0u128, 0u128, inputs as u128);
    for &w in widths {
        let w = w as u128;
        params += prev * w + w;
        outputs += w;
        prev = w;
    }
    (params, outputs)
}

impl ModelConfig {
    /// Words of the dense parameters (both MLPs' weights and biases), in `u128` so that
    /// an absurd configuration is measured, not overflowed.
    pub fn dense_words(&self) -> u128 {
        let width = self.interaction_width_u128();
        mlp_words(self.num_dense, &self.bottom).0 + mlp_words(width as usize, &self.top).0
    }

    fn interaction_width_u128(&self) -> u128 {
        let vectors = self.tables() as u128 + 1;
        self.dim as u128 + vectors * (vectors - 1) / 2
    }

    /// Memory a single-process trainer of this configuration needs at batch size
    /// `max_batch` (mirrors the allocations of `ModelState::new` and `Dlrm::new`; tables
    /// on huge pages take up to 2 MiB more each, rounded up to whole pages).
    pub fn memory_estimate(&self, max_batch: usize) -> MemoryEstimate {
        let batch = max_batch as u128;
        let tables = self.tables() as u128;
        let dim = self.dim as u128;
        let row_words = dim + self.sparse_optimizer.row_state_len(self.dim) as u128;
        let rows: u128 = self.table_rows.iter().map(|&r| r as u128).sum();
        let vectors = tables + 1;
        let width = self.interaction_width_u128();
        // Parameters, their gradient buffer, and the dense optimizer's state per word.
        let state_per_word = self.dense_optimizer.dense_state_len(1).unwrap_or(2) as u128;
        let dense_bytes = |params: u128| params * (2 + state_per_word) * F32;
        let (bottom_params, bottom_out) = mlp_words(self.num_dense, &self.bottom);
        let (top_params, top_out) = mlp_words(width as usize, &self.top);
        // Activations and their gradients.
        let activations = |outputs: u128| batch * 2 * outputs * F32;
        let per_sample = 2 * vectors * dim // z and dz
            + 2 * width // interaction and its gradient
            + self.num_dense as u128 + 1 // dense features and label
            + self.num_dense.next_multiple_of(16) as u128 // the same features, padded
            + tables * (2 + row_words + dim); // ids, offsets, gathered rows, row gradients
        MemoryEstimate {
            tables: rows * row_words * F32,
            bottom: dense_bytes(bottom_params) + activations(bottom_out),
            top: dense_bytes(top_params) + activations(top_out),
            batch: batch * per_sample * F32,
        }
    }
}

/// `bytes` for a person: "1.5 GiB".
pub fn human_bytes(bytes: u128) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dlrm, ModelState, NaiveMatMul, Optimizer};

    fn config() -> ModelConfig {
        ModelConfig {
            num_dense: 13,
            table_rows: vec![1000; 4],
            dim: 16,
            bottom: vec![32, 16],
            top: vec![24, 1],
            sparse_optimizer: Optimizer::RowwiseAdagrad {
                lr: 0.1,
                eps: 1e-8,
                initial_accumulator: 0.0,
            },
            dense_optimizer: Optimizer::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
        }
    }

    #[test]
    fn the_model_part_is_what_a_model_state_holds() {
        let c = config();
        let state = ModelState::new(&c, 1).unwrap();
        // At batch 0 only the model is counted: parameters and Adam's two moments in the
        // state, plus one gradient buffer of the dense parameters.
        let e = c.memory_estimate(0);
        assert_eq!(e.batch, 0);
        assert_eq!(e.tables, 4 * 1000 * (16 + 1) * 4);
        let dense_params = (state.bytes() as u128 - e.tables) / 4 / 3;
        assert_eq!(e.total() - dense_params * 4, state.bytes() as u128);
        // Batch buffers are linear in the batch size.
        let (a, b) = (c.memory_estimate(64), c.memory_estimate(128));
        assert_eq!(b.total() - e.total(), 2 * (a.total() - e.total()));
        Dlrm::new(&c, 64, 1, Box::new(NaiveMatMul)).unwrap();
    }

    #[test]
    fn absurd_sizes_do_not_overflow() {
        let mut c = config();
        c.table_rows = vec![u32::MAX as usize; 26];
        c.dim = 100_000;
        c.bottom = vec![100_000_000, 100_000];
        let e = c.memory_estimate(1_000_000_000);
        assert!(e.tables > 1 << 50 && e.batch > 1 << 50, "{e:?}");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(12), "12 B");
    }
}
