//! The work the control loop plans, run against the servers without holding the lock:
//! consistent cuts and CPR's prioritised saves (and pruning what is no longer kept), and
//! resolving the steps of dead workers. Recoveries run in `recovery.rs`.

use std::time::Duration;

use tokio::time::Instant;

use crate::control::Task;
use crate::cpr::PrioritySaveCosts;
use crate::ledger::{Applied, Resolution};
use crate::planner;
use crate::{CheckpointRecord, Phase, Shared, State};
use ftrec_proto::proto::*;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::client::ServerClient;

/// The first wait after a failed cut; it doubles on each failure in a row up to the cap.
const FIRST_CUT_BACKOFF: Duration = Duration::from_secs(2);
const MAX_CUT_BACKOFF: Duration = Duration::from_secs(300);
/// How long to wait before asking the servers about orphan steps again after one did not
/// answer.
const RESOLVE_RETRY: Duration = Duration::from_millis(200);
/// How often to ask whether a cut committing in the background is done.
const CONFIRM_RETRY: Duration = Duration::from_millis(50);

pub(super) async fn run_task(shared: &std::sync::Arc<Shared>, task: Task) {
    // Each task's calls get their kind's deadline: checkpoint I/O for writes and restores
    // (a rollback, a partial restore), the control plane's for the rest. A rebuild's
    // transfers are the servers' own, bounded by the rebuild stall deadline.
    let deadlines = shared.job.deadlines();
    let deadline = match &task {
        Task::Checkpoint { .. } => deadlines.checkpoint_io,
        Task::Recover { action, .. } if action.restores() => deadlines.checkpoint_io,
        _ => deadlines.control,
    };
    let clients: Result<Vec<_>, _> = shared.job.connector_for(deadline).and_then(|connector| {
        shared
            .server_addresses()
            .iter()
            .map(|a| connector.server(a))
            .collect()
    });
    let clients = match clients {
        Ok(c) => c,
        Err(e) => {
            shared.event(EventKind::Error, e.to_string());
            return;
        }
    };
    match task {
        Task::OwnSaves {
            epoch,
            step,
            servers,
        } => own_saves(shared, clients, epoch, step, servers).await,
        Task::Checkpoint {
            epoch,
            step,
            priority,
        } => checkpoint(shared, clients, epoch, step, priority).await,
        Task::Recover { epoch, action } => {
            // etcd membership: the new epoch is recorded before any server adopts it, so
            // a leader elected after this one never reuses it or forgets the recovery.
            if let Err(e) = shared.sync_durable().await {
                tracing::warn!("recovery of epoch {epoch} waits for etcd: {e}");
                shared.lock().recover_after =
                    Some(tokio::time::Instant::now() + std::time::Duration::from_millis(200));
                return;
            }
            crate::recovery::recover(shared, clients, epoch, action).await
        }
        Task::Resolve { epoch, steps } => resolve(shared, clients, epoch, steps).await,
        Task::ConfirmCut { epoch, step } => confirm_cut(shared, clients, epoch, step).await,
    }
}

async fn checkpoint(
    shared: &Shared,
    clients: Vec<ServerClient>,
    epoch: u64,
    step: u64,
    priority: bool,
) {
    let what = if priority {
        format!("step {step} (CPR prioritised save)")
    } else {
        format!("step {step}")
    };
    let started_at = shared.event(EventKind::CheckpointStart, what);
    let calls = clients.iter().cloned().map(|mut c| async move {
        c.checkpoint(CheckpointRequest {
            epoch,
            step,
            priority,
            as_applied: false,
        })
        .await
    });
    // A member declared dead meanwhile may be silent: the cut is abandoned with the epoch
    // (its parts stay uncommitted), so the recovery never waits on a dead member's write.
    let mut epochs = shared.epochs.subscribe();
    let results = tokio::select! {
        biased;
        results = futures::future::join_all(calls) => results,
        // No answers: the epoch has moved, so the cut is counted abandoned below (not
        // failed: a failure would delay the next cut).
        _ = epochs.wait_for(|&e| e > epoch) => Vec::new(),
    };
    let mut bytes = 0;
    let mut ids = Vec::with_capacity(results.len());
    let mut failed = None;
    let mut committed = true;
    let (mut tracker_bytes, mut select_seconds, mut tracking_seconds) = (0u64, 0f64, 0f64);
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(r) => {
                let r = r.into_inner();
                bytes += r.bytes;
                tracker_bytes += r.tracker_bytes;
                select_seconds = select_seconds.max(r.select_seconds);
                tracking_seconds = tracking_seconds.max(r.tracking_seconds);
                committed &= r.committed;
                ids.push(r.id);
            }
            Err(e) => failed = Some(format!("server {i}: {}", e.message())),
        }
    }
    let prune = {
        let mut s = shared.lock();
        let pause = end_pause(&mut s, epoch);
        match failed {
            None if s.epoch == epoch => {
                let record = CheckpointRecord {
                    step,
                    started_at,
                    pause_seconds: pause,
                    bytes,
                    ids,
                    priority,
                };
                let train_seconds = s.train_seconds();
                if priority && let Some(cpr) = s.cpr.as_mut() {
                    cpr.on_priority_save(
                        Instant::now(),
                        PrioritySaveCosts {
                            tracker_bytes,
                            select_seconds,
                            pause,
                            tracking_seconds,
                            train_seconds,
                        },
                    );
                }
                if committed {
                    commit_cut(shared, &mut s, record)
                } else {
                    // Every part is copied, so training goes on; the cut counts for a
                    // rollback only once every server confirms its commit.
                    s.timeline.event(
                        EventKind::CheckpointCopied,
                        format!("step {step}, paused {pause:.3}s; committing in the background"),
                    );
                    s.pending_cut = Some(record);
                    s.pending_since = Some(Instant::now());
                    None
                }
            }
            None => {
                s.timeline.event(
                    EventKind::CheckpointAbandoned,
                    format!("step {step}: epoch changed"),
                );
                crate::owe_cut(&mut s, step, priority);
                None
            }
            Some(e) => {
                coordinated_cut_failed(&mut s, step, priority, &e);
                None
            }
        }
    };
    if let Some(kept) = prune {
        prune_cuts(shared, clients, epoch, &kept).await;
    }
}

/// `cpr.uncoordinated`: `servers` save their own shards while training goes on, each at
/// the step its shard has applied (named in its reply), and each save counts on its own as
/// soon as it is committed; no cut spans the servers. `step` is the first step not granted
/// when they became due. A server whose save fails is tried again at its next turn, after
/// the usual backoff.
async fn own_saves(
    shared: &Shared,
    clients: Vec<ServerClient>,
    epoch: u64,
    step: u64,
    servers: Vec<usize>,
) {
    let what = format!(
        "own saves of servers {servers:?} as they stand, at step {step} granted \
         (uncoordinated; training goes on)"
    );
    let started_at = shared.event(EventKind::CheckpointStart, what);
    let calls = servers.iter().filter_map(|&j| {
        let mut c = clients.get(j)?.clone();
        Some(async move {
            let r = c
                .checkpoint(CheckpointRequest {
                    epoch,
                    step,
                    priority: false,
                    as_applied: true,
                })
                .await;
            (j, r)
        })
    });
    let mut epochs = shared.epochs.subscribe();
    let results = tokio::select! {
        biased;
        results = futures::future::join_all(calls) => results,
        _ = epochs.wait_for(|&e| e > epoch) => Vec::new(),
    };
    let mut prunes = Vec::new();
    {
        let mut s = shared.lock();
        if s.epoch != epoch || results.is_empty() {
            s.timeline.event(
                EventKind::CheckpointAbandoned,
                format!("own saves at step {step} granted: epoch changed"),
            );
            return;
        }
        let mut failed = Vec::new();
        for (j, r) in results {
            let reply = match r {
                Ok(r) if r.get_ref().committed => r.into_inner(),
                Ok(_) => {
                    failed.push(format!("server {j}: its save is not committed"));
                    continue;
                }
                Err(e) => {
                    failed.push(format!("server {j}: {}", e.message()));
                    continue;
                }
            };
            let mut ids = vec![String::new(); s.servers.len()];
            if let Some(id) = ids.get_mut(j) {
                id.clone_from(&reply.id);
            }
            // Nothing paused: what the save cost training is the time its copy held the
            // shard's lock, when pushes to that shard waited.
            s.checkpoints.push(CheckpointRecord {
                step: reply.step,
                started_at,
                pause_seconds: reply.stall_seconds,
                bytes: reply.bytes,
                ids,
                priority: false,
            });
            shared.metrics.add("ftrec_checkpoints_total", 1);
            s.timeline.event(
                EventKind::CheckpointEnd,
                format!(
                    "step {}, server {j}'s own save, {} bytes in {:.3}s; its copy held the \
                     shard {:.3}s",
                    reply.step, reply.bytes, reply.seconds, reply.stall_seconds
                ),
            );
            let now = Instant::now();
            if let Some(kept) = s
                .own_saves
                .as_mut()
                .and_then(|o| o.saved(j, reply.step, now))
            {
                prunes.push((j, kept));
            }
        }
        if failed.is_empty() {
            s.checkpoint_backoff = None;
        } else {
            cut_failed(&mut s, step, &failed.join("; "));
        }
    }
    for (j, kept) in prunes {
        if let Some(client) = clients.get(j) {
            prune_servers(shared, vec![(j, client.clone())], epoch, kept).await;
        }
    }
}

/// A checkpoint of `epoch` is over: training goes on (unless a recovery took over), and
/// the pause it caused is returned, seconds.
fn end_pause(s: &mut State, epoch: u64) -> f64 {
    let pause = s
        .pause_started
        .take()
        .map_or(0.0, |t| t.elapsed().as_secs_f64());
    if s.epoch == epoch && s.phase == Phase::Checkpointing {
        s.phase = Phase::Running;
    }
    pause
}

/// Counts a cut every server committed: it becomes the rollback target. Returns the cuts
/// to keep when older ones are due for deletion.
fn commit_cut(
    shared: &Shared,
    s: &mut State,
    record: CheckpointRecord,
) -> Option<Vec<CheckpointRecord>> {
    let (step, bytes, pause, priority) = (
        record.step,
        record.bytes,
        record.pause_seconds,
        record.priority,
    );
    s.last_save = Some(step);
    if !priority && s.cut_owed.is_some_and(|owed| step >= owed) {
        s.cut_owed = None;
    }
    s.checkpoints.push(record.clone());
    s.retained_cuts.push(record);
    shared.metrics.add("ftrec_checkpoints_total", 1);
    let kind = if priority {
        " (CPR prioritised save)"
    } else {
        ""
    };
    s.timeline.event(
        EventKind::CheckpointEnd,
        format!("step {step}{kind}, {bytes} bytes, paused {pause:.3}s"),
    );
    // A prioritised save is not a consistent state: a partial restore reloads it, a
    // rollback never goes to it, and it decides nothing.
    if !priority {
        if let Some(r) = s.replan.as_mut() {
            r.on_cut(pause);
        }
        s.last_checkpoint = Some(step);
        s.last_cut_at = Instant::now();
        s.checkpoint_backoff = None;
        let train_seconds = s.train_seconds();
        let total = s.steps.total();
        if let Some(cpr) = s.cpr.as_mut()
            && let Some(decision) = cpr.on_cut(Instant::now(), pause, train_seconds, step, total)
        {
            tracing::info!("{decision}");
            s.timeline.event(EventKind::CprDecision, decision);
        }
    }
    let keep = shared.job.config.checkpoint.keep;
    let excess = s.retained_cuts.len().saturating_sub(keep);
    (keep > 0 && excess > 0).then(|| {
        s.retained_cuts.drain(..excess);
        s.retained_cuts.clone()
    })
}

/// A coordinated cut (or prioritised save) that failed: [`cut_failed`], and the cut is
/// owed ([`crate::owe_cut`]). Own saves keep their own schedule and owe nothing.
fn coordinated_cut_failed(s: &mut State, step: u64, priority: bool, why: &str) {
    cut_failed(s, step, why);
    crate::owe_cut(s, step, priority);
}

/// A cut that will not count: said once on stderr and in the event log, and the next one
/// waits (doubling, bounded), so a full disk is neither hammered nor logged in a loop.
fn cut_failed(s: &mut State, step: u64, why: &str) {
    let wait = s
        .checkpoint_backoff
        .map_or(FIRST_CUT_BACKOFF, |(_, d)| (d * 2).min(MAX_CUT_BACKOFF));
    s.checkpoint_backoff = Some((Instant::now() + wait, wait));
    let fallback = s
        .last_checkpoint
        .map_or("the initial state".to_string(), |c| {
            format!("the cut of step {c}")
        });
    let why = format!(
        "checkpoint of step {step} failed: {why}. Training goes on; a failure now \
         rolls back to {fallback}. Next attempt in {wait:?} or later."
    );
    tracing::error!("{why}");
    s.timeline.event(EventKind::CheckpointFailed, why);
}

/// Asks every server whether its part of the pending cut is committed; counts the cut
/// when all are, fails it when one's background write failed, and otherwise asks again
/// shortly.
async fn confirm_cut(shared: &Shared, clients: Vec<ServerClient>, epoch: u64, step: u64) {
    let calls = clients
        .iter()
        .cloned()
        .map(|mut c| async move { c.cut_committed(CutCommittedRequest { epoch, step }).await });
    let mut all = true;
    let mut failed = None;
    for (i, r) in futures::future::join_all(calls)
        .await
        .into_iter()
        .enumerate()
    {
        match r {
            Ok(r) => all &= r.into_inner().committed,
            Err(e) => failed = Some(format!("server {i}: {}", e.message())),
        }
    }
    let prune = {
        let mut s = shared.lock();
        if s.epoch != epoch || s.pending_cut.as_ref().is_none_or(|c| c.step != step) {
            return;
        }
        if let Some(e) = failed {
            let priority = s.pending_cut.take().is_some_and(|c| c.priority);
            coordinated_cut_failed(&mut s, step, priority, &e);
            return;
        }
        if !all {
            let limit = shared.job.timeout();
            if s.pending_since.is_some_and(|t| t.elapsed() > limit) {
                let priority = s.pending_cut.take().is_some_and(|c| c.priority);
                coordinated_cut_failed(
                    &mut s,
                    step,
                    priority,
                    &format!("its background commit did not finish within {limit:?}"),
                );
                return;
            }
            s.confirm_after = Some(Instant::now() + CONFIRM_RETRY);
            return;
        }
        let Some(record) = s.pending_cut.take() else {
            return;
        };
        commit_cut(shared, &mut s, record)
    };
    if let Some(kept) = prune {
        prune_cuts(shared, clients, epoch, &kept).await;
    }
}

/// Deletes every shard checkpoint that is not part of a kept cut. A newer cut has
/// committed before this runs, so a failure at any moment leaves at least `keep` cuts.
async fn prune_cuts(
    shared: &Shared,
    clients: Vec<ServerClient>,
    epoch: u64,
    kept: &[CheckpointRecord],
) {
    let keep_steps: Vec<u64> = kept.iter().map(|r| r.step).collect();
    prune_servers(
        shared,
        clients.into_iter().enumerate().collect(),
        epoch,
        keep_steps,
    )
    .await;
}

/// Asks each of `clients` (by slot) to delete every checkpoint but those of `keep_steps`.
async fn prune_servers(
    shared: &Shared,
    clients: Vec<(usize, ServerClient)>,
    epoch: u64,
    keep_steps: Vec<u64>,
) {
    // etcd membership: the newer cut is recorded before an older one is deleted, so a
    // new leader never rolls back to a cut that is gone. Pruning waits for the next cut
    // when etcd does not answer.
    if shared.sync_durable().await.is_err() {
        return;
    }
    let calls = clients.into_iter().map(|(i, mut c)| {
        let keep_steps = keep_steps.clone();
        async move { (i, c.prune(PruneRequest { epoch, keep_steps }).await) }
    });
    let mut deleted = 0;
    let mut failed = Vec::new();
    for (i, r) in futures::future::join_all(calls).await {
        match r {
            Ok(r) => deleted += r.into_inner().deleted,
            Err(e) => failed.push(format!("server {i}: {}", e.message())),
        }
    }
    let mut s = shared.lock();
    if !failed.is_empty() {
        // The next cut's prune lists the same keep set, so nothing is left behind for good.
        // Said once until a prune succeeds again, not at every cut.
        if !std::mem::replace(&mut s.prune_failing, true) {
            let why = failed.join("; ");
            tracing::warn!("pruning old checkpoints: {why}; retrying after each cut");
            s.timeline.event(EventKind::PruneFailed, why);
        }
        return;
    }
    s.prune_failing = false;
    if deleted > 0 {
        s.timeline.event(
            EventKind::CheckpointsPruned,
            format!("{deleted} shard checkpoints deleted; steps kept: {keep_steps:?}"),
        );
    }
}

/// Asks every server which orphan steps it applied, then settles, regrants or rolls back.
async fn resolve(shared: &Shared, clients: Vec<ServerClient>, epoch: u64, steps: Vec<u64>) {
    let finishers = shared
        .job
        .config
        .two_phase_commit()
        .then(|| clients.clone());
    let calls = clients.into_iter().map(|mut c| {
        let steps = steps.clone();
        async move {
            c.applied(AppliedRequest {
                epoch,
                steps,
                digest: false,
            })
            .await
        }
    });
    let mut answers = Vec::new();
    for r in futures::future::join_all(calls).await {
        match r.map(|r| r.into_inner().applied) {
            Ok(a) if a.len() == steps.len() => answers.push(a),
            Ok(_) | Err(_) => {
                // A server that does not answer is dead or busy restoring: the failure
                // detector decides; ask again shortly.
                shared.lock().resolve_after = Some(Instant::now() + RESOLVE_RETRY);
                return;
            }
        }
    }
    if let Some(clients) = finishers {
        finish_commits(clients, epoch, &steps, &mut answers).await;
    }
    let config = &shared.job.config.cluster;
    let mut s = shared.lock();
    // Partial recovery that fell back to full rollbacks promises exactness like `checkpoint`.
    let fell_back = s.cpr.as_ref().is_some_and(|cpr| !cpr.partial());
    let ft = if fell_back {
        ftrec_config::FaultTolerance::Checkpoint
    } else {
        config.ft
    };
    let partial_regrant = planner::regrant_partly_applied(ft, config.deterministic);
    if s.epoch != epoch {
        return;
    }
    let servers = answers.len();
    let mut rollback = None;
    for (i, &step) in steps.iter().enumerate() {
        let count = answers.iter().filter(|a| a[i]).count();
        let applied = match count {
            n if n == servers => Applied::Everywhere,
            0 => Applied::Nowhere,
            _ => Applied::Partly,
        };
        match s.steps.resolve(step, applied, partial_regrant) {
            Resolution::Settled => {
                shared.settled(&mut s, step);
                s.timeline.event(
                    EventKind::StepSettled,
                    format!("step {step}: applied on every server; only its report was lost"),
                );
            }
            Resolution::Regranted => {
                s.timeline.event(
                    EventKind::StepRegranted,
                    format!("step {step}: applied on {count} of {servers} servers"),
                );
            }
            Resolution::NeedsRollback => rollback = Some((step, count)),
            Resolution::Unknown => {}
        }
    }
    if let Some((step, count)) = rollback {
        s.epoch += 1;
        shared.epoch_moved(s.epoch);
        shared.metrics.set("ftrec_epoch", s.epoch as f64);
        s.phase = Phase::Recovering;
        s.pause_started = None;
        let epoch = s.epoch;
        s.timeline.event(
            EventKind::RollbackNeeded,
            format!(
                "step {step} reached {count} of {servers} servers before its worker stopped; \
                 rolling back to the last cut for exact results; epoch {epoch}"
            ),
        );
    }
}

/// Two-phase commit: a step some server committed was decided "commit" by its worker, so
/// the servers that have it prepared but missed the decision (the worker died between
/// its commit calls) commit it now. Regranting it instead would leave the committed
/// servers' parity holding the first prepare's differences. A server that cannot (it
/// never prepared the step, or died) keeps the step partly applied for the ledger.
async fn finish_commits(
    clients: Vec<ServerClient>,
    epoch: u64,
    steps: &[u64],
    answers: &mut [Vec<bool>],
) {
    let mut calls = Vec::new();
    for (i, &step) in steps.iter().enumerate() {
        let applied = answers.iter().filter(|a| a[i]).count();
        if applied == 0 || applied == answers.len() {
            continue;
        }
        for (server, a) in answers.iter().enumerate() {
            if !a[i] {
                let mut c = clients[server].clone();
                calls.push(async move {
                    let done = c.commit_step(StepDecision { epoch, step }).await.is_ok();
                    (server, i, done)
                });
            }
        }
    }
    for (server, i, done) in futures::future::join_all(calls).await {
        if done {
            tracing::info!("finished step {}'s commit on server {server}", steps[i]);
            answers[server][i] = true;
        }
    }
}
