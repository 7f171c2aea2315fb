//! `ftrec bench coordinator`: the coordinator in etcd (issue 22), measured with real
//! processes and a real etcd (`ftrec_bench::coordinator`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use ftrec_bench::coordinator::CoordinatorOptions;

#[derive(Args, Debug)]
pub struct BenchCoordinatorArgs {
    /// Dataset directory (generated into OUT/data when absent: 20000 rows).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Steps per run.
    #[arg(long, default_value_t = 3000)]
    pub steps: u64,
    #[arg(long, default_value_t = 3)]
    pub servers: usize,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Steady-state rounds (each runs embedded and etcd, interleaved).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Leader kills, one run each.
    #[arg(long, default_value_t = 3)]
    pub trials: usize,
    /// The leader dies this long after training starts.
    #[arg(long, default_value_t = 2.0)]
    pub kill_after: f64,
    /// An etcd to use (`host:port,...`); default: a fresh one on loopback in OUT.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Option<Vec<String>>,
    /// Skip the 3-member etcd experiment.
    #[arg(long)]
    pub no_etcd_cluster: bool,
    /// Model and training overrides, as for `cluster run` (`--set KEY=VALUE`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    #[arg(long, default_value = "bench-coordinator")]
    pub out: PathBuf,
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: BenchCoordinatorArgs) -> Result<()> {
    let summary = ftrec_bench::coordinator::run(
        &super::Cli,
        &CoordinatorOptions {
            data: a.data,
            steps: a.steps,
            servers: a.servers,
            workers: a.workers,
            rounds: a.rounds,
            trials: a.trials,
            kill_after: a.kill_after,
            etcd: a.etcd,
            no_etcd_cluster: a.no_etcd_cluster,
            overrides: a.overrides,
            out: a.out.clone(),
        },
    )?;
    super::write_summary(&a.out, summary, a.json)
}
