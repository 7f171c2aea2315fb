//! Every server's part of a recovery plan, as RPCs: the restores of a rollback (and the
//! parity re-derived after them), the new epoch adopted by every server, the rebuild of a
//! replacement from its group's survivors (followed to its end, or to `serving` for a
//! background one), a partial restore's reloads, and under 2PC the survivors' fence first.

use ftrec_proto::proto::*;
use ftrec_proto::timeline::{EventKind, Subject};
use ftrec_rpc::client::ServerClient;
use ftrec_rpc::stream::{ProgressDeadline, Progressing};

use crate::Shared;
use crate::planner::RecoveryAction;

/// What a server (by slot) answered to its part of a recovery: for a rebuild, its figures.
pub(super) type RecoveryReply = (usize, Result<Option<RebuildReply>, tonic::Status>);
/// A rebuild's progress stream, each message due within the streams' progress deadline.
pub(super) type RebuildStream = Progressing<tonic::Streaming<RebuildReply>>;
/// A replacement serving while it rebuilds in the background: its progress stream.
pub(super) type Background = (usize, RebuildStream);

/// Every server's part of the plan. A rebuild is two rounds: the survivors adopt the new
/// epoch first (dropping what older epochs left prepared), so that what the replacements
/// then read from them no longer changes.
pub(super) async fn recovery_calls(
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
    let new_epoch = NewEpoch {
        epoch,
        finish: &finish,
    };
    match action {
        RecoveryAction::Rollback { cut } => {
            (rollback(shared, clients, epoch, *cut).await, Vec::new())
        }
        RecoveryAction::KeepState {
            next_step,
            unsettled,
        } => {
            let calls = clients
                .into_iter()
                .enumerate()
                .map(|(i, c)| new_epoch.set(i, c, *next_step, unsettled.clone()));
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
                .map(|(i, c)| new_epoch.set(i, c.clone(), *next_step, unsettled.clone()));
            let mut results: Vec<RecoveryReply> = futures::future::join_all(survivors).await;
            if !results.iter().all(|(_, r)| r.is_ok()) {
                return (results, Vec::new());
            }
            let streams = rebuild(shared, &clients, epoch, servers, unreadable, &mut results).await;
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
            let calls = clients.into_iter().enumerate().map(|(i, c)| {
                let reload = servers
                    .iter()
                    .position(|&j| j == i)
                    .and_then(|k| cuts.get(k).copied().flatten());
                new_epoch.reload_and_set(i, c, reload, *next_step, unsettled.clone())
            });
            (futures::future::join_all(calls).await, Vec::new())
        }
        RecoveryAction::Abandon { .. } => (Vec::new(), Vec::new()),
    }
}

/// The epoch a recovery moves every server to, and the steps (2PC) each finishes on the
/// way.
#[derive(Clone, Copy)]
struct NewEpoch<'a> {
    epoch: u64,
    finish: &'a [u64],
}

impl NewEpoch<'_> {
    /// Server `i` adopts the epoch, counting the steps below `applied` as applied but
    /// `unsettled`.
    async fn set(
        self,
        i: usize,
        mut c: ServerClient,
        applied: u64,
        unsettled: Vec<u64>,
    ) -> RecoveryReply {
        let r = c
            .set_epoch(SetEpochRequest {
                epoch: self.epoch,
                applied,
                unsettled,
                finish: self.finish.to_vec(),
            })
            .await;
        (i, r.map(|_| None))
    }

    /// Server `i` reloads its shard from its save of step `reload` (if any), then adopts
    /// the epoch.
    async fn reload_and_set(
        self,
        i: usize,
        mut c: ServerClient,
        reload: Option<u64>,
        applied: u64,
        unsettled: Vec<u64>,
    ) -> RecoveryReply {
        if let Some(step) = reload
            && let Err(e) = c
                .restore(RestoreRequest {
                    epoch: self.epoch,
                    step: Some(step),
                })
                .await
        {
            return (i, Err(e));
        }
        self.set(i, c, applied, unsettled).await
    }
}

/// Every server restores the cut of step `cut` (its initial state for `None`); with
/// erasure coding, then derives its parity rows and dense replica from its group's.
async fn rollback(
    shared: &Shared,
    clients: Vec<ServerClient>,
    epoch: u64,
    cut: Option<u64>,
) -> Vec<RecoveryReply> {
    let calls = clients
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, mut c)| async move {
            let r = c.restore(RestoreRequest { epoch, step: cut }).await;
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
            background: false,
            failure_free_steps_per_sec: 0.0,
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

/// The replacements in `servers` rebuild their slots from the survivors (which adopted
/// the epoch already), `unreadable` slots counted lost too. Their figures go into
/// `results`; returns the progress streams of those rebuilding in the background.
async fn rebuild(
    shared: &Shared,
    clients: &[ServerClient],
    epoch: u64,
    servers: &[usize],
    unreadable: &[usize],
    results: &mut Vec<RecoveryReply>,
) -> Vec<Background> {
    // Under 2PC a replacement serves at once and rebuilds in the background
    // (`server/degraded.rs`); without it, training waits for the rebuild.
    let background = shared.job.config.ec.two_phase_commit;
    let addresses = shared.server_addresses();
    {
        let mut s = shared.lock();
        for &server in servers {
            s.timeline.event_about(
                EventKind::RebuildStart,
                Subject::Server(server as u32),
                None,
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
    let failure_free_steps_per_sec = shared.lock().steps.recent_steps_per_sec();
    let rebuilds = servers.iter().map(|&server| {
        let mut c = clients[server].clone();
        let request = RebuildRequest {
            epoch,
            servers: addresses.clone(),
            lost: lost.clone(),
            parity_only: false,
            background,
            failure_free_steps_per_sec,
        };
        async move {
            let r = follow_rebuild(shared, server, &mut c, request, true).await;
            (server, r)
        }
    });
    let mut streams = Vec::new();
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
    streams
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

/// Runs `server`'s rebuild and follows its progress stream: with `report`, a
/// `rebuild-progress` event at each quarter of its tables. Returns the totals, or, for a
/// background rebuild, the first reply (`serving`) and the rest of the stream. A server
/// silent past the streams' progress deadline fails the call as unreachable (it sends
/// progress at least every quarter of it while it works).
pub(super) async fn follow_rebuild(
    shared: &Shared,
    server: usize,
    client: &mut ServerClient,
    request: RebuildRequest,
    report: bool,
) -> Result<(RebuildReply, Option<RebuildStream>), tonic::Status> {
    let what = format!(
        "server {server}'s rebuild stream ({})",
        request.servers.get(server).map_or("", String::as_str)
    );
    let mut replies = client
        .rebuild(request)
        .await?
        .into_inner()
        .with_progress_deadline(shared.job.deadlines().stream_progress, what);
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
pub(super) fn report_progress(
    shared: &Shared,
    server: usize,
    reply: &RebuildReply,
    quarter: &mut u32,
) {
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
