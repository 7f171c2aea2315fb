//! The parameter-server cluster as real processes over loopback TCP: equivalence with the
//! single-process trainer, SIGKILLed servers replaced and rolled back, and clear refusals.

use ftrec_proto::timeline::EventKind;
use ftrec_testkit::ClusterRun;
use ftrec_testkit::cluster::{announced, event_kinds as events};

use crate::FTREC;

use std::io::Read;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[test]
fn one_deterministic_worker_equals_the_single_process_trainer() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    // 7200 train samples / 128 = 56.25 steps per epoch: 70 steps cross an epoch.
    let expected = FTREC.single_process_digest(&data, "70");
    // Deterministic mode orders steps globally, so two workers taking turns give the same
    // bits as one.
    for (servers, workers) in [("1", "1"), ("3", "1"), ("2", "2")] {
        let run = dir.path().join(format!("run-{servers}-{workers}"));
        let out = ClusterRun::new(&data)
            .run_dir(&run)
            .steps(70)
            .servers(servers)
            .workers(workers)
            .deterministic()
            .no_eval()
            .report(FTREC);
        assert_eq!(
            out["state_digest"], expected,
            "{servers} servers, {workers} workers"
        );
        assert_eq!(out["steps"], 70);
        assert_eq!(out["samples"], 70 * 128 - (128 - 7200 % 128));
        assert!(out["rpc_bytes_per_sample"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn a_sigkilled_server_is_replaced_and_the_rollback_is_bit_exact() {
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
        .ft("checkpoint")
        .set("checkpoint.every_steps=50")
        .kill("server:1@0.5s")
        .report(FTREC);
    // The replacement restored the last cut and training replayed the rolled-back steps:
    // the end state is the uninterrupted run's, bit for bit.
    assert_eq!(out["state_digest"], expected);
    let recoveries = out["recoveries"].as_array().unwrap();
    assert_eq!(recoveries.len(), 1, "{out}");
    assert_eq!(recoveries[0]["server"], 1);
    assert_eq!(recoveries[0]["resumed_step"].as_u64().unwrap() % 50, 0);
    assert!(out["recovery_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(out["kill_to_resume_seconds"].as_array().unwrap().len(), 1);
    assert!(out["auc"].as_f64().unwrap() > 0.5);
    let kinds = events(&run);
    for kind in [
        EventKind::Killed,
        EventKind::FailureDetected,
        EventKind::Replacement,
        EventKind::RecoveryStart,
        EventKind::RecoveryEnd,
    ] {
        assert!(kinds.contains(&kind), "no {kind} event in {kinds:?}");
    }
    let server_joins = kinds
        .iter()
        .filter(|k| **k == EventKind::ServerJoined)
        .count();
    assert_eq!(server_joins, 3, "two servers and one replacement");
    // Each server's checkpoints are ordinary verified checkpoints of its shard.
    for s in 0..2 {
        let ck = run.join(format!("checkpoints/server-{s}"));
        let verify = FTREC.run(&["ckpt", "verify", ck.to_str().unwrap()]);
        assert!(
            verify.status.success(),
            "{}",
            String::from_utf8_lossy(&verify.stdout)
        );
    }
    let png = dir.path().join("timeline.png");
    let plot = FTREC.run(&[
        "plot",
        "timeline",
        run.to_str().unwrap(),
        "--out",
        png.to_str().unwrap(),
    ]);
    assert!(
        plot.status.success(),
        "{}",
        String::from_utf8_lossy(&plot.stderr)
    );
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
}

#[test]
fn asynchronous_workers_survive_a_kill_with_a_spare_and_without_rollback() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let run = dir.path().join("run");
    let out = ClusterRun::new(&data)
        .run_dir(&run)
        .steps(2500)
        .servers(2)
        .workers(2)
        .arg("--spares", 1)
        .ft("none")
        .kill("server:0@0.5s")
        .kill("worker:1@2.5s")
        .no_eval()
        .report(FTREC);
    assert_eq!(out["steps"], 2500);
    assert_eq!(out["recoveries"].as_array().unwrap().len(), 1, "{out}");
    assert_eq!(out["recoveries"][0]["steps_rolled_back"], 0);
    // A killed worker is stateless: it is detected, respawned, and training completes.
    let kinds = events(&run);
    let (_, replacement) = ftrec_testkit::cluster::events(&run)
        .into_iter()
        .find(|(k, _)| *k == EventKind::Replacement)
        .expect("a replacement event");
    assert!(
        replacement.contains("spare"),
        "the spare took the slot: {replacement}"
    );
    assert!(
        kinds.contains(&EventKind::WorkerFailureDetected),
        "{kinds:?}"
    );
    assert_eq!(
        kinds
            .iter()
            .filter(|k| **k == EventKind::WorkerJoined)
            .count(),
        3
    );
}

fn wait_with_limit(mut child: Child, limit: Duration) -> (bool, String) {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return (status.success(), err);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("process did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn write_job(dir: &Path, data: &str, name: &str, extra: &[&str]) -> std::path::PathBuf {
    // `cluster run` writes the job file; a short run with a tiny time limit gives us one.
    let run = dir.join(name);
    ClusterRun::new(data)
        .steps(2)
        .run_dir(&run)
        .no_time_limit()
        .no_eval()
        .servers(1)
        .workers(1)
        .extend(extra)
        .report(FTREC);
    run.join("job.toml")
}

#[test]
fn bad_addresses_mismatched_configs_and_stolen_identities_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let job = write_job(dir.path(), &data, "a", &[]);
    let other = write_job(
        dir.path(),
        &data,
        "b",
        &["--set", "optimizer.sparse.lr=0.5"],
    );
    let job_s = job.to_str().unwrap();

    // Nothing listens on port 1: a bounded wait and an error naming the address.
    let worker = FTREC
        .command()
        .args([
            "worker",
            "--job",
            job_s,
            "--coordinator",
            "127.0.0.1:1",
            "--id",
            "0",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, err) = wait_with_limit(worker, Duration::from_secs(30));
    assert!(!ok);
    assert!(err.contains("127.0.0.1:1"), "{err}");

    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let address = format!("127.0.0.1:{port}");
    let mut coordinator = FTREC
        .command()
        .args([
            "coordinator",
            "--job",
            job_s,
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ])
        .args(["--out", dir.path().join("coord").to_str().unwrap()])
        .stderr(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let server = |job: &str| {
        FTREC
            .command()
            .args([
                "server",
                "--job",
                job,
                "--coordinator",
                &address,
                "--id",
                "0",
            ])
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    };
    // Another job's process does not hold this job's secret: refused before anything else.
    let (ok, err) = wait_with_limit(server(other.to_str().unwrap()), Duration::from_secs(30));
    assert!(!ok);
    assert!(err.contains("wrong job secret"), "{err}");
    // With the secret but another configuration: refused by the fingerprint.
    let secret = |job: &Path| job.with_file_name("job.secret");
    std::fs::copy(secret(&job), secret(&other)).unwrap();
    let (ok, err) = wait_with_limit(server(other.to_str().unwrap()), Duration::from_secs(30));
    assert!(!ok);
    assert!(err.contains("another configuration"), "{err}");

    let mut first = server(job_s);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        first.try_wait().unwrap().is_none(),
        "the real server 0 runs"
    );
    let (ok, err) = wait_with_limit(server(job_s), Duration::from_secs(30));
    assert!(!ok);
    assert!(err.contains("already held"), "{err}");

    let _ = first.kill();
    let _ = coordinator.kill();
    let _ = first.wait();
    let _ = coordinator.wait();
}

#[test]
fn cluster_kill_sigkills_a_member_of_a_running_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let run = dir.path().join("run");
    let args = ClusterRun::new(&data)
        .steps(3000)
        .run_dir(&run)
        .servers(2)
        .workers(1)
        .ft("checkpoint")
        .set("checkpoint.every_steps=100")
        .no_eval()
        .args();
    let mut child = FTREC
        .command()
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The launcher announces its coordinator on stderr before training starts.
    let (address, metrics_address, _stderr) = announced(&mut child);
    std::thread::sleep(Duration::from_millis(1500));
    let job = run.join("job.toml");
    let job = job.to_str().unwrap();
    // The cluster admits only its job's processes: without the job's secret, refused.
    let refused = FTREC.run(&["cluster", "kill", "--coordinator", &address, "server:0"]);
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--job"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let kill = FTREC.run(&[
        "cluster",
        "kill",
        "--coordinator",
        &address,
        "--job",
        job,
        "server:0",
    ]);
    assert!(
        kill.status.success(),
        "{}",
        String::from_utf8_lossy(&kill.stderr)
    );
    assert!(String::from_utf8_lossy(&kill.stdout).contains("killed server:0"));
    let bad = FTREC.run(&[
        "cluster",
        "kill",
        "--coordinator",
        &address,
        "--job",
        job,
        "disk:0",
    ]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown role"));
    // The coordinator's Prometheus endpoint counts the steps trained so far.
    let metrics = http_get(&metrics_address, "/metrics");
    assert!(metrics.starts_with("HTTP/1.1 200"), "{metrics}");
    assert!(
        metrics.contains("# TYPE ftrec_steps_total counter"),
        "{metrics}"
    );
    let steps: u64 = metrics
        .lines()
        .find(|l| l.starts_with("ftrec_steps_total{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("a steps sample");
    assert!(steps > 0, "{metrics}");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["steps"], 3000);
    assert_eq!(
        report["recoveries"].as_array().unwrap().len(),
        1,
        "{report}"
    );
    assert_eq!(report["recoveries"][0]["server"], 0);
}

fn http_get(address: &str, path: &str) -> String {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}
