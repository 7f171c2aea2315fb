//! `ftrec cluster run`: a whole cluster on this host. The launcher embeds the coordinator,
//! starts every server and worker as a separate `ftrec` process on loopback, injects
//! SIGKILLs on schedule, replaces dead servers with fresh processes, and at the end gathers
//! the model from the servers for its digest and evaluation.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ftrec_model::ModelState;
use serde::Serialize;

use ftrec_coordinator::{self as coordinator, CoordinatorOptions, RunSummary, Spawner, sigkill};
use ftrec_faults::{FaultAction, FaultSpec, points};
use ftrec_proto::PsError;
use ftrec_proto::job::Job;
use ftrec_proto::proto::Role;
use ftrec_proto::timeline::{EventKind, Subject};

/// When a `--kill` fires.
#[derive(Clone, Debug, PartialEq)]
pub enum KillAt {
    /// This long after training starts.
    After(Duration),
    /// As soon as the coordinator grants this global step (exact, for tests).
    Step(u64),
    /// The server kills itself at this fault point (armed in its registry, `ftrec-faults`).
    Point(FaultSpec),
}

/// `role:id@seconds` (`server:1@10s`) or `role:id@step:N` (`server:1@step:8`): SIGKILL
/// that process that long after training starts, or as soon as step N is granted.
#[derive(Clone, Debug, PartialEq)]
pub struct KillSpec {
    pub role: Role,
    pub id: usize,
    pub at: KillAt,
}

/// `prepare:N`, `commit:N` or `rebuild`: the points a `--kill` may name (a kill, not a
/// planted skip).
fn is_kill_point(when: &str) -> bool {
    FaultSpec::parse(when).is_ok_and(|spec| {
        spec.action == FaultAction::Kill
            && match spec.point.as_str() {
                points::REBUILD => spec.step.is_none(),
                points::PREPARE | points::COMMIT => spec.step.is_some(),
                _ => false,
            }
    })
}

impl std::str::FromStr for KillSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "--kill {s:?}: expected ROLE:ID@SECONDS, ROLE:ID@step:N or (servers of an \
                 erasure-coded run) ROLE:ID@prepare:N, @commit:N or @rebuild, e.g. server:1@10s, \
                 server:1@step:8 or server:1@commit:8"
            )
        };
        let (who, when) = s.split_once('@').ok_or_else(bad)?;
        let (role, id) = parse_member(who).map_err(|_| bad())?;
        let at = match when.strip_prefix("step:") {
            Some(step) => KillAt::Step(step.parse().map_err(|_| bad())?),
            None if is_kill_point(when) => {
                if role != Role::Server {
                    return Err(bad());
                }
                KillAt::Point(FaultSpec::parse(when).map_err(|_| bad())?)
            }
            None => {
                let secs: f64 = when.trim_end_matches('s').parse().map_err(|_| bad())?;
                if !(secs.is_finite() && secs >= 0.0) {
                    return Err(bad());
                }
                KillAt::After(Duration::from_secs_f64(secs))
            }
        };
        Ok(Self { role, id, at })
    }
}

/// `server:1` or `worker:0`.
pub fn parse_member(s: &str) -> Result<(Role, usize), String> {
    let (role, id) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected ROLE:ID, e.g. server:1"))?;
    let role = match role {
        "server" => Role::Server,
        "worker" => Role::Worker,
        other => return Err(format!("{s:?}: unknown role {other:?} (server or worker)")),
    };
    let id = id
        .parse()
        .map_err(|_| format!("{s:?}: {id:?} is not a process id number"))?;
    Ok((role, id))
}

pub struct LaunchOptions {
    pub job: Job,
    /// Where the job file, process logs and timeline go.
    pub run_dir: PathBuf,
    pub kills: Vec<KillSpec>,
    /// Spare servers started up front and handed a slot on a failure.
    pub spares: usize,
    /// The `ftrec` binary to start processes with.
    pub exe: PathBuf,
    /// Bound on the whole run.
    pub time_limit: Duration,
    /// Evaluates the final model (the caller's trainer on the test split, say); the
    /// cluster itself has no evaluation of its own to depend on.
    pub evaluate: Option<Evaluator>,
}

/// Metrics of the gathered final model, or why they could not be computed.
pub type Evaluator =
    Box<dyn FnOnce(&Job, ModelState) -> Result<ftrec_model::metrics::Metrics, String> + Send>;

/// Progress shown while the cluster trains.
#[derive(Clone, Debug)]
pub struct Progress {
    /// The embedded coordinator's address (for `ftrec cluster kill`).
    pub coordinator: String,
    /// Its Prometheus endpoint, `host:port`.
    pub coordinator_metrics: Option<String>,
    pub steps: u64,
    pub samples: u64,
    pub epoch: u64,
    pub seconds: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct LaunchReport {
    #[serde(flatten)]
    pub summary: RunSummary,
    pub state_digest: String,
    /// One per server, in server order: xxh3 of its shard (each table's local rows in
    /// order, then its dense range, their optimizer state and the dense step), so a test
    /// can tell which servers' state a recovery touched.
    pub shard_digests: Vec<String>,
    /// Erasure coding: stripes whose stored parity disagrees with their data rows, and
    /// dense replicas that differ from their primary, checked over everything at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parity_mismatches: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_mismatches: Option<u64>,
    pub servers: usize,
    pub workers: usize,
    /// From each SIGKILL to training resumed (detection included).
    pub kill_to_resume_seconds: Vec<f64>,
    pub auc: Option<f64>,
    pub logloss: Option<f64>,
    pub eval_samples: Option<usize>,
    pub run_dir: PathBuf,
    /// The caller removed the run directory after the run (a temporary one).
    pub run_dir_removed: bool,
}

/// Set in every child's environment: the launcher's pid, so the child dies with it.
pub const LAUNCHER_PID_ENV: &str = "FTREC_LAUNCHER_PID";

/// Called first thing by `ftrec server` and `ftrec worker`. When a launcher started this
/// process, the kernel SIGKILLs it as soon as the launcher dies, even by SIGKILL
/// (`PR_SET_PDEATHSIG`), so no server or worker lingers as an orphan. The launcher spawns
/// children only from threads that live as long as it does (its main thread and its
/// runtime's workers), since the signal follows the spawning thread's exit.
pub fn die_with_launcher() -> Result<(), PsError> {
    let Some(launcher) = std::env::var(LAUNCHER_PID_ENV)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    else {
        return Ok(());
    };
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL)).map_err(
        |e| PsError::Io {
            path: "prctl(PR_SET_PDEATHSIG)".into(),
            error: e.into(),
        },
    )?;
    // The launcher may have died before the call above: this process was then adopted.
    let parent = rustix::process::getppid().map(|p| p.as_raw_pid());
    if parent != Some(launcher) {
        return Err(PsError::Stopped(format!(
            "the launcher (pid {launcher}) is gone; not starting without it"
        )));
    }
    Ok(())
}

/// Child processes started by the launcher; every one is reaped or killed at the end.
struct LocalSpawner {
    exe: PathBuf,
    job_file: PathBuf,
    logs: PathBuf,
    children: Mutex<Vec<(String, Child)>>,
    /// Planned deaths not yet handed to a process, by server slot.
    faults: Mutex<Vec<(usize, FaultSpec)>>,
    /// Processes started per server slot so far.
    spawned: Mutex<Vec<usize>>,
}

impl LocalSpawner {
    /// The `--fault` flags of the next process of slot `id`: phase points go to its first
    /// process, a rebuild death to its first replacement (the process that rebuilds).
    fn faults_for(&self, id: usize) -> Vec<String> {
        let Ok(mut spawned) = self.spawned.lock() else {
            return Vec::new();
        };
        if spawned.len() <= id {
            spawned.resize(id + 1, 0);
        }
        let replacement = spawned[id] > 0;
        spawned[id] += 1;
        let Ok(mut faults) = self.faults.lock() else {
            return Vec::new();
        };
        let mut mine = Vec::new();
        faults.retain(|(slot, spec)| {
            let due = *slot == id && (spec.point == points::REBUILD) == replacement;
            if due {
                mine.extend(["--fault".to_string(), spec.to_string()]);
            }
            !due
        });
        mine
    }

    fn spawn(&self, name: String, args: &[String]) -> Result<(), PsError> {
        self.spawn_with(name, args, Vec::new())
    }

    fn spawn_with(
        &self,
        name: String,
        args: &[String],
        faults: Vec<String>,
    ) -> Result<(), PsError> {
        let n = self.children.lock().map_or(0, |c| c.len());
        let log_path = self.logs.join(format!("{name}-{n}.log"));
        let log = std::fs::File::create(&log_path).map_err(|error| PsError::Io {
            path: log_path.display().to_string(),
            error,
        })?;
        let err_log = log.try_clone().map_err(|error| PsError::Io {
            path: log_path.display().to_string(),
            error,
        })?;
        let child = Command::new(&self.exe)
            .args(args)
            .args(faults)
            .env(LAUNCHER_PID_ENV, std::process::id().to_string())
            .env(
                "FTREC_LOG",
                std::env::var("FTREC_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .spawn()
            .map_err(|error| PsError::Io {
                path: self.exe.display().to_string(),
                error,
            })?;
        if let Ok(mut c) = self.children.lock() {
            c.push((name, child));
        }
        Ok(())
    }

    fn base_args(&self, role: &str, coordinator: &str) -> Vec<String> {
        vec![
            role.to_string(),
            "--job".into(),
            self.job_file.display().to_string(),
            "--coordinator".into(),
            coordinator.to_string(),
        ]
    }

    /// Reaps the children that have exited, so a killed one does not linger as a zombie
    /// (whose pid would still look alive to the checkpoint leases it held).
    fn reap_exited(&self) {
        if let Ok(mut children) = self.children.lock() {
            for (_, child) in children.iter_mut() {
                let _ = child.try_wait();
            }
        }
    }

    /// Waits up to `grace` for every child to exit, then SIGKILLs the rest.
    fn reap(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        let Ok(mut children) = self.children.lock() else {
            return;
        };
        for (name, child) in children.iter_mut() {
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        tracing::warn!("{name} did not exit; killing it");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
    }
}

impl Spawner for LocalSpawner {
    fn spawn_server(&self, id: usize, coordinator: &str) -> Result<(), PsError> {
        let mut args = self.base_args("server", coordinator);
        args.extend(["--id".into(), id.to_string()]);
        self.spawn_with(format!("server-{id}"), &args, self.faults_for(id))
    }

    fn spawn_worker(&self, id: usize, coordinator: &str) -> Result<(), PsError> {
        let mut args = self.base_args("worker", coordinator);
        args.extend(["--id".into(), id.to_string()]);
        self.spawn(format!("worker-{id}"), &args)
    }
}

impl LocalSpawner {
    fn spawn_spare(&self, n: usize, coordinator: &str) -> Result<(), PsError> {
        let mut args = self.base_args("server", coordinator);
        args.push("--spare".into());
        self.spawn(format!("spare-{n}"), &args)
    }
}

/// A fresh run directory for a cluster the user gave no `--run-dir`: `parent/prefix-<128
/// random bits>`, created by this call (never an existing path) and private (0700).
///
/// It holds the job secret and job file. A predictable name under a shared `/tmp` could be
/// created first by another user, who would then own the directory, read the secret and
/// join the cluster; so the name is unguessable and an existing path is never reused, even
/// our own (a clash means the name is not random enough to trust, or someone guessed it).
pub fn private_run_dir(parent: &Path, prefix: &str) -> Result<PathBuf, PsError> {
    use rand::RngCore;
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    const TRIES: usize = 4;
    for _ in 0..TRIES {
        let mut bytes = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        let suffix: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let dir = parent.join(format!("{prefix}-{suffix}"));
        // create_dir (not _all) fails on any existing path, a symlink included: the
        // directory is ours because this call made it. The umask can only remove bits.
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let owner = std::fs::symlink_metadata(&dir).map(|m| m.uid()).ok();
                tracing::warn!(
                    "{} already exists (owner uid {owner:?}): not reusing it",
                    dir.display()
                );
                continue;
            }
            Err(e) => return Err(io(&dir)(e)),
        }
        // Exactly 0700 whatever the umask left (a umask of 0277 would make it unwritable).
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(io(&dir))?;
        let meta = std::fs::symlink_metadata(&dir).map_err(io(&dir))?;
        if !meta.is_dir() || meta.uid() != rustix::process::geteuid().as_raw() {
            return Err(PsError::Config(format!(
                "{}: the run directory just created is not a directory owned by this user",
                dir.display()
            )));
        }
        return Ok(dir);
    }
    Err(PsError::Config(format!(
        "{}: {TRIES} random run-directory names under it already existed; pass --run-dir DIR",
        parent.display()
    )))
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> PsError + '_ {
    move |error| PsError::Io {
        path: path.display().to_string(),
        error,
    }
}

/// Runs the cluster to the end and reports. `on_progress` is called a few times a second.
pub fn run(opts: LaunchOptions, on_progress: impl Fn(&Progress)) -> Result<LaunchReport, PsError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io(Path::new("tokio runtime")))?;
    rt.block_on(run_async(opts, on_progress))
}

async fn run_async(
    opts: LaunchOptions,
    on_progress: impl Fn(&Progress),
) -> Result<LaunchReport, PsError> {
    let job = opts.job;
    let run_dir = opts.run_dir;
    let evaluator = opts.evaluate;
    for k in &opts.kills {
        let (what, count) = match k.role {
            Role::Server => ("servers", job.config.cluster.servers),
            _ => ("workers", job.config.cluster.workers),
        };
        if k.id >= count {
            return Err(PsError::Config(format!(
                "--kill names {} {}, but the cluster has {count} {what} (0..={})",
                &what[..what.len() - 1],
                k.id,
                count.saturating_sub(1)
            )));
        }
    }
    let logs = run_dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(io(&logs))?;
    let job_file = run_dir.join("job.toml");
    job.save(&job_file)?;
    let cluster = job.config.cluster.clone();
    let spawner = Arc::new(LocalSpawner {
        exe: opts.exe,
        job_file,
        logs,
        children: Mutex::new(Vec::new()),
        faults: Mutex::new(
            opts.kills
                .iter()
                .filter_map(|k| match &k.at {
                    KillAt::Point(p) => Some((k.id, p.clone())),
                    _ => None,
                })
                .collect(),
        ),
        spawned: Mutex::new(Vec::new()),
    });
    let mut handle = coordinator::start(CoordinatorOptions {
        job: job.clone(),
        host: "127.0.0.1".into(),
        port: 0,
        spawner: Some(spawner.clone()),
    })
    .await?;
    let shared = handle.shared.clone();
    let address = shared.address().to_string();
    let result = async {
        for id in 0..cluster.servers {
            spawner.spawn_server(id, &address)?;
        }
        for n in 0..opts.spares {
            spawner.spawn_spare(n, &address)?;
        }
        for id in 0..cluster.workers {
            spawner.spawn_worker(id, &address)?;
        }
        let started = Instant::now();
        let mut stop_signals = StopSignals::new()?;
        let mut kills = Vec::new();
        for k in &opts.kills {
            match k.at {
                KillAt::After(after) => kills.push((after, k.role, k.id)),
                KillAt::Step(step) => shared.kill_at_step(k.role, k.id, step),
                KillAt::Point(_) => {}
            }
        }
        kills.sort_by_key(|k| k.0);
        let mut kill_times = Vec::new();
        let mut training_start: Option<Instant> = None;
        loop {
            spawner.reap_exited();
            let summary = shared.summary();
            // The event log is copied only until training has started.
            if training_start.is_none()
                && shared
                    .timeline()
                    .events
                    .iter()
                    .any(|e| e.kind == EventKind::TrainingStart)
            {
                training_start = Some(Instant::now());
            }
            on_progress(&Progress {
                coordinator: address.clone(),
                coordinator_metrics: handle.metrics_address.clone(),
                steps: summary.steps,
                samples: summary.samples,
                epoch: summary.epoch,
                seconds: started.elapsed().as_secs_f64(),
            });
            if let Some(t0) = training_start {
                while kills.first().is_some_and(|k| t0.elapsed() >= k.0) {
                    let (_, role, id) = kills.remove(0);
                    match shared.pid_of(role, id) {
                        Some(pid) => {
                            sigkill(pid).map_err(io(Path::new("kill")))?;
                            let t = shared.event_about(
                                EventKind::Killed,
                                coordinator::subject(role, id),
                                None,
                                format!(
                                    "{} {id} (pid {pid}) by SIGKILL",
                                    coordinator::role_name(role)
                                ),
                            );
                            kill_times.push(t);
                        }
                        None => {
                            let who = coordinator::role_name(role);
                            shared.event(EventKind::KillSkipped, format!("{who} {id}: no such process"));
                        }
                    }
                }
            }
            let waited = tokio::select! {
                waited = handle.wait_done(Duration::from_millis(200)) => waited,
                signal = stop_signals.recv() => {
                    shared.event(EventKind::Interrupted, format!("{signal}: stopping every process"));
                    return Err(PsError::Stopped(format!(
                        "by {signal}; timeline and logs in {}",
                        run_dir.display()
                    )));
                }
            };
            match waited {
                Ok(()) => break,
                Err(PsError::Timeout(_)) => {}
                Err(e) => {
                    return Err(PsError::Fatal(format!(
                        "{e}; logs in {}",
                        run_dir.join("logs").display()
                    )));
                }
            }
            if started.elapsed() > opts.time_limit {
                return Err(PsError::Timeout(format!(
                    "the cluster did not finish within {:?}; logs in {}",
                    opts.time_limit,
                    run_dir.display()
                )));
            }
        }
        let mut summary = shared.summary();
        let timeline = shared.timeline();
        // Each recovery's own SIGKILL to resume: the last kill of its server before the
        // failure was detected.
        for r in &mut summary.recoveries {
            let server = Some(Subject::Server(r.server as u32));
            r.kill_to_resume_seconds = timeline
                .of(EventKind::Killed)
                .filter(|e| e.subject == server && e.t <= r.detected_at)
                .map(|e| e.t)
                .fold(None, |last: Option<f64>, t| {
                    Some(last.map_or(t, |l| l.max(t)))
                })
                .map(|killed| r.resumed_at - killed);
        }
        kill_times.extend(
            timeline
                .of(EventKind::Killed)
                .filter(|e| e.step.is_some())
                .map(|e| e.t),
        );
        let kill_to_resume: Vec<f64> = kill_times
            .iter()
            .filter_map(|&k| {
                timeline
                    .of(EventKind::RecoveryEnd)
                    .find(|e| e.t >= k)
                    .map(|e| e.t - k)
            })
            .collect();
        let epoch = shared.summary().epoch;
        let addresses = shared.server_addresses();
        let (state, shard_digests) =
            ftrec_proto::gather::gather_state(&job, &addresses, epoch).await?;
        let (mut parity_mismatches, mut replica_mismatches) = (None, None);
        if job.config.cluster.ft.erasure_coded() {
            let report =
                crate::parity_check::verify_parity(&job, &addresses, epoch, &state).await?;
            parity_mismatches = Some(report.mismatches);
            replica_mismatches = Some(report.replica_mismatches);
        }
        let digest = state.digest().to_string();
        let (mut auc, mut logloss, mut eval_samples) = (None, None, None);
        if let Some(evaluate) = evaluator {
            let metrics = evaluate(&job, state).map_err(PsError::Fatal)?;
            auc = Some(metrics.auc);
            logloss = Some(metrics.logloss);
            eval_samples = Some(metrics.samples);
        }
        Ok(LaunchReport {
            summary,
            state_digest: digest,
            shard_digests,
            parity_mismatches,
            replica_mismatches,
            servers: cluster.servers,
            workers: cluster.workers,
            kill_to_resume_seconds: kill_to_resume,
            auc,
            logloss,
            eval_samples,
            run_dir: run_dir.clone(),
            run_dir_removed: false,
        })
    }
    .await;
    shared.stop();
    let reaper = spawner.clone();
    let grace = Duration::from_millis(cluster.failure_timeout_ms * 5).max(Duration::from_secs(3));
    let _ = tokio::task::spawn_blocking(move || reaper.reap(grace)).await;
    // Written on every way out (success, error, time limit, signal): the record of what
    // happened is most wanted when the run did not finish.
    let written = shared.timeline().write(&run_dir);
    match (result, written) {
        (Ok(report), Ok(())) => Ok(report),
        (Ok(_), Err(e)) => Err(e),
        (Err(e), written) => {
            if let Err(w) = written {
                tracing::warn!("writing the timeline: {w}");
            }
            Err(e)
        }
    }
}

/// SIGTERM and SIGINT, which stop the run cleanly (children stopped, timeline written)
/// instead of killing the launcher outright.
struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn new() -> Result<Self, PsError> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).map_err(io(Path::new("SIGTERM handler")))?,
            int: signal(SignalKind::interrupt()).map_err(io(Path::new("SIGINT handler")))?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn default_run_directories_are_fresh_unguessable_and_private() {
        let parent = tempfile::tempdir().unwrap();
        let a = private_run_dir(parent.path(), "ftrec-cluster").unwrap();
        let b = private_run_dir(parent.path(), "ftrec-cluster").unwrap();
        assert_ne!(a, b);
        for dir in [&a, &b] {
            assert_eq!(dir.parent(), Some(parent.path()));
            let name = dir.file_name().unwrap().to_str().unwrap();
            let suffix = name.strip_prefix("ftrec-cluster-").unwrap();
            // 128 random bits, not a pid and a clock.
            assert_eq!(suffix.len(), 32, "{name}");
            assert!(suffix.bytes().all(|c| c.is_ascii_hexdigit()), "{name}");
            let meta = std::fs::symlink_metadata(dir).unwrap();
            assert!(meta.is_dir());
            assert_eq!(meta.permissions().mode() & 0o777, 0o700, "{name}");
        }
        // A parent that cannot hold it is an error naming the path, not a panic.
        let file = parent.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let e = private_run_dir(&file, "ftrec-cluster")
            .unwrap_err()
            .to_string();
        assert!(e.contains("file/ftrec-cluster-"), "{e}");
    }
}
