//! The calibration behind `--ft auto`: short runs of the job itself (its model, servers,
//! workers, spares, `k` and `r`, on its data, with this binary) whose reports give every
//! cost the choice weighs. Four runs of `steps` steps each:
//! - `none`: the failure-free step, which prices the job and a retrained step;
//! - `ec`: erasure coding's normal-mode overhead against `none`;
//! - `ec-kill`: a server SIGKILLed a third of the way in: the resume, the rebuild's rate,
//!   and the share of training the rebuild takes (committed rate while degraded against
//!   `ec`'s);
//! - `checkpoint-kill`: the same SIGKILL under the job's checkpoints: the cuts' pause, and
//!   the restore (a replacement process started, joined and loaded).
//!
//! Erasure coding's runs are skipped where it cannot run the job (too few servers, or a
//! parity that does not fit `cluster.server_memory_bytes`). One round: on a loaded 2-core
//! host two runs of one configuration differ by several percent, which the choice's
//! margins must (and in the shoot-out do) exceed.

use std::path::Path;
use std::time::{Duration, Instant};

use ftrec_config::{FaultTolerance, JobConfig};
use ftrec_rpc::{Job, PsError};
use serde::{Deserialize, Serialize};

use crate::launch::{self, LaunchOptions, LaunchReport};

/// What the calibration measured, in seconds unless named otherwise.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProbeFigures {
    /// Steps each run trained.
    pub steps: u64,
    /// The failure-free step (`none`).
    pub step_seconds: f64,
    /// Erasure coding's measurements; `None` where it cannot run the job.
    pub ec: Option<EcProbe>,
    /// The checkpoint run's mean cut pause.
    pub checkpoint_pause_seconds: f64,
    /// Its SIGKILL to training resumed: a new process, the join, every server's load.
    pub checkpoint_restore_seconds: f64,
    /// The calibration's own wall time, every run's start-up included.
    pub seconds: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EcProbe {
    /// The overhead the choice weighs: the larger of `wall_overhead` and `cpu_overhead`.
    /// Each configuration runs once, and on a loaded 2-core host the wall clock of one
    /// run swings by several percent: `ec` has come out as fast as `none` (0), which made
    /// erasure coding free and auto chose it at one failure in 11 days. CPU time per step
    /// barely moves with a neighbour's load, and `ec`'s extra work (parity differences,
    /// the 2PC, the dense replica) is in it however the clock went.
    pub overhead: f64,
    /// 1 − `ec`'s samples per second over `none`'s (0 when `ec` was faster).
    #[serde(default)]
    pub wall_overhead: f64,
    /// 1 − `none`'s CPU seconds per step (every job process) over `ec`'s (0 where either
    /// run's CPU could not be read, or `ec` used less).
    #[serde(default)]
    pub cpu_overhead: f64,
    /// SIGKILL to training resumed in degraded mode.
    pub resume_seconds: f64,
    pub rebuild_bytes_per_sec: f64,
    /// 1 − the committed rate while the rebuild ran over `ec`'s failure-free rate (1
    /// where training waited for it).
    pub rebuild_slowdown: f64,
}

/// Where and how the calibration runs.
pub struct ProbeOptions<'a> {
    /// The `ftrec` binary its processes are started from.
    pub exe: &'a Path,
    /// Its runs' directories go under it (removed after each run).
    pub dir: &'a Path,
    /// Spares the job starts with.
    pub spares: usize,
    pub steps: u64,
}

/// The fewest steps a calibration run can take: a cut, the kill, and steps after it.
pub const MIN_STEPS: u64 = 12;

/// Runs the calibration of `config`. `ec_refused` says why erasure coding cannot run the
/// job (its runs are skipped then).
pub fn probe(
    config: &JobConfig,
    opts: &ProbeOptions<'_>,
    ec_refused: Option<&str>,
) -> Result<ProbeFigures, PsError> {
    if opts.steps < MIN_STEPS {
        return Err(PsError::Config(format!(
            "--calibration-steps {}: at least {MIN_STEPS} (a cut, a SIGKILL and steps after it)",
            opts.steps
        )));
    }
    let started = Instant::now();
    let kill_step = opts.steps / 3;
    let kill = format!("server:1@step:{kill_step}");
    let base = probe_config(config, opts.steps);
    let with = |ft: FaultTolerance| {
        let mut c = base.clone();
        c.cluster.ft = ft;
        c
    };
    let none = run(opts, "none", with(FaultTolerance::None), None)?;
    let step_seconds = none.summary.train_seconds / none.summary.steps.max(1) as f64;
    let ec = match ec_refused {
        Some(_) => None,
        None => {
            let ec = run(opts, "ec", with(FaultTolerance::Ec), None)?;
            let ec_kill = run(opts, "ec-kill", with(FaultTolerance::Ec), Some(&kill))?;
            Some(ec_figures(
                &none,
                &ec,
                &ec_kill,
                config.train.batch_size as f64,
            )?)
        }
    };
    let mut checkpointed = with(FaultTolerance::Checkpoint);
    checkpointed.checkpoint.every_steps = (kill_step / 2).max(1);
    checkpointed.checkpoint.every_seconds = None;
    let ckpt = run(opts, "checkpoint-kill", checkpointed, Some(&kill))?;
    let pauses: Vec<f64> = ckpt
        .summary
        .checkpoints
        .iter()
        .filter(|c| !c.priority)
        .map(|c| c.pause_seconds)
        .collect();
    if pauses.is_empty() {
        return Err(failed("checkpoint-kill", "it made no cut"));
    }
    Ok(ProbeFigures {
        steps: opts.steps,
        step_seconds,
        ec,
        checkpoint_pause_seconds: pauses.iter().sum::<f64>() / pauses.len() as f64,
        checkpoint_restore_seconds: first_resume(&ckpt, "checkpoint-kill")?,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The job as the calibration runs it: its own shape, `steps` steps, no evaluation, no
/// resume, cuts only where a run asks for them (into its own directory).
fn probe_config(config: &JobConfig, steps: u64) -> JobConfig {
    let mut c = config.clone();
    c.train.steps = steps;
    c.train.eval_samples = 0;
    c.cluster.resume_from = None;
    c.checkpoint.dir = None;
    if c.threads == 0 {
        c.threads = 1;
    }
    c
}

fn failed(name: &str, why: impl std::fmt::Display) -> PsError {
    PsError::Fatal(format!("--ft auto: calibration run {name}: {why}"))
}

fn run(
    opts: &ProbeOptions<'_>,
    name: &str,
    mut config: JobConfig,
    kill: Option<&str>,
) -> Result<LaunchReport, PsError> {
    let run_dir = opts.dir.join(format!("calibration-{name}"));
    let _ = std::fs::remove_dir_all(&run_dir);
    if config.cluster.ft.checkpoints() {
        config.checkpoint.dir = Some(run_dir.join("checkpoints"));
    }
    let kills = kill
        .map(|k| k.parse().map_err(|e: String| failed(name, e)))
        .transpose()?
        .into_iter()
        .collect();
    tracing::info!(
        "--ft auto: calibration run {name} ({} steps)",
        config.train.steps
    );
    let report = launch::run(
        LaunchOptions {
            job: Job::new(config)?,
            run_dir: run_dir.clone(),
            kills,
            spares: opts.spares,
            exe: opts.exe.to_path_buf(),
            time_limit: Duration::from_secs(600),
            evaluate: None,
            save: None,
            resume: None,
            scale_at: Vec::new(),
        },
        |_| {},
    )
    .map_err(|e| failed(name, e))?;
    // Calibration runs are scratch: their cuts were never the job's.
    let _ = std::fs::remove_dir_all(&run_dir);
    Ok(report)
}

fn first_resume(r: &LaunchReport, name: &str) -> Result<f64, PsError> {
    r.kill_to_resume_seconds
        .first()
        .copied()
        .ok_or_else(|| failed(name, "its SIGKILL was not followed by a resume"))
}

/// `ec`'s overhead against `none` by the wall clock (from samples per second) and by CPU
/// time (from CPU seconds per step, 0 where either is unknown); neither below 0.
fn overheads(rates: (f64, f64), cpu_per_step: (Option<f64>, Option<f64>)) -> (f64, f64) {
    let (rate_none, rate_ec) = rates;
    let wall = (1.0 - rate_ec / rate_none.max(1e-9)).max(0.0);
    let cpu = match cpu_per_step {
        (Some(none), Some(ec)) if ec > 0.0 => (1.0 - none / ec).max(0.0),
        _ => 0.0,
    };
    (wall, cpu)
}

/// Every job process's CPU seconds per trained step while training ran.
fn cpu_per_step(r: &LaunchReport) -> Option<f64> {
    let cpu = r.cpu_training?;
    (r.summary.steps > 0 && cpu.cpu_seconds > 0.0).then(|| cpu.cpu_seconds / r.summary.steps as f64)
}

fn ec_figures(
    none: &LaunchReport,
    ec: &LaunchReport,
    ec_kill: &LaunchReport,
    batch: f64,
) -> Result<EcProbe, PsError> {
    let rate_none = none.summary.samples_per_sec;
    let rate_ec = ec.summary.samples_per_sec;
    let x = ec_kill
        .summary
        .recoveries
        .first()
        .ok_or_else(|| failed("ec-kill", "no recovery was recorded"))?;
    if x.rebuild_seconds <= 0.0 || x.rebuild_bytes == 0 {
        return Err(failed("ec-kill", "its recovery rebuilt nothing"));
    }
    let slowdown = x
        .committed_rate_while_degraded(ec_kill.summary.last_step_at, batch)
        .map_or(1.0, |rate| 1.0 - rate / rate_ec.max(1e-9));
    let (wall_overhead, cpu_overhead) =
        overheads((rate_none, rate_ec), (cpu_per_step(none), cpu_per_step(ec)));
    Ok(EcProbe {
        overhead: wall_overhead.max(cpu_overhead),
        wall_overhead,
        cpu_overhead,
        resume_seconds: first_resume(ec_kill, "ec-kill")?,
        rebuild_bytes_per_sec: x.rebuild_bytes as f64 / x.rebuild_seconds,
        rebuild_slowdown: slowdown.clamp(0.0, 1.0),
    })
}

#[cfg(test)]
mod tests {
    use super::overheads;

    #[test]
    fn a_load_burst_that_hides_ec_s_cost_on_the_clock_leaves_it_in_the_cpu_time() {
        // `ec` ran as fast as `none` by the clock (a neighbour slowed `none`), but used
        // 12% more CPU a step: the CPU figure is what remains.
        let (wall, cpu) = overheads((1000.0, 1010.0), (Some(0.088), Some(0.1)));
        assert_eq!(wall, 0.0);
        assert!((cpu - 0.12).abs() < 1e-9, "{cpu}");
        // By the clock 10% slower, by the CPU 5%.
        let (wall, cpu) = overheads((1000.0, 900.0), (Some(0.095), Some(0.1)));
        assert!((wall - 0.1).abs() < 1e-9 && (cpu - 0.05).abs() < 1e-9);
        // A run whose CPU could not be read gives no CPU figure.
        assert_eq!(overheads((1000.0, 900.0), (None, Some(0.1))).1, 0.0);
        assert_eq!(overheads((1000.0, 900.0), (Some(0.1), Some(0.0))).1, 0.0);
    }
}
