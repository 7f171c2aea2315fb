//! `--ft auto` choosing by the failure rate, time-based cuts (`checkpoint.every_seconds`),
//! and a frozen server (SIGSTOP, silent rather than gone) fenced and rolled back exactly.

use ftrec_proto::timeline::EventKind;
use ftrec_testkit::ClusterRun;
use ftrec_testkit::cluster::event_kinds;

use crate::FTREC;

#[test]
fn auto_chooses_by_the_failure_rate_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = FTREC.single_process_digest(&data, "40");
    let mut chosen = Vec::new();
    for mtbf in ["2", "1000000"] {
        let run = dir.path().join(format!("run-{mtbf}"));
        let out = ClusterRun::new(&data)
            .run_dir(&run)
            .steps(40)
            .servers(3)
            .workers(1)
            .deterministic()
            .no_eval()
            .ft("auto")
            .arg("--mtbf", mtbf)
            .report(FTREC);
        let auto = &out["auto"];
        let save = &auto["costs"]["checkpoint_save_seconds"];
        assert!(save["value"].as_f64().unwrap() > 0.0, "{auto}");
        assert!(
            save["source"].as_str().unwrap().starts_with("measured"),
            "{auto}"
        );
        assert_eq!(
            auto["costs"]["mtbf_seconds"]["value"].as_f64(),
            mtbf.parse().ok()
        );
        assert!(!auto["why"].as_str().unwrap().is_empty());
        // Whatever it chose trains the same model.
        assert_eq!(out["state_digest"], expected, "mtbf {mtbf}: {auto}");
        chosen.push((auto["strategy"].clone(), auto["every_seconds"].clone()));
    }
    // A failure every 2 s: erasure coding. One per 11 days: checkpoints, far apart.
    assert_eq!(chosen[0].0, "ec", "{chosen:?}");
    assert_eq!(chosen[1].0, "checkpoint", "{chosen:?}");
    assert!(chosen[1].1.as_f64().unwrap() > 0.0, "{chosen:?}");
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
