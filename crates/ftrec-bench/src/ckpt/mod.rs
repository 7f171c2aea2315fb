//! `ftrec bench ckpt`: the checkpoint strategies side by side on a Criteo-shaped model
//! (Kaggle table sizes, full scale ~2.3 GB of tables with row-wise Adagrad state).
//!
//! * IncrCP experiment (incrcp.txt §5): per strategy, a training run with a checkpoint
//!   every `interval` steps; per checkpoint the blocking construction time, the storage
//!   used so far, and (cold page cache) the time to replay what it stores beyond its
//!   baseline, which is what the paper reports as recovery time.
//! * DECK experiment (deck.txt §5.5): effective training time with full checkpoints every
//!   `12 * interval` steps against DECK deltas every `interval` steps; tracking cost per
//!   step; merge throughput.
//! * Disk: `dd` write (fdatasync) and cold read bandwidth in the same run, against a full
//!   checkpoint's write and cold restore.

mod plot;
pub mod quantize;
pub mod report;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use ftrec_ckpt::deck::DeckOptions;
use ftrec_ckpt::{Checkpointer, Checkpoints, LocalStore, Strategy};
use ftrec_model::{Batch, Dlrm, ModelState, Optimizer};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::Serialize;

use ftrec_config::JobConfig;
use ftrec_train::TrainError;

#[derive(Clone, Debug)]
pub struct CkptBenchConfig {
    pub dir: PathBuf,
    /// Scale of the Kaggle cardinalities (1.0: 33.8M rows, ~2.3 GB of tables).
    pub scale: f64,
    pub checkpoints: usize,
    pub interval: u64,
    /// Replay (restore) timing for every this-many-th checkpoint, and the last.
    pub restore_every: usize,
    /// The full strategy writes this many checkpoints; the rest are the same size and
    /// are extrapolated (150 full copies would not fit the disk).
    pub full_samples: usize,
    pub differential_full_every: u64,
    pub incrcp_threshold: f64,
    pub deck_live_factor: f64,
    pub batch_size: usize,
    pub threads: usize,
    pub seed: u64,
    pub skip_deck: bool,
    /// Strategies of the IncrCP experiment, run in this order.
    pub strategies: Vec<Strategy>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct CheckpointRow {
    pub strategy: String,
    pub index: usize,
    pub step: u64,
    pub kind: String,
    pub blocking_seconds: f64,
    pub bytes_written: u64,
    /// Bytes in the checkpoint directory right after this checkpoint.
    pub storage_bytes: u64,
    /// Cold-cache time to replay what a restore reads beyond the baseline (sampled).
    pub restore_seconds: Option<f64>,
    pub restore_bytes: Option<u64>,
    /// Whether the row was measured (false: extrapolated from measured ones).
    pub measured: bool,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct StrategySummary {
    pub strategy: String,
    pub checkpoints: usize,
    pub mean_blocking_seconds: f64,
    pub mean_restore_seconds: f64,
    pub final_storage_bytes: u64,
    pub baselines: u32,
    /// The newest checkpoint restored in full equals the trained state.
    pub verified_digest: bool,
    pub train_seconds: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct DiskBandwidth {
    /// The disk's sequential write bandwidth: per sample the faster of `dd` through the
    /// page cache (`conv=fdatasync`) and `dd oflag=direct`, median over samples.
    pub dd_write_bytes_per_second: f64,
    /// Likewise for cold reads: the faster of buffered and `iflag=direct`.
    pub dd_read_bytes_per_second: f64,
    pub dd_write_buffered_bytes_per_second: f64,
    pub dd_write_direct_bytes_per_second: f64,
    pub dd_read_buffered_bytes_per_second: f64,
    pub dd_read_direct_bytes_per_second: f64,
    pub full_write_bytes_per_second: f64,
    pub full_restore_bytes_per_second: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct DeckRun {
    pub name: String,
    pub steps: u64,
    pub wall_seconds: f64,
    pub blocking_seconds: f64,
    /// Share of wall time spent training (not blocked by checkpoints).
    pub effective_training_time: f64,
    pub checkpoints: u64,
    pub fulls: u32,
    pub tracking_ms_per_step: f64,
    pub step_ms_mean: f64,
    pub merge_bytes_per_second: f64,
    pub merged_checkpoints: usize,
    pub peak_resident_chunks: usize,
    /// Cumulative blocking seconds after each step with a checkpoint.
    pub blocking_timeline: Vec<(u64, f64)>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct CkptBenchReport {
    pub model_bytes: usize,
    pub table_rows: usize,
    pub rows: Vec<CheckpointRow>,
    pub summaries: Vec<StrategySummary>,
    pub disk: DiskBandwidth,
    pub deck: Vec<DeckRun>,
}

/// Kaggle-shaped configuration: dim 16, row-wise Adagrad tables, DLRM MLPs.
pub fn bench_model(c: &CkptBenchConfig) -> Result<JobConfig, TrainError> {
    let mut config = JobConfig::preset("tiny")?;
    config.seed = c.seed;
    config.threads = c.threads;
    config.model.table_rows = ftrec_data::criteo::KAGGLE_CARDINALITIES
        .iter()
        .map(|&r| ((r as f64 * c.scale).round() as usize).max(4))
        .collect();
    config.model.num_tables = 0;
    config.model.dim = 16;
    config.model.bottom = vec![512, 256, 16];
    config.model.top = vec![512, 256, 1];
    config.optimizer.sparse = Optimizer::RowwiseAdagrad {
        lr: 0.05,
        eps: 1e-8,
        initial_accumulator: 0.0,
    };
    config.train.batch_size = c.batch_size;
    config.model_config()?;
    Ok(config)
}

/// Endless Zipf(1.1) batches with ids scattered over each table as hashing would.
struct BatchSource {
    rng: Xoshiro256PlusPlus,
    zipfs: Vec<Zipf<f64>>,
    rows: Vec<u64>,
    num_dense: usize,
    batch_size: usize,
}

impl BatchSource {
    fn new(config: &JobConfig, seed: u64) -> Result<Self, TrainError> {
        let mc = config.model_config()?;
        let zipfs = mc
            .table_rows
            .iter()
            .map(|&r| Zipf::new(r as u64 - 1, 1.1).map_err(|e| TrainError::Config(e.to_string())))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
            zipfs,
            rows: mc.table_rows.iter().map(|&r| r as u64).collect(),
            num_dense: mc.num_dense,
            batch_size: config.train.batch_size,
        })
    }

    fn fill(&mut self, b: &mut Batch) {
        b.labels.clear();
        b.dense.clear();
        for s in &mut b.sparse {
            s.clear();
        }
        for _ in 0..self.batch_size {
            b.labels.push(self.rng.gen_bool(0.25) as u8 as f32);
            for _ in 0..self.num_dense {
                b.dense.push(self.rng.gen_range(0.0..5.0));
            }
            for (t, z) in self.zipfs.iter().enumerate() {
                let rank = z.sample(&mut self.rng) as u64;
                // A fixed odd multiplier permutes the ids, so hot rows spread out.
                let row = 1 + rank.wrapping_mul(0x9E37_79B9_7F4A_7C15) % (self.rows[t] - 1);
                b.sparse[t].push_bag([row as u32]);
            }
        }
        b.size = self.batch_size;
    }
}

pub use ftrec_ckpt::timing::{dir_bytes, evict_from_cache, files_under};

struct Rig {
    pool: rayon::ThreadPool,
    state: ModelState,
    model: Dlrm,
    batch: Batch,
    source: BatchSource,
    step_seconds: f64,
    steps: u64,
}

impl Rig {
    fn new(config: &JobConfig) -> Result<Self, TrainError> {
        let (pool, state, model) = crate::train_step::fresh_model(config)?;
        Ok(Self {
            batch: Batch::with_tables(state.tables().len()),
            source: BatchSource::new(config, config.seed ^ 0x5eed)?,
            pool,
            state,
            model,
            step_seconds: 0.0,
            steps: 0,
        })
    }

    /// One training step; feeds the touched rows to `ck`.
    fn step(&mut self, ck: &mut Checkpointer) -> Result<(), TrainError> {
        self.source.fill(&mut self.batch);
        let start = Instant::now();
        let (model, state, batch) = (&mut self.model, &mut self.state, &self.batch);
        self.pool.install(|| model.train_step(state, batch))?;
        self.step_seconds += start.elapsed().as_secs_f64();
        self.steps += 1;
        for t in 0..self.state.tables().len() {
            ck.track(t, self.model.unique_rows(t));
        }
        if self.steps.is_multiple_of(16) {
            ck.compact();
        }
        Ok(())
    }

    fn checkpoint(
        &mut self,
        ck: &mut Checkpointer,
    ) -> Result<(ftrec_ckpt::Manifest, f64), TrainError> {
        let start = Instant::now();
        let (state, step) = (&self.state, self.steps);
        let m = self
            .pool
            .install(|| ck.checkpoint(state, step, serde_json::json!({ "step": step })))?;
        Ok((m, start.elapsed().as_secs_f64()))
    }
}

fn fresh_dir(dir: &Path) -> Result<(), TrainError> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|e| TrainError::Io {
        path: dir.to_path_buf(),
        error: e,
    })
}

fn checkpointer_for(
    strategy: Strategy,
    dir: &Path,
    c: &CkptBenchConfig,
    tables: usize,
) -> Result<Checkpointer, TrainError> {
    let ck = Checkpoints::new(Box::new(LocalStore::open(dir)?));
    let full_every = match strategy {
        Strategy::Differential => c.differential_full_every,
        _ => 0,
    };
    Ok(Checkpointer::with_threshold(
        ck,
        strategy,
        full_every,
        tables,
        c.incrcp_threshold,
    )?)
}

/// Bandwidths (bytes per second) seen by the full strategy, with `dd` reads of a file of
/// the same size interleaved with its restores, so both meet the same disk state.
#[derive(Default)]
struct FullBandwidth {
    dd_write: Vec<DdPair>,
    write: Vec<f64>,
    restore: Vec<f64>,
    dd_read: Vec<DdPair>,
}

/// One `dd` sample through the page cache and one bypassing it, taken back to back.
#[derive(Clone, Copy)]
struct DdPair {
    buffered: f64,
    direct: f64,
}

impl DdPair {
    fn best(&self) -> f64 {
        self.buffered.max(self.direct)
    }
}

fn median_of(pairs: &[DdPair], f: impl Fn(&DdPair) -> f64) -> f64 {
    median(&pairs.iter().map(f).collect::<Vec<_>>())
}

pub(crate) use ftrec_ckpt::timing::median;

/// One strategy of the IncrCP experiment.
fn run_strategy(
    c: &CkptBenchConfig,
    config: &JobConfig,
    strategy: Strategy,
    dd_file: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<CheckpointRow>, StrategySummary, FullBandwidth), TrainError> {
    let name = strategy.name();
    let dir = c.dir.join(name);
    fresh_dir(&dir)?;
    let mut rig = Rig::new(config)?;
    let mut ck = checkpointer_for(strategy, &dir, c, rig.state.tables().len())?;
    let planned = if strategy == Strategy::Full {
        c.full_samples.min(c.checkpoints)
    } else {
        c.checkpoints
    };
    let mut rows = Vec::new();
    let mut full_bw = FullBandwidth::default();
    let started = Instant::now();
    for index in 0..planned {
        for _ in 0..c.interval {
            rig.step(&mut ck)?;
        }
        if strategy == Strategy::Full {
            // dd writes a file of the model's size just before each full checkpoint, so
            // the two meet the same state of this VM's (host-cached) disk.
            full_bw
                .dd_write
                .push(dd_write(dd_file, rig.state.bytes() as u64)?);
        }
        let (m, blocking) = rig.checkpoint(&mut ck)?;
        rows.push(CheckpointRow {
            strategy: name.into(),
            index,
            step: m.step,
            kind: m.kind.tag().into(),
            blocking_seconds: blocking,
            bytes_written: m.bytes(),
            storage_bytes: dir_bytes(&dir),
            measured: true,
            ..Default::default()
        });
        progress(&format!("{name}: checkpoint {}/{planned}", index + 1));
    }
    ck.flush()?;
    let train_seconds = started.elapsed().as_secs_f64();
    if let Some(last) = rows.last_mut() {
        last.storage_bytes = dir_bytes(&dir);
    }
    let trained_digest = rig.state.digest();
    let checkpoints = ck.checkpoints().clone();
    let listed = checkpoints.list()?;
    // Replay timing, cold cache, onto the trained state (its values are no longer needed).
    for (i, row) in rows.iter_mut().enumerate() {
        let sampled = i % c.restore_every.max(1) == 0 || i + 1 == planned;
        if !(sampled || strategy == Strategy::Full) {
            continue;
        }
        let Some(m) = listed.iter().find(|m| m.step == row.step) else {
            continue;
        };
        // As in the paper, a delta strategy's baseline load is not its recovery cost:
        // restoring a baseline checkpoint itself replays nothing beyond it.
        if strategy != Strategy::Full && m.kind == ftrec_ckpt::CheckpointKind::Full {
            row.restore_seconds = Some(0.0);
            row.restore_bytes = Some(0);
            continue;
        }
        if strategy == Strategy::Full {
            full_bw.dd_read.push(dd_read(dd_file)?);
        }
        evict_from_cache(&dir);
        let start = Instant::now();
        let bytes = checkpoints.replay_increments(&m.id, &mut rig.state)?;
        let seconds = start.elapsed().as_secs_f64();
        row.restore_seconds = Some(seconds);
        row.restore_bytes = Some(bytes);
        if strategy == Strategy::Full {
            full_bw.write.push(bytes as f64 / row.blocking_seconds);
            full_bw.restore.push(bytes as f64 / seconds);
        }
        progress(&format!("{name}: replayed checkpoint {}", i + 1));
    }
    drop(rig);
    let verified_digest = match listed.last() {
        Some(m) => checkpoints.restore(&m.id)?.0.digest() == trained_digest,
        None => false,
    };
    if strategy == Strategy::Full {
        extrapolate_full(&mut rows, c, name);
    }
    let measured_restores: Vec<f64> = rows.iter().filter_map(|r| r.restore_seconds).collect();
    let summary = StrategySummary {
        strategy: name.into(),
        checkpoints: rows.len(),
        mean_blocking_seconds: rows.iter().map(|r| r.blocking_seconds).sum::<f64>()
            / rows.len().max(1) as f64,
        mean_restore_seconds: measured_restores.iter().sum::<f64>()
            / measured_restores.len().max(1) as f64,
        final_storage_bytes: rows.last().map_or(0, |r| r.storage_bytes),
        baselines: rows.iter().filter(|r| r.kind == "full").count() as u32,
        verified_digest,
        train_seconds,
    };
    fresh_dir(&dir)?;
    Ok((rows, summary, full_bw))
}

/// Every full checkpoint has the same size and cost: the unmeasured ones repeat the mean
/// of the measured ones, and storage grows by one checkpoint each.
fn extrapolate_full(rows: &mut Vec<CheckpointRow>, c: &CkptBenchConfig, name: &str) {
    let n = rows.len().max(1) as f64;
    let blocking = rows.iter().map(|r| r.blocking_seconds).sum::<f64>() / n;
    let restores: Vec<f64> = rows.iter().filter_map(|r| r.restore_seconds).collect();
    let restore = restores.iter().sum::<f64>() / restores.len().max(1) as f64;
    let Some(last) = rows.last().cloned() else {
        return;
    };
    let per = last.storage_bytes / rows.len() as u64;
    for index in rows.len()..c.checkpoints {
        rows.push(CheckpointRow {
            strategy: name.into(),
            index,
            step: (index as u64 + 1) * c.interval,
            kind: "full".into(),
            blocking_seconds: blocking,
            bytes_written: last.bytes_written,
            storage_bytes: per * (index as u64 + 1),
            restore_seconds: (index % c.restore_every.max(1) == 0).then_some(restore),
            restore_bytes: last.restore_bytes,
            measured: false,
        });
    }
}

/// Runs `dd` and returns bytes per second from its summary line.
fn dd(args: &[&str]) -> Result<f64, TrainError> {
    let out = Command::new("dd")
        .args(args)
        .output()
        .map_err(|e| TrainError::Config(format!("cannot run dd: {e}")))?;
    let text = String::from_utf8_lossy(&out.stderr);
    // "2147483648 bytes (2.1 GB, 2.0 GiB) copied, 5.1 s, 421 MB/s"
    let line = text
        .lines()
        .find(|l| l.contains("copied"))
        .ok_or_else(|| TrainError::Config(format!("dd printed no summary: {text}")))?;
    let bytes: f64 = line
        .split_whitespace()
        .next()
        .and_then(|b| b.parse().ok())
        .unwrap_or(0.0);
    let seconds: f64 = line
        .split(", ")
        .find(|p| p.ends_with(" s"))
        .and_then(|p| p.trim_end_matches(" s").trim().parse().ok())
        .unwrap_or(f64::NAN);
    Ok(bytes / seconds)
}

/// `dd` write bandwidth of a `bytes`-sized file, through the page cache with
/// `fdatasync` and with `oflag=direct` (and `fdatasync`).
fn dd_write(file: &Path, bytes: u64) -> Result<DdPair, TrainError> {
    let of = format!("of={}", file.display());
    let count = format!("count={}", bytes.div_ceil(4 << 20).max(1));
    let buffered = dd(&["if=/dev/zero", &of, "bs=4M", &count, "conv=fdatasync"])?;
    let direct = dd(&[
        "if=/dev/zero",
        &of,
        "bs=4M",
        &count,
        "oflag=direct",
        "conv=fdatasync",
    ])?;
    Ok(DdPair { buffered, direct })
}

/// Cold `dd` read bandwidth of `file`, through the page cache and with `iflag=direct`.
fn dd_read(file: &Path) -> Result<DdPair, TrainError> {
    let evict = || {
        if let Some(dir) = file.parent() {
            evict_from_cache(dir);
        }
    };
    let input = format!("if={}", file.display());
    evict();
    let buffered = dd(&[&input, "of=/dev/null", "bs=4M"])?;
    evict();
    let direct = dd(&[&input, "of=/dev/null", "bs=4M", "iflag=direct"])?;
    Ok(DdPair { buffered, direct })
}

fn run_deck_experiment(
    c: &CkptBenchConfig,
    config: &JobConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<DeckRun>, TrainError> {
    let steps = c.checkpoints as u64 * c.interval;
    let mut runs = Vec::new();
    for (name, every) in [("full", 12 * c.interval), ("deck", c.interval)] {
        let dir = c.dir.join(format!("deck-exp-{name}"));
        fresh_dir(&dir)?;
        let mut rig = Rig::new(config)?;
        let tables = rig.state.tables().len();
        let mut ck = if name == "deck" {
            let options = DeckOptions {
                live_factor: c.deck_live_factor,
                ..DeckOptions::default()
            };
            Checkpointer::deck(
                Checkpoints::new(Box::new(LocalStore::open(&dir)?)),
                tables,
                options,
            )?
        } else {
            checkpointer_for(Strategy::Full, &dir, c, tables)?
        };
        let (mut blocking, mut checkpoints) = (0.0, 0);
        let mut timeline = Vec::new();
        let started = Instant::now();
        for step in 1..=steps {
            rig.step(&mut ck)?;
            if step.is_multiple_of(every) {
                blocking += rig.checkpoint(&mut ck)?.1;
                checkpoints += 1;
                if name == "full" {
                    // Retention as a production run would keep it (12 full copies of the
                    // model would fill this disk); deleting is housekeeping, not blocking.
                    ck.checkpoints().gc(Some(2))?;
                }
                timeline.push((step, blocking));
                progress(&format!("deck experiment, {name}: step {step}/{steps}"));
            }
        }
        let t = Instant::now();
        ck.flush()?;
        blocking += t.elapsed().as_secs_f64();
        let wall = started.elapsed().as_secs_f64();
        ck.flush_background()?;
        let deck = ck.deck_stats().unwrap_or_default();
        runs.push(DeckRun {
            name: name.into(),
            steps,
            wall_seconds: wall,
            blocking_seconds: blocking,
            effective_training_time: 1.0 - blocking / wall,
            checkpoints,
            fulls: if name == "deck" {
                deck.fulls
            } else {
                checkpoints as u32
            },
            tracking_ms_per_step: ck.tracking_seconds() * 1e3 / steps as f64,
            step_ms_mean: rig.step_seconds * 1e3 / steps as f64,
            merge_bytes_per_second: deck.merges.bytes_per_second(),
            merged_checkpoints: deck.merges.merged.len(),
            peak_resident_chunks: deck.peak_resident_chunks,
            blocking_timeline: timeline,
        });
        drop(ck);
        fresh_dir(&dir)?;
    }
    Ok(runs)
}

pub fn bench_ckpt(
    c: &CkptBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<CkptBenchReport, TrainError> {
    let config = bench_model(c)?;
    let mc = config.model_config()?;
    let mut report = CkptBenchReport {
        model_bytes: mc.table_rows.iter().sum::<usize>() * mc.row_stride() * 4,
        table_rows: mc.table_rows.iter().sum(),
        ..Default::default()
    };
    progress("measuring the disk with dd");
    let dd_dir = c.dir.join("dd");
    fresh_dir(&dd_dir)?;
    let dd_file = dd_dir.join("dd.bin");
    for &strategy in &c.strategies {
        let (rows, summary, full_bw) = run_strategy(c, &config, strategy, &dd_file, progress)?;
        if strategy == Strategy::Full {
            let d = &mut report.disk;
            d.dd_write_bytes_per_second = median_of(&full_bw.dd_write, DdPair::best);
            d.dd_write_buffered_bytes_per_second = median_of(&full_bw.dd_write, |p| p.buffered);
            d.dd_write_direct_bytes_per_second = median_of(&full_bw.dd_write, |p| p.direct);
            d.dd_read_buffered_bytes_per_second = median_of(&full_bw.dd_read, |p| p.buffered);
            d.dd_read_direct_bytes_per_second = median_of(&full_bw.dd_read, |p| p.direct);
            report.disk.full_write_bytes_per_second = median(&full_bw.write);
            report.disk.full_restore_bytes_per_second = median(&full_bw.restore);
            report.disk.dd_read_bytes_per_second = median_of(&full_bw.dd_read, DdPair::best);
            fresh_dir(&dd_dir)?;
        }
        report.rows.extend(rows);
        report.summaries.push(summary);
    }
    if !c.skip_deck {
        report.deck = run_deck_experiment(c, &config, progress)?;
    }
    Ok(report)
}
