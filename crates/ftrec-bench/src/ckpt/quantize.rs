//! `ftrec bench ckpt --quantize int8|int4`: what quantized checkpoints save and what they
//! cost in model quality (`checkpoint.quantize`, issue 43 §3).
//!
//! Two runs of the same job on a generated Criteo-shaped dataset, each trained in
//! `cycles` legs: after each leg a full checkpoint is written and the trainer is replaced
//! by one restored from it, as a job that is preempted and resumed every leg would be.
//! One run stores f32 rows (its restores are exact: its final state equals an
//! uninterrupted run's, which is checked), the other quantized rows, so its error
//! accumulates over the restores (Inshrinkerator measures the same effect). The report
//! gives the bytes written and read per checkpoint against f32, and the held-out AUC of
//! each run at the end.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use ftrec_ckpt::{QuantKind, Strategy};
use ftrec_config::JobConfig;
use ftrec_data::Dataset;
use ftrec_data::generate::{GenConfig, OutputFormat, generate, read_meta};
use ftrec_train::{TrainError, Trainer};

#[derive(Clone, Debug)]
pub struct QuantStudyConfig {
    pub preset: String,
    /// The dataset; generated here (Criteo-shaped, `rows` samples) when it holds none.
    pub data: PathBuf,
    pub rows: u64,
    /// Scratch directory for the checkpoints.
    pub dir: PathBuf,
    pub quantize: QuantKind,
    pub quantize_optimizer: bool,
    pub cycles: u64,
    pub steps_per_cycle: u64,
    pub seed: u64,
    pub threads: usize,
}

/// One run's figures.
#[derive(Clone, Debug, Serialize)]
pub struct QuantRun {
    pub quantize: QuantKind,
    pub quantize_optimizer: bool,
    /// Median over the run's checkpoints (all full, all the same size).
    pub bytes_written_per_checkpoint: u64,
    /// What one restore reads: the checkpoint's rows and dense file (same as written for
    /// a full checkpoint).
    pub bytes_read_per_restore: u64,
    pub median_save_seconds: f64,
    pub median_restore_seconds: f64,
    pub auc: f64,
    pub logloss: f64,
    pub state_digest: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct QuantReport {
    pub preset: String,
    pub steps: u64,
    pub restore_cycles: u64,
    pub eval_samples: usize,
    pub f32: QuantRun,
    pub quantized: QuantRun,
    /// Quantized bytes written per checkpoint over f32's.
    pub bytes_ratio_vs_f32: f64,
    pub read_bytes_ratio_vs_f32: f64,
    /// The quantized run's held-out AUC minus the f32 run's, after every restore.
    pub auc_delta_after_restores: f64,
    /// The f32 run, saved and restored every leg, ends bit-identical to one trained
    /// without a pause (its restores are exact).
    pub f32_cycles_exact: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The dataset under `c.data`, generated first when it is not there (or not this one).
fn dataset(c: &QuantStudyConfig) -> Result<(Dataset, Dataset), TrainError> {
    let gen_config = GenConfig::criteo(c.rows, c.seed, 0.01);
    let present = read_meta(&c.data).is_some_and(|m| m.config == gen_config)
        && c.data.join(ftrec_data::TRAIN_FILE).exists();
    if !present {
        generate(&gen_config, &c.data, OutputFormat::Binary, |_| {})
            .map_err(|e| TrainError::Config(e.to_string()))?;
    }
    let open =
        |file| Dataset::open_split(&c.data, file).map_err(|e| TrainError::Config(e.to_string()));
    Ok((open(ftrec_data::TRAIN_FILE)?, open(ftrec_data::TEST_FILE)?))
}

fn job(c: &QuantStudyConfig, quantize: QuantKind, dir: &Path) -> Result<JobConfig, TrainError> {
    let mut config = JobConfig::preset(&c.preset)?;
    config.seed = c.seed;
    config.threads = c.threads;
    config.data.dir = Some(c.data.clone());
    config.checkpoint.dir = Some(dir.to_path_buf());
    config.checkpoint.strategy = Some(Some(Strategy::Full));
    config.checkpoint.quantize = quantize;
    config.checkpoint.quantize_optimizer = c.quantize_optimizer && quantize != QuantKind::None;
    config.checkpoint.new_branch = true;
    config.validate()?;
    Ok(config)
}

fn run(
    c: &QuantStudyConfig,
    quantize: QuantKind,
    train: &Dataset,
    test: &Dataset,
) -> Result<QuantRun, TrainError> {
    let dir = c.dir.join(format!("{quantize:?}").to_lowercase());
    match std::fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(TrainError::Config(format!("{}: {e}", dir.display())));
        }
        _ => {}
    }
    let config = job(c, quantize, &dir)?;
    let mut trainer = Trainer::new(&config)?;
    trainer.enable_checkpoints()?;
    let (mut written, mut saves, mut restores) = (Vec::new(), Vec::new(), Vec::new());
    for cycle in 1..=c.cycles {
        // A leg ends with its checkpoint (`checkpoint.every_steps = 0`: at the end).
        let report = trainer.train(train, cycle * c.steps_per_cycle, |_| {})?;
        let saved = report.checkpoints;
        let id = saved
            .last_id
            .ok_or_else(|| TrainError::Config("no checkpoint was written".into()))?;
        saves.push(saved.blocking_seconds + saved.flush_seconds);
        written.push(saved.bytes as f64);
        drop(trainer);
        let started = Instant::now();
        trainer = Trainer::resume(&config, &dir, Some(&id), false)?;
        restores.push(started.elapsed().as_secs_f64());
        trainer.enable_checkpoints()?;
    }
    let metrics = trainer.evaluate(test, 0)?;
    let bytes = median(written) as u64;
    Ok(QuantRun {
        quantize,
        quantize_optimizer: config.checkpoint.quantize_optimizer,
        bytes_written_per_checkpoint: bytes,
        bytes_read_per_restore: bytes,
        median_save_seconds: median(saves),
        median_restore_seconds: median(restores),
        auc: metrics.auc,
        logloss: metrics.logloss,
        state_digest: trainer.digest().to_string(),
    })
}

pub fn study(c: &QuantStudyConfig) -> Result<QuantReport, TrainError> {
    if c.quantize == QuantKind::None {
        return Err(TrainError::Config(
            "--quantize int8 or int4: the study compares it with f32".into(),
        ));
    }
    if c.cycles == 0 || c.steps_per_cycle == 0 {
        return Err(TrainError::Config(
            "--cycles and --steps-per-cycle must be at least 1".into(),
        ));
    }
    let (train, test) = dataset(c)?;
    let f32 = run(c, QuantKind::None, &train, &test)?;
    let quantized = run(c, c.quantize, &train, &test)?;
    // The same job without a pause: the f32 run must end exactly there.
    let uninterrupted = {
        let config = job(c, QuantKind::None, &c.dir.join("uninterrupted"))?;
        let mut trainer = Trainer::new(&config)?;
        trainer.train(&train, c.cycles * c.steps_per_cycle, |_| {})?;
        trainer.digest().to_string()
    };
    Ok(QuantReport {
        preset: c.preset.clone(),
        steps: c.cycles * c.steps_per_cycle,
        restore_cycles: c.cycles,
        eval_samples: test.len(),
        bytes_ratio_vs_f32: quantized.bytes_written_per_checkpoint as f64
            / f32.bytes_written_per_checkpoint.max(1) as f64,
        read_bytes_ratio_vs_f32: quantized.bytes_read_per_restore as f64
            / f32.bytes_read_per_restore.max(1) as f64,
        auc_delta_after_restores: quantized.auc - f32.auc,
        f32_cycles_exact: f32.state_digest == uninterrupted,
        f32,
        quantized,
    })
}
