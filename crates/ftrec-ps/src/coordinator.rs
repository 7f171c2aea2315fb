//! The coordinator: membership and heartbeats, the cluster epoch, the step schedule handed
//! to workers, consistent checkpoint cuts, failure detection and recovery.
//!
//! Workers ask for steps one at a time ([`NextStep`](crate::proto::NextStepRequest)), so the
//! coordinator always knows the exact cut: every step below `next_step` that is not
//! outstanding has been pushed to every server. A checkpoint stops granting, waits for the
//! outstanding steps, and has every server write its shard at that step. A failure bumps the
//! epoch (servers then refuse the old epoch's requests), replaces the dead server, and rolls
//! every server back to the last cut (`ft = checkpoint`) or keeps going with a fresh shard
//! (`ft = none`); `next_step` rewinds to the cut, which rewinds the workers' data.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ftrec_train::config::FaultTolerance;
use serde::Serialize;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::PsError;
use crate::client::server_client;
use crate::job::{Job, Schedule};
use crate::metrics::{self, Metrics};
use crate::placement::PlacementMap;
use crate::proto::coordinator_server::{Coordinator, CoordinatorServer};
use crate::proto::next_step_reply::Action;
use crate::proto::*;
use crate::timeline::{Timeline, TimelineData};

/// Starts replacement processes. The local launcher spawns children; without one, the
/// coordinator waits for a registered spare or a server started by hand.
pub trait Spawner: Send + Sync {
    fn spawn_server(&self, id: usize, coordinator: &str) -> Result<(), PsError>;
    fn spawn_worker(&self, id: usize, coordinator: &str) -> Result<(), PsError>;
}

#[derive(Clone, Debug, Default)]
struct Member {
    address: String,
    pid: u32,
    joined: bool,
    alive: bool,
    ready: bool,
    last_seen: Option<Instant>,
}

impl Member {
    fn silent_for(&self) -> Duration {
        self.last_seen.map_or(Duration::ZERO, |t| t.elapsed())
    }
}

#[derive(Clone, Debug)]
struct Spare {
    token: u32,
    member: Member,
    assigned: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    Starting,
    Running,
    Checkpointing,
    Recovering,
    Done,
}

/// One recovery from a server failure, in seconds since the timeline started.
#[derive(Clone, Debug, Serialize)]
pub struct Recovery {
    pub server: usize,
    pub detected_at: f64,
    pub resumed_at: f64,
    /// Step training continued from.
    pub resumed_step: u64,
    pub steps_rolled_back: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct CheckpointRecord {
    pub step: u64,
    pub started_at: f64,
    /// Training was paused from the cut request to the end of the write.
    pub pause_seconds: f64,
    pub bytes: u64,
}

struct State {
    phase: Phase,
    epoch: u64,
    placement: PlacementMap,
    servers: Vec<Member>,
    spares: Vec<Spare>,
    workers: Vec<Member>,
    next_step: u64,
    /// Granted steps not yet reported, and the worker holding each.
    outstanding: BTreeMap<u64, usize>,
    samples: u64,
    lost_samples: u64,
    rpc_bytes: u64,
    last_checkpoint: Option<u64>,
    pause_started: Option<Instant>,
    checkpoints: Vec<CheckpointRecord>,
    /// Slots waiting for their replacement, with the detection time.
    failed: Vec<(usize, f64)>,
    recoveries: Vec<Recovery>,
    timeline: Timeline,
    stopping: bool,
    busy: bool,
    next_token: u32,
    worker_respawns: Vec<u32>,
    /// A worker lost a step to a server error: no new grants until the failure detector
    /// confirms a failure (or this passes), so the schedule is not burnt on a dead server.
    suspect_until: Option<Instant>,
    /// Why the run cannot go on (a crash loop); ends it with this error.
    fatal: Option<String>,
}

pub struct Shared {
    job: Job,
    schedule: Schedule,
    total_steps: u64,
    address: String,
    state: Mutex<State>,
    spawner: Option<Box<dyn Spawner>>,
    metrics: Arc<Metrics>,
    done: watch::Sender<bool>,
}

/// What a finished run reports.
#[derive(Clone, Debug, Serialize)]
pub struct RunSummary {
    pub steps: u64,
    pub samples: u64,
    pub lost_samples: u64,
    pub train_seconds: f64,
    pub samples_per_sec: f64,
    pub rpc_bytes: u64,
    pub rpc_bytes_per_sample: f64,
    pub epoch: u64,
    pub checkpoints: Vec<CheckpointRecord>,
    pub recoveries: Vec<Recovery>,
    pub recovery_seconds: f64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a bug; the state is still the best we have.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn event(&self, kind: &str, detail: impl Into<String>) -> f64 {
        self.lock().timeline.event(kind, detail)
    }

    pub fn timeline(&self) -> TimelineData {
        self.lock().timeline.data.clone()
    }

    pub fn server_addresses(&self) -> Vec<String> {
        self.lock().placement.servers.clone()
    }

    pub fn pid_of(&self, role: Role, id: usize) -> Option<u32> {
        let s = self.lock();
        let m = match role {
            Role::Server => s.servers.get(id),
            Role::Worker => s.workers.get(id),
            Role::Unspecified => None,
        }?;
        (m.joined && m.pid != 0).then_some(m.pid)
    }

    pub fn summary(&self) -> RunSummary {
        let s = self.lock();
        let start = s
            .timeline
            .data
            .events
            .iter()
            .find(|e| e.kind == "training-start")
            .map_or(0.0, |e| e.t);
        let end = s
            .timeline
            .data
            .events
            .iter()
            .find(|e| e.kind == "training-end")
            .map_or_else(|| s.timeline.now(), |e| e.t);
        let seconds = (end - start).max(1e-9);
        RunSummary {
            steps: s.next_step,
            samples: s.samples,
            lost_samples: s.lost_samples,
            train_seconds: seconds,
            samples_per_sec: s.samples as f64 / seconds,
            rpc_bytes: s.rpc_bytes,
            rpc_bytes_per_sample: s.rpc_bytes as f64 / s.samples.max(1) as f64,
            epoch: s.epoch,
            checkpoints: s.checkpoints.clone(),
            recovery_seconds: s
                .recoveries
                .iter()
                .fold(0.0, |acc, r| acc + (r.resumed_at - r.detected_at)),
            recoveries: s.recoveries.clone(),
        }
    }

    /// Tells every process to exit (heartbeat replies carry `stop`).
    pub fn stop(&self) {
        self.lock().stopping = true;
    }

    fn fence_error(&self, job_fp: u64) -> Option<Status> {
        let ours = self.job.fingerprint();
        (job_fp != ours).then(|| {
            Status::failed_precondition(format!(
                "configuration fingerprint {job_fp:016x} differs from the cluster's {ours:016x}: \
                 the process was started with another configuration"
            ))
        })
    }

    fn grant(&self, s: &mut State, worker: usize) -> NextStepReply {
        let wait = |epoch, v| NextStepReply {
            action: Action::Wait as i32,
            step: 0,
            epoch,
            wait_ms: 20,
            placement_version: v,
        };
        let (epoch, version) = (s.epoch, s.placement.version);
        if s.stopping || s.phase == Phase::Done {
            return NextStepReply {
                action: Action::Stop as i32,
                ..wait(epoch, version)
            };
        }
        if s.phase != Phase::Running || s.suspect_until.is_some_and(|t| Instant::now() < t) {
            return wait(epoch, version);
        }
        let c = &self.job.config;
        let every = c.checkpoint.every_steps;
        let due = c.cluster.ft == FaultTolerance::Checkpoint
            && every > 0
            && s.next_step > 0
            && s.next_step.is_multiple_of(every)
            && s.last_checkpoint != Some(s.next_step)
            && s.next_step < self.total_steps;
        if due {
            s.phase = Phase::Checkpointing;
            s.pause_started = Some(Instant::now());
            return wait(epoch, version);
        }
        if s.next_step < self.total_steps {
            let step = s.next_step;
            s.next_step += 1;
            s.outstanding.insert(step, worker);
            return NextStepReply {
                action: Action::Train as i32,
                step,
                epoch,
                wait_ms: 0,
                placement_version: version,
            };
        }
        if s.outstanding.is_empty() {
            s.phase = Phase::Done;
            s.timeline
                .event("training-end", format!("{} steps", s.next_step));
            self.done.send_replace(true);
            return NextStepReply {
                action: Action::Stop as i32,
                ..wait(epoch, version)
            };
        }
        wait(epoch, version)
    }
}

struct Service(Arc<Shared>);

#[tonic::async_trait]
impl Coordinator for Service {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        let shared = &self.0;
        let req = req.into_inner();
        if let Some(e) = shared.fence_error(req.fingerprint) {
            shared.event(
                "join-refused",
                format!("{:?} {}: {}", req.role(), req.id, e.message()),
            );
            return Err(e);
        }
        let c = &shared.job.config.cluster;
        let timeout = Duration::from_millis(c.failure_timeout_ms);
        let mut s = shared.lock();
        let mut spare_token = 0;
        let id = req.id as usize;
        let member = Member {
            address: req.address.clone(),
            pid: req.pid,
            joined: true,
            alive: true,
            ready: false,
            last_seen: Some(Instant::now()),
        };
        match (req.role(), req.spare) {
            (Role::Server, true) => {
                spare_token = s.next_token;
                s.next_token += 1;
                s.spares.push(Spare {
                    token: spare_token,
                    member,
                    assigned: None,
                });
                s.timeline.event(
                    "spare-joined",
                    format!("spare {spare_token} at {}", req.address),
                );
            }
            (Role::Server, false) => {
                let Some(slot) = s.servers.get(id) else {
                    return Err(Status::invalid_argument(format!(
                        "server id {id} is outside this cluster's {} servers",
                        c.servers
                    )));
                };
                if slot.joined && slot.alive && slot.silent_for() < timeout {
                    return Err(Status::already_exists(format!(
                        "server {id} is already held by a live process (pid {} at {}); \
                         refusing a second server with that identity",
                        slot.pid, slot.address
                    )));
                }
                s.servers[id] = member;
                s.placement.assign(id, req.address.clone());
                s.timeline.event(
                    "server-joined",
                    format!(
                        "server {id} at {} (pid {}, metrics http://{}/metrics)",
                        req.address, req.pid, req.metrics_address
                    ),
                );
            }
            (Role::Worker, _) => {
                let Some(slot) = s.workers.get(id) else {
                    return Err(Status::invalid_argument(format!(
                        "worker id {id} is outside this cluster's {} workers",
                        c.workers
                    )));
                };
                if slot.joined && slot.alive && slot.silent_for() < timeout {
                    return Err(Status::already_exists(format!(
                        "worker {id} is already held by a live process (pid {})",
                        slot.pid
                    )));
                }
                s.workers[id] = Member {
                    ready: true,
                    ..member
                };
                s.timeline.event(
                    "worker-joined",
                    format!(
                        "worker {id} (pid {}, metrics http://{}/metrics)",
                        req.pid, req.metrics_address
                    ),
                );
            }
            (Role::Unspecified, _) => return Err(Status::invalid_argument("join without a role")),
        }
        Ok(Response::new(JoinReply {
            epoch: s.epoch,
            servers: c.servers as u32,
            workers: c.workers as u32,
            spare_token,
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatReply>, Status> {
        let shared = &self.0;
        let req = req.into_inner();
        let mut s = shared.lock();
        let stop = s.stopping;
        let mut assign = None;
        let id = req.id as usize;
        let member = match (req.role(), req.spare) {
            (Role::Server, true) => {
                let Some(spare) = s.spares.iter_mut().find(|sp| sp.token == req.id) else {
                    return Err(Status::not_found("unknown spare"));
                };
                assign = spare.assigned.map(|a| a as u32);
                &mut spare.member
            }
            (Role::Server, false) => s
                .servers
                .get_mut(id)
                .ok_or_else(|| Status::invalid_argument("unknown server"))?,
            (Role::Worker, _) => s
                .workers
                .get_mut(id)
                .ok_or_else(|| Status::invalid_argument("unknown worker"))?,
            _ => return Err(Status::invalid_argument("heartbeat without a role")),
        };
        if !member.alive {
            // Declared dead (and replaced): a paused process that wakes up must not serve.
            return Err(Status::permission_denied(
                "this process was declared dead; its slot has been replaced",
            ));
        }
        member.last_seen = Some(Instant::now());
        member.ready |= req.ready;
        Ok(Response::new(HeartbeatReply {
            epoch: s.epoch,
            stop,
            assign,
        }))
    }

    async fn next_step(
        &self,
        req: Request<NextStepRequest>,
    ) -> Result<Response<NextStepReply>, Status> {
        let shared = &self.0;
        let req = req.into_inner();
        let worker = req.worker as usize;
        let mut s = shared.lock();
        if let Some(m) = s.workers.get_mut(worker) {
            m.last_seen = Some(Instant::now());
        }
        s.rpc_bytes += req.rpc_bytes;
        shared.metrics.add("ftrec_rpc_bytes_total", req.rpc_bytes);
        if let Some(step) = req.finished
            && s.outstanding.remove(&step).is_some()
        {
            let (_, n) = shared.schedule.batch(step);
            s.samples += n;
            s.timeline.samples(n);
            shared.metrics.add("ftrec_samples_total", n);
            shared.metrics.add("ftrec_steps_total", 1);
        }
        if let Some(step) = req.lost {
            if s.outstanding.remove(&step).is_some() {
                let (_, n) = shared.schedule.batch(step);
                s.lost_samples += n;
                shared.metrics.add("ftrec_lost_samples_total", n);
            }
            let c = &shared.job.config.cluster;
            s.suspect_until = Some(
                Instant::now() + Duration::from_millis(c.failure_timeout_ms + 2 * c.heartbeat_ms),
            );
        }
        let reply = shared.grant(&mut s, worker);
        Ok(Response::new(reply))
    }

    async fn placement(
        &self,
        _req: Request<PlacementRequest>,
    ) -> Result<Response<PlacementReply>, Status> {
        let s = self.0.lock();
        Ok(Response::new(PlacementReply {
            version: s.placement.version,
            servers: s.placement.servers.clone(),
        }))
    }

    async fn kill(&self, req: Request<KillRequest>) -> Result<Response<KillReply>, Status> {
        let req = req.into_inner();
        let role = req.role();
        let Some(pid) = self.0.pid_of(role, req.id as usize) else {
            return Err(Status::not_found(format!(
                "no {role:?} {} has joined",
                req.id
            )));
        };
        sigkill(pid).map_err(|e| Status::internal(format!("kill {pid}: {e}")))?;
        self.0.event(
            "killed",
            format!("{} {} (pid {pid}) by SIGKILL", role_name(role), req.id),
        );
        Ok(Response::new(KillReply { pid }))
    }
}

pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Server => "server",
        Role::Worker => "worker",
        Role::Unspecified => "?",
    }
}

/// SIGKILLs a process on this host.
pub fn sigkill(pid: u32) -> Result<(), std::io::Error> {
    let pid =
        rustix::process::Pid::from_raw(pid as i32).ok_or_else(|| std::io::Error::other("pid 0"))?;
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).map_err(Into::into)
}

/// Replacements of one worker slot before the run is declared failed (a crash loop).
const MAX_RESPAWNS: u32 = 3;

pub struct CoordinatorOptions {
    pub job: Job,
    pub host: String,
    /// Port to listen on (0: any).
    pub port: u16,
    pub spawner: Option<Box<dyn Spawner>>,
}

/// A running coordinator (embedded in `cluster run`, or `ftrec coordinator`).
pub struct Handle {
    pub shared: Arc<Shared>,
    pub metrics_address: Option<String>,
    done: watch::Receiver<bool>,
}

impl Handle {
    /// Waits until every step is trained (bounded by `limit`).
    pub async fn wait_done(&mut self, limit: Duration) -> Result<(), PsError> {
        tokio::time::timeout(limit, self.done.wait_for(|d| *d))
            .await
            .map_err(|_| PsError::Timeout(format!("training did not finish within {limit:?}")))?
            .map_err(|_| PsError::Refused("coordinator stopped".into()))?;
        match self.shared.lock().fatal.clone() {
            Some(why) => Err(PsError::Refused(why)),
            None => Ok(()),
        }
    }
}

pub async fn start(opts: CoordinatorOptions) -> Result<Handle, PsError> {
    let job = opts.job;
    let data = job.train_data()?;
    let schedule = Schedule {
        samples: data.len() as u64,
        batch_size: job.config.train.batch_size as u64,
    };
    let c = &job.config;
    let total_steps = if c.train.steps > 0 {
        c.train.steps
    } else {
        c.train.epochs * schedule.batches_per_epoch()
    };
    let (listener, address) = crate::client::bind(&opts.host, opts.port).await?;
    let metrics = Arc::new(
        Metrics::new("role=\"coordinator\"".into())
            .counter("ftrec_samples_total", "Samples trained")
            .counter("ftrec_steps_total", "Steps finished")
            .counter(
                "ftrec_lost_samples_total",
                "Samples of steps lost to failures",
            )
            .counter("ftrec_rpc_bytes_total", "Worker RPC payload bytes")
            .counter("ftrec_failures_total", "Server failures detected")
            .counter("ftrec_checkpoints_total", "Cluster checkpoints")
            .gauge("ftrec_epoch", "Cluster epoch"),
    );
    let metrics_address = metrics::start(&opts.host, metrics.clone()).await;
    let (done_tx, done_rx) = watch::channel(false);
    let cluster = &c.cluster;
    let shared = Arc::new(Shared {
        schedule,
        total_steps,
        address: address.clone(),
        state: Mutex::new(State {
            phase: Phase::Starting,
            epoch: 1,
            placement: PlacementMap::new(cluster.servers),
            servers: vec![Member::default(); cluster.servers],
            spares: Vec::new(),
            workers: vec![Member::default(); cluster.workers],
            next_step: 0,
            outstanding: BTreeMap::new(),
            samples: 0,
            lost_samples: 0,
            rpc_bytes: 0,
            last_checkpoint: None,
            pause_started: None,
            checkpoints: Vec::new(),
            failed: Vec::new(),
            recoveries: Vec::new(),
            timeline: Timeline::new(),
            stopping: false,
            busy: false,
            next_token: 1,
            worker_respawns: vec![0; cluster.workers],
            suspect_until: None,
            fatal: None,
        }),
        spawner: opts.spawner,
        metrics,
        done: done_tx,
        job,
    });
    let service = CoordinatorServer::new(Service(shared.clone()));
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tokio::spawn(async move {
        if let Err(e) = tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .add_service(service)
            .serve_with_incoming(incoming)
            .await
        {
            tracing::error!("coordinator RPC server stopped: {e}");
        }
    });
    tokio::spawn(control_loop(shared.clone()));
    shared.event(
        "coordinator",
        format!(
            "listening on {address} (metrics http://{}/metrics)",
            metrics_address.as_deref().unwrap_or("-")
        ),
    );
    Ok(Handle {
        shared,
        metrics_address,
        done: done_rx,
    })
}

/// Work the control loop decided on under the lock and runs after releasing it.
enum Task {
    Checkpoint { epoch: u64, step: u64 },
    Recover { epoch: u64, action: RecoveryAction },
}

/// How the servers come back after a failure.
#[derive(Clone, Copy)]
enum RecoveryAction {
    /// `ft = checkpoint`: every server restores the cut of this step (`None`: no cut yet,
    /// back to the initial state), and training continues from it.
    Rollback { cut: Option<u64> },
    /// `ft = none`: every server keeps its state and adopts the new epoch; training goes
    /// on from `next_step`.
    KeepState { next_step: u64 },
}

impl RecoveryAction {
    /// The step training continues from.
    fn resume_step(self) -> u64 {
        match self {
            Self::Rollback { cut } => cut.unwrap_or(0),
            Self::KeepState { next_step } => next_step,
        }
    }
}

async fn control_loop(shared: Arc<Shared>) {
    let tick = Duration::from_millis(20);
    loop {
        tokio::time::sleep(tick).await;
        let task = {
            let mut s = shared.lock();
            if s.stopping && s.phase == Phase::Done {
                // Keep answering heartbeats with `stop` until the process exits.
                continue;
            }
            detect_failures(&shared, &mut s);
            if s.busy { None } else { plan(&shared, &mut s) }
        };
        if let Some(task) = task {
            let shared = shared.clone();
            tokio::spawn(async move {
                run_task(&shared, task).await;
                shared.lock().busy = false;
            });
        }
    }
}

fn detect_failures(shared: &Shared, s: &mut State) {
    let c = &shared.job.config.cluster;
    let timeout = Duration::from_millis(c.failure_timeout_ms);
    if s.phase == Phase::Done {
        return;
    }
    for id in 0..s.servers.len() {
        let m = &s.servers[id];
        let silent = m.silent_for();
        if !(m.joined && m.alive && silent > timeout) {
            continue;
        }
        s.servers[id].alive = false;
        s.servers[id].ready = false;
        s.epoch += 1;
        shared.metrics.add("ftrec_failures_total", 1);
        shared.metrics.set("ftrec_epoch", s.epoch as f64);
        let t = s.timeline.event(
            "failure-detected",
            format!("server {id} silent for {silent:?}; epoch {}", s.epoch),
        );
        s.failed.push((id, t));
        s.suspect_until = None;
        // Steps in flight are lost (ft=none) or rolled back (ft=checkpoint).
        let lost: Vec<u64> = std::mem::take(&mut s.outstanding).into_keys().collect();
        for step in lost {
            s.lost_samples += shared.schedule.batch(step).1;
        }
        s.phase = Phase::Recovering;
        replace_server(shared, s, id);
    }
    for id in 0..s.workers.len() {
        let m = &s.workers[id];
        if !(m.joined && m.alive && m.silent_for() > timeout) {
            continue;
        }
        s.workers[id].alive = false;
        s.timeline
            .event("worker-failure-detected", format!("worker {id}"));
        let held: Vec<u64> = s
            .outstanding
            .iter()
            .filter(|(_, w)| **w == id)
            .map(|(k, _)| *k)
            .collect();
        for step in held {
            s.outstanding.remove(&step);
            s.lost_samples += shared.schedule.batch(step).1;
        }
        s.worker_respawns[id] += 1;
        if s.worker_respawns[id] > MAX_RESPAWNS {
            let why = format!(
                "worker {id} failed {} times; giving up (see its log)",
                s.worker_respawns[id]
            );
            s.timeline.event("fatal", why.clone());
            s.fatal = Some(why);
            s.phase = Phase::Done;
            shared.done.send_replace(true);
            return;
        }
        if let Some(sp) = &shared.spawner
            && let Err(e) = sp.spawn_worker(id, &shared.address)
        {
            s.timeline
                .event("replacement-failed", format!("worker {id}: {e}"));
        }
    }
}

fn replace_server(shared: &Shared, s: &mut State, id: usize) {
    if let Some(spare) = s
        .spares
        .iter_mut()
        .find(|sp| sp.assigned.is_none() && sp.member.alive)
    {
        spare.assigned = Some(id);
        let member = Member {
            ready: false,
            last_seen: Some(Instant::now()),
            ..spare.member.clone()
        };
        let (token, address) = (spare.token, member.address.clone());
        s.servers[id] = member;
        s.placement.assign(id, address.clone());
        s.timeline.event(
            "replacement",
            format!("spare {token} at {address} takes server {id}"),
        );
        return;
    }
    match &shared.spawner {
        Some(sp) => match sp.spawn_server(id, &shared.address) {
            Ok(()) => {
                s.timeline
                    .event("replacement", format!("spawned a new server {id}"));
            }
            Err(e) => {
                s.timeline
                    .event("replacement-failed", format!("server {id}: {e}"));
            }
        },
        None => {
            s.timeline.event(
                "replacement",
                format!("waiting for a spare or a new `ftrec server --id {id}`"),
            );
        }
    }
}

fn plan(shared: &Shared, s: &mut State) -> Option<Task> {
    match s.phase {
        Phase::Starting => {
            let servers_ready = s.servers.iter().all(|m| m.alive && m.ready);
            let workers_joined = s.workers.iter().all(|m| m.joined);
            if servers_ready && workers_joined {
                s.phase = Phase::Running;
                s.timeline
                    .event("training-start", format!("{} steps", shared.total_steps));
            }
            None
        }
        Phase::Checkpointing if s.outstanding.is_empty() => {
            s.busy = true;
            Some(Task::Checkpoint {
                epoch: s.epoch,
                step: s.next_step,
            })
        }
        Phase::Recovering => {
            if !s.servers.iter().all(|m| m.alive && m.ready) {
                return None;
            }
            s.busy = true;
            s.timeline
                .event("recovery-start", format!("epoch {}", s.epoch));
            let action = match shared.job.config.cluster.ft {
                FaultTolerance::Checkpoint => RecoveryAction::Rollback {
                    cut: s.last_checkpoint,
                },
                FaultTolerance::None => RecoveryAction::KeepState {
                    next_step: s.next_step,
                },
            };
            Some(Task::Recover {
                epoch: s.epoch,
                action,
            })
        }
        _ => None,
    }
}

async fn run_task(shared: &Shared, task: Task) {
    let timeout = shared.job.timeout();
    let clients: Result<Vec<_>, _> = shared
        .server_addresses()
        .iter()
        .map(|a| server_client(a, timeout))
        .collect();
    let clients = match clients {
        Ok(c) => c,
        Err(e) => {
            shared.event("error", e.to_string());
            return;
        }
    };
    match task {
        Task::Checkpoint { epoch, step } => {
            let started_at = shared.event("checkpoint-start", format!("step {step}"));
            let calls = clients
                .into_iter()
                .map(|mut c| async move { c.checkpoint(CheckpointRequest { epoch, step }).await });
            let results = futures::future::join_all(calls).await;
            let mut bytes = 0;
            let mut failed = None;
            for (i, r) in results.into_iter().enumerate() {
                match r {
                    Ok(r) => bytes += r.into_inner().bytes,
                    Err(e) => failed = Some(format!("server {i}: {}", e.message())),
                }
            }
            let mut s = shared.lock();
            let pause = s
                .pause_started
                .take()
                .map_or(0.0, |t| t.elapsed().as_secs_f64());
            if s.epoch == epoch && s.phase == Phase::Checkpointing {
                s.phase = Phase::Running;
            }
            match failed {
                None if s.epoch == epoch => {
                    s.last_checkpoint = Some(step);
                    s.checkpoints.push(CheckpointRecord {
                        step,
                        started_at,
                        pause_seconds: pause,
                        bytes,
                    });
                    shared.metrics.add("ftrec_checkpoints_total", 1);
                    s.timeline.event(
                        "checkpoint-end",
                        format!("step {step}, {bytes} bytes, paused {pause:.3}s"),
                    );
                }
                None => {
                    s.timeline.event(
                        "checkpoint-abandoned",
                        format!("step {step}: epoch changed"),
                    );
                }
                Some(e) => {
                    s.timeline
                        .event("checkpoint-failed", format!("step {step}: {e}"));
                }
            }
        }
        Task::Recover { epoch, action } => {
            let applied = action.resume_step();
            let calls = clients.into_iter().map(|mut c| async move {
                match action {
                    RecoveryAction::Rollback { cut } => c
                        .restore(RestoreRequest { epoch, step: cut })
                        .await
                        .map(|_| ()),
                    RecoveryAction::KeepState { .. } => c
                        .set_epoch(SetEpochRequest { epoch, applied })
                        .await
                        .map(|_| ()),
                }
            });
            let results = futures::future::join_all(calls).await;
            let failed: Vec<String> = results
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    r.as_ref()
                        .err()
                        .map(|e| format!("server {i}: {}", e.message()))
                })
                .collect();
            let mut s = shared.lock();
            if !failed.is_empty() || s.epoch != epoch {
                s.timeline.event(
                    "recovery-retry",
                    format!("epoch {epoch}: {}", failed.join("; ")),
                );
                return;
            }
            let rolled_back = s.next_step.saturating_sub(applied);
            s.next_step = applied;
            s.outstanding.clear();
            s.phase = Phase::Running;
            let resumed_at = s.timeline.event(
                "recovery-end",
                format!("training resumes at step {applied} (rolled back {rolled_back} steps)"),
            );
            for (server, detected_at) in std::mem::take(&mut s.failed) {
                s.recoveries.push(Recovery {
                    server,
                    detected_at,
                    resumed_at,
                    resumed_step: applied,
                    steps_rolled_back: rolled_back,
                });
            }
        }
    }
}
