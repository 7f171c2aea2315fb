//! `ftrec bench ec`: ECRec's figures (ECRec §5) on one cluster shape and one dataset,
//! every run back to back: normal-mode throughput with no fault tolerance, with erasure
//! coding (2PC on and off), the same SIGKILL under erasure coding and under checkpoints,
//! and the memory the redundancy takes.

use clap::Args;
use std::path::PathBuf;

use anyhow::Result;
use ftrec_cluster::launch::LaunchReport;
use ftrec_config::{FaultTolerance, JobConfig};
use serde_json::json;

use super::cluster::{BenchRun, bench_setup};

#[derive(Args, Debug)]
pub struct BenchEcArgs {
    /// Dataset directory (generated with the tiny Criteo shape when missing).
    #[arg(long, default_value = "bench-cluster-data")]
    pub data: PathBuf,
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    #[arg(long, default_value_t = 3)]
    pub servers: usize,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// SIGKILL server 1 this many seconds into the runs with a failure.
    #[arg(long, default_value_t = 5.0)]
    pub kill_after: f64,
    /// Standby servers started up front (ECRec's replacement server), in every run.
    #[arg(long, default_value_t = 1)]
    pub spares: usize,
    /// Cut interval of the `--ft checkpoint` run compared with.
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: u64,
    /// Where summary.json and the timeline plots go.
    #[arg(long, default_value = "bench-ec")]
    pub out: PathBuf,
    /// Override a configuration key (repeatable), e.g. `--set ec.k=3`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[arg(long)]
    pub json: bool,
}

fn run_one(a: &BenchEcArgs, config: &JobConfig, name: &str, kill: bool) -> Result<LaunchReport> {
    let kills = if kill {
        vec![format!("server:1@{}s", a.kill_after)]
    } else {
        Vec::new()
    };
    BenchRun {
        out: &a.out,
        name,
        kills: &kills,
        spares: a.spares,
        quiet: a.json,
    }
    .launch(config, a.checkpoint_every)
}

/// Bytes the redundancy takes beside the model: parity rows on every server plus one
/// replica of the dense parameters and their optimizer state.
fn redundancy_bytes(config: &JobConfig) -> Result<(u64, u64)> {
    let model = config.model_config()?;
    let layout = ftrec_proto::Job::new(config.clone())?.layout()?;
    let row_bytes = (model.row_stride() * 4) as u64;
    let rows: u64 = model.table_rows.iter().map(|&r| r as u64).sum();
    let parity: u64 = (0..config.cluster.servers)
        .map(|s| {
            model
                .table_rows
                .iter()
                .map(|&r| layout.parity_rows(s, r) as u64)
                .sum::<u64>()
        })
        .sum::<u64>()
        * row_bytes;
    let dense_params = ftrec_model::MlpSpec::dlrm_pair(&model).1.end();
    let dense = (dense_params + model.dense_optimizer.dense_state_len(dense_params)?) as u64 * 4;
    Ok((rows * row_bytes + dense, parity + dense))
}

pub fn run(a: BenchEcArgs) -> Result<()> {
    let mut config = bench_setup(&a.out, &a.data, a.rows, &a.preset, &a.set, a.steps, a.json)?;
    config.threads = 1;
    config.cluster.servers = a.servers;
    config.cluster.workers = a.workers;
    let with = |ft: FaultTolerance, two_phase: bool| {
        let mut c = config.clone();
        c.cluster.ft = ft;
        c.ec.two_phase_commit = two_phase;
        c
    };
    let mut coded_dense = with(FaultTolerance::Ec, true);
    coded_dense.ec.replicate_dense = false;
    let none = run_one(&a, &with(FaultTolerance::None, true), "none", false)?;
    let ec = run_one(&a, &with(FaultTolerance::Ec, true), "ec", false)?;
    let ec_no_2pc = run_one(&a, &with(FaultTolerance::Ec, false), "ec-no-2pc", false)?;
    let ec_no_replication = run_one(&a, &coded_dense, "ec-no-replication", false)?;
    let ec_kill = run_one(&a, &with(FaultTolerance::Ec, true), "ec-kill", true)?;
    let ckpt_kill = run_one(
        &a,
        &with(FaultTolerance::Checkpoint, true),
        "checkpoint-kill",
        true,
    )?;

    let rate = |r: &LaunchReport| r.summary.samples_per_sec;
    let overhead = |r: &LaunchReport| 1.0 - rate(r) / rate(&none);
    let ec_recovery = ec_kill.summary.recoveries.first();
    let kill_to_resume = ec_kill.kill_to_resume_seconds.first().copied();
    let (rebuild_seconds, rebuild_bytes) = ec_recovery
        .map(|r| (r.rebuild_seconds, r.rebuild_bytes))
        .unwrap_or_default();
    // Training while the replacement rebuilt in the background: the steps granted from
    // the resume to full redundancy, over that window, against the same run shape with
    // no failure.
    let batch = config.train.batch_size as f64;
    let degraded_rate = ec_recovery.filter(|r| r.background_rebuild).map(|r| {
        let window = r.detected_at + r.degraded_seconds - r.resumed_at;
        r.steps_while_degraded as f64 * batch / window.max(1e-9)
    });
    // Checkpoint recovery in the average case: the measured SIGKILL-to-resume (detection,
    // restore) plus retraining half an interval at the run's mean step time.
    let step_seconds = ckpt_kill.summary.train_seconds / ckpt_kill.summary.steps.max(1) as f64;
    let ckpt_resume = ckpt_kill.kill_to_resume_seconds.first().copied();
    let ckpt_recovery = ckpt_resume.map(|k| k + a.checkpoint_every as f64 / 2.0 * step_seconds);
    let (model_bytes, extra_bytes) = redundancy_bytes(&with(FaultTolerance::Ec, true))?;
    let summary = json!({
        "preset": a.preset,
        "overrides": a.set,
        "steps": a.steps,
        "servers": a.servers,
        "workers": a.workers,
        "spares": a.spares,
        "ec": { "k": config.ec.k, "r": config.ec.r, "groups": config.ec.groups },
        "samples_per_sec": {
            "none": rate(&none),
            "ec": rate(&ec),
            "ec_no_2pc": rate(&ec_no_2pc),
            "ec_no_replication": rate(&ec_no_replication),
            "ec_kill": rate(&ec_kill),
            "checkpoint_kill": rate(&ckpt_kill),
        },
        "overhead": overhead(&ec),
        "overhead_no_2pc": overhead(&ec_no_2pc),
        // Dense ranges coded in dense stripes, their changes sent as differences.
        "overhead_no_replication": overhead(&ec_no_replication),
        "kill_to_resume_seconds": kill_to_resume,
        "detection_seconds": ec_recovery.map(|r| kill_to_resume.unwrap_or(0.0) - (r.resumed_at - r.detected_at)),
        "rebuild_seconds": rebuild_seconds,
        "rebuild_bytes": rebuild_bytes,
        "rebuild_bytes_per_sec": rebuild_bytes as f64 / rebuild_seconds.max(1e-9),
        "rebuild_throughput_ratio": degraded_rate.map(|d| d / rate(&ec)),
        "degraded_samples_per_sec": degraded_rate,
        "steps_while_degraded": ec_recovery.map(|r| r.steps_while_degraded),
        "checkpoint_kill_to_resume_seconds": ckpt_resume,
        "checkpoint_recovery_seconds_average_case": ckpt_recovery,
        "recovery_speedup_vs_checkpoint": match (ckpt_recovery, kill_to_resume) {
            (Some(c), Some(e)) => Some(c / e),
            _ => None,
        },
        "memory_overhead": extra_bytes as f64 / model_bytes as f64,
        "parity_mismatches": [
            ec.parity_mismatches,
            ec_no_2pc.parity_mismatches,
            ec_no_replication.parity_mismatches,
            ec_kill.parity_mismatches
        ],
        "lost_samples": ec_kill.summary.lost_samples,
    });
    super::write_summary(&a.out, summary, a.json)
}
