//! A replacement server rebuilds what its slot held (ECRec §3.4) from the survivors of
//! its group: every data row and every parity row, decoded stripe by stripe, and both
//! dense ranges it keeps (its own, from the replica holder; the one it replicates, from
//! that range's primary). Training is held by the coordinator meanwhile; the rebuilt
//! state is bit-identical to the lost one because the code works on the rows' bytes.

pub(crate) mod boost;
mod dense;
pub(crate) mod reserve;

use std::collections::BTreeMap;
use tokio::time::Instant;

use ftrec_ec::Codec;
use ftrec_model::{EmbeddingTable, ModelState};

use crate::Core;
use crate::degraded::Background;
use crate::shard::{DenseReplica, Pending, Redundancy, Shard, packed_dense};
use ftrec_faults::points;
use ftrec_proto::applied::AppliedSteps;
use ftrec_proto::proto::*;
use ftrec_proto::wire::bytes_to_f32s;
use ftrec_rpc::PsError;
use ftrec_rpc::client::ServerClient;

/// Every survivor's data and parity slots of table `t`, streamed from all at once.
async fn fetch_table(
    clients: BTreeMap<usize, ServerClient>,
    epoch: u64,
    t: usize,
    with_parity: bool,
) -> Result<(BTreeMap<usize, Vec<u8>>, BTreeMap<usize, Vec<u8>>), PsError> {
    let fetches = clients.into_iter().map(|(s, client)| {
        let (mut rows_client, mut parity_client) = (client.clone(), client);
        async move {
            let what = format!("rebuild: table {t} from server {s}");
            let parity = async {
                if with_parity {
                    ftrec_rpc::gather::fetch_all(&mut parity_client, epoch, t, true, &what)
                        .await
                        .map(Some)
                } else {
                    Ok(None)
                }
            };
            let (d, p) = futures::future::join(
                ftrec_rpc::gather::fetch_all(&mut rows_client, epoch, t, false, &what),
                parity,
            )
            .await;
            Ok::<_, PsError>((s, d?, p?))
        }
    });
    let mut data = BTreeMap::new();
    let mut parity = BTreeMap::new();
    for fetched in futures::future::join_all(fetches).await {
        let (s, d, p) = fetched?;
        data.insert(s, d);
        if let Some(p) = p {
            parity.insert(s, p);
        }
    }
    Ok((data, parity))
}

async fn fetch_dense(
    client: &mut ServerClient,
    epoch: u64,
    replica: bool,
    what: &str,
) -> Result<FetchDenseReply, PsError> {
    Ok(client
        .fetch_dense(FetchDenseRequest {
            epoch,
            replica,
            ..Default::default()
        })
        .await
        .map_err(|s| PsError::rpc(what, &s))?
        .into_inner())
}

impl Core {
    /// Rebuilds (or, with `parity_only`, re-derives) this slot; `progress` gets one
    /// message per table. Returns the totals.
    pub(super) async fn rebuild(
        &self,
        req: RebuildRequest,
        progress: tokio::sync::mpsc::Sender<Result<RebuildReply, tonic::Status>>,
    ) -> Result<RebuildReply, PsError> {
        let started = Instant::now();
        let turn = self.commit_turn.lock().await;
        self.check_epoch_forward(req.epoch)?;
        let epoch = req.epoch;
        let layout = self.layout;
        let Some(stripes) = layout.stripes() else {
            return Err(PsError::Config("rebuild without erasure coding".into()));
        };
        let (k, r) = (stripes.params.k, stripes.params.r);
        let me = self.id;
        let lost: Vec<usize> = req.lost.iter().map(|&s| s as usize).collect();
        let (group, _) = stripes.group_of_server(me);
        let (first, members) = stripes.group(group);
        let mut clients: BTreeMap<usize, ServerClient> = BTreeMap::new();
        for s in first..first + members {
            if s == me || lost.contains(&s) {
                continue;
            }
            let address = req
                .servers
                .get(s)
                .filter(|a| !a.is_empty())
                .ok_or_else(|| {
                    PsError::BadRequest(format!("rebuild: no address for server {s}"))
                })?;
            clients.insert(
                s,
                self.job
                    .connector_for(self.job.deadlines().rebuild_stall)?
                    .server(address)?,
            );
        }
        let parity_only = req.parity_only;
        let global = self.job.config.model_config()?;
        let config = Shard::shard_config(&global, layout, me)?;
        if req.background && !parity_only {
            let codec = Codec::new(k, r).map_err(|e| PsError::Config(e.to_string()))?;
            let totals = self
                .serve_degraded(&clients, epoch, &global, config, lost, codec, started)
                .await?;
            let _ = progress.send(Ok(totals)).await;
            // Serving: updates go on while the rest decodes.
            drop(turn);
            return self
                .rebuild_in_background(global.tables(), started, totals, &progress)
                .await;
        }
        // Re-encoding after a rollback: every server restored its data rows from the same
        // cut; parity and replicas are derived from them (this server's own rows included).
        let own_rows: Vec<Vec<u8>> = if parity_only {
            let shard = self.shard_read()?;
            shard
                .state()
                .tables()
                .iter()
                .map(|t| t.as_bytes().to_vec())
                .collect()
        } else {
            Vec::new()
        };
        let stride = global.row_stride();
        let row_bytes = stride * 4;
        let codec = Codec::new(k, r).map_err(|e| PsError::Config(e.to_string()))?;
        let mut redundancy = Redundancy::empty(&global, layout, me)?;
        let mut tables = Vec::with_capacity(global.tables());
        let (mut rebuilt_rows, mut rebuilt_bytes) = (0u64, 0u64);
        let (mut waited, mut decoding) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
        // Table t + 1 streams in while table t decodes.
        let mut next = Some(tokio::spawn(fetch_table(
            clients.clone(),
            epoch,
            0,
            !parity_only,
        )));
        for t in 0..global.tables() {
            let rows = global.table_rows[t];
            let Some(fetching) = next.take() else {
                return Err(PsError::Internal("rebuild: fetch not started".into()));
            };
            let wait_started = Instant::now();
            let (mut data, parity) = fetching
                .await
                .map_err(|e| PsError::Internal(format!("rebuild: fetch task: {e}")))??;
            // This server's own restored rows (re-encoding only).
            let own = own_rows.get(t).cloned().unwrap_or_default();
            if parity_only {
                data.insert(me, own.clone());
            }
            waited += wait_started.elapsed();
            if t + 1 < global.tables() {
                next = Some(tokio::spawn(fetch_table(
                    clients.clone(),
                    epoch,
                    t + 1,
                    !parity_only,
                )));
            }
            let decode_started = Instant::now();
            // Survivors' slots by server index: no hashing per row.
            let by_server = |held: BTreeMap<usize, Vec<u8>>| {
                let mut v: Vec<Option<Vec<u8>>> = vec![None; layout.servers()];
                for (s, bytes) in held {
                    v[s] = Some(bytes);
                }
                v
            };
            let (data, parity) = (by_server(data), by_server(parity));
            fn slot_bytes(
                held: &[Option<Vec<u8>>],
                server: usize,
                local: usize,
                row_bytes: usize,
            ) -> Option<&[u8]> {
                held[server]
                    .as_deref()
                    .and_then(|b| b.get(local * row_bytes..(local + 1) * row_bytes))
            }
            // Decodes stripe `j` from the survivors into `out`: its row `index` (data rows
            // first, then parity rows).
            let decode = |j: usize, index: usize, out: &mut [u8]| -> Result<(), PsError> {
                let row_of = |n: usize| {
                    let slot = if n < k {
                        stripes.data_slot(t, j, n)
                    } else {
                        stripes.parity_slot(t, j, n - k)
                    };
                    let held = if n < k { &data } else { &parity };
                    slot_bytes(held, slot.server, slot.local, row_bytes)
                };
                crate::degraded::decode_row(&codec, row_of, index, out)
                    .map_err(|e| PsError::Degraded(format!("rebuild: table {t} stripe {j}: {e}")))
            };
            let (data_slots, _) = stripes.capacity(me, rows);
            let mut mine = if parity_only {
                own
            } else {
                vec![0u8; data_slots * row_bytes]
            };
            let held = &mut redundancy.parity[t];
            // Decoding is CPU work: on this runtime thread, spread over rayon's threads.
            let decoded = self.job.network().in_place(|| -> Result<u64, PsError> {
                use rayon::prelude::*;
                let data_rows: u64 = if parity_only {
                    0
                } else {
                    mine.par_chunks_mut(row_bytes)
                        .enumerate()
                        .map(|(local, out)| match stripes.data_at(t, me, local, rows) {
                            Some((j, i)) => decode(j, i, out).map(|()| 1),
                            None => Ok(0),
                        })
                        .sum::<Result<u64, PsError>>()?
                };
                let parity_rows: u64 = held
                    .par_chunks_mut(row_bytes)
                    .enumerate()
                    .map(|(local, out)| match stripes.parity_at(t, me, local, rows) {
                        Some((j, p)) => decode(j, k + p, out).map(|()| 1),
                        None => Ok(0),
                    })
                    .sum::<Result<u64, PsError>>()?;
                Ok(data_rows + parity_rows)
            })?;
            rebuilt_rows += decoded;
            decoding += decode_started.elapsed();
            rebuilt_bytes += if parity_only {
                held.len()
            } else {
                mine.len() + held.len()
            } as u64;
            self.faults.kill_at(points::REBUILD, None);
            // Progress is best effort: a slow reader must not hold the rebuild up.
            let _ = progress.try_send(Ok(RebuildReply {
                bytes: rebuilt_bytes,
                rows: rebuilt_rows,
                seconds: started.elapsed().as_secs_f64(),
                tables_done: t as u32 + 1,
                tables: global.tables() as u32,
                done: false,
                serving: false,
            }));
            let values = bytes_to_f32s(&mine, "rebuilt rows")?;
            tables.push(
                EmbeddingTable::from_data(config.table_rows[t], global.dim, stride, values)
                    .ok_or_else(|| PsError::Config("rebuilt table shape".into()))?,
            );
        }
        let parts = self
            .fetch_dense_parts(&clients, epoch, &global, &config, parity_only)
            .await?;
        redundancy.replica = parts.replica;
        if layout.dense_coded() {
            redundancy.dense_parity = parts.dense_parity;
        }
        rebuilt_bytes += parts.bytes;
        let totals = RebuildReply {
            bytes: rebuilt_bytes,
            rows: rebuilt_rows,
            seconds: 0.0,
            tables_done: global.tables() as u32,
            tables: global.tables() as u32,
            done: true,
            serving: true,
        };
        let Some(dense) = parts.dense else {
            // The data rows and dense range stay as restored; parity and the replica now
            // match them.
            self.shard_write()?.set_redundancy(redundancy);
            return Ok(RebuildReply {
                seconds: started.elapsed().as_secs_f64(),
                ..totals
            });
        };
        let applied = parts.applied;
        let state = ModelState::from_parts(config, tables, dense)?;
        {
            let mut shard = self.shard_write()?;
            shard.install_rebuilt(state, redundancy)?;
            self.publish(epoch, |steps| *steps = applied);
        }
        self.settle_older_epochs(epoch, &[])?;
        // Cuts go on from here: the slot's history continues on its newest branch.
        self.continue_history()?;
        self.metrics.set("ftrec_epoch", epoch as f64);
        tracing::info!(
            "rebuilt {rebuilt_rows} rows, {rebuilt_bytes} bytes in {:.3} s: waiting for fetches {:.3} s, decoding {:.3} s",
            started.elapsed().as_secs_f64(),
            waited.as_secs_f64(),
            decoding.as_secs_f64()
        );
        Ok(RebuildReply {
            seconds: started.elapsed().as_secs_f64(),
            ..totals
        })
    }

    /// The first part of a background rebuild: dense state and applied steps from the
    /// replica holder, every row and parity slot pending, and the epoch adopted. The slot
    /// serves from here on (`degraded.rs` decodes what a pull or push needs).
    #[allow(clippy::too_many_arguments)]
    async fn serve_degraded(
        &self,
        clients: &BTreeMap<usize, ServerClient>,
        epoch: u64,
        global: &ftrec_model::ModelConfig,
        config: ftrec_model::ModelConfig,
        lost: Vec<usize>,
        codec: Codec,
        started: Instant,
    ) -> Result<RebuildReply, PsError> {
        let me = self.id;
        let layout = self.layout;
        let Some(stripes) = layout.stripes() else {
            return Err(PsError::Config("rebuild without erasure coding".into()));
        };
        let parts = self
            .fetch_dense_parts(clients, epoch, global, &config, false)
            .await?;
        let dense = parts
            .dense
            .ok_or_else(|| PsError::Internal("rebuild: no dense range".into()))?;
        let mut redundancy = Redundancy::empty(global, layout, me)?;
        // A promoted spare's rows and parity are written already (`reserve.rs` here); elsewhere
        // these are lazily mapped allocations, as `Redundancy::empty`'s are.
        let mut reserve =
            std::mem::take(&mut *self.reserve.lock().unwrap_or_else(|p| p.into_inner()));
        for (t, parity) in redundancy.parity.iter_mut().enumerate() {
            *parity = reserve.parity(t, parity.len());
        }
        redundancy.replica = parts.replica;
        if layout.dense_coded() {
            redundancy.dense_parity = parts.dense_parity;
        }
        let stride = global.row_stride();
        let parity_slots: Vec<usize> = redundancy
            .parity
            .iter()
            .map(|p| p.len() / redundancy.row_bytes.max(1))
            .collect();
        let mut pending = Pending::new(&config.table_rows, &parity_slots);
        let mut tables = Vec::with_capacity(global.tables());
        let (k, r) = (stripes.params.k, stripes.params.r);
        for (t, &rows) in global.table_rows.iter().enumerate() {
            let local_rows = config.table_rows[t];
            // Nothing here may take time in proportion to the shard: training waits for
            // it. The full cycles are marked a word at a time; only the last, partly
            // padded cycle is tested slot by slot (resume was 0.38 s at 100k rows per
            // table and 0.56 s at 400k with a test per slot).
            let full = stripes.full_cycles(me, rows);
            pending.mark_data_range(t, 0..full * k);
            for local in (full * k).min(local_rows)..local_rows {
                if stripes.data_at(t, me, local, rows).is_some() {
                    pending.mark_data(t, local);
                }
            }
            pending.mark_parity_range(t, 0..full * r);
            for local in (full * r).min(parity_slots[t])..parity_slots[t] {
                if stripes.parity_at(t, me, local, rows).is_some() {
                    pending.mark_parity(t, local);
                }
            }
            tables.push(
                EmbeddingTable::from_data(
                    local_rows,
                    global.dim,
                    stride,
                    reserve.table(t, local_rows * stride),
                )
                .ok_or_else(|| PsError::Config("shard table shape".into()))?,
            );
        }
        let state = ModelState::from_parts(config, tables, dense)?;
        let id = self
            .background_ids
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        *self.background.lock().unwrap_or_else(|p| p.into_inner()) = Some(Background {
            id,
            lost,
            codec: std::sync::Arc::new(codec),
        });
        {
            let mut shard = self.shard_write()?;
            shard.install_rebuilt(state, redundancy)?;
            shard.begin_background_rebuild(pending);
            self.publish(epoch, |steps| *steps = parts.applied);
        }
        self.settle_older_epochs(epoch, &[])?;
        self.metrics.set("ftrec_epoch", epoch as f64);
        tracing::info!(
            "serving degraded in epoch {epoch} after {:.3} s; rebuilding in the background",
            started.elapsed().as_secs_f64()
        );
        Ok(RebuildReply {
            bytes: parts.bytes,
            rows: 0,
            seconds: started.elapsed().as_secs_f64(),
            tables_done: 0,
            tables: global.tables() as u32,
            done: false,
            serving: true,
        })
    }

    /// The dense state a rebuilt slot keeps: the replica of the range it replicates (from
    /// that range's primary) and, unless `parity_only`, its own range (from its replica
    /// holder) with that holder's record of applied steps, which is this slot's: under
    /// 2PC the replica holder committed exactly the steps the slot had.
    async fn fetch_dense_parts(
        &self,
        clients: &BTreeMap<usize, ServerClient>,
        epoch: u64,
        global: &ftrec_model::ModelConfig,
        config: &ftrec_model::ModelConfig,
        parity_only: bool,
    ) -> Result<DenseParts, PsError> {
        let layout = self.layout;
        let me = self.id;
        if layout.dense_coded() {
            let coded = self
                .rebuild_coded_dense(clients, epoch, global, parity_only)
                .await?;
            let dense = match coded.own {
                Some((params, state, step)) => Some(packed_dense(
                    config,
                    self.job.config.seed,
                    &params,
                    &state,
                    step,
                )?),
                None => None,
            };
            return Ok(DenseParts {
                replica: None,
                dense_parity: coded.parity,
                dense,
                applied: coded.applied,
                bytes: coded.bytes,
            });
        }
        let replica_holder = layout
            .replica_of(me)
            .ok_or_else(|| PsError::Config("no dense replica holder".into()))?;
        let replicated = layout
            .replicates(me)
            .ok_or_else(|| PsError::Config("no replicated dense range".into()))?;
        let dense_from = |s: usize| {
            clients.get(&s).cloned().ok_or_else(|| {
                PsError::Fatal(format!(
                    "rebuild: server {s} holds a dense range this slot needs and is lost too"
                ))
            })
        };
        let other = fetch_dense(
            &mut dense_from(replicated)?,
            epoch,
            false,
            "rebuild: replicated range",
        )
        .await?;
        let replica = DenseReplica {
            of: replicated,
            range: layout.dense_range(replicated, ftrec_model::MlpSpec::dlrm_pair(global).1.end()),
            params: bytes_to_f32s(&other.params, "replicated range")?,
            state: bytes_to_f32s(&other.state, "replicated range state")?,
            step: other.step,
        };
        let mut bytes = (other.params.len() + other.state.len()) as u64;
        if parity_only {
            return Ok(DenseParts {
                replica: Some(replica),
                dense_parity: Vec::new(),
                dense: None,
                applied: AppliedSteps::default(),
                bytes,
            });
        }
        let own = fetch_dense(
            &mut dense_from(replica_holder)?,
            epoch,
            true,
            "rebuild: dense replica",
        )
        .await?;
        let dense = packed_dense(
            config,
            self.job.config.seed,
            &bytes_to_f32s(&own.params, "dense replica")?,
            &bytes_to_f32s(&own.state, "dense replica state")?,
            own.step,
        )?;
        bytes += (own.params.len() + own.state.len()) as u64;
        Ok(DenseParts {
            replica: Some(replica),
            dense_parity: Vec::new(),
            dense: Some(dense),
            applied: AppliedSteps::from_parts(own.applied_below, own.applied_ahead.iter().copied()),
            bytes,
        })
    }
}

/// What [`Core::fetch_dense_parts`] brings.
struct DenseParts {
    replica: Option<DenseReplica>,
    /// Dense ranges coded: the dense parity rows this slot holds.
    dense_parity: Vec<(ftrec_ec::DenseParitySlot, Vec<u8>)>,
    /// This slot's own dense range (`None` when re-deriving parity only).
    dense: Option<ftrec_model::DenseState>,
    applied: AppliedSteps,
    bytes: u64,
}
