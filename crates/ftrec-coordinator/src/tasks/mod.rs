//! The work the control loop plans (`Task`), run against the servers without holding
//! the lock: consistent cuts and CPR's prioritised saves with pruning (`cuts.rs`),
//! `cpr.uncoordinated`'s own saves (`own_saves.rs`), and resolving the steps of dead
//! workers (`resolve.rs`). Recoveries run in `recovery/`.

mod cuts;
mod own_saves;
mod resolve;

use std::time::Duration;

use tokio::time::Instant;

use crate::Shared;
use crate::planner::RecoveryAction;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::PsError;

use cuts::{checkpoint, confirm_cut};
use own_saves::own_saves;
use resolve::resolve;

/// How long a recovery that may go on unrecorded waits for etcd to record its epoch: a
/// write that etcd serves takes milliseconds.
const UNRECORDED_AFTER: Duration = Duration::from_secs(1);

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
    /// A move's cut committed: switch to its layout (`scale.rs`).
    Switch {
        epoch: u64,
    },
}

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
            // Through an etcd outage, a recovery that rolls nothing back (the survivors
            // keep their state, a replacement rebuilds from parity) goes on unrecorded
            // once etcd has not answered for `UNRECORDED_AFTER`: a newer leader's epochs
            // are above it, and it finds the dead server again. Waiting out the whole
            // etcd request timeout, and then the lease, cost a quorum loss 6 s.
            let unrecorded = shared.may_act_unrecorded()
                && matches!(
                    action,
                    RecoveryAction::Rebuild { .. } | RecoveryAction::KeepState { .. }
                );
            let synced = if unrecorded {
                tokio::time::timeout(UNRECORDED_AFTER, shared.sync_durable())
                    .await
                    .unwrap_or_else(|_| {
                        Err(PsError::Unavailable(format!(
                            "no answer within {UNRECORDED_AFTER:?}"
                        )))
                    })
            } else {
                shared.sync_durable().await
            };
            if let Err(e) = synced {
                // A refused write deposes this leader (`sync_durable`): it decides nothing.
                if !unrecorded || !shared.leading() {
                    tracing::warn!("recovery of epoch {epoch} waits for etcd: {e}");
                    shared.lock().recovery.retry_soon(Instant::now());
                    return;
                }
                let text = format!(
                    "etcd does not answer ({e}): the recovery of epoch {epoch} goes on \
                     without a record (cluster.train_through_etcd_outage)"
                );
                tracing::warn!("{text}");
                shared.event(EventKind::Coordinator, text);
            }
            crate::recovery::recover(shared, clients, epoch, action).await
        }
        Task::Resolve { epoch, steps } => resolve(shared, clients, epoch, steps).await,
        Task::ConfirmCut { epoch, step } => confirm_cut(shared, clients, epoch, step).await,
        Task::Switch { epoch } => crate::scale::switch_recorded(shared, epoch).await,
    }
}
