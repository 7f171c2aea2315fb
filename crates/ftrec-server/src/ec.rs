//! Erasure coding on a server (ECRec §3.2, §3.5): difference propagation as a pre-commit
//! observer, parity differences received from other servers, and two-phase commit.
//!
//! Two-phase commit, as built here (a commit mode of the one pipeline, `pipeline.rs`):
//! - Phase 1 (`Push` with `prepare`): the server takes its commit turn, stages the update,
//!   sends `old XOR new` of every changed row to the stripe's parity holders, which *stage*
//!   them, and keeps the staged update with the turn until phase 2. Holding the turn keeps
//!   the next update from being staged against rows that are about to change.
//! - Phase 2 (`CommitStep`): the update is installed and the parity holders fold what they
//!   staged for the step; `AbortStep` drops both.
//! - A prepared step not decided within four RPC timeouts is aborted, and a recovery
//!   fences its epoch (no older step prepares or commits from then on) and drops
//!   everything prepared or staged in older epochs: no staged update stays behind. A server that dies in phase 2 loses nothing: its parity holders and
//!   dense replica commit the step, and the rebuild decodes its rows with it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use ftrec_ec::{Codec, StripeLayout};
use tokio::sync::OwnedMutexGuard;

use crate::Core;
use crate::pipeline::apply_parity_difference;
use crate::shard::dense_code::DENSE_TABLE;
use crate::shard::{PreCommit, StagedUpdate};
use ftrec_faults::points;
use ftrec_proto::PsError;
use ftrec_proto::client::{Connector, CoordinatorClient, ServerClient};
use ftrec_proto::placement::GlobalRow;
use ftrec_proto::proto::*;
use ftrec_proto::wire::{bytes_to_u32s, u32s_to_bytes};

/// Clients for the other servers, from the coordinator's placement map, refreshed when a
/// slot changes hands.
pub(super) struct Peers {
    coordinator: CoordinatorClient,
    connector: Connector,
    /// The placement map, and the epoch this server was in when it was fetched.
    map: tokio::sync::Mutex<(u64, Vec<(String, ServerClient)>)>,
}

impl Peers {
    pub(super) fn new(coordinator: CoordinatorClient, connector: Connector) -> Self {
        Self {
            coordinator,
            connector,
            map: tokio::sync::Mutex::new((0, Vec::new())),
        }
    }

    /// A client for `server`, fetching the placement map when it is unknown, `fresh`, or
    /// older than `epoch`. A new epoch may have replaced a peer, and the old address can
    /// be silent rather than refusing (a frozen host, a link down): a call there would
    /// wait out its whole deadline before any retry learned the new address.
    pub(super) async fn client(
        &self,
        server: usize,
        fresh: bool,
        epoch: u64,
    ) -> Result<ServerClient, PsError> {
        let mut guard = self.map.lock().await;
        let (fetched_in, map) = &mut *guard;
        if fresh || *fetched_in < epoch || map.get(server).is_none_or(|(a, _)| a.is_empty()) {
            *fetched_in = epoch;
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
                        self.connector
                            .server(if a.is_empty() { "0.0.0.0:0" } else { &a })?;
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
    pub epoch: tokio::sync::watch::Receiver<crate::Live>,
}

impl ParityPropagator {
    /// The request to parity holder `server` for `step`, started empty if new.
    fn request_to<'a>(
        &self,
        out: &'a mut BTreeMap<usize, ParityUpdateRequest>,
        server: usize,
        epoch: u64,
        step: u64,
    ) -> &'a mut ParityUpdateRequest {
        out.entry(server).or_insert_with(|| ParityUpdateRequest {
            epoch,
            step,
            source: self.id as u32,
            staged: self.two_phase,
            tables: Vec::new(),
        })
    }

    /// One request per parity holder: slots, coefficients and differences.
    fn requests(&self, staged: &StagedUpdate, epoch: u64) -> BTreeMap<usize, ParityUpdateRequest> {
        let mut out: BTreeMap<usize, ParityUpdateRequest> = BTreeMap::new();
        let r = self.stripes.params.r;
        let mut delta = Vec::new();
        for rows in staged.rows() {
            let stride = rows.old.len() / rows.globals.len().max(1);
            let row_bytes = stride * 4;
            let old: &[u8] = bytemuck::cast_slice(&rows.old);
            let new: &[u8] = bytemuck::cast_slice(&rows.new);
            let mut per_holder: BTreeMap<usize, HolderDeltas> = BTreeMap::new();
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
                self.request_to(&mut out, server, epoch, staged.step)
                    .tables
                    .push(ParityDelta {
                        table: rows.table as u32,
                        locals: u32s_to_bytes(&locals),
                        coefs: coefs.into(),
                        deltas: deltas.into(),
                    });
            }
        }
        // Dense ranges coded: this server's dense row changed too (every step).
        if let Some(delta) = staged.dense_delta() {
            let (g, _) = self.stripes.group_of_server(self.id);
            let (stripe, position) = self.stripes.dense_stripe_of(self.id);
            for p in 0..r {
                let holder = self.stripes.dense_parity_holder(g, stripe, p);
                self.request_to(&mut out, holder, epoch, staged.step)
                    .tables
                    .push(ParityDelta {
                        table: DENSE_TABLE,
                        locals: u32s_to_bytes(&[stripe as u32]),
                        coefs: vec![self.codec.coefficient(p, position)].into(),
                        deltas: delta.to_vec().into(),
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
                        let mut client = peers.client(server, fresh, epoch).await?;
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
        // A new epoch fences this update (the servers refuse it now), and a peer that went
        // silent must not hold the commit turn, which the recovery needs, for a deadline.
        let mut live = self.epoch.clone();
        let results = tokio::select! {
            biased;
            results = futures::future::join_all(calls) => results,
            moved = live.wait_for(|l| l.epoch != epoch) => {
                let current = moved.map(|l| l.epoch).unwrap_or(epoch);
                return Err(PsError::StaleEpoch { got: epoch, current });
            }
        };
        for result in results {
            result?;
        }
        Ok(())
    }
}

/// A phase-1 update waiting for its decision, holding the commit turn.
struct Prepared {
    epoch: u64,
    id: u64,
    staged: StagedUpdate,
    _turn: OwnedMutexGuard<()>,
}

/// Parity differences staged for a step, from any data server.
struct StagedParity {
    epoch: u64,
    at: tokio::time::Instant,
    request: ParityUpdateRequest,
}

/// The erasure-coding state of a server beside its shard.
#[derive(Default)]
pub(super) struct EcState {
    prepared: Mutex<BTreeMap<u64, Prepared>>,
    staged_parity: Mutex<BTreeMap<u64, Vec<StagedParity>>>,
    /// One-round mode: the (source, step, epoch) of recent folds, so a retried update is
    /// not folded twice (XOR would cancel it).
    folded: Mutex<std::collections::VecDeque<(u32, u64, u64)>>,
    /// The newest epoch a recovery announced; a step of an older one may no longer be
    /// prepared or committed here, even before the recovery gets the commit turn.
    fence: std::sync::atomic::AtomicU64,
    /// Distinguishes prepares of the same step, so a timer aborts only its own.
    next_prepare: std::sync::atomic::AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EcState {
    fn fenced_past(&self, epoch: u64) -> bool {
        self.fence.load(std::sync::atomic::Ordering::SeqCst) > epoch
    }

    /// The id of `step` if it is prepared here in `epoch` (a retried phase 1).
    pub(crate) fn prepared_id(&self, step: u64, epoch: u64) -> Option<u64> {
        lock(&self.prepared)
            .get(&step)
            .filter(|p| p.epoch == epoch)
            .map(|p| p.id)
    }

    /// The end of 2PC phase 1 (the pipeline's two-phase mode): the update is staged and
    /// its differences are staged at the parity holders; it waits here, with the commit
    /// turn, for phase 2.
    pub(crate) fn hold_prepared(
        &self,
        core: &Core,
        epoch: u64,
        staged: StagedUpdate,
        turn: OwnedMutexGuard<()>,
    ) -> Result<u64, PsError> {
        let step = staged.step;
        core.faults.kill_at(points::PREPARE, Some(step));
        // A recovery began while the differences were out: this step is its to decide.
        if self.fenced_past(epoch) {
            return Err(PsError::StaleEpoch {
                got: epoch,
                current: self.fence.load(std::sync::atomic::Ordering::SeqCst),
            });
        }
        let id = self
            .next_prepare
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        lock(&self.prepared).insert(
            step,
            Prepared {
                epoch,
                id,
                staged,
                _turn: turn,
            },
        );
        Ok(id)
    }

    /// Drops what older epochs prepared or staged (a recovery decided their fate).
    pub(super) fn drop_older_than(&self, epoch: u64) {
        self.fence
            .fetch_max(epoch, std::sync::atomic::Ordering::SeqCst);
        lock(&self.prepared).retain(|_, p| p.epoch >= epoch);
        for staged in lock(&self.staged_parity).values_mut() {
            staged.retain(|s| s.epoch >= epoch);
        }
        lock(&self.staged_parity).retain(|_, v| !v.is_empty());
    }
}

impl Core {
    pub(crate) fn ec(&self) -> Result<&EcState, PsError> {
        self.ec.as_ref().ok_or_else(|| {
            PsError::Config("this cluster does not erasure code (cluster.ft)".into())
        })
    }

    /// Folds (or stages, under 2PC) parity differences from a data server.
    pub(super) fn parity_update(&self, req: ParityUpdateRequest) -> Result<(), PsError> {
        self.check_epoch(req.epoch)?;
        let ec = self.ec()?;
        // Checked whole, up front, so a staged request folds without an error at commit
        // and a bad one changes nothing.
        validate_parity_update(&*self.shard_read()?, &req)?;
        if req.staged {
            let mut staged = lock(&ec.staged_parity);
            // Differences of a step that was never decided (its worker died between the
            // phases) go once they are far older than any decision could be, unless this
            // server holds the step prepared itself.
            let limit = self.job.timeout() * 4;
            let prepared = lock(&ec.prepared);
            for (step, entries) in staged.iter_mut() {
                if !prepared.contains_key(step) {
                    entries.retain(|s| s.at.elapsed() < limit);
                }
            }
            drop(prepared);
            staged.retain(|_, v| !v.is_empty());
            let entries = staged.entry(req.step).or_default();
            // A retried update (its reply was lost) replaces the first: folding the same
            // difference twice would cancel it.
            entries.retain(|s| !(s.request.source == req.source && s.epoch == req.epoch));
            entries.push(StagedParity {
                epoch: req.epoch,
                at: tokio::time::Instant::now(),
                request: req,
            });
            return Ok(());
        }
        let key = (req.source, req.step, req.epoch);
        let mut folded = lock(&ec.folded);
        if folded.contains(&key) {
            return Ok(());
        }
        let mut shard = self.shard_write()?;
        apply_parity_difference(&mut shard, &req, &self.faults)?;
        folded.push_back(key);
        if folded.len() > 4096 {
            folded.pop_front();
        }
        Ok(())
    }

    /// 2PC phase 2: installs (or with `commit = false` drops) what phase 1 prepared and
    /// the parity differences staged for `step`. Returns the applied-step count.
    pub(super) fn decide_step(&self, epoch: u64, step: u64, commit: bool) -> Result<u64, PsError> {
        self.decide(epoch, step, commit, None)
    }

    /// [`Core::decide_step`], or with `only` the abort of one particular prepare (its
    /// timer's), which leaves a newer prepare of the same step alone.
    fn decide(
        &self,
        epoch: u64,
        step: u64,
        commit: bool,
        only: Option<u64>,
    ) -> Result<u64, PsError> {
        self.check_epoch(epoch)?;
        let ec = self.ec()?;
        if commit && ec.fenced_past(epoch) {
            // A recovery is deciding this epoch's steps: committing here now could leave
            // the step on some servers only.
            return Err(PsError::StaleEpoch {
                got: epoch,
                current: ec.fence.load(std::sync::atomic::Ordering::SeqCst),
            });
        }
        let prepared = {
            let mut all = lock(&ec.prepared);
            let mine = all
                .get(&step)
                .is_some_and(|p| p.epoch == epoch && only.is_none_or(|id| p.id == id));
            if mine { all.remove(&step) } else { None }
        };
        if only.is_some() && prepared.is_none() {
            return Ok(self.steps().count());
        }
        tracing::debug!(
            "{} step {step} in epoch {epoch}: prepared here {}",
            if commit { "commit" } else { "abort" },
            prepared.is_some()
        );
        if commit && prepared.is_none() {
            if self.steps().contains(step) {
                // A retried commit whose first attempt went through.
                return Ok(self.steps().count());
            }
            return Err(PsError::NotPrepared {
                server: self.id as u32,
                step,
                epoch,
            });
        }
        let parity: Vec<ParityUpdateRequest> = lock(&ec.staged_parity)
            .remove(&step)
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.epoch == epoch)
            .map(|s| s.request)
            .collect();
        let Some(prepared) = prepared.filter(|_| commit) else {
            return Ok(self.steps().count());
        };
        self.faults.kill_at(points::COMMIT, Some(step));
        let applied = self.install(epoch, &prepared.staged, &parity)?;
        // Dropping `prepared` here releases the commit turn for the next update.
        drop(prepared);
        Ok(applied)
    }

    /// Aborts prepare `id` of `step` if phase 2 has not decided it long after any decision
    /// could arrive (a worker's commit, with its retries, ends well within this).
    pub(super) fn abort_if_undecided(self: &Arc<Self>, epoch: u64, step: u64, id: u64) {
        let core = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(core.job.timeout() * 4).await;
            let undecided = core.ec.as_ref().is_some_and(|ec| {
                lock(&ec.prepared)
                    .get(&step)
                    .is_some_and(|p| p.epoch == epoch && p.id == id)
            });
            if undecided && core.decide(epoch, step, false, Some(id)).is_ok() {
                tracing::warn!("step {step} was prepared but never decided; aborted it");
            }
        });
    }
}

/// Checks a parity update whole against this server's parity slots.
fn validate_parity_update(
    shard: &crate::shard::Shard,
    req: &ParityUpdateRequest,
) -> Result<(), PsError> {
    let Some(red) = shard.redundancy() else {
        return Err(PsError::Config("this server holds no parity".into()));
    };
    for t in &req.tables {
        let what = || {
            format!(
                "parity update from server {} for step {}, table {}",
                req.source, req.step, t.table
            )
        };
        if t.table == DENSE_TABLE {
            let stripes = bytes_to_u32s(&t.locals, "dense stripes")?;
            let ([stripe], [_]) = (stripes.as_slice(), &t.coefs[..]) else {
                return Err(PsError::BadRequest(format!(
                    "{}: a dense difference names {} stripes and {} coefficients",
                    what(),
                    stripes.len(),
                    t.coefs.len()
                )));
            };
            match red.dense_parity_row(*stripe as usize) {
                Some(row) if row.len() == t.deltas.len() => continue,
                Some(row) => {
                    return Err(PsError::BadRequest(format!(
                        "{}: {} difference bytes for dense rows of {}",
                        what(),
                        t.deltas.len(),
                        row.len()
                    )));
                }
                None => {
                    return Err(PsError::BadRequest(format!(
                        "{}: this server holds no parity of dense stripe {stripe}",
                        what()
                    )));
                }
            }
        }
        let locals = bytes_to_u32s(&t.locals, "parity slots")?;
        let Some(slots) = red.parity.get(t.table as usize) else {
            return Err(PsError::BadRequest(format!("{}: no such table", what())));
        };
        let capacity = slots.len() / red.row_bytes.max(1);
        if locals.len() != t.coefs.len() || t.deltas.len() != locals.len() * red.row_bytes {
            return Err(PsError::BadRequest(format!(
                "{}: {} slots, {} coefficients, {} difference bytes (rows of {} bytes)",
                what(),
                locals.len(),
                t.coefs.len(),
                t.deltas.len(),
                red.row_bytes
            )));
        }
        if let Some(bad) = locals.iter().find(|&&l| l as usize >= capacity) {
            return Err(PsError::BadRequest(format!(
                "{}: parity slot {bad} is outside this server's {capacity} slots",
                what()
            )));
        }
    }
    Ok(())
}
