//! `ftrec bench cpr`: the CPR emulation study (cpr.txt §5.1, §6) on generated
//! Criteo-shaped data; summary JSON and plots (`ftrec_bench::cpr_study`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use ftrec_bench::cpr_study::bench::{self, JobOptions};
use ftrec_bench::cpr_study::{CorrelationConfig, CostOverrides, Strategy, StudyConfig, run_study};

use crate::output::print_json;

#[derive(Args, Debug)]
pub struct BenchCprArgs {
    /// Dataset directory; generated (Criteo Kaggle shape at 1% of its cardinalities, with
    /// a planted teacher) when it does not hold the `--rows` dataset.
    #[arg(long, default_value = "bench-cpr-data")]
    pub data: PathBuf,
    /// Samples to generate (train + test; 10% are held out).
    #[arg(long, default_value_t = 600_000)]
    pub rows: u64,
    #[arg(long, default_value = "demo")]
    pub preset: String,
    /// Override a configuration key (repeatable), e.g. `--set cpr.r=0.25`. The study's
    /// defaults (dim 16, MLPs 64-16 and 64-1, batch 1024, one table per generated
    /// feature) come first.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Steps per run (default: one epoch).
    #[arg(long)]
    pub steps: Option<u64>,
    #[arg(long, default_value_t = 2)]
    pub failures: usize,
    /// Shares of the embedding servers each failure loses.
    #[arg(long, value_delimiter = ',', default_value = "0.125,0.25,0.5")]
    pub fractions: Vec<f64>,
    /// Emulated embedding servers (N_emb); row `r` of table `t` lives on server
    /// `(r + t) % servers`, the cluster's placement.
    #[arg(long, default_value_t = 8)]
    pub servers: usize,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,partial,cpr_vanilla,cpr_uncoordinated,cpr_scar,cpr_mfu,cpr_ssu"
    )]
    pub strategies: Vec<Strategy>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Target PLS (sets `cpr.target_pls`).
    #[arg(long)]
    pub target_pls: Option<f64>,
    /// Seconds to save the whole model, in the job frame (default: a real full checkpoint
    /// written to `--storage-dir`, measured and scaled to the frame).
    #[arg(long)]
    pub o_save: Option<f64>,
    /// Seconds to load the whole model (default: the real checkpoint's cold restore,
    /// measured).
    #[arg(long)]
    pub o_load: Option<f64>,
    /// Seconds to reschedule a failed node (default: measured, a process of this binary
    /// started and waited for, median of 5, scaled like the other costs).
    #[arg(long)]
    pub o_res: Option<f64>,
    /// The fixed part of every save, whatever its size (default: measured beside
    /// `--o-save`, with a checkpoint of the same tables at two rows each; 0 when
    /// `--o-save` is given).
    #[arg(long)]
    pub o_save_fixed: Option<f64>,
    /// The fixed part of every load (as `--o-save-fixed`).
    #[arg(long)]
    pub o_load_fixed: Option<f64>,
    /// Length of the emulated job in seconds (default: the measured failure-free epoch);
    /// measured costs are scaled to it (§5.1). T_fail is `cpr.mtbf_seconds`, else this
    /// over `--failures`.
    #[arg(long)]
    pub job_seconds: Option<f64>,
    /// Partial recovery must save this share of Eq. 1's overhead to be chosen.
    #[arg(long, default_value_t = 0.1)]
    pub min_benefit: f64,
    /// Extra CPR-vanilla runs at these target PLS values (each fraction), so the AUC–PLS
    /// correlation spans a PLS range like the paper's §6.5; empty (`--pls-sweep ''`)
    /// skips them.
    #[arg(long, value_delimiter = ',', default_value = "0.2,0.4,0.8")]
    pub pls_sweep: Vec<f64>,
    /// Independent runs for the AUC-PLS correlation: this many model seeds ...
    /// (0 skips them: the correlation then rests on the one schedule's runs).
    #[arg(long, default_value_t = 5)]
    pub correlation_seeds: u64,
    /// ... times this many Poisson failure schedules (mean `--failures` per epoch), each
    /// run CPR-vanilla at the largest fraction, at the next of `--correlation-targets`.
    #[arg(long, default_value_t = 3)]
    pub correlation_schedules: u64,
    #[arg(long, value_delimiter = ',', default_value = "0.02,0.1,0.2,0.4,0.8")]
    pub correlation_targets: Vec<f64>,
    /// Also run the sensitivity studies: target PLS 0.02/0.1/0.2 (CPR-vanilla, CPR-SSU)
    /// and 2/20/40 failures at every fraction (full against CPR-SSU, with CPR's decision
    /// checked against the runs), all in the main study's cost frame.
    #[arg(long)]
    pub sensitivity: bool,
    /// §6.5's many-failure runs: this many CPR-vanilla runs, each with 1-32 failures of
    /// 6.25-50% of 16 emulated servers and a random target PLS in 0.01-1; 0 skips them.
    #[arg(long, default_value_t = 16)]
    pub many_failures: usize,
    #[arg(long, default_value = "bench-results/cpr")]
    pub out: PathBuf,
    /// Where the checkpoints that time `O_save` and `O_load` are written (removed after):
    /// the local disk a server would checkpoint to. Default: `--out`. `--memory-costs`
    /// times an in-memory copy instead (no disk: the cheapest save there is).
    #[arg(long)]
    pub storage_dir: Option<PathBuf>,
    #[arg(long)]
    pub memory_costs: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: BenchCprArgs) -> Result<()> {
    let (job, train, test) = bench::prepare(
        &super::Cli,
        &JobOptions {
            data: &a.data,
            rows: a.rows,
            preset: &a.preset,
            set: &a.set,
            steps: a.steps,
            seed: a.seed,
            target_pls: a.target_pls,
            quiet: a.json,
        },
    )?;
    let config = StudyConfig {
        job,
        fractions: a.fractions.clone(),
        failures: a.failures,
        servers: a.servers,
        strategies: a.strategies.clone(),
        costs: CostOverrides {
            o_save: a.o_save,
            o_load: a.o_load,
            o_res: a.o_res,
            o_save_fixed: a.o_save_fixed,
            o_load_fixed: a.o_load_fixed,
            job_seconds: a.job_seconds,
            storage_dir: (!a.memory_costs)
                .then(|| a.storage_dir.clone().unwrap_or_else(|| a.out.clone())),
        },
        min_benefit: a.min_benefit,
        pls_sweep: a.pls_sweep.clone(),
        correlation: (a.correlation_seeds > 0 && a.correlation_schedules > 0).then(|| {
            CorrelationConfig {
                seeds: a.correlation_seeds,
                schedules: a.correlation_schedules,
                targets: a.correlation_targets.clone(),
            }
        }),
        sensitivity: a.sensitivity,
        many_failures: a.many_failures,
    };
    let bar = indicatif::ProgressBar::new_spinner();
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let report = run_study(&config, &train, &test, &mut |m| {
        bar.set_message(m.to_string());
        tracing::info!("bench cpr: {m}");
    })?;
    bar.finish_and_clear();
    let value = bench::write(&report, &a.out)?;
    if a.json {
        return print_json(value);
    }
    outln!("{}", serde_json::to_string_pretty(&value["by_fraction"])?);
    outln!(
        "auc_pls_correlation {:.4} over {} runs (95% interval {:.3}..{:.3}); targets {}",
        report.auc_pls_correlation,
        report.correlation_runs,
        report.auc_pls_correlation_interval[0],
        report.auc_pls_correlation_interval[1],
        serde_json::to_string(&report.targets)?
    );
    outln!("wrote {}", a.out.display());
    Ok(())
}
