//! `cpr.uncoordinated`'s own saves, run against the servers without holding the lock
//! while training goes on.

use tokio::time::Instant;

use super::cuts::{cut_failed, prune_servers};
use crate::{CheckpointRecord, Shared};
use ftrec_proto::proto::*;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::client::ServerClient;

/// `cpr.uncoordinated`: `servers` save their own shards while training goes on, each at
/// the step its shard has applied (named in its reply), and each save counts on its own as
/// soon as it is committed; no cut spans the servers. `step` is the first step not granted
/// when they became due. A server whose save fails is tried again at its next turn, after
/// the usual backoff.
pub(super) async fn own_saves(
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
            let mut ids = vec![String::new(); s.members.servers.len()];
            if let Some(id) = ids.get_mut(j) {
                id.clone_from(&reply.id);
            }
            // Nothing paused: what the save cost training is the time its copy held the
            // shard's lock, when pushes to that shard waited.
            s.saves.checkpoints.push(CheckpointRecord {
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
                .cuts
                .own_saves
                .as_mut()
                .and_then(|o| o.saved(j, reply.step, now))
            {
                prunes.push((j, kept));
            }
        }
        if failed.is_empty() {
            s.cuts.clear_backoff();
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
