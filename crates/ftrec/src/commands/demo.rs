//! `ftrec demo`: generate data, train on a local cluster, SIGKILL a server mid-run and
//! show the recovery.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use ftrec_config::JobConfig;
use ftrec_data::generate::{GenConfig, OutputFormat, read_meta};
use ftrec_data::{TEST_FILE, TRAIN_FILE};
use ftrec_proto::timeline::{EventKind, TimelineData};
use serde_json::json;

use crate::commands::data::run_gen;
use crate::output::print_json;
use crate::progress::bar;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Where to put the generated data.
    #[arg(long, default_value = "demo-data")]
    pub dir: PathBuf,
    /// Samples to generate (train + test).
    #[arg(long, default_value_t = 2_600_000)]
    pub rows: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// SIGKILL server 1 this many seconds after training starts.
    #[arg(long, default_value_t = 20.0)]
    pub kill_after: f64,
    /// How the cluster survives the kill: `ec` (3 servers, erasure coded: the server is
    /// rebuilt from the others, nothing rolls back) or `checkpoint` (2 servers, roll back to
    /// the last consistent checkpoint).
    #[arg(long, default_value = "ec", value_parser = str::parse::<ftrec_config::FaultTolerance>)]
    pub ft: ftrec_config::FaultTolerance,
    #[arg(long)]
    pub json: bool,
}

fn remove_if_present(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", dir.display()))
        }
        _ => Ok(()),
    }
}

pub fn run(a: DemoArgs) -> Result<()> {
    let gen_config = GenConfig::criteo(a.rows, a.seed, 0.01);
    let meta = match read_meta(&a.dir) {
        Some(m)
            if m.config == gen_config
                && a.dir.join(TRAIN_FILE).exists()
                && a.dir.join(TEST_FILE).exists() =>
        {
            m
        }
        _ => {
            if !a.json {
                outln!(
                    "generating {} Criteo-shaped samples into {} ...",
                    a.rows,
                    a.dir.display()
                );
            }
            run_gen(&gen_config, &a.dir, OutputFormat::Binary, a.json)?
        }
    };
    let mut config = JobConfig::preset("demo")?;
    config.seed = a.seed;
    config.threads = 1;
    config.data.dir = Some(std::path::absolute(&a.dir)?);
    let erasure_coded = a.ft.erasure_coded();
    config.cluster.servers = if erasure_coded { 3 } else { 2 };
    config.cluster.workers = 2;
    config.cluster.ft = a.ft;
    config.checkpoint.every_steps = 100;
    let run_dir = std::path::absolute(a.dir.join("cluster-run"))?;
    let checkpoints = run_dir.join("checkpoints");
    // The demo's checkpoints are its own scratch: each demo is a fresh run, and a full
    // cut of this model is about 680 MB.
    remove_if_present(&checkpoints)?;
    if a.ft.checkpoints() {
        config.checkpoint.dir = Some(checkpoints.clone());
    }
    if !a.json {
        let how = if erasure_coded {
            "3 parameter servers + 2 workers as separate processes over TCP,\n\
             rows and optimizer state erasure coded (k = 2, r = 1), dense parameters replicated"
        } else {
            "2 parameter servers + 2 workers as separate processes over TCP,\n\
             a consistent checkpoint every 100 steps"
        };
        outln!(
            "training the tiny DLRM (26 tables x 100k rows x 64, batch 2048) for one pass over {} samples\n\
             on a local cluster: {how}; server 1 is to be SIGKILLed {}s into training ...",
            meta.train_samples,
            a.kill_after
        );
    }
    let job = ftrec_rpc::Job::new(config)?;
    let total =
        job.config.train.epochs * (meta.train_samples).div_ceil(job.config.train.batch_size as u64);
    let pb = bar(total, "cluster");
    if a.json {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let report = ftrec_cluster::launch::run(
        ftrec_cluster::launch::LaunchOptions {
            job,
            run_dir: run_dir.clone(),
            kills: vec![
                format!("server:1@{}s", a.kill_after)
                    .parse()
                    .map_err(anyhow::Error::msg)?,
            ],
            spares: 0,
            exe: std::env::current_exe()?,
            time_limit: std::time::Duration::from_secs(3600),
            evaluate: Some(crate::commands::cluster::evaluator()),
            save: None,
            resume: None,
            scale_at: Vec::new(),
        },
        |p| {
            pb.set_position(p.steps);
            pb.set_message(format!("{} samples, epoch {}", p.samples, p.epoch));
        },
    );
    pb.finish_and_clear();
    let report = report?;
    // Recovery is over; what stays is the timeline and the logs (disk use bounded).
    remove_if_present(&checkpoints)?;
    let auc = report.auc.unwrap_or(f64::NAN);
    let gap = meta.teacher_auc - auc;
    let s = &report.summary;
    let timeline = TimelineData::read(&run_dir.join("timeline.json"))?;
    let killed = timeline.of(EventKind::Killed).next().is_some();
    if a.json {
        return print_json(json!({
            "auc": auc, "teacher_auc": meta.teacher_auc, "auc_gap": gap,
            "logloss": report.logloss, "samples": s.samples,
            "samples_per_sec": s.samples_per_sec, "seconds": s.train_seconds,
            "state_digest": report.state_digest, "recovery_seconds": s.recovery_seconds,
            "kill_to_resume_seconds": report.kill_to_resume_seconds,
            "recoveries": s.recoveries, "run_dir": report.run_dir, "server_killed": killed,
            "parity_mismatches": report.parity_mismatches,
            "pls": s.pls, "recovery_mode": s.recovery_mode,
        }));
    }
    for e in timeline.events.iter().filter(|e| {
        matches!(
            e.kind,
            EventKind::TrainingStart
                | EventKind::Killed
                | EventKind::FailureDetected
                | EventKind::Replacement
                | EventKind::ServerJoined
                | EventKind::RecoveryStart
                | EventKind::RebuildStart
                | EventKind::Degraded
                | EventKind::RebuildProgress
                | EventKind::RebuildEnd
                | EventKind::PartialRestore
                | EventKind::CprDecision
                | EventKind::RecoveryEnd
                | EventKind::TrainingEnd
        )
    }) {
        outln!("  [{:7.2}s] {:<17} {}", e.t, e.kind, e.detail);
    }
    outln!(
        "trained {} samples in {:.1}s ({:.0} samples/s); {} checkpoints; {}",
        s.samples,
        s.train_seconds,
        s.samples_per_sec,
        s.checkpoints.len(),
        kill_outcome(
            killed,
            &report.kill_to_resume_seconds,
            s.recovery_seconds,
            s.train_seconds,
            a.kill_after
        )
    );
    for r in s.recoveries.iter().filter(|r| r.background_rebuild) {
        println!(
            "server {} rebuilt {:.1} MB in the background in {:.2}s while training went on              ({} steps trained degraded); full redundancy {:.2}s after the failure was detected",
            r.server,
            r.rebuild_bytes as f64 / 1e6,
            r.rebuild_seconds,
            r.steps_while_degraded,
            r.degraded_seconds
        );
    }
    if let Some(m) = report.parity_mismatches {
        outln!("verify-parity: {m} stripes whose parity disagrees with their rows");
    }
    outln!(
        "held-out AUC {:.4} vs teacher ceiling {:.4} (gap {:.4}); logloss {:.4}",
        auc,
        meta.teacher_auc,
        gap,
        report.logloss.unwrap_or(f64::NAN)
    );
    outln!(
        "timeline and logs in {}; plot: ftrec plot timeline {} --out timeline.png",
        run_dir.display(),
        run_dir.display()
    );
    Ok(())
}

/// The demo's account of its SIGKILL: a run shorter than `--kill-after` ends before the
/// kill, and saying "recovery took 0.00s" then would claim a recovery that never was.
fn kill_outcome(
    killed: bool,
    kill_to_resume: &[f64],
    recovery_seconds: f64,
    train_seconds: f64,
    kill_after: f64,
) -> String {
    if !killed {
        return format!(
            "server 1 was NOT killed: training ended after {train_seconds:.1}s, before the \
             kill at {kill_after}s (pass --kill-after below {train_seconds:.1}, or more --rows)"
        );
    }
    if kill_to_resume.is_empty() {
        return format!(
            "server 1 was SIGKILLed but training did not resume before it ended (recovery \
             work {recovery_seconds:.2}s)"
        );
    }
    let each: Vec<String> = kill_to_resume.iter().map(|k| format!("{k:.2}s")).collect();
    format!(
        "recovery took {recovery_seconds:.2}s (SIGKILL to training resumed: {})",
        each.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::kill_outcome;

    #[test]
    fn a_kill_that_never_happened_is_not_reported_as_a_recovery() {
        let s = kill_outcome(false, &[], 0.0, 0.6, 20.0);
        assert!(s.contains("NOT killed") && s.contains("0.6s"), "{s}");
        assert!(!s.contains("resumed:"), "{s}");
        let s = kill_outcome(true, &[1.234], 1.0, 30.0, 20.0);
        assert!(s.contains("resumed: 1.23s"), "{s}");
        let s = kill_outcome(true, &[], 0.5, 21.0, 20.0);
        assert!(s.contains("did not resume"), "{s}");
    }
}
