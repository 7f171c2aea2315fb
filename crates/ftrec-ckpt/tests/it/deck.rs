//! DECK's policies: when a full checkpoint is due, which old ones the lineage keeps, and
//! the staging memory bound on a model many chunks large.

use ftrec_ckpt::deck::{DeckOptions, LineagePolicy};
use ftrec_ckpt::{CheckpointKind, Checkpointer, Checkpoints, LocalStore};
use ftrec_model::{ModelConfig, ModelState, Optimizer};

fn state() -> ModelState {
    let config = ModelConfig {
        num_dense: 2,
        table_rows: vec![5000, 300],
        dim: 8,
        bottom: vec![8],
        top: vec![1],
        sparse_optimizer: Optimizer::Adagrad {
            lr: 0.1,
            eps: 1e-8,
            initial_accumulator: 0.1,
        },
        dense_optimizer: Optimizer::Sgd { lr: 0.1 },
    };
    ModelState::new(&config, 3).unwrap()
}

/// Takes `n` checkpoints, each after rewriting the same 100 rows (equal-sized deltas), and
/// returns the kinds written.
fn kinds(options: DeckOptions, n: u64) -> (Vec<CheckpointKind>, Checkpointer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpoints::new(Box::new(LocalStore::open(dir.path()).unwrap()));
    let mut ck = Checkpointer::deck(ck, 2, options).unwrap();
    let mut s = state();
    let rows: Vec<u32> = (0..100).collect();
    let mut kinds = Vec::new();
    for step in 1..=n {
        for &r in &rows {
            s.set_row(0, r as u64, &vec![step as f32; s.tables()[0].stride()])
                .unwrap();
        }
        ck.track(0, &rows);
        let m = ck.checkpoint(&s, step, serde_json::Value::Null).unwrap();
        kinds.push(m.kind);
        // Let the background catch up, so the live volume it measures is current.
        ck.flush_background().unwrap();
    }
    (kinds, ck, dir)
}

use CheckpointKind::{Delta, Full};

#[test]
fn a_full_checkpoint_every_n_deltas() {
    let options = DeckOptions {
        full_every_deltas: 3,
        live_factor: 0.0,
        ..DeckOptions::default()
    };
    let (k, _, _) = kinds(options, 9);
    assert_eq!(
        k,
        [Full, Delta, Delta, Delta, Full, Delta, Delta, Delta, Full]
    );
}

#[test]
fn a_full_checkpoint_when_live_deltas_outgrow_f_times_one() {
    // Without merging, live volume is the sum of the deltas: d, 2d, 3d > 2.5d.
    let options = DeckOptions {
        live_factor: 2.5,
        merge_in_background: false,
        ..DeckOptions::default()
    };
    let (k, _, _) = kinds(options, 9);
    assert_eq!(
        k,
        [Full, Delta, Delta, Delta, Full, Delta, Delta, Delta, Full]
    );
    // Merging keeps one checkpoint per set bit of the delta count (stride 2), each about
    // one delta here: the volume first exceeds 3.5 deltas after 15.
    let options = DeckOptions {
        live_factor: 3.5,
        stride: 2,
        ..DeckOptions::default()
    };
    let (k, ck, _dir) = kinds(options, 9);
    assert_eq!(k.iter().filter(|k| **k == Full).count(), 1, "{k:?}");
    let stats = ck.deck_stats().unwrap();
    assert!(!stats.merges.merged.is_empty());
    assert!(stats.merges.bytes_per_second() > 0.0);
}

#[test]
fn the_lineage_keeps_spaced_old_fulls_and_drops_old_deltas() {
    let options = DeckOptions {
        full_every_deltas: 1,
        live_factor: 0.0,
        lineage: LineagePolicy {
            keep_full_gap_steps: 4,
            keep_full_max: 2,
        },
        ..DeckOptions::default()
    };
    // Fulls at steps 1, 3, 5, 7, 9, 11; deltas in between.
    let (k, ck, _dir) = kinds(options, 12);
    assert_eq!(k.iter().filter(|k| **k == Full).count(), 6);
    let listed: Vec<(u64, CheckpointKind)> = ck
        .checkpoints()
        .list()
        .unwrap()
        .iter()
        .map(|m| (m.step, m.kind))
        .collect();
    // Of the older fulls 1, 3, 5, 7, 9, those 4 steps apart are 1, 5, 9; the newest two
    // stay (5, 9), with the current base 11 and its delta 12.
    assert_eq!(listed, [(5, Full), (9, Full), (11, Full), (12, Delta)]);
    for m in ck.checkpoints().list().unwrap() {
        ck.checkpoints().restore(&m.id).unwrap();
    }
}

#[test]
fn staging_holds_at_most_four_chunks_whatever_the_model_size() {
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpoints::new(Box::new(LocalStore::open(dir.path()).unwrap()));
    let options = DeckOptions {
        // About 100 chunks for the two tables.
        chunk_bytes: 4 * 18 * 50,
        ..DeckOptions::default()
    };
    let mut ck = Checkpointer::deck(ck, 2, options).unwrap();
    let s = state();
    let m = ck.checkpoint(&s, 1, serde_json::Value::Null).unwrap();
    assert!(m.chunks.len() >= 100, "{} chunks", m.chunks.len());
    ck.flush().unwrap();
    let peak = ck.deck_stats().unwrap().peak_resident_chunks;
    assert!((1..=4).contains(&peak), "peak {peak}");
    let (restored, _) = ck.checkpoints().restore(&m.id).unwrap();
    assert_eq!(restored, s);
}

/// A cluster pins its committed cut: DECK's merger folds the pinned delta into a merged
/// checkpoint but keeps it, and it still restores to its own state; gc keeps it too.
#[test]
fn a_pinned_delta_survives_merges_and_gc_and_restores_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let store = Checkpoints::new(Box::new(LocalStore::open(dir.path()).unwrap()));
    let options = DeckOptions {
        merge_in_background: false,
        full_every_deltas: 0,
        live_factor: 0.0,
        ..DeckOptions::default()
    };
    let mut ck = Checkpointer::deck(store.clone(), 2, options).unwrap();
    let mut s = state();
    let mut states = Vec::new();
    let mut ids = Vec::new();
    for step in 1..=3u64 {
        let rows: Vec<u32> = (step as u32 * 10..step as u32 * 10 + 50).collect();
        for &r in &rows {
            s.set_row(0, r as u64, &vec![step as f32; s.tables()[0].stride()])
                .unwrap();
        }
        ck.track(0, &rows);
        ids.push(ck.checkpoint(&s, step, serde_json::Value::Null).unwrap().id);
        ck.flush_background().unwrap();
        states.push(s.clone());
    }
    // Full at step 1, deltas at 2 and 3: pin step 2, then merge both deltas (through a
    // second handle, as `ftrec ckpt merge` from another process would).
    store.pin_step(2).unwrap();
    let other = Checkpoints::new(Box::new(LocalStore::open(dir.path()).unwrap()));
    let report = ftrec_ckpt::merge::merge_pass(&other, &ids[0], 2, 1 << 20).unwrap();
    assert_eq!(report.merged.len(), 1, "{report:?}");
    assert!(!report.deleted.contains(&ids[1]), "{report:?}");
    assert!(report.deleted.contains(&ids[2]), "{report:?}");
    assert_eq!(store.restore(&ids[1]).unwrap().0, states[1]);
    let merged = &report.merged[0];
    assert_eq!(store.restore(merged).unwrap().0, states[2]);
    // gc keeping only the newest per branch still keeps the pinned delta's chain.
    store.gc(Some(1)).unwrap();
    assert_eq!(store.restore(&ids[1]).unwrap().0, states[1]);
    // Unpinned, it goes.
    store.set_pinned_steps(&[]).unwrap();
    store.gc(Some(1)).unwrap();
    assert!(store.restore(&ids[1]).is_err());
}
