//! `ftrec cluster run`: a whole cluster on this host. The launcher embeds the coordinator,
//! starts every server and worker as a separate `ftrec` process on loopback, injects
//! SIGKILLs on schedule, replaces dead servers with fresh processes, and at the end gathers
//! the model from the servers for its digest and evaluation.

mod cpu;
pub mod etcd;
mod kill;
mod report;
mod rss;
mod run_dir;
mod spawner;

pub use cpu::CpuWindow;
pub use kill::{CoordinatorKill, KillAt, KillSpec, coordinator_kill, parse_member};
pub use report::{check_save_path, final_report};
pub use run_dir::private_run_dir;
use spawner::LocalSpawner;
pub use spawner::{LAUNCHER_PID_ENV, die_with_launcher, replacement_spawner};

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ftrec_model::ModelState;
use serde::{Deserialize, Serialize};

use ftrec_coordinator::{self as coordinator, CoordinatorOptions, RunSummary, Spawner, sigkill};
use ftrec_proto::proto::Role;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::PsError;
use ftrec_rpc::job::Job;

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
    /// `--save`: the final model goes to this snapshot file (`.ftm`, as `train --save`
    /// writes), gathered once the last step committed.
    pub save: Option<PathBuf>,
    /// The cut `cluster.resume_from` names, resolved and checked ([`crate::resume`]).
    pub resume: Option<ftrec_proto::proto::ResumePoint>,
    /// `--scale-at STEP:SERVERS`: the job asks to move to `SERVERS` servers once step
    /// `STEP` is reached (as `ftrec cluster scale` would, at an exact point).
    pub scale_at: Vec<(u64, usize)>,
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

/// What a launch reports (`cluster run --json`). A coordinator process writes the same
/// report (`ftrec coordinator --json`), and the `--etcd` launcher reads the finishing
/// coordinator's back.
#[derive(Clone, Debug, Serialize, Deserialize)]
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
    /// Erasure coding: each mismatch of the end-of-run check named (the first
    /// `parity_check::MAX_DETAILS`), empty when the parity is right.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parity_mismatch_details: Option<Vec<crate::parity_check::Mismatch>>,
    pub servers: usize,
    pub workers: usize,
    /// From each SIGKILL to training resumed (detection included).
    pub kill_to_resume_seconds: Vec<f64>,
    /// Per server slot, the largest peak resident set (`VmHWM`) of the processes that
    /// held it, read from `/proc` while the run went on (null where none could be read).
    pub server_peak_rss_bytes: Vec<Option<u64>>,
    /// The largest peak resident set of a spare while it waited for a slot (null without
    /// spares): a spare's memory reserve (`ec.spare_reserve`) is paid here, before any
    /// failure.
    pub waiting_spare_peak_rss_bytes: Option<u64>,
    /// Every job process's CPU time (`/proc`, summed: the servers, a promoted spare from
    /// its promotion, the workers, and this launcher with its coordinator) while training
    /// ran, and in each recovery's background rebuild (from the resume to full
    /// redundancy; null for a recovery with none). A rebuild's cost is what it adds to
    /// all of them: the replacement decodes, the survivors send, and the workers' steps
    /// wait or go degraded meanwhile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_training: Option<cpu::CpuWindow>,
    pub cpu_rebuilds: Vec<Option<cpu::CpuWindow>>,
    pub auc: Option<f64>,
    pub logloss: Option<f64>,
    pub eval_samples: Option<usize>,
    /// `--save`: the snapshot file the final model was written to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saved_model: Option<PathBuf>,
    pub run_dir: PathBuf,
    /// The caller removed the run directory after the run (a temporary one).
    #[serde(default)]
    pub run_dir_removed: bool,
    /// `--etcd`: each SIGKILL of the leading coordinator (empty without).
    #[serde(default)]
    pub coordinator_kills: Vec<etcd::LeaderKill>,
}

pub(crate) fn io(path: &Path) -> impl Fn(std::io::Error) -> PsError + '_ {
    move |error| PsError::Io {
        path: path.display().to_string(),
        error,
    }
}

/// Runs the cluster to the end and reports. `on_progress` is called a few times a second.
pub fn run(opts: LaunchOptions, on_progress: impl Fn(&Progress)) -> Result<LaunchReport, PsError> {
    block_on(run_async(opts, on_progress))
}

/// A launcher's own runtime: two threads are enough to supervise the processes.
fn block_on<T>(launch: impl Future<Output = Result<T, PsError>>) -> Result<T, PsError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io(Path::new("tokio runtime")))?
        .block_on(launch)
}

async fn run_async(
    opts: LaunchOptions,
    on_progress: impl Fn(&Progress),
) -> Result<LaunchReport, PsError> {
    let LaunchOptions {
        job,
        run_dir,
        kills,
        spares,
        exe,
        time_limit,
        evaluate,
        save,
        resume,
        scale_at,
    } = opts;
    kill::check_members(&job, &kills, &scale_at)?;
    let logs = run_dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(io(&logs))?;
    let job_file = run_dir.join("job.toml");
    job.save(&job_file)?;
    let cluster = job.config.cluster.clone();
    let spawner = Arc::new(LocalSpawner {
        exe,
        job_file,
        logs,
        children: Mutex::new(Vec::new()),
        faults: Mutex::new(kill::fault_points(&kills)),
        spawned: Mutex::new(Vec::new()),
        etcd: None,
        tied: true,
    });
    let mut handle = coordinator::start(CoordinatorOptions {
        job: job.clone(),
        host: "127.0.0.1".into(),
        port: 0,
        spawner: Some(spawner.clone()),
        standby: false,
        id: None,
        faults: Default::default(),
        resume,
    })
    .await?;
    let shared = handle.shared.clone();
    let result = async {
        let address = shared.address().to_string();
        for id in 0..cluster.servers {
            spawner.spawn_server(id, &address)?;
        }
        for n in 0..spares {
            spawner.spawn_spare(n, &address)?;
        }
        for id in 0..cluster.workers {
            spawner.spawn_worker(id, &address)?;
        }
        let supervised = Supervised {
            spawner: &spawner,
            kills: &kills,
            scale_at: &scale_at,
            time_limit,
            run_dir: &run_dir,
        };
        let mut peaks = rss::PeakRss::new(cluster.servers);
        let cpu = Arc::new(Mutex::new(cpu::CpuSeries::default()));
        let sampler = tokio::spawn(sample_job_cpu(
            shared.clone(),
            (cluster.servers, cluster.workers),
            cpu.clone(),
        ));
        let kill_times = supervised.run(&mut handle, &on_progress, &mut peaks).await;
        sampler.abort();
        // A last sample after training ended, so that the training window is covered.
        let pids = job_pids(&shared, cluster.servers, cluster.workers);
        cpu.lock()
            .unwrap_or_else(|p| p.into_inner())
            .sample(shared.now(), pids);
        let kill_times = kill_times?;
        let mut report = report::final_report(
            &job,
            &shared,
            kill_times,
            evaluate,
            &run_dir,
            save.as_deref(),
        )
        .await?;
        // The servers still serve: gathering the model for the report is part of the run.
        peaks.sample(|role, id| shared.pid_of(role, id));
        peaks.sample_spares(&shared.waiting_spare_pids());
        report.server_peak_rss_bytes = peaks.per_server();
        // The launcher's own reads, and what the spares said of themselves: one given a
        // slot within a tick of its join was never read here while it waited.
        report.waiting_spare_peak_rss_bytes =
            peaks.waiting_spare().max(shared.waiting_spare_peak());
        let cpu = cpu.lock().unwrap_or_else(|p| p.into_inner());
        let training_start = shared
            .timeline()
            .of(EventKind::TrainingStart)
            .next()
            .map(|e| e.t);
        report.cpu_training =
            training_start.and_then(|t| cpu.window(t, t + report.summary.train_seconds));
        report.cpu_rebuilds = report
            .summary
            .recoveries
            .iter()
            .map(|r| {
                r.background_rebuild
                    .then(|| cpu.window(r.resumed_at, r.detected_at + r.degraded_seconds))
                    .flatten()
            })
            .collect();
        Ok(report)
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
        (Ok(_), Err(e)) => Err(e.into()),
        (Err(e), written) => {
            if let Err(w) = written {
                tracing::warn!("writing the timeline: {w}");
            }
            Err(e)
        }
    }
}

/// The job's processes now: every server slot's and worker's, and this launcher's (its
/// coordinator runs here).
fn job_pids(shared: &coordinator::Shared, servers: usize, workers: usize) -> Vec<u32> {
    (0..servers)
        .filter_map(|id| shared.pid_of(Role::Server, id))
        .chain((0..workers).filter_map(|id| shared.pid_of(Role::Worker, id)))
        .chain(std::iter::once(std::process::id()))
        .collect()
}

/// Samples the job processes' CPU time every 20 ms until aborted: a rebuild of a second
/// or two needs finer steps than the supervisor's loop.
async fn sample_job_cpu(
    shared: Arc<coordinator::Shared>,
    (servers, workers): (usize, usize),
    series: Arc<Mutex<cpu::CpuSeries>>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let pids = job_pids(&shared, servers, workers);
        let now = shared.now();
        series
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sample(now, pids);
    }
}

/// The launcher while the cluster trains: progress, timed kills, signals and the time limit.
struct Supervised<'a> {
    spawner: &'a LocalSpawner,
    kills: &'a [KillSpec],
    scale_at: &'a [(u64, usize)],
    time_limit: Duration,
    run_dir: &'a Path,
}

impl Supervised<'_> {
    /// Until the coordinator says the run is done. Returns the timeline times of the timed
    /// kills it fired.
    async fn run(
        &self,
        handle: &mut coordinator::Handle,
        on_progress: &impl Fn(&Progress),
        peaks: &mut rss::PeakRss,
    ) -> Result<Vec<f64>, PsError> {
        let shared = handle.shared.clone();
        let address = shared.address().to_string();
        let started = Instant::now();
        let mut stop_signals = StopSignals::new()?;
        let mut timed = Vec::new();
        // Kills that wait for their slot's recovery: (not before, slot).
        let mut during_recovery: Vec<(Duration, usize)> = Vec::new();
        for k in self.kills {
            match k.at {
                KillAt::After(after) => timed.push((after, k.role, k.id, Injected::Kill)),
                KillAt::FreezeAfter(after) => timed.push((after, k.role, k.id, Injected::Freeze)),
                KillAt::DuringRecovery(after) => during_recovery.push((after, k.id)),
                KillAt::Step(step) => shared.kill_at_step(k.role, k.id, step),
                KillAt::Point(_) => {}
            }
        }
        for &(step, servers) in self.scale_at {
            shared.scale_at_step(step, servers);
        }
        timed.sort_by_key(|k| k.0);
        let mut kill_times = Vec::new();
        // The last process each server slot lost to an injected failure: a kill during a
        // recovery strikes the slot's next process, never the one found dead.
        let mut struck: std::collections::HashMap<usize, u32> = Default::default();
        let mut training_start: Option<Instant> = None;
        loop {
            self.spawner.reap_exited();
            peaks.sample(|role, id| shared.pid_of(role, id));
            peaks.sample_spares(&shared.waiting_spare_pids());
            for (name, pid) in self
                .spawner
                .kill_superseded(|role, id| shared.pid_of(role, id))
            {
                shared.event(
                    EventKind::SupersededKilled,
                    format!(
                        "{name} (pid {pid}) by SIGKILL: declared dead, its slot has a new \
                         process, and it may be frozen or cut off rather than gone"
                    ),
                );
            }
            let summary = shared.summary();
            // The event log is copied only until training has started.
            if training_start.is_none()
                && shared
                    .timeline()
                    .of(EventKind::TrainingStart)
                    .next()
                    .is_some()
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
                while timed.first().is_some_and(|k| t0.elapsed() >= k.0) {
                    let (_, role, id, how) = timed.remove(0);
                    if role == Role::Server
                        && let Some(pid) = shared.pid_of(role, id)
                    {
                        struck.insert(id, pid);
                    }
                    kill_times.extend(fail_now(&shared, role, id, how)?);
                }
                let mut fired = Vec::new();
                for (i, &(after, id)) in during_recovery.iter().enumerate() {
                    if t0.elapsed() < after {
                        continue;
                    }
                    let Some(pid) = shared.recovering_pid(id) else {
                        continue;
                    };
                    if struck.get(&id) == Some(&pid) {
                        continue;
                    }
                    struck.insert(id, pid);
                    kill_times.push(fail_pid(
                        &shared,
                        Role::Server,
                        id,
                        pid,
                        Injected::Kill,
                        " while it recovered",
                    )?);
                    fired.push(i);
                }
                for i in fired.into_iter().rev() {
                    during_recovery.remove(i);
                }
            }
            // A kill that waits for a recovery looks often: a rebuild can be over in
            // 0.1 s.
            let tick = if during_recovery.is_empty() {
                Duration::from_millis(200)
            } else {
                Duration::from_millis(5)
            };
            let waited = tokio::select! {
                waited = handle.wait_done(tick) => waited,
                signal = stop_signals.recv() => {
                    shared.event(EventKind::Interrupted, format!("{signal}: stopping every process"));
                    return Err(PsError::Stopped(format!(
                        "by {signal}; timeline and logs in {}",
                        self.run_dir.display()
                    )));
                }
            };
            match waited {
                Ok(()) => return Ok(kill_times),
                Err(PsError::Timeout(_)) => {}
                Err(e) => {
                    return Err(PsError::Fatal(format!(
                        "{e}; logs in {}",
                        self.run_dir.join("logs").display()
                    )));
                }
            }
            if started.elapsed() > self.time_limit {
                return Err(PsError::Timeout(format!(
                    "the cluster did not finish within {:?}; logs in {}",
                    self.time_limit,
                    self.run_dir.display()
                )));
            }
        }
    }
}

/// How a timed failure is injected.
#[derive(Clone, Copy, Debug)]
enum Injected {
    Kill,
    Freeze,
}

/// SIGKILLs (or SIGSTOPs) `role` `id` now; its timeline time, or `None` if it has no
/// process.
fn fail_now(
    shared: &coordinator::Shared,
    role: Role,
    id: usize,
    how: Injected,
) -> Result<Option<f64>, PsError> {
    let Some(pid) = shared.pid_of(role, id) else {
        shared.event(
            EventKind::KillSkipped,
            format!("{} {id}: no such process", coordinator::role_name(role)),
        );
        return Ok(None);
    };
    fail_pid(shared, role, id, pid, how, "").map(Some)
}

/// SIGKILLs (or SIGSTOPs) process `pid` of `role` `id`, and records it (`why` follows
/// the event's text); its timeline time.
fn fail_pid(
    shared: &coordinator::Shared,
    role: Role,
    id: usize,
    pid: u32,
    how: Injected,
    why: &str,
) -> Result<f64, PsError> {
    let who = coordinator::role_name(role);
    let (kind, text) = match how {
        Injected::Kill => {
            sigkill(pid).map_err(io(Path::new("kill")))?;
            (EventKind::Killed, "SIGKILL")
        }
        Injected::Freeze => {
            coordinator::sigstop(pid).map_err(io(Path::new("kill -STOP")))?;
            (EventKind::Frozen, "SIGSTOP: frozen, silent but not gone")
        }
    };
    Ok(shared.event_about(
        kind,
        coordinator::subject(role, id),
        None,
        format!("{who} {id} (pid {pid}) by {text}{why}"),
    ))
}

/// SIGTERM, SIGINT and SIGHUP (the terminal that started the run closed), which stop the
/// run cleanly (children stopped, timeline written) instead of killing the launcher
/// outright.
struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn new() -> Result<Self, PsError> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).map_err(io(Path::new("SIGTERM handler")))?,
            int: signal(SignalKind::interrupt()).map_err(io(Path::new("SIGINT handler")))?,
            hup: signal(SignalKind::hangup()).map_err(io(Path::new("SIGHUP handler")))?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
            _ = self.hup.recv() => "SIGHUP",
        }
    }
}
