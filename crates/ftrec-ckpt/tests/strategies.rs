//! For random update sequences and every strategy, restoring each retained checkpoint
//! yields exactly the state at that point.

use std::collections::HashMap;

use ftrec_ckpt::{Checkpointer, Checkpoints, LocalStore, Strategy as CkptStrategy};
use ftrec_model::{ModelConfig, ModelState, Optimizer};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// Overwrite these rows of a table (as a training step would) and track them.
    Update(usize, Vec<u32>, u32),
    Dense(u32),
    Compact,
    Checkpoint,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..2, proptest::collection::vec(0u32..60, 0..8), any::<u32>())
            .prop_map(|(t, rows, v)| Op::Update(t, rows, v)),
        1 => any::<u32>().prop_map(Op::Dense),
        1 => Just(Op::Compact),
        2 => Just(Op::Checkpoint),
    ]
}

fn config() -> ModelConfig {
    ModelConfig {
        num_dense: 2,
        table_rows: vec![60, 7],
        dim: 3,
        bottom: vec![3],
        top: vec![1],
        sparse_optimizer: Optimizer::Adam {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
        },
        dense_optimizer: Optimizer::Momentum {
            lr: 0.1,
            momentum: 0.5,
        },
    }
}

fn run(strategy: CkptStrategy, full_every: u64, ops: &[Op]) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::open(dir.path()).unwrap();
    let mut ck = Checkpointer::new(Checkpoints::new(Box::new(store)), strategy, full_every, 2);
    let mut state = ModelState::new(&config(), 1).unwrap();
    let mut expected: HashMap<String, ModelState> = HashMap::new();
    let mut step = 0u64;
    for op in ops {
        match op {
            Op::Update(t, rows, v) => {
                let t = t % state.tables().len();
                let n = state.tables()[t].rows() as u32;
                let mut rows: Vec<u32> = rows.iter().map(|r| r % n).collect();
                rows.sort_unstable();
                rows.dedup();
                for &r in &rows {
                    let stride = state.tables()[t].stride();
                    let vals: Vec<f32> = (0..stride)
                        .map(|k| (v.wrapping_add(k as u32 * 31 + r)) as f32)
                        .collect();
                    state.set_row(t, r as u64, &vals).unwrap();
                }
                ck.track(t, &rows);
                step += 1;
            }
            Op::Dense(v) => {
                state.dense.params[(*v as usize) % 5] = *v as f32;
                state.dense.step += 1;
            }
            Op::Compact => ck.compact(),
            Op::Checkpoint => {
                let m = ck
                    .checkpoint(&state, step, serde_json::json!({"step": step}))
                    .unwrap();
                expected.insert(m.id, state.clone());
                step += 1; // distinct ids
            }
        }
    }
    let listed = ck.checkpoints().list().unwrap();
    prop_assert_eq!(listed.len(), expected.len());
    for m in listed {
        let (restored, _) = ck.checkpoints().restore(&m.id).unwrap();
        prop_assert!(
            restored == expected[&m.id],
            "{:?} checkpoint {} restored wrong state",
            strategy,
            m.id
        );
        ck.checkpoints().verify(&m.id).unwrap();
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn every_strategy_restores_every_checkpoint_exactly(
        ops in proptest::collection::vec(op(), 1..60),
        full_every in prop_oneof![Just(0u64), 1u64..5],
    ) {
        for strategy in [CkptStrategy::Full, CkptStrategy::Differential, CkptStrategy::NaiveIncremental] {
            run(strategy, full_every, &ops)?;
        }
    }
}
