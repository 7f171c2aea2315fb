//! The cluster loses no step and never hangs: SIGKILLed workers (also while a cut is
//! pending), failing checkpoints, signals to the launcher; and its disk use stays bounded.
//! Real processes over loopback TCP, real SIGKILLs.

use ftrec_proto::timeline::EventKind;
use ftrec_testkit::ClusterRun;
use ftrec_testkit::cli::json_of;
use ftrec_testkit::cluster::{events, timed_events};

use crate::FTREC;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TRAIN_SAMPLES: u64 = 7200;
const BATCH: u64 = 128;

/// Samples in the first `steps` batches of the schedule (the last batch of an epoch is
/// short), which is what a run that trains every step exactly once reports.
fn samples_of(steps: u64) -> u64 {
    let per_epoch = TRAIN_SAMPLES.div_ceil(BATCH);
    (0..steps)
        .map(|g| {
            let i = g % per_epoch;
            BATCH.min(TRAIN_SAMPLES - i * BATCH)
        })
        .sum()
}

/// A few kill moments per run, different each time the suite runs (printed, so a failure
/// can be replayed with `FTREC_KILL_SEED`): each `min_gap` plus up to `spread_ms` after the
/// previous one (a slot killed twice needs its replacement to have joined).
fn kill_moments(n: usize, spread_ms: u64, min_gap: f64) -> Vec<f64> {
    let seed = std::env::var("FTREC_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("FTREC_KILL_SEED={seed}");
    let mut x = seed | 1;
    let mut at = 0.3 - min_gap;
    (0..n)
        .map(|_| {
            // xorshift: enough spread for kill times, no dependency.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            at += min_gap + (x % spread_ms) as f64 / 1000.0;
            at
        })
        .collect()
}

/// Workers SIGKILLed at random moments, in two shapes: two workers with a cut every 5
/// steps, so most kills land while a cut waits for the dead worker's step; and one worker
/// with rare cuts, so kills land mid-step (pull, compute or push). Nothing is lost, and the
/// result equals the single-process trainer's bits: the dead worker's step was settled,
/// granted again, or rolled back to the cut.
fn worker_kills_lose_nothing(trials: usize) {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let mut expected = std::collections::BTreeMap::new();
    let mut outcomes = std::collections::BTreeMap::<&str, usize>::new();
    for trial in 0..trials {
        let run = dir.path().join(format!("run-{trial}"));
        let (steps, workers, every, victims, gap) = if trial % 2 == 0 {
            (
                "400",
                "2",
                "checkpoint.every_steps=5",
                ["worker:0", "worker:1"],
                0.0,
            )
        } else {
            (
                "1500",
                "1",
                "checkpoint.every_steps=200",
                ["worker:0", "worker:0"],
                1.6,
            )
        };
        let expected = expected
            .entry(steps)
            .or_insert_with(|| FTREC.single_process_digest(&data, steps));
        let kills: Vec<String> = kill_moments(2, 1000, gap)
            .iter()
            .zip(victims)
            .map(|(t, w)| format!("{w}@{t:.3}s"))
            .collect();
        let cluster = ClusterRun::new(&data)
            .run_dir(&run)
            .steps(steps)
            .no_eval()
            .servers(2)
            .workers(workers)
            .deterministic()
            .ft("checkpoint")
            .set(every);
        let args = kills.iter().fold(cluster, |c, k| c.kill(k)).args();
        let out = json_of(&FTREC.run(&args));
        let timed = timed_events(&run);
        let kinds = events(&run);
        assert_eq!(out["lost_samples"], 0, "{kills:?}: {out}");
        assert_eq!(out["steps"].to_string(), steps, "{kills:?}: {out}");
        assert_eq!(&out["state_digest"], &*expected, "{kills:?}: {kinds:?}");
        // Every kill the failure detector had time for (1 s of silence) was detected.
        let end = timed
            .iter()
            .find(|(_, k, _)| *k == EventKind::TrainingEnd)
            .map_or(f64::MAX, |(t, _, _)| *t);
        let due = timed
            .iter()
            .filter(|(t, k, _)| *k == EventKind::Killed && t + 1.5 < end)
            .count();
        let detected = kinds
            .iter()
            .filter(|(k, _)| *k == EventKind::WorkerFailureDetected)
            .count();
        assert!(detected >= due, "{kills:?}: {kinds:?}");
        for (kind, _) in &kinds {
            if [
                EventKind::StepSettled,
                EventKind::StepRegranted,
                EventKind::RollbackNeeded,
            ]
            .contains(kind)
            {
                *outcomes.entry(kind.name()).or_default() += 1;
            }
        }
    }
    eprintln!("dead workers' steps: {outcomes:?}");
}

#[test]
fn sigkilled_workers_lose_no_step_and_the_run_stays_bit_exact() {
    worker_kills_lose_nothing(2);
}

/// The long sweep: `cargo test -p ftrec --test cluster cluster_safety:: -- --ignored`.
#[test]
#[ignore]
fn sigkilled_workers_lose_no_step_sweep() {
    worker_kills_lose_nothing(20);
}

/// `cluster run --kill worker:J@prepared:N`: the worker dies with its step prepared on
/// every server and committed on none (2PC between its phases), by its own fault point.
/// The step is resolved, trained again, and the run ends bit-exact.
#[test]
fn a_worker_killed_between_the_commit_phases_by_cluster_run_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let run = dir.path().join("run");
    let steps = "300";
    let args = ClusterRun::new(&data)
        .run_dir(&run)
        .steps(steps)
        .no_eval()
        .servers(3)
        // One worker takes every step, so step 41 is surely its own.
        .workers(1)
        .deterministic()
        .ft("ec")
        .kill("worker:0@prepared:41")
        .args();
    let out = json_of(&FTREC.run(&args));
    let kinds = events(&run);
    assert_eq!(out["lost_samples"], 0, "{out}");
    assert_eq!(out["parity_mismatches"], 0, "{out}");
    assert_eq!(
        out["state_digest"],
        FTREC.single_process_digest(&data, steps),
        "{kinds:?}"
    );
    assert!(
        kinds
            .iter()
            .any(|(k, text)| *k == EventKind::WorkerFailureDetected && text.contains("worker 0")),
        "the worker died at its fault point: {kinds:?}"
    );
}

#[test]
fn asynchronous_workers_killed_mid_run_train_every_step_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    for ft in ["none", "checkpoint"] {
        let run = dir.path().join(format!("run-{ft}"));
        let kills: Vec<String> = kill_moments(2, 700, 0.0)
            .iter()
            .zip(["worker:1", "worker:0"])
            .map(|(t, w)| format!("{w}@{t:.3}s"))
            .collect();
        let cluster = ClusterRun::new(&data)
            .run_dir(&run)
            .steps(1500)
            .no_eval()
            .servers(2)
            .workers(3)
            .ft(ft)
            .set("checkpoint.every_steps=50");
        let args = kills.iter().fold(cluster, |c, k| c.kill(k)).args();
        let out = json_of(&FTREC.run(&args));
        // No server died, so nothing rolls back: the samples counted are those of each
        // step once, which a skipped or doubly counted step would break.
        assert_eq!(out["lost_samples"], 0, "{ft} {kills:?}: {out}");
        assert_eq!(out["samples"], samples_of(1500), "{ft} {kills:?}: {out}");
        assert!(out["recoveries"].as_array().unwrap().is_empty(), "{out}");
    }
}

fn checkpoint_ids(dir: &Path) -> Vec<String> {
    let ls = json_of(&FTREC.run(&["ckpt", "ls", dir.to_str().unwrap(), "--json"]));
    let list = ls
        .get("checkpoints")
        .and_then(|c| c.as_array())
        .or_else(|| ls.as_array())
        .unwrap_or_else(|| panic!("{ls}"));
    list.iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn only_the_newest_cuts_are_kept_and_rollback_still_finds_its_cut() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = FTREC.single_process_digest(&data, "300");
    let run = dir.path().join("run");
    let args = ClusterRun::new(&data)
        .run_dir(&run)
        .steps(300)
        .no_eval()
        .servers(2)
        .workers(1)
        .deterministic()
        .ft("checkpoint")
        .set("checkpoint.every_steps=10")
        .kill("server:0@0.8s")
        .args();
    let out = json_of(&FTREC.run(&args));
    assert_eq!(out["state_digest"], expected, "{out}");
    let cuts = out["checkpoints"].as_array().unwrap();
    assert!(cuts.len() > 5, "{out}");
    for s in 0..2 {
        let ids = checkpoint_ids(&run.join(format!("checkpoints/server-{s}")));
        // The default `checkpoint.keep = 2`: the two newest cuts, each server's part.
        let newest: Vec<&str> = cuts[cuts.len() - 2..]
            .iter()
            .map(|c| c["ids"][s].as_str().unwrap())
            .collect();
        let mut have: Vec<&str> = ids.iter().map(String::as_str).collect();
        have.sort();
        let mut want = newest.clone();
        want.sort();
        assert_eq!(have, want, "server {s}");
    }
    // keep = 0 keeps every cut.
    let all = dir.path().join("all");
    let args = ClusterRun::new(&data)
        .run_dir(&all)
        .steps(60)
        .no_eval()
        .servers(1)
        .workers(1)
        .ft("checkpoint")
        .set("checkpoint.every_steps=10")
        .set("checkpoint.keep=0")
        .args();
    json_of(&FTREC.run(&args));
    assert_eq!(
        checkpoint_ids(&all.join("checkpoints/server-0")).len(),
        6,
        "cuts at 10, 20, ..., 50, and the final one at 60"
    );
}

#[test]
fn a_failing_cut_is_reported_backs_off_and_training_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let run = dir.path().join("run");
    // Server 1 cannot create any data file: its `data` is a plain file.
    let ck = dir.path().join("ck");
    std::fs::create_dir_all(ck.join("server-1")).unwrap();
    std::fs::write(ck.join("server-1/data"), b"not a directory").unwrap();
    let args = ClusterRun::new(&data)
        .run_dir(&run)
        .steps(3000)
        .no_eval()
        .servers(2)
        .workers(1)
        .ft("checkpoint")
        .arg("--checkpoint-dir", ck.to_str().unwrap())
        .set("checkpoint.every_steps=5")
        .args();
    let out = FTREC.command().args(&args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report = json_of(&out);
    assert_eq!(report["steps"], 3000);
    assert!(report["checkpoints"].as_array().unwrap().is_empty());
    assert!(
        stderr.contains("checkpoint of step 5 failed") && stderr.contains("Training goes on"),
        "{stderr}"
    );
    let events = events(&run);
    let failed = events
        .iter()
        .filter(|(k, _)| *k == EventKind::CheckpointFailed)
        .count();
    let seconds = report["train_seconds"].as_f64().unwrap();
    // Backing off 2 s, 4 s, 8 s ...: a handful, not one every 20 ms; then the final cut's
    // 3 tries, 2 s apart, and the job ends saying so.
    let bound = 2 + (seconds / 2.0).log2().max(0.0).ceil() as usize + 3;
    assert!(
        (4..=bound).contains(&failed),
        "{failed} failed cuts in {seconds:.1}s"
    );
    assert!(
        events.iter().any(|(k, d)| *k == EventKind::Error
            && d.contains("the final cut of step 3000 failed 3 times")
            && d.contains("newest cut is none")),
        "{events:?}"
    );
}

/// The pids of `parent`'s children, from /proc.
fn children_of(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: the command may hold spaces, so split after ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) {
            out.push(pid);
        }
    }
    out
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

/// Starts a long cluster run and waits until training has started; returns the launcher
/// and its server and worker pids.
fn start_long_run(data: &str, run: &Path) -> (Child, Vec<u32>) {
    let args = ClusterRun::new(data)
        .run_dir(run)
        .steps(1000000)
        .no_eval()
        .servers(2)
        .workers(1)
        .args();
    let mut child = FTREC
        .command()
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("coordinator at") {
        line.clear();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "no coordinator line"
        );
    }
    // Keep draining stderr so the launcher never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = stderr.read_to_string(&mut rest);
    });
    let pid = child.id();
    assert!(
        wait_until(Duration::from_secs(30), || children_of(pid).len() >= 3),
        "the launcher did not start its processes"
    );
    std::thread::sleep(Duration::from_millis(1000));
    let kids = children_of(pid);
    (child, kids)
}

#[test]
fn the_launcher_stops_its_processes_on_sigterm_or_sighup_and_they_die_with_it_on_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());

    // SIGHUP too: the terminal that started the run closed.
    for signal in ["TERM", "HUP"] {
        let run = dir.path().join(signal);
        let (mut launcher, kids) = start_long_run(&data, &run);
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &launcher.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        assert!(
            wait_until(Duration::from_secs(20), || launcher
                .try_wait()
                .unwrap()
                .is_some()),
            "the launcher did not stop on SIG{signal}"
        );
        assert!(!launcher.wait().unwrap().success());
        assert!(kids.iter().all(|&k| !alive(k)), "children left: {kids:?}");
        let kinds = events(&run);
        assert!(
            kinds
                .iter()
                .any(|(k, d)| *k == EventKind::Interrupted && d.contains(&format!("SIG{signal}"))),
            "{kinds:?}"
        );
    }

    let run = dir.path().join("kill");
    let (mut launcher, kids) = start_long_run(&data, &run);
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || kids.iter().all(|&k| !alive(k))),
        "children outlived a SIGKILLed launcher: {kids:?}"
    );
}

#[test]
fn a_temporary_run_directory_is_removed_after_a_successful_run_unless_it_holds_cuts() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    // No --run-dir: the launcher makes a temporary one.
    let run = |ft: &str, extra: &[&str]| {
        ClusterRun::new(&data)
            .steps(30)
            .no_time_limit()
            .servers(1)
            .workers(1)
            .ft(ft)
            .set("checkpoint.every_steps=10")
            .no_eval()
            .extend(extra)
            .report(FTREC)
    };
    let out = run("none", &[]);
    assert_eq!(out["run_dir_removed"], true);
    let run_dir = out["run_dir"].as_str().unwrap();
    assert!(!Path::new(run_dir).exists(), "{run_dir} is still there");
    // Cuts elsewhere: the scratch goes, the cuts stay.
    let elsewhere = dir.path().join("ck");
    let out = run(
        "checkpoint",
        &["--checkpoint-dir", elsewhere.to_str().unwrap()],
    );
    assert_eq!(out["run_dir_removed"], true);
    assert!(elsewhere.join("server-0").is_dir());
    // Cuts in the run directory: nothing committed is deleted on the way out.
    let out = run("checkpoint", &[]);
    assert_eq!(out["run_dir_removed"], false);
    let kept = Path::new(out["run_dir"].as_str().unwrap()).join("checkpoints/server-0");
    let listed = json_of(&FTREC.run(&["ckpt", "ls", kept.to_str().unwrap(), "--json"]));
    let steps: Vec<u64> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps.last(), Some(&30), "the final cut: {listed}");
    std::fs::remove_dir_all(kept.parent().unwrap().parent().unwrap()).unwrap();
}

/// The standard failure: a server host that goes silent (SIGSTOP: no refusal ever comes).
/// It is declared dead after the failure timeout, replaced, and killed by the launcher;
/// nothing waits on it, and the run ends with `ftrec train`'s model and exact parity.
#[test]
fn a_frozen_server_is_replaced_and_the_run_ends_exact() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let steps = "600";
    let expected = FTREC.single_process_digest(&data, steps);
    let run = dir.path().join("frozen");
    let args = ClusterRun::new(&data)
        .run_dir(&run)
        .steps(steps)
        .no_eval()
        .servers(3)
        .workers(1)
        .deterministic()
        .ft("ec")
        .args();
    let launcher = FTREC
        .command()
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = launcher.id();
    let is_server_1 = |p: &u32| {
        let cmdline = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        args.contains(&&b"server"[..]) && args.windows(2).any(|w| w == [&b"--id"[..], b"1"])
    };
    let mut frozen = None;
    assert!(
        wait_until(Duration::from_secs(30), || {
            frozen = children_of(pid).into_iter().find(is_server_1);
            frozen.is_some() && children_of(pid).len() >= 4
        }),
        "the launcher did not start its processes"
    );
    let frozen = frozen.unwrap();
    // Training is under way: 600 steps take several seconds.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        Command::new("kill")
            .args(["-STOP", &frozen.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let out = launcher.wait_with_output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the report");
    assert!(out.status.success(), "{report}");
    assert_eq!(report["state_digest"], expected, "{report}");
    assert_eq!(report["parity_mismatches"], 0, "{report}");
    assert_eq!(report["replica_mismatches"], 0, "{report}");
    let recoveries = report["recoveries"].as_array().unwrap();
    assert!(
        recoveries.iter().any(|r| r["server"] == 1),
        "no recovery of server 1: {report}"
    );
    assert!(!alive(frozen), "the frozen server outlived the run");
    let kinds = events(&run);
    assert!(
        kinds.iter().any(|(k, _)| *k == EventKind::SupersededKilled),
        "{kinds:?}"
    );
}
