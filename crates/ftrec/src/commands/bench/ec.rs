//! `ftrec bench ec`: ECRec's figures (ECRec §5) on one cluster shape and one dataset:
//! normal-mode throughput with no fault tolerance, with erasure coding (2PC on and off),
//! the same SIGKILL under erasure coding and under checkpoints, and the memory the
//! redundancy takes. Every configuration runs once per round, rounds interleaved, and each
//! figure is the median over the rounds with its spread: on a shared 2-core machine the
//! spread between two runs of one configuration exceeds the gaps being judged. The
//! optimizers are stateful (Adagrad rows, Adam dense), as ECRec's point is that optimizer
//! state multiplies what must survive.

use clap::Args;
use std::path::PathBuf;

use anyhow::Result;
use ftrec_cluster::launch::LaunchReport;
use ftrec_config::{FaultTolerance, JobConfig};
use serde_json::json;

use super::cluster::{BenchRun, bench_setup};

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
    /// The rebuild's cap (`ec.rebuild_bytes_per_sec`) in the throttled SIGKILL run, the
    /// one judged by throughput while rebuilding: 2 cores cannot both rebuild at full
    /// speed and train at full speed, so the unthrottled run measures the rebuild and this
    /// one what training keeps. 60 MB/s: the fastest cap that kept about 0.95 of training in
    /// a sweep of 20-200 MB/s (`bench/ec-throttle/sweep.sh`, BENCHMARKS.md); faster takes
    /// the cores from training.
    #[arg(long, default_value_t = 60_000_000)]
    pub throttle: u64,
    #[arg(long)]
    pub json: bool,
}

/// The optimizers unless `--set` names others: per-element Adagrad on the embedding rows
/// (its state is as large as the rows) and Adam on the dense model.
const STATEFUL: [&str; 2] = [
    "optimizer.sparse.kind=\"adagrad\"",
    "optimizer.dense.kind=\"adam\"",
];

/// One round's runs.
struct Round {
    none: LaunchReport,
    ec: LaunchReport,
    ec_no_2pc: LaunchReport,
    ec_no_replication: LaunchReport,
    ec_kill: LaunchReport,
    /// The same SIGKILL with the rebuild capped at `--throttle`.
    ec_kill_throttled: LaunchReport,
    ckpt_kill: LaunchReport,
    /// `--scale`: the same SIGKILL at each factor of the rows.
    scaled: Vec<LaunchReport>,
}

/// A figure over the rounds: its median, its spread and every value (null where a round
/// had none).
pub(crate) fn over_rounds(values: Vec<Option<f64>>) -> serde_json::Value {
    let mut present: Vec<f64> = values.iter().flatten().copied().collect();
    present.sort_by(f64::total_cmp);
    let median = (!present.is_empty()).then(|| present[present.len() / 2]);
    json!({
        "median": median,
        "min": present.first(),
        "max": present.last(),
        "rounds": values,
    })
}

fn run_one(a: &BenchEcArgs, config: &JobConfig, name: &str, kill: bool) -> Result<LaunchReport> {
    let kills = if kill {
        vec![format!("server:1@{}s", a.kill_after)]
    } else {
        Vec::new()
    };
    BenchRun {
        out: &a.out,
        name,
        kills: &kills,
        spares: a.spares,
        quiet: a.json,
        evaluate: false,
    }
    .launch(config, a.checkpoint_every)
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

pub fn run(a: BenchEcArgs) -> Result<()> {
    if a.rounds == 0 {
        anyhow::bail!("--rounds must be at least 1");
    }
    let overrides: Vec<String> = STATEFUL
        .iter()
        .map(|s| s.to_string())
        .chain(a.set.iter().cloned())
        .collect();
    let mut config = bench_setup(
        &a.out, &a.data, a.rows, &a.preset, &overrides, a.steps, a.json,
    )?;
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
    let mut throttled = with(FaultTolerance::Ec, true);
    throttled.ec.rebuild_bytes_per_sec = a.throttle;
    let loopback_bytes_per_sec = super::loopback::bytes_per_sec()?;
    let scaled_configs: Vec<JobConfig> = a
        .scale
        .iter()
        .map(|&factor| scaled(&with(FaultTolerance::Ec, true), factor))
        .collect::<Result<_>>()?;
    let mut rounds = Vec::new();
    for r in 1..=a.rounds {
        let name = |n: &str| format!("{n}-r{r}");
        rounds.push(Round {
            none: run_one(&a, &with(FaultTolerance::None, true), &name("none"), false)?,
            ec: run_one(&a, &with(FaultTolerance::Ec, true), &name("ec"), false)?,
            ec_no_2pc: run_one(
                &a,
                &with(FaultTolerance::Ec, false),
                &name("ec-no-2pc"),
                false,
            )?,
            ec_no_replication: run_one(&a, &coded_dense, &name("ec-no-replication"), false)?,
            ec_kill: run_one(&a, &with(FaultTolerance::Ec, true), &name("ec-kill"), true)?,
            ec_kill_throttled: run_one(&a, &throttled, &name("ec-kill-throttled"), true)?,
            ckpt_kill: run_one(
                &a,
                &with(FaultTolerance::Checkpoint, true),
                &name("checkpoint-kill"),
                true,
            )?,
            scaled: a
                .scale
                .iter()
                .zip(&scaled_configs)
                .map(|(factor, c)| run_one(&a, c, &name(&format!("ec-kill-x{factor}")), true))
                .collect::<Result<_>>()?,
        });
    }
    let figures: Vec<RoundFigures> = rounds
        .iter()
        .map(|r| round_figures(r, &config, a.checkpoint_every))
        .collect();
    let across =
        |f: &dyn Fn(&RoundFigures) -> Option<f64>| over_rounds(figures.iter().map(f).collect());
    let per_run = |run: &dyn Fn(&Round) -> &LaunchReport, f: &dyn Fn(&LaunchReport) -> f64| {
        over_rounds(rounds.iter().map(|r| Some(f(run(r)))).collect())
    };
    let (model_bytes, extra_bytes) = redundancy_bytes(&with(FaultTolerance::Ec, true))?;
    let model = config.model_config()?;
    // The rebuild's figures, flat beside the others (one `json!` for all of them passes
    // the macro's recursion limit).
    let rebuild = json!({
        "rebuild_seconds": across(&|f| Some(f.rebuild_seconds)),
        "rebuild_bytes": across(&|f| Some(f.rebuild_bytes as f64)),
        "rebuild_bytes_per_sec": across(&|f| Some(f.rebuild_bytes as f64 / f.rebuild_seconds.max(1e-9))),
        // A raw TCP copy between two threads on this host: with k = 2 every byte
        // installed is two bytes moved, so the rebuild's ceiling is about half of it.
        "loopback_bytes_per_sec": loopback_bytes_per_sec,
        "rebuild_fraction_of_loopback": across(&|f| Some(f.rebuild_bytes as f64 / f.rebuild_seconds.max(1e-9) / loopback_bytes_per_sec)),
        // CPU the servers spent from the resume to full redundancy (`/proc`, every server
        // process summed), less what the steps committed meanwhile cost them at the
        // failure-free run's CPU per step, over the gigabytes rebuilt.
        "rebuild_core_seconds_per_gb": across(&|f| f.rebuild_core_seconds_per_gb()),
        "rebuild_server_cpu_seconds": across(&|f| f.rebuild_cpu),
        "server_cpu_seconds_per_step": across(&|f| f.cpu_per_step),
        // The throttled run: steps committed (not merely granted) while the replacement
        // rebuilt, against the same run shape with no failure.
        "rebuild_throughput_ratio": across(&|f| f.throttled.degraded_rate.map(|d| d / f.rate_ec)),
        "rebuild_bytes_per_sec_throttled": across(&|f| f.throttled.rebuild_rate()),
        "rebuild_throttle_bytes_per_sec": a.throttle,
        "degraded_samples_per_sec": across(&|f| f.throttled.degraded_rate),
        "steps_committed_while_degraded": across(&|f| f.throttled.committed_while_degraded),
        // The unthrottled run, where the rebuild takes what it can from training.
        "rebuild_throughput_ratio_unthrottled": across(&|f| f.degraded_rate.map(|d| d / f.rate_ec)),
        "steps_committed_while_degraded_unthrottled": across(&|f| f.committed_while_degraded),
    });
    let mut summary = json!({
        "preset": a.preset,
        "overrides": overrides,
        "steps": a.steps,
        "servers": a.servers,
        "workers": a.workers,
        "spares": a.spares,
        "rounds": a.rounds,
        "sparse_optimizer": model.sparse_optimizer.name(),
        "dense_optimizer": model.dense_optimizer.name(),
        "ec": { "k": config.ec.k, "r": config.ec.r, "groups": config.ec.groups },
        "samples_per_sec": {
            "none": across(&|f| Some(f.rate_none)),
            "ec": across(&|f| Some(f.rate_ec)),
            "ec_no_2pc": across(&|f| Some(f.rate_ec_no_2pc)),
            "ec_no_replication": across(&|f| Some(f.rate_ec_no_replication)),
            "ec_kill": across(&|f| Some(f.rate_ec_kill)),
            "ec_kill_throttled": across(&|f| Some(f.throttled.rate)),
            "checkpoint_kill": across(&|f| Some(f.rate_ckpt_kill)),
        },
        "overhead": across(&|f| Some(1.0 - f.rate_ec / f.rate_none)),
        "overhead_no_2pc": across(&|f| Some(1.0 - f.rate_ec_no_2pc / f.rate_none)),
        // Dense ranges coded in dense stripes, their changes sent as differences.
        "overhead_no_replication": across(&|f| Some(1.0 - f.rate_ec_no_replication / f.rate_none)),
        "kill_to_resume_seconds": across(&|f| f.kill_to_resume),
        // To the first step a worker finished after the resume: what a user sees.
        "kill_to_first_step_seconds": across(&|f| f.kill_to_first_step),
        "kill_to_full_redundancy_seconds": across(&|f| f.kill_to_full_redundancy),
        "detection_seconds": across(&|f| f.detection),
        "checkpoint_kill_to_resume_seconds": across(&|f| f.ckpt_resume),
        "checkpoint_step_seconds": across(&|f| Some(f.ckpt_step_seconds)),
        "checkpoint_recovery_seconds_average_case": across(&|f| f.ckpt_recovery),
        // Checkpoint recovery (restore, then retraining half an interval) against ECRec's
        // time until training goes on (degraded), and against its time until the cluster
        // again survives a second failure (the rebuild done). The second is the fair one
        // for redundancy; the first is what a user waits.
        "resume_speedup": across(&|f| f.ckpt_recovery.zip(f.kill_to_resume).map(|(c, e)| c / e)),
        "full_redundancy_speedup": across(&|f| f.ckpt_recovery.zip(f.kill_to_full_redundancy).map(|(c, e)| c / e)),
        "memory_overhead": extra_bytes as f64 / model_bytes as f64,
        // The same, measured: what the servers' peak resident sets (`/proc`, VmHWM,
        // summed over the servers) grew by from `none` to `ec` in the same round, over
        // the model's bytes. It counts what the layout leaves out (2PC's staged
        // differences, buffers, allocator slack).
        "memory_overhead_measured": across(&|f| f.rss_none.zip(f.rss_ec).map(|(none, ec)| {
            (ec as f64 - none as f64) / model_bytes as f64
        })),
        "model_bytes": model_bytes,
        "redundancy_bytes": extra_bytes,
        "server_peak_rss_bytes": {
            "none": across(&|f| f.rss_none.map(|b| b as f64)),
            "ec": across(&|f| f.rss_ec.map(|b| b as f64)),
        },
        // Every data-plane RPC the servers served (workers' and peers': 2PC, parity
        // updates) per step, and their payload bytes per sample, side by side.
        "rpcs_per_step": {
            "none": per_run(&|r| &r.none, &rpcs_per_step),
            "ec": per_run(&|r| &r.ec, &rpcs_per_step),
            "ec_no_2pc": per_run(&|r| &r.ec_no_2pc, &rpcs_per_step),
            "ec_no_replication": per_run(&|r| &r.ec_no_replication, &rpcs_per_step),
        },
        "server_rpc_bytes_per_sample": {
            "none": per_run(&|r| &r.none, &server_bytes_per_sample),
            "ec": per_run(&|r| &r.ec, &server_bytes_per_sample),
            "ec_no_2pc": per_run(&|r| &r.ec_no_2pc, &server_bytes_per_sample),
            "ec_no_replication": per_run(&|r| &r.ec_no_replication, &server_bytes_per_sample),
        },
        "parity_mismatches": rounds.iter().map(|r| [
            r.ec.parity_mismatches,
            r.ec_no_2pc.parity_mismatches,
            r.ec_no_replication.parity_mismatches,
            r.ec_kill.parity_mismatches,
            r.ec_kill_throttled.parity_mismatches,
        ]).collect::<Vec<_>>(),
        // Dense replicas that differ from their primary at the end. One-round mode with
        // asynchronous workers lets the primary and its replica apply pushes in different
        // orders, so their floats drift: a known gap (ARCHITECTURE, failure model).
        "replica_mismatches": rounds.iter().map(|r| [
            r.ec.replica_mismatches,
            r.ec_no_2pc.replica_mismatches,
            r.ec_no_replication.replica_mismatches,
            r.ec_kill.replica_mismatches,
            r.ec_kill_throttled.replica_mismatches,
        ]).collect::<Vec<_>>(),
        "lost_samples": rounds.iter().map(|r| [r.ec_kill.summary.lost_samples, r.ec_kill_throttled.summary.lost_samples]).collect::<Vec<_>>(),
        "scale": scale_figures(&a.scale, &rounds, &scaled_configs)?,
    });
    if let (Some(all), serde_json::Value::Object(rebuild)) = (summary.as_object_mut(), rebuild) {
        all.extend(rebuild);
    }
    super::write_summary(&a.out, summary, a.json)
}

fn rpcs_per_step(r: &LaunchReport) -> f64 {
    r.summary.server_rpcs as f64 / r.summary.steps.max(1) as f64
}

fn server_bytes_per_sample(r: &LaunchReport) -> f64 {
    r.summary.server_rpc_bytes as f64 / r.summary.samples.max(1) as f64
}

/// Every table's rows multiplied by `factor`.
fn scaled(config: &JobConfig, factor: usize) -> Result<JobConfig> {
    if factor == 0 {
        anyhow::bail!("--scale factors must be at least 1");
    }
    let mut c = config.clone();
    let rows = c.model_config()?.table_rows;
    c.model.table_rows = rows.iter().map(|&r| r * factor).collect();
    c.model.num_tables = rows.len();
    c.fits_in_memory(0)?;
    Ok(c)
}

/// `--scale`: per factor, the state rebuilt, the SIGKILL to resume, the rebuild's time and
/// rate, and the throughput, each over the rounds.
fn scale_figures(
    factors: &[usize],
    rounds: &[Round],
    configs: &[JobConfig],
) -> Result<serde_json::Value> {
    let mut by_factor = serde_json::Map::new();
    for (i, (factor, config)) in factors.iter().zip(configs).enumerate() {
        let runs: Vec<&LaunchReport> = rounds.iter().map(|r| &r.scaled[i]).collect();
        let of = |f: &dyn Fn(&LaunchReport) -> Option<f64>| {
            over_rounds(runs.iter().map(|r| f(r)).collect())
        };
        let recovery = |r: &LaunchReport| r.summary.recoveries.first().cloned();
        let (model_bytes, _) = redundancy_bytes(config)?;
        by_factor.insert(
            format!("x{factor}"),
            json!({
                "rows_per_table": config.model_config()?.table_rows.first(),
                "model_bytes": model_bytes,
                "kill_to_resume_seconds": of(&|r| r.kill_to_resume_seconds.first().copied()),
                "kill_to_first_step_seconds": of(&|r| recovery(r).and_then(|x| x.kill_to_first_step_seconds)),
                "rebuild_bytes": of(&|r| recovery(r).map(|x| x.rebuild_bytes as f64)),
                "rebuild_seconds": of(&|r| recovery(r).map(|x| x.rebuild_seconds)),
                "rebuild_bytes_per_sec": of(&|r| recovery(r).map(|x| x.rebuild_bytes as f64 / x.rebuild_seconds.max(1e-9))),
                "samples_per_sec": of(&|r| Some(r.summary.samples_per_sec)),
                "parity_mismatches": runs.iter().map(|r| r.parity_mismatches).collect::<Vec<_>>(),
                "lost_samples": runs.iter().map(|r| r.summary.lost_samples).collect::<Vec<_>>(),
            }),
        );
    }
    Ok(serde_json::Value::Object(by_factor))
}

/// One round's figures.
struct RoundFigures {
    rate_none: f64,
    rate_ec: f64,
    rate_ec_no_2pc: f64,
    rate_ec_no_replication: f64,
    rate_ec_kill: f64,
    rate_ckpt_kill: f64,
    kill_to_resume: Option<f64>,
    kill_to_first_step: Option<f64>,
    kill_to_full_redundancy: Option<f64>,
    detection: Option<f64>,
    rebuild_seconds: f64,
    rebuild_bytes: u64,
    degraded_rate: Option<f64>,
    committed_while_degraded: Option<f64>,
    ckpt_resume: Option<f64>,
    ckpt_step_seconds: f64,
    ckpt_recovery: Option<f64>,
    /// The servers' peak resident sets summed, or `None` where one could not be read.
    rss_none: Option<u64>,
    rss_ec: Option<u64>,
    /// The servers' CPU seconds over the rebuild window of the unthrottled SIGKILL run,
    /// and per step in the failure-free `ec` run.
    rebuild_cpu: Option<f64>,
    cpu_per_step: Option<f64>,
    throttled: Degraded,
}

/// The throttled SIGKILL run's rebuild and the training it kept.
struct Degraded {
    rate: f64,
    rebuild_seconds: f64,
    rebuild_bytes: u64,
    degraded_rate: Option<f64>,
    committed_while_degraded: Option<f64>,
}

impl Degraded {
    fn rebuild_rate(&self) -> Option<f64> {
        (self.rebuild_seconds > 0.0).then(|| self.rebuild_bytes as f64 / self.rebuild_seconds)
    }
}

impl RoundFigures {
    /// The rebuild's CPU beyond training's, per gigabyte rebuilt (unthrottled run).
    fn rebuild_core_seconds_per_gb(&self) -> Option<f64> {
        let training = self.committed_while_degraded? * self.cpu_per_step?;
        let gb = self.rebuild_bytes as f64 / 1e9;
        let cpu = self.rebuild_cpu?;
        (gb > 0.0).then(|| (cpu - training).max(0.0) / gb)
    }
}

/// Steps committed while the replacement rebuilt in the background, as samples per second
/// over the window from the resume to full redundancy, or to the last step if that came
/// first. (A slow rebuild can outlast the steps, and the run then waits for it: counting
/// that wait as degraded training put the ratio at 0.886 for runs that trained at full
/// speed while degraded; issue 23.)
fn rate_while_degraded(r: &LaunchReport, batch: f64) -> (Option<f64>, Option<f64>) {
    let background = r
        .summary
        .recoveries
        .first()
        .filter(|x| x.background_rebuild);
    (
        background.map(|x| {
            let redundant_at = x.detected_at + x.degraded_seconds;
            let end = r
                .summary
                .last_step_at
                .map_or(redundant_at, |t| t.min(redundant_at));
            let window = end - x.resumed_at;
            x.steps_committed_while_degraded as f64 * batch / window.max(1e-9)
        }),
        background.map(|x| x.steps_committed_while_degraded as f64),
    )
}

fn summed_peak_rss(r: &LaunchReport) -> Option<u64> {
    if r.server_peak_rss_bytes.is_empty() {
        return None;
    }
    r.server_peak_rss_bytes.iter().copied().sum()
}

fn round_figures(r: &Round, config: &JobConfig, checkpoint_every: u64) -> RoundFigures {
    let rate = |r: &LaunchReport| r.summary.samples_per_sec;
    let recovery = r.ec_kill.summary.recoveries.first();
    let kill_to_resume = r.ec_kill.kill_to_resume_seconds.first().copied();
    let (rebuild_seconds, rebuild_bytes) = recovery
        .map(|x| (x.rebuild_seconds, x.rebuild_bytes))
        .unwrap_or_default();
    // Kill to resume, plus the rest of the degraded window: kill to full redundancy.
    let kill_to_full_redundancy = recovery
        .zip(kill_to_resume)
        .map(|(x, k)| k + (x.detected_at + x.degraded_seconds - x.resumed_at).max(0.0));
    // Training while the replacement rebuilt in the background: the steps committed from
    // the resume to full redundancy, over that window.
    let batch = config.train.batch_size as f64;
    let (degraded_rate, committed_while_degraded) = rate_while_degraded(&r.ec_kill, batch);
    let throttled_recovery = r.ec_kill_throttled.summary.recoveries.first();
    let (throttled_rate, throttled_committed) = rate_while_degraded(&r.ec_kill_throttled, batch);
    // Checkpoint recovery in the average case: the measured SIGKILL-to-resume (detection,
    // restore) plus retraining half an interval at the run's mean step time, where the
    // steps retrained after the rollback count as steps the run took.
    let s = &r.ckpt_kill.summary;
    let ckpt_step_seconds = s.train_seconds / (s.steps + s.steps_rolled_back).max(1) as f64;
    let ckpt_resume = r.ckpt_kill.kill_to_resume_seconds.first().copied();
    RoundFigures {
        rate_none: rate(&r.none),
        rate_ec: rate(&r.ec),
        rate_ec_no_2pc: rate(&r.ec_no_2pc),
        rate_ec_no_replication: rate(&r.ec_no_replication),
        rate_ec_kill: rate(&r.ec_kill),
        rate_ckpt_kill: rate(&r.ckpt_kill),
        kill_to_resume,
        kill_to_first_step: recovery.and_then(|x| x.kill_to_first_step_seconds),
        kill_to_full_redundancy,
        detection: recovery.map(|x| kill_to_resume.unwrap_or(0.0) - (x.resumed_at - x.detected_at)),
        rebuild_seconds,
        rebuild_bytes,
        degraded_rate,
        committed_while_degraded,
        ckpt_resume,
        ckpt_step_seconds,
        ckpt_recovery: ckpt_resume.map(|k| k + checkpoint_every as f64 / 2.0 * ckpt_step_seconds),
        rss_none: summed_peak_rss(&r.none),
        rss_ec: summed_peak_rss(&r.ec),
        rebuild_cpu: r
            .ec_kill
            .server_cpu_rebuilds
            .first()
            .copied()
            .flatten()
            .map(|w| w.cpu_seconds),
        cpu_per_step: r
            .ec
            .server_cpu_training
            .map(|w| w.cpu_seconds / r.ec.summary.steps.max(1) as f64),
        throttled: Degraded {
            rate: rate(&r.ec_kill_throttled),
            rebuild_seconds: throttled_recovery.map_or(0.0, |x| x.rebuild_seconds),
            rebuild_bytes: throttled_recovery.map_or(0, |x| x.rebuild_bytes),
            degraded_rate: throttled_rate,
            committed_while_degraded: throttled_committed,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_figure_over_rounds_is_the_median_of_the_rounds_that_had_it() {
        let v = over_rounds(vec![Some(3.0), None, Some(1.0), Some(2.0)]);
        assert_eq!(v["median"], 2.0);
        assert_eq!(
            (v["min"].clone(), v["max"].clone()),
            (json!(1.0), json!(3.0))
        );
        assert_eq!(v["rounds"][1], serde_json::Value::Null);
        assert_eq!(over_rounds(vec![None])["median"], serde_json::Value::Null);
    }
}
