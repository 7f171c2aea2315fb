//! `ftrec bench shootout`: one job, one Poisson schedule of server failures (SIGKILLs and
//! freezes), every fault tolerance strategy side by side, at a rare and a frequent failure
//! rate, over interleaved rounds. For each: the effective training time ratio (ETT), final
//! AUC and logloss, samples lost or retrained, checkpoint bytes written, peak memory per
//! server, time to resume and time to full redundancy; `auto` runs what `cluster run --ft
//! auto` would choose for the rate.

mod figures;
mod plot;
mod table;

use std::path::PathBuf;
use std::time::Instant;

use ftrec_cluster::auto;
use ftrec_cluster::failure_schedule::{FailureSchedule, ScheduleShape};
use ftrec_config::{FaultTolerance, JobConfig, Strategy};
use serde_json::{Value, json};

use crate::cluster_run::{BenchRun, Setup};
use crate::error::{BenchError, Result};
use crate::host::Host;
use crate::run_record::RunRecord;
use figures::{RunFigures, auto_verdict};
pub use table::table;

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

/// Strategies run only when `--strategies` names them: the checkpoint strategies with their
/// embedding rows stored int8 (`checkpoint.quantize`), beside the f32 ones.
pub const QUANTIZED_STRATEGIES: [&str; 2] = ["checkpoint-incrcp-int8", "checkpoint-deck-int8"];

/// The strategies a run compares: `names`, each checked, or every default one.
pub fn chosen_strategies(names: &[String]) -> Result<Vec<String>> {
    if names.is_empty() {
        return Ok(STRATEGIES.iter().map(|s| s.to_string()).collect());
    }
    for name in names {
        if !STRATEGIES.contains(&name.as_str()) && !QUANTIZED_STRATEGIES.contains(&name.as_str()) {
            return Err(BenchError::Usage(format!(
                "--strategies: unknown strategy {name:?} (one of {}, {})",
                STRATEGIES.join(", "),
                QUANTIZED_STRATEGIES.join(", ")
            )));
        }
    }
    Ok(names.to_vec())
}

/// The strategies a summary compares, in its order (every default one for a summary
/// written before the list was recorded).
pub fn strategies_of(summary: &Value) -> Vec<String> {
    match summary["strategies"].as_array() {
        Some(list) => list
            .iter()
            .filter_map(|s| s.as_str().map(String::from))
            .collect(),
        None => STRATEGIES.iter().map(|s| s.to_string()).collect(),
    }
}

/// `ftrec bench shootout`'s flags.
#[derive(Clone, Debug)]
pub struct ShootoutOptions {
    pub data: PathBuf,
    pub rows: u64,
    pub preset: String,
    /// Steps per run (default 300; `quick` 240).
    pub steps: Option<u64>,
    pub servers: usize,
    pub workers: usize,
    /// Rounds (default 3; `quick` 1).
    pub rounds: Option<usize>,
    /// One round of a smaller job (tables of 20,000 rows, 240 steps).
    pub quick: bool,
    /// Mean time between failures of the rare rate (default: the failure-free run's
    /// training time), and of the frequent rate (default: a quarter of it).
    pub rare_mtbf: Option<f64>,
    pub frequent_mtbf: Option<f64>,
    pub seed: u64,
    pub freeze_share: f64,
    pub min_gap: f64,
    /// The frequent rate's schedules also strike their first SIGKILLed slot again while
    /// it recovers, at least this long after the first strike (negative: never).
    pub during_recovery: f64,
    /// Steps in any order instead of deterministic runs.
    pub asynchronous: bool,
    pub checkpoint_every: u64,
    pub spares: usize,
    pub out: PathBuf,
    pub set: Vec<String>,
    /// No progress lines.
    pub quiet: bool,
    /// The strategies to compare (empty: every one of [`STRATEGIES`]).
    pub strategies: Vec<String>,
    /// With `auto` among them: also the frequent rate under a memory budget the parity
    /// does not fit, where `auto` must choose checkpoints.
    pub capped: bool,
}

/// A failure rate of the comparison: one schedule per round, each drawn from its own seed.
struct Rate {
    name: &'static str,
    mtbf_seconds: f64,
    schedules: Vec<FailureSchedule>,
}

/// The seed of rate `rate`'s schedule in round `round` (from 1): round 1 keeps the seeds
/// of the runs before schedules were drawn per round.
fn schedule_seed(seed: u64, rate: usize, round: usize) -> u64 {
    seed + rate as u64 + 1000 * (round as u64 - 1)
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
        "checkpoint-incrcp-int8" => {
            checkpoint(&mut c, Strategy::Incrcp);
            c.checkpoint.quantize = ftrec_ckpt::QuantKind::Int8;
            every
        }
        "checkpoint-deck-int8" => {
            checkpoint(&mut c, Strategy::Deck);
            c.checkpoint.quantize = ftrec_ckpt::QuantKind::Int8;
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
        other => return Err(BenchError::Usage(format!("unknown strategy {other:?}"))),
    };
    Ok((c, every))
}

/// One run of `config` named `name`.
fn launch(
    host: &dyn Host,
    a: &ShootoutOptions,
    config: &JobConfig,
    name: &str,
    kills: &[String],
    every: u64,
) -> Result<RunRecord> {
    BenchRun {
        host,
        out: &a.out,
        name,
        kills,
        spares: a.spares,
        quiet: a.quiet,
        evaluate: true,
    }
    .launch(config, every)
    .map_err(|e| BenchError::Run {
        what: format!("shoot-out run {name}"),
        source: Box::new(e),
    })
}

/// Runs the bench, draws its plots and writes `shootout.json`; the summary (the caller
/// writes `summary.json`).
/// `auto`'s choice for `config` at `mtbf`, calibrated (once per configuration: the
/// cache is the bench's own) with the bench's spares.
fn choose(
    host: &dyn Host,
    a: &ShootoutOptions,
    config: &mut JobConfig,
    mtbf: f64,
) -> Result<auto::Choice> {
    host.choose_ft(
        config,
        &a.out.join("auto-calibration"),
        Some(mtbf),
        a.spares,
    )
    .map_err(BenchError::Host)
}

/// What choosing cost the run (0 for the calibration where it was cached) and what the
/// calibration cost when it was measured.
fn choosing_seconds(choice: &auto::Choice) -> (f64, f64) {
    let c = &choice.costs;
    let paid = c.calibration_seconds.value;
    (paid, c.calibration_measured_seconds.max(paid))
}

/// The largest server's bytes of `config` under `ft`.
fn server_need(config: &JobConfig, ft: FaultTolerance) -> Result<u64> {
    let mut c = config.clone();
    c.cluster.ft = ft;
    let largest = ftrec_rpc::Job::new(c)?.server_bytes()?.into_iter().max();
    Ok(largest.unwrap_or(0).min(u64::MAX as u128) as u64)
}

/// The frequent rate again, with every server's memory budget halfway between what its
/// share needs under checkpoints and under erasure coding: the parity does not fit, so
/// `auto` must choose checkpoints where, unconstrained, it chose erasure coding. Its run
/// meets round 1's frequent schedule.
fn capped_case(
    host: &dyn Host,
    a: &ShootoutOptions,
    base: &JobConfig,
    rate: &Rate,
    free: &RunRecord,
) -> Result<Value> {
    let plain = server_need(base, FaultTolerance::Checkpoint)?;
    let coded = server_need(base, FaultTolerance::Ec)?;
    if coded <= plain {
        return Ok(json!({ "skipped": "erasure coding needs no more memory than checkpoints" }));
    }
    let budget = plain + (coded - plain) / 2;
    let mut c = base.clone();
    c.cluster.server_memory_bytes = budget;
    let choice = choose(host, a, &mut c, rate.mtbf_seconds)?;
    let kills: Vec<String> = rate.schedules[0]
        .kills()
        .iter()
        .map(|k| k.to_string())
        .collect();
    let ft = c.cluster.ft;
    let report = launch(host, a, &c, "capped-auto-r1", &kills, a.checkpoint_every)?;
    let (paid, measured) = choosing_seconds(&choice);
    let ref_step = free.train_seconds / free.steps.max(1) as f64;
    let f = figures::figures(&report, ft, ref_step).charge_choosing(paid, measured);
    Ok(json!({
        "rate": rate.name,
        "mtbf_seconds": rate.mtbf_seconds,
        "server_memory_bytes": budget,
        "server_need_checkpoint_bytes": plain,
        "server_need_ec_bytes": coded,
        "auto_chose_checkpoints": choice.strategy == "checkpoint",
        "auto_choice": {
            "strategy": choice.strategy,
            "every_seconds": choice.every_seconds,
            "predicted_ett": choice.predicted_ett,
            "why": choice.why,
        },
        "figures": f,
    }))
}

pub fn run(host: &dyn Host, a: &ShootoutOptions) -> Result<Value> {
    let chosen = chosen_strategies(&a.strategies)?;
    let rounds = a.rounds.unwrap_or(if a.quick { 1 } else { 3 });
    if rounds == 0 {
        return Err(BenchError::Usage("--rounds must be at least 1".into()));
    }
    let steps = a.steps.unwrap_or(if a.quick { 240 } else { 300 });
    let mut overrides: Vec<String> = Vec::new();
    if a.quick {
        overrides.push("model.rows_per_table=20000".into());
    }
    overrides.extend(a.set.iter().cloned());
    let mut base = Setup {
        out: &a.out,
        data: &a.data,
        rows: a.rows,
        preset: &a.preset,
        overrides: &overrides,
        steps,
        quiet: a.quiet,
    }
    .config(host)?;
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
    let mut free_runs: Vec<RunRecord> = Vec::new();
    let (free_config, _) = configure(&base, "none", a.checkpoint_every)?;
    free_runs.push(launch(host, a, &free_config, "failure-free-r1", &[], 0)?);
    let horizon = free_runs[0].train_seconds;
    let rare_mtbf = a.rare_mtbf.unwrap_or(horizon);
    let frequent_mtbf = a.frequent_mtbf.unwrap_or(horizon / 4.0);
    // Both rates meet a SIGKILL and a freeze in every round; the frequent one also a
    // second failure during a recovery.
    let shape = |during_recovery: bool| ScheduleShape {
        servers: a.servers,
        start_seconds: 1.0,
        horizon_seconds: horizon,
        min_gap_seconds: a.min_gap,
        freeze_share: a.freeze_share,
        both_kinds: true,
        during_recovery_seconds: (during_recovery && a.during_recovery >= 0.0)
            .then_some(a.during_recovery),
    };
    let rates = [
        ("rare", rare_mtbf, false),
        ("frequent", frequent_mtbf, true),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (name, mtbf, during_recovery))| {
        let schedules = (1..=rounds)
            .map(|round| {
                FailureSchedule::poisson(
                    schedule_seed(a.seed, i, round),
                    mtbf,
                    shape(during_recovery),
                )
                .map_err(BenchError::Usage)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Rate {
            name,
            mtbf_seconds: mtbf,
            schedules,
        })
    })
    .collect::<Result<Vec<_>>>()?;

    // figures[rate][strategy][round]
    let mut runs: Vec<Vec<Vec<RunFigures>>> = vec![vec![Vec::new(); chosen.len()]; 2];
    let mut choices: Vec<Vec<auto::Choice>> = vec![Vec::new(), Vec::new()];
    for round in 1..=rounds {
        if round > 1 {
            free_runs.push(launch(
                host,
                a,
                &free_config,
                &format!("failure-free-r{round}"),
                &[],
                0,
            )?);
        }
        let free = &free_runs[round - 1];
        let ref_step = free.train_seconds / free.steps.max(1) as f64;
        for (ri, rate) in rates.iter().enumerate() {
            let kills: Vec<String> = rate.schedules[round - 1]
                .kills()
                .iter()
                .map(|k| k.to_string())
                .collect();
            for (si, strategy) in chosen.iter().enumerate() {
                let name = format!("{}-{}-r{round}", rate.name, strategy.replace('+', "-"));
                let mut choosing = None;
                let (config, every, ft) = if strategy == "auto" {
                    let mut c = base.clone();
                    let choice = choose(host, a, &mut c, rate.mtbf_seconds)?;
                    let ft = c.cluster.ft;
                    choosing = Some(choosing_seconds(&choice));
                    choices[ri].push(choice);
                    (c, a.checkpoint_every, ft)
                } else {
                    let (c, every) = configure(&base, strategy, a.checkpoint_every)?;
                    let ft = c.cluster.ft;
                    (c, every, ft)
                };
                let report = launch(host, a, &config, &name, &kills, every)?;
                let mut f = figures::figures(&report, ft, ref_step);
                if let Some((paid, measured)) = choosing {
                    f = f.charge_choosing(paid, measured);
                }
                runs[ri][si].push(f);
            }
        }
    }

    let capped = if chosen.iter().any(|s| s == "auto") && a.capped {
        Some(capped_case(host, a, &base, &rates[1], &free_runs[0])?)
    } else {
        None
    };

    let free_figures: Vec<RunFigures> = free_runs
        .iter()
        .map(|r| {
            figures::figures(
                r,
                FaultTolerance::None,
                r.train_seconds / r.steps.max(1) as f64,
            )
        })
        .collect();
    let failure_free = figures::over_rounds(&free_figures);
    let mut by_rate = serde_json::Map::new();
    for (ri, rate) in rates.iter().enumerate() {
        let mut strategies = serde_json::Map::new();
        for (si, strategy) in chosen.iter().enumerate() {
            strategies.insert(strategy.clone(), figures::over_rounds(&runs[ri][si]));
        }
        let choice = choices[ri].first();
        let verdict = auto_verdict(&strategies, failure_free["auc"].as_f64());
        by_rate.insert(
            rate.name.into(),
            json!({
                "mtbf_seconds": rate.mtbf_seconds,
                // Round 1's, and every round's (each drawn from its own seed).
                "schedule": rate.schedules[0],
                "schedules": rate.schedules,
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
        "strategies": chosen,
        "deterministic": !a.asynchronous,
        "min_gap_seconds": a.min_gap,
        "during_recovery_seconds": a.during_recovery,
        "ett_definition": "steps whose updates survive into the final model (steps less \
            those lost with a shard, as samples lost / samples per step), costed at the \
            failure-free run's seconds per step of the same round, over the run's wall time \
            of training",
        "failure_free": failure_free,
        "by_rate": by_rate,
        "capped": capped,
        "seconds": started.elapsed().as_secs_f64(),
    });
    plot::plot_bars(&summary, &a.out.join("shootout.png"))?;
    for rate in &rates {
        plot::plot_throughput(
            &a.out,
            &chosen,
            rate.name,
            &rate.schedules[0],
            &a.out.join(format!("timeline-{}.png", rate.name)),
        )?;
    }
    let path = a.out.join("shootout.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
        .map_err(BenchError::file(&path))?;
    Ok(summary)
}
