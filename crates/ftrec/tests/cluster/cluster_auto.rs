//! `--ft auto` calibrating on the job and choosing by the failure rate, time-based cuts (`checkpoint.every_seconds`),
//! and a frozen server (SIGSTOP, silent rather than gone) fenced and rolled back exactly.

use ftrec_proto::timeline::EventKind;
use ftrec_testkit::ClusterRun;
use ftrec_testkit::cluster::event_kinds;
use serde_json::Value;

use crate::FTREC;

/// `--ft auto` calibrates on the job itself (4 short runs: none, ec, ec with a SIGKILL,
/// checkpoints with a SIGKILL), keeps the calibration per configuration, counts what
/// choosing cost in the ETT it predicts, and chooses the strategy whose prediction is
/// best; a memory budget without room for the parity rules erasure coding out.
#[test]
fn auto_calibrates_on_the_job_caches_it_and_chooses_by_the_failure_rate() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = FTREC.single_process_digest(&data, "40");
    let cache = dir.path().join("calibrations");
    let auto_run = |name: &str, mtbf: &str, set: Option<String>| {
        let mut run = ClusterRun::new(&data)
            .run_dir(&dir.path().join(name))
            .steps(40)
            .servers(3)
            .workers(1)
            .deterministic()
            .no_eval()
            .ft("auto")
            .arg("--mtbf", mtbf)
            .arg("--calibration-cache", cache.display())
            .arg("--calibration-steps", 24);
        if let Some(set) = set {
            run = run.set(&set);
        }
        let out = run.report(FTREC);
        // Whatever it chose trains the same model.
        assert_eq!(out["state_digest"], expected, "{name}: {}", out["auto"]);
        out["auto"].clone()
    };
    let source =
        |auto: &Value, key: &str| auto["costs"][key]["source"].as_str().unwrap().to_string();
    let value = |auto: &Value, key: &str| auto["costs"][key]["value"].as_f64().unwrap();

    let first = auto_run("frequent", "2", None);
    for key in [
        "job_seconds",
        "checkpoint_save_seconds",
        "restart_seconds",
        "ec_overhead",
        "ec_resume_seconds",
        "ec_rebuild_bytes_per_sec",
        "ec_rebuild_slowdown",
    ] {
        assert!(
            source(&first, key).starts_with("measured: a calibration of this job (4 runs"),
            "{key}: {first}"
        );
    }
    assert!(value(&first, "ec_resume_seconds") > 0.0, "{first}");
    assert!(value(&first, "ec_rebuild_bytes_per_sec") > 0.0, "{first}");
    // What choosing cost is in the prediction.
    let paid = value(&first, "calibration_seconds");
    assert!(paid > 0.0, "{first}");
    let before = first["predicted_ett_before_calibration"].as_f64().unwrap();
    assert!(first["predicted_ett"].as_f64().unwrap() < before, "{first}");
    // The choice is the candidates' best prediction.
    let best = first["predictions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["excluded"].is_null())
        .max_by(|a, b| {
            a["ett"]
                .as_f64()
                .unwrap()
                .total_cmp(&b["ett"].as_f64().unwrap())
        })
        .unwrap()
        .clone();
    assert_eq!(first["strategy"], best["strategy"], "{first}");

    // The same job at another rate finds its calibration: nothing measured again.
    let rare = auto_run("rare", "1000000", None);
    assert!(
        source(&rare, "ec_overhead").starts_with("cached: "),
        "{rare}"
    );
    assert_eq!(value(&rare, "ec_overhead"), value(&first, "ec_overhead"));
    assert!(value(&rare, "calibration_seconds") < paid, "{rare}");
    // One failure per 11 days: checkpoints, far apart.
    assert_eq!(rare["strategy"], "checkpoint", "{rare}");
    assert!(rare["every_seconds"].as_f64().unwrap() > 0.0, "{rare}");

    // Each server's budget one byte short of its share under erasure coding: checkpoints,
    // and erasure coding's runs are not even tried.
    let coded = value(&first, "ec_shard_bytes") as u64;
    let capped = auto_run(
        "capped",
        "2",
        Some(format!("cluster.server_memory_bytes={}", coded - 1)),
    );
    assert_eq!(capped["strategy"], "checkpoint", "{capped}");
    assert!(
        capped["why"]
            .as_str()
            .unwrap()
            .contains("cluster.server_memory_bytes"),
        "{capped}"
    );
    assert!(
        source(&capped, "ec_overhead").starts_with("not measured"),
        "{capped}"
    );
    assert!(
        source(&capped, "restart_seconds").contains("2 runs"),
        "{capped}"
    );
}

#[test]
fn a_frozen_server_is_fenced_and_time_based_cuts_roll_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = FTREC.single_process_digest(&data, "1000");
    let run = dir.path().join("run");
    let out = ClusterRun::new(&data)
        .run_dir(&run)
        .steps(1000)
        .servers(2)
        .workers(1)
        .deterministic()
        .no_eval()
        .ft("checkpoint")
        .set("checkpoint.every_seconds=0.25")
        // Planned for one failure in 600 s: the freeze makes the coordinator measure
        // the MTBF again and re-plan the interval from it and the cuts' pause.
        .set("checkpoint.planned_mtbf_seconds=600")
        .kill("server:1@1s=freeze")
        .report(FTREC);
    assert_eq!(out["state_digest"], expected, "{out}");
    let recoveries = out["recoveries"].as_array().unwrap();
    assert_eq!(recoveries.len(), 1, "{out}");
    assert_eq!(recoveries[0]["server"], 1);
    // The freeze is the failure the resume is timed from.
    assert_eq!(out["kill_to_resume_seconds"].as_array().unwrap().len(), 1);
    // Cuts follow wall time, not a step count: none closer than the interval.
    let starts: Vec<f64> = out["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["started_at"].as_f64().unwrap())
        .collect();
    assert!(starts.len() >= 2, "{out}");
    for w in starts.windows(2) {
        assert!(w[1] - w[0] >= 0.25, "cuts at {starts:?}");
    }
    // One failure after t s of training: MTBF (600 + t) / 2, and Young's interval from
    // the last cut's measured pause.
    let replan = &out["replan"];
    assert_eq!(replan["failures"], 1, "{out}");
    let mtbf = replan["mtbf_seconds"].as_f64().unwrap();
    assert!(mtbf > 300.0 && mtbf < 310.0, "{replan}");
    let save = replan["measured_save_seconds"].as_f64().unwrap();
    let every = replan["every_seconds"].as_f64().unwrap();
    assert!(
        (every - (2.0 * save * mtbf).sqrt()).abs() < 1e-9,
        "{replan}"
    );
    let kinds = event_kinds(&run);
    for kind in [
        EventKind::CheckpointReplanned,
        EventKind::Frozen,
        EventKind::FailureDetected,
        EventKind::SupersededKilled,
        EventKind::RecoveryEnd,
    ] {
        assert!(kinds.contains(&kind), "no {kind} in {kinds:?}");
    }
}
