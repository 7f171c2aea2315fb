//! `ftrec bench shootout`: every fault tolerance strategy on one job under one Poisson
//! schedule of server failures, at a rare and a frequent rate (`ftrec_bench::shootout`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use ftrec_bench::shootout::ShootoutOptions;

#[derive(Args, Debug)]
pub struct BenchShootoutArgs {
    /// Dataset directory (generated with the tiny Criteo shape when missing).
    #[arg(long, default_value = "bench-cluster-data")]
    pub data: PathBuf,
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    /// The job: the demo preset (the tiny architecture with optimizers that learn within
    /// a minute, so lost updates show in the AUC) with its row state (row-wise Adagrad).
    #[arg(long, default_value = "demo")]
    pub preset: String,
    /// Steps per run (default 300; --quick 240).
    #[arg(long)]
    pub steps: Option<u64>,
    #[arg(long, default_value_t = 3)]
    pub servers: usize,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Rounds: every strategy at both rates once per round (default 3; --quick 1).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// One round of a smaller job (tables of 20,000 rows, 240 steps): what CI-sized
    /// machines can run in under 15 minutes. The output says so (`quick`, `rounds`).
    #[arg(long)]
    pub quick: bool,
    /// Mean time between failures of the rare rate, seconds (default: the failure-free
    /// run's training time, so about one failure per run).
    #[arg(long)]
    pub rare_mtbf: Option<f64>,
    /// ... and of the frequent rate (default: a quarter of it).
    #[arg(long)]
    pub frequent_mtbf: Option<f64>,
    /// Seed of the failure schedules.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Share of the failures that freeze (SIGSTOP) their server instead of killing it;
    /// every schedule has at least one.
    #[arg(long, default_value_t = 0.3)]
    pub freeze_share: f64,
    /// Consecutive failures at least this far apart, seconds: more than detection plus a
    /// rebuild, so that erasure coding with r = 1 is not asked to survive a second failure
    /// of a group mid-rebuild (a study of its own).
    #[arg(long, default_value_t = 2.5)]
    pub min_gap: f64,
    /// The frequent rate's schedules strike their first SIGKILLed server again while it
    /// recovers (its replacement rebuilding, or its restore under way), at the first such
    /// moment at least this long after the first strike (`--kill
    /// server:J@Ts=recovering`): a second failure during a recovery, that every strategy
    /// can survive since the slot's survivors still hold its state. Negative: never.
    /// Every schedule of both rates also holds a SIGKILL and a freeze, and each round
    /// draws its own from its own seed.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub during_recovery: f64,
    /// Let steps run asynchronously instead of in strict order. By default the runs are
    /// deterministic, so an exact strategy ends with the failure-free model bit for bit and
    /// AUC differences are the strategies', not the noise of async training (about ±0.01
    /// AUC between two async runs of this job, five times the 0.002 that decides which
    /// strategies count).
    #[arg(long = "async")]
    pub asynchronous: bool,
    /// Cut interval of the checkpoint strategies and of partial recovery, steps;
    /// ec+checkpoint cuts 4x less often (ECRec's second layer).
    #[arg(long, default_value_t = 40)]
    pub checkpoint_every: u64,
    /// Standby servers started up front, in every run.
    #[arg(long, default_value_t = 1)]
    pub spares: usize,
    /// Where shootout.json, the plots and each run's timeline go.
    #[arg(long, default_value = "bench-shootout")]
    pub out: PathBuf,
    /// Override a configuration key (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The strategies to compare, comma-separated (default: every one but the quantized
    /// ones): none, checkpoint-full, checkpoint-deck, checkpoint-incrcp, partial,
    /// partial-uncoordinated, ec, ec+checkpoint, auto, and checkpoint-incrcp-int8 and
    /// checkpoint-deck-int8 (embedding rows stored int8).
    #[arg(long, value_delimiter = ',')]
    pub strategies: Vec<String>,
    /// Leave out the capped case: auto at the frequent rate with every server's memory
    /// budget (cluster.server_memory_bytes) too small for the parity, where it must
    /// choose checkpoints.
    #[arg(long)]
    pub no_capped: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: BenchShootoutArgs) -> Result<()> {
    let summary = ftrec_bench::shootout::run(
        &super::Cli,
        &ShootoutOptions {
            data: a.data,
            rows: a.rows,
            preset: a.preset,
            steps: a.steps,
            servers: a.servers,
            workers: a.workers,
            rounds: a.rounds,
            quick: a.quick,
            rare_mtbf: a.rare_mtbf,
            frequent_mtbf: a.frequent_mtbf,
            seed: a.seed,
            freeze_share: a.freeze_share,
            min_gap: a.min_gap,
            during_recovery: a.during_recovery,
            asynchronous: a.asynchronous,
            checkpoint_every: a.checkpoint_every,
            spares: a.spares,
            out: a.out.clone(),
            set: a.set,
            quiet: a.json,
            strategies: a.strategies,
            capped: !a.no_capped,
        },
    )?;
    if !a.json {
        for line in ftrec_bench::shootout::table(&summary) {
            outln!("{line}");
        }
    }
    super::write_summary(&a.out, summary, a.json)
}
