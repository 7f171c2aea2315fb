//! Same seed, data and config give bit-identical parameters; a run resumed from a
//! snapshot equals an uninterrupted one; snapshots detect damage.

use std::path::Path;

use ftrec_config::JobConfig;
use ftrec_data::generate::{GenConfig, OutputFormat, generate};
use ftrec_data::{Dataset, TRAIN_FILE};
use ftrec_train::{Trainer, snapshot};

fn small_config(threads: usize, sparse_opt: &str) -> JobConfig {
    let mut overrides: Vec<String> = vec![
        "model.rows_per_table=500".into(),
        "model.dim=8".into(),
        "model.bottom=[16, 8]".into(),
        "model.top=[16, 1]".into(),
        "train.batch_size=128".into(),
        format!("threads={threads}"),
        format!("optimizer.sparse.kind=\"{sparse_opt}\""),
        "optimizer.dense.kind=\"adam\"".into(),
    ];
    if sparse_opt == "momentum" {
        overrides.push("optimizer.sparse.momentum=0.9".into());
    }
    JobConfig::load(Some("tiny"), None, &overrides).unwrap()
}

fn dataset(dir: &Path) -> Dataset {
    let cfg = GenConfig::criteo(4000, 5, 0.0005);
    generate(&cfg, dir, OutputFormat::Binary, |_| {}).unwrap();
    Dataset::open(&dir.join(TRAIN_FILE)).unwrap()
}

fn run(config: &JobConfig, data: &Dataset, steps: u64) -> Trainer {
    let mut t = Trainer::new(config).unwrap();
    t.train(data, steps, |_| {}).unwrap();
    t
}

#[test]
fn same_seed_same_bits_for_every_optimizer_and_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    for opt in ["sgd", "momentum", "adagrad", "rowwise_adagrad", "adam"] {
        let cfg = small_config(2, opt);
        let a = run(&cfg, &data, 40).digest();
        let b = run(&cfg, &data, 40).digest();
        assert_eq!(a, b, "{opt}: two identical runs differ");
        let c = run(&small_config(1, opt), &data, 40).digest();
        assert_eq!(a, c, "{opt}: 1 and 2 threads differ");
        let mut other_seed = cfg.clone();
        other_seed.seed += 1;
        assert_ne!(
            a,
            run(&other_seed, &data, 40).digest(),
            "{opt}: seed ignored"
        );
    }
}

#[test]
fn resumed_from_snapshot_equals_uninterrupted() {
    let dir = tempfile::tempdir().unwrap();
    let data = dataset(dir.path());
    let cfg = small_config(2, "adam");
    // 4000*0.9/128 = 28.1 steps per epoch: 45 steps cross an epoch boundary.
    let full = run(&cfg, &data, 45);
    let first = run(&cfg, &data, 17);
    let path = dir.path().join("m.ftm");
    snapshot::save(&path, &first.state, first.progress).unwrap();
    let (state, progress) = snapshot::load(&path).unwrap();
    assert_eq!(state, first.state);
    let mut resumed = Trainer::with_state(&cfg, state, progress).unwrap();
    resumed.train(&data, 45, |_| {}).unwrap();
    assert_eq!(resumed.progress, full.progress);
    assert_eq!(resumed.digest(), full.digest());
}

#[test]
fn damaged_snapshots_are_rejected_with_the_offset() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_config(1, "rowwise_adagrad");
    let t = Trainer::new(&cfg).unwrap();
    let path = dir.path().join("m.ftm");
    snapshot::save(&path, &t.state, t.progress).unwrap();
    let good = std::fs::read(&path).unwrap();
    for pos in [0, 13, 40, good.len() / 2, good.len() - 3] {
        let mut bad = good.clone();
        bad[pos] ^= 0x01;
        std::fs::write(&path, &bad).unwrap();
        let e = snapshot::load(&path).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("m.ftm"), "flip at {pos}: {e}");
    }
    for len in [5, good.len() / 3, good.len() - 1] {
        std::fs::write(&path, &good[..len]).unwrap();
        let e = snapshot::load(&path).map(|_| ()).unwrap_err().to_string();
        assert!(
            e.contains("truncated") && e.contains("offset"),
            "len {len}: {e}"
        );
    }
}
