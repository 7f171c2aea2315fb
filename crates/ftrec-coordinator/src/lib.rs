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
//! `ledger.rs` grants steps; `tasks.rs` executes plans against the servers. Folders:
//! `cpr/` holds partial recovery's accounting and its uncoordinated saves, `leader/` the
//! durable record and the takeover of a standby.

mod control;
mod cpr;
mod leader;
pub mod ledger;
pub mod planner;
mod recovery;
pub mod replan;
mod service;
#[cfg(test)]
mod sim_tests;
mod start;
mod summary;
mod tasks;

use cpr::own_saves;
use leader::{durable, takeover};

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use serde::Serialize;
use tokio::sync::watch;
use tonic::Status;

use ftrec_proto::placement::PlacementMap;
use ftrec_proto::proto::coordinator_server::CoordinatorServer;
use ftrec_proto::proto::next_step_reply::Action;
use ftrec_proto::proto::*;
use ftrec_proto::timeline::{EventKind, Subject, Timeline, TimelineData};
use ftrec_rpc::PsError;
use ftrec_rpc::job::{Job, Schedule};
use ftrec_rpc::metrics::{self, Metrics};
use ledger::StepLedger;
pub use start::{CoordinatorOptions, Handle, start};
pub use summary::{CheckpointRecord, Failover, Recovery, RunSummary};

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
    /// A probe found nothing listening at its address: dead, without waiting for its
    /// heartbeats to time out.
    refused: bool,
    /// Which join of the slot this is (`JoinReply.incarnation`): an older process of the
    /// slot that comes back (a zombie) is told apart by it.
    incarnation: u64,
    /// Workers cannot reach it, though it answers the coordinator (a partition): why it is
    /// to be declared dead.
    cut_off: Option<String>,
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

struct State {
    phase: Phase,
    epoch: u64,
    placement: PlacementMap,
    servers: Vec<Member>,
    spares: Vec<Spare>,
    workers: Vec<Member>,
    steps: StepLedger,
    samples: u64,
    lost_samples: u64,
    /// Incarnations of processes refused after being declared dead.
    zombies: std::collections::BTreeSet<u64>,
    /// Lost steps in a row whose worker could not reach this server (reset by any step
    /// that finishes).
    unreachable_reports: std::collections::BTreeMap<usize, u32>,
    rpc_bytes: u64,
    last_checkpoint: Option<u64>,
    /// The newest committed checkpoint of any kind (a cut or a CPR prioritised save).
    last_save: Option<u64>,
    /// The cut being taken is a CPR prioritised save.
    cut_priority: bool,
    /// `cpr.uncoordinated`: every server's own saves and schedule.
    own_saves: Option<own_saves::OwnSaves>,
    /// `checkpoint.planned_mtbf_seconds`: the cut interval re-planned at each failure.
    replan: Option<replan::Replan>,
    pause_started: Option<Instant>,
    checkpoints: Vec<CheckpointRecord>,
    /// The committed cuts still on disk, oldest first (`checkpoint.keep` of them at most).
    retained_cuts: Vec<CheckpointRecord>,
    /// After a failed cut: no new one before this instant, and the wait after the next
    /// failure (doubling, bounded), so a full disk is neither hammered nor logged 45 times a
    /// second.
    checkpoint_backoff: Option<(Instant, Duration)>,
    /// The step of a cut that did not count (abandoned by a new epoch, failed, or dropped
    /// while committing) when training did not roll back past it: with
    /// `checkpoint.every_steps` the cut is due again at the first fresh step at or past it
    /// ([`step_cut_due`]), not a whole interval later. A job with erasure coding under its
    /// cuts (`ec+checkpoint`) loses no steps to a failure, so otherwise a failure during a
    /// cut left it without a new one for twice the interval. Cleared by a committed cut at or
    /// past it.
    cut_owed: Option<u64>,
    /// When the last consistent cut committed (or training started): the clock of
    /// `checkpoint.every_seconds`.
    last_cut_at: Instant,
    /// A cut every server has copied, committing in the background (DECK, IncrCP): it
    /// becomes the rollback target once every server confirms. No new cut starts before.
    pending_cut: Option<CheckpointRecord>,
    /// Not asked about again before this.
    confirm_after: Option<Instant>,
    /// When the pending cut was copied: one that does not commit within the RPC timeout
    /// fails.
    pending_since: Option<Instant>,
    /// Recovery attempts that failed in a row, and when to try the next.
    recovery_failures: u32,
    recover_after: Option<Instant>,
    /// Kills to fire when a step is granted (`--kill server:1@step:8`): role, id, step.
    step_kills: Vec<(Role, usize, u64)>,
    /// The last prune failed (said once, until one succeeds).
    prune_failing: bool,
    /// Orphan steps are not asked about again before this (a server did not answer).
    resolve_after: Option<Instant>,
    /// Slots waiting for their replacement, with the detection time.
    failed: Vec<(usize, f64)>,
    /// Servers rebuilding in the background, with the epoch their rebuild began in.
    rebuilding: Vec<(usize, u64)>,
    recoveries: Vec<Recovery>,
    timeline: Timeline,
    stopping: bool,
    busy: bool,
    next_token: u32,
    worker_respawns: Vec<u32>,
    /// A worker lost a step to a server error: no new grants until the failure detector
    /// confirms a failure (or this passes), so the schedule is not burnt on a dead server.
    suspect_until: Option<Instant>,
    /// Per server process (incarnation): the RPCs it served and their payload bytes, as
    /// its latest heartbeat said.
    served: std::collections::HashMap<u64, (u64, u64)>,
    /// A worker's call to a server failed: probe the servers' ports (`control.rs`).
    probe_requested: bool,
    /// Why the run cannot go on (a crash loop); ends it with this error.
    fatal: Option<String>,
    /// Steps lost since one last finished (`service.rs` gives up past a bound).
    lost_in_a_row: u32,
    /// Steps trained again after rollbacks, over the run: once per rollback, whether a
    /// server's failure or a partly applied step caused it (a recovery record exists only
    /// for a failed server, and several failed at once share one rollback).
    steps_rolled_back: u64,
    /// `cluster.ft = "partial"`: PLS, interval and the full-or-partial choice.
    cpr: Option<cpr::CprState>,
    /// etcd membership: this coordinator learned it no longer leads.
    deposed: bool,
    /// Seconds trained under earlier leaders (etcd membership), failovers included.
    train_seconds_before: f64,
    /// When the last step so far was counted, on the timeline's clock.
    last_step_at: Option<f64>,
    /// Takeovers by standbys over the job's life; the last one's time is filled in when
    /// its first step settles (`failover_since_unix`: the old leader's last write).
    failovers: Vec<Failover>,
    failover_since_unix: Option<f64>,
    /// Training had started under an earlier leader.
    taken_over_started: bool,
}

impl State {
    /// Seconds since training started (0 before).
    fn train_seconds(&self) -> f64 {
        self.timeline
            .data
            .events
            .iter()
            .find(|e| e.kind == EventKind::TrainingStart)
            .map_or(0.0, |e| self.timeline.now() - e.t)
    }

    /// The pid of the process that joined as `role` `id`, if any.
    fn pid_of(&self, role: Role, id: usize) -> Option<u32> {
        let m = match role {
            Role::Server => self.servers.get(id),
            Role::Worker => self.workers.get(id),
            Role::Unspecified => None,
        }?;
        (m.joined && m.pid != 0).then_some(m.pid)
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
}

impl Shared {
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
        self.lock().pid_of(role, id)
    }

    /// The pids of the spares that wait for a slot (not yet given one).
    pub fn waiting_spare_pids(&self) -> Vec<u32> {
        self.lock()
            .spares
            .iter()
            .filter(|s| s.assigned.is_none() && s.member.pid != 0)
            .map(|s| s.member.pid)
            .collect()
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
        let seconds = (end - start + s.train_seconds_before).max(1e-9);
        RunSummary {
            steps: s.steps.next_step(),
            samples: s.samples,
            lost_samples: s.lost_samples,
            zombies_refused: s.zombies.len() as u64,
            train_seconds: seconds,
            samples_per_sec: s.samples as f64 / seconds,
            rpc_bytes: s.rpc_bytes,
            rpc_bytes_per_sample: s.rpc_bytes as f64 / s.samples.max(1) as f64,
            server_rpcs: s.served.values().map(|v| v.0).sum(),
            server_rpc_bytes: s.served.values().map(|v| v.1).sum(),
            epoch: s.epoch,
            checkpoints: s.checkpoints.clone(),
            last_step_at: s.last_step_at,
            recovery_seconds: s
                .recoveries
                .iter()
                .fold(0.0, |acc, r| acc + (r.resumed_at - r.detected_at)),
            recoveries: s.recoveries.clone(),
            steps_rolled_back: s.steps_rolled_back,
            pls: s.cpr.as_ref().map(|c| c.pls()),
            recovery_mode: s
                .cpr
                .as_ref()
                .map(|c| if c.partial() { "partial" } else { "full" }),
            cpr_decision: s.cpr.as_ref().and_then(|c| c.decision().cloned()),
            replan: s.replan.clone(),
            cpr_priority: s.cpr.as_ref().and_then(|c| c.priority_report()),
            lease_ttl_seconds: self.durable.as_ref().map(|d| d.ttl.as_secs_f64()),
            coordinator_failovers: self.durable.as_ref().map(|_| s.failovers.clone()),
            coordinator: self.durable.as_ref().map(|d| d.id.clone()),
        }
    }

    /// SIGKILLs `role` `id` as soon as global step `step` is granted (failure injection at
    /// an exact point of the schedule, for tests and benchmarks).
    pub fn kill_at_step(&self, role: Role, id: usize, step: u64) {
        self.lock().step_kills.push((role, id, step));
    }

    /// Fires the step kills that `granted` reached.
    fn fire_step_kills(&self, s: &mut State, granted: u64) {
        let (due, rest): (Vec<_>, Vec<_>) = s
            .step_kills
            .iter()
            .copied()
            .partition(|&(_, _, step)| step <= granted);
        s.step_kills = rest;
        for (role, id, _) in due {
            let Some(pid) = s.pid_of(role, id) else {
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
        // A leader whose lease may have expired grants nothing: another may lead now.
        let granting = matches!(s.phase, Phase::Running | Phase::Checkpointing) && self.leading();
        if !granting || s.suspect_until.is_some_and(|t| Instant::now() < t) {
            return wait(epoch, version);
        }
        if s.phase == Phase::Running
            && let Some(due) = self.cut_due(s)
        {
            match due {
                // Own saves pause nothing: the control loop asks the servers now, and
                // granting goes on.
                SaveDue::Own(servers) => {
                    let next = s.steps.next_step();
                    s.last_save = Some(next);
                    if let Some(own) = s.own_saves.as_mut() {
                        own.request(servers, next);
                        self.wake.notify_one();
                    }
                }
                SaveDue::Cut { priority } => {
                    s.cut_priority = priority;
                    s.phase = Phase::Checkpointing;
                    s.pause_started = Some(Instant::now());
                }
            }
        }
        // Regrants go out even while a cut waits: the cut needs them settled.
        // In deterministic mode steps apply strictly in order: a fresh step granted while
        // an earlier one waits to be resolved would wait on it forever.
        let fresh = s.phase == Phase::Running
            && !(self.job.config.cluster.deterministic && s.steps.has_orphans());
        if let Some(step) = s.steps.take(worker, epoch, fresh) {
            if !s.step_kills.is_empty() {
                self.fire_step_kills(s, step);
            }
            return NextStepReply {
                action: Action::Train as i32,
                step,
                epoch,
                wait_ms: 0,
                placement_version: version,
            };
        }
        // A background rebuild finishes before the run ends, so the model gathered and
        // its parity verified are whole, and the report has the rebuild's figures.
        if s.steps.done() && s.rebuilding.is_empty() {
            s.phase = Phase::Done;
            let steps = s.steps.next_step();
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
        if let Some(since) = s.failover_since_unix.take()
            && let Some(f) = s.failovers.last_mut()
        {
            let now = durable::unix_now();
            f.failover_seconds = (now - since).max(0.0);
            f.first_step_at_unix = Some(now);
            let text = format!(
                "first step settled under {} {:.3} s after {}'s last write to etcd",
                f.to, f.failover_seconds, f.from
            );
            s.timeline.event(EventKind::Coordinator, text);
        }
        s.samples += n;
        s.timeline.samples(n);
        s.last_step_at = Some(s.timeline.now());
        self.metrics.add("ftrec_samples_total", n);
        self.metrics.add("ftrec_steps_total", 1);
    }

    /// Which checkpoint, if any, is due at the next fresh step.
    fn cut_due(&self, s: &State) -> Option<SaveDue> {
        let c = &self.job.config;
        let every = c.checkpoint.every_steps;
        let next = s.steps.next_step();
        let now = Instant::now();
        let may_save = c.cluster.ft.checkpoints()
            && next > 0
            && s.last_save != Some(next)
            && s.pending_cut.is_none()
            // A slot rebuilding in the background has no complete shard to cut yet.
            && s.rebuilding.is_empty()
            && next < s.steps.total()
            && s.checkpoint_backoff
                .is_none_or(|(until, _)| Instant::now() >= until);
        if let Some(own) = &s.own_saves {
            // Servers whose save is asked for or running are not due again (`due`).
            let servers = own.due(next, every, now);
            return (may_save && !servers.is_empty()).then_some(SaveDue::Own(servers));
        }
        // CPR with a target PLS sets the interval in seconds (Eq. 4); else
        // `checkpoint.every_seconds` of wall time; else every N steps.
        let cut = match s.cpr.as_ref().filter(|cpr| cpr.interval().is_some()) {
            Some(cpr) => cpr.cut_due(now),
            None => match c.checkpoint.every_seconds {
                Some(planned) => {
                    let seconds = s.replan.as_ref().map_or(planned, |r| r.every_seconds);
                    now.duration_since(s.last_cut_at).as_secs_f64() >= seconds
                }
                None => step_cut_due(next, every, s.cut_owed),
            },
        };
        // Prioritised saves go between cuts, once a cut exists to save against.
        let priority = !cut
            && s.last_checkpoint.is_some()
            && s.cpr
                .as_ref()
                .is_some_and(|cpr| cpr.priority_due(now, next, every));
        (may_save && (cut || priority)).then_some(SaveDue::Cut { priority })
    }
}

/// With `checkpoint.every_steps = every`: a cut is due at every multiple of it, and at
/// the first fresh step at or past `owed`, the step of a cut that did not count.
fn step_cut_due(next: u64, every: u64, owed: Option<u64>) -> bool {
    every > 0 && (next.is_multiple_of(every) || owed.is_some_and(|o| next >= o))
}

/// Notes that the coordinated cut of `step` did not count: it is owed (see
/// [`State::cut_owed`]). Prioritised saves owe nothing: the next one comes on its own.
fn owe_cut(s: &mut State, step: u64, priority: bool) {
    if !priority {
        s.cut_owed = Some(s.cut_owed.map_or(step, |o| o.min(step)));
    }
}

/// What [`Shared::cut_due`] found due.
enum SaveDue {
    /// A cut of every server (or CPR's prioritised save): granting pauses for it.
    Cut { priority: bool },
    /// `cpr.uncoordinated`: these servers' own saves, taken while training goes on.
    Own(Vec<usize>),
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

#[cfg(test)]
mod cut_schedule_tests {
    use super::step_cut_due;

    #[test]
    fn an_owed_cut_is_due_at_the_first_fresh_step_at_or_past_it() {
        // Every 40 steps, nothing owed: the multiples only.
        assert!(step_cut_due(40, 40, None));
        assert!(!step_cut_due(41, 40, None));
        // The cut of step 40 did not count and training went on (no rollback): due at
        // once, not at 80.
        assert!(step_cut_due(41, 40, Some(40)));
        assert!(step_cut_due(57, 40, Some(40)));
        // Rolled back to an older cut: not due before the owed step comes round again.
        assert!(!step_cut_due(21, 40, Some(40)));
        assert!(step_cut_due(40, 40, Some(40)));
        // No interval in steps: never.
        assert!(!step_cut_due(50, 0, Some(40)));
    }
}
