//! Faults that strike while something else is failing (issue 42), with real processes and
//! a real etcd: etcd frozen while a server dies, and the holes found by reading the code
//! and by runs across network namespaces, each pinned by a test that failed before its fix.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;

use ftrec_testkit::ClusterRun;
use ftrec_testkit::by_hand::{pids_with_args, signal_pid};

use crate::FTREC;

/// Hole 2 of issue 42, the acceptance run: etcd frozen (SIGSTOP) 12 s after launch for
/// 60 s, and server 1 SIGKILLed by pid 4 s into the freeze, under `--ft ec` with
/// asynchronous workers and a standby coordinator. Before the fix the leader went on
/// granting steps that the dead server lost until 64 in a row ended the job, every
/// server gave up on the coordinator 10 s later, the launcher's new standbys exited at
/// once on the unreachable etcd, and the whole model was lost. Now the leader grants
/// nothing it cannot decide about, the servers hold on to their shards, the standby waits
/// for etcd, and when etcd returns the dead server is recovered with nothing lost.
#[test]
fn etcd_frozen_for_a_minute_while_a_server_dies_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let etcd = ftrec_testkit::etcd::start(&dir.path().join("etcd"));
    let run_dir = dir.path().join("run");
    let run = ClusterRun::new(&data)
        .steps(2500)
        .servers(3)
        .workers(2)
        .ft("ec")
        .arg("--etcd", &etcd.endpoint)
        .arg("--coordinators", 2)
        .run_dir(&run_dir);
    let launched = Instant::now();
    let child = FTREC
        .command()
        .args(run.args())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let at = |seconds: u64| {
        let due = launched + Duration::from_secs(seconds);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
    };
    at(12);
    signal_pid(etcd.pid(), "STOP");
    at(16);
    let job = run_dir.join("job.toml");
    let job = job.to_str().unwrap();
    let server_1 = pids_with_args(&["server", job, "--id", "1"]);
    assert_eq!(server_1.len(), 1, "server 1 of {job}: {server_1:?}");
    signal_pid(server_1[0], "KILL");
    at(72);
    signal_pid(etcd.pid(), "CONT");
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["lost_samples"], 0, "{report}");
    assert_eq!(report["parity_mismatches"], 0, "{report}");
    assert_eq!(report["replica_mismatches"], 0, "{report}");
    let recoveries = report["recoveries"].as_array().unwrap();
    assert!(
        recoveries.iter().any(|r| r["server"] == 1),
        "server 1 was recovered: {report}"
    );
}
