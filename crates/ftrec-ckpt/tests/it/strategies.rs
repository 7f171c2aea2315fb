//! For random update sequences and every strategy, restoring each retained checkpoint
//! yields exactly the state at that point; with quantized checkpoints, exactly that
//! state with each row quantized once (merges and extractions move stored rows, never
//! quantizing them again).

use std::collections::HashMap;

use ftrec_ckpt::chunklist::ChunkList;
use ftrec_ckpt::deck::DeckOptions;
use ftrec_ckpt::{
    Checkpointer, Checkpoints, LocalStore, Quant, QuantKind, Strategy as CkptStrategy,
};
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

/// `state` as a checkpoint stored as `quant` restores it: each row through the codec.
fn as_stored(state: &ModelState, quant: Quant) -> ModelState {
    let mut out = state.clone();
    if quant.is_none() {
        return out;
    }
    let quant = Quant {
        dim: state.config().dim as u16,
        ..quant
    };
    for t in 0..out.tables().len() {
        for r in 0..out.tables()[t].rows() {
            let mut stored = Vec::new();
            quant
                .encode_row(state.tables()[t].row(r), &mut stored)
                .unwrap();
            quant.decode_row(&stored, out.tables_mut()[t].row_mut(r));
        }
    }
    out
}

fn run(
    strategy: CkptStrategy,
    full_every: u64,
    threshold: f64,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    run_stored(strategy, full_every, threshold, ops, Quant::NONE)
}

fn run_stored(
    strategy: CkptStrategy,
    full_every: u64,
    threshold: f64,
    ops: &[Op],
    quant: Quant,
) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::open(dir.path()).unwrap();
    let checkpoints = Checkpoints::new(Box::new(store)).with_quant(quant);
    let mut ck = if strategy == CkptStrategy::Deck {
        // The random knobs map onto DECK's: full interval, live-volume factor, stride.
        let options = DeckOptions {
            full_every_deltas: full_every as u32,
            live_factor: threshold * 10.0,
            stride: 2 + (full_every % 2) as u32,
            chunk_bytes: 3 * 4 * 20,
            ..DeckOptions::default()
        };
        Checkpointer::deck(checkpoints, 2, options).unwrap()
    } else {
        Checkpointer::with_threshold(checkpoints, strategy, full_every, 2, threshold).unwrap()
    };
    // Several chunks per table and checkpoint, so extraction meets the key-range filter.
    ck.set_chunk_bytes(3 * 4 * 20);
    let mut state = ModelState::new(&config(), 1).unwrap();
    // By step: a DECK merge replaces deltas by a merged checkpoint of the same step.
    let mut expected: HashMap<u64, ModelState> = HashMap::new();
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
                    // Quantized rows keep fp16 scales: values of an embedding's size.
                    let vals: Vec<f32> = (0..stride)
                        .map(|k| (v.wrapping_add(k as u32 * 31 + r)) as f32)
                        .map(|x| {
                            if quant.is_none() {
                                x
                            } else {
                                (x % 4096.0) / 64.0
                            }
                        })
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
                expected.insert(m.step, as_stored(&state, quant));
                step += 1; // distinct ids
                // The newest checkpoint restores exactly between extraction rounds too.
                ck.flush().unwrap();
                let (restored, _) = ck.checkpoints().restore(&m.id).unwrap();
                prop_assert!(
                    restored == as_stored(&state, quant),
                    "{:?} newest {} restored wrong",
                    strategy,
                    m.id
                );
            }
        }
    }
    ck.flush_background().unwrap();
    let listed = ck.checkpoints().list().unwrap();
    if strategy == CkptStrategy::Deck {
        // Merges and the lineage policy delete, but the newest state always survives.
        let newest = expected.keys().max();
        prop_assert_eq!(listed.last().map(|m| m.step), newest.copied());
        prop_assert_eq!(ck.deck_stats().unwrap().background_failures, 0);
        prop_assert!(ck.deck_stats().unwrap().peak_resident_chunks <= 4);
    } else {
        prop_assert_eq!(listed.len(), expected.len());
    }
    for m in listed {
        let (restored, _) = ck.checkpoints().restore(&m.id).unwrap();
        prop_assert!(
            restored == expected[&m.step],
            "{:?} checkpoint {} restored wrong state",
            strategy,
            m.id
        );
        ck.checkpoints().verify(&m.id).unwrap();
        // A row range restored into another table: exactly those rows change, to the
        // checkpoint's values.
        let (t, rows) = (0, 13u32..41);
        let mut into = restored.tables()[t].clone();
        let stride = into.stride();
        for r in 0..into.rows() {
            into.row_mut(r).fill(-7.0);
        }
        ck.checkpoints()
            .restore_rows(&m.id, t, rows.clone(), &mut into)
            .unwrap();
        for r in 0..into.rows() {
            let want = if rows.contains(&(r as u32)) {
                restored.tables()[t].row(r).to_vec()
            } else {
                vec![-7.0; stride]
            };
            prop_assert!(
                into.row(r) == want.as_slice(),
                "{:?} {} row {}",
                strategy,
                m.id,
                r
            );
        }
    }
    if strategy == CkptStrategy::Incrcp && threshold == 0.0 {
        assert_rectangles_hold_each_row_once(&ck)?;
    }
    // Garbage collection keeps what the retained checkpoints need, and nothing breaks.
    ck.checkpoints().gc(Some(2)).unwrap();
    for m in ck.checkpoints().list().unwrap() {
        let (restored, _) = ck.checkpoints().restore(&m.id).unwrap();
        prop_assert!(
            restored == expected[&m.step],
            "{:?} {} after gc",
            strategy,
            m.id
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn every_strategy_restores_every_checkpoint_exactly(
        ops in proptest::collection::vec(op(), 1..60),
        full_every in prop_oneof![Just(0u64), 1u64..5],
        threshold in prop_oneof![Just(0.0), Just(0.02), Just(0.3), Just(1.0)],
    ) {
        for strategy in [
            CkptStrategy::Full,
            CkptStrategy::Differential,
            CkptStrategy::NaiveIncremental,
            CkptStrategy::Incrcp,
            CkptStrategy::Deck,
        ] {
            run(strategy, full_every, threshold, &ops)?;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]
    #[test]
    fn every_strategy_restores_quantized_rows_as_stored(
        ops in proptest::collection::vec(op(), 1..40),
        full_every in prop_oneof![Just(0u64), 1u64..5],
        threshold in prop_oneof![Just(0.0), Just(0.3)],
        kind in prop_oneof![Just(QuantKind::Int8), Just(QuantKind::Int4)],
        optimizer in any::<bool>(),
    ) {
        let quant = Quant { kind, optimizer, dim: 0 };
        for strategy in [
            CkptStrategy::Full,
            CkptStrategy::Differential,
            CkptStrategy::Incrcp,
            CkptStrategy::Deck,
        ] {
            run_stored(strategy, full_every, threshold, &ops, quant)?;
        }
    }
}

/// With R = 0 every duplicate is extracted, so once all rounds ran, a restore reads each
/// row at most once (IncrCP's "no de-duplication" property).
fn assert_rectangles_hold_each_row_once(ck: &Checkpointer) -> Result<(), TestCaseError> {
    let store = ck.checkpoints().store();
    for m in ck.checkpoints().list().unwrap() {
        if m.kind != ftrec_ckpt::CheckpointKind::Full {
            continue;
        }
        let Some(list) = ChunkList::load_current(store, &m.id).unwrap() else {
            continue;
        };
        for target in 0..list.columns.len() as u32 {
            let mut seen = std::collections::HashSet::new();
            for c in list.rectangle(target) {
                let bytes = c.read(store).unwrap();
                ftrec_ckpt::chunk::decode(&c.key, &bytes, |row, _| {
                    assert!(seen.insert((c.table, row)), "row {row} read twice");
                    Ok(())
                })
                .unwrap();
            }
        }
    }
    Ok(())
}
