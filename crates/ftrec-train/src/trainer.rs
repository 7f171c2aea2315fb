//! The single-process training loop.

use std::time::Instant;

use ftrec_data::Dataset;
use ftrec_model::metrics::{Metrics, evaluate};
use ftrec_model::{Batch, Dlrm, GemmMatMul, ModelConfig, ModelState, TablePages};
use rayon::ThreadPool;
use serde::Serialize;

use crate::TrainError;
use ftrec_ckpt::lease::LeaseOptions;
use ftrec_ckpt::{BranchStart, Checkpointer, Checkpoints, Manifest, WriterStart, open_store};
use ftrec_config::JobConfig;

/// Where training is: steps done and the next sample of the training split. Saved with
/// checkpoints so a resumed run reads exactly the samples an uninterrupted one would.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Progress {
    pub step: u64,
    pub epoch: u64,
    pub position: u64,
}

/// What a checkpoint records about the run besides the model: where training is, and the
/// settings outside the model that decide what a resumed run does (so a resume with
/// other values can say so). Older checkpoints hold the progress alone.
#[derive(Serialize, serde::Deserialize)]
struct RunRecord {
    #[serde(flatten)]
    progress: Progress,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    batch_size: Option<usize>,
}

/// Passed to the progress callback after every step.
#[derive(Clone, Copy, Debug)]
pub struct StepInfo {
    pub step: u64,
    pub total_steps: u64,
    pub samples: u64,
    pub loss: f64,
    pub elapsed_secs: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct TrainReport {
    pub steps: u64,
    pub samples: u64,
    pub seconds: f64,
    pub samples_per_sec: f64,
    /// Mean training log loss over the run.
    pub train_logloss: f64,
    pub checkpoints: CheckpointStats,
}

/// What checkpointing cost during a `train` call.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CheckpointStats {
    pub written: u64,
    /// Time training was stopped while checkpoints were written.
    pub blocking_seconds: f64,
    pub bytes: u64,
    pub last_id: Option<String>,
    /// Time spent tracking changed rows (delta strategies).
    pub tracking_seconds: f64,
    /// Time the end of training waited for background checkpoint writes to commit.
    pub flush_seconds: f64,
}

pub struct Trainer {
    config: JobConfig,
    model_config: ModelConfig,
    table_rows: Vec<u32>,
    pub state: ModelState,
    pub progress: Progress,
    model: Dlrm,
    pool: ThreadPool,
    batch: Batch,
    checkpointer: Option<Checkpointer>,
    /// The checkpoint this trainer was resumed from.
    pub resumed_from: Option<String>,
    /// The checkpoint location `resumed_from` is in.
    resumed_location: Option<String>,
    /// Where this run's checkpoints go: branch, fork point.
    pub writer_start: Option<WriterStart>,
    /// How fast that restore read the model, for IncrCP's baseline-reset estimate.
    restore_bytes_per_second: Option<f64>,
    /// What the user must hear about the resume: settings that differ from the
    /// checkpoint's run (the caller shows them).
    pub resume_warnings: Vec<String>,
}

/// The pages a single-process job's tables go on (`train.huge_pages`).
pub fn table_pages(config: &JobConfig) -> TablePages {
    if config.train.huge_pages {
        TablePages::Huge
    } else {
        TablePages::Default
    }
}

impl Trainer {
    /// A trainer with a freshly initialised model (deterministic in `config.seed`).
    pub fn new(config: &JobConfig) -> Result<Self, TrainError> {
        // Refused here, not aborted by the allocator below.
        config.fits_in_memory(0)?;
        let model_config = config.model_config()?;
        let pool = Self::pool(config)?;
        let pages = table_pages(config);
        let state = pool.install(|| ModelState::new_on(&model_config, config.seed, pages))?;
        Self::assemble(config, model_config, pool, state, Progress::default())
    }

    /// A trainer around an existing state (a snapshot or checkpoint), without initialising
    /// a model first.
    pub fn with_state(
        config: &JobConfig,
        state: ModelState,
        progress: Progress,
    ) -> Result<Self, TrainError> {
        let model_config = config.model_config()?;
        let pool = Self::pool(config)?;
        if state.config() != &model_config {
            return Err(Self::mismatch(
                "restored state",
                &state.config().differences(&model_config),
            ));
        }
        Self::assemble(config, model_config, pool, state, progress)
    }

    fn pool(config: &JobConfig) -> Result<ThreadPool, TrainError> {
        rayon::ThreadPoolBuilder::new()
            .num_threads(config.threads())
            .build()
            .map_err(|e| TrainError::Threads(e.to_string()))
    }

    /// A refusal naming every setting that differs, the saved value first.
    fn mismatch(what: &str, differences: &[String]) -> TrainError {
        TrainError::Config(format!(
            "{what} was trained with another model or optimizer than this configuration \
             (saved vs configured): {}",
            differences.join("; ")
        ))
    }

    fn assemble(
        config: &JobConfig,
        model_config: ModelConfig,
        pool: ThreadPool,
        state: ModelState,
        progress: Progress,
    ) -> Result<Self, TrainError> {
        let threads = config.threads();
        let model = Dlrm::new(
            &model_config,
            config.train.batch_size,
            threads,
            Box::new(GemmMatMul),
        )?;
        Ok(Self {
            table_rows: model_config.table_rows.iter().map(|&r| r as u32).collect(),
            batch: Batch::with_tables(model_config.tables()),
            model_config,
            config: config.clone(),
            state,
            progress,
            model,
            pool,
            checkpointer: None,
            resumed_from: None,
            resumed_location: None,
            writer_start: None,
            restore_bytes_per_second: None,
            resume_warnings: Vec::new(),
        })
    }

    /// Opens the configured checkpoint directory (if any) so `train` writes checkpoints:
    /// takes its writer lease and picks the branch (a resume from an older checkpoint of
    /// the same location forks a new branch; a fresh run into a location with history is
    /// refused unless `checkpoint.new_branch`).
    pub fn enable_checkpoints(&mut self) -> Result<(), TrainError> {
        let c = &self.config.checkpoint;
        if c.effective_strategy().is_none() {
            return Ok(());
        }
        if let Some(dir) = &c.dir {
            let location = dir.to_string_lossy().to_string();
            let same_location = self
                .resumed_location
                .as_deref()
                .is_some_and(|r| same_location(r, &location));
            let start = match (&self.resumed_from, same_location) {
                (Some(id), true) => BranchStart::Resume { from: id.clone() },
                _ => BranchStart::Fresh {
                    new_branch: c.new_branch,
                },
            };
            let (checkpoints, started) = Checkpoints::new(open_store(&location)?)
                .with_quant(c.quant())
                .start_writing(start, &LeaseOptions::new("ftrec train"))?;
            if started.new_branch || started.cleaned > 0 {
                tracing::info!(
                    "checkpoints go to branch {} of {location}{}",
                    started.branch,
                    started
                        .forked_from
                        .as_ref()
                        .map_or(String::new(), |f| format!(", forked at {f}"))
                );
            }
            self.writer_start = Some(started);
            let tables = self.model_config.tables();
            let Some(mut ck) =
                Checkpointer::start_configured(checkpoints, c.strategy_config()?, tables)?
            else {
                return Ok(());
            };
            if let Some(speed) = self.restore_bytes_per_second {
                ck.set_read_bandwidth(speed);
            }
            self.checkpointer = Some(ck);
        }
        Ok(())
    }

    /// A trainer restored from checkpoint `id` (the newest when `None`) in `dir`: model
    /// state, optimizer state, dense step and data position are those of the checkpoint.
    /// A damaged checkpoint is an error, unless `fallback` is set: then the newest older
    /// checkpoint that restores cleanly is used.
    pub fn resume(
        config: &JobConfig,
        dir: &std::path::Path,
        id: Option<&str>,
        fallback: bool,
    ) -> Result<Self, TrainError> {
        // The restore allocates the whole model: refuse what cannot fit before it does.
        config.fits_in_memory(0)?;
        let restore_started = Instant::now();
        let location = dir.to_string_lossy().to_string();
        let ck = Checkpoints::new(open_store(&location)?);
        let no_checkpoint =
            || TrainError::Config(format!("{}: no checkpoint to resume from", dir.display()));
        let (state, manifest) = if fallback {
            // Newest first, starting at the requested checkpoint; damaged ones are skipped
            // and reported, so the user sees what was passed over.
            let (good, damaged) = ck.list_lenient()?;
            for (_, e) in &damaged {
                tracing::warn!("skipping a damaged manifest: {e}");
            }
            let limit = id
                .and_then(|id| good.iter().find(|m| m.id == id))
                .map(|m| m.step);
            let mut restored = None;
            for m in good
                .iter()
                .rev()
                .filter(|m| limit.is_none_or(|l| m.step <= l))
            {
                match ck.restore(&m.id) {
                    Ok(r) => {
                        restored = Some(r);
                        break;
                    }
                    Err(e) => tracing::warn!("--fallback: checkpoint {} is unusable: {e}", m.id),
                }
            }
            restored.ok_or_else(no_checkpoint)?
        } else {
            let id = match id {
                Some(id) => id.to_string(),
                None => ck.latest()?.ok_or_else(no_checkpoint)?.id,
            };
            ck.restore(&id)?
        };
        let id = manifest.id.clone();
        let record: RunRecord = serde_json::from_value(manifest.trainer.clone()).map_err(|e| {
            TrainError::Config(format!("checkpoint {id}: unreadable trainer progress: {e}"))
        })?;
        let model_config = config.model_config()?;
        if state.config() != &model_config {
            return Err(Self::mismatch(
                &format!("checkpoint {id}"),
                &state.config().differences(&model_config),
            ));
        }
        let warnings = run_differences(&id, &record, config);
        let mut trainer = Self::assemble(
            config,
            model_config,
            Self::pool(config)?,
            state,
            record.progress,
        )?;
        trainer.resume_warnings = warnings;
        trainer.resumed_from = Some(id);
        trainer.resumed_location = Some(location);
        let seconds = restore_started.elapsed().as_secs_f64();
        trainer.restore_bytes_per_second = Some(trainer.state.bytes() as f64 / seconds.max(1e-9));
        Ok(trainer)
    }

    /// Writes a checkpoint of the current state now (kind chosen by the strategy).
    pub fn checkpoint(&mut self) -> Result<Option<Manifest>, TrainError> {
        let Some(ck) = &mut self.checkpointer else {
            return Ok(None);
        };
        let progress = serde_json::to_value(RunRecord {
            progress: self.progress,
            seed: Some(self.config.seed),
            batch_size: Some(self.config.train.batch_size),
        })
        .map_err(|e| TrainError::Config(e.to_string()))?;
        let (state, step) = (&self.state, self.progress.step);
        Ok(Some(
            self.pool.install(|| ck.checkpoint(state, step, progress))?,
        ))
    }

    /// Feeds the rows the last step updated to the delta tracker.
    fn track_step(&mut self) {
        if let Some(ck) = &mut self.checkpointer {
            for t in 0..self.model_config.tables() {
                ck.track(t, self.model.unique_rows(t));
            }
            if self.progress.step.is_multiple_of(16) {
                ck.compact();
            }
        }
    }

    pub fn config(&self) -> &JobConfig {
        &self.config
    }

    fn check_dataset(&self, data: &Dataset) -> Result<(), TrainError> {
        if data.num_dense() != self.model_config.num_dense
            || data.num_sparse() != self.model_config.tables()
        {
            return Err(TrainError::Config(format!(
                "{} has {} dense and {} sparse features but the model expects {} and {}",
                data.path().display(),
                data.num_dense(),
                data.num_sparse(),
                self.model_config.num_dense,
                self.model_config.tables()
            )));
        }
        if data.is_empty() {
            return Err(TrainError::Config(format!(
                "{} is empty",
                data.path().display()
            )));
        }
        Ok(())
    }

    /// Refuses a total below the step a resumed trainer is at: training cannot go
    /// backwards, and stopping at once with success would pass the checkpoint's model off
    /// as the one asked for.
    pub fn check_total_steps(&self, total_steps: u64) -> Result<(), TrainError> {
        match &self.resumed_from {
            Some(id) if self.progress.step > total_steps => Err(TrainError::Config(format!(
                "checkpoint {id} is at step {} but this run stops at step {total_steps} \
                 (train.steps, or the epochs over the data): nothing to train; ask for more \
                 than {} steps",
                self.progress.step, self.progress.step
            ))),
            _ => Ok(()),
        }
    }

    /// Total steps the configuration asks for on `data`.
    pub fn planned_steps(&self, data: &Dataset) -> u64 {
        if self.config.train.steps > 0 {
            self.config.train.steps
        } else {
            self.config.train.epochs
                * (data.len() as u64).div_ceil(self.config.train.batch_size as u64)
        }
    }

    /// Trains until `progress.step` reaches `total_steps` (so a resumed trainer stops
    /// where an uninterrupted one does), calling `on_step` after each step.
    pub fn train(
        &mut self,
        data: &Dataset,
        total_steps: u64,
        mut on_step: impl FnMut(&StepInfo),
    ) -> Result<TrainReport, TrainError> {
        self.check_dataset(data)?;
        self.check_total_steps(total_steps)?;
        let start = Instant::now();
        let (mut samples, mut loss_sum, mut steps) = (0u64, 0.0f64, 0u64);
        let mut ckpt = CheckpointStats::default();
        let every = self.config.checkpoint.every_steps;
        let batch_size = self.config.train.batch_size as u64;
        while self.progress.step < total_steps {
            let remaining = data.len() as u64 - self.progress.position;
            let n = remaining.min(batch_size);
            data.fill_batch(
                self.progress.position as usize,
                n as usize,
                &self.table_rows,
                &mut self.batch,
            )?;
            let (model, state, batch) = (&mut self.model, &mut self.state, &self.batch);
            let loss = self.pool.install(|| model.train_step(state, batch))?;
            self.progress.step += 1;
            self.progress.position += n;
            self.track_step();
            if self.progress.position == data.len() as u64 {
                self.progress.position = 0;
                self.progress.epoch += 1;
            }
            samples += n;
            loss_sum += loss;
            steps += 1;
            let last = self.progress.step == total_steps;
            if self.checkpointer.is_some()
                && ((every > 0 && self.progress.step.is_multiple_of(every)) || last)
            {
                let t = Instant::now();
                if let Some(m) = self.checkpoint()? {
                    ckpt.written += 1;
                    ckpt.bytes += m.bytes();
                    ckpt.last_id = Some(m.id);
                }
                ckpt.blocking_seconds += t.elapsed().as_secs_f64();
            }
            on_step(&StepInfo {
                step: self.progress.step,
                total_steps,
                samples,
                loss: loss / n as f64,
                elapsed_secs: start.elapsed().as_secs_f64(),
            });
        }
        if let Some(ck) = &mut self.checkpointer {
            // Background writes (IncrCP) must be committed before the run reports them.
            let t = Instant::now();
            ck.flush()?;
            ckpt.flush_seconds = t.elapsed().as_secs_f64();
        }
        let seconds = start.elapsed().as_secs_f64();
        Ok(TrainReport {
            steps,
            samples,
            seconds,
            samples_per_sec: samples as f64 / seconds.max(1e-9),
            train_logloss: loss_sum / samples.max(1) as f64,
            checkpoints: CheckpointStats {
                tracking_seconds: self
                    .checkpointer
                    .as_ref()
                    .map_or(0.0, |c| c.tracking_seconds()),
                ..ckpt
            },
        })
    }

    /// Metrics on the first `limit` samples of `data` (all when 0).
    pub fn evaluate(&mut self, data: &Dataset, limit: usize) -> Result<Metrics, TrainError> {
        self.check_dataset(data)?;
        let n = if limit == 0 {
            data.len()
        } else {
            limit.min(data.len())
        };
        let bs = self.config.train.batch_size;
        let mut logits = Vec::with_capacity(n);
        let mut labels = Vec::with_capacity(n);
        let mut start = 0;
        while start < n {
            let count = bs.min(n - start);
            data.fill_batch(start, count, &self.table_rows, &mut self.batch)?;
            labels.extend_from_slice(&self.batch.labels);
            let (model, state, batch) = (&mut self.model, &self.state, &self.batch);
            self.pool
                .install(|| model.predict(state, batch, &mut logits))?;
            start += count;
        }
        Ok(evaluate(&logits, &labels))
    }

    pub fn digest(&self) -> ftrec_model::StateDigest {
        let state = &self.state;
        self.pool.install(|| state.digest())
    }
}

/// Whether two checkpoint locations name the same place (local paths compared after
/// resolving them; URLs as written, less a trailing `/`).
fn same_location(a: &str, b: &str) -> bool {
    if a.contains("://") || b.contains("://") {
        return a.trim_end_matches('/') == b.trim_end_matches('/');
    }
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// What a resume with settings other than the checkpoint's run changes, for the user.
fn run_differences(id: &str, record: &RunRecord, config: &JobConfig) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(seed) = record.seed.filter(|&s| s != config.seed) {
        out.push(format!(
            "checkpoint {id} was trained with seed {seed}; seed = {} is ignored (the seed only \
             initialises a model, and the resumed one comes from the checkpoint)",
            config.seed
        ));
    }
    if let Some(batch) = record.batch_size.filter(|&b| b != config.train.batch_size) {
        out.push(format!(
            "checkpoint {id} was trained with train.batch_size = {batch}; this run goes on \
             from sample {} with {}, so it will not match an uninterrupted run",
            record.progress.position, config.train.batch_size
        ));
    }
    out
}
