//! `ftrec train` and `ftrec eval`: the single-process trainer.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::Args;
use ftrec_config::JobConfig;
use ftrec_data::generate::read_meta;
use ftrec_data::{Dataset, TEST_FILE, TRAIN_FILE};
use ftrec_train::{Trainer, snapshot};
use serde_json::json;

use super::config::{ConfigArgs, load_config, run_overrides};
use crate::output::print_json;
use crate::progress::bar;

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Dataset directory with train.ftrd and test.ftrd (overrides data.dir).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Total steps (overrides train.steps).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Save the final model to this snapshot file.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Write checkpoints here (same as `--set checkpoint.dir=DIR`); strategy `full` unless
    /// `checkpoint.strategy` says otherwise, every `checkpoint.every_steps` and at the end.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Resume from `DIR` (newest checkpoint) or `DIR@ID`. `--steps` still counts total steps.
    #[arg(long, value_name = "DIR[@ID]")]
    pub resume: Option<String>,
    /// With `--resume`: if the checkpoint is damaged, use the newest older one that
    /// restores cleanly (reported as `resumed_from`).
    #[arg(long, requires = "resume")]
    pub fallback: bool,
    /// Start an independent branch of history in a checkpoint location that already
    /// holds checkpoints (a fresh run there is refused otherwise).
    #[arg(long)]
    pub new_branch: bool,
    /// Print one JSON object with the results.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Snapshot written by `ftrec train --save`.
    #[arg(long)]
    pub model: PathBuf,
    /// Dataset directory (its test split is used) or a .ftrd file.
    #[arg(long)]
    pub data: PathBuf,
    #[arg(long, default_value_t = 4096)]
    pub batch_size: usize,
    /// Evaluate at most this many samples (0 = all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    #[arg(long)]
    pub json: bool,
}

struct TrainOutcome {
    resumed_from: Option<String>,
    writer: Option<ftrec_ckpt::WriterStart>,
    report: ftrec_train::TrainReport,
    metrics: ftrec_model::metrics::Metrics,
    digest: String,
}

fn open_split(dir: &Path, file: &str) -> Result<Dataset> {
    // DataError already names the file.
    Ok(Dataset::open_split(dir, file)?)
}

fn train_and_eval(
    config: &JobConfig,
    dir: &Path,
    save: Option<&Path>,
    resume: Option<&str>,
    fallback: bool,
    quiet: bool,
) -> Result<TrainOutcome> {
    let train_ds = open_split(dir, TRAIN_FILE)?;
    let test_ds = open_split(dir, TEST_FILE)?;
    let mut trainer = match resume {
        Some(spec) => {
            let (ck_dir, id) = crate::commands::ckpt::parse_location(spec);
            Trainer::resume(config, &ck_dir, id.as_deref(), fallback)?
        }
        None => Trainer::new(config)?,
    };
    let total = trainer.planned_steps(&train_ds);
    // Before checkpointing starts (a resume may fork a branch): nothing to undo.
    trainer.check_total_steps(total)?;
    trainer.enable_checkpoints()?;
    for w in &trainer.resume_warnings {
        eprintln!("warning: {w}");
    }
    if let Some(id) = &trainer.resumed_from
        && trainer.progress.step == total
    {
        eprintln!("warning: checkpoint {id} is already at step {total}: nothing left to train");
    }
    let pb = bar(total, "train");
    if quiet {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let report = trainer.train(&train_ds, total, |s| {
        pb.set_position(s.step);
        if s.step % 5 == 0 || s.step == s.total_steps {
            pb.set_message(format!(
                "{:.0} samples/s loss {:.4}",
                s.samples as f64 / s.elapsed_secs.max(1e-9),
                s.loss
            ));
        }
    })?;
    pb.finish_and_clear();
    let metrics = trainer.evaluate(&test_ds, config.train.eval_samples)?;
    if let Some(path) = save {
        snapshot::save(path, &trainer.state, trainer.progress)?;
    }
    Ok(TrainOutcome {
        resumed_from: trainer.resumed_from.clone(),
        writer: trainer.writer_start.clone(),
        report,
        metrics,
        digest: trainer.digest().to_string(),
    })
}

pub(crate) fn train(a: TrainArgs) -> Result<()> {
    let mut extra = run_overrides(a.steps, a.data.as_deref(), a.checkpoint_dir.as_deref());
    if a.new_branch {
        extra.push("checkpoint.new_branch=true".into());
    }
    let config = load_config(&a.config, extra)?;
    config.require_checkpoint_dir()?;
    let Some(dir) = config.data.dir.clone() else {
        bail!("no dataset: pass --data DIR or set data.dir");
    };
    let out = train_and_eval(
        &config,
        &dir,
        a.save.as_deref(),
        a.resume.as_deref(),
        a.fallback,
        false,
    )?;
    let teacher_auc = read_meta(&dir).map(|m| m.teacher_auc);
    if a.json {
        return print_json(json!({
            "auc": out.metrics.auc,
            "logloss": out.metrics.logloss,
            "accuracy": out.metrics.accuracy,
            "eval_samples": out.metrics.samples,
            "samples": out.report.samples,
            "steps": out.report.steps,
            "seconds": out.report.seconds,
            "samples_per_sec": out.report.samples_per_sec,
            "train_logloss": out.report.train_logloss,
            "state_digest": out.digest,
            "teacher_auc": teacher_auc,
            "checkpoints": out.report.checkpoints,
            "resumed_from": out.resumed_from,
            "checkpoint_branch": out.writer.as_ref().map(|w| w.branch),
            "forked_from": out.writer.as_ref().and_then(|w| w.forked_from.clone()),
        }));
    }
    outln!(
        "trained {} steps ({} samples) in {:.1}s: {:.0} samples/s, train logloss {:.4}",
        out.report.steps,
        out.report.samples,
        out.report.seconds,
        out.report.samples_per_sec,
        out.report.train_logloss
    );
    outln!(
        "held-out ({} samples): AUC {:.4}, logloss {:.4}, accuracy {:.4}{}",
        out.metrics.samples,
        out.metrics.auc,
        out.metrics.logloss,
        out.metrics.accuracy,
        teacher_auc.map_or(String::new(), |t| format!(" (teacher AUC {t:.4})"))
    );
    outln!("state digest {}", out.digest);
    Ok(())
}

pub(crate) fn eval(a: EvalArgs) -> Result<()> {
    let (state, progress) = snapshot::load(&a.model)?;
    let config = JobConfig::for_model(state.config(), a.batch_size, a.threads);
    config.fits_in_memory(state.bytes() as u64)?;
    let mut trainer = Trainer::with_state(&config, state, progress)?;
    let ds = open_split(&a.data, TEST_FILE)?;
    let m = trainer.evaluate(&ds, a.limit)?;
    if a.json {
        return print_json(json!({
            "auc": m.auc, "logloss": m.logloss, "accuracy": m.accuracy,
            "samples": m.samples, "model_step": progress.step,
            "state_digest": trainer.digest().to_string(),
        }));
    }
    outln!(
        "{} samples: AUC {:.4}, logloss {:.4}, accuracy {:.4} (model at step {})",
        m.samples,
        m.auc,
        m.logloss,
        m.accuracy,
        progress.step
    );
    Ok(())
}
