//! `ftrec bench faults`: every kind of silent failure at random moments under each `--ft`,
//! across network namespaces, reduced to the table BENCHMARKS.md quotes
//! (`ftrec_bench::faults`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use ftrec_bench::faults::FaultsOptions;

#[derive(Args, Debug)]
pub struct BenchFaultsArgs {
    /// The namespace harness that runs each trial.
    #[arg(long, default_value = "tools/netns-harness.sh")]
    pub harness: PathBuf,
    /// Rounds: each fault and mode runs this many times, at a random moment each.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Faults (comma separated): link-down, partition, loss, freeze, zombie.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "link-down,partition,loss,freeze,zombie"
    )]
    pub faults: Vec<String>,
    /// Fault tolerance modes (comma separated): ec, checkpoint, partial.
    #[arg(long, value_delimiter = ',', default_value = "ec,checkpoint,partial")]
    pub fts: Vec<String>,
    /// The fault's moment is drawn from this range of seconds after training starts.
    #[arg(long, default_value = "1-4")]
    pub at: String,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Deterministic steps per run.
    #[arg(long, default_value_t = 1500)]
    pub steps: u64,
    /// Reduce the trials of an earlier sweep (`tools/netns-harness.sh sweep --json FILE`)
    /// instead of running one.
    #[arg(long, value_name = "FILE")]
    pub from_trials: Option<PathBuf>,
    /// Where trials.json and summary.json go.
    #[arg(long, default_value = "bench-faults")]
    pub out: PathBuf,
    #[arg(long)]
    pub json: bool,
}

pub fn bench_faults(a: BenchFaultsArgs) -> Result<()> {
    let summary = ftrec_bench::faults::run(
        &super::Cli,
        &FaultsOptions {
            harness: a.harness,
            rounds: a.rounds,
            faults: a.faults,
            fts: a.fts,
            at: a.at,
            seed: a.seed,
            steps: a.steps,
            from_trials: a.from_trials,
            out: a.out.clone(),
        },
    )?;
    if !a.json {
        let rows = summary["by_fault"]
            .as_array()
            .map_or(&[][..], Vec::as_slice);
        for line in ftrec_bench::faults::table(rows) {
            outln!("{line}");
        }
    }
    super::write_summary(&a.out, summary, a.json)
}
