//! `cluster run --etcd URL --coordinators N`: the coordinators run as processes of their
//! own, one elected leader and N-1 standbys, with the job's state in etcd. The launcher
//! starts them, the servers and the workers (all finding the leader through etcd), fires
//! the timed kills (`coordinator@T` SIGKILLs whichever coordinator leads at T), starts a
//! new standby for each coordinator that dies, and at the end takes the report of the
//! coordinator that finished the job: it gathered the model and checked the parity itself,
//! while the servers still served.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use ftrec_coordinator::{Spawner, sigkill};
use ftrec_proto::proto::Role;
use ftrec_rpc::PsError;
use ftrec_rpc::job::Job;

use super::spawner::LocalSpawner;
use super::{CoordinatorKill, KillAt, KillSpec, Progress, io, kill};

/// What `--etcd` adds to a launch.
#[derive(Clone, Debug)]
pub struct EtcdLaunch {
    pub endpoints: Vec<String>,
    /// Coordinator processes kept running: one leads, the rest stand by.
    pub coordinators: usize,
    /// `--kill coordinator@...`: SIGKILL the leader.
    pub coordinator_kills: Vec<CoordinatorKill>,
    /// `--save`: every coordinator is told the file; the one that ends the job writes it.
    pub save: Option<PathBuf>,
}

pub struct EtcdRunOptions {
    pub job: Job,
    pub run_dir: PathBuf,
    pub kills: Vec<KillSpec>,
    pub exe: PathBuf,
    pub time_limit: Duration,
    pub etcd: EtcdLaunch,
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Runs the job to the end; returns the finishing coordinator's report (the keys of a
/// `cluster run --json` report), with `coordinator_kills` (each SIGKILL of a leader, with
/// the time to the first step settled under the next one) added.
pub fn run(opts: EtcdRunOptions, on_progress: impl Fn(&Progress)) -> Result<Value, PsError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io(Path::new("tokio runtime")))?;
    rt.block_on(run_async(opts, on_progress))
}

async fn run_async(
    opts: EtcdRunOptions,
    on_progress: impl Fn(&Progress),
) -> Result<Value, PsError> {
    let EtcdRunOptions {
        job,
        run_dir,
        kills,
        exe,
        time_limit,
        etcd,
    } = opts;
    let job = job.with_etcd(etcd.endpoints.clone());
    kill::check_members(&job, &kills, &[])?;
    if kills.iter().any(|k| !matches!(k.at, KillAt::After(_))) {
        return Err(PsError::Config(
            "with --etcd, --kill takes ROLE:ID@SECONDS or coordinator@SECONDS (step and fault \
             points are fired by an embedded coordinator)"
                .into(),
        ));
    }
    let logs = run_dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(io(&logs))?;
    let job_file = run_dir.join("job.toml");
    job.save(&job_file)?;
    let Some(etcd_options) = job.etcd_options() else {
        return Err(PsError::Internal("etcd options of an etcd job".into()));
    };
    let client = ftrec_etcd::Etcd::connect(&etcd_options).await?;
    client.claim_job(&job.etcd_claim()).await?;
    let spawner = LocalSpawner {
        exe,
        job_file,
        logs,
        children: Mutex::new(Vec::new()),
        faults: Mutex::new(Vec::new()),
        spawned: Mutex::new(Vec::new()),
        etcd: Some(etcd.endpoints.join(",")),
        tied: true,
    };
    let result = supervise(
        &job,
        &client,
        &spawner,
        &run_dir,
        &kills,
        &etcd,
        time_limit,
        &on_progress,
    )
    .await;
    let grace = Duration::from_millis(job.config.cluster.failure_timeout_ms * 5)
        .max(Duration::from_secs(3));
    spawner.reap(grace);
    result
}

/// A coordinator process the launcher started: its name, and where its report goes.
struct Coordinator {
    name: String,
    report: PathBuf,
    out: PathBuf,
}

#[allow(clippy::too_many_arguments)]
async fn supervise(
    job: &Job,
    client: &ftrec_etcd::Etcd,
    spawner: &LocalSpawner,
    run_dir: &Path,
    kills: &[KillSpec],
    etcd: &EtcdLaunch,
    time_limit: Duration,
    on_progress: &impl Fn(&Progress),
) -> Result<Value, PsError> {
    let started = Instant::now();
    let mut coordinators: Vec<Coordinator> = Vec::new();
    let start_coordinator = |coordinators: &mut Vec<Coordinator>, standby: bool| {
        let name = format!("coordinator-{}", coordinators.len());
        let out = run_dir.join(&name);
        let report = run_dir.join(format!("{name}.json"));
        spawner.spawn_coordinator(&name, standby, &out, &report, etcd.save.as_deref())?;
        coordinators.push(Coordinator { name, report, out });
        Ok::<_, PsError>(())
    };
    start_coordinator(&mut coordinators, false)?;
    // The first leads before anyone else starts, so the members find it at once.
    let leader = loop {
        if let Some((leader, _)) = client.leader().await? {
            break leader;
        }
        if let Some(status) = spawner.exit_status(&coordinators[0].name) {
            return Err(PsError::Fatal(format!(
                "the first coordinator exited ({status}) before leading; its log is in {}",
                run_dir.join("logs").display()
            )));
        }
        if started.elapsed() > Duration::from_secs(30) {
            return Err(PsError::Timeout(
                "no coordinator led the job within 30 s".into(),
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for _ in 1..etcd.coordinators.max(1) {
        start_coordinator(&mut coordinators, true)?;
    }
    let cluster = &job.config.cluster;
    for id in 0..cluster.servers {
        spawner.spawn_server(id, "")?;
    }
    for id in 0..cluster.workers {
        spawner.spawn_worker(id, "")?;
    }
    let mut timed: Vec<(Duration, Option<(Role, usize)>)> = kills
        .iter()
        .filter_map(|k| match k.at {
            KillAt::After(t) => Some((t, Some((k.role, k.id)))),
            _ => None,
        })
        .chain(etcd.coordinator_kills.iter().filter_map(|k| match k {
            CoordinatorKill::After(t) => Some((*t, None)),
            CoordinatorKill::DuringRebuild => None,
        }))
        .collect();
    timed.sort_by_key(|k| k.0);
    let mut during_rebuild = etcd
        .coordinator_kills
        .iter()
        .filter(|k| **k == CoordinatorKill::DuringRebuild)
        .count();
    let mut coordinator_kills: Vec<Value> = Vec::new();
    let mut training_start: Option<Instant> = None;
    let mut address = leader.address;
    loop {
        spawner.reap_exited();
        let record = client
            .get_json::<Value>("state")
            .await
            .ok()
            .flatten()
            .map(|(v, _)| v);
        if let Some(why) = record.as_ref().and_then(|r| r["fatal"].as_str()) {
            return Err(PsError::Fatal(format!(
                "{why}; logs in {}",
                run_dir.join("logs").display()
            )));
        }
        if let Some(r) = &record {
            if training_start.is_none() && r["started"].as_bool() == Some(true) {
                training_start = Some(Instant::now());
            }
            if let Ok(Some((l, _))) = client.leader().await {
                address = l.address;
            }
            on_progress(&Progress {
                coordinator: address.clone(),
                coordinator_metrics: None,
                steps: r["settled_through"].as_u64().unwrap_or(0),
                samples: r["samples_settled"].as_u64().unwrap_or(0),
                epoch: r["epoch"].as_u64().unwrap_or(0),
                seconds: started.elapsed().as_secs_f64(),
            });
        }
        let rebuilding = record
            .as_ref()
            .and_then(|r| r["rebuilding"].as_array())
            .is_some_and(|r| !r.is_empty());
        if rebuilding && during_rebuild > 0 {
            during_rebuild -= 1;
            if let Some(mut kill) = kill_leader(client).await? {
                kill["during_rebuild"] = json!(true);
                coordinator_kills.push(kill);
            }
        }
        if let Some(t0) = training_start {
            while timed.first().is_some_and(|k| t0.elapsed() >= k.0) {
                let (_, who) = timed.remove(0);
                match who {
                    None => {
                        if let Some(kill) = kill_leader(client).await? {
                            coordinator_kills.push(kill);
                        }
                    }
                    Some((role, id)) => kill_member(record.as_ref(), role, id)?,
                }
            }
        }
        // A coordinator that exited: the job's report if it finished the job, else a
        // new standby takes its place.
        let mut finished = None;
        let mut dead = 0usize;
        for c in &coordinators {
            let Some(status) = spawner.exit_status(&c.name) else {
                continue;
            };
            if !status.success() {
                dead += 1;
            } else if has_digest(&c.report) {
                finished = Some((c.report.clone(), c.out.clone()));
                break;
            }
            // A standby that found the job done exits too: the leader reports.
        }
        if let Some((report, out)) = finished {
            return finish(&report, &out, run_dir, coordinator_kills);
        }
        // Deaths beyond the planned kills and a few more are a crash loop: say so rather
        // than start coordinators until the time limit.
        if dead > coordinator_kills.len() + 2 * etcd.coordinators.max(1) {
            return Err(PsError::Fatal(format!(
                "{dead} coordinators died ({} of them killed on purpose); see their logs in {}",
                coordinator_kills.len(),
                run_dir.join("logs").display()
            )));
        }
        let live = coordinators.len() - dead;
        for _ in live..etcd.coordinators.max(1) {
            start_coordinator(&mut coordinators, true)?;
        }
        if started.elapsed() > time_limit {
            return Err(PsError::Timeout(format!(
                "the cluster did not finish within {time_limit:?}; logs in {}",
                run_dir.join("logs").display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether a coordinator's report is the job's (a standby that found the job finished
/// reports nothing of the model).
fn has_digest(report: &Path) -> bool {
    std::fs::read(report)
        .ok()
        .and_then(|t| serde_json::from_slice::<Value>(&t).ok())
        .is_some_and(|v| v["state_digest"].is_string())
}

/// SIGKILLs the coordinator that leads now; what the report says of the kill.
async fn kill_leader(client: &ftrec_etcd::Etcd) -> Result<Option<Value>, PsError> {
    let Some((leader, term)) = client.leader().await? else {
        tracing::warn!("coordinator kill: no coordinator leads right now; skipped");
        return Ok(None);
    };
    let at = unix_now();
    sigkill(leader.pid).map_err(io(Path::new("kill")))?;
    tracing::info!(
        "killed coordinator {} (pid {}) by SIGKILL",
        leader.id,
        leader.pid
    );
    Ok(Some(json!({
        "coordinator": leader.id,
        "pid": leader.pid,
        "term": term,
        "killed_at_unix": at,
    })))
}

fn kill_member(record: Option<&Value>, role: Role, id: usize) -> Result<(), PsError> {
    let slots = match role {
        Role::Server => "servers",
        _ => "workers",
    };
    let pid = record
        .and_then(|r| r[slots][id]["pid"].as_u64())
        .filter(|&p| p != 0);
    match pid {
        Some(pid) => sigkill(pid as u32).map_err(io(Path::new("kill"))),
        None => {
            tracing::warn!("{slots} {id}: no process recorded yet; kill skipped");
            Ok(())
        }
    }
}

/// The finishing coordinator's report, with the run directory, its timeline copied where
/// `plot timeline` looks, and each leader kill's time to the first step settled after it.
fn finish(
    report: &Path,
    out: &Path,
    run_dir: &Path,
    mut coordinator_kills: Vec<Value>,
) -> Result<Value, PsError> {
    let text = std::fs::read(report).map_err(io(report))?;
    let mut v: Value = serde_json::from_slice(&text).map_err(|e| {
        PsError::Fatal(format!(
            "{}: not a coordinator report: {e}",
            report.display()
        ))
    })?;
    let failovers = v["coordinator_failovers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for kill in &mut coordinator_kills {
        let term = kill["term"].as_u64().unwrap_or(0);
        let at = kill["killed_at_unix"].as_f64().unwrap_or(0.0);
        // The takeover that followed this kill: the first with a later term.
        let next = failovers
            .iter()
            .filter(|f| f["term"].as_u64().unwrap_or(0) > term)
            .min_by_key(|f| f["term"].as_u64().unwrap_or(0));
        if let Some(first) = next.and_then(|f| f["first_step_at_unix"].as_f64()) {
            kill["kill_to_first_step_seconds"] = json!(first - at);
        }
    }
    v["coordinator_kills"] = json!(coordinator_kills);
    v["run_dir"] = json!(run_dir);
    let timeline = out.join("timeline.json");
    if timeline.exists() {
        for name in ["timeline.json", "timeline.csv"] {
            let _ = std::fs::copy(out.join(name), run_dir.join(name));
        }
    }
    Ok(v)
}
