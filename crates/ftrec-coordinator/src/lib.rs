//! The coordinator: membership and heartbeats, the cluster epoch, the step schedule handed
//! to workers, consistent checkpoint cuts, failure detection and recovery.
//!
//! Workers ask for steps one at a time ([`NextStep`](ftrec_proto::proto::NextStepRequest)), and
//! the [`ledger::StepLedger`] knows where each stands, so the coordinator always knows the
//! exact cut. A checkpoint stops granting fresh steps, waits until every granted one is
//! settled, and has every server write its shard at that step. A failure bumps the epoch
//! (servers then refuse the old epoch's requests), replaces the dead server, and rolls every
//! server back to the last cut (`ft = checkpoint`) or keeps going with a fresh shard
//! (`ft = none`). A step whose worker died is never skipped: it is granted again, or the
//! cluster rolls back to the cut (see `ledger`).
//!
//! Files: `service.rs` answers the RPCs; `control.rs` detects failures and decides what
//! to do next; `planner.rs` is the pure recovery planner (a situation in, a plan out);
//! `ledger.rs` grants steps. Folders: `state/` holds the state under the lock, grouped by
//! concern, each group with its invariants; `tasks/` and `recovery/` execute plans
//! against the servers; `cpr/` holds partial recovery's accounting and its uncoordinated
//! saves, `leader/` the durable record and the takeover of a standby.

mod control;
mod cpr;
mod final_cut;
mod hosting;
#[cfg(test)]
mod join_tests;
mod leader;
pub mod ledger;
pub mod planner;
mod recovery;
pub mod replan;
mod scale;
mod service;
#[cfg(test)]
mod sim_tests;
mod start;
mod state;
mod summary;
mod tasks;

use leader::durable;

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::time::Instant;

use tokio::sync::watch;
use tonic::Status;

use ftrec_proto::proto::next_step_reply::Action;
use ftrec_proto::proto::*;
use ftrec_proto::timeline::{EventKind, Subject, TimelineData};
use ftrec_rpc::PsError;
use ftrec_rpc::job::{Job, Schedule};
use ftrec_rpc::metrics::Metrics;
pub use leader::progress::{JobProgress, STATE_KEY, SlotProcess};
pub use start::{CoordinatorOptions, Handle, TestHooks, start, start_with};
pub use state::{MoveRecord, Phase};
use state::{SaveDue, State};
pub use summary::{CheckpointRecord, Failover, Recovery, RecoveryMode, RunSummary};

/// Starts replacement processes. The local launcher spawns children; without one, the
/// coordinator waits for a registered spare or a server started by hand.
pub trait Spawner: Send + Sync {
    fn spawn_server(&self, id: usize, coordinator: &str) -> Result<(), PsError>;
    fn spawn_worker(&self, id: usize, coordinator: &str) -> Result<(), PsError>;
    /// Whether the process last started for slot `id` of `role` has exited. One that
    /// exits before it joins is never declared dead (it was never heard), so the job's
    /// start waits for it: it is started again. `false` when the spawner cannot tell.
    fn exited(&self, _role: Role, _id: usize) -> bool {
        false
    }
}

pub struct Shared {
    job: Job,
    schedule: Schedule,
    address: String,
    state: Mutex<State>,
    spawner: Option<Arc<dyn Spawner>>,
    metrics: Arc<Metrics>,
    done: watch::Sender<bool>,
    /// The epoch, published on every change: a task talking to the servers of an older
    /// epoch (a cut) gives up at once rather than wait out a deadline on a dead member.
    epochs: watch::Sender<u64>,
    /// etcd membership: this coordinator's leadership and record.
    durable: Option<durable::Durable>,
    /// Wakes the control loop before its tick when a grant made work for it (an own
    /// save fell due): the save is asked for at once, not up to a tick (20 ms, several
    /// short steps) after its turn.
    wake: tokio::sync::Notify,
    testing: start::TestHooks,
    faults: ftrec_faults::Faults,
}

impl Shared {
    /// A kill armed at `point`: a process is gone at once; a simulated coordinator stops
    /// here for good (its host is crashed between ticks), doing nothing more.
    pub(crate) async fn die_at(&self, point: &str) {
        self.die_at_step(point, None).await;
    }

    /// [`Self::die_at`] at a point that passes a step (a spec naming one fires there only).
    pub(crate) async fn die_at_step(&self, point: &str, step: Option<u64>) {
        if self.faults.kill_at(point, step) {
            std::future::pending::<()>().await;
        }
    }

    /// Publishes a new epoch (the caller changed `State::epoch` under the lock).
    fn epoch_moved(&self, epoch: u64) {
        self.epochs.send_replace(epoch);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock is a bug; the state is still the best we have.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn event(&self, kind: EventKind, detail: impl Into<String>) -> f64 {
        self.lock().timeline.event(kind, detail)
    }

    /// Records an event about one member (a kill, a failure).
    pub fn event_about(
        &self,
        kind: EventKind,
        subject: Subject,
        step: Option<u64>,
        detail: impl Into<String>,
    ) -> f64 {
        self.lock()
            .timeline
            .event_about(kind, subject, step, detail)
    }

    pub fn timeline(&self) -> TimelineData {
        self.lock().timeline.data.clone()
    }

    pub fn server_addresses(&self) -> Vec<String> {
        self.lock().placement.servers.clone()
    }

    pub fn pid_of(&self, role: Role, id: usize) -> Option<u32> {
        self.lock().members.pid_of(role, id)
    }

    /// The process of server slot `id` while it recovers: rebuilding in the background
    /// (erasure coding with 2PC: the slot serves degraded meanwhile), else in its running
    /// recovery (a restore, a blocking rebuild). `None` when the slot is not recovering or
    /// has no process. It may still be the dead process until the replacement is known:
    /// the caller compares it with the one it killed.
    pub fn recovering_pid(&self, id: usize) -> Option<u32> {
        let s = self.lock();
        let background = self.job.config.two_phase_commit();
        // Not a slot merely declared dead: its recovery task is running (`busy`), so a
        // restore or a blocking rebuild is under way.
        let recovering = if background {
            s.recovery.rebuilding.iter().any(|&(r, _)| r == id)
        } else {
            s.busy && s.recovery.failed.iter().any(|&(f, _)| f == id)
        };
        recovering
            .then(|| s.members.pid_of(Role::Server, id))
            .flatten()
    }

    /// The pids of the spares that wait for a slot (not yet given one).
    pub fn waiting_spare_pids(&self) -> Vec<u32> {
        self.lock().members.waiting_spare_pids()
    }

    /// The largest peak resident set a spare reported while it waited.
    pub fn waiting_spare_peak(&self) -> Option<u64> {
        self.lock().members.waiting_spare_peak()
    }

    /// Seconds since the timeline began: the clock of every event and recovery.
    pub fn now(&self) -> f64 {
        self.lock().timeline.now()
    }

    pub fn summary(&self) -> RunSummary {
        let s = self.lock();
        let start = s
            .timeline
            .data
            .events
            .iter()
            .find(|e| e.kind == EventKind::TrainingStart)
            .map_or(0.0, |e| e.t);
        let end = s
            .timeline
            .data
            .events
            .iter()
            .find(|e| e.kind == EventKind::TrainingEnd)
            .map_or_else(|| s.timeline.now(), |e| e.t);
        let seconds = (end - start + s.leader.train_seconds_before).max(1e-9);
        RunSummary {
            steps: s.steps.ledger.next_step(),
            resumed_from_step: s.scaling.resumed_from.as_ref().map_or(0, |r| r.step),
            resumed_from_servers: s.scaling.resumed_from.as_ref().map(|r| r.servers),
            resumed_from: s.scaling.resumed_from.as_ref().map(|r| r.location.clone()),
            servers: s.scaling.servers,
            moves: s.scaling.moves.clone(),
            samples: s.steps.samples,
            lost_samples: s.steps.lost_samples,
            zombies_refused: s.members.zombies.len() as u64,
            train_seconds: seconds,
            samples_per_sec: s.steps.samples as f64 / seconds,
            rpc_bytes: s.steps.rpc_bytes,
            rpc_bytes_per_sample: s.steps.rpc_bytes as f64 / s.steps.samples.max(1) as f64,
            server_rpcs: s.members.served.values().map(|v| v.0).sum(),
            server_rpc_bytes: s.members.served.values().map(|v| v.1).sum(),
            epoch: s.epoch,
            checkpoints: s.saves.checkpoints.clone(),
            last_step_at: s.steps.last_step_at,
            recovery_seconds: s
                .recovery
                .recoveries
                .iter()
                .fold(0.0, |acc, r| acc + (r.resumed_at - r.detected_at)),
            recoveries: s.recovery.recoveries.clone(),
            unrecorded_recoveries: s.recovery.unrecorded_kept.clone(),
            steps_rolled_back: s.recovery.steps_rolled_back,
            pls: s.cuts.cpr.as_ref().map(|c| c.pls()),
            recovery_mode: s.cuts.cpr.as_ref().map(|c| {
                if c.partial() {
                    ftrec_cpr::Recovery::Partial
                } else {
                    ftrec_cpr::Recovery::Full
                }
            }),
            cpr_decision: s.cuts.cpr.as_ref().and_then(|c| c.decision().cloned()),
            replan: s.cuts.replan.clone(),
            cpr_priority: s.cuts.cpr.as_ref().and_then(|c| c.priority_report()),
            lease_ttl_seconds: self.durable.as_ref().map(|d| d.ttl.as_secs_f64()),
            coordinator_failovers: self.durable.as_ref().map(|_| s.leader.failovers.clone()),
            coordinator: self.durable.as_ref().map(|d| d.id.clone()),
        }
    }

    /// SIGKILLs `role` `id` as soon as global step `step` is granted (failure injection at
    /// an exact point of the schedule, for tests and benchmarks).
    pub fn kill_at_step(&self, role: Role, id: usize, step: u64) {
        self.lock().steps.kill_at(role, id, step);
    }

    /// Asks for a move to `servers` servers once step `step` is reached (as `ftrec
    /// cluster scale` would, at an exact point of the schedule, for tests and benchmarks).
    pub fn scale_at_step(&self, step: u64, servers: usize) {
        self.lock().scaling.scheduled.push((step, servers));
    }

    /// Fires the step kills that `granted` reached.
    fn fire_step_kills(&self, s: &mut State, granted: u64) {
        for (role, id) in s.steps.kills_due(granted) {
            let Some(pid) = s.members.pid_of(role, id) else {
                s.timeline.event(
                    EventKind::KillSkipped,
                    format!("{} {id}: no such process", role_name(role)),
                );
                continue;
            };
            match sigkill(pid) {
                Ok(()) => s.timeline.event_about(
                    EventKind::Killed,
                    subject(role, id),
                    Some(granted),
                    format!(
                        "{} {id} (pid {pid}) by SIGKILL at step {granted}",
                        role_name(role)
                    ),
                ),
                Err(e) => s.timeline.event(
                    EventKind::Error,
                    format!("{} {id} (pid {pid}): kill failed: {e}", role_name(role)),
                ),
            };
        }
    }

    /// Whether this coordinator learned that another one leads the job now: its run ended
    /// without changing anything, and the job goes on under the new leader.
    pub fn is_deposed(&self) -> bool {
        self.lock().leader.deposed
    }

    /// Tells every process to exit (heartbeat replies carry `stop`).
    pub fn stop(&self) {
        self.lock().stopping = true;
    }

    /// Ends the run with `why`: every waiter learns it is over.
    fn fail_run(&self, s: &mut State, why: String) {
        s.fail_run(why);
        self.done.send_replace(true);
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
            reuse_gradients: false,
        };
        let (epoch, version) = (s.epoch, s.placement.version);
        if s.stopping || s.phase == Phase::Done {
            return NextStepReply {
                action: Action::Stop as i32,
                ..wait(epoch, version)
            };
        }
        // A leader whose lease may have expired grants only while the job is healthy, and
        // only where the servers' fences make that safe (`grants_through_outage`): another
        // may lead now, and a step granted to a server that dies is lost until this one
        // can declare it (64 in a row ended the job: issue 42, hole 2).
        let decides = self.testing.grant_without_lease_check || self.may_decide();
        let granting = matches!(s.phase, Phase::Running | Phase::Checkpointing)
            && (decides || self.grants_through_outage(s));
        if !granting || s.recovery.suspecting(Instant::now()) {
            return wait(epoch, version);
        }
        // A move to another server count takes its cut at this boundary when it may, and
        // holds fresh steps back from then until its switch. Neither starts while etcd
        // does not answer: both end in decisions only etcd can record.
        if decides
            && s.phase == Phase::Running
            && s.scaling.pending.is_none()
            && let Some(to) = s.scaling.scheduled_due(s.steps.ledger.next_step())
            && let Err(e) = scale::ask(self, s, to)
        {
            s.timeline.event(EventKind::Error, e.to_string());
        }
        let held = decides && s.phase == Phase::Running && scale::take_cut(s);
        if decides
            && s.phase == Phase::Running
            && !held
            && let Some(due) = self.cut_due(s)
        {
            if s.steps.ledger.next_step() >= s.steps.ledger.total() {
                s.cuts.final_cut_started();
            }
            match due {
                // Own saves pause nothing: the control loop asks the servers now, and
                // granting goes on.
                SaveDue::Own(servers) => {
                    let next = s.steps.ledger.next_step();
                    s.saves.last_save = Some(next);
                    if let Some(own) = s.cuts.own_saves.as_mut() {
                        own.request(servers, next);
                        self.wake.notify_one();
                    }
                }
                SaveDue::Cut { priority } => {
                    s.phase = Phase::Checkpointing;
                    s.cuts.pause(priority, Instant::now());
                }
            }
        }
        // Regrants go out even while a cut waits: the cut needs them settled.
        // In deterministic mode steps apply strictly in order: a fresh step granted while
        // an earlier one waits to be resolved would wait on it forever.
        let moving = held || s.scaling.holds_steps();
        let fresh = s.phase == Phase::Running
            && !moving
            && !(self.job.config.cluster.deterministic && s.steps.ledger.has_orphans());
        let c = &self.job.config.cluster;
        let own_first = !c.deterministic;
        // An asynchronous worker whose own lost step is about to be resolved (nothing holds
        // the resolution back) waits for it rather than take a fresh step, which would
        // overwrite the gradients it could push again: a resolution takes one round of
        // calls, a step computed again about 50 ms.
        let now = Instant::now();
        if own_first
            && c.ft.erasure_coded()
            && s.phase == Phase::Running
            && s.steps.ledger.holds_unresolved(worker)
            && !(s.recovery.suspecting(now) || s.steps.resolving_waits(now))
        {
            return wait(epoch, version);
        }
        if let Some(taken) = s
            .steps
            .ledger
            .take_preferring(worker, epoch, fresh, own_first)
        {
            let step = taken.step;
            // A rollback (ec+checkpoint past what the code rebuilds) rewinds the ledger,
            // which forgets every loss: a step lost before it is computed again.
            let reuse_gradients = taken.own_loss && c.ft.erasure_coded();
            self.fire_step_kills(s, step);
            if let Some(on_grant) = &self.testing.on_grant {
                on_grant(epoch, step);
            }
            return NextStepReply {
                action: Action::Train as i32,
                step,
                epoch,
                wait_ms: 0,
                placement_version: version,
                reuse_gradients,
            };
        }
        // A background rebuild finishes before the run ends, so the model gathered and
        // its parity verified are whole, and the report has the rebuild's figures.
        // So does the final cut: the end of the job is kept. The end is a decision: with
        // the lease in doubt the workers wait (told to stop then, they had exited, and
        // the leader that took over when etcd returned had no worker to end the job).
        if decides
            && s.steps.ledger.done()
            && s.recovery.rebuilding.is_empty()
            && !self.final_cut_outstanding(s)
        {
            s.phase = Phase::Done;
            let steps = s.steps.ledger.next_step();
            if !self.final_cut_kept(s) {
                let newest = s
                    .saves
                    .last_checkpoint
                    .map_or("none".to_string(), |c| format!("step {c}"));
                s.timeline.event(
                    EventKind::Error,
                    format!(
                        "the final cut of step {steps} failed {} times; the job's newest \
                         cut is {newest}",
                        state::FINAL_CUT_TRIES
                    ),
                );
            }
            s.timeline
                .event(EventKind::TrainingEnd, format!("{steps} steps"));
            self.done.send_replace(true);
            return NextStepReply {
                action: Action::Stop as i32,
                ..wait(epoch, version)
            };
        }
        wait(epoch, version)
    }

    /// Counts a step every server applied.
    fn settled(&self, s: &mut State, step: u64) {
        let (_, n) = self.schedule.batch(step);
        if let Some(text) = s.leader.step_settled(durable::unix_now) {
            s.timeline.event(EventKind::Coordinator, text);
        }
        s.timeline.samples(n);
        let now = s.timeline.now();
        s.steps.settled(n, now);
        self.metrics.add("ftrec_samples_total", n);
        self.metrics.add("ftrec_steps_total", 1);
    }

    /// Which checkpoint, if any, is due at the next fresh step.
    fn cut_due(&self, s: &State) -> Option<SaveDue> {
        let next = s.steps.ledger.next_step();
        if next >= s.steps.ledger.total() {
            return self.final_cut_due(s);
        }
        let may_save = self.job.config.cluster.ft.checkpoints()
            && next > 0
            && s.saves.last_save != Some(next)
            && s.saves.pending().is_none()
            // A slot rebuilding in the background has no complete shard to cut yet.
            && s.recovery.rebuilding.is_empty();
        let have_cut = s.saves.last_checkpoint.is_some();
        s.cuts
            .due(&self.job, next, Instant::now(), may_save, have_cut)
    }
}

/// The timeline's name for a member.
pub fn subject(role: Role, id: usize) -> Subject {
    match role {
        Role::Worker => Subject::Worker(id as u32),
        Role::Server | Role::Unspecified => Subject::Server(id as u32),
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

/// Freezes `pid` (SIGSTOP): the process keeps its sockets but answers nothing, as a
/// host that went silent.
pub fn sigstop(pid: u32) -> Result<(), std::io::Error> {
    let pid =
        rustix::process::Pid::from_raw(pid as i32).ok_or_else(|| std::io::Error::other("pid 0"))?;
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).map_err(Into::into)
}

/// Replacements of one worker slot before the run is declared failed (a crash loop).
const MAX_RESPAWNS: u32 = 3;
