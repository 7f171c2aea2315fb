//! Recoveries, run against the servers without holding the lock: every server's part of
//! the planner's `RecoveryAction` (`calls.rs`: a rollback, a new epoch, an erasure-coded
//! rebuild, a partial restore), what the recovery cost (`accounting.rs`: CPR's PLS, lost
//! samples), background rebuilds followed to their end (`background.rs`), and here the
//! retries of a failing recovery and the run's record of each one that went through.

mod accounting;
mod background;
mod calls;

use std::sync::Arc;

use tokio::time::Instant;

use crate::Shared;
use crate::planner::RecoveryAction;
use crate::state::{AttemptFailed, Phase, State};
use crate::summary::Recovery;
use ftrec_proto::proto::*;
use ftrec_proto::timeline::{EventKind, Subject};
use ftrec_rpc::client::ServerClient;

use accounting::{account_lost_samples, account_partial_restore};
use background::{follow_background, rebuild_end_event};
use calls::{Background, RecoveryReply, recovery_calls};

pub(super) async fn recover(
    shared: &Arc<Shared>,
    clients: Vec<ServerClient>,
    epoch: u64,
    action: RecoveryAction,
) {
    if let RecoveryAction::Abandon { why } = &action {
        let mut s = shared.lock();
        shared.fail_run(&mut s, why.clone());
        return;
    }
    shared.die_at(ftrec_faults::points::RECOVERY).await;
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
        attempt_failed(shared, &mut s, epoch, &failed.join("; "));
        return;
    }
    s.recovery.attempt_succeeded();
    s.steps.lost_in_a_row = 0;
    count_costs(shared, &mut s, &action, load_seconds);
    let in_background: Vec<usize> = background.iter().map(|(server, _)| *server).collect();
    let rebuilt = rebuild_figures(&mut s, results, &in_background);
    let resumed = resume(&mut s, &action);
    record_recoveries(
        &mut s,
        &action,
        epoch,
        resumed,
        rebuilt,
        &in_background,
        shard_digests,
    );
    follow_in_background(shared, &mut s, epoch, background);
}

/// A recovery of `epoch` failed (`why`): tried again after a backoff, said on the first
/// failure and every tenth; a cause that does not pass (a missing cut, a shard of another
/// server) ends the run with it rather than looping.
fn attempt_failed(shared: &Shared, s: &mut State, epoch: u64, why: &str) {
    // A member whose part failed may be dead (a replacement SIGKILLed mid-restore): every
    // server's port is probed, as after a worker's lost step, so a refused one is declared
    // at once instead of after its failure timeout, while this recovery retries in vain.
    // The shoot-out's second strike during a rollback waited 1.2 s for it (issue 45).
    s.members.probe_requested = true;
    match s.recovery.attempt_failed(Instant::now()) {
        AttemptFailed::Retry { say } => {
            if say {
                tracing::warn!("recovery of epoch {epoch} failed: {why}; retrying");
                s.timeline
                    .event(EventKind::RecoveryRetry, format!("epoch {epoch}: {why}"));
            }
        }
        AttemptFailed::GiveUp { failures } => {
            let fatal = format!("recovery failed {failures} times in a row; giving up: {why}");
            shared.fail_run(s, fatal);
        }
    }
}

/// What the recovery tells the planners: one failure of the cluster (whatever number of
/// servers it took) for the re-planned cut interval, CPR's PLS and measured costs, and
/// the samples lost.
fn count_costs(shared: &Shared, s: &mut State, action: &RecoveryAction, load_seconds: f64) {
    // The MTBF the cut interval was planned for is measured again.
    if !s.recovery.failed.is_empty() {
        let train = s.train_seconds();
        if let Some(line) = s.cuts.replan.as_mut().map(|r| r.on_failure(train)) {
            tracing::info!("{line}");
            s.timeline.event(EventKind::CheckpointReplanned, line);
        }
    }
    account_partial_restore(shared, s, action);
    account_lost_samples(shared, s, action);
    if matches!(action, RecoveryAction::PartialRestore { .. }) {
        // CPR's O_load and O_res, measured: the reload calls, and detection to the start
        // of this recovery (the replacement had joined).
        let now = s.timeline.now();
        let o_res = s
            .recovery
            .first_detected()
            .map_or(0.0, |detected| (now - load_seconds - detected).max(0.0));
        if let Some(cpr) = s.cuts.cpr.as_mut() {
            cpr.on_measured(load_seconds, o_res);
        }
    }
}

/// The rebuilds' events, and the figures of those that finished (the slowest one's
/// seconds, the bytes of all); a replacement serving while it rebuilds in the background
/// is said to be degraded instead.
fn rebuild_figures(
    s: &mut State,
    results: Vec<RecoveryReply>,
    in_background: &[usize],
) -> (f64, u64) {
    let (mut rebuild_seconds, mut rebuild_bytes) = (0.0f64, 0u64);
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
                s.timeline.event_about(
                    EventKind::RebuildEnd,
                    Subject::Server(server as u32),
                    None,
                    rebuild_end_event(server, &r),
                );
            }
            _ => {}
        }
    }
    (rebuild_seconds, rebuild_bytes)
}

/// Where training resumes after `action`.
#[derive(Clone, Copy)]
struct Resumed {
    /// The first step not applied everywhere.
    step: u64,
    /// Steps granted before that will be trained again.
    rolled_back: u64,
    /// On the timeline's clock.
    at: f64,
}

/// Training resumes: the ledger rewinds to the cut after a rollback, the save schedule
/// gets over the failure, and granting starts again.
fn resume(s: &mut State, action: &RecoveryAction) -> Resumed {
    let applied = match action {
        // The initial state of a resumed job's (or a moved job's) servers is its base cut.
        RecoveryAction::Rollback { cut: None } => s.scaling.first_step(),
        _ => action.resume_step(),
    };
    let rolled_back = s.steps.ledger.next_step().saturating_sub(applied);
    s.recovery.steps_rolled_back += rolled_back;
    if let RecoveryAction::Rollback { .. } = action {
        s.steps.ledger.rewind(applied);
        // Every server restored a cut and re-derived its parity: no rebuild goes on.
        s.recovery.rebuilding.clear();
    }
    // A cut that failed just before was most likely the dead server's doing: try the next
    // one on time. A full disk fails it again and backs off again.
    s.cuts.clear_backoff();
    // A cut still committing never counted. After a rollback the restored state is older
    // and the cut comes round again; after a rebuild nothing rolled back, so it is owed.
    if let Some(cut) = s.saves.take_pending()
        && !matches!(action, RecoveryAction::Rollback { .. })
    {
        s.cuts.owe(cut.step, cut.priority);
    }
    s.phase = Phase::Running;
    let at = s.timeline.event(
        EventKind::RecoveryEnd,
        format!("training resumes at step {applied} (rolled back {rolled_back} steps)"),
    );
    Resumed {
        step: applied,
        rolled_back,
        at,
    }
}

/// One record per failed slot this recovery replaced, for the report.
fn record_recoveries(
    s: &mut State,
    action: &RecoveryAction,
    epoch: u64,
    resumed: Resumed,
    (rebuild_seconds, rebuild_bytes): (f64, u64),
    in_background: &[usize],
    shard_digests: Vec<String>,
) {
    let rebuilt = matches!(action, RecoveryAction::Rebuild { .. });
    for (server, detected_at) in std::mem::take(&mut s.recovery.failed) {
        let background_rebuild = in_background.contains(&server);
        s.recovery.recoveries.push(Recovery {
            server,
            detected_at,
            resumed_at: resumed.at,
            resumed_step: resumed.step,
            steps_rolled_back: resumed.rolled_back,
            rebuild_seconds,
            rebuild_bytes,
            degraded_seconds: if rebuilt && !background_rebuild {
                resumed.at - detected_at
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
            mode: action.mode(),
            shard_digests: shard_digests.clone(),
        });
    }
}

/// The replacements serving while they rebuild: each stays in `rebuilding` (holding the
/// run open) until its stream ends.
fn follow_in_background(
    shared: &Arc<Shared>,
    s: &mut State,
    epoch: u64,
    background: Vec<Background>,
) {
    for (server, stream) in background {
        s.recovery.rebuilding.push((server, epoch));
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
