//! Dense ranges coded (`ec.replicate_dense = false`): a replacement's dense row decoded
//! from its dense stripe, and the dense parity rows it holds decoded or encoded, from the
//! survivors of its group. After a rollback (`parity_only`) every member re-derives its
//! parity rows from the members' restored ranges, never from other parity rows (those
//! are being re-derived at the same time).

use std::collections::BTreeMap;

use ftrec_ec::DenseParitySlot;

use crate::Core;
use crate::shard::dense_code;
use ftrec_proto::applied::AppliedSteps;
use ftrec_proto::proto::*;
use ftrec_rpc::PsError;
use ftrec_rpc::client::ServerClient;

pub(super) struct CodedDense {
    /// This slot's dense range, optimizer state and step (`None` with `parity_only`).
    pub own: Option<(Vec<f32>, Vec<f32>, u64)>,
    pub parity: Vec<(DenseParitySlot, Vec<u8>)>,
    /// A survivor's applied steps: this slot's (2PC).
    pub applied: AppliedSteps,
    pub bytes: u64,
}

async fn fetch(
    client: &ServerClient,
    epoch: u64,
    stripe: Option<u32>,
    what: String,
) -> Result<FetchDenseReply, PsError> {
    Ok(client
        .clone()
        .fetch_dense(FetchDenseRequest {
            epoch,
            replica: false,
            dense_parity_stripe: stripe,
        })
        .await
        .map_err(|s| PsError::rpc(what, &s))?
        .into_inner())
}

/// Records a survivor's applied steps, which must equal the others': the survivors stand
/// still during a recovery.
fn agree(
    applied: &mut Option<AppliedSteps>,
    reply: &FetchDenseReply,
    stripe: usize,
) -> Result<(), PsError> {
    let theirs = AppliedSteps::from_parts(reply.applied_below, reply.applied_ahead.iter().copied());
    if applied.get_or_insert_with(|| theirs.clone()) != &theirs {
        return Err(PsError::Degraded(format!(
            "dense stripe {stripe}: survivors disagree on the steps applied"
        )));
    }
    Ok(())
}

impl Core {
    pub(super) async fn rebuild_coded_dense(
        &self,
        clients: &BTreeMap<usize, ServerClient>,
        epoch: u64,
        global: &ftrec_model::ModelConfig,
        parity_only: bool,
    ) -> Result<CodedDense, PsError> {
        let layout = self.layout;
        let Some(stripes) = layout.stripes() else {
            return Err(PsError::Config(
                "dense stripes without erasure coding".into(),
            ));
        };
        let me = self.id;
        let (k, r) = (stripes.params.k, stripes.params.r);
        let (g, _) = stripes.group_of_server(me);
        let len = dense_code::row_len(global, layout, me)?;
        let codec = ftrec_ec::Codec::new(k, r).map_err(|e| PsError::Config(e.to_string()))?;
        let held = stripes.dense_parity_held(me);
        let (mine, position) = stripes.dense_stripe_of(me);
        let mut needed: Vec<usize> = held.iter().map(|s| s.stripe).collect();
        needed.push(mine);
        needed.sort_unstable();
        needed.dedup();
        let own_row = if parity_only {
            let shard = self.pipeline.shard_read()?;
            Some(dense_code::pack(
                shard.dense_params(),
                shard.dense_optimizer_state(),
                shard.dense_step(),
                len,
            ))
        } else {
            None
        };
        let mut applied = None;
        let mut bytes = 0u64;
        let mut decoded: BTreeMap<usize, Vec<Option<Vec<u8>>>> = BTreeMap::new();
        for &j in &needed {
            let mut rows: Vec<Option<Vec<u8>>> = Vec::with_capacity(k + r);
            for (i, member) in stripes.dense_members(g, j).into_iter().enumerate() {
                let row = match member {
                    None => Some(vec![0u8; len]),
                    Some(m) if m == me => own_row.clone(),
                    Some(m) => match clients.get(&m) {
                        Some(c) => {
                            let reply =
                                fetch(c, epoch, None, format!("dense range of server {m}")).await?;
                            agree(&mut applied, &reply, j)?;
                            let params =
                                ftrec_proto::wire::bytes_to_f32s(&reply.params, "dense range")?;
                            let state =
                                ftrec_proto::wire::bytes_to_f32s(&reply.state, "dense state")?;
                            Some(dense_code::pack(&params, &state, reply.step, len))
                        }
                        None => None,
                    },
                };
                debug_assert!(i < k);
                rows.push(row);
            }
            for p in 0..r {
                let holder = stripes.dense_parity_holder(g, j, p);
                let row = match clients.get(&holder) {
                    Some(c) if holder != me && !parity_only => {
                        let what = format!("dense parity of stripe {j} on server {holder}");
                        let reply = fetch(c, epoch, Some(j as u32), what).await?;
                        agree(&mut applied, &reply, j)?;
                        Some(reply.dense_parity.to_vec())
                    }
                    _ => None,
                };
                rows.push(row);
            }
            codec
                .reconstruct(&mut rows)
                .map_err(|e| PsError::ec(format!("dense stripe {j}"), e))?;
            decoded.insert(j, rows);
        }
        let parity = held
            .iter()
            .map(|slot| {
                decoded
                    .get(&slot.stripe)
                    .and_then(|rows| rows[k + slot.p].clone())
                    .map(|row| (*slot, row))
                    .ok_or_else(|| {
                        PsError::Internal(format!("dense stripe {} not decoded", slot.stripe))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        bytes += parity.iter().map(|(_, r)| r.len() as u64).sum::<u64>();
        let own = if parity_only {
            None
        } else {
            let row = decoded
                .get(&mine)
                .and_then(|rows| rows[position].as_deref())
                .ok_or_else(|| PsError::Internal(format!("dense stripe {mine} not decoded")))?;
            bytes += row.len() as u64;
            let (params, state) = dense_code::range_lens(global, layout, me)?;
            Some(dense_code::unpack(row, params, state)?)
        };
        let applied = match (applied, parity_only) {
            (Some(applied), _) => applied,
            (None, true) => AppliedSteps::default(),
            (None, false) => {
                return Err(PsError::Degraded(
                    "dense rebuild: no surviving member of the dense stripes answered, so \
                     the steps this slot holds are unknown"
                        .into(),
                ));
            }
        };
        Ok(CodedDense {
            own,
            parity,
            applied,
            bytes,
        })
    }
}
