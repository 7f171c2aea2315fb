//! `ftrec bench ec`: ECRec's figures (ECRec §5) on one cluster shape and one dataset
//! (`ftrec_bench::ec`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use ftrec_bench::ec::EcOptions;

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
    /// Rounds: every configuration once per round, in the same order, the rounds one
    /// after the other.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Also run the SIGKILL under erasure coding with every table's rows multiplied by
    /// each factor (e.g. `--scale 1,4`), one run per factor per round: resume must not grow
    /// with the shard, and the rebuild rate should not fall.
    #[arg(long, value_delimiter = ',')]
    pub scale: Vec<usize>,
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: BenchEcArgs) -> Result<()> {
    let summary = ftrec_bench::ec::run(
        &super::Cli,
        &EcOptions {
            data: a.data,
            rows: a.rows,
            preset: a.preset,
            steps: a.steps,
            servers: a.servers,
            workers: a.workers,
            kill_after: a.kill_after,
            spares: a.spares,
            checkpoint_every: a.checkpoint_every,
            out: a.out.clone(),
            set: a.set,
            rounds: a.rounds,
            scale: a.scale,
            quiet: a.json,
        },
    )?;
    super::write_summary(&a.out, summary, a.json)
}
