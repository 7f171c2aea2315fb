//! Erasure coding on a server (ECRec §3.2, §3.5): difference propagation as a pre-commit
//! observer, parity differences received from other servers, and two-phase commit.
//!
//! Two-phase commit, as built here:
//! - Phase 1 (`Push` with `prepare`): the server takes its commit turn, stages the update,
//!   sends `old XOR new` of every changed row to the stripe's parity holders, which *stage*
//!   them, and keeps the staged update with the turn until phase 2. Holding the turn keeps
//!   the next update from being staged against rows that are about to change.
//! - Phase 2 (`CommitStep`): the update is installed and the parity holders fold what they
//!   staged for the step; `AbortStep` drops both.
//! - A prepared step not decided within the RPC timeout is aborted, and an epoch change
//!   (a recovery) drops everything prepared or staged in older epochs: no staged update
//!   stays behind. A server that dies in phase 2 loses nothing: its parity holders and
//!   dense replica commit the step, and the rebuild decodes its rows with it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use ftrec_ec::{Codec, StripeLayout};
use tokio::sync::OwnedMutexGuard;

use super::Core;
use super::pipeline::Pushed;
use crate::PsError;
use crate::client::{CoordinatorClient, ServerClient, server_client};
use crate::faults::FaultPoint;
use crate::placement::GlobalRow;
use crate::proto::*;
use crate::shard::{PreCommit, StagedUpdate, Update};
use crate::wire::{bytes_to_u32s, u32s_to_bytes};

/// Clients for the other servers, from the coordinator's placement map, refreshed when a
/// slot changes hands.
pub(super) struct Peers {
    coordinator: CoordinatorClient,
    timeout: std::time::Duration,
    map: tokio::sync::Mutex<Vec<(String, ServerClient)>>,
}

impl Peers {
    pub(super) fn new(coordinator: CoordinatorClient, timeout: std::time::Duration) -> Self {
        Self {
            coordinator,
            timeout,
            map: tokio::sync::Mutex::new(Vec::new()),
        }
    }

    /// A client for `server`, fetching the placement map when it is unknown (or `fresh`).
    pub(super) async fn client(&self, server: usize, fresh: bool) -> Result<ServerClient, PsError> {
        let mut map = self.map.lock().await;
        if fresh || map.get(server).is_none_or(|(a, _)| a.is_empty()) {
            let placement = self
                .coordinator
                .clone()
                .placement(PlacementRequest {})
                .await
                .map_err(|s| PsError::rpc("placement", &s))?
                .into_inner();
            *map = placement
                .servers
                .into_iter()
                .map(|a| {
                    let client =
                        server_client(if a.is_empty() { "0.0.0.0:0" } else { &a }, self.timeout)?;
                    Ok((a, client))
                })
                .collect::<Result<_, PsError>>()?;
        }
        map.get(server)
            .filter(|(a, _)| !a.is_empty())
            .map(|(_, c)| c.clone())
            .ok_or_else(|| PsError::Unavailable(format!("server {server} has no address yet")))
    }
}

/// Per parity holder: its slots, the coefficients and the differences, back to back.
#[derive(Default)]
struct HolderDeltas {
    locals: Vec<u32>,
    coefs: Vec<u8>,
    deltas: Vec<u8>,
}

/// Sends each changed row's difference to its parity holders before the update installs
/// (the pre-commit observer of an erasure-coded server).
pub(super) struct ParityPropagator {
    pub id: usize,
    pub stripes: StripeLayout,
    pub codec: Arc<Codec>,
    pub two_phase: bool,
    pub peers: Arc<Peers>,
    pub epoch: tokio::sync::watch::Receiver<super::Live>,
}

impl ParityPropagator {
    /// One request per parity holder: slots, coefficients and differences.
    fn requests(&self, staged: &StagedUpdate, epoch: u64) -> HashMap<usize, ParityUpdateRequest> {
        let mut out: HashMap<usize, ParityUpdateRequest> = HashMap::new();
        let r = self.stripes.params.r;
        let mut delta = Vec::new();
        for rows in staged.rows() {
            let stride = rows.old.len() / rows.globals.len().max(1);
            let row_bytes = stride * 4;
            let old: &[u8] = bytemuck::cast_slice(&rows.old);
            let new: &[u8] = bytemuck::cast_slice(&rows.new);
            let mut per_holder: HashMap<usize, HolderDeltas> = HashMap::new();
            for (n, &g) in rows.globals.iter().enumerate() {
                let span = n * row_bytes..(n + 1) * row_bytes;
                if old[span.clone()] == new[span.clone()] {
                    continue;
                }
                delta.resize(row_bytes, 0);
                ftrec_ec::xor_into(&old[span.clone()], &new[span], &mut delta);
                let (stripe, position) = self.stripes.stripe_of(GlobalRow(g).0 as usize);
                for p in 0..r {
                    let slot = self.stripes.parity_slot(rows.table, stripe, p);
                    let entry = per_holder.entry(slot.server).or_default();
                    entry.locals.push(slot.local as u32);
                    entry.coefs.push(self.codec.coefficient(p, position));
                    entry.deltas.extend_from_slice(&delta);
                }
            }
            for (
                server,
                HolderDeltas {
                    locals,
                    coefs,
                    deltas,
                },
            ) in per_holder
            {
                out.entry(server)
                    .or_insert_with(|| ParityUpdateRequest {
                        epoch,
                        step: staged.step,
                        source: self.id as u32,
                        staged: self.two_phase,
                        tables: Vec::new(),
                    })
                    .tables
                    .push(ParityDelta {
                        table: rows.table as u32,
                        locals: u32s_to_bytes(&locals),
                        coefs: coefs.into(),
                        deltas: deltas.into(),
                    });
            }
        }
        out
    }
}

#[tonic::async_trait]
impl PreCommit for ParityPropagator {
    async fn pre_commit(&self, staged: &StagedUpdate) -> Result<(), PsError> {
        let epoch = self.epoch.borrow().epoch;
        let calls = self
            .requests(staged, epoch)
            .into_iter()
            .map(|(server, req)| {
                let peers = self.peers.clone();
                async move {
                    let mut last = None;
                    // A replacement took the slot: its new address is one map refresh away.
                    for fresh in [false, true] {
                        let mut client = peers.client(server, fresh).await?;
                        match client.parity_update(req.clone()).await {
                            Ok(_) => return Ok(()),
                            Err(s) => {
                                last = Some(PsError::rpc(
                                    format!("parity update to server {server}"),
                                    &s,
                                ))
                            }
                        }
                    }
                    Err(last.unwrap_or_else(|| PsError::Unavailable(format!("server {server}"))))
                }
            });
        for result in futures::future::join_all(calls).await {
            result?;
        }
        Ok(())
    }
}

/// A phase-1 update waiting for its decision, holding the commit turn.
struct Prepared {
    epoch: u64,
    staged: StagedUpdate,
    _turn: OwnedMutexGuard<()>,
}

/// Parity differences staged for a step, from any data server.
struct StagedParity {
    epoch: u64,
    at: std::time::Instant,
    request: ParityUpdateRequest,
}

/// The erasure-coding state of a server beside its shard.
#[derive(Default)]
pub(super) struct EcState {
    prepared: Mutex<HashMap<u64, Prepared>>,
    staged_parity: Mutex<HashMap<u64, Vec<StagedParity>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EcState {
    /// Drops what older epochs prepared or staged (a recovery decided their fate).
    pub(super) fn drop_older_than(&self, epoch: u64) {
        lock(&self.prepared).retain(|_, p| p.epoch >= epoch);
        for staged in lock(&self.staged_parity).values_mut() {
            staged.retain(|s| s.epoch >= epoch);
        }
        lock(&self.staged_parity).retain(|_, v| !v.is_empty());
    }
}

impl Core {
    fn ec(&self) -> Result<&EcState, PsError> {
        self.ec.as_ref().ok_or_else(|| {
            PsError::Config("this cluster does not erasure code (cluster.ft)".into())
        })
    }

    /// Folds (or stages, under 2PC) parity differences from a data server.
    pub(super) fn parity_update(&self, req: ParityUpdateRequest) -> Result<(), PsError> {
        self.check_epoch(req.epoch)?;
        let ec = self.ec()?;
        // Checked up front, so a staged request folds without errors at commit.
        for t in &req.tables {
            let locals = bytes_to_u32s(&t.locals, "parity slots")?;
            if locals.len() != t.coefs.len() || t.deltas.len() % locals.len().max(1) != 0 {
                return Err(PsError::Request(format!(
                    "parity update for table {}: {} slots, {} coefficients, {} difference bytes",
                    t.table,
                    locals.len(),
                    t.coefs.len(),
                    t.deltas.len()
                )));
            }
        }
        if req.staged {
            let mut staged = lock(&ec.staged_parity);
            // Differences of a step that was never decided (its worker died between the
            // phases) go once they are older than any decision could be.
            let timeout = self.job.timeout();
            for entries in staged.values_mut() {
                entries.retain(|s| s.at.elapsed() < timeout * 2);
            }
            staged.retain(|_, v| !v.is_empty());
            staged.entry(req.step).or_default().push(StagedParity {
                epoch: req.epoch,
                at: std::time::Instant::now(),
                request: req,
            });
            return Ok(());
        }
        let mut shard = self.shard_write()?;
        fold_request(&mut shard, &req)
    }

    /// 2PC phase 1: stage the update, propagate its differences (staged at the parity
    /// holders), and hold it with the commit turn until [`Core::decide_step`].
    pub(super) async fn prepare_update(
        &self,
        epoch: u64,
        update: Update,
    ) -> Result<Pushed, PsError> {
        let ec = self.ec()?;
        // A retried phase 1 (its reply was lost) finds its step prepared already.
        if lock(&ec.prepared)
            .get(&update.step)
            .is_some_and(|p| p.epoch == epoch)
        {
            return Ok(Pushed::Applied {
                steps: self.steps().count(),
                rows: 0,
            });
        }
        let turn = self.commit_turn.clone().lock_owned().await;
        self.check_epoch(epoch)?;
        tracing::debug!("prepare step {} in epoch {epoch}", update.step);
        if self.steps().contains(update.step) {
            return Ok(Pushed::Duplicate {
                steps: self.steps().count(),
            });
        }
        let staged = self.shard_read()?.stage(&update)?;
        for observer in &self.pre_commit {
            observer.pre_commit(&staged).await?;
        }
        let (step, rows) = (staged.step, staged.rows_changed());
        self.faults.die_at(FaultPoint::Prepare(step));
        lock(&ec.prepared).insert(
            step,
            Prepared {
                epoch,
                staged,
                _turn: turn,
            },
        );
        Ok(Pushed::Applied {
            steps: self.steps().count(),
            rows,
        })
    }

    /// 2PC phase 2: installs (or with `commit = false` drops) what phase 1 prepared and
    /// the parity differences staged for `step`. Returns the applied-step count.
    pub(super) fn decide_step(&self, epoch: u64, step: u64, commit: bool) -> Result<u64, PsError> {
        self.check_epoch(epoch)?;
        let ec = self.ec()?;
        let prepared = lock(&ec.prepared)
            .remove(&step)
            .filter(|p| p.epoch == epoch);
        tracing::debug!(
            "{} step {step} in epoch {epoch}: prepared here {}",
            if commit { "commit" } else { "abort" },
            prepared.is_some()
        );
        let parity: Vec<StagedParity> = lock(&ec.staged_parity)
            .remove(&step)
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.epoch == epoch)
            .collect();
        if !commit {
            return Ok(self.steps().count());
        }
        self.faults.die_at(FaultPoint::Commit(step));
        let applied = {
            let mut shard = self.shard_write()?;
            for staged in &parity {
                fold_request(&mut shard, &staged.request)?;
            }
            match &prepared {
                Some(p) => {
                    shard.commit(&p.staged);
                    self.publish(epoch, |steps| {
                        steps.insert(step);
                    })
                }
                None => self.steps().count(),
            }
        };
        if let Some(p) = &prepared {
            for observer in &self.post_commit {
                observer.post_commit(p.staged.rows());
            }
        }
        // Dropping `prepared` here releases the commit turn for the next update.
        drop(prepared);
        Ok(applied)
    }

    /// Aborts `step` if phase 2 has not decided it by the RPC timeout.
    pub(super) fn abort_if_undecided(self: &Arc<Self>, epoch: u64, step: u64) {
        let core = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(core.job.timeout()).await;
            let undecided = core.ec.as_ref().is_some_and(|ec| {
                lock(&ec.prepared)
                    .get(&step)
                    .is_some_and(|p| p.epoch == epoch)
            });
            if undecided && core.decide_step(epoch, step, false).is_ok() {
                tracing::warn!("step {step} was prepared but never decided; aborted it");
            }
        });
    }
}

/// Folds every difference of `req` into the shard's parity slots.
fn fold_request(shard: &mut crate::shard::Shard, req: &ParityUpdateRequest) -> Result<(), PsError> {
    let Some(red) = shard.redundancy_mut() else {
        return Err(PsError::Config("this server holds no parity".into()));
    };
    let row_bytes = red.row_bytes;
    for t in &req.tables {
        let locals = bytes_to_u32s(&t.locals, "parity slots")?;
        for (n, (&local, &coef)) in locals.iter().zip(t.coefs.iter()).enumerate() {
            let delta = t
                .deltas
                .get(n * row_bytes..(n + 1) * row_bytes)
                .ok_or_else(|| PsError::Request("parity differences are short".into()))?;
            red.fold(t.table as usize, local as usize, coef, delta)?;
        }
    }
    Ok(())
}
