//! `ftrec bench ec`: ECRec's figures (ECRec §5) on one cluster shape and one dataset:
//! normal-mode throughput with no fault tolerance, with erasure coding (2PC on and off),
//! the same SIGKILL under erasure coding and under checkpoints, and the memory the
//! redundancy takes. Every configuration runs once per round, rounds interleaved, and each
//! figure is the median over the rounds with its spread: on a shared 2-core machine the
//! spread between two runs of one configuration exceeds the gaps being judged. The
//! optimizers are stateful (Adagrad rows, Adam dense), as ECRec's point is that optimizer
//! state multiplies what must survive.
//!
//! `mod.rs` runs the rounds; `figures.rs` turns one round's runs into its figures;
//! `summary.rs` puts the rounds' figures into `summary.json`.

mod figures;
mod summary;

use std::path::PathBuf;

use ftrec_config::{FaultTolerance, JobConfig};
use serde_json::Value;

use crate::cluster_run::{BenchRun, Setup};
use crate::error::{BenchError, Result};
use crate::host::Host;
use crate::run_record::RunRecord;

/// `ftrec bench ec`'s flags.
#[derive(Clone, Debug)]
pub struct EcOptions {
    pub data: PathBuf,
    pub rows: u64,
    pub preset: String,
    pub steps: u64,
    pub servers: usize,
    pub workers: usize,
    /// SIGKILL server 1 this many seconds into the runs with a failure.
    pub kill_after: f64,
    /// Standby servers started up front, in every run.
    pub spares: usize,
    /// Cut interval of the `--ft checkpoint` run compared with.
    pub checkpoint_every: u64,
    pub out: PathBuf,
    pub set: Vec<String>,
    pub rounds: usize,
    /// Also the SIGKILL under erasure coding with every table's rows times each factor.
    pub scale: Vec<usize>,
    /// No progress lines.
    pub quiet: bool,
}

/// The optimizers unless `--set` names others: per-element Adagrad on the embedding rows
/// (its state is as large as the rows) and Adam on the dense model.
const STATEFUL: [&str; 2] = [
    "optimizer.sparse.kind=\"adagrad\"",
    "optimizer.dense.kind=\"adam\"",
];

/// One round's runs.
pub(crate) struct Round {
    pub none: RunRecord,
    pub ec: RunRecord,
    pub ec_no_2pc: RunRecord,
    pub ec_no_replication: RunRecord,
    /// The SIGKILL with the job's own rebuild settings (by default self-paced, no cap and
    /// no renice): every recovery figure comes from this one run.
    pub ec_kill: RunRecord,
    pub ckpt_kill: RunRecord,
    /// `--scale`: the same SIGKILL at each factor of the rows.
    pub scaled: Vec<RunRecord>,
}

fn run_one(
    host: &dyn Host,
    a: &EcOptions,
    config: &JobConfig,
    name: &str,
    kill: bool,
) -> Result<RunRecord> {
    let kills = if kill {
        vec![format!("server:1@{}s", a.kill_after)]
    } else {
        Vec::new()
    };
    BenchRun {
        host,
        out: &a.out,
        name,
        kills: &kills,
        spares: a.spares,
        quiet: a.quiet,
        evaluate: false,
    }
    .launch(config, a.checkpoint_every)
}

/// Runs the bench; its summary (the caller writes `summary.json`).
pub fn run(host: &dyn Host, a: &EcOptions) -> Result<Value> {
    if a.rounds == 0 {
        return Err(BenchError::Usage("--rounds must be at least 1".into()));
    }
    let overrides: Vec<String> = STATEFUL
        .iter()
        .map(|s| s.to_string())
        .chain(a.set.iter().cloned())
        .collect();
    let mut config = Setup {
        out: &a.out,
        data: &a.data,
        rows: a.rows,
        preset: &a.preset,
        overrides: &overrides,
        steps: a.steps,
        quiet: a.quiet,
    }
    .config(host)?;
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
    let loopback_bytes_per_sec = crate::loopback::bytes_per_sec()?;
    let scaled_configs: Vec<JobConfig> = a
        .scale
        .iter()
        .map(|&factor| scaled(&with(FaultTolerance::Ec, true), factor))
        .collect::<Result<_>>()?;
    let mut rounds = Vec::new();
    for r in 1..=a.rounds {
        let name = |n: &str| format!("{n}-r{r}");
        let one = |c: &JobConfig, n: &str, kill: bool| run_one(host, a, c, &name(n), kill);
        rounds.push(Round {
            none: one(&with(FaultTolerance::None, true), "none", false)?,
            ec: one(&with(FaultTolerance::Ec, true), "ec", false)?,
            ec_no_2pc: one(&with(FaultTolerance::Ec, false), "ec-no-2pc", false)?,
            ec_no_replication: one(&coded_dense, "ec-no-replication", false)?,
            ec_kill: one(&with(FaultTolerance::Ec, true), "ec-kill", true)?,
            ckpt_kill: one(
                &with(FaultTolerance::Checkpoint, true),
                "checkpoint-kill",
                true,
            )?,
            scaled: a
                .scale
                .iter()
                .zip(&scaled_configs)
                .map(|(factor, c)| one(c, &format!("ec-kill-x{factor}"), true))
                .collect::<Result<_>>()?,
        });
    }
    summary::summary(
        a,
        &config,
        &with(FaultTolerance::Ec, true),
        overrides,
        &rounds,
        &scaled_configs,
        loopback_bytes_per_sec,
    )
}

/// Every table's rows multiplied by `factor`.
fn scaled(config: &JobConfig, factor: usize) -> Result<JobConfig> {
    if factor == 0 {
        return Err(BenchError::Usage(
            "--scale factors must be at least 1".into(),
        ));
    }
    let mut c = config.clone();
    let rows = c.model_config()?.table_rows;
    c.model.table_rows = rows.iter().map(|&r| r * factor).collect();
    c.model.num_tables = rows.len();
    c.fits_in_memory(0)?;
    Ok(c)
}

/// The reserve one waiting spare writes (`ec.spare_reserve`): per table, the largest data
/// rows and the largest parity rows any slot holds (the spare does not know which slot it
/// will take). 0 where no spare reserves (not erasure coded, or the reserve off).
fn spare_reserve_bytes(config: &JobConfig) -> Result<u64> {
    if !(config.cluster.ft.erasure_coded() && config.ec.spare_reserve) {
        return Ok(0);
    }
    let model = config.model_config()?;
    let layout = ftrec_rpc::Job::new(config.clone())?.layout()?;
    let row_bytes = (model.row_stride() * 4) as u64;
    let largest =
        |of: &dyn Fn(usize) -> usize| (0..config.cluster.servers).map(of).max().unwrap_or(0) as u64;
    Ok(model
        .table_rows
        .iter()
        .enumerate()
        .map(|(t, &rows)| {
            largest(&|s| layout.local_rows(t, s, rows)) + largest(&|s| layout.parity_rows(s, rows))
        })
        .sum::<u64>()
        * row_bytes)
}

/// Bytes the redundancy takes beside the model: parity rows on every server plus one
/// replica of the dense parameters and their optimizer state.
fn redundancy_bytes(config: &JobConfig) -> Result<(u64, u64)> {
    let model = config.model_config()?;
    let layout = ftrec_rpc::Job::new(config.clone())?.layout()?;
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
