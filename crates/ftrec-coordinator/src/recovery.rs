//! Recoveries, run against the servers without holding the lock: every server's part of
//! the planner's `RecoveryAction` (a rollback, a new epoch, an erasure-coded rebuild, a
//! partial restore), the rebuild's progress events, CPR's PLS accounting and measurements,
//! and the run's record of each recovery.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::planner::RecoveryAction;
use crate::{Phase, Recovery, Shared, State};
use ftrec_proto::proto::*;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::PsError;
use ftrec_rpc::client::ServerClient;

/// A failed recovery is tried again after this, at most this many times in a row.
const RECOVERY_RETRY: Duration = Duration::from_millis(200);
const MAX_RECOVERY_FAILURES: u32 = 50;

/// What a server (by slot) answered to its part of a recovery: for a rebuild, its figures.
type RecoveryReply = (usize, Result<Option<RebuildReply>, tonic::Status>);
/// A replacement serving while it rebuilds in the background: its progress stream.
type Background = (usize, tonic::Streaming<RebuildReply>);

/// Every server's part of the plan. A rebuild is two rounds: the survivors adopt the new
/// epoch first (dropping what older epochs left prepared), so that what the replacements
/// then read from them no longer changes.
async fn recovery_calls(
    shared: &Shared,
    clients: Vec<ServerClient>,
    epoch: u64,
    action: &RecoveryAction,
) -> (Vec<RecoveryReply>, Vec<Background>) {
    // Under 2PC the survivors are fenced first, and the steps some of them committed
    // before their fence are finished everywhere they are prepared.
    let finish = match action {
        RecoveryAction::KeepState { unsettled, .. } | RecoveryAction::Rebuild { unsettled, .. }
            if shared.job.config.two_phase_commit() =>
        {
            let lost: &[usize] = match action {
                RecoveryAction::Rebuild { servers, .. } => servers,
                _ => &[],
            };
            match fence_survivors(&clients, lost, epoch, unsettled).await {
                Ok(finish) => finish,
                Err(failed) => return (failed, Vec::new()),
            }
        }
        _ => Vec::new(),
    };
    let finish = &finish;
    let set_epoch = |i: usize, mut c: ServerClient, applied: u64, unsettled: Vec<u64>| async move {
        let r = c
            .set_epoch(SetEpochRequest {
                epoch,
                applied,
                unsettled,
                finish: finish.clone(),
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
                return (restored, Vec::new());
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
                    background: false,
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
            (futures::future::join_all(reencode).await, Vec::new())
        }
        RecoveryAction::KeepState {
            next_step,
            unsettled,
        } => {
            let calls = clients
                .into_iter()
                .enumerate()
                .map(|(i, c)| set_epoch(i, c, *next_step, unsettled.clone()));
            (futures::future::join_all(calls).await, Vec::new())
        }
        RecoveryAction::Rebuild {
            servers,
            next_step,
            unsettled,
            unreadable,
        } => {
            let survivors = clients
                .iter()
                .enumerate()
                .filter(|(i, _)| !servers.contains(i))
                .map(|(i, c)| set_epoch(i, c.clone(), *next_step, unsettled.clone()));
            let mut results: Vec<RecoveryReply> = futures::future::join_all(survivors).await;
            let mut streams = Vec::new();
            // Under 2PC a replacement serves at once and rebuilds in the background
            // (`server/degraded.rs`); without it, training waits for the rebuild.
            let background = shared.job.config.ec.two_phase_commit;
            if results.iter().all(|(_, r)| r.is_ok()) {
                let addresses = shared.server_addresses();
                {
                    let mut s = shared.lock();
                    for &server in servers {
                        s.timeline.event(
                            EventKind::RebuildStart,
                            format!(
                                "server {server} decodes its rows and parity from the survivors{}",
                                if background { " in the background" } else { "" }
                            ),
                        );
                    }
                }
                let lost: Vec<u32> = servers
                    .iter()
                    .chain(unreadable)
                    .map(|&s| s as u32)
                    .collect();
                let rebuilds = servers.iter().map(|&server| {
                    let mut c = clients[server].clone();
                    let request = RebuildRequest {
                        epoch,
                        servers: addresses.clone(),
                        lost: lost.clone(),
                        parity_only: false,
                        background,
                    };
                    async move {
                        let r = follow_rebuild(shared, server, &mut c, request, true).await;
                        (server, r)
                    }
                });
                for (server, r) in futures::future::join_all(rebuilds).await {
                    match r {
                        Ok((reply, stream)) => {
                            if let Some(stream) = stream {
                                streams.push((server, stream));
                            }
                            results.push((server, Ok(Some(reply))));
                        }
                        Err(e) => results.push((server, Err(e))),
                    }
                }
            }
            (results, streams)
        }
        RecoveryAction::PartialRestore {
            servers,
            cuts,
            next_step,
            unsettled,
        } => {
            // Each replacement reloads its own shard from its checkpoint of its cut; then
            // every server, survivors and replacements alike, adopts the epoch and counts
            // the steps below `next_step` as applied: nobody rolls back.
            let calls = clients.into_iter().enumerate().map(|(i, mut c)| {
                let reload = servers
                    .iter()
                    .position(|&j| j == i)
                    .and_then(|k| cuts.get(k).copied().flatten());
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
            (futures::future::join_all(calls).await, Vec::new())
        }
        RecoveryAction::Abandon { .. } => (Vec::new(), Vec::new()),
    }
}

/// 2PC's first recovery round: every survivor (every slot not in `lost`) raises its fence
/// to `epoch`, after which none commits a step of an older epoch, and says which of the
/// `unsettled` steps it applied. A step applied on some survivor was decided "commit" by
/// its worker: the survivors that still hold it prepared must commit it too (ECRec's
/// atomicity), or its parity differences would be on some holders only. Returns those
/// steps, or the survivors' failures.
async fn fence_survivors(
    clients: &[ServerClient],
    lost: &[usize],
    epoch: u64,
    unsettled: &[u64],
) -> Result<Vec<u64>, Vec<RecoveryReply>> {
    let calls = clients
        .iter()
        .cloned()
        .enumerate()
        .filter(|(i, _)| !lost.contains(i))
        .map(|(i, mut c)| async move {
            let r = c
                .fence(FenceRequest {
                    epoch,
                    steps: unsettled.to_vec(),
                })
                .await;
            (i, r.map(|reply| reply.into_inner().applied))
        });
    let mut finish = Vec::new();
    let mut failed = Vec::new();
    for (i, reply) in futures::future::join_all(calls).await {
        match reply {
            Ok(applied) => finish.extend(
                unsettled
                    .iter()
                    .zip(applied)
                    .filter(|(_, applied)| *applied)
                    .map(|(&step, _)| step),
            ),
            Err(e) => failed.push((i, Err(e))),
        }
    }
    if !failed.is_empty() {
        return Err(failed);
    }
    finish.sort_unstable();
    finish.dedup();
    if !finish.is_empty() {
        tracing::info!(
            "epoch {epoch}: steps {finish:?} committed on some survivor before the fence; finishing them"
        );
    }
    Ok(finish)
}

/// Counts the PLS of a partial restore (CPR Eq. 3), one term per reloaded server, and
/// says each term's inputs in the event log so the figure can be checked from it.
fn account_partial_restore(shared: &Shared, s: &mut State, action: &RecoveryAction) {
    let RecoveryAction::PartialRestore {
        servers,
        cuts,
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
    let own = s.own_saves.is_some();
    let Some(cpr) = s.cpr.as_mut() else {
        return;
    };
    let mut lines = Vec::new();
    for (&server, &cut) in servers.iter().zip(cuts) {
        let s_ckpt = schedule.samples_before(cut.unwrap_or(0));
        let increment = cpr.on_partial_restore(s_i, s_ckpt);
        lines.push(format!(
            "server {server} reloads its shard from {} (S_last_ckpt {s_ckpt} samples); \
             lost at S_i {s_i} samples; PLS += {increment:.6} -> {:.6}",
            match (cut, own) {
                (None, _) => "its initial state".to_string(),
                (Some(c), true) => format!("its own save of step {c}"),
                (Some(c), false) => format!("the cut of step {c}"),
            },
            cpr.pls()
        ));
    }
    let pls = cpr.pls();
    shared.metrics.set("ftrec_pls", pls);
    for line in lines {
        s.timeline.event(EventKind::PartialRestore, line);
    }
}

/// Counts the samples whose updates a lost shard no longer holds, summed over the shards:
/// under `none` everything a replaced shard had trained (it starts over from its initial
/// state), under partial recovery what it trained since the cut it reloads. Exact modes
/// lose nothing (a rollback retrains, counted in `steps_rolled_back`).
fn account_lost_samples(shared: &Shared, s: &mut State, action: &RecoveryAction) {
    let schedule = shared.schedule;
    let settled_before = |next_step: u64, unsettled: &[u64]| {
        let in_flight: u64 = unsettled.iter().map(|&u| schedule.batch(u).1).sum();
        schedule.samples_before(next_step).saturating_sub(in_flight)
    };
    let (per_shard, shards) = match action {
        RecoveryAction::KeepState {
            next_step,
            unsettled,
        } if shared.job.config.cluster.ft == ftrec_config::FaultTolerance::None => {
            let mut lost: Vec<usize> = s.failed.iter().map(|&(server, _)| server).collect();
            lost.sort_unstable();
            lost.dedup();
            (settled_before(*next_step, unsettled), lost.len() as u64)
        }
        RecoveryAction::PartialRestore {
            cuts,
            next_step,
            unsettled,
            ..
        } => {
            let settled = settled_before(*next_step, unsettled);
            let lost: u64 = cuts
                .iter()
                .map(|cut| settled.saturating_sub(schedule.samples_before(cut.unwrap_or(0))))
                .sum();
            (lost, 1)
        }
        _ => return,
    };
    let lost = per_shard * shards;
    if lost > 0 {
        s.lost_samples += lost;
        shared.metrics.add("ftrec_lost_samples_total", lost);
        s.timeline.event(
            EventKind::SamplesLost,
            format!("{shards} shard(s) lost the updates of {per_shard} samples each"),
        );
    }
}

/// Runs `server`'s rebuild and follows its progress stream: with `report`, a
/// `rebuild-progress` event at each quarter of its tables. Returns the totals, or, for a
/// background rebuild, the first reply (`serving`) and the rest of the stream.
async fn follow_rebuild(
    shared: &Shared,
    server: usize,
    client: &mut ServerClient,
    request: RebuildRequest,
    report: bool,
) -> Result<(RebuildReply, Option<tonic::Streaming<RebuildReply>>), tonic::Status> {
    let mut replies = client.rebuild(request).await?.into_inner();
    let mut quarter = 0;
    while let Some(reply) = replies.message().await? {
        if reply.done {
            return Ok((reply, None));
        }
        if reply.serving {
            return Ok((reply, Some(replies)));
        }
        if report {
            report_progress(shared, server, &reply, &mut quarter);
        }
    }
    Err(tonic::Status::unavailable(format!(
        "server {server}'s rebuild ended without its totals"
    )))
}

/// A `rebuild-progress` event when `reply` reaches a new quarter of the tables.
fn report_progress(shared: &Shared, server: usize, reply: &RebuildReply, quarter: &mut u32) {
    let reached = (reply.tables_done * 4) / reply.tables.max(1);
    if reached > *quarter && reply.tables_done < reply.tables {
        *quarter = reached;
        shared.lock().timeline.event(
            EventKind::RebuildProgress,
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

fn rebuild_end_event(server: usize, r: &RebuildReply) -> String {
    format!(
        "server {server}: {} rows, {} bytes in {:.3} s ({:.0} MB/s); full redundancy restored",
        r.rows,
        r.bytes,
        r.seconds,
        r.bytes as f64 / r.seconds.max(1e-9) / 1e6
    )
}

/// Follows a background rebuild to its end: progress events, then the `rebuild-end`
/// event and the recovery's rebuild figures, and the server leaves `rebuilding`. A rebuild
/// that fails on a server still alive ends the run with the cause (it would never end);
/// one whose server died is the failure detector's.
async fn follow_background(
    shared: Arc<Shared>,
    server: usize,
    epoch: u64,
    mut stream: tonic::Streaming<RebuildReply>,
) {
    let mut quarter = 0;
    let failure = loop {
        match stream.message().await {
            Ok(Some(reply)) if reply.done => {
                let mut s = shared.lock();
                let before = s.rebuilding.len();
                s.rebuilding.retain(|&(r, e)| !(r == server && e == epoch));
                if s.rebuilding.len() == before {
                    return;
                }
                let now = s
                    .timeline
                    .event(EventKind::RebuildEnd, rebuild_end_event(server, &reply));
                let next_step = s.steps.next_step();
                let unsettled = s.steps.unsettled();
                for r in s
                    .recoveries
                    .iter_mut()
                    .filter(|r| r.server == server && r.epoch == epoch)
                {
                    r.rebuild_seconds = reply.seconds;
                    r.rebuild_bytes = reply.bytes;
                    r.degraded_seconds = now - r.detected_at;
                    r.steps_while_degraded = next_step.saturating_sub(r.resumed_step);
                    let in_flight = unsettled.iter().filter(|&&u| u >= r.resumed_step).count();
                    r.steps_committed_while_degraded =
                        r.steps_while_degraded.saturating_sub(in_flight as u64);
                }
                return;
            }
            Ok(Some(reply)) => report_progress(&shared, server, &reply, &mut quarter),
            Ok(None) => break "the stream ended without its totals".to_string(),
            Err(status) => match PsError::rpc(format!("server {server}'s rebuild"), &status) {
                // A rebuild superseded by a rollback or a newer rebuild is no failure.
                PsError::Superseded(_) => return,
                e => break e.to_string(),
            },
        }
    };
    // Give the failure detector time to tell a dead server from a failed rebuild.
    let wait = Duration::from_millis(shared.job.config.cluster.failure_timeout_ms * 2);
    // A recovery under way decides the slot's fate (a rollback clears `rebuilding`).
    let mut s = loop {
        tokio::time::sleep(wait).await;
        let s = shared.lock();
        if s.phase != Phase::Recovering {
            break s;
        }
    };
    if s.rebuilding.contains(&(server, epoch)) {
        let why = format!("server {server}'s background rebuild failed: {failure}");
        s.timeline.event(EventKind::Fatal, why.clone());
        s.fatal = Some(why);
        s.phase = Phase::Done;
        shared.done.send_replace(true);
    }
}

pub(super) async fn recover(
    shared: &Arc<Shared>,
    clients: Vec<ServerClient>,
    epoch: u64,
    action: RecoveryAction,
) {
    if let RecoveryAction::Abandon { why } = &action {
        let mut s = shared.lock();
        s.timeline.event(EventKind::Fatal, why.clone());
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
    let (results, background) = recovery_calls(shared, clients, epoch, &action).await;
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
                .event(EventKind::RecoveryRetry, format!("epoch {epoch}: {why}"));
        }
        if s.recovery_failures >= MAX_RECOVERY_FAILURES {
            let fatal = format!(
                "recovery failed {} times in a row; giving up: {why}",
                s.recovery_failures
            );
            s.timeline.event(EventKind::Fatal, fatal.clone());
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
    // One failure of the cluster (whatever number of servers it took): the MTBF the cut
    // interval was planned for is measured again.
    if !s.failed.is_empty() {
        let train = s.train_seconds();
        if let Some(line) = s.replan.as_mut().map(|r| r.on_failure(train)) {
            tracing::info!("{line}");
            s.timeline.event(EventKind::CheckpointReplanned, line);
        }
    }
    account_partial_restore(shared, &mut s, &action);
    account_lost_samples(shared, &mut s, &action);
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
    let in_background: Vec<usize> = background.iter().map(|(server, _)| *server).collect();
    for (server, reply) in results {
        match reply {
            Ok(Some(r)) if in_background.contains(&server) => {
                s.timeline.event(
                    EventKind::Degraded,
                    format!(
                        "server {server} serves after {:.3} s: rows not rebuilt yet are decoded \
                         from their stripes on demand while the rest rebuilds in the background",
                        r.seconds
                    ),
                );
            }
            Ok(Some(r)) => {
                rebuild_seconds = rebuild_seconds.max(r.seconds);
                rebuild_bytes += r.bytes;
                s.timeline
                    .event(EventKind::RebuildEnd, rebuild_end_event(server, &r));
            }
            _ => {}
        }
    }
    let rolled_back = s.steps.next_step().saturating_sub(applied);
    s.steps_rolled_back += rolled_back;
    if let RecoveryAction::Rollback { .. } = action {
        s.steps.rewind(applied);
        // Every server restored a cut and re-derived its parity: no rebuild goes on.
        s.rebuilding.clear();
    }
    // A cut that failed just before was most likely the dead server's doing: try the next
    // one on time. A full disk fails it again and backs off again.
    s.checkpoint_backoff = None;
    // A cut still committing never counted. After a rollback the restored state is older
    // and the cut comes round again; after a rebuild nothing rolled back, so it is owed.
    if let Some(cut) = s.pending_cut.take()
        && !matches!(action, RecoveryAction::Rollback { .. })
    {
        crate::owe_cut(&mut s, cut.step, cut.priority);
    }
    s.phase = Phase::Running;
    let resumed_at = s.timeline.event(
        EventKind::RecoveryEnd,
        format!("training resumes at step {applied} (rolled back {rolled_back} steps)"),
    );
    let rebuilt = matches!(action, RecoveryAction::Rebuild { .. });
    for (server, detected_at) in std::mem::take(&mut s.failed) {
        let background_rebuild = in_background.contains(&server);
        s.recoveries.push(Recovery {
            server,
            detected_at,
            resumed_at,
            resumed_step: applied,
            steps_rolled_back: rolled_back,
            rebuild_seconds,
            rebuild_bytes,
            degraded_seconds: if rebuilt && !background_rebuild {
                resumed_at - detected_at
            } else {
                0.0
            },
            background_rebuild,
            steps_while_degraded: 0,
            steps_committed_while_degraded: 0,
            kill_to_resume_seconds: None,
            first_step_at: None,
            kill_to_first_step_seconds: None,
            epoch,
            mode: action.mode().to_string(),
            shard_digests: shard_digests.clone(),
        });
    }
    for (server, stream) in background {
        s.rebuilding.push((server, epoch));
        tokio::spawn(follow_background(shared.clone(), server, epoch, stream));
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
