//! The control loop: failure detection, and the work it plans (cuts, recoveries, orphan
//! resolution), decided under the lock and run by `tasks` after releasing it.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::planner::{self, Cause, Situation};
use crate::state::{Phase, State};
use crate::tasks::{Task, run_task};
use crate::{MAX_RESPAWNS, Shared};
use ftrec_proto::proto::Role;
use ftrec_proto::timeline::{EventKind, Subject};

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
            if let Some(targets) = s.members.take_probe_targets() {
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
            } else if shared.acts_through_outage() {
                detect_refused_servers(&shared, &mut s);
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
                let recovery = matches!(task, Task::Recover { .. });
                run_task(&shared, task).await;
                let mut s = shared.lock();
                match own_saves {
                    // However they ended (done, abandoned, never sent), these servers'
                    // next saves may come.
                    Some(servers) => {
                        if let Some(own) = s.cuts.own_saves.as_mut() {
                            own.finished(&servers);
                        }
                    }
                    None => s.busy = false,
                }
                // A recovery's orphans are resolved now, not at the next tick (its
                // workers wait to push their steps again). Only then: a task that fails
                // at once and is planned again would spin without the tick between.
                if recovery {
                    shared.wake.notify_one();
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
        let m = &mut s.members.servers[id];
        // The slot may have a new process by now.
        if m.alive && m.address == address {
            m.refused = true;
            s.timeline.event(
                EventKind::SuspicionConfirmed,
                format!("server {id}: connection to {address} refused"),
            );
            // Declared at once, not at the next tick.
            shared.wake.notify_one();
        }
    }
}

/// This coordinator did not run for `stalled` (SIGSTOP, a host that swapped or lost its
/// CPU): the members' silence over that time is its own, not theirs. Each gets a fresh
/// failure timeout; one that is really gone is declared dead one timeout later.
fn forgive_own_stall(s: &mut State, stalled: Duration) {
    s.members.forgive_silence(tokio::time::Instant::now());
    s.timeline.event(
        EventKind::Coordinator,
        format!(
            "this coordinator did not run for {stalled:?}: the members' silence over that time \
             is not counted against them"
        ),
    );
}

fn detect_failures(shared: &Shared, s: &mut State) {
    let timeout = Duration::from_millis(shared.job.config.cluster.failure_timeout_ms);
    if s.phase == Phase::Done {
        return;
    }
    let heard = last_sign_of_own_links(shared, s, timeout);
    say_if_cut_off(s, timeout, heard);
    s.members.void_cut_off_evidence(timeout);
    for id in 0..s.members.servers.len() {
        if let Some(why) = s.members.server_failure(id, timeout, heard) {
            server_failed(shared, s, id, &why);
        }
    }
    for id in 0..s.members.workers.len() {
        let m = &s.members.workers[id];
        if m.joined
            && m.alive
            && m.silent_on_its_own(timeout, heard)
            && !worker_failed(shared, s, id)
        {
            return;
        }
    }
    restart_early_exits(shared, s);
}

/// A leader acting through an etcd outage declares dead only a server whose port refused
/// a connection: no process listens there, whoever leads. Silence is no such evidence (a
/// frozen server, or this coordinator's own links): it waits for etcd.
fn detect_refused_servers(shared: &Shared, s: &mut State) {
    if s.phase == Phase::Done || s.scaling.joining {
        return;
    }
    for id in 0..s.members.servers.len() {
        if let Some(why) = s.members.server_refused(id) {
            let why = format!("{why}, while etcd does not answer: declared on that evidence");
            server_failed(shared, s, id, &why);
        }
    }
}

/// With embedded membership no standby can take over from a coordinator cut off from
/// every member, and one that hears nobody for this many failure timeouts takes the
/// silence as real (a whole rack lost), not its own.
const ALONE_TIMEOUTS: u32 = 4;

/// The coordinator's last sign that its own links work: a member heard, or (with etcd)
/// a lease renewal answered. A member's silence counts against it only when such a sign
/// came after its deadline ([`crate::state::Member::silent_on_its_own`]).
fn last_sign_of_own_links(shared: &Shared, s: &State, timeout: Duration) -> Option<Instant> {
    let heard = s.members.last_heard().max(shared.etcd_reached_at());
    if shared.durable_membership() {
        return heard;
    }
    heard.max(Instant::now().checked_sub(timeout * (ALONE_TIMEOUTS - 1)))
}

/// Members silent past the timeout that are not declared dead because this coordinator
/// heard from nobody since: said on the timeline once per such spell.
fn say_if_cut_off(s: &mut State, timeout: Duration, heard: Option<Instant>) {
    let members = s.members.servers.iter().chain(&s.members.workers);
    let withheld = members
        .filter(|m| m.joined && m.alive && m.silent_for() > timeout)
        .filter(|m| !m.silent_on_its_own(timeout, heard))
        .count();
    if withheld == 0 {
        s.leader.isolated_said = false;
    } else if !std::mem::replace(&mut s.leader.isolated_said, true) {
        s.timeline.event(
            EventKind::Coordinator,
            format!(
                "{withheld} member(s) silent past the failure timeout, and nothing heard \
                 since from any member or from etcd: this coordinator is the one cut off, \
                 and declares none of them dead until it hears from someone"
            ),
        );
    }
}

/// Declares server `id` dead for `why`: a new epoch, its steps in flight set aside, and
/// a replacement asked for.
pub(crate) fn server_failed(shared: &Shared, s: &mut State, id: usize, why: &str) {
    declare_server_dead(shared, s, id, why);
    replace_server(shared, s, id);
}

/// Server `id` is dead: a new epoch, its steps in flight set aside, and a recovery to
/// run once its slot has a process again (none is asked for here: a join that replaces
/// it brings its own).
pub(crate) fn declare_server_dead(shared: &Shared, s: &mut State, id: usize, why: &str) {
    let c = &shared.job.config.cluster;
    s.members.servers[id].alive = false;
    s.members.servers[id].ready = false;
    if s.scaling.joining {
        // A move's new server, lost before its layout trained a step: nothing of the new
        // layout is lost (every server's initial state is the move's cut), so its slot is
        // started again and loads the cut like the others; no recovery, no new epoch.
        s.timeline.event_about(
            EventKind::FailureDetected,
            Subject::Server(id as u32),
            None,
            format!("server {id} {why}, before the new layout trained; started again"),
        );
        return;
    }
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
    // Its background rebuild (if any) died with it; its replacement starts afresh.
    s.recovery.server_lost(id, t);
    // `ec+checkpoint` rebuilds a lost server from the survivors and keeps its state
    // too; it rolls back only when more of a group is lost than the code rebuilds, and
    // that rewind clears the orphans. (Forgetting its steps in flight here lost them
    // for good: found by the simulated cluster, `ftrec-sim`.)
    let keeps_state = !c.ft.checkpoints()
        || c.ft.erasure_coded()
        || s.cuts.cpr.as_ref().is_some_and(|cpr| cpr.partial());
    if keeps_state {
        // The run keeps its state: steps in flight are resolved after recovery (granted
        // again, or settled where every server applied them).
        s.steps.ledger.orphan_outstanding();
    } else {
        // A rollback trains every step from the cut again: late reports of the steps in
        // flight must count nothing.
        s.steps.ledger.forget_outstanding();
    }
    s.phase = Phase::Recovering;
}

/// Declares worker `id` dead: its steps are resolved with the servers and granted
/// again (never skipped), and a replacement is spawned. False when the slot failed too
/// often: the run ends.
fn worker_failed(shared: &Shared, s: &mut State, id: usize) -> bool {
    s.members.workers[id].alive = false;
    let held = s.steps.ledger.worker_died(id);
    s.timeline.event(
        EventKind::WorkerFailureDetected,
        format!("worker {id}; {held} granted steps to resolve"),
    );
    let respawns = s.members.worker_respawned(id);
    if respawns > MAX_RESPAWNS {
        let why = format!("worker {id} failed {respawns} times; giving up (see its log)");
        shared.fail_run(s, why);
        return false;
    }
    if let Some(sp) = &shared.spawner
        && let Err(e) = sp.spawn_worker(id, &shared.address)
    {
        s.timeline
            .event(EventKind::ReplacementFailed, format!("worker {id}: {e}"));
    }
    true
}

/// Gives server slot `id` a waiting spare, if one is there.
pub(crate) fn give_spare(s: &mut State, id: usize, now: Instant) -> bool {
    let Some((token, address)) = s.members.assign_spare(id, now) else {
        return false;
    };
    s.placement.assign(id, address.clone());
    let on = s
        .members
        .spares
        .iter()
        .find(|sp| sp.token == token)
        .and_then(|sp| sp.hosted_by)
        .map_or(String::new(), |j| format!(" on server {j}'s host"));
    s.timeline.event_about(
        EventKind::Replacement,
        Subject::Server(id as u32),
        None,
        format!("spare {token} at {address}{on} takes server {id}"),
    );
    true
}

pub(super) fn replace_server(shared: &Shared, s: &mut State, id: usize) {
    // A spare given a slot rebuilds it from its group (erasure coding); a move's new slot
    // has no group to rebuild from yet, so it gets a process that loads the cut.
    if !s.scaling.joining && give_spare(s, id, Instant::now()) {
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

/// [`plan`] for the tests of this crate.
#[cfg(test)]
pub(crate) fn plan_for_test(shared: &Shared, s: &mut State) -> Option<Task> {
    plan(shared, s)
}

fn plan(shared: &Shared, s: &mut State) -> Option<Task> {
    if s.phase == Phase::Running && crate::hosting::hand_over(shared, s) {
        return None;
    }
    crate::scale::forget_lost_cut(s);
    if crate::scale::switch_due(s) {
        s.busy = true;
        return Some(Task::Switch { epoch: s.epoch });
    }
    match s.phase {
        Phase::Starting => {
            if s.members.all_joined() {
                start_training(shared, s);
            }
            None
        }
        Phase::Checkpointing if s.steps.ledger.quiet() => {
            s.busy = true;
            Some(Task::Checkpoint {
                epoch: s.epoch,
                step: s.steps.ledger.next_step(),
                priority: s.cuts.priority,
            })
        }
        Phase::Recovering => {
            let now = Instant::now();
            // A spare that joined since the failure (none was there then), or one asked of
            // a survivor's host once the slot waited long enough.
            crate::hosting::fill_lost_slots(shared, s, now);
            if s.recovery.backing_off(now) {
                return None;
            }
            if !s.members.servers_ready() {
                say_who_is_awaited(shared, s, now);
                return None;
            }
            s.recovery.awaited_said = None;
            s.busy = true;
            Some(plan_recovery(shared, s))
        }
        Phase::Running | Phase::Checkpointing => plan_running(s),
        Phase::Done => None,
    }
}

/// A recovery that waits this long for a slot's process says which, and again every
/// [`AWAITED_REPEAT`]: a job with no replacement coming otherwise stood still in silence
/// (issue 42, hole 8).
const AWAITED_AFTER: Duration = Duration::from_secs(5);
const AWAITED_REPEAT: Duration = Duration::from_secs(60);

/// Names the slots the recovery waits for, the kind of process each needs, and the
/// command that starts one, once the wait is long and then every minute.
pub(crate) fn say_who_is_awaited(shared: &Shared, s: &mut State, now: Instant) {
    // The first wait counts as said `AWAITED_REPEAT - AWAITED_AFTER` ago: it is said
    // `AWAITED_AFTER` from now.
    let first = now
        .checked_sub(AWAITED_REPEAT - AWAITED_AFTER)
        .unwrap_or(now);
    let since = *s.recovery.awaited_said.get_or_insert(first);
    if now.duration_since(since) < AWAITED_REPEAT {
        return;
    }
    s.recovery.awaited_said = Some(now);
    let find = match shared.job.etcd_options() {
        Some(etcd) => format!("--etcd {}", etcd.endpoints.join(",")),
        None => format!("--coordinator {}", shared.address),
    };
    let awaited: Vec<String> = s
        .members
        .servers
        .iter()
        .enumerate()
        .filter(|(_, m)| !m.ready)
        .map(|(id, m)| {
            if m.alive && m.joined {
                format!(
                    "server {id}: its process (pid {}) is building its shard",
                    m.pid
                )
            } else {
                format!(
                    "server {id}: no process; start one with `ftrec server --job JOB {find} \
                     --id {id}` (or a spare anywhere with `--spare` in place of `--id {id}`)"
                )
            }
        })
        .collect();
    let c = &shared.job.config.cluster;
    let text = format!(
        "the recovery of epoch {} waits for {}{}",
        s.epoch,
        awaited.join("; "),
        match (shared.spawner.is_some(), c.survivor_spares) {
            (true, _) => String::new(),
            (false, true) => format!(
                ". This coordinator starts none itself (it was started without --spawn); a \
                 slot that waits {} s (cluster.survivor_spare_after_s) gets a spare on a \
                 survivor's host",
                c.survivor_spare_after_s
            ),
            (false, false) => ". This coordinator starts none itself (it was started \
                               without --spawn), and cluster.survivor_spares is off"
                .to_string(),
        }
    );
    tracing::warn!("{text}");
    s.timeline.event(EventKind::Replacement, text);
}

/// Starts again every slot whose process exited before it joined: it was never heard, so
/// it is never declared dead, and the job's start or a recovery waited for it forever
/// (issue 42: found by the simulation, a worker crashed before it joined, and a
/// replacement server that met slow etcd at its start). One that keeps exiting ends the
/// run, naming its log.
fn restart_early_exits(shared: &Shared, s: &mut State) {
    let Some(spawner) = shared.spawner.clone() else {
        return;
    };
    for (role, id) in s.members.without_process() {
        if !spawner.exited(role, id) {
            continue;
        }
        let name = if role == Role::Server {
            "server"
        } else {
            "worker"
        };
        let exits = s.members.exited_before_joining(role, id);
        if exits > MAX_RESPAWNS {
            let why = format!(
                "{name} {id} exited {exits} times before it joined; giving up (see its log)"
            );
            shared.fail_run(s, why);
            return;
        }
        let spawned = match role {
            Role::Server => spawner.spawn_server(id, &shared.address),
            _ => spawner.spawn_worker(id, &shared.address),
        };
        let (kind, detail) = match spawned {
            Ok(()) => (
                EventKind::Replacement,
                format!("{name} {id} exited before it joined; started another"),
            ),
            Err(e) => (EventKind::ReplacementFailed, format!("{name} {id}: {e}")),
        };
        s.timeline.event(kind, detail);
    }
}

/// Every member is in: training starts, and with it the save schedule's clocks.
fn start_training(shared: &Shared, s: &mut State) {
    // After a move, the new layout's servers are in: training goes on where it stopped.
    if crate::scale::trained_again(s) {
        return;
    }
    s.phase = Phase::Running;
    s.steps.started = true;
    let total = s.steps.ledger.total();
    s.timeline
        .event(EventKind::TrainingStart, format!("{total} steps"));
    s.cuts.restart_clock(Instant::now());
    if let Some(own) = s.cuts.own_saves.as_mut() {
        // Eq. 4's interval in seconds when CPR has one, else
        // `checkpoint.every_seconds`, else `checkpoint.every_steps`.
        let checkpoint = &shared.job.config.checkpoint;
        let seconds = checkpoint
            .every_seconds
            .and_then(|x| std::time::Duration::try_from_secs_f64(x).ok());
        let interval = s.cuts.cpr.as_ref().and_then(|c| c.interval()).or(seconds);
        own.start(Instant::now(), interval);
        s.timeline.event(
            EventKind::CprInterval,
            format!(
                "uncoordinated saves: each of {} servers saves its own shard, staggered over {}",
                s.members.servers.len(),
                interval.map_or(format!("every {} steps", checkpoint.every_steps), |i| {
                    format!("every {:.2} s", i.as_secs_f64())
                })
            ),
        );
    }
    if let Some(cpr) = s.cuts.cpr.as_mut() {
        cpr.start(Instant::now());
        if let Some(interval) = cpr.interval() {
            s.timeline.event(
                EventKind::CprInterval,
                format!(
                    "a checkpoint every {:.2} s (Eq. 4 from cpr.target_pls and cpr.mtbf_seconds)",
                    interval.as_secs_f64()
                ),
            );
        }
    }
}

/// The recovery of the current epoch, as the planner decides it from what failed.
fn plan_recovery(shared: &Shared, s: &mut State) -> Task {
    s.timeline
        .event(EventKind::RecoveryStart, format!("epoch {}", s.epoch));
    let cluster = &shared.job.config.cluster;
    let failed = &s.recovery.failed;
    let action = planner::plan(&Situation {
        ft: cluster.ft,
        deterministic: cluster.deterministic,
        cause: if failed.is_empty() {
            Cause::StepPartlyApplied
        } else {
            Cause::ServersLost(failed.iter().map(|(id, _)| *id).collect())
        },
        last_cut: s.saves.last_checkpoint,
        // A save of an older layout is no state of this one's servers: before their first
        // save, their initial state (the move's cut) is what a partial restore reloads.
        last_save: s
            .saves
            .last_save
            .filter(|&step| s.scaling.base.is_none() || step > s.scaling.first_step()),
        unsettled: s.steps.ledger.unsettled(),
        next_step: s.steps.ledger.next_step(),
        ec: s.layout(&shared.job).ok().and_then(|l| l.stripes()),
        rebuilding: s.recovery.rebuilding.iter().map(|&(r, _)| r).collect(),
        replicate_dense: shared.job.config.dense_replicated(),
        partial: s.cuts.cpr.as_ref().is_some_and(|cpr| cpr.partial()),
        own_saves: s.cuts.own_saves.as_ref().map(|o| o.newest_all()),
    });
    if matches!(action, planner::RecoveryAction::Rollback { .. }) {
        // Every server restores a cut and re-derives its parity: background
        // rebuilds end (superseded), and none may hold the run open.
        s.recovery.rebuilding.clear();
    }
    Task::Recover {
        epoch: s.epoch,
        action,
    }
}

/// While training: confirm a cut committing in the background, resolve orphan steps,
/// or start a round of own saves.
fn plan_running(s: &mut State) -> Option<Task> {
    let now = Instant::now();
    if let Some(step) = s.saves.confirmation_due(now) {
        s.busy = true;
        return Some(Task::ConfirmCut {
            epoch: s.epoch,
            step,
        });
    }
    let orphans = s.steps.ledger.orphans();
    // A worker that lost a step to a server error makes the coordinator wait for
    // the failure detector first; asking a dying server would only fail.
    let waiting = s.recovery.suspecting(now) || s.steps.resolving_waits(now);
    if orphans.is_empty() || waiting {
        let epoch = s.epoch;
        let step = s.steps.ledger.next_step();
        let servers = s.cuts.own_saves.as_mut().and_then(|o| o.start_round())?;
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
