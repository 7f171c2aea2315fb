//! `ftrec bench cluster`: the cluster against the single-process trainer on the same cores,
//! RPC bytes per sample, checkpoint pause and the time from a SIGKILL to training resumed.

use std::path::PathBuf;

use ftrec_config::{FaultTolerance, JobConfig};
use ftrec_data::{Dataset, TRAIN_FILE};
use ftrec_train::Trainer;
use serde_json::{Value, json};

use crate::cluster_run::{BenchRun, Setup};
use crate::error::{BenchError, Result};
use crate::host::Host;
use crate::rounds::median_upper as median;
use crate::run_record::RunRecord;

/// `ftrec bench cluster`'s flags.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    pub data: PathBuf,
    pub rows: u64,
    pub preset: String,
    pub steps: u64,
    pub servers: usize,
    pub workers: usize,
    pub checkpoint_every: u64,
    /// SIGKILL server 1 this many seconds into the checkpointed runs.
    pub kill_after: f64,
    /// Checkpoint strategies, each run with a SIGKILLed server.
    pub strategies: Vec<String>,
    /// Cut interval of the strategies other than `full` (default: `checkpoint_every`).
    pub delta_every: Option<u64>,
    pub out: PathBuf,
    pub set: Vec<String>,
    /// No progress lines.
    pub quiet: bool,
}

fn cluster(
    host: &dyn Host,
    a: &ClusterOptions,
    config: &JobConfig,
    name: &str,
    ft: FaultTolerance,
    kill: Option<String>,
    every: u64,
) -> Result<RunRecord> {
    let mut c = config.clone();
    c.threads = 1;
    c.cluster.servers = a.servers;
    c.cluster.workers = a.workers;
    c.cluster.ft = ft;
    let kills: Vec<String> = kill.into_iter().collect();
    BenchRun {
        host,
        out: &a.out,
        name,
        kills: &kills,
        spares: 0,
        quiet: a.quiet,
        evaluate: false,
    }
    .launch(&c, every)
}

/// One checkpointed run's figures. Effective training time is the share of the wall
/// time that trained steps which were kept: the rest went to cut pauses, to the recovery,
/// and to retraining the steps rolled back (each costed at the run's mean step time).
fn strategy_figures(s: &RunRecord, every: u64) -> Value {
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
        "kill_to_resume_seconds": s.kill_to_resume_seconds,
        "steps_rolled_back": rolled_back,
        "train_seconds": s.train_seconds,
    })
}

/// Runs the bench; its summary (the caller writes `summary.json`).
pub fn run(host: &dyn Host, a: &ClusterOptions) -> Result<Value> {
    let config = Setup {
        out: &a.out,
        data: &a.data,
        rows: a.rows,
        preset: &a.preset,
        overrides: &a.set,
        steps: a.steps,
        quiet: a.quiet,
    }
    .config(host)?;

    // The single-process trainer on every core of this host.
    if !a.quiet {
        host.note(&format!("single-process trainer, {} steps ...", a.steps));
    }
    let train = Dataset::open_split(&a.data, TRAIN_FILE)?;
    let mut single = config.clone();
    single.threads = 0;
    let mut trainer = Trainer::new(&single)?;
    let total = trainer.planned_steps(&train);
    let single_report = trainer.train(&train, total, |_| {})?;
    drop(trainer);

    let plain = cluster(host, a, &config, "async", FaultTolerance::None, None, 0)?;
    let kill = Some(format!("server:1@{}s", a.kill_after));
    let mut per_strategy = serde_json::Map::new();
    let mut ckpt = None;
    for name in &a.strategies {
        let mut c = config.clone();
        c.checkpoint.strategy = Some(
            ftrec_config::parse_strategy(name)
                .map_err(|e| BenchError::Usage(format!("--strategies: {e}")))?,
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
            host,
            a,
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
    let Some(s) = ckpt else {
        return Err(BenchError::Usage(
            "--strategies: name at least one strategy".into(),
        ));
    };
    Ok(json!({
        "preset": a.preset,
        "overrides": a.set,
        "steps": a.steps,
        "servers": a.servers,
        "workers": a.workers,
        "single_process_samples_per_sec": single_report.samples_per_sec,
        "cluster_samples_per_sec": plain.samples_per_sec,
        "cluster_vs_single": plain.samples_per_sec / single_report.samples_per_sec,
        "rpc_bytes_per_sample": plain.rpc_bytes_per_sample,
        "checkpoints": s.checkpoints.len(),
        "checkpoint_pause_median_seconds":
            median(s.checkpoints.iter().map(|c| c.pause_seconds).collect()),
        "checkpoint_bytes": s.checkpoints.first().map(|c| c.bytes),
        "kill_to_resume_seconds": s.kill_to_resume_seconds,
        "detection_seconds": detection(&s),
        "recovery_seconds": s.recovery_seconds,
        "steps_rolled_back": s.recoveries.iter().map(|r| r.steps_rolled_back).collect::<Vec<_>>(),
        "checkpoint_run_samples_per_sec": s.samples_per_sec,
        "lost_samples": s.lost_samples,
        "strategies": per_strategy,
    }))
}

/// Per injected kill, the time to detect it: kill to resume, less detection to resume.
fn detection(s: &RunRecord) -> Vec<f64> {
    s.recoveries
        .iter()
        .zip(&s.kill_to_resume_seconds)
        .map(|(r, k)| k - (r.resumed_at - r.detected_at))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run_record::fixtures::run;

    fn cut(pause: f64, bytes: u64) -> Value {
        json!({ "step": 0, "started_at": 0.0, "pause_seconds": pause, "bytes": bytes,
                "ids": [], "priority": false })
    }

    #[test]
    fn effective_training_time_charges_pauses_recovery_and_retrained_steps() {
        // 90 kept + 10 rolled back steps in 100 s: 1 s a step. Lost: 1 + 3 + 2 s of
        // pauses, 9 s of recovery, 10 s retrained: 25 of 100 s.
        let r = run(json!({
            "steps": 90, "steps_rolled_back": 10, "train_seconds": 100.0,
            "recovery_seconds": 9.0, "kill_to_resume_seconds": [4.0],
            "checkpoints": [cut(1.0, 10), cut(3.0, 30), cut(2.0, 20)],
        }));
        let f = strategy_figures(&r, 50);
        assert_eq!(f["effective_training_time"], 0.75);
        assert_eq!(f["blocking_seconds_per_checkpoint"], 2.0);
        assert_eq!(f["bytes_written"], 60);
        assert_eq!(f["checkpoints"], 3);
        assert_eq!(f["kill_to_resume_seconds"], json!([4.0]));
    }

    #[test]
    fn a_run_without_cuts_or_time_has_null_and_zero_figures() {
        let f = strategy_figures(&run(json!({})), 50);
        // No cuts: the median is NaN, which JSON writes as null.
        assert!(f["blocking_seconds_per_checkpoint"].is_null());
        // 0 s trained: the share is NaN, clamped by max to 0.
        assert_eq!(f["effective_training_time"], 0.0);
    }

    #[test]
    fn detection_pairs_each_kill_with_its_recovery() {
        let r = run(json!({
            "kill_to_resume_seconds": [3.0, 5.0],
            "recoveries": [
                { "detected_at": 10.0, "resumed_at": 11.5 },
                { "detected_at": 20.0, "resumed_at": 24.0 },
                { "detected_at": 30.0, "resumed_at": 31.0 },
            ],
        }));
        // The third recovery had no injected kill: no detection time for it.
        assert_eq!(detection(&r), vec![1.5, 1.0]);
        assert!(detection(&run(json!({}))).is_empty());
    }
}
