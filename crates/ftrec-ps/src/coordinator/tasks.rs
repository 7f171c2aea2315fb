//! The work the control loop plans, run against the servers without holding the lock:
//! consistent cuts (and pruning the cuts no longer kept), recoveries, and resolving the
//! steps of dead workers.

use std::time::{Duration, Instant};

use super::control::Task;
use super::ledger::{Applied, Resolution};
use super::planner::{self, RecoveryAction};
use super::{CheckpointRecord, Phase, Recovery, Shared, State};
use crate::client::ServerClient;
use crate::proto::*;

/// The first wait after a failed cut; it doubles on each failure in a row up to the cap.
const FIRST_CUT_BACKOFF: Duration = Duration::from_secs(2);
const MAX_CUT_BACKOFF: Duration = Duration::from_secs(300);
/// How long to wait before asking the servers about orphan steps again after one did not
/// answer.
const RESOLVE_RETRY: Duration = Duration::from_millis(200);
/// A failed recovery is tried again after this, at most this many times in a row.
const RECOVERY_RETRY: Duration = Duration::from_millis(200);
const MAX_RECOVERY_FAILURES: u32 = 50;
/// How often to ask whether a cut committing in the background is done.
const CONFIRM_RETRY: Duration = Duration::from_millis(50);

pub(super) async fn run_task(shared: &Shared, task: Task) {
    let clients: Result<Vec<_>, _> = shared.job.connector().and_then(|connector| {
        shared
            .server_addresses()
            .iter()
            .map(|a| connector.server(a))
            .collect()
    });
    let clients = match clients {
        Ok(c) => c,
        Err(e) => {
            shared.event("error", e.to_string());
            return;
        }
    };
    match task {
        Task::Checkpoint {
            epoch,
            step,
            priority,
        } => checkpoint(shared, clients, epoch, step, priority).await,
        Task::Recover { epoch, action } => recover(shared, clients, epoch, action).await,
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
    let started_at = shared.event("checkpoint-start", what);
    let calls = clients.iter().cloned().map(|mut c| async move {
        c.checkpoint(CheckpointRequest {
            epoch,
            step,
            priority,
        })
        .await
    });
    let results = futures::future::join_all(calls).await;
    let mut bytes = 0;
    let mut ids = Vec::with_capacity(results.len());
    let mut failed = None;
    let mut committed = true;
    let (mut tracker_bytes, mut select_seconds) = (0u64, 0f64);
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(r) => {
                let r = r.into_inner();
                bytes += r.bytes;
                tracker_bytes += r.tracker_bytes;
                select_seconds = select_seconds.max(r.select_seconds);
                committed &= r.committed;
                ids.push(r.id);
            }
            Err(e) => failed = Some(format!("server {i}: {}", e.message())),
        }
    }
    let prune = {
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
                let record = CheckpointRecord {
                    step,
                    started_at,
                    pause_seconds: pause,
                    bytes,
                    ids,
                    priority,
                };
                if priority && let Some(cpr) = s.cpr.as_mut() {
                    cpr.on_priority_save(Instant::now(), tracker_bytes, select_seconds);
                }
                if committed {
                    commit_cut(shared, &mut s, record)
                } else {
                    // Every part is copied, so training goes on; the cut counts for a
                    // rollback only once every server confirms its commit.
                    s.timeline.event(
                        "checkpoint-copied",
                        format!("step {step}, paused {pause:.3}s; committing in the background"),
                    );
                    s.pending_cut = Some(record);
                    s.pending_since = Some(Instant::now());
                    None
                }
            }
            None => {
                s.timeline.event(
                    "checkpoint-abandoned",
                    format!("step {step}: epoch changed"),
                );
                None
            }
            Some(e) => {
                cut_failed(&mut s, step, &e);
                None
            }
        }
    };
    if let Some(kept) = prune {
        prune_cuts(shared, clients, epoch, &kept).await;
    }
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
    s.checkpoints.push(record.clone());
    s.retained_cuts.push(record);
    shared.metrics.add("ftrec_checkpoints_total", 1);
    let kind = if priority {
        " (CPR prioritised save)"
    } else {
        ""
    };
    s.timeline.event(
        "checkpoint-end",
        format!("step {step}{kind}, {bytes} bytes, paused {pause:.3}s"),
    );
    // A prioritised save is not a consistent state: a partial restore reloads it, a
    // rollback never goes to it, and it decides nothing.
    if !priority {
        s.last_checkpoint = Some(step);
        s.checkpoint_backoff = None;
        let train_seconds = s.train_seconds();
        let total = s.steps.total();
        if let Some(cpr) = s.cpr.as_mut()
            && let Some(decision) = cpr.on_cut(Instant::now(), pause, train_seconds, step, total)
        {
            tracing::info!("{decision}");
            s.timeline.event("cpr-decision", decision);
        }
    }
    let keep = shared.job.config.checkpoint.keep;
    let excess = s.retained_cuts.len().saturating_sub(keep);
    (keep > 0 && excess > 0).then(|| {
        s.retained_cuts.drain(..excess);
        s.retained_cuts.clone()
    })
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
    s.timeline.event("checkpoint-failed", why);
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
            s.pending_cut = None;
            cut_failed(&mut s, step, &e);
            return;
        }
        if !all {
            let limit = shared.job.timeout();
            if s.pending_since.is_some_and(|t| t.elapsed() > limit) {
                s.pending_cut = None;
                cut_failed(
                    &mut s,
                    step,
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
    let calls = clients.into_iter().map(|mut c| {
        let keep_steps = keep_steps.clone();
        async move { c.prune(PruneRequest { epoch, keep_steps }).await }
    });
    let mut deleted = 0;
    let mut failed = Vec::new();
    for (i, r) in futures::future::join_all(calls)
        .await
        .into_iter()
        .enumerate()
    {
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
            s.timeline.event("prune-failed", why);
        }
        return;
    }
    s.prune_failing = false;
    if deleted > 0 {
        let steps: Vec<u64> = kept.iter().map(|r| r.step).collect();
        s.timeline.event(
            "checkpoints-pruned",
            format!("{deleted} shard checkpoints deleted; cuts kept: {steps:?}"),
        );
    }
}

/// What a server (by slot) answered to its part of a recovery: for a rebuild, its figures.
type RecoveryReply = (usize, Result<Option<RebuildReply>, tonic::Status>);

/// Every server's part of the plan. A rebuild is two rounds: the survivors adopt the new
/// epoch first (dropping what older epochs left prepared), so that what the replacements
/// then read from them no longer changes.
async fn recovery_calls(
    shared: &Shared,
    clients: Vec<ServerClient>,
    epoch: u64,
    action: &RecoveryAction,
) -> Vec<RecoveryReply> {
    let set_epoch = |i: usize, mut c: ServerClient, applied: u64, unsettled: Vec<u64>| async move {
        let r = c
            .set_epoch(SetEpochRequest {
                epoch,
                applied,
                unsettled,
            })
            .await;
        (i, r.map(|_| None))
    };
    match action {
        RecoveryAction::Rollback { cut } => {
            let calls = clients
                .iter()
                .cloned()
                .enumerate()
                .map(|(i, mut c)| async move {
                    let r = c.restore(RestoreRequest { epoch, step: *cut }).await;
                    (i, r.map(|_| None))
                });
            let restored: Vec<RecoveryReply> = futures::future::join_all(calls).await;
            let erasure_coded = shared.job.config.cluster.ft.erasure_coded();
            if !erasure_coded || restored.iter().any(|(_, r)| r.is_err()) {
                return restored;
            }
            // Checkpoints hold data rows only: once every server has restored them, each
            // derives its parity rows and dense replica from its group's restored rows.
            let addresses = shared.server_addresses();
            let reencode = clients.into_iter().enumerate().map(|(i, mut c)| {
                let request = RebuildRequest {
                    epoch,
                    servers: addresses.clone(),
                    lost: Vec::new(),
                    parity_only: true,
                };
                async move {
                    (
                        i,
                        follow_rebuild(shared, i, &mut c, request, false)
                            .await
                            .map(|_| None),
                    )
                }
            });
            futures::future::join_all(reencode).await
        }
        RecoveryAction::KeepState {
            next_step,
            unsettled,
        } => {
            let calls = clients
                .into_iter()
                .enumerate()
                .map(|(i, c)| set_epoch(i, c, *next_step, unsettled.clone()));
            futures::future::join_all(calls).await
        }
        RecoveryAction::Rebuild {
            servers,
            next_step,
            unsettled,
        } => {
            let survivors = clients
                .iter()
                .enumerate()
                .filter(|(i, _)| !servers.contains(i))
                .map(|(i, c)| set_epoch(i, c.clone(), *next_step, unsettled.clone()));
            let mut results: Vec<RecoveryReply> = futures::future::join_all(survivors).await;
            if results.iter().all(|(_, r)| r.is_ok()) {
                let addresses = shared.server_addresses();
                {
                    let mut s = shared.lock();
                    for &server in servers {
                        s.timeline.event(
                            "rebuild-start",
                            format!(
                                "server {server} decodes its rows and parity from the survivors"
                            ),
                        );
                    }
                }
                let lost: Vec<u32> = servers.iter().map(|&s| s as u32).collect();
                let rebuilds = servers.iter().map(|&server| {
                    let mut c = clients[server].clone();
                    let request = RebuildRequest {
                        epoch,
                        servers: addresses.clone(),
                        lost: lost.clone(),
                        parity_only: false,
                    };
                    async move {
                        let r = follow_rebuild(shared, server, &mut c, request, true).await;
                        (server, r.map(Some))
                    }
                });
                results.extend(futures::future::join_all(rebuilds).await);
            }
            results
        }
        RecoveryAction::PartialRestore {
            servers,
            cut,
            next_step,
            unsettled,
        } => {
            // Each replacement reloads its own shard from its checkpoint of the cut; then
            // every server, survivors and replacements alike, adopts the epoch and counts
            // the steps below `next_step` as applied: nobody rolls back.
            let calls = clients.into_iter().enumerate().map(|(i, mut c)| {
                let reload = servers.contains(&i).then_some(*cut).flatten();
                let unsettled = unsettled.clone();
                async move {
                    if let Some(step) = reload
                        && let Err(e) = c
                            .restore(RestoreRequest {
                                epoch,
                                step: Some(step),
                            })
                            .await
                    {
                        return (i, Err(e));
                    }
                    set_epoch(i, c, *next_step, unsettled).await
                }
            });
            futures::future::join_all(calls).await
        }
        RecoveryAction::Abandon { .. } => Vec::new(),
    }
}

/// Counts the PLS of a partial restore (CPR Eq. 3), one term per reloaded server, and
/// says each term's inputs in the event log so the figure can be checked from it.
fn account_partial_restore(shared: &Shared, s: &mut State, action: &RecoveryAction) {
    let RecoveryAction::PartialRestore {
        servers,
        cut,
        next_step,
        unsettled,
    } = action
    else {
        return;
    };
    let schedule = shared.schedule;
    // The updates every server had applied when the slot was lost: the granted steps
    // less those still in flight (granted again, so not lost).
    let in_flight: u64 = unsettled.iter().map(|&u| schedule.batch(u).1).sum();
    let s_i = schedule
        .samples_before(*next_step)
        .saturating_sub(in_flight);
    let s_ckpt = schedule.samples_before(cut.unwrap_or(0));
    let Some(cpr) = s.cpr.as_mut() else {
        return;
    };
    let mut lines = Vec::new();
    for &server in servers {
        let increment = cpr.on_partial_restore(s_i, s_ckpt);
        lines.push(format!(
            "server {server} reloads its shard from {} (S_last_ckpt {s_ckpt} samples); \
             lost at S_i {s_i} samples; PLS += {increment:.6} -> {:.6}",
            cut.map_or("its initial state".to_string(), |c| format!(
                "the cut of step {c}"
            )),
            cpr.pls()
        ));
    }
    let pls = cpr.pls();
    shared.metrics.set("ftrec_pls", pls);
    for line in lines {
        s.timeline.event("partial-restore", line);
    }
}

/// Runs `server`'s rebuild and follows its progress stream: with `report`, a
/// `rebuild-progress` event at each quarter of its tables. Returns the totals.
async fn follow_rebuild(
    shared: &Shared,
    server: usize,
    client: &mut ServerClient,
    request: RebuildRequest,
    report: bool,
) -> Result<RebuildReply, tonic::Status> {
    let mut replies = client.rebuild(request).await?.into_inner();
    let mut quarter = 0;
    while let Some(reply) = replies.message().await? {
        if reply.done {
            return Ok(reply);
        }
        let reached = (reply.tables_done * 4) / reply.tables.max(1);
        if report && reached > quarter && reply.tables_done < reply.tables {
            quarter = reached;
            shared.lock().timeline.event(
                "rebuild-progress",
                format!(
                    "server {server}: {}/{} tables, {} rows, {:.0} MB/s",
                    reply.tables_done,
                    reply.tables,
                    reply.rows,
                    reply.bytes as f64 / reply.seconds.max(1e-9) / 1e6
                ),
            );
        }
    }
    Err(tonic::Status::unavailable(format!(
        "server {server}'s rebuild ended without its totals"
    )))
}

async fn recover(shared: &Shared, clients: Vec<ServerClient>, epoch: u64, action: RecoveryAction) {
    if let RecoveryAction::Abandon { why } = &action {
        let mut s = shared.lock();
        s.timeline.event("fatal", why.clone());
        s.fatal = Some(why.clone());
        s.phase = Phase::Done;
        shared.done.send_replace(true);
        return;
    }
    let applied = action.resume_step();
    // The audit hashes every shard: worth its time where runs are compared bit for bit.
    let audit = (shared.job.config.cluster.deterministic
        && matches!(action, RecoveryAction::PartialRestore { .. }))
    .then(|| clients.clone());
    let calls_started = Instant::now();
    let results = recovery_calls(shared, clients, epoch, &action).await;
    let load_seconds = calls_started.elapsed().as_secs_f64();
    let shard_digests = match audit {
        Some(clients) if results.iter().all(|(_, r)| r.is_ok()) => {
            shard_digests(clients, epoch).await
        }
        _ => Vec::new(),
    };
    let failed: Vec<String> = results
        .iter()
        .filter_map(|(i, r)| {
            r.as_ref()
                .err()
                .map(|e| format!("server {i}: {}", e.message()))
        })
        .collect();
    let mut s = shared.lock();
    if s.epoch != epoch {
        return;
    }
    if !failed.is_empty() {
        // Said on the first failure and every tenth; a cause that does not pass (a missing
        // cut, a shard of another server) ends the run with it rather than looping.
        s.recovery_failures += 1;
        let why = failed.join("; ");
        if s.recovery_failures % 10 == 1 {
            tracing::warn!("recovery of epoch {epoch} failed: {why}; retrying");
            s.timeline
                .event("recovery-retry", format!("epoch {epoch}: {why}"));
        }
        if s.recovery_failures >= MAX_RECOVERY_FAILURES {
            let fatal = format!(
                "recovery failed {} times in a row; giving up: {why}",
                s.recovery_failures
            );
            s.timeline.event("fatal", fatal.clone());
            s.fatal = Some(fatal);
            s.phase = Phase::Done;
            shared.done.send_replace(true);
        } else {
            s.recover_after = Some(Instant::now() + RECOVERY_RETRY);
        }
        return;
    }
    s.recovery_failures = 0;
    s.recover_after = None;
    s.lost_in_a_row = 0;
    account_partial_restore(shared, &mut s, &action);
    if matches!(action, RecoveryAction::PartialRestore { .. }) {
        // CPR's O_load and O_res, measured: the reload calls, and detection to the start
        // of this recovery (the replacement had joined).
        let now = s.timeline.now();
        let detected = s
            .failed
            .iter()
            .map(|&(_, t)| t)
            .fold(f64::INFINITY, f64::min);
        let o_res = if detected.is_finite() {
            (now - load_seconds - detected).max(0.0)
        } else {
            0.0
        };
        if let Some(cpr) = s.cpr.as_mut() {
            cpr.on_measured(load_seconds, o_res);
        }
    }
    let (mut rebuild_seconds, mut rebuild_bytes) = (0.0f64, 0u64);
    for (server, reply) in results {
        if let Ok(Some(r)) = reply {
            rebuild_seconds = rebuild_seconds.max(r.seconds);
            rebuild_bytes += r.bytes;
            s.timeline.event(
                "rebuild-end",
                format!(
                    "server {server}: {} rows, {} bytes in {:.3} s ({:.0} MB/s); full redundancy restored",
                    r.rows,
                    r.bytes,
                    r.seconds,
                    r.bytes as f64 / r.seconds.max(1e-9) / 1e6
                ),
            );
        }
    }
    let rolled_back = s.steps.next_step().saturating_sub(applied);
    if let RecoveryAction::Rollback { .. } = action {
        s.steps.rewind(applied);
    }
    // A cut that failed just before was most likely the dead server's doing: try the next
    // one on time. A full disk fails it again and backs off again.
    s.checkpoint_backoff = None;
    // A cut still committing never counted; the restored state is older anyway.
    s.pending_cut = None;
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
            rebuild_seconds,
            rebuild_bytes,
            mode: action.mode(),
            shard_digests: shard_digests.clone(),
        });
    }
}

/// Every server's shard digest (empty where one did not answer).
async fn shard_digests(clients: Vec<ServerClient>, epoch: u64) -> Vec<String> {
    let calls = clients.into_iter().map(|mut c| async move {
        c.applied(AppliedRequest {
            epoch,
            steps: Vec::new(),
            digest: true,
        })
        .await
        .map(|r| r.into_inner().shard_digest)
        .unwrap_or_default()
    });
    futures::future::join_all(calls).await
}

/// Asks every server which orphan steps it applied, then settles, regrants or rolls back.
async fn resolve(shared: &Shared, clients: Vec<ServerClient>, epoch: u64, steps: Vec<u64>) {
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
                    "step-settled",
                    format!("step {step}: applied on every server; only its report was lost"),
                );
            }
            Resolution::Regranted => {
                s.timeline.event(
                    "step-regranted",
                    format!("step {step}: applied on {count} of {servers} servers"),
                );
            }
            Resolution::NeedsRollback => rollback = Some((step, count)),
            Resolution::Unknown => {}
        }
    }
    if let Some((step, count)) = rollback {
        s.epoch += 1;
        shared.metrics.set("ftrec_epoch", s.epoch as f64);
        s.phase = Phase::Recovering;
        s.pause_started = None;
        let epoch = s.epoch;
        s.timeline.event(
            "rollback-needed",
            format!(
                "step {step} reached {count} of {servers} servers before its worker stopped; \
                 rolling back to the last cut for exact results; epoch {epoch}"
            ),
        );
    }
}
