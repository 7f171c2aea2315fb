//! The model learns the planted teacher: held-out AUC approaches the teacher's ceiling.
//! (The full-size check is `ftrec demo`; this is the same pipeline at test scale.)

use ftrec_config::JobConfig;
use ftrec_data::generate::{GenConfig, OutputFormat, generate};
use ftrec_data::{Dataset, TEST_FILE, TRAIN_FILE};
use ftrec_train::Trainer;

#[test]
fn held_out_auc_approaches_the_teacher() {
    let dir = tempfile::tempdir().unwrap();
    let report = generate(
        &GenConfig::criteo(150_000, 9, 0.001),
        dir.path(),
        OutputFormat::Binary,
        |_| {},
    )
    .unwrap();
    let config = JobConfig::load(
        Some("demo"),
        None,
        &[
            "model.rows_per_table=20000".into(),
            "model.dim=16".into(),
            "model.bottom=[64, 16]".into(),
            "model.top=[64, 32, 1]".into(),
            "train.batch_size=512".into(),
        ],
    )
    .unwrap();
    let train = Dataset::open(&dir.path().join(TRAIN_FILE)).unwrap();
    let test = Dataset::open(&dir.path().join(TEST_FILE)).unwrap();
    let mut trainer = Trainer::new(&config).unwrap();
    let untrained = trainer.evaluate(&test, 0).unwrap();
    let steps = trainer.planned_steps(&train);
    trainer.train(&train, steps, |_| {}).unwrap();
    let trained = trainer.evaluate(&test, 0).unwrap();
    eprintln!(
        "teacher AUC {:.4}, untrained {:.4}, trained {:.4} (logloss {:.4})",
        report.teacher_auc, untrained.auc, trained.auc, trained.logloss
    );
    assert!(untrained.auc < report.teacher_auc - 0.1);
    assert!(
        trained.auc > report.teacher_auc - 0.03,
        "trained AUC {} too far below teacher {}",
        trained.auc,
        report.teacher_auc
    );
}
