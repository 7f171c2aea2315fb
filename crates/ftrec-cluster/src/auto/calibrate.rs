//! The costs `--ft auto` chooses from, measured on this host for this job before it
//! starts: a real full checkpoint of the model written to the checkpoint directory's file
//! system and restored cold, and the memory erasure coding would take against what the
//! host has. The model's pace is the caller's to measure (the CLI times the single-process
//! trainer: the cluster crates do not depend on it). Erasure coding's own costs (normal-mode
//! overhead, resume, rebuild rate) need a cluster to measure: they come from a `bench ec`
//! summary when one is given, else from the figures BENCHMARKS.md records.

use std::path::{Path, PathBuf};

use ftrec_config::{FaultTolerance, JobConfig};
use ftrec_model::ModelState;
use ftrec_rpc::{Job, PsError};

use super::model::{Costs, Measured};

/// `bench ec`'s medians on this 2-core host (BENCHMARKS.md, issue 23; the run of
/// `bench-results/ec/summary-issue23-s37-rebuild-first.json`): used when no summary is given.
pub const EC_OVERHEAD: f64 = 0.047;
pub const EC_RESUME_SECONDS: f64 = 0.24;
/// The self-paced rebuild's rate, and the share of training it takes meanwhile
/// (1 − `rebuild_throughput_ratio`), from the same run.
pub const EC_REBUILD_BYTES_PER_SEC: f64 = 1416e6;
pub const EC_REBUILD_SLOWDOWN: f64 = 0.868;
/// A replacement server process started and joined: `bench cluster`'s SIGKILL to resume
/// less its detection, on loopback.
pub const RESTART_SECONDS: f64 = 0.5;
const BENCH: &str = "bench ec (BENCHMARKS.md)";

/// What to calibrate against.
pub struct CalibrateOptions<'a> {
    /// Mean time between failures of the whole cluster, if the user knows it.
    pub mtbf_seconds: Option<f64>,
    /// A `bench ec --json` summary.json whose medians replace the recorded EC figures.
    pub ec_summary: Option<&'a Path>,
    /// Scratch for the timing checkpoint (the job's checkpoint directory, or the run's).
    pub scratch: &'a Path,
    /// Seconds per step of the model (measured by the caller), and how.
    pub step_seconds: Measured,
}

/// With no MTBF given: a server fails once a week, so a cluster of `n` once per week / n.
pub const DEFAULT_SERVER_MTBF_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

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
    let model = config.model_config()?;
    let state = ModelState::new(&model, config.seed)?;
    std::fs::create_dir_all(opts.scratch).map_err(crate::launch::io(opts.scratch))?;
    let timing = ftrec_ckpt::timing::time_full_checkpoint(&state, opts.scratch, 3)
        .map_err(|e| PsError::Fatal(format!("timing a checkpoint: {e}")))?;
    drop(state);
    let fs = format!(
        "measured: a full checkpoint of {:.1} MB in {}, median of 3",
        timing.bytes as f64 / 1e6,
        opts.scratch.display()
    );
    let step_seconds = opts.step_seconds.value;
    let ec = ec_figures(opts.ec_summary)?;
    let ec_rebuild_slowdown = ec.slowdown_at(config.ec.rebuild_bytes_per_sec);
    let (ec_shard_bytes, ec_refused) = ec_memory(config);
    Ok(Costs {
        mtbf_seconds: mtbf,
        job_seconds: Measured::new(
            step_seconds * config.train.steps as f64,
            format!(
                "{} ({:.2} ms), times train.steps = {}",
                opts.step_seconds.source,
                step_seconds * 1e3,
                config.train.steps
            ),
        ),
        checkpoint_save_seconds: Measured::new(timing.save_seconds, fs.clone()),
        checkpoint_load_seconds: Measured::new(timing.load_seconds, format!("{fs}, cold")),
        detection_seconds: Measured::new(
            config.cluster.failure_timeout_ms as f64 / 1e3,
            "config: cluster.failure_timeout_ms (a silent server)",
        ),
        restart_seconds: Measured::new(RESTART_SECONDS, "bench cluster (BENCHMARKS.md)"),
        ec_resume_seconds: ec.resume,
        ec_overhead: ec.overhead,
        ec_shard_bytes: Measured::new(
            ec_shard_bytes as f64,
            "computed: the largest server's rows, parity and dense state under ec",
        ),
        ec_rebuild_bytes_per_sec: match config.ec.rebuild_bytes_per_sec {
            0 => ec.rebuild_rate,
            cap => Measured::new(
                (cap as f64).min(ec.rebuild_rate.value),
                "config: ec.rebuild_bytes_per_sec",
            ),
        },
        ec_rebuild_slowdown,
        ec_refused,
    })
}

struct EcFigures {
    overhead: Measured,
    resume: Measured,
    /// The rebuild's rate, and the share of training it took meanwhile, from one run.
    rebuild_rate: Measured,
    slowdown: Measured,
}

impl EcFigures {
    /// The share of training a rebuild takes at the job's cap (0: none). At or above the
    /// measured rate, as measured; below it, scaled by the cap over that rate (the
    /// rebuild's CPU grows with its rate). The rate and the slowdown come from the same
    /// run: a fast rate priced with a slow run's slowdown leaves out what it costs.
    fn slowdown_at(&self, cap: u64) -> Measured {
        let rate = self.rebuild_rate.value;
        if cap == 0 || rate <= 0.0 || cap as f64 >= rate {
            return self.slowdown.clone();
        }
        Measured::new(
            self.slowdown.value * cap as f64 / rate,
            format!(
                "{}, scaled from its {:.0} MB/s to ec.rebuild_bytes_per_sec = {:.0} MB/s",
                self.slowdown.source,
                rate / 1e6,
                cap as f64 / 1e6
            ),
        )
    }
}

/// From `bench ec`'s summary.json (its medians), or the recorded figures.
fn ec_figures(summary: Option<&Path>) -> Result<EcFigures, PsError> {
    let Some(path) = summary else {
        return Ok(EcFigures {
            overhead: Measured::new(EC_OVERHEAD, BENCH),
            resume: Measured::new(EC_RESUME_SECONDS, BENCH),
            rebuild_rate: Measured::new(EC_REBUILD_BYTES_PER_SEC, BENCH),
            slowdown: Measured::new(EC_REBUILD_SLOWDOWN, BENCH),
        });
    };
    let text = std::fs::read_to_string(path).map_err(crate::launch::io(path))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| PsError::Config(format!("{}: not JSON: {e}", path.display())))?;
    let key = |name: &str| -> Result<f64, PsError> {
        let field = &v[name];
        field["median"]
            .as_f64()
            .or_else(|| field.as_f64())
            .ok_or_else(|| {
                PsError::Config(format!(
                    "{}: no number at {name} (a `bench ec --json` summary has one)",
                    path.display()
                ))
            })
    };
    let source = format!("measured: {} (bench ec)", path.display());
    Ok(EcFigures {
        overhead: Measured::new(key("overhead")?.max(0.0), source.clone()),
        resume: Measured::new(key("kill_to_resume_seconds")?, source.clone()),
        rebuild_rate: Measured::new(key("rebuild_bytes_per_sec")?, source.clone()),
        slowdown: Measured::new(
            (1.0 - key("rebuild_throughput_ratio")?).clamp(0.0, 1.0),
            source,
        ),
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
    let mut total: u128 = 0;
    let mut largest: u128 = 0;
    for id in 0..servers {
        match job.server_memory(Some(id)) {
            Ok(parts) => {
                let bytes: u128 = parts.iter().map(|p| p.bytes).sum();
                total += bytes;
                largest = largest.max(bytes);
            }
            Err(e) => return (0, Some(e.to_string())),
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
    (largest.min(u64::MAX as u128) as u64, refused)
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

    fn summary(dir: &Path, ratio: Option<f64>) -> PathBuf {
        let mut v = serde_json::json!({
            "overhead": {"median": 0.05},
            "kill_to_resume_seconds": {"median": 0.25},
            "rebuild_bytes_per_sec": {"median": 8e8},
        });
        if let Some(ratio) = ratio {
            v["rebuild_throughput_ratio"] = serde_json::json!({"median": ratio});
        }
        let path = dir.join("summary.json");
        std::fs::write(&path, v.to_string()).unwrap();
        path
    }

    /// A rebuild at the measured rate is priced with what it took in that run; one capped
    /// below it, with that share scaled to the cap.
    #[test]
    fn the_slowdown_comes_from_the_run_whose_rate_is_used() {
        let dir = tempfile::tempdir().unwrap();
        let ec = ec_figures(Some(&summary(dir.path(), Some(0.35)))).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(ec.slowdown_at(0).value, 0.65));
        assert!(close(ec.slowdown_at(200_000_000).value, 0.65 / 4.0));
        assert!(close(ec.slowdown_at(10_000_000_000).value, 0.65));
        assert!(ec.slowdown_at(200_000_000).source.contains("scaled"));
        let recorded = ec_figures(None).unwrap();
        assert!(close(recorded.slowdown_at(0).value, EC_REBUILD_SLOWDOWN));
    }

    #[test]
    fn a_summary_without_the_throughput_ratio_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let err = ec_figures(Some(&summary(dir.path(), None)))
            .err()
            .expect("refused");
        assert!(
            err.to_string().contains("rebuild_throughput_ratio"),
            "{err}"
        );
    }
}
