//! `ftrec bench cluster`: the cluster against the single-process trainer on the same cores,
//! RPC bytes per sample, checkpoint pause and the time from a SIGKILL to training resumed.

use clap::Args;
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use ftrec_cluster::launch::{self, LaunchOptions, LaunchReport};
use ftrec_config::FaultTolerance;
use ftrec_config::JobConfig;
use ftrec_data::generate::{GenConfig, OutputFormat, read_meta};
use ftrec_data::{Dataset, TRAIN_FILE};
use ftrec_proto::timeline::TimelineData;
use ftrec_train::Trainer;
use serde_json::json;

use crate::commands::data::run_gen;

#[derive(Args, Debug)]
pub struct BenchClusterArgs {
    /// Dataset directory (generated with the tiny Criteo shape when missing).
    #[arg(long, default_value = "bench-cluster-data")]
    pub data: PathBuf,
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    #[arg(long, default_value_t = 2)]
    pub servers: usize,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: u64,
    /// SIGKILL server 1 this many seconds into the checkpointed run.
    #[arg(long, default_value_t = 5.0)]
    pub kill_after: f64,
    /// Checkpoint strategies to run side by side, each with a SIGKILLed server (comma
    /// separated: full, differential, naive-incremental, incrcp, deck).
    #[arg(long, value_delimiter = ',', default_value = "full")]
    pub strategies: Vec<String>,
    /// Cut interval for the strategies other than `full` (default: --checkpoint-every),
    /// e.g. 12x more often for DECK's experiment.
    #[arg(long)]
    pub delta_every: Option<u64>,
    /// Where summary.json and the timeline plots go.
    #[arg(long, default_value = "bench-cluster")]
    pub out: PathBuf,
    /// Override a configuration key of the preset (repeatable), e.g.
    /// `--set model.rows_per_table=300000` for a larger model.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[arg(long)]
    pub json: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One benchmark run of `config` named `name` under `out`: launched, its timeline plotted
/// to `<out>/<name>.png`, its checkpoints (if any) removed afterwards.
pub(crate) struct BenchRun<'a> {
    pub out: &'a Path,
    pub name: &'a str,
    pub kills: &'a [String],
    pub spares: usize,
    pub quiet: bool,
    /// Evaluate the final model on the test split (AUC, logloss).
    pub evaluate: bool,
}

impl BenchRun<'_> {
    /// Checkpointed runs write every `every` steps into the run directory.
    pub(crate) fn launch(&self, config: &JobConfig, every: u64) -> Result<LaunchReport> {
        let mut c = config.clone();
        let run_dir = std::path::absolute(self.out.join(self.name))?;
        let _ = std::fs::remove_dir_all(&run_dir);
        if c.cluster.ft.checkpoints() {
            c.checkpoint.dir = Some(run_dir.join("checkpoints"));
            c.checkpoint.every_steps = every;
        }
        let kills = self
            .kills
            .iter()
            .map(|k| k.parse().map_err(anyhow::Error::msg))
            .collect::<Result<Vec<_>>>()?;
        if !self.quiet {
            eprintln!("cluster run {} ...", self.name);
        }
        let (servers, workers) = (c.cluster.servers, c.cluster.workers);
        let report = launch::run(
            LaunchOptions {
                job: ftrec_rpc::Job::new(c)?,
                run_dir: run_dir.clone(),
                kills,
                spares: self.spares,
                exe: std::env::current_exe()?,
                time_limit: Duration::from_secs(1800),
                evaluate: self.evaluate.then(crate::commands::cluster::evaluator),
            },
            |_| {},
        )?;
        crate::commands::cluster::plot::plot_timeline(
            &TimelineData::read(&run_dir.join("timeline.json"))?,
            &self.out.join(format!("{}.png", self.name)),
            &format!("{}: {servers} servers, {workers} workers", self.name),
        )?;
        // The figures and the plot are what a benchmark keeps; its checkpoints are scratch.
        let _ = std::fs::remove_dir_all(run_dir.join("checkpoints"));
        Ok(report)
    }
}

/// The benchmark's dataset (generated when missing) and configuration: `preset` with
/// `overrides`, `steps` steps over `data`.
pub(crate) fn bench_setup(
    out: &Path,
    data: &Path,
    rows: u64,
    preset: &str,
    overrides: &[String],
    steps: u64,
    quiet: bool,
) -> Result<JobConfig> {
    std::fs::create_dir_all(out).with_context(|| out.display().to_string())?;
    let gen_config = GenConfig::criteo(rows, 1, 0.01);
    let fresh =
        read_meta(data).is_some_and(|m| m.config == gen_config) && data.join(TRAIN_FILE).exists();
    if !fresh {
        run_gen(&gen_config, data, OutputFormat::Binary, quiet)?;
    }
    let mut config = JobConfig::load(Some(preset), None, overrides)?;
    config.fits_in_memory(0)?;
    config.train.steps = steps;
    config.data.dir = Some(std::path::absolute(data)?);
    Ok(config)
}

fn cluster(
    a: &BenchClusterArgs,
    config: &JobConfig,
    name: &str,
    ft: FaultTolerance,
    kill: Option<String>,
    every: u64,
) -> Result<LaunchReport> {
    let mut c = config.clone();
    c.threads = 1;
    c.cluster.servers = a.servers;
    c.cluster.workers = a.workers;
    c.cluster.ft = ft;
    let kills: Vec<String> = kill.into_iter().collect();
    BenchRun {
        out: &a.out,
        name,
        kills: &kills,
        spares: 0,
        quiet: a.json,
        evaluate: false,
    }
    .launch(&c, every)
}

/// One checkpointed run's figures. Effective training time is the share of the wall
/// time that trained steps which were kept: the rest went to cut pauses, to the recovery,
/// and to retraining the steps rolled back (each costed at the run's mean step time).
fn strategy_figures(r: &LaunchReport, every: u64) -> serde_json::Value {
    let s = &r.summary;
    let pauses: f64 = s.checkpoints.iter().map(|c| c.pause_seconds).sum();
    let rolled_back = s.steps_rolled_back;
    let per_step = s.train_seconds / (s.steps + rolled_back).max(1) as f64;
    let lost = pauses + s.recovery_seconds + rolled_back as f64 * per_step;
    json!({
        "every_steps": every,
        "checkpoints": s.checkpoints.len(),
        "blocking_seconds_per_checkpoint":
            median(s.checkpoints.iter().map(|c| c.pause_seconds).collect()),
        "bytes_written": s.checkpoints.iter().map(|c| c.bytes).sum::<u64>(),
        "effective_training_time": (1.0 - lost / s.train_seconds).max(0.0),
        "recovery_seconds": s.recovery_seconds,
        "kill_to_resume_seconds": r.kill_to_resume_seconds,
        "steps_rolled_back": rolled_back,
        "train_seconds": s.train_seconds,
    })
}

pub fn run(a: BenchClusterArgs) -> Result<()> {
    let config = bench_setup(&a.out, &a.data, a.rows, &a.preset, &a.set, a.steps, a.json)?;

    // The single-process trainer on every core of this host.
    if !a.json {
        eprintln!("single-process trainer, {} steps ...", a.steps);
    }
    let train = Dataset::open_split(&a.data, TRAIN_FILE)?;
    let mut single = config.clone();
    single.threads = 0;
    let mut trainer = Trainer::new(&single)?;
    let total = trainer.planned_steps(&train);
    let single_report = trainer.train(&train, total, |_| {})?;
    drop(trainer);

    let plain = cluster(&a, &config, "async", FaultTolerance::None, None, 0)?;
    let kill = Some(format!("server:1@{}s", a.kill_after));
    let mut per_strategy = serde_json::Map::new();
    let mut ckpt = None;
    for name in &a.strategies {
        let mut c = config.clone();
        c.checkpoint.strategy = Some(
            ftrec_config::parse_strategy(name).map_err(|e| anyhow::anyhow!("--strategies: {e}"))?,
        );
        let every = match name.as_str() {
            "full" => a.checkpoint_every,
            _ => a.delta_every.unwrap_or(a.checkpoint_every),
        };
        let run_name = if name == "full" {
            "checkpoint-kill".to_string()
        } else {
            format!("checkpoint-kill-{name}")
        };
        let r = cluster(
            &a,
            &c,
            &run_name,
            FaultTolerance::Checkpoint,
            kill.clone(),
            every,
        )?;
        per_strategy.insert(name.clone(), strategy_figures(&r, every));
        if ckpt.is_none() || name == "full" {
            ckpt = Some(r);
        }
    }
    let Some(ckpt) = ckpt else {
        anyhow::bail!("--strategies: name at least one strategy");
    };
    let s = &ckpt.summary;
    let detection: Vec<f64> = s
        .recoveries
        .iter()
        .zip(&ckpt.kill_to_resume_seconds)
        .map(|(r, k)| k - (r.resumed_at - r.detected_at))
        .collect();
    let summary = json!({
        "preset": a.preset,
        "overrides": a.set,
        "steps": a.steps,
        "servers": a.servers,
        "workers": a.workers,
        "single_process_samples_per_sec": single_report.samples_per_sec,
        "cluster_samples_per_sec": plain.summary.samples_per_sec,
        "cluster_vs_single": plain.summary.samples_per_sec / single_report.samples_per_sec,
        "rpc_bytes_per_sample": plain.summary.rpc_bytes_per_sample,
        "checkpoints": s.checkpoints.len(),
        "checkpoint_pause_median_seconds":
            median(s.checkpoints.iter().map(|c| c.pause_seconds).collect()),
        "checkpoint_bytes": s.checkpoints.first().map(|c| c.bytes),
        "kill_to_resume_seconds": ckpt.kill_to_resume_seconds,
        "detection_seconds": detection,
        "recovery_seconds": s.recovery_seconds,
        "steps_rolled_back": s.recoveries.iter().map(|r| r.steps_rolled_back).collect::<Vec<_>>(),
        "checkpoint_run_samples_per_sec": s.samples_per_sec,
        "lost_samples": s.lost_samples,
        "strategies": per_strategy,
    });
    super::write_summary(&a.out, summary, a.json)
}
