//! The coordinator in etcd (issue 22), with real processes and a real etcd on loopback:
//! a standby takes over from a killed or frozen leader, mid-run and mid-rebuild, and the
//! run ends exactly where `ftrec train` does; a deposed leader changes nothing; bad
//! endpoints, another job's prefix and a changed job file are refused by name.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use ftrec_testkit::ClusterRun;
use ftrec_testkit::by_hand::{
    etcd_coordinator, etcd_hand_job, finished_exact, hand_job, listening_address, signal, spawn,
    spawn_members, wait_exit,
};
use ftrec_testkit::cli::json_of;
use ftrec_testkit::etcd::LocalEtcd;

use crate::FTREC;

fn etcd(dir: &Path) -> LocalEtcd {
    ftrec_testkit::etcd::start(&dir.join("etcd"))
}

/// `cluster run --etcd` of the small model: 3 servers, 2 workers, deterministic.
fn run_with_etcd(data: &str, run_dir: &Path, endpoint: &str, steps: &str, extra: &[&str]) -> Value {
    ClusterRun::new(data)
        .steps(steps)
        .servers(3)
        .workers(2)
        .deterministic()
        .arg("--etcd", endpoint)
        .arg("--coordinators", 2)
        .run_dir(run_dir)
        .extend(extra)
        .report(FTREC)
}

/// The last lines of every coordinator's log under the report's run directory: a slow
/// takeover is read from them (the test's directory is gone once it fails).
fn coordinator_logs(report: &Value) -> String {
    let logs = Path::new(report["run_dir"].as_str().unwrap_or("")).join("logs");
    let mut names: Vec<_> = std::fs::read_dir(&logs)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    names.retain(|p: &std::path::PathBuf| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("coordinator-"))
    });
    names.sort();
    let mut out = String::new();
    for path in names {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        out += &format!("\n--- {} (last 60 lines)\n", path.display());
        out += &lines[lines.len().saturating_sub(60)..].join("\n");
    }
    out
}

/// Every leader kill was followed by a takeover whose first step settled, and the report
/// says which coordinator finished.
fn assert_failovers(report: &Value, kills: usize) {
    let failovers = report["coordinator_failovers"].as_array().unwrap();
    assert_eq!(failovers.len(), kills, "{report}");
    for f in failovers {
        assert_ne!(f["from"], f["to"], "{report}");
        assert!(f["first_step_at_unix"].is_f64(), "{report}");
    }
    let killed = report["coordinator_kills"].as_array().unwrap();
    assert_eq!(killed.len(), kills, "{report}");
    let ttl = report["lease_ttl_seconds"].as_f64().unwrap();
    for k in killed {
        let seconds = k["kill_to_first_step_seconds"].as_f64().unwrap();
        // The goal is TTL + 1 s (measured by `ftrec bench coordinator`); a loaded test
        // machine gets slack, a takeover that never happened gets none.
        assert!(
            seconds > 0.0 && seconds < ttl + 10.0,
            "{report}{}",
            coordinator_logs(report)
        );
    }
}

#[test]
fn a_leader_killed_mid_run_or_mid_rebuild_is_replaced_and_the_run_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let etcd = etcd(dir.path());
    let expected = FTREC.single_process_digest(&data, "1500");

    // The leader that ends the job writes `--save`: here the one that took over.
    let saved = dir.path().join("mid-run.ftm");
    let report = run_with_etcd(
        &data,
        &dir.path().join("mid-run"),
        &etcd.endpoint,
        "1500",
        &[
            "--ft",
            "ec",
            "--kill",
            "coordinator@1.5s",
            "--save",
            saved.to_str().unwrap(),
        ],
    );
    assert_eq!(report["state_digest"], expected, "{report}");
    let model = json_of(&FTREC.run(&[
        "eval",
        "--model",
        saved.to_str().unwrap(),
        "--data",
        &data,
        "--json",
    ]));
    assert_eq!(model["state_digest"], expected, "{model}");
    assert_eq!(model["model_step"], 1500, "{model}");
    assert_eq!(report["lost_samples"], 0);
    assert_eq!(report["parity_mismatches"], 0);
    assert_eq!(report["replica_mismatches"], 0);
    assert_failovers(&report, 1);

    // A server dies, and its replacement's background rebuild (throttled to last) loses
    // its coordinator: the new leader runs the recovery again.
    let report = run_with_etcd(
        &data,
        &dir.path().join("mid-rebuild"),
        &etcd.endpoint,
        "1500",
        &[
            "--ft",
            "ec",
            "--kill",
            "server:1@1s",
            "--kill",
            "coordinator@rebuild",
            "--set",
            "ec.rebuild_bytes_per_sec=1000000",
        ],
    );
    assert_eq!(report["state_digest"], expected, "{report}");
    assert_eq!(report["lost_samples"], 0);
    assert_eq!(report["parity_mismatches"], 0);
    assert_eq!(report["replica_mismatches"], 0);
    assert_failovers(&report, 1);
    assert_eq!(report["coordinator_kills"][0]["during_rebuild"], true);
    let rebuilds = report["recoveries"].as_array().unwrap();
    assert!(
        rebuilds
            .iter()
            .any(|r| r["mode"] == "rebuild" && r["rebuild_bytes"].as_u64() > Some(0)),
        "the new leader's rebuild finished: {report}"
    );
}

#[test]
fn a_new_leader_rolls_back_to_a_cut_the_old_one_committed() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let etcd = etcd(dir.path());
    let expected = FTREC.single_process_digest(&data, "1500");
    let report = run_with_etcd(
        &data,
        &dir.path().join("run"),
        &etcd.endpoint,
        "1500",
        &[
            "--ft",
            "checkpoint",
            "--set",
            "checkpoint.every_steps=50",
            "--kill",
            "coordinator@1s",
            "--kill",
            "server:1@4s",
        ],
    );
    assert_eq!(report["state_digest"], expected, "{report}");
    assert_eq!(report["lost_samples"], 0);
    assert_failovers(&report, 1);
    // The cuts the first leader committed are the new leader's too.
    let cuts: Vec<u64> = report["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["step"].as_u64().unwrap())
        .collect();
    assert_eq!(cuts.first(), Some(&50), "{report}");
    let recovery = &report["recoveries"][0];
    assert_eq!(recovery["mode"], "rollback", "{report}");
    let resumed = recovery["resumed_step"].as_u64().unwrap();
    assert!(
        cuts.contains(&resumed),
        "rolled back to a committed cut: {report}"
    );
    // Not to an older one: the newest cut the killed leader reported committed is known to
    // the new leader (how far back that is depends on how soon it took over, which a
    // loaded test machine stretches). A leader reports a cut once etcd holds the record
    // with it; before, the record followed at the next flush, and a kill in between left
    // the new leader one cut behind the old one's log (seen once under a full suite).
    // A SIGKILLed coordinator writes no timeline file; its log has the same lines.
    let logs = dir.path().join("run/logs");
    let first_leader_log = std::fs::read_dir(&logs)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("coordinator-0-")
        })
        .expect("the first leader's log");
    let newest_old_cut = std::fs::read_to_string(&first_leader_log)
        .unwrap()
        .lines()
        .filter(|l| !l.contains("not recorded in etcd yet"))
        .filter_map(|l| {
            l.split("checkpoint-end: step ")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .max();
    assert!(
        newest_old_cut.is_some(),
        "the first leader committed a cut: {first_leader_log:?}"
    );
    assert!(
        Some(resumed) >= newest_old_cut,
        "rolled back to {resumed}, behind the old leader's cut {newest_old_cut:?}: {report}"
    );
}

#[test]
fn a_frozen_leader_is_deposed_and_changes_nothing_when_it_wakes() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let etcd = etcd(dir.path());
    let steps = 1500;
    let e = etcd.endpoint.as_str();
    let (job, keys) = etcd_hand_job(FTREC, dir.path(), &data, steps, (e, "/ftrec/frozen"), &[]);
    let job_s = job.to_str().unwrap();
    let coordinator =
        |id: &str, standby: bool| etcd_coordinator(FTREC, dir.path(), job_s, e, id, standby);
    let mut first = coordinator("c1", false);
    let started = Instant::now();
    while keys.leader().as_deref() != Some("c1") {
        assert!(started.elapsed() < Duration::from_secs(20), "c1 never led");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut second = coordinator("c2", true);
    let members = spawn_members(FTREC, dir.path(), job_s, &["--etcd", e]);
    // Freeze the leader once training is under way.
    let started = Instant::now();
    while keys
        .record()
        .is_none_or(|r| r["settled_through"].as_u64() < Some(100))
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "training never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(&first, "STOP");
    let frozen = Instant::now();
    while keys.leader().as_deref() != Some("c2") {
        assert!(
            frozen.elapsed() < Duration::from_secs(30),
            "the standby never took over"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let the new leader work a while, then wake the old one.
    std::thread::sleep(Duration::from_millis(1000));
    signal(&first, "CONT");
    let status = wait_exit(&mut first, Duration::from_secs(30));
    assert!(!status.success(), "the deposed leader exits with an error");
    let mut log = String::new();
    std::fs::File::open(dir.path().join("c1.log"))
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(log.contains("no longer leads the job"), "{log}");
    let report = finished_exact(
        FTREC,
        &mut second,
        &dir.path().join("c2.json"),
        &data,
        steps,
    );
    assert_eq!(report["lost_samples"], 0);
    assert_eq!(report["parity_mismatches"], 0);
    assert_eq!(report["coordinator_failovers"][0]["from"], "c1", "{report}");
    assert_eq!(report["coordinator_failovers"][0]["to"], "c2", "{report}");
    // The last word in etcd is the new leader's: the old one wrote nothing after waking.
    let last = keys.record().unwrap();
    assert_eq!(last["leader"], "c2");
    assert_eq!(last["done"], true);
    for mut m in members {
        let _ = wait_exit(&mut m, Duration::from_secs(30));
    }
}

#[test]
fn an_unreachable_etcd_another_jobs_prefix_and_a_changed_job_file_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let etcd = etcd(dir.path());
    // A member waits this long for an etcd that does not answer (an outage, as far as it
    // can tell) before it gives up: 600 s by default.
    let prefix = [
        "--set",
        "cluster.etcd_prefix=\"/ftrec/shared\"",
        "--set",
        "cluster.control_plane_grace_s=2",
    ];
    let job = hand_job(FTREC, dir.path(), &data, "a", 50, &prefix);
    let job_s = job.to_str().unwrap();
    let run = |job: &str, endpoint: &str| {
        let out = FTREC
            .command()
            .args([
                "coordinator",
                "--job",
                job,
                "--etcd",
                endpoint,
                "--port",
                "0",
            ])
            .args([
                "--host",
                "127.0.0.1",
                "--out",
                dir.path().join("x").to_str().unwrap(),
            ])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // Nothing listens: the error names the endpoint.
    let (ok, err) = run(job_s, "127.0.0.1:1");
    assert!(!ok);
    assert!(
        err.contains("127.0.0.1:1") && err.contains("unreachable"),
        "{err}"
    );
    let (ok, err) = {
        let out = FTREC
            .command()
            .args([
                "worker",
                "--job",
                job_s,
                "--etcd",
                "127.0.0.1:1",
                "--id",
                "0",
            ])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    assert!(!ok);
    assert!(err.contains("127.0.0.1:1"), "{err}");
    // It said at once that it waits, and for how long.
    assert!(err.contains("cluster.control_plane_grace_s"), "{err}");

    // Job a claims the prefix (a coordinator that leads, then is stopped).
    let mut leader = FTREC
        .command()
        .args([
            "coordinator",
            "--job",
            job_s,
            "--etcd",
            &etcd.endpoint,
            "--port",
            "0",
        ])
        .args([
            "--host",
            "127.0.0.1",
            "--out",
            dir.path().join("a-out").to_str().unwrap(),
        ])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let keys = ftrec_testkit::etcd::JobKeys::new(&etcd.endpoint, "/ftrec/shared");
    let started = Instant::now();
    while keys.leader().is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "job a never led"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = leader.kill();
    let _ = leader.wait();
    let claim = || keys.get("job").expect("the job's claim in etcd");
    let claimed = claim();

    // Another job (its own secret) with the same prefix: refused, naming the key.
    let other = hand_job(FTREC, dir.path(), &data, "b", 50, &prefix);
    let (ok, err) = run(other.to_str().unwrap(), &etcd.endpoint);
    assert!(!ok);
    assert!(
        err.contains("/ftrec/shared/job") && err.contains("another job"),
        "{err}"
    );

    // Job a's secret with another configuration: refused by its fingerprint.
    let changed = hand_job(
        FTREC,
        dir.path(),
        &data,
        "c",
        50,
        &[prefix[0], prefix[1], "--set", "optimizer.sparse.lr=0.5"],
    );
    let secret = |job: &Path| job.with_file_name("job.secret");
    std::fs::copy(secret(&job), secret(&changed)).unwrap();
    let (ok, err) = run(changed.to_str().unwrap(), &etcd.endpoint);
    assert!(!ok);
    assert!(
        err.contains("/ftrec/shared/job") && err.contains("fingerprint"),
        "{err}"
    );
    // The refusals wrote nothing: the claim is job a's.
    assert_eq!(claim(), claimed);
}

#[test]
fn training_goes_on_while_etcd_is_frozen_and_nothing_is_lost_when_it_returns() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let etcd = etcd(dir.path());
    let expected = FTREC.single_process_digest(&data, "2000");
    let run_dir = dir.path().join("run");
    let prefix = "/ftrec/frozen-etcd";
    let (endpoint, data_dir, run) = (etcd.endpoint.clone(), data.clone(), run_dir.clone());
    let cluster = std::thread::spawn(move || {
        let prefix_set = format!("cluster.etcd_prefix=\"{prefix}\"");
        run_with_etcd(
            &data_dir,
            &run,
            &endpoint,
            "2000",
            &["--ft", "ec", "--set", &prefix_set],
        )
    });
    let keys = ftrec_testkit::etcd::JobKeys::new(&etcd.endpoint, prefix);
    let started = Instant::now();
    let before = loop {
        if let Some(steps) = keys.record().and_then(|r| r["settled_through"].as_u64())
            && steps >= 100
        {
            break steps;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "training never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Frozen for twice the lease: nobody can reach etcd, and nothing needs a decision.
    let stop = |sig: &str| {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &etcd.pid().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
    };
    stop("STOP");
    std::thread::sleep(Duration::from_secs(6));
    stop("CONT");
    let thawed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let started = Instant::now();
    // The first record written after the thaw says where training got to meanwhile.
    let after = loop {
        if let Some(r) = keys.record()
            && r["written_at_unix"].as_f64() > Some(thawed)
        {
            break r["settled_through"].as_u64().unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "etcd never answered again"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let report = cluster.join().unwrap();
    assert!(
        after > before,
        "training went on while the lease was surely the leader's: step {before} before, \
         {after} after"
    );
    assert_eq!(report["state_digest"], expected, "{report}");
    assert_eq!(report["lost_samples"], 0);
    assert_eq!(report["parity_mismatches"], 0);
    // The first leader's own record of its throughput: it trained on while its lease was
    // surely its own, and on past it (`cluster.train_through_etcd_outage`, the default:
    // every server well, nothing to decide) once its first write failed, a request timeout
    // into the freeze. Before, it granted nothing then, and the freeze cost its length.
    // (A job that waits for etcd grants nothing with its lease in doubt: the control-plane
    // simulation's `a_leader_trains_through_an_etcd_outage_while_its_servers_are_well`.)
    let timeline: Value = serde_json::from_slice(
        &std::fs::read(run_dir.join("coordinator-0").join("timeline.json")).unwrap(),
    )
    .unwrap();
    let failed_at = timeline["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| {
            e["detail"]
                .as_str()
                .unwrap_or("")
                .starts_with("etcd does not answer")
        })
        .and_then(|e| e["t"].as_f64())
        .expect("the leader noticed etcd gone");
    let per_second: Vec<u64> = timeline["samples_per_second"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    let first = failed_at.ceil() as usize;
    let during: u64 = per_second.iter().skip(first).take(2).sum();
    assert!(
        during > 0,
        "no step settled in seconds {first}..{} of {per_second:?}, past the lease",
        first + 2
    );
    // A single etcd member frozen past the TTL expires the lease when it returns (etcd
    // extends leases only when its own leader changes), so a standby may take over once:
    // at most one failover, and still nothing lost.
    let failovers = report["coordinator_failovers"].as_array().unwrap().len();
    assert!(failovers <= 1, "{report}");
}

/// A coordinator that was itself frozen (SIGSTOP) for several failure timeouts wakes to
/// find every member silent: that silence is its own. It fences no one, no recovery
/// happens, and the run ends exact. (Before, it declared every server dead on waking;
/// with etcd membership a deposed leader did so before it learned it was deposed, and
/// the live servers exited.) Embedded membership: nothing else could take over.
#[test]
fn a_coordinator_frozen_past_the_failure_timeout_fences_no_one_when_it_wakes() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let steps = 1500;
    let job = hand_job(FTREC, dir.path(), &data, "job", steps, &[]);
    let job_s = job.to_str().unwrap();
    let out = dir.path().join("coordinator");
    let mut coordinator = spawn(
        FTREC,
        &[
            "coordinator",
            "--job",
            job_s,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--json",
            "--out",
            out.to_str().unwrap(),
        ],
        &out,
    );
    let address = listening_address(&out.with_extension("log"));
    let members = spawn_members(FTREC, dir.path(), job_s, &["--coordinator", &address]);
    // Under way, then frozen for three failure timeouts (1 s each).
    std::thread::sleep(Duration::from_secs(2));
    signal(&coordinator, "STOP");
    std::thread::sleep(Duration::from_secs(3));
    signal(&coordinator, "CONT");
    let status = wait_exit(&mut coordinator, Duration::from_secs(120));
    assert!(status.success(), "the coordinator finished the job");
    let report: Value =
        serde_json::from_slice(&std::fs::read(out.with_extension("json")).unwrap()).unwrap();
    assert_eq!(
        report["recoveries"].as_array().map(Vec::len),
        Some(0),
        "nobody was declared dead: {report}"
    );
    assert_eq!(report["zombies_refused"], 0, "{report}");
    assert_eq!(
        report["state_digest"],
        FTREC.single_process_digest(&data, &steps.to_string()),
        "{report}"
    );
    for mut m in members {
        assert!(wait_exit(&mut m, Duration::from_secs(30)).success());
    }
}
