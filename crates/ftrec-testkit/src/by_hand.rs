//! A job's processes started one by one, as an operator across hosts would: a job file
//! from a short `cluster run`, then coordinators, servers and workers spawned by hand, with
//! signals to freeze and wake them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::{ClusterRun, Ftrec};

/// A job file for processes started by hand, `steps` long, with its etcd prefix: a
/// 2-step `cluster run` of 3 servers and 2 workers under `--ft ec` writes it, and the
/// steps are raised after.
pub fn hand_job(
    ftrec: Ftrec,
    dir: &Path,
    data: &str,
    name: &str,
    steps: u64,
    extra: &[&str],
) -> PathBuf {
    let run = dir.join(name);
    let args = ClusterRun::new(data)
        .steps(2)
        .run_dir(&run)
        .servers(3)
        .workers(2)
        .ft("ec")
        .deterministic()
        .no_eval()
        .extend(extra)
        .args();
    ftrec.json(&args);
    let job = run.join("job.toml");
    let text = std::fs::read_to_string(&job).unwrap();
    std::fs::write(
        &job,
        text.replace("steps = 2\n", &format!("steps = {steps}\n")),
    )
    .unwrap();
    job
}

/// `ftrec args`, its standard output in `out.json` and its standard error in `out.log`.
pub fn spawn(ftrec: Ftrec, args: &[&str], out: &Path) -> Child {
    to_files(ftrec, args, out).spawn().unwrap()
}

/// `ftrec args` with its standard output in `out.json` and its standard error in `out.log`.
fn to_files(ftrec: Ftrec, args: &[&str], out: &Path) -> Command {
    let mut command = ftrec.command();
    command
        .args(args)
        .stdout(std::fs::File::create(out.with_extension("json")).unwrap())
        .stderr(std::fs::File::create(out.with_extension("log")).unwrap());
    command
}

/// The 3 servers and 2 workers of a job started by hand; `find` says how they find the
/// coordinator (`--etcd URL` or `--coordinator ADDRESS`). Logs go beside `dir`'s files.
pub fn spawn_members(ftrec: Ftrec, dir: &Path, job: &str, find: &[&str]) -> Vec<Child> {
    [
        ("server", "0"),
        ("server", "1"),
        ("server", "2"),
        ("worker", "0"),
        ("worker", "1"),
    ]
    .into_iter()
    .map(|(role, id)| {
        let mut args = vec![role, "--job", job, "--id", id];
        args.extend(find);
        spawn(ftrec, &args, &dir.join(format!("{role}-{id}")))
    })
    .collect()
}

pub fn signal(child: &Child, name: &str) {
    signal_pid(child.id(), name);
}

pub fn wait_exit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(started.elapsed() < limit, "no exit within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The address a coordinator started by hand prints on its standard error.
pub fn listening_address(log: &Path) -> String {
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(address) = text
            .lines()
            .find_map(|l| l.strip_prefix("coordinator listening on "))
        {
            return address.trim().to_string();
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the coordinator never listened: {text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The pids of this host's processes whose command line holds every word of `words`, in
/// any order (found in `/proc`): a member a launcher started, killed by its pid.
pub fn pids_with_args(words: &[&str]) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| {
            let e = e.ok()?;
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let args: Vec<String> = cmdline
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            words
                .iter()
                .all(|w| args.iter().any(|a| a == w))
                .then_some(pid)
        })
        .collect()
}

/// Sends signal `name` (`STOP`, `CONT`, `KILL`) to `pid`.
pub fn signal_pid(pid: u32, name: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{name} {pid}");
}

/// Processes a test started by hand, SIGKILLed when it ends, passed or failed: a server
/// under etcd never gives up on a timeout (it holds a shard), so one left behind by a
/// failed assertion would wait for good.
pub struct Reaped(pub Vec<Child>);

impl Drop for Reaped {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A coordinator of `job` started by hand under etcd at `endpoint`, named `id` (its report
/// in `dir/ID.json`, its log in `dir/ID.log`, its timeline in `dir/ID/`), as a standby or
/// not.
pub fn etcd_coordinator(
    ftrec: Ftrec,
    dir: &Path,
    job: &str,
    endpoint: &str,
    id: &str,
    standby: bool,
) -> Child {
    let out = dir.join(id);
    let out_s = out.to_str().unwrap();
    let mut args = vec![
        "coordinator",
        "--job",
        job,
        "--etcd",
        endpoint,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--id",
        id,
        "--json",
        "--out",
        out_s,
    ];
    if standby {
        args.push("--standby");
    }
    spawn(ftrec, &args, &out)
}

/// Waits for the coordinator `child` to finish the job and reads its report (`ID.json`
/// beside `dir/ID`, as [`etcd_coordinator`] writes it); asserts that it succeeded and that
/// the model it ended with is `ftrec train`'s after `steps` steps of `data`.
pub fn finished_exact(
    ftrec: Ftrec,
    child: &mut Child,
    report: &Path,
    data: &str,
    steps: u64,
) -> serde_json::Value {
    let status = wait_exit(child, Duration::from_secs(120));
    assert!(
        status.success(),
        "{} did not finish the job",
        report.display()
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(report).unwrap()).unwrap();
    assert_eq!(
        report["state_digest"],
        ftrec.single_process_digest(data, &steps.to_string()),
        "{report}"
    );
    report
}

/// Leader `c1`, then standby `c2`, the job's servers and workers, and `spares` spares, each
/// started by hand under the etcd at `endpoint` (logs under `dir`, a spare's in
/// `spare-N.log`); returned once the
/// record says `settled` steps settled and every spare joined. The coordinators first.
#[track_caller]
pub fn start_with_spares(
    ftrec: Ftrec,
    dir: &Path,
    job: &str,
    endpoint: &str,
    keys: &crate::etcd::JobKeys,
    spares: usize,
    settled: u64,
) -> (Reaped, Reaped) {
    let coordinator =
        |id: &str, standby: bool| etcd_coordinator(ftrec, dir, job, endpoint, id, standby);
    let mut coordinators = Reaped(vec![coordinator("c1", false)]);
    let started = Instant::now();
    while keys.leader().as_deref() != Some("c1") {
        assert!(started.elapsed() < Duration::from_secs(20), "c1 never led");
        std::thread::sleep(Duration::from_millis(50));
    }
    coordinators.0.push(coordinator("c2", true));
    let mut members = Reaped(spawn_members(ftrec, dir, job, &["--etcd", endpoint]));
    // The spares log at `info`, so a test can tell when one rebuilt a slot.
    for n in 0..spares {
        let args = ["server", "--job", job, "--etcd", endpoint, "--spare"];
        let spare = to_files(ftrec, &args, &dir.join(format!("spare-{n}")))
            .env("FTREC_LOG", "info")
            .spawn()
            .unwrap();
        members.0.push(spare);
    }
    let spares_in = |r: &serde_json::Value| r["spares"].as_array().map_or(0, Vec::len);
    while keys
        .record()
        .is_none_or(|r| r["settled_through"].as_u64() < Some(settled) || spares_in(&r) < spares)
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "training never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (coordinators, members)
}

/// [`hand_job`] with its keys under `prefix` in the etcd at `endpoint`, and a reader of
/// those keys.
#[track_caller]
pub fn etcd_hand_job(
    ftrec: Ftrec,
    dir: &Path,
    data: &str,
    steps: u64,
    (endpoint, prefix): (&str, &str),
    extra: &[&str],
) -> (PathBuf, crate::etcd::JobKeys) {
    let prefix_set = format!("cluster.etcd_prefix=\"{prefix}\"");
    let mut args = vec!["--set", prefix_set.as_str()];
    args.extend(extra);
    let job = hand_job(ftrec, dir, data, "job", steps, &args);
    (job, crate::etcd::JobKeys::new(endpoint, prefix))
}
