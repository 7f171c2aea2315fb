//! `ftrec bench ...`: the benchmarks behind BENCHMARKS.md. The experiments live in
//! `ftrec-bench`; each file here is a subcommand's flags, the call into it, and the
//! printing.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::{Args, Subcommand};
use ftrec_bench::error::Boxed;
use ftrec_bench::train_step;
use ftrec_cluster::auto::Choice;
use ftrec_cluster::launch::Evaluator;
use ftrec_config::JobConfig;
use ftrec_data::generate::{GenConfig, OutputFormat};

use self::ckpt::BenchCkptArgs;
use crate::commands::config::{ConfigArgs, load_config};
use crate::output::print_json;
use crate::progress::bar;
use cluster::BenchClusterArgs;
use ec::BenchEcArgs;

pub mod ckpt;
pub mod cluster;
pub mod coordinator;
pub mod cpr;
pub mod ec;
pub mod faults;
pub mod shootout;
pub mod soak;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Median training step time on in-memory batches.
    Train(BenchTrainArgs),
    /// Checkpoint strategies side by side on a Criteo-shaped model (~2.3 GB at scale 1):
    /// IncrCP and DECK experiments, disk bandwidth by dd; CSV, PNG plots, summary JSON.
    Ckpt(BenchCkptArgs),
    /// The cluster (2 servers, 2 workers by default) against the single-process trainer on
    /// the same cores; RPC bytes per sample; checkpoint pause; SIGKILL to training resumed.
    Cluster(BenchClusterArgs),
    /// ECRec against no fault tolerance and against checkpoints on the same cluster and
    /// data: normal-mode overhead (with and without 2PC), SIGKILL to the next step,
    /// rebuild rate, recovery speed-up over checkpoints, memory overhead.
    Ec(BenchEcArgs),
    /// The CPR emulation study: full recovery, partial recovery and CPR (vanilla, SCAR,
    /// MFU, SSU) under injected failures; AUC, PLS, checkpoint overhead, plots.
    Cpr(cpr::BenchCprArgs),
    /// Silent failures across network namespaces (root): a link down, a worker-server
    /// partition, 5% loss, a frozen server and a zombie, at random moments under each
    /// `--ft`, each against the same run without the fault: time to detect, time to
    /// resume, slowdown, exactness (`tools/netns-harness.sh sweep`).
    Faults(faults::BenchFaultsArgs),
    /// The coordinator in etcd: samples/s against embedded (interleaved rounds), SIGKILL
    /// of the leader to the first step under the next, a leader lost mid-rebuild, and a
    /// 3-member etcd losing a member; every faulted run checked against the same run
    /// uninterrupted.
    Coordinator(coordinator::BenchCoordinatorArgs),
    /// Every fault tolerance strategy on one job under one Poisson schedule of server
    /// failures (SIGKILLs and freezes), at a rare and a frequent rate, rounds interleaved:
    /// ETT, AUC, lost samples, bytes written, peak RSS, time to resume and to full
    /// redundancy; `auto` runs what `cluster run --ft auto` chooses. shootout.json, PNGs.
    Shootout(shootout::BenchShootoutArgs),
    /// Rolling faults of every kind across network namespaces (a 3-member etcd, two
    /// coordinators, servers two to a rack with spares, workers), one every --every
    /// seconds, against the same job without faults: faults survived, detect and resume
    /// seconds, the longest stall, exactness and training_time_ratio. Needs root.
    Soak(soak::BenchSoakArgs),
}

#[derive(Args, Debug)]
pub struct BenchTrainArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn bench_train(a: BenchTrainArgs) -> Result<()> {
    let config = load_config(&a.config, Vec::new())?;
    let pb = bar((a.warmup + a.steps) as u64, "bench");
    if a.json {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let r = train_step::bench_train(&config, a.warmup, a.steps, |i| pb.set_position(i as u64))?;
    pb.finish_and_clear();
    if a.json {
        return print_json(serde_json::to_value(&r)?);
    }
    outln!(
        "batch {} on {} threads: median step {:.2} ms (p10 {:.2}, p90 {:.2}) = {:.0} samples/s; model {:.0} MiB, peak RSS {}",
        r.batch_size,
        r.threads,
        r.step_ms_median,
        r.step_ms_p10,
        r.step_ms_p90,
        r.samples_per_sec,
        r.model_bytes as f64 / (1 << 20) as f64,
        r.peak_rss_bytes.map_or("n/a".into(), |b| format!(
            "{:.0} MiB",
            b as f64 / (1 << 20) as f64
        ))
    );
    Ok(())
}

/// What the benches borrow from this binary: itself (to start clusters and `cluster run`s),
/// dataset generation with its progress bar, the trainer's evaluation and `--ft auto`.
struct Cli;

impl ftrec_bench::Host for Cli {
    fn exe(&self) -> std::io::Result<PathBuf> {
        std::env::current_exe()
    }

    fn generate(&self, config: &GenConfig, dir: &Path, quiet: bool) -> Result<(), Boxed> {
        crate::commands::data::run_gen(config, dir, OutputFormat::Binary, quiet)?;
        Ok(())
    }

    fn evaluator(&self) -> Evaluator {
        crate::commands::cluster::evaluator()
    }

    fn choose_ft(
        &self,
        config: &mut JobConfig,
        scratch: &Path,
        mtbf: Option<f64>,
        spares: usize,
    ) -> Result<Choice, Boxed> {
        use crate::commands::cluster::auto;
        let probe_steps = ftrec_cluster::auto::calibrate::default_probe_steps(config.train.steps);
        Ok(auto::choose_and_apply(
            config,
            scratch,
            scratch,
            &auto::AutoArgs {
                mtbf,
                spares,
                // Kept beside the bench's runs: measured once per bench, reused by its
                // other rates and rounds.
                cache: Some(scratch.join("cache")),
                recalibrate: false,
                probe_steps,
            },
        )?)
    }

    fn note(&self, line: &str) {
        eprintln!("{line}");
    }
}

/// Writes a benchmark's `summary.json` into `out`, then prints it: as the JSON output
/// with `json`, pretty for a person otherwise.
fn write_summary(out: &std::path::Path, summary: serde_json::Value, json: bool) -> Result<()> {
    use anyhow::Context;
    let path = out.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| path.display().to_string())?;
    if json {
        return print_json(summary);
    }
    outln!("{}", serde_json::to_string_pretty(&summary)?);
    outln!("wrote {}", out.display());
    Ok(())
}
