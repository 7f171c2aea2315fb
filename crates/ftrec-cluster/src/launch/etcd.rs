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

use serde::{Deserialize, Serialize};

use ftrec_coordinator::{JobProgress, STATE_KEY, Spawner, sigkill};
use ftrec_proto::proto::Role;
use ftrec_rpc::PsError;
use ftrec_rpc::job::Job;

use super::spawner::LocalSpawner;
use super::{CoordinatorKill, KillAt, KillSpec, LaunchReport, Progress, io, kill};

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

/// One SIGKILL of the coordinator that led at the time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LeaderKill {
    pub coordinator: String,
    pub pid: u32,
    /// The term it led in.
    pub term: u64,
    pub killed_at_unix: f64,
    /// Fired while a server was rebuilding in the background (`coordinator@rebuild`).
    #[serde(default)]
    pub during_rebuild: bool,
    /// To the first step settled under the next leader (the takeover of a later term);
    /// none when no step settled after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kill_to_first_step_seconds: Option<f64>,
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Runs the job to the end; returns the finishing coordinator's report (a `cluster run`
/// report without an evaluation: the model stays with the servers), with each SIGKILL of
/// a leader in `coordinator_kills`.
pub fn run(opts: EtcdRunOptions, on_progress: impl Fn(&Progress)) -> Result<LaunchReport, PsError> {
    super::block_on(run_async(opts, on_progress))
}

async fn run_async(
    opts: EtcdRunOptions,
    on_progress: impl Fn(&Progress),
) -> Result<LaunchReport, PsError> {
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
) -> Result<LaunchReport, PsError> {
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
    let mut coordinator_kills: Vec<LeaderKill> = Vec::new();
    let mut training_start: Option<Instant> = None;
    let mut address = leader.address;
    loop {
        spawner.reap_exited();
        // A record this launcher cannot read (a newer leader's format, say) is read again
        // on the next turn; it never stops the run.
        let record = client
            .get_json::<JobProgress>(STATE_KEY)
            .await
            .ok()
            .flatten()
            .map(|(v, _)| v);
        if let Some(why) = record.as_ref().and_then(|r| r.fatal.as_deref()) {
            return Err(PsError::Fatal(format!(
                "{why}; logs in {}",
                run_dir.join("logs").display()
            )));
        }
        if let Some(r) = &record {
            if training_start.is_none() && r.started {
                training_start = Some(Instant::now());
            }
            if let Ok(Some((l, _))) = client.leader().await {
                address = l.address;
            }
            on_progress(&Progress {
                coordinator: address.clone(),
                coordinator_metrics: None,
                steps: r.settled_through,
                samples: r.samples_settled,
                epoch: r.epoch,
                seconds: started.elapsed().as_secs_f64(),
            });
        }
        let rebuilding = record.as_ref().is_some_and(|r| !r.rebuilding.is_empty());
        if rebuilding && during_rebuild > 0 {
            during_rebuild -= 1;
            if let Some(mut kill) = kill_leader(client).await? {
                kill.during_rebuild = true;
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
            } else if let Some(report) = job_report(&c.report)? {
                finished = Some((report, c.out.clone()));
                break;
            }
            // A standby that found the job done exits too: the leader reports.
        }
        if let Some((report, out)) = finished {
            return Ok(finish(report, &out, run_dir, coordinator_kills));
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

/// The report of a coordinator that exited successfully, if it is the job's: a standby
/// that found the job finished reports `already_done` and nothing of the model. Anything
/// else that does not read as a report is an error, not a run that never ends.
fn job_report(path: &Path) -> Result<Option<LaunchReport>, PsError> {
    #[derive(Deserialize)]
    struct AlreadyDone {
        already_done: bool,
    }
    let text = std::fs::read(path).map_err(io(path))?;
    match serde_json::from_slice::<LaunchReport>(&text) {
        Ok(report) => Ok(Some(report)),
        Err(_) if serde_json::from_slice::<AlreadyDone>(&text).is_ok_and(|d| d.already_done) => {
            Ok(None)
        }
        Err(e) => Err(PsError::Fatal(format!(
            "{}: not a coordinator report: {e}",
            path.display()
        ))),
    }
}

/// SIGKILLs the coordinator that leads now; what the report says of the kill.
async fn kill_leader(client: &ftrec_etcd::Etcd) -> Result<Option<LeaderKill>, PsError> {
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
    Ok(Some(LeaderKill {
        coordinator: leader.id,
        pid: leader.pid,
        // An etcd revision: never negative.
        term: u64::try_from(term).unwrap_or(0),
        killed_at_unix: at,
        during_rebuild: false,
        kill_to_first_step_seconds: None,
    }))
}

fn kill_member(record: Option<&JobProgress>, role: Role, id: usize) -> Result<(), PsError> {
    match record.and_then(|r| r.pid_of(role, id)) {
        Some(pid) => sigkill(pid).map_err(io(Path::new("kill"))),
        None => {
            tracing::warn!("{role:?} {id}: no process recorded yet; kill skipped");
            Ok(())
        }
    }
}

/// The finishing coordinator's report, with the run directory, its timeline copied where
/// `plot timeline` looks, and each leader kill's time to the first step settled after it.
fn finish(
    mut report: LaunchReport,
    out: &Path,
    run_dir: &Path,
    mut coordinator_kills: Vec<LeaderKill>,
) -> LaunchReport {
    let failovers = report
        .summary
        .coordinator_failovers
        .clone()
        .unwrap_or_default();
    for kill in &mut coordinator_kills {
        // The takeover that followed this kill: the first with a later term.
        let next = failovers
            .iter()
            .filter(|f| f.term > kill.term)
            .min_by_key(|f| f.term);
        kill.kill_to_first_step_seconds = next
            .and_then(|f| f.first_step_at_unix)
            .map(|first| first - kill.killed_at_unix);
    }
    report.coordinator_kills = coordinator_kills;
    report.run_dir = run_dir.to_path_buf();
    let timeline = out.join("timeline.json");
    if timeline.exists() {
        for name in ["timeline.json", "timeline.csv"] {
            let _ = std::fs::copy(out.join(name), run_dir.join(name));
        }
    }
    report
}
