//! Orphan resolution: asking the servers which steps of dead workers (or lost reports)
//! they applied, finishing 2PC commits a dead worker left half done, then settling,
//! granting again or rolling back.

use tokio::time::Instant;

use crate::Shared;
use crate::ledger::{Applied, Resolution};
use crate::planner;
use crate::state::Phase;
use ftrec_proto::proto::*;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::client::ServerClient;

/// Asks every server which orphan steps it applied, then settles, regrants or rolls back.
pub(super) async fn resolve(
    shared: &Shared,
    clients: Vec<ServerClient>,
    epoch: u64,
    steps: Vec<u64>,
) {
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
                shared.lock().steps.resolve_later(Instant::now());
                return;
            }
        }
    }
    if let Some(clients) = finishers {
        finish_commits(clients.clone(), epoch, &steps, &mut answers).await;
        if !abort_unapplied(clients, epoch, &steps, &answers).await {
            shared.lock().steps.resolve_later(Instant::now());
            return;
        }
    }
    let config = &shared.job.config.cluster;
    let mut s = shared.lock();
    // Partial recovery that fell back to full rollbacks promises exactness like `checkpoint`.
    let fell_back = s.cuts.cpr.as_ref().is_some_and(|cpr| !cpr.partial());
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
        match s.steps.ledger.resolve(step, applied, partial_regrant) {
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
        s.cuts.drop_pause();
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

/// Two-phase commit: a step that no server committed is granted again, and a server that
/// still holds the dead worker's prepared copy would take it for a retry of the new
/// grant's phase 1 and commit the old gradient. In deterministic mode that gradient is
/// the new one bit for bit; with asynchronous workers the parameters have moved since, so
/// the servers that held a copy and the ones that did not would install different dense
/// gradients, and the replicas part (found by the simulation once its control-plane
/// sweep ran asynchronous workers). Every server drops its copy first. False when one
/// could not be told: the step waits.
async fn abort_unapplied(
    clients: Vec<ServerClient>,
    epoch: u64,
    steps: &[u64],
    answers: &[Vec<bool>],
) -> bool {
    let unapplied = steps
        .iter()
        .enumerate()
        .filter(|&(i, _)| answers.iter().all(|a| !a[i]))
        .map(|(_, &step)| step);
    let mut calls = Vec::new();
    for step in unapplied {
        for c in &clients {
            let mut c = c.clone();
            calls.push(async move {
                c.abort_step(StepDecision {
                    epoch,
                    step,
                    // The coordinator's own resolution: every try of the step.
                    attempt: 0,
                })
                .await
                .is_ok()
            });
        }
    }
    futures::future::join_all(calls)
        .await
        .into_iter()
        .all(|told| told)
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
                    let done = c
                        .commit_step(StepDecision {
                            epoch,
                            step,
                            attempt: 0,
                        })
                        .await
                        .is_ok();
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
