//! `ftrec bench shootout`: one job, one Poisson schedule of server failures (SIGKILLs and
//! freezes), every fault tolerance strategy side by side, at a rare and a frequent failure
//! rate, over interleaved rounds. For each: the effective training time ratio (ETT), final
//! AUC and logloss, samples lost or retrained, checkpoint bytes written, peak memory per
//! server, time to resume and time to full redundancy; `auto` runs what `cluster run --ft
//! auto` would choose for the rate.

mod figures;
mod plot;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use ftrec_cluster::auto;
use ftrec_cluster::failure_schedule::{FailureSchedule, ScheduleShape};
use ftrec_cluster::launch::LaunchReport;
use ftrec_config::{FaultTolerance, JobConfig, Strategy};
use serde_json::{Value, json};

use super::cluster::{BenchRun, bench_setup};
use figures::RunFigures;

/// The strategies, in the order every round runs them.
pub const STRATEGIES: [&str; 9] = [
    "none",
    "checkpoint-full",
    "checkpoint-deck",
    "checkpoint-incrcp",
    "partial",
    "partial-uncoordinated",
    "ec",
    "ec+checkpoint",
    "auto",
];

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
    #[arg(long)]
    pub json: bool,
}

/// A failure rate of the comparison.
struct Rate {
    name: &'static str,
    schedule: FailureSchedule,
}

/// The job under `strategy`.
fn configure(base: &JobConfig, strategy: &str, every: u64) -> Result<(JobConfig, u64)> {
    let mut c = base.clone();
    let checkpoint = |c: &mut JobConfig, s: Strategy| {
        c.cluster.ft = FaultTolerance::Checkpoint;
        c.checkpoint.strategy = Some(Some(s));
    };
    let every = match strategy {
        "none" => {
            c.cluster.ft = FaultTolerance::None;
            every
        }
        "checkpoint-full" => {
            checkpoint(&mut c, Strategy::Full);
            every
        }
        "checkpoint-deck" => {
            checkpoint(&mut c, Strategy::Deck);
            every
        }
        "checkpoint-incrcp" => {
            checkpoint(&mut c, Strategy::Incrcp);
            every
        }
        "partial" => {
            c.cluster.ft = FaultTolerance::Partial;
            every
        }
        // Each server saves its own shard, staggered over the same interval.
        "partial-uncoordinated" => {
            c.cluster.ft = FaultTolerance::Partial;
            c.cpr.uncoordinated = true;
            every
        }
        "ec" => {
            c.cluster.ft = FaultTolerance::Ec;
            every
        }
        "ec+checkpoint" => {
            c.cluster.ft = FaultTolerance::EcCheckpoint;
            every * 4
        }
        other => bail!("unknown strategy {other:?}"),
    };
    Ok((c, every))
}

/// One run of `config` named `name`.
fn launch(
    a: &BenchShootoutArgs,
    config: &JobConfig,
    name: &str,
    kills: &[String],
    every: u64,
) -> Result<LaunchReport> {
    BenchRun {
        out: &a.out,
        name,
        kills,
        spares: a.spares,
        quiet: a.json,
        evaluate: true,
    }
    .launch(config, every)
    .with_context(|| format!("shoot-out run {name}"))
}

pub fn run(a: BenchShootoutArgs) -> Result<()> {
    let rounds = a.rounds.unwrap_or(if a.quick { 1 } else { 3 });
    if rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let steps = a.steps.unwrap_or(if a.quick { 240 } else { 300 });
    let mut overrides: Vec<String> = Vec::new();
    if a.quick {
        overrides.push("model.rows_per_table=20000".into());
    }
    overrides.extend(a.set.iter().cloned());
    let mut base = bench_setup(
        &a.out, &a.data, a.rows, &a.preset, &overrides, steps, a.json,
    )?;
    base.threads = 1;
    base.cluster.servers = a.servers;
    base.cluster.workers = a.workers;
    base.cluster.deterministic = !a.asynchronous;
    // AUC on a fixed share of the test split, the same for every run.
    if base.train.eval_samples == 0 {
        base.train.eval_samples = 200_000;
    }
    let started = Instant::now();

    // Round 1's failure-free run sets the schedules' horizon and default rates.
    let mut free_runs: Vec<LaunchReport> = Vec::new();
    let (free_config, _) = configure(&base, "none", a.checkpoint_every)?;
    free_runs.push(launch(&a, &free_config, "failure-free-r1", &[], 0)?);
    let horizon = free_runs[0].summary.train_seconds;
    let rare_mtbf = a.rare_mtbf.unwrap_or(horizon);
    let frequent_mtbf = a.frequent_mtbf.unwrap_or(horizon / 4.0);
    let shape = ScheduleShape {
        servers: a.servers,
        start_seconds: 1.0,
        horizon_seconds: horizon,
        min_gap_seconds: a.min_gap,
        freeze_share: a.freeze_share,
    };
    let rates = [("rare", rare_mtbf), ("frequent", frequent_mtbf)]
        .into_iter()
        .enumerate()
        .map(|(i, (name, mtbf))| {
            Ok(Rate {
                name,
                schedule: FailureSchedule::poisson(a.seed + i as u64, mtbf, shape)
                    .map_err(anyhow::Error::msg)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;

    // figures[rate][strategy][round]
    let mut runs: Vec<Vec<Vec<RunFigures>>> = vec![vec![Vec::new(); STRATEGIES.len()]; 2];
    let mut choices: Vec<Vec<auto::Choice>> = vec![Vec::new(), Vec::new()];
    for round in 1..=rounds {
        if round > 1 {
            free_runs.push(launch(
                &a,
                &free_config,
                &format!("failure-free-r{round}"),
                &[],
                0,
            )?);
        }
        let free = &free_runs[round - 1];
        let ref_step = free.summary.train_seconds / free.summary.steps.max(1) as f64;
        for (ri, rate) in rates.iter().enumerate() {
            let kills: Vec<String> = rate
                .schedule
                .kills()
                .iter()
                .map(|k| k.to_string())
                .collect();
            for (si, strategy) in STRATEGIES.iter().enumerate() {
                let name = format!("{}-{}-r{round}", rate.name, strategy.replace('+', "-"));
                let (config, every, ft) = if *strategy == "auto" {
                    let mut c = base.clone();
                    let choice = crate::commands::cluster::auto::choose_and_apply(
                        &mut c,
                        &a.out.join("auto-calibration"),
                        Some(rate.schedule.mtbf_seconds),
                        None,
                    )?;
                    let ft = c.cluster.ft;
                    choices[ri].push(choice);
                    (c, a.checkpoint_every, ft)
                } else {
                    let (c, every) = configure(&base, strategy, a.checkpoint_every)?;
                    let ft = c.cluster.ft;
                    (c, every, ft)
                };
                let report = launch(&a, &config, &name, &kills, every)?;
                runs[ri][si].push(figures::figures(&report, ft, ref_step));
            }
        }
    }

    let free_figures: Vec<RunFigures> = free_runs
        .iter()
        .map(|r| {
            figures::figures(
                r,
                FaultTolerance::None,
                r.summary.train_seconds / r.summary.steps.max(1) as f64,
            )
        })
        .collect();
    let failure_free = figures::over_rounds(&free_figures);
    let mut by_rate = serde_json::Map::new();
    for (ri, rate) in rates.iter().enumerate() {
        let mut strategies = serde_json::Map::new();
        for (si, strategy) in STRATEGIES.iter().enumerate() {
            strategies.insert(strategy.to_string(), figures::over_rounds(&runs[ri][si]));
        }
        let choice = choices[ri].first();
        let verdict = auto_verdict(&strategies, failure_free["auc"].as_f64());
        by_rate.insert(
            rate.name.into(),
            json!({
                "mtbf_seconds": rate.schedule.mtbf_seconds,
                "schedule": rate.schedule,
                "failure_free_auc": failure_free["auc"],
                "failure_free_logloss": failure_free["logloss"],
                "auto_choice": choice.map(|c| json!({
                    "strategy": c.strategy,
                    "every_seconds": c.every_seconds,
                    "predicted_ett": c.predicted_ett,
                    "why": c.why,
                    "predictions": c.predictions,
                    "costs": c.costs,
                })),
                "auto_verdict": verdict,
                "strategies": strategies,
            }),
        );
    }
    let summary = json!({
        "quick": a.quick,
        "rounds": rounds,
        "preset": a.preset,
        "overrides": overrides,
        "steps": steps,
        "servers": a.servers,
        "workers": a.workers,
        "spares": a.spares,
        "checkpoint_every": a.checkpoint_every,
        "deterministic": !a.asynchronous,
        "min_gap_seconds": a.min_gap,
        "ett_definition": "steps whose updates survive into the final model (steps less \
            those lost with a shard, as samples lost / samples per step), costed at the \
            failure-free run's seconds per step of the same round, over the run's wall time \
            of training",
        "failure_free": failure_free,
        "by_rate": by_rate,
        "seconds": started.elapsed().as_secs_f64(),
    });
    plot::plot_bars(&summary, &a.out.join("shootout.png"))?;
    for rate in &rates {
        plot::plot_throughput(
            &a.out,
            rate.name,
            &rate.schedule,
            &a.out.join(format!("timeline-{}.png", rate.name)),
        )?;
    }
    let path = a.out.join("shootout.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| path.display().to_string())?;
    if !a.json {
        plot::print_table(&summary)?;
    }
    super::write_summary(&a.out, summary, a.json)
}

/// Whether auto's measured ETT is within 5% of the best strategy's, among those whose
/// AUC is within 0.002 of the failure-free run's.
fn auto_verdict(
    strategies: &serde_json::Map<String, Value>,
    failure_free_auc: Option<f64>,
) -> Value {
    let eligible = |v: &Value| match (v["auc"].as_f64(), failure_free_auc) {
        (Some(auc), Some(ff)) => auc >= ff - 0.002,
        _ => false,
    };
    let best = strategies
        .iter()
        .filter(|(_, v)| eligible(v))
        .filter_map(|(name, v)| Some((name.clone(), v["ett"].as_f64()?)))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    let auto_ett = strategies.get("auto").and_then(|v| v["ett"].as_f64());
    let auto_eligible = strategies.get("auto").is_some_and(eligible);
    match (best, auto_ett) {
        (Some((name, best)), Some(auto)) => json!({
            "best": name,
            "best_ett": best,
            "auto_ett": auto,
            "auto_auc_within_0_002": auto_eligible,
            "within_5_percent": auto_eligible && auto >= 0.95 * best,
        }),
        _ => Value::Null,
    }
}
