//! The control loop: failure detection, and the work it plans (cuts, recoveries, orphan
//! resolution), decided under the lock and run by `tasks` after releasing it.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::planner::{self, Cause, RecoveryAction, Situation};
use crate::tasks::run_task;
use crate::{MAX_RESPAWNS, Member, Phase, Shared, State};
use ftrec_proto::timeline::{EventKind, Subject};

/// Work the control loop decided on under the lock and runs after releasing it.
pub(super) enum Task {
    Checkpoint {
        epoch: u64,
        step: u64,
        /// CPR: a prioritised save rather than a cut.
        priority: bool,
    },
    /// `cpr.uncoordinated`: these servers save their own shards while training goes on;
    /// `step` is the first step not granted when they became due.
    OwnSaves {
        epoch: u64,
        step: u64,
        servers: Vec<usize>,
    },
    Recover {
        epoch: u64,
        action: RecoveryAction,
    },
    /// Ask every server which of these orphan steps it applied.
    Resolve {
        epoch: u64,
        steps: Vec<u64>,
    },
    /// Ask every server whether its part of the cut at `step` is committed.
    ConfirmCut {
        epoch: u64,
        step: u64,
    },
}

pub(super) async fn control_loop(shared: Arc<Shared>) {
    let tick = Duration::from_millis(20);
    let timeout = Duration::from_millis(shared.job.config.cluster.failure_timeout_ms);
    let mut last_tick = tokio::time::Instant::now();
    loop {
        // A wake-up stored while the loop was busy ends the next wait at once.
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = shared.wake.notified() => {}
        }
        let stalled = std::mem::replace(&mut last_tick, tokio::time::Instant::now()).elapsed();
        let task = {
            let mut s = shared.lock();
            if stalled > timeout / 2 {
                forgive_own_stall(&mut s, stalled);
            }
            if s.stopping && s.phase == Phase::Done {
                // Keep answering heartbeats with `stop` until the process exits.
                continue;
            }
            if std::mem::take(&mut s.probe_requested) {
                let targets: Vec<(usize, String)> = s
                    .servers
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.joined && m.alive && !m.address.is_empty())
                    .map(|(id, m)| (id, m.address.clone()))
                    .collect();
                tokio::spawn(probe_servers(shared.clone(), targets));
            }
            // A coordinator that may no longer lead decides nothing (etcd membership).
            if !shared.leading() {
                continue;
            }
            // Declaring a member dead is a decision: with etcd membership, only while the
            // lease is surely this coordinator's. One that was frozen or cut off past its
            // lease learns it was deposed before it could fence live members.
            if shared.may_decide() {
                detect_failures(&shared, &mut s);
            }
            if s.busy { None } else { plan(&shared, &mut s) }
        };
        if let Some(task) = task {
            let shared = shared.clone();
            tokio::spawn(async move {
                // Own saves run beside other tasks (they never set `busy`: a recovery may
                // start meanwhile, and a new epoch abandons them).
                let own_saves = match &task {
                    Task::OwnSaves { servers, .. } => Some(servers.clone()),
                    _ => None,
                };
                run_task(&shared, task).await;
                let mut s = shared.lock();
                match own_saves {
                    // However they ended (done, abandoned, never sent), these servers'
                    // next saves may come.
                    Some(servers) => {
                        if let Some(own) = s.own_saves.as_mut() {
                            own.finished(&servers);
                        }
                    }
                    None => s.busy = false,
                }
            });
        }
    }
}

/// A worker's call to a server failed: connect to every server's port. "Connection
/// refused" means no process listens there (a SIGKILLed server's socket is closed by the
/// kernel at once), so that server is dead now, not after its heartbeats time out. A
/// probe that gets no answer either way decides nothing; the heartbeats still do.
async fn probe_servers(shared: Arc<Shared>, targets: Vec<(usize, String)>) {
    let network = shared.job.network().clone();
    let probes = targets.into_iter().map(|(id, address)| {
        let network = network.clone();
        async move {
            let attempt =
                tokio::time::timeout(Duration::from_millis(300), network.connect(&address)).await;
            let refused =
                matches!(attempt, Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused);
            (id, address, refused)
        }
    });
    for (id, address, refused) in futures::future::join_all(probes).await {
        if !refused {
            continue;
        }
        let mut s = shared.lock();
        let m = &mut s.servers[id];
        // The slot may have a new process by now.
        if m.alive && m.address == address {
            m.refused = true;
            s.timeline.event(
                EventKind::SuspicionConfirmed,
                format!("server {id}: connection to {address} refused"),
            );
        }
    }
}

/// This coordinator did not run for `stalled` (SIGSTOP, a host that swapped or lost its
/// CPU): the members' silence over that time is its own, not theirs. Each gets a fresh
/// failure timeout; one that is really gone is declared dead one timeout later.
fn forgive_own_stall(s: &mut State, stalled: Duration) {
    let now = tokio::time::Instant::now();
    for m in s.servers.iter_mut().chain(s.workers.iter_mut()) {
        if m.last_seen.is_some() {
            m.last_seen = Some(now);
        }
    }
    for spare in s.spares.iter_mut() {
        if spare.member.last_seen.is_some() {
            spare.member.last_seen = Some(now);
        }
    }
    s.timeline.event(
        EventKind::Coordinator,
        format!(
            "this coordinator did not run for {stalled:?}: the members' silence over that time \
             is not counted against them"
        ),
    );
}

fn detect_failures(shared: &Shared, s: &mut State) {
    let c = &shared.job.config.cluster;
    let timeout = Duration::from_millis(c.failure_timeout_ms);
    if s.phase == Phase::Done {
        return;
    }
    // A server that went silent or refused connections explains the steps lost meanwhile:
    // "cut off" evidence gathered then against another server is void (a call relayed
    // through the dying one failed, say), and if the partition is real the new epoch's
    // reports show it again. Declaring both lost two servers of a group at once.
    let dying = |m: &crate::Member| m.joined && m.alive && (m.silent_for() > timeout || m.refused);
    if s.servers.iter().any(dying) {
        for m in s.servers.iter_mut().filter(|m| !dying(m)) {
            m.cut_off = None;
        }
        s.unreachable_reports.clear();
    }
    for id in 0..s.servers.len() {
        let m = &s.servers[id];
        let silent = m.silent_for();
        if !(m.joined && m.alive && (silent > timeout || m.refused || m.cut_off.is_some())) {
            continue;
        }
        let why = if let Some(why) = &m.cut_off {
            why.clone()
        } else if m.refused {
            format!(
                "its port refused a connection after a worker's call failed (silent for {silent:?})"
            )
        } else {
            format!("silent for {silent:?}")
        };
        s.servers[id].alive = false;
        s.servers[id].ready = false;
        // Its background rebuild (if any) died with it; its replacement starts afresh.
        s.rebuilding.retain(|&(r, _)| r != id);
        s.epoch += 1;
        shared.epoch_moved(s.epoch);
        shared.metrics.add("ftrec_failures_total", 1);
        shared.metrics.set("ftrec_epoch", s.epoch as f64);
        let t = s.timeline.event_about(
            EventKind::FailureDetected,
            Subject::Server(id as u32),
            None,
            format!("server {id} {why}; epoch {}", s.epoch),
        );
        s.failed.push((id, t));
        s.suspect_until = None;
        // `ec+checkpoint` rebuilds a lost server from the survivors and keeps its state
        // too; it rolls back only when more of a group is lost than the code rebuilds, and
        // that rewind clears the orphans. (Forgetting its steps in flight here lost them
        // for good: found by the simulated cluster, `ftrec-sim`.)
        let keeps_state = !c.ft.checkpoints()
            || c.ft.erasure_coded()
            || s.cpr.as_ref().is_some_and(|cpr| cpr.partial());
        if keeps_state {
            // The run keeps its state: steps in flight are resolved after recovery (granted
            // again, or settled where every server applied them).
            s.steps.orphan_outstanding();
        } else {
            // A rollback trains every step from the cut again: late reports of the steps in
            // flight must count nothing.
            s.steps.forget_outstanding();
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
        // Its steps are resolved with the servers and granted again: never skipped.
        let held = s.steps.worker_died(id);
        s.timeline.event(
            EventKind::WorkerFailureDetected,
            format!("worker {id}; {held} granted steps to resolve"),
        );
        s.worker_respawns[id] += 1;
        if s.worker_respawns[id] > MAX_RESPAWNS {
            let why = format!(
                "worker {id} failed {} times; giving up (see its log)",
                s.worker_respawns[id]
            );
            s.timeline.event(EventKind::Fatal, why.clone());
            s.fatal = Some(why);
            s.phase = Phase::Done;
            shared.done.send_replace(true);
            return;
        }
        if let Some(sp) = &shared.spawner
            && let Err(e) = sp.spawn_worker(id, &shared.address)
        {
            s.timeline
                .event(EventKind::ReplacementFailed, format!("worker {id}: {e}"));
        }
    }
}

pub(super) fn replace_server(shared: &Shared, s: &mut State, id: usize) {
    if let Some(spare) = s
        .spares
        .iter_mut()
        .find(|sp| sp.assigned.is_none() && sp.member.alive)
    {
        spare.assigned = Some(id);
        let member = Member {
            ready: false,
            last_seen: Some(Instant::now()),
            refused: false,
            cut_off: None,
            ..spare.member.clone()
        };
        let (token, address) = (spare.token, member.address.clone());
        s.servers[id] = member;
        s.placement.assign(id, address.clone());
        s.timeline.event(
            EventKind::Replacement,
            format!("spare {token} at {address} takes server {id}"),
        );
        return;
    }
    match &shared.spawner {
        Some(sp) => match sp.spawn_server(id, &shared.address) {
            Ok(()) => {
                s.timeline
                    .event(EventKind::Replacement, format!("spawned a new server {id}"));
            }
            Err(e) => {
                s.timeline
                    .event(EventKind::ReplacementFailed, format!("server {id}: {e}"));
            }
        },
        None => {
            s.timeline.event(
                EventKind::Replacement,
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
                let total = s.steps.total();
                s.timeline
                    .event(EventKind::TrainingStart, format!("{total} steps"));
                s.last_cut_at = Instant::now();
                if let Some(own) = s.own_saves.as_mut() {
                    // Eq. 4's interval in seconds when CPR has one, else
                    // `checkpoint.every_seconds`, else `checkpoint.every_steps`.
                    let seconds = shared
                        .job
                        .config
                        .checkpoint
                        .every_seconds
                        .and_then(|x| std::time::Duration::try_from_secs_f64(x).ok());
                    let interval = s.cpr.as_ref().and_then(|c| c.interval()).or(seconds);
                    own.start(Instant::now(), interval);
                    s.timeline.event(
                        EventKind::CprInterval,
                        format!(
                            "uncoordinated saves: each of {} servers saves its own shard, \
                             staggered over {}",
                            s.servers.len(),
                            interval.map_or(
                                format!("every {} steps", shared.job.config.checkpoint.every_steps),
                                |i| format!("every {:.2} s", i.as_secs_f64())
                            )
                        ),
                    );
                }
                if let Some(cpr) = s.cpr.as_mut() {
                    cpr.start(Instant::now());
                    if let Some(interval) = cpr.interval() {
                        s.timeline.event(
                            EventKind::CprInterval,
                            format!(
                                "a checkpoint every {:.2} s (Eq. 4 from cpr.target_pls and \
                                 cpr.mtbf_seconds)",
                                interval.as_secs_f64()
                            ),
                        );
                    }
                }
            }
            None
        }
        Phase::Checkpointing if s.steps.quiet() => {
            s.busy = true;
            Some(Task::Checkpoint {
                epoch: s.epoch,
                step: s.steps.next_step(),
                priority: s.cut_priority,
            })
        }
        Phase::Recovering => {
            let waiting = s.recover_after.is_some_and(|t| Instant::now() < t);
            if waiting || !s.servers.iter().all(|m| m.alive && m.ready) {
                return None;
            }
            s.busy = true;
            s.timeline
                .event(EventKind::RecoveryStart, format!("epoch {}", s.epoch));
            let cluster = &shared.job.config.cluster;
            let action = planner::plan(&Situation {
                ft: cluster.ft,
                deterministic: cluster.deterministic,
                cause: if s.failed.is_empty() {
                    Cause::StepPartlyApplied
                } else {
                    Cause::ServersLost(s.failed.iter().map(|(id, _)| *id).collect())
                },
                last_cut: s.last_checkpoint,
                last_save: s.last_save,
                unsettled: s.steps.unsettled(),
                next_step: s.steps.next_step(),
                ec: shared.job.layout().ok().and_then(|l| l.stripes()),
                rebuilding: s.rebuilding.iter().map(|&(r, _)| r).collect(),
                replicate_dense: shared.job.config.dense_replicated(),
                partial: s.cpr.as_ref().is_some_and(|cpr| cpr.partial()),
                own_saves: s.own_saves.as_ref().map(|o| o.newest_all()),
            });
            if matches!(action, planner::RecoveryAction::Rollback { .. }) {
                // Every server restores a cut and re-derives its parity: background
                // rebuilds end (superseded), and none may hold the run open.
                s.rebuilding.clear();
            }
            Some(Task::Recover {
                epoch: s.epoch,
                action,
            })
        }
        Phase::Running | Phase::Checkpointing => {
            let now = Instant::now();
            if let Some(step) = s.pending_cut.as_ref().map(|c| c.step)
                && s.confirm_after.is_none_or(|t| now >= t)
            {
                s.busy = true;
                s.confirm_after = None;
                return Some(Task::ConfirmCut {
                    epoch: s.epoch,
                    step,
                });
            }
            let orphans = s.steps.orphans();
            // A worker that lost a step to a server error makes the coordinator wait for
            // the failure detector first; asking a dying server would only fail.
            let waiting = [s.suspect_until, s.resolve_after]
                .into_iter()
                .flatten()
                .any(|t| now < t);
            if orphans.is_empty() || waiting {
                let epoch = s.epoch;
                let step = s.steps.next_step();
                let servers = s.own_saves.as_mut().and_then(|o| o.start_round())?;
                return Some(Task::OwnSaves {
                    epoch,
                    step,
                    servers,
                });
            }
            s.busy = true;
            Some(Task::Resolve {
                epoch: s.epoch,
                steps: orphans,
            })
        }
        Phase::Done => None,
    }
}
