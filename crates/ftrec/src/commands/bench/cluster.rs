//! `ftrec bench cluster`: the cluster against the single-process trainer on the same cores,
//! RPC bytes per sample, checkpoint pause and the time from a SIGKILL to training resumed
//! (`ftrec_bench::cluster`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use ftrec_bench::cluster::ClusterOptions;

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

pub fn run(a: BenchClusterArgs) -> Result<()> {
    let summary = ftrec_bench::cluster::run(
        &super::Cli,
        &ClusterOptions {
            data: a.data,
            rows: a.rows,
            preset: a.preset,
            steps: a.steps,
            servers: a.servers,
            workers: a.workers,
            checkpoint_every: a.checkpoint_every,
            kill_after: a.kill_after,
            strategies: a.strategies,
            delta_every: a.delta_every,
            out: a.out.clone(),
            set: a.set,
            quiet: a.json,
        },
    )?;
    super::write_summary(&a.out, summary, a.json)
}
