//! Difference propagation (ECRec §3.2): the pre-commit observer that sends `old XOR new`
//! of every row an update changes to the row's parity holders before it installs.

use std::collections::BTreeMap;
use std::sync::Arc;

use ftrec_ec::{Codec, StripeLayout};

use super::Peers;
use crate::shard::dense_code::DENSE_TABLE;
use crate::shard::{PreCommit, StagedUpdate};
use ftrec_proto::placement::GlobalRow;
use ftrec_proto::proto::{ParityDelta, ParityUpdateRequest};
use ftrec_proto::wire::u32s_to_bytes;
use ftrec_rpc::PsError;
use ftrec_rpc::hedge::first_answer;

/// The kind under which parity updates' times are kept.
const PARITY_CALLS: &str = "parity";

/// Per parity holder: its slots, the coefficients and the differences, back to back.
struct HolderDeltas {
    locals: Vec<u32>,
    coefs: Vec<u8>,
    deltas: Vec<u8>,
}

impl HolderDeltas {
    fn for_rows(rows: usize, row_bytes: usize) -> Self {
        Self {
            locals: Vec::with_capacity(rows),
            coefs: Vec::with_capacity(rows),
            deltas: Vec::with_capacity(rows * row_bytes),
        }
    }
}

/// Sends each changed row's difference to its parity holders before the update installs
/// (the pre-commit observer of an erasure-coded server).
pub(crate) struct ParityPropagator {
    pub id: usize,
    pub stripes: StripeLayout,
    pub codec: Arc<Codec>,
    pub two_phase: bool,
    pub peers: Arc<Peers>,
    pub epoch: tokio::sync::watch::Receiver<crate::pipeline::Live>,
    /// The recovery fence (`EcState::fence_watch`): raised by a recovery's first round,
    /// before the new epoch is published.
    pub fence: tokio::sync::watch::Receiver<u64>,
}

impl ParityPropagator {
    /// The request to parity holder `server` for `step`, started empty if new.
    fn request_to<'a>(
        &self,
        out: &'a mut BTreeMap<usize, ParityUpdateRequest>,
        server: usize,
        epoch: u64,
        staged: &StagedUpdate,
    ) -> &'a mut ParityUpdateRequest {
        out.entry(server).or_insert_with(|| ParityUpdateRequest {
            epoch,
            step: staged.step,
            source: self.id as u32,
            staged: self.two_phase,
            tables: Vec::new(),
            attempt: staged.attempt(),
        })
    }

    /// One request per parity holder: slots, coefficients and differences. Each holder's
    /// buffers are sized first and the staged differences copied into them once.
    fn requests(
        &self,
        staged: &StagedUpdate,
        epoch: u64,
    ) -> Result<BTreeMap<usize, ParityUpdateRequest>, PsError> {
        let mut out: BTreeMap<usize, ParityUpdateRequest> = BTreeMap::new();
        let r = self.stripes.params.r;
        // Per changed row's parity row: (holder, slot, coefficient, row).
        let mut targets: Vec<(usize, u32, u8, usize)> = Vec::new();
        for rows in staged.rows() {
            let stride = rows.new.len() / rows.globals.len().max(1);
            if rows.delta.len() != rows.new.len() {
                return Err(PsError::Internal(format!(
                    "step {}, table {}: {} difference words staged for {} row words",
                    staged.step,
                    rows.table,
                    rows.delta.len(),
                    rows.new.len()
                )));
            }
            let row_bytes = stride * 4;
            let deltas: &[u8] = bytemuck::cast_slice(&rows.delta);
            targets.clear();
            let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
            for (n, &g) in rows.globals.iter().enumerate() {
                if rows.changed_delta(n, stride).is_none() {
                    continue;
                }
                let (stripe, position) = self.stripes.stripe_of(GlobalRow(g).0 as usize);
                for p in 0..r {
                    let slot = self.stripes.parity_slot(rows.table, stripe, p);
                    targets.push((
                        slot.server,
                        slot.local as u32,
                        self.codec.coefficient(p, position),
                        n,
                    ));
                    *counts.entry(slot.server).or_default() += 1;
                }
            }
            let mut per_holder: BTreeMap<usize, HolderDeltas> = counts
                .into_iter()
                .map(|(server, n)| (server, HolderDeltas::for_rows(n, row_bytes)))
                .collect();
            for &(server, local, coef, n) in &targets {
                if let Some(entry) = per_holder.get_mut(&server) {
                    entry.locals.push(local);
                    entry.coefs.push(coef);
                    entry
                        .deltas
                        .extend_from_slice(&deltas[n * row_bytes..(n + 1) * row_bytes]);
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
                self.request_to(&mut out, server, epoch, staged)
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
                self.request_to(&mut out, holder, epoch, staged)
                    .tables
                    .push(ParityDelta {
                        table: DENSE_TABLE,
                        locals: u32s_to_bytes(&[stripe as u32]),
                        coefs: vec![self.codec.coefficient(p, position)].into(),
                        deltas: delta.to_vec().into(),
                    });
            }
        }
        Ok(out)
    }
}

#[tonic::async_trait]
impl PreCommit for ParityPropagator {
    async fn pre_commit(&self, staged: &StagedUpdate) -> Result<(), PsError> {
        let epoch = self.epoch.borrow().epoch;
        let calls = self
            .requests(staged, epoch)?
            .into_iter()
            .map(|(server, req)| {
                let peers = self.peers.clone();
                async move {
                    let mut last = None;
                    // A replacement took the slot: its new address is one map refresh away.
                    for fresh in [false, true] {
                        let (address, mut client, mut second) = peers
                            .clients(server, fresh, epoch)
                            .await
                            .map_err(|e| e.blaming(server))?;
                        let started = tokio::time::Instant::now();
                        let copy = req.clone();
                        let answered = first_answer(
                            client.parity_update(req.clone()),
                            peers
                                .hedge_after(PARITY_CALLS, server, &address)
                                .map(|after| {
                                    (after, async move { second.parity_update(copy).await })
                                }),
                        )
                        .await;
                        let took = answered.result.is_ok().then(|| started.elapsed());
                        peers.called(PARITY_CALLS, server, &address, took, answered.hedged);
                        match answered.result {
                            Ok(_) => return Ok(()),
                            Err(s) => {
                                last = Some(PsError::rpc(
                                    format!("parity update to server {server}"),
                                    &s,
                                ))
                            }
                        }
                    }
                    Err(last
                        .unwrap_or_else(|| PsError::Unavailable(format!("server {server}")))
                        .blaming(server))
                }
            });
        // A new epoch fences this update (the servers refuse it now), and a peer that went
        // silent must not hold the commit turn, which the recovery needs, for a deadline.
        // A recovery's fence comes first (the new epoch is published only once the
        // survivors settled, which needs the turn this update holds), so both end it.
        let mut live = self.epoch.clone();
        let mut fence = self.fence.clone();
        let results = tokio::select! {
            biased;
            results = futures::future::join_all(calls) => results,
            moved = live.wait_for(|l| l.epoch != epoch) => {
                let current = moved.map(|l| l.epoch).unwrap_or(epoch);
                return Err(PsError::StaleEpoch { got: epoch, current });
            }
            fenced = fence.wait_for(|&f| f > epoch) => {
                let current = fenced.map(|f| *f).unwrap_or(epoch);
                return Err(PsError::StaleEpoch { got: epoch, current });
            }
        };
        for result in results {
            result?;
        }
        Ok(())
    }
}
