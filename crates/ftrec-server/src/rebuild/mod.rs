//! A replacement server rebuilds what its slot held (ECRec §3.4) from the survivors of
//! its group: every data row and every parity row, decoded stripe by stripe, and both
//! dense ranges it keeps (its own, from the replica holder; the one it replicates, from
//! that range's primary). Training is held by the coordinator meanwhile; the rebuilt
//! state is bit-identical to the lost one because the code works on the rows' bytes.

pub(crate) mod boost;
mod context;
mod dense;
pub(crate) mod pace;
pub(crate) mod reserve;
mod tables;
pub(crate) mod ticks;

pub(crate) use context::RebuildContext;

use std::collections::BTreeMap;
use tokio::time::Instant;

use ftrec_ec::Codec;
use ftrec_model::{EmbeddingTable, ModelState};

use crate::Core;
use crate::shard::{DenseReplica, Pending, Redundancy, Shard, packed_dense};
use ftrec_proto::applied::AppliedSteps;
use ftrec_proto::proto::*;
use ftrec_proto::wire::bytes_to_f32s;
use ftrec_rpc::PsError;
use ftrec_rpc::client::ServerClient;

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
    /// message per table. Returns the totals. Holds the commit turn throughout, but for a
    /// background rebuild, which lets it go once the slot serves.
    pub(super) async fn rebuild(
        &self,
        req: RebuildRequest,
        progress: tokio::sync::mpsc::Sender<Result<RebuildReply, tonic::Status>>,
    ) -> Result<RebuildReply, PsError> {
        let started = Instant::now();
        self.pipeline.check_epoch_forward(req.epoch)?;
        // A step of an older epoch prepared here holds the commit turn until it is decided,
        // and nobody may decide it: a new leader that took over during this slot's
        // background rebuild fences only the other servers, and the worker that prepared it
        // dropped it on seeing the new epoch. This slot's state is rebuilt from the
        // survivors anyway: the older epoch's prepared steps are dropped before the turn
        // is taken (issue 42, hole 1: the new leader waited on this rebuild forever).
        self.settle_older_epochs(req.epoch, &[])?;
        let turn = self.pipeline.turn().await;
        self.pipeline.check_epoch_forward(req.epoch)?;
        let epoch = req.epoch;
        let layout = self.layout;
        let Some(stripes) = layout.stripes() else {
            return Err(PsError::Config("rebuild without erasure coding".into()));
        };
        let (k, r) = (stripes.params.k, stripes.params.r);
        let lost: Vec<usize> = req.lost.iter().map(|&s| s as usize).collect();
        let clients = self.survivor_clients(&req, stripes, &lost)?;
        let parity_only = req.parity_only;
        let global = self.job.config.model_config()?;
        let config = Shard::shard_config(&global, layout, self.id)?;
        if req.background && !parity_only {
            let codec = Codec::new(k, r).map_err(|e| PsError::Config(e.to_string()))?;
            // The pace stretches the window in which this group has less redundancy: only
            // where it survives another loss meanwhile. With r = 1 (this slot lost, none
            // to spare) a second loss before the rebuild ends loses the model, and a rebuild
            // slowed for a cause it did not make (a slow link slows training whatever the
            // rebuild does; `ftrec-sim` schedules::ec, seed 11) met one.
            let (group, _) = stripes.group_of_server(self.id);
            let (first, members) = stripes.group(group);
            let lost_in_group = lost
                .iter()
                .filter(|&&s| (first..first + members).contains(&s))
                .count();
            let pace_against = if lost_in_group < r {
                req.failure_free_steps_per_sec
            } else {
                0.0
            };
            let totals = self
                .serve_degraded(&clients, epoch, &global, config, lost, codec, started)
                .await?;
            let _ = progress.send(Ok(totals)).await;
            // Serving: updates go on while the rest decodes.
            drop(turn);
            return self
                .rebuild_in_background(global.tables(), started, totals, pace_against, &progress)
                .await;
        }
        let whole = WholeRebuild {
            clients: &clients,
            epoch,
            global: &global,
            config: &config,
            parity_only,
            started,
            progress: &progress,
        };
        let result = self.rebuild_whole(&whole).await;
        drop(turn);
        result
    }

    /// Clients for the survivors of this slot's group (every member but this one and the
    /// `lost`), at the addresses the recovery sent.
    fn survivor_clients(
        &self,
        req: &RebuildRequest,
        stripes: ftrec_ec::StripeLayout,
        lost: &[usize],
    ) -> Result<BTreeMap<usize, ServerClient>, PsError> {
        let me = self.id;
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
        Ok(clients)
    }

    /// A rebuild that decodes every table before the slot serves (or re-derives parity
    /// after a rollback), then installs the result. The caller holds the commit turn.
    async fn rebuild_whole(&self, w: &WholeRebuild<'_>) -> Result<RebuildReply, PsError> {
        let (layout, me) = (self.layout, self.id);
        let Some(stripes) = layout.stripes() else {
            return Err(PsError::Config("rebuild without erasure coding".into()));
        };
        // Re-encoding after a rollback: every server restored its data rows from the same
        // cut; parity and replicas are derived from them (this server's own rows included).
        let own_rows: Vec<Vec<u8>> = if w.parity_only {
            let shard = self.pipeline.shard_read()?;
            shard
                .state()
                .tables()
                .iter()
                .map(|t| t.as_bytes().to_vec())
                .collect()
        } else {
            Vec::new()
        };
        let codec = Codec::new(stripes.params.k, stripes.params.r)
            .map_err(|e| PsError::Config(e.to_string()))?;
        let mut redundancy = Redundancy::empty(w.global, layout, me)?;
        let plan = tables::TablePlan {
            stripes,
            codec: &codec,
            me,
            servers: layout.servers(),
            row_bytes: w.global.row_stride() * 4,
            parity_only: w.parity_only,
            silence: self.job.deadlines().rebuild_stall,
        };
        let rebuilt = tables::rebuild_tables(
            &plan,
            w,
            own_rows,
            &mut redundancy,
            self.job.network(),
            &self.faults,
        )
        .await?;
        let (rebuilt_rows, mut rebuilt_bytes) = (rebuilt.rows, rebuilt.bytes);
        let parts = self
            .fetch_dense_parts(w.clients, w.epoch, w.global, w.config, w.parity_only)
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
            tables_done: w.global.tables() as u32,
            tables: w.global.tables() as u32,
            done: true,
            serving: true,
        };
        let Some(dense) = parts.dense else {
            // The data rows and dense range stay as restored; parity and the replica now
            // match them.
            self.pipeline.shard_write()?.set_redundancy(redundancy);
            return Ok(RebuildReply {
                seconds: w.started.elapsed().as_secs_f64(),
                ..totals
            });
        };
        let applied = parts.applied;
        let state = ModelState::from_parts(w.config.clone(), rebuilt.tables, dense)?;
        {
            let mut shard = self.pipeline.shard_write()?;
            shard.install_rebuilt(state, redundancy)?;
            self.pipeline.publish(w.epoch, |steps| *steps = applied);
        }
        self.settle_older_epochs(w.epoch, &[])?;
        // Cuts go on from here: the slot's history continues on its newest branch.
        self.ckpt.continue_history()?;
        self.metrics.set("ftrec_epoch", w.epoch as f64);
        tracing::info!(
            "rebuilt {rebuilt_rows} rows, {rebuilt_bytes} bytes in {:.3} s: waiting for fetches {:.3} s, decoding {:.3} s",
            w.started.elapsed().as_secs_f64(),
            rebuilt.waited.as_secs_f64(),
            rebuilt.decoding.as_secs_f64()
        );
        Ok(RebuildReply {
            seconds: w.started.elapsed().as_secs_f64(),
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
        let mut reserve = self.rebuilding.take_reserve();
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
        self.rebuilding.start_background(lost, codec);
        {
            let mut shard = self.pipeline.shard_write()?;
            shard.install_rebuilt(state, redundancy)?;
            shard.begin_background_rebuild(pending);
            self.pipeline.publish(epoch, |steps| *steps = parts.applied);
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

/// A rebuild of the whole slot before it serves: what every step of it reads.
pub(super) struct WholeRebuild<'a> {
    pub clients: &'a BTreeMap<usize, ServerClient>,
    pub epoch: u64,
    pub global: &'a ftrec_model::ModelConfig,
    /// This slot's shard configuration.
    pub config: &'a ftrec_model::ModelConfig,
    pub parity_only: bool,
    pub started: Instant,
    pub progress: &'a tokio::sync::mpsc::Sender<Result<RebuildReply, tonic::Status>>,
}

#[cfg(test)]
mod tests;
