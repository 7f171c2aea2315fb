//! The model state the engine tests checkpoint: Adam rows (so every row carries optimizer
//! state and a step count), a table larger than one 4 MiB chunk, and two small ones.

use ftrec_model::{ModelConfig, ModelState, Optimizer};

pub fn state(seed: u64) -> ModelState {
    let config = ModelConfig {
        num_dense: 3,
        // a table larger than one 4 MiB chunk (stride 2*16+1 words)
        table_rows: vec![40_000, 17, 2],
        dim: 16,
        bottom: vec![8, 16],
        top: vec![8, 1],
        sparse_optimizer: Optimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
        },
        dense_optimizer: Optimizer::Adagrad {
            lr: 0.1,
            eps: 1e-8,
            initial_accumulator: 0.1,
        },
    };
    let mut s = ModelState::new(&config, seed).unwrap();
    s.dense.step = 77;
    s
}

/// An Adagrad model of one table of `rows` rows of `dim`, a 50-row second table and a tiny
/// dense part: the shape the DECK and IncrCP tests size to their chunk arithmetic.
pub fn adagrad_state(rows: usize, dim: usize, seed: u64) -> ModelState {
    let config = ModelConfig {
        num_dense: 2,
        table_rows: vec![rows, 50],
        dim,
        bottom: vec![dim],
        top: vec![1],
        sparse_optimizer: Optimizer::Adagrad {
            lr: 0.1,
            eps: 1e-8,
            initial_accumulator: 0.1,
        },
        dense_optimizer: Optimizer::Sgd { lr: 0.1 },
    };
    ModelState::new(&config, seed).unwrap()
}
