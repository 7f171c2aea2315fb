//! Consistent cuts and CPR's prioritised saves, run against the servers without holding
//! the lock: the cut itself, the confirmation of one committing in the background, what a
//! committed or failed cut changes, and pruning the cuts no longer kept.

use tokio::time::Instant;

use crate::cpr::PrioritySaveCosts;
use crate::state::{Phase, State};
use crate::{CheckpointRecord, Shared};
use ftrec_proto::proto::*;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::PsError;
use ftrec_rpc::client::ServerClient;

pub(super) async fn checkpoint(
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
    let mut all_committed = true;
    let (mut tracker_bytes, mut select_seconds, mut tracking_seconds) = (0u64, 0f64, 0f64);
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(r) => {
                let r = r.into_inner();
                bytes += r.bytes;
                tracker_bytes += r.tracker_bytes;
                select_seconds = select_seconds.max(r.select_seconds);
                tracking_seconds = tracking_seconds.max(r.tracking_seconds);
                all_committed &= r.committed;
                ids.push(r.id);
            }
            Err(e) => failed = Some(format!("server {i}: {}", e.message())),
        }
    }
    let committed = {
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
                if priority && let Some(cpr) = s.cuts.cpr.as_mut() {
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
                if all_committed {
                    Some(commit_cut(shared, &mut s, record))
                } else {
                    // Every part is copied, so training goes on; the cut counts for a
                    // rollback only once every server confirms its commit.
                    s.timeline.event(
                        EventKind::CheckpointCopied,
                        format!("step {step}, paused {pause:.3}s; committing in the background"),
                    );
                    s.saves.copied(record, Instant::now());
                    None
                }
            }
            None => {
                s.timeline.event(
                    EventKind::CheckpointAbandoned,
                    format!("step {step}: epoch changed"),
                );
                s.cuts.owe(step, priority);
                None
            }
            Some(e) => {
                coordinated_cut_failed(&mut s, step, priority, &e);
                None
            }
        }
    };
    if let Some(committed) = committed {
        after_commit(shared, clients, epoch, committed).await;
    }
}

/// A checkpoint of `epoch` is over: training goes on (unless a recovery took over), and
/// the pause it caused is returned, seconds.
fn end_pause(s: &mut State, epoch: u64) -> f64 {
    let pause = s.cuts.end_pause();
    if s.epoch == epoch && s.phase == Phase::Checkpointing {
        s.phase = Phase::Running;
    }
    pause
}

/// What a committed cut leaves to do once the lock is released: its report, and the cuts
/// to keep when older ones are due for deletion.
struct Committed {
    step: u64,
    priority: bool,
    end: String,
    kept: Option<Vec<CheckpointRecord>>,
}

/// Counts a cut every server committed: it becomes the rollback target.
fn commit_cut(shared: &Shared, s: &mut State, record: CheckpointRecord) -> Committed {
    let (step, bytes, pause, priority) = (
        record.step,
        record.bytes,
        record.pause_seconds,
        record.priority,
    );
    s.cuts.committed(step, priority, Instant::now());
    let kept = s.saves.commit(record, shared.job.config.checkpoint.keep);
    if !priority && s.scaling.cut_committed(step) {
        // A move went through this cut: its switch is due now, not at the next tick.
        shared.wake.notify_one();
    }
    shared.metrics.add("ftrec_checkpoints_total", 1);
    let kind = if priority {
        " (CPR prioritised save)"
    } else {
        ""
    };
    let end = format!("step {step}{kind}, {bytes} bytes, paused {pause:.3}s");
    // A prioritised save is not a consistent state: a partial restore reloads it, a
    // rollback never goes to it, and it decides nothing.
    if !priority {
        if let Some(r) = s.cuts.replan.as_mut() {
            r.on_cut(pause);
        }
        let train_seconds = s.train_seconds();
        let total = s.steps.ledger.total();
        if let Some(cpr) = s.cuts.cpr.as_mut()
            && let Some(decision) = cpr.on_cut(Instant::now(), pause, train_seconds, step, total)
        {
            tracing::info!("{decision}");
            s.timeline.event(EventKind::CprDecision, decision);
        }
    }
    Committed {
        step,
        priority,
        end,
        kept,
    }
}

/// Reports a committed cut, then prunes the cuts no longer kept. With etcd membership the
/// report waits for the record that holds the cut: a cut the log calls committed is one a
/// new leader rolls back to. Before, the report went out at once and the record followed
/// at the next flush (`cluster.etcd_flush_ms`), so a leader killed in between left a new
/// leader rolling back to the cut before the one its log had reported.
async fn after_commit(
    shared: &Shared,
    clients: Vec<ServerClient>,
    epoch: u64,
    committed: Committed,
) {
    let Committed {
        step,
        priority,
        mut end,
        kept,
    } = committed;
    if shared.durable_membership()
        && let Err(e) = shared.sync_durable().await
    {
        end.push_str(&format!(
            "; not recorded in etcd yet ({e}): a new leader may roll back to an older cut"
        ));
    }
    shared.event(EventKind::CheckpointEnd, end);
    if !priority {
        shared
            .die_at_step(ftrec_faults::points::CUT_COMMITTED, Some(step))
            .await;
    }
    if let Some(kept) = kept {
        prune_cuts(shared, clients, epoch, &kept).await;
    }
}

/// A coordinated cut (or prioritised save) that failed: [`cut_failed`], and the cut is
/// owed ([`crate::state::CutSchedule::owe`]). Own saves keep their own schedule and owe
/// nothing.
fn coordinated_cut_failed(s: &mut State, step: u64, priority: bool, why: &str) {
    cut_failed(s, step, why);
    s.cuts.owe(step, priority);
}

/// A cut that will not count: said once on stderr and in the event log, and the next one
/// waits (doubling, bounded), so a full disk is neither hammered nor logged in a loop.
pub(super) fn cut_failed(s: &mut State, step: u64, why: &str) {
    let wait = s.cuts.failed(Instant::now());
    if step >= s.steps.ledger.total() {
        s.cuts.final_cut_failed(Instant::now());
    }
    let fallback = s
        .saves
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
pub(super) async fn confirm_cut(
    shared: &Shared,
    clients: Vec<ServerClient>,
    epoch: u64,
    step: u64,
) {
    let calls = clients
        .iter()
        .cloned()
        .map(|mut c| async move { c.cut_committed(CutCommittedRequest { epoch, step }).await });
    let mut all = true;
    let mut failed = None;
    let mut collided = None;
    for (i, r) in futures::future::join_all(calls)
        .await
        .into_iter()
        .enumerate()
    {
        match r {
            Ok(r) => all &= r.into_inner().committed,
            Err(status) => {
                if let Some(key) = PsError::rpc(format!("server {i}"), &status).taken_name() {
                    collided = Some(format!("server {i}: {key}"));
                }
                failed = Some(format!("server {i}: {}", status.message()));
            }
        }
    }
    let committed = {
        let mut s = shared.lock();
        if s.epoch != epoch || s.saves.pending().is_none_or(|c| c.step != step) {
            return;
        }
        if let Some(e) = failed {
            // Two writers chose one name: never expected (each cut's step is new on its
            // branch), so it is an event of its own for the checks to find.
            if let Some(key) = collided {
                s.timeline.event(EventKind::CutCollided, key);
            }
            let priority = s.saves.take_pending().is_some_and(|c| c.priority);
            coordinated_cut_failed(&mut s, step, priority, &e);
            return;
        }
        if !all {
            let limit = shared.job.timeout();
            if s.saves.pending_overdue(limit) {
                let priority = s.saves.take_pending().is_some_and(|c| c.priority);
                coordinated_cut_failed(
                    &mut s,
                    step,
                    priority,
                    &format!("its background commit did not finish within {limit:?}"),
                );
                return;
            }
            s.saves.confirm_later(Instant::now());
            return;
        }
        let Some(record) = s.saves.take_pending() else {
            return;
        };
        commit_cut(shared, &mut s, record)
    };
    after_commit(shared, clients, epoch, committed).await;
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
pub(super) async fn prune_servers(
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
    // The next cut's prune lists the same keep set, so nothing is left behind for good.
    // Said once until a prune succeeds again, not at every cut.
    if s.saves.pruned(failed.is_empty()) {
        let why = failed.join("; ");
        tracing::warn!("pruning old checkpoints: {why}; retrying after each cut");
        s.timeline.event(EventKind::PruneFailed, why);
    }
    if failed.is_empty() && deleted > 0 {
        s.timeline.event(
            EventKind::CheckpointsPruned,
            format!("{deleted} shard checkpoints deleted; steps kept: {keep_steps:?}"),
        );
    }
}
