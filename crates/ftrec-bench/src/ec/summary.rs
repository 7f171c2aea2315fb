//! The rounds' figures as `summary.json`: each figure's median over the rounds with its
//! spread, beside the configuration they came from.

use ftrec_config::JobConfig;
use serde_json::{Value, json};

use super::figures::{RoundFigures, round_figures, rpcs_per_step, server_bytes_per_sample};
use super::{EcOptions, Round, redundancy_bytes, spare_reserve_bytes};
use crate::error::Result;
use crate::rounds::over_rounds;
use crate::run_record::RunRecord;

/// `config`: the job every run shares; `ec_config`: it under erasure coding.
pub(super) fn summary(
    a: &EcOptions,
    config: &JobConfig,
    ec_config: &JobConfig,
    overrides: Vec<String>,
    rounds: &[Round],
    scaled_configs: &[JobConfig],
    loopback_bytes_per_sec: f64,
) -> Result<Value> {
    let figures: Vec<RoundFigures> = rounds
        .iter()
        .map(|r| {
            round_figures(
                r,
                config.train.batch_size as f64,
                a.checkpoint_every,
                a.spares,
            )
        })
        .collect();
    let across =
        |f: &dyn Fn(&RoundFigures) -> Option<f64>| over_rounds(figures.iter().map(f).collect());
    let per_run = |run: &dyn Fn(&Round) -> &RunRecord, f: &dyn Fn(&RunRecord) -> f64| {
        over_rounds(rounds.iter().map(|r| Some(f(run(r)))).collect())
    };
    let (model_bytes, parity_and_replica_bytes) = redundancy_bytes(ec_config)?;
    // Every waiting spare writes its reserve before training starts, and only erasure
    // coding needs one: it is part of what the redundancy costs.
    let spare_reserve = spare_reserve_bytes(ec_config)? * a.spares as u64;
    let extra_bytes = parity_and_replica_bytes + spare_reserve;
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
        // CPU every job process spent from the resume to full redundancy (`/proc`: the
        // servers with the replacement, the workers, the launcher and its coordinator),
        // less what the steps committed meanwhile cost them at the failure-free `ec` run's
        // CPU per step, over the gigabytes rebuilt.
        "rebuild_core_seconds_per_gb": across(&|f| f.rebuild_core_seconds_per_gb()),
        "rebuild_cpu_seconds": across(&|f| f.rebuild_cpu),
        "cpu_seconds_per_step": across(&|f| f.cpu_per_step),
        // Steps committed (not merely granted) while the replacement rebuilt, against the
        // same job with no failure: the rebuild paces itself (`ec.rebuild_training_share`)
        // unless `--set` changes it, in the same run as every other recovery figure.
        "rebuild_throughput_ratio": across(&|f| f.degraded_rate.map(|d| d / f.rate_ec)),
        "rebuild_training_share": ec_config.ec.rebuild_training_share,
        "rebuild_cap_bytes_per_sec": ec_config.ec.rebuild_bytes_per_sec,
        "rebuild_nice": ec_config.ec.rebuild_nice,
        "degraded_samples_per_sec": across(&|f| f.degraded_rate),
        "steps_committed_while_degraded": across(&|f| f.committed_while_degraded),
        // Kill to full redundancy: 1 - committed / failure-free rate, integrated, plus any
        // retrained steps; against checkpoints' restore, retrained steps at the
        // failure-free step and the pause of the interval's cut, for the same SIGKILL.
        "lost_training_seconds": across(&|f| f.lost_training_seconds),
        "checkpoint_lost_training_seconds": across(&|f| f.ckpt_lost_training_seconds),
        "lost_training_ratio": across(&|f| f.lost_training_seconds.zip(f.ckpt_lost_training_seconds).map(|(e, c)| e / c.max(1e-9))),
        "checkpoint_retrained_steps": across(&|f| Some(f.ckpt_retrained_steps as f64)),
        "checkpoint_pause_seconds": across(&|f| f.ckpt_pause_seconds),
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
        "failure_free_step_seconds": across(&|f| Some(f.failure_free_step_seconds)),
        "checkpoint_recovery_seconds_average_case": across(&|f| f.ckpt_recovery),
        // Checkpoint recovery (restore, then retraining half an interval) against ECRec's
        // time until training goes on (degraded), and against its time until the cluster
        // again survives a second failure (the rebuild done). The second is the fair one
        // for redundancy; the first is what a user waits.
        "resume_speedup": across(&|f| f.ckpt_recovery.zip(f.kill_to_resume).map(|(c, e)| c / e)),
        "full_redundancy_speedup": across(&|f| f.ckpt_recovery.zip(f.kill_to_full_redundancy).map(|(c, e)| c / e)),
        // Parity, the dense replica and every waiting spare's reserve, over the model.
        "memory_overhead": extra_bytes as f64 / model_bytes as f64,
        // The same, measured: what the servers' and a waiting spare's peak resident sets
        // (`/proc`, VmHWM) grew by from `none` to `ec` in the same round, over the model's
        // bytes. It counts what the layout leaves out (2PC's staged differences, buffers,
        // allocator slack).
        "memory_overhead_measured": across(&|f| f.redundancy_rss_bytes().map(|b| b / model_bytes as f64)),
        "model_bytes": model_bytes,
        "redundancy_bytes": extra_bytes,
        "spare_reserve_bytes": spare_reserve,
        "server_peak_rss_bytes": {
            "none": across(&|f| f.rss_none.map(|b| b as f64)),
            "ec": across(&|f| f.rss_ec.map(|b| b as f64)),
        },
        "waiting_spare_peak_rss_bytes": {
            "none": across(&|f| f.spare_rss_none.map(|b| b as f64)),
            "ec": across(&|f| f.spare_rss_ec.map(|b| b as f64)),
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
        ]).collect::<Vec<_>>(),
        // Dense replicas that differ from their primary at the end. One-round mode with
        // asynchronous workers lets the primary and its replica apply pushes in different
        // orders, so their floats drift: a known gap (ARCHITECTURE, failure model).
        "replica_mismatches": rounds.iter().map(|r| [
            r.ec.replica_mismatches,
            r.ec_no_2pc.replica_mismatches,
            r.ec_no_replication.replica_mismatches,
            r.ec_kill.replica_mismatches,
        ]).collect::<Vec<_>>(),
        "lost_samples": rounds.iter().map(|r| r.ec_kill.lost_samples).collect::<Vec<_>>(),
        "scale": scale_figures(&a.scale, rounds, scaled_configs)?,
    });
    if let (Some(all), serde_json::Value::Object(rebuild)) = (summary.as_object_mut(), rebuild) {
        all.extend(rebuild);
    }
    Ok(summary)
}

/// `--scale`: per factor, the state rebuilt, the SIGKILL to resume, the rebuild's time and
/// rate, and the throughput, each over the rounds.
fn scale_figures(factors: &[usize], rounds: &[Round], configs: &[JobConfig]) -> Result<Value> {
    let mut by_factor = serde_json::Map::new();
    for (i, (factor, config)) in factors.iter().zip(configs).enumerate() {
        let runs: Vec<&RunRecord> = rounds.iter().map(|r| &r.scaled[i]).collect();
        let of = |f: &dyn Fn(&RunRecord) -> Option<f64>| {
            over_rounds(runs.iter().map(|r| f(r)).collect())
        };
        let recovery = |r: &RunRecord| r.recoveries.first().cloned();
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
                "samples_per_sec": of(&|r| Some(r.samples_per_sec)),
                "parity_mismatches": runs.iter().map(|r| r.parity_mismatches).collect::<Vec<_>>(),
                "lost_samples": runs.iter().map(|r| r.lost_samples).collect::<Vec<_>>(),
            }),
        );
    }
    Ok(Value::Object(by_factor))
}
