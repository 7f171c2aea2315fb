//! `ftrec bench coordinator`: the coordinator in etcd (issue 22), measured with real
//! processes and a real etcd. Four experiments, each a `cluster run` of the binary:
//! - steady state: samples/s with etcd membership against embedded, rounds interleaved;
//! - failover: SIGKILL of the leader mid-run, to the first step settled under the next
//!   (and whether the run still ends at the uninterrupted digest);
//! - mid-rebuild: a server killed, then the leader killed while the replacement rebuilds;
//! - a 3-member etcd with one member SIGKILLed mid-run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::error::{BenchError, Result};
use crate::host::Host;
use crate::rounds::median_mid as median;

/// `ftrec bench coordinator`'s flags.
#[derive(Clone, Debug)]
pub struct CoordinatorOptions {
    /// Dataset directory (generated into `out/data` when `None`).
    pub data: Option<PathBuf>,
    pub steps: u64,
    pub servers: usize,
    pub workers: usize,
    /// Steady-state rounds (each runs embedded and etcd, interleaved).
    pub rounds: usize,
    /// Leader kills, one run each.
    pub trials: usize,
    /// The leader dies this long after training starts.
    pub kill_after: f64,
    /// An etcd to use; `None`: a fresh one on loopback in `out`.
    pub etcd: Option<Vec<String>>,
    pub no_etcd_cluster: bool,
    /// `--set KEY=VALUE` for every `cluster run`.
    pub overrides: Vec<String>,
    pub out: PathBuf,
}

struct Bench<'a> {
    host: &'a dyn Host,
    a: &'a CoordinatorOptions,
    exe: PathBuf,
    data: String,
    runs: usize,
}

impl Bench<'_> {
    /// One `cluster run --json` of the binary; its report.
    fn cluster_run(&mut self, name: &str, extra: &[String]) -> Result<Value> {
        self.runs += 1;
        let run_dir = self
            .a
            .out
            .join("runs")
            .join(format!("{:02}-{name}", self.runs));
        let mut args: Vec<String> = [
            "cluster",
            "run",
            "--data",
            &self.data,
            "--no-eval",
            "--json",
            "--time-limit",
            "600",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend([
            "--steps".into(),
            self.a.steps.to_string(),
            "--servers".into(),
            self.a.servers.to_string(),
            "--workers".into(),
            self.a.workers.to_string(),
            "--run-dir".into(),
            run_dir.display().to_string(),
        ]);
        for o in &self.a.overrides {
            args.extend(["--set".into(), o.clone()]);
        }
        args.extend(extra.iter().cloned());
        self.host.note(&format!("bench coordinator: {name}"));
        let out = Command::new(&self.exe)
            .args(&args)
            .output()
            .map_err(|source| BenchError::IoDuring {
                what: format!("running {}", self.exe.display()),
                source,
            })?;
        if !out.status.success() {
            return Err(BenchError::Failed(format!(
                "cluster run ({name}) failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        serde_json::from_slice(&out.stdout).map_err(|source| BenchError::Json {
            what: format!("{name}: not JSON"),
            source,
        })
    }
}

/// Runs the bench; its summary (the caller writes `summary.json`).
pub fn run(host: &dyn Host, a: &CoordinatorOptions) -> Result<Value> {
    std::fs::create_dir_all(&a.out).map_err(BenchError::file(&a.out))?;
    let exe = host.exe()?;
    let data = match &a.data {
        Some(d) => std::path::absolute(d)?,
        None => generate(&exe, &a.out)?,
    };
    // A fresh etcd per bench unless one is given; dropped (killed) at the end.
    let mut local = None;
    let endpoints = match &a.etcd {
        Some(e) => e.join(","),
        None => {
            let e = ftrec_etcd::local::start(&std::path::absolute(a.out.join("etcd"))?).map_err(
                |source| BenchError::Etcd {
                    what: "starting etcd (install Debian's etcd-server)",
                    source,
                },
            )?;
            let endpoint = e.endpoint.clone();
            local = Some(e);
            endpoint
        }
    };
    let mut b = Bench {
        host,
        a,
        exe,
        data: data.display().to_string(),
        runs: 0,
    };
    let etcd_args = |extra: &[&str]| -> Vec<String> {
        let mut v = vec!["--etcd".to_string(), endpoints.clone()];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let ec = ["--ft".to_string(), "ec".to_string()];

    // Steady state: embedded and etcd, interleaved, same cluster and data.
    let (mut embedded, mut in_etcd) = (Vec::new(), Vec::new());
    for round in 0..a.rounds {
        let r = b.cluster_run(&format!("steady-embedded-{round}"), &ec)?;
        embedded.push(r["samples_per_sec"].as_f64().unwrap_or(0.0));
        let mut extra = ec.to_vec();
        extra.extend(etcd_args(&[]));
        let r = b.cluster_run(&format!("steady-etcd-{round}"), &extra)?;
        in_etcd.push(r["samples_per_sec"].as_f64().unwrap_or(0.0));
    }
    let (me, mt) = (median(embedded.clone()), median(in_etcd.clone()));
    let steady = json!({
        "embedded_samples_per_sec": embedded,
        "etcd_samples_per_sec": in_etcd,
        "embedded_median": me,
        "etcd_median": mt,
        "etcd_over_embedded": me.zip(mt).map(|(e, t)| t / e),
    });

    // Failovers: deterministic, so each run is checked against the uninterrupted one.
    let mut det = ec.to_vec();
    det.push("--deterministic".into());
    let reference = b.cluster_run("reference", &det)?["state_digest"].clone();
    let mut kill_to_first_step = Vec::new();
    let mut failover_seconds = Vec::new();
    let mut exact = 0;
    let mut lease_ttl = None;
    for trial in 0..a.trials {
        let mut extra = det.clone();
        extra.extend(etcd_args(&[
            "--kill",
            &format!("coordinator@{}s", a.kill_after),
        ]));
        let r = b.cluster_run(&format!("failover-{trial}"), &extra)?;
        lease_ttl = r["lease_ttl_seconds"].as_f64();
        if r["state_digest"] == reference && r["lost_samples"] == 0 {
            exact += 1;
        }
        for k in r["coordinator_kills"].as_array().into_iter().flatten() {
            kill_to_first_step.extend(k["kill_to_first_step_seconds"].as_f64());
        }
        for f in r["coordinator_failovers"].as_array().into_iter().flatten() {
            failover_seconds.extend(f["failover_seconds"].as_f64());
        }
    }
    let failover = json!({
        "trials": a.trials,
        "kill_after_seconds": a.kill_after,
        "lease_ttl_seconds": lease_ttl,
        "kill_to_first_step_seconds": kill_to_first_step,
        "kill_to_first_step_median": median(kill_to_first_step.clone()),
        "kill_to_first_step_max": kill_to_first_step.iter().copied().reduce(f64::max),
        "goal_seconds": lease_ttl.map(|t| t + 1.0),
        "failover_seconds_median": median(failover_seconds),
        "exact_runs": exact,
    });

    // The leader dies while a replacement server rebuilds (throttled so it lasts).
    let mut extra = det.clone();
    extra.extend(etcd_args(&[
        "--kill",
        "server:1@1s",
        "--kill",
        "coordinator@rebuild",
        "--set",
        "ec.rebuild_bytes_per_sec=1000000",
    ]));
    let r = b.cluster_run("mid-rebuild", &extra)?;
    let mid_rebuild = json!({
        "exact": r["state_digest"] == reference && r["lost_samples"] == 0,
        "parity_mismatches": r["parity_mismatches"],
        "replica_mismatches": r["replica_mismatches"],
        "coordinator_kills": r["coordinator_kills"],
        "recoveries": r["recoveries"].as_array().map(|v| v.iter().map(|x| json!({
            "mode": x["mode"], "rebuild_seconds": x["rebuild_seconds"],
            "rebuild_bytes": x["rebuild_bytes"]})).collect::<Vec<_>>()),
    });

    let etcd_cluster = if a.no_etcd_cluster {
        Value::Null
    } else {
        three_members(&mut b, &det, &reference)?
    };
    drop(local);
    let summary = json!({
        "steps": a.steps,
        "servers": a.servers,
        "workers": a.workers,
        "rounds": a.rounds,
        "steady": steady,
        "failover": failover,
        "mid_rebuild": mid_rebuild,
        "etcd_member_killed": etcd_cluster,
    });
    Ok(summary)
}

/// A 3-member etcd, one member SIGKILLed mid-run: the run should not notice.
fn three_members(b: &mut Bench, det: &[String], reference: &Value) -> Result<Value> {
    let dir = std::path::absolute(b.a.out.join("etcd-3"))?;
    let _ = std::fs::remove_dir_all(&dir);
    let mut members =
        ftrec_etcd::local::start_cluster(&dir, 3).map_err(|source| BenchError::Etcd {
            what: "starting a 3-member etcd (install Debian's etcd-server)",
            source,
        })?;
    let endpoints: Vec<String> = members.iter().map(|m| m.endpoint.clone()).collect();
    let pid = members[0].pid();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        Command::new("kill").args(["-9", &pid.to_string()]).status()
    });
    let mut extra = det.to_vec();
    extra.extend(["--etcd".to_string(), endpoints.join(",")]);
    let r = b.cluster_run("etcd-member-killed", &extra);
    let _ = killer.join();
    members.clear();
    let r = r?;
    Ok(json!({
        "exact": &r["state_digest"] == reference && r["lost_samples"] == 0,
        "coordinator_failovers": r["coordinator_failovers"],
        "samples_per_sec": r["samples_per_sec"],
        "killed_member_after_seconds": 3,
    }))
}

/// 20000 generated rows in `out/data`.
fn generate(exe: &Path, out: &Path) -> Result<PathBuf> {
    let data = std::path::absolute(out.join("data"))?;
    if data.join("meta.json").exists() || data.is_dir() {
        return Ok(data);
    }
    let status = Command::new(exe)
        .args(["data", "gen", "--rows", "20000", "--seed", "2", "--out"])
        .arg(&data)
        .status()?;
    if !status.success() {
        return Err(BenchError::Failed("generating the dataset failed".into()));
    }
    Ok(data)
}
