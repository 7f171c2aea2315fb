//! The costs `--ft auto` chooses from, measured on this host for this job before it
//! starts: a calibration of the job itself ([`super::probe`]: its failure-free step,
//! erasure coding's overhead, resume, rebuild rate and slowdown, the checkpoints' pause
//! and restore), cached per configuration fingerprint ([`super::cache`]); a full checkpoint
//! of the model restored cold from the checkpoint directory's file system; and the memory
//! erasure coding would take against each server's budget. No cost is a constant from
//! another job: the calibration's own time is counted in the ETT it predicts.

use std::path::{Path, PathBuf};
use std::time::Instant;

use ftrec_config::{FaultTolerance, JobConfig};
use ftrec_model::ModelState;
use ftrec_rpc::{Job, PsError};

use super::cache;
use super::model::{Costs, Measured};
use super::probe::{self, ProbeFigures, ProbeOptions};

/// What to calibrate against.
pub struct CalibrateOptions<'a> {
    /// Mean time between failures of the whole cluster, if the user knows it.
    pub mtbf_seconds: Option<f64>,
    /// Scratch for the timing checkpoint (the job's checkpoint directory, or the run's).
    pub scratch: &'a Path,
    /// Where the calibration's runs go (each removed after it): the job's run directory,
    /// never its checkpoint location.
    pub runs_dir: &'a Path,
    /// The `ftrec` binary the calibration's processes are started from.
    pub exe: &'a Path,
    /// Spares the job starts with (the calibration starts as many).
    pub spares: usize,
    /// Steps of each calibration run ([`default_probe_steps`] unless told otherwise).
    pub probe_steps: u64,
    /// Where calibrations are kept per fingerprint (`None`: measured every time).
    pub cache: Option<&'a Path>,
    /// Measure again even where the cache holds this job's calibration.
    pub recalibrate: bool,
}

/// Steps of each calibration run unless told otherwise: an eighth of the job's, between 20
/// and 60. 60 steps are about 3 s of the demo job, enough for its rebuild (0.7-1.4 s) to
/// end inside the run; a short job calibrates with fewer, as the calibration is paid
/// before it (a 240-step job's took 15 s with 60).
pub fn default_probe_steps(train_steps: u64) -> u64 {
    (train_steps / 8).clamp(20, 60)
}

/// With no MTBF given: a server fails once a week, so a cluster of `n` once per week / n.
pub const DEFAULT_SERVER_MTBF_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// The calibration, measured now or found in the cache, and what this run paid for it.
struct Calibration {
    figures: ProbeFigures,
    /// "measured: ..." or "cached: FILE (...)".
    source: String,
    paid_seconds: f64,
}

fn calibration(
    config: &JobConfig,
    opts: &CalibrateOptions<'_>,
    ec_refused: Option<&str>,
) -> Result<Calibration, PsError> {
    let key = cache::key(config, opts.probe_steps, opts.spares, opts.exe)?;
    if let Some(dir) = opts.cache.filter(|_| !opts.recalibrate)
        && let Some(hit) = cache::load(dir, &key)
    {
        return Ok(Calibration {
            source: format!(
                "cached: {} (a calibration of this job's fingerprint {}, {:.1} s when measured)",
                hit.path.display(),
                key.fingerprint,
                hit.figures.seconds
            ),
            figures: hit.figures,
            paid_seconds: 0.0,
        });
    }
    let figures = probe::probe(
        config,
        &ProbeOptions {
            exe: opts.exe,
            dir: opts.runs_dir,
            spares: opts.spares,
            steps: opts.probe_steps,
        },
        ec_refused,
    )?;
    let kept = match opts.cache {
        Some(dir) => format!(", kept in {}", cache::store(dir, &key, &figures)?.display()),
        None => String::new(),
    };
    Ok(Calibration {
        source: format!(
            "measured: a calibration of this job ({} runs of {} steps, {:.1} s{kept})",
            if figures.ec.is_some() { 4 } else { 2 },
            figures.steps,
            figures.seconds
        ),
        paid_seconds: figures.seconds,
        figures,
    })
}

pub fn calibrate(config: &JobConfig, opts: &CalibrateOptions<'_>) -> Result<Costs, PsError> {
    let servers = config.cluster.servers.max(1);
    let mtbf = match opts.mtbf_seconds {
        Some(m) if m > 0.0 && m.is_finite() => Measured::new(m, "given: --mtbf"),
        Some(m) => {
            return Err(PsError::Config(format!(
                "--mtbf {m}: must be a positive number of seconds"
            )));
        }
        None => Measured::new(
            DEFAULT_SERVER_MTBF_SECONDS / servers as f64,
            format!("assumed: one failure per server per week, {servers} servers (pass --mtbf)"),
        ),
    };
    let started = Instant::now();
    let model = config.model_config()?;
    let state = ModelState::new(&model, config.seed)?;
    std::fs::create_dir_all(opts.scratch).map_err(crate::launch::io(opts.scratch))?;
    let timing = ftrec_ckpt::timing::time_full_checkpoint(&state, opts.scratch, 3)
        .map_err(|e| PsError::Fatal(format!("timing a checkpoint: {e}")))?;
    drop(state);
    let timing_seconds = started.elapsed().as_secs_f64();
    let fs = format!(
        "measured: a full checkpoint of {:.1} MB in {}, cold, median of 3",
        timing.bytes as f64 / 1e6,
        opts.scratch.display()
    );
    let (ec_shard_bytes, ec_refused) = ec_memory(config);
    let cal = calibration(config, opts, ec_refused.as_deref())?;
    let f = &cal.figures;
    let src = |what: &str| format!("{} ({what})", cal.source);
    let not_measured = |value: f64| {
        Measured::new(
            value,
            "not measured: erasure coding cannot run this job".to_string(),
        )
    };
    let ec = f.ec.as_ref();
    // The calibration's restore holds the new process and every server's load; the cold
    // load of the whole model is the part that grows with the model.
    let restart = (f.checkpoint_restore_seconds - timing.load_seconds).max(0.0);
    Ok(Costs {
        mtbf_seconds: mtbf,
        job_seconds: Measured::new(
            f.step_seconds * config.train.steps as f64,
            format!(
                "{}, times train.steps = {}",
                src(&format!("failure-free step {:.2} ms", f.step_seconds * 1e3)),
                config.train.steps
            ),
        ),
        checkpoint_save_seconds: Measured::new(
            f.checkpoint_pause_seconds,
            src("the checkpoint run's mean cut pause"),
        ),
        checkpoint_load_seconds: Measured::new(timing.load_seconds, fs),
        detection_seconds: Measured::new(
            config.cluster.failure_timeout_ms as f64 / 1e3,
            "config: cluster.failure_timeout_ms (a silent server)",
        ),
        restart_seconds: Measured::new(
            restart,
            src(&format!(
                "the checkpoint run's SIGKILL to resume, {:.2} s, less the cold load",
                f.checkpoint_restore_seconds
            )),
        ),
        ec_resume_seconds: ec.map_or_else(
            || not_measured(0.0),
            |e| Measured::new(e.resume_seconds, src("SIGKILL to degraded resume")),
        ),
        ec_overhead: ec.map_or_else(
            || not_measured(0.0),
            |e| {
                Measured::new(
                    e.overhead,
                    src(&format!(
                        "ec against none, failure-free: the larger of the wall clock's \
                         {:.1}% and CPU time per step's {:.1}%",
                        100.0 * e.wall_overhead,
                        100.0 * e.cpu_overhead
                    )),
                )
            },
        ),
        ec_shard_bytes: Measured::new(
            ec_shard_bytes as f64,
            "computed: the largest server's rows, parity and dense state under ec",
        ),
        ec_rebuild_bytes_per_sec: ec.map_or_else(
            || not_measured(1.0),
            |e| {
                Measured::new(
                    e.rebuild_bytes_per_sec,
                    src("the rebuild's bytes over its time"),
                )
            },
        ),
        ec_rebuild_slowdown: ec.map_or_else(
            || not_measured(1.0),
            |e| {
                Measured::new(
                    e.rebuild_slowdown,
                    src("1 - committed rate while rebuilding over ec's failure-free rate"),
                )
            },
        ),
        ec_refused,
        calibration_seconds: Measured::new(
            cal.paid_seconds + timing_seconds,
            format!(
                "{}; with the timing checkpoint's {:.2} s",
                cal.source, timing_seconds
            ),
        ),
        calibration_measured_seconds: f.seconds + timing_seconds,
    })
}

/// The largest server's bytes under erasure coding, and why erasure coding cannot run the
/// job on this host, if it cannot.
fn ec_memory(config: &JobConfig) -> (u64, Option<String>) {
    let mut c = config.clone();
    c.cluster.ft = FaultTolerance::Ec;
    let job = match Job::new(c) {
        Ok(job) => job,
        Err(e) => return (0, Some(e.to_string())),
    };
    let servers = job.config.cluster.servers;
    let bytes = match job.server_bytes() {
        Ok(bytes) => bytes,
        Err(e) => return (0, Some(e.to_string())),
    };
    let total: u128 = bytes.iter().sum();
    let largest = bytes
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .min(u64::MAX as u128) as u64;
    // What each server itself would refuse at its start: its share against its budget
    // (`cluster.server_memory_bytes`) and its host.
    for id in 0..servers {
        if let Err(e) = job.check_server_memory(Some(id)) {
            return (largest, Some(e.to_string()));
        }
    }
    let refused = ftrec_config::available_memory().and_then(|available| {
        // Every server of a `cluster run` shares this host.
        (total > available as u128).then(|| {
            format!(
                "its {servers} servers need {} with parity and replicas, and this host has {} \
                 available",
                ftrec_model::human_bytes(total),
                ftrec_model::human_bytes(available as u128)
            )
        })
    });
    (largest, refused)
}

/// Where the timing checkpoint goes: the job's checkpoint directory (the file system cuts
/// will be written to), else the run directory.
pub fn scratch_dir(config: &JobConfig, run_dir: &Path) -> PathBuf {
    config
        .checkpoint
        .dir
        .clone()
        .unwrap_or_else(|| run_dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auto::tests::tiny;

    /// A budget that holds a server's share without parity rules erasure coding out, by
    /// the key that sets it; the same job with no budget (or a roomy one) may use it.
    #[test]
    fn a_server_memory_budget_without_room_for_parity_rules_erasure_coding_out() {
        let plain = tiny(&["cluster.servers=3"]);
        let share: u128 = Job::new(plain.clone())
            .unwrap()
            .server_memory(Some(0))
            .unwrap()
            .iter()
            .map(|p| p.bytes)
            .sum();
        let (coded, refused) = ec_memory(&plain);
        assert!(refused.is_none(), "{refused:?}");
        assert!(coded as u128 > share, "{coded} against {share}");
        let budget = (share + (coded as u128 - share) / 4) as u64;
        let capped = tiny(&[
            "cluster.servers=3",
            &format!("cluster.server_memory_bytes={budget}"),
        ]);
        let (_, refused) = ec_memory(&capped);
        let refused = refused.expect("refused");
        assert!(refused.contains("cluster.server_memory_bytes"), "{refused}");
        // The job itself, without parity, still fits its budget.
        Job::new(capped)
            .unwrap()
            .check_server_memory(Some(0))
            .unwrap();
        let roomy = tiny(&[
            "cluster.servers=3",
            &format!("cluster.server_memory_bytes={}", coded * 2),
        ]);
        assert!(ec_memory(&roomy).1.is_none());
    }
}
