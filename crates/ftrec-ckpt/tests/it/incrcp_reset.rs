//! IncrCP's baseline reset (§4.5), fired by its cost model rather than by `full_every`,
//! and exact restores on both sides of it.
//!
//! The model resets when writing a new baseline (`C_base`, measured) costs less than the
//! next increment plus the recovery of the rows since the baseline (`C_incre + R_i`,
//! extrapolated from the last two increments' restore rectangles at the read bandwidth).
//! The test injects the read bandwidth through the public setter, scaled by the measured
//! baseline time, so that small increments are worth keeping and one large increment
//! makes the rectangle cost far more than a new baseline, whatever this machine's speed.

use ftrec_testkit::model;
use std::time::Instant;

use ftrec_ckpt::{CheckpointKind, Checkpointer, Checkpoints, LocalStore, Manifest, Strategy};
use ftrec_model::{ModelState, StateDigest};

fn state() -> ModelState {
    model::adagrad_state(20_000, 32, 5)
}

/// The rectangle size at which reading it back takes as long as writing the baseline did
/// (by the test's own clock, which includes the write).
const BREAK_EVEN: f64 = 128.0 * 1024.0;

/// Training between checkpoints: rewrites `rows` of table 0 (and one row of table 1 and
/// the dense part, so every kind of state moves) with values unique to `step`.
fn train(s: &mut ModelState, ck: &mut Checkpointer, step: u64, rows: &[u32]) {
    let stride = s.tables()[0].stride();
    for &r in rows {
        let v = step as f32 * 1000.0 + r as f32 / 7.0;
        s.set_row(0, r as u64, &vec![v; stride]).unwrap();
    }
    ck.track(0, rows);
    let small = (step % 50) as u32;
    s.set_row(1, small as u64, &vec![step as f32; s.tables()[1].stride()])
        .unwrap();
    ck.track(1, &[small]);
    s.dense.params[0] = step as f32;
    s.dense.step = step;
}

#[test]
fn the_cost_model_resets_the_baseline_and_every_checkpoint_restores_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoints = Checkpoints::new(Box::new(LocalStore::open(dir.path()).unwrap()));
    // full_every = 0: no fixed cap, only the cost model can start a new baseline.
    let mut ck = Checkpointer::new(checkpoints, Strategy::Incrcp, 0, 2).unwrap();
    let mut s = state();
    let mut saved: Vec<(Manifest, StateDigest, ModelState)> = Vec::new();
    let mut take = |ck: &mut Checkpointer, s: &ModelState, step: u64| {
        let m = ck.checkpoint(s, step, serde_json::Value::Null).unwrap();
        // Committed, and its report absorbed into the model, before the next decision.
        ck.flush().unwrap();
        saved.push((m.clone(), s.digest(), s.clone()));
        m
    };

    let started = Instant::now();
    let first = take(&mut ck, &s, 1);
    let base_seconds = started.elapsed().as_secs_f64();
    assert_eq!(first.kind, CheckpointKind::Full);
    // Reading BREAK_EVEN bytes "takes" as long as the baseline took to write.
    ck.set_read_bandwidth(BREAK_EVEN / base_seconds);

    // Small increments: three rows each, rectangles far below break-even, so increments
    // stay cheaper than a new baseline.
    for step in 2..=4u64 {
        let rows: Vec<u32> = (step as u32 * 8..step as u32 * 8 + 2).collect();
        train(&mut s, &mut ck, step, &rows);
        let m = take(&mut ck, &s, step);
        assert_eq!(m.kind, CheckpointKind::Incrcp, "step {step}");
    }
    let small_rectangle = ck.incrcp_reports().last().unwrap().rectangle_bytes;
    assert!(
        (small_rectangle as f64) < BREAK_EVEN / 20.0,
        "small increments' rectangle is {small_rectangle} bytes"
    );

    // The increments grow: one rewrites most of the table, so restoring the chain now
    // reads far more than a baseline costs to write.
    let big: Vec<u32> = (0..19_000).collect();
    train(&mut s, &mut ck, 5, &big);
    let m = take(&mut ck, &s, 5);
    assert_eq!(m.kind, CheckpointKind::Incrcp);
    let big_rectangle = ck.incrcp_reports().last().unwrap().rectangle_bytes;
    assert!(
        big_rectangle as f64 > 20.0 * BREAK_EVEN,
        "the large increment's rectangle is only {big_rectangle} bytes"
    );
    assert_eq!(ck.incrcp_baselines(), 1);
    eprintln!(
        "baseline written in {:.1} ms; rectangles: small {small_rectangle} bytes, large \
         {big_rectangle} bytes, break-even {BREAK_EVEN} bytes",
        base_seconds * 1e3
    );

    // The next checkpoint, however small, is a new baseline: the model's decision.
    train(&mut s, &mut ck, 6, &[1, 2, 3]);
    let reset = take(&mut ck, &s, 6);
    assert_eq!(
        reset.kind,
        CheckpointKind::Full,
        "no reset after the growth"
    );
    assert_eq!(ck.incrcp_baselines(), 2);

    // Small increments continue on the new baseline.
    for step in 7..=8u64 {
        let rows: Vec<u32> = (step as u32 * 100..step as u32 * 100 + 2).collect();
        train(&mut s, &mut ck, step, &rows);
        let m = take(&mut ck, &s, step);
        assert_eq!(m.kind, CheckpointKind::Incrcp, "step {step}");
        assert_eq!(m.parents, std::slice::from_ref(&reset.id), "step {step}");
    }
    for (m, _, _) in &saved[1..5] {
        assert_eq!(m.parents, std::slice::from_ref(&first.id), "{}", m.id);
    }

    // The store holds both baselines and every increment.
    let listed: Vec<(u64, CheckpointKind)> = ck
        .checkpoints()
        .list()
        .unwrap()
        .iter()
        .map(|m| (m.step, m.kind))
        .collect();
    use CheckpointKind::{Full, Incrcp};
    assert_eq!(
        listed,
        [
            (1, Full),
            (2, Incrcp),
            (3, Incrcp),
            (4, Incrcp),
            (5, Incrcp),
            (6, Full),
            (7, Incrcp),
            (8, Incrcp)
        ]
    );

    // Every checkpoint, before, at and after the reset, restores to exactly what was
    // saved: the digest hashes every byte of every row, optimizer slot and dense value.
    for (m, digest, state) in &saved {
        let (restored, _) = ck.checkpoints().restore(&m.id).unwrap();
        assert_eq!(restored.digest(), *digest, "{} (step {})", m.id, m.step);
        assert!(restored == *state, "{} (step {})", m.id, m.step);
    }
    // Distinct states, so a restore of the wrong checkpoint cannot pass by accident.
    let mut digests: Vec<_> = saved.iter().map(|(_, d, _)| *d).collect();
    digests.dedup();
    assert_eq!(digests.len(), saved.len());
}
