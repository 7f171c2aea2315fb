//! The parameter server's RPCs.

use std::sync::Arc;
use tokio::time::Instant;

use bytes::Bytes;
use tonic::{Request, Response, Status};

use crate::Core;
use crate::pipeline::{CommitMode, Pushed};
use crate::shard::Update;
use ftrec_proto::applied::AppliedSteps;
use ftrec_proto::proto::parameter_server_server::ParameterServer;
use ftrec_proto::proto::*;
use ftrec_proto::wire::{bytes_to_u32s, f32s_to_bytes};
use ftrec_rpc::PsError;

/// The most bytes one `FetchRows` piece carries.
const FETCH_CHUNK_BYTES: usize = 4 << 20;

pub(super) struct Service(pub(super) Arc<Core>);

#[tonic::async_trait]
impl ParameterServer for Service {
    async fn pull(&self, req: Request<PullRequest>) -> Result<Response<PullReply>, Status> {
        let core = &self.0;
        let req = req.into_inner();
        core.pipeline.check_epoch(req.epoch)?;
        if let Some(target) = req.wait_applied {
            core.wait_applied(req.epoch, target).await?;
            // A step applied here already was granted again after its worker died. With
            // checkpoints the coordinator rolls back for exact results, so say so; without,
            // the run promised nothing exact after a failure and the pull goes ahead.
            let exact = core.job.config.cluster.ft.exact_recovery();
            if exact && core.pipeline.steps().contains(target) {
                return Err(PsError::AlreadyApplied {
                    server: core.id as u32,
                    step: target,
                }
                .into());
            }
        }
        // Degraded reads: rows of this slot not rebuilt yet are decoded from their stripes.
        let wanted = req
            .tables
            .iter()
            .map(|t| Ok((t.table as usize, bytes_to_u32s(&t.rows, "pull rows")?)))
            .collect::<Result<Vec<_>, PsError>>()?;
        core.materialize_tables(&wanted, false).await?;
        let mut embeddings = Vec::with_capacity(req.tables.len());
        let mut rows_sent = 0;
        let (dense, applied) = {
            let shard = core.pipeline.shard_read()?;
            for t in &req.tables {
                let rows = bytes_to_u32s(&t.rows, "pull rows")?;
                let mut out = Vec::new();
                shard.gather(t.table as usize, &rows, &mut out)?;
                rows_sent += rows.len() as u64;
                embeddings.push(Bytes::from(out));
            }
            (
                f32s_to_bytes(shard.dense_params()),
                core.pipeline.steps().count(),
            )
        };
        let out_bytes = embeddings.iter().map(|e| e.len()).sum::<usize>() + dense.len();
        core.metrics.add("ftrec_pulls_total", 1);
        core.metrics.add("ftrec_rows_pulled_total", rows_sent);
        core.metrics
            .add("ftrec_rpc_bytes_out_total", out_bytes as u64);
        Ok(Response::new(PullReply {
            embeddings,
            dense,
            applied,
        }))
    }

    async fn push(&self, req: Request<PushRequest>) -> Result<Response<PushReply>, Status> {
        let core = &self.0;
        let req = req.into_inner();
        core.pipeline.check_epoch(req.epoch)?;
        let deterministic = core.job.config.cluster.deterministic;
        if deterministic {
            core.wait_applied(req.epoch, req.step).await?;
        }
        let (update, in_bytes) = Update::from_push(&req)?;
        let mode = match req.prepare {
            true => CommitMode::TwoPhase,
            false => CommitMode::Immediate,
        };
        // The update runs to its end even if its caller leaves (a deadline, a cancelled
        // stream): once its parity differences are out, stopping halfway would leave
        // holders with differences of an update that neither installed here nor was
        // prepared (one-round holders fold them at once). Its fate is then the worker's,
        // the regrant's or the recovery's to decide, as for any other.
        let running = core.clone();
        let epoch = req.epoch;
        let pushed = tokio::spawn(async move { running.run_update(epoch, update, mode).await })
            .await
            .map_err(|e| PsError::Internal(format!("update task: {e}")))??;
        let (applied, rows) = match pushed {
            Pushed::Prepared { rows, .. } => (core.pipeline.steps().count(), rows),
            Pushed::Applied { steps, rows } => (steps, rows),
            Pushed::Duplicate { steps } => {
                return Ok(Response::new(PushReply { applied: steps }));
            }
        };
        core.metrics.add("ftrec_pushes_total", 1);
        core.metrics.add("ftrec_rows_updated_total", rows as u64);
        core.metrics
            .add("ftrec_rpc_bytes_in_total", in_bytes as u64);
        Ok(Response::new(PushReply { applied }))
    }

    async fn checkpoint(
        &self,
        req: Request<CheckpointRequest>,
    ) -> Result<Response<CheckpointReply>, Status> {
        let core = self.0.clone();
        let req = req.into_inner();
        core.pipeline.check_epoch(req.epoch)?;
        let Some(checkpoints) = core.ckpt.location().cloned() else {
            return Err(PsError::Config("checkpoint.dir is not set".into()).into());
        };
        core.wait_rebuilt().await?;
        let started = Instant::now();
        if req.as_applied {
            // No commit turn: pushes go on but for the copy (`own_save.rs`).
            let save = core
                .job
                .network()
                .clone()
                .blocking(move || {
                    let save = core.ckpt.write_own_save(&core.pipeline, &checkpoints)?;
                    core.metrics.add("ftrec_checkpoints_total", 1);
                    Ok::<_, PsError>(save)
                })
                .await??;
            return Ok(Response::new(CheckpointReply {
                id: save.manifest.id.clone(),
                bytes: save.manifest.bytes(),
                seconds: started.elapsed().as_secs_f64(),
                committed: true,
                step: save.step,
                stall_seconds: save.stall_seconds,
                ..CheckpointReply::default()
            }));
        }
        let turn = core.pipeline.owned_turn().await;
        let reply = core
            .job
            .network()
            .clone()
            .blocking(move || -> Result<_, PsError> {
                let _turn = turn;
                let reply = if req.priority {
                    let save = core
                        .ckpt
                        .write_priority(&core.pipeline, &checkpoints, req.step)?;
                    CheckpointReply {
                        id: save.manifest.id.clone(),
                        bytes: save.manifest.bytes(),
                        seconds: 0.0,
                        committed: true,
                        tracker_bytes: save.tracker_bytes,
                        select_seconds: save.select_seconds,
                        step: req.step,
                        stall_seconds: 0.0,
                        tracking_seconds: save.tracking_seconds,
                    }
                } else {
                    core.faults
                        .kill_at(ftrec_faults::points::CUT, Some(req.step));
                    let (manifest, committed) =
                        core.ckpt
                            .write_cut(&core.pipeline, &checkpoints, req.step)?;
                    CheckpointReply {
                        id: manifest.id.clone(),
                        bytes: manifest.bytes(),
                        seconds: 0.0,
                        committed,
                        tracker_bytes: 0,
                        select_seconds: 0.0,
                        step: req.step,
                        stall_seconds: 0.0,
                        tracking_seconds: 0.0,
                    }
                };
                core.metrics.add("ftrec_checkpoints_total", 1);
                Ok(reply)
            })
            .await??;
        Ok(Response::new(CheckpointReply {
            seconds: started.elapsed().as_secs_f64(),
            ..reply
        }))
    }

    async fn cut_committed(
        &self,
        req: Request<CutCommittedRequest>,
    ) -> Result<Response<CutCommittedReply>, Status> {
        let core = self.0.clone();
        let req = req.into_inner();
        core.pipeline.check_epoch(req.epoch)?;
        let Some(checkpoints) = core.ckpt.location().cloned() else {
            return Err(PsError::Config("checkpoint.dir is not set".into()).into());
        };
        let network = core.job.network().clone();
        let committed = network
            .blocking(move || core.ckpt.cut_committed(&checkpoints, req.step))
            .await??;
        Ok(Response::new(CutCommittedReply { committed }))
    }

    async fn restore(
        &self,
        req: Request<RestoreRequest>,
    ) -> Result<Response<RestoreReply>, Status> {
        let core = self.0.clone();
        let req = req.into_inner();
        let started = Instant::now();
        core.faults.kill_at(ftrec_faults::points::RESTORE, None);
        // Steps an older epoch prepared hold the commit turn: the rollback decided them.
        if req.epoch >= core.pipeline.live().epoch {
            core.settle_older_epochs(req.epoch, &[])?;
        }
        let turn = core.pipeline.owned_turn().await;
        let id = core
            .job
            .network()
            .clone()
            .blocking(move || -> Result<String, PsError> {
                let _turn = turn;
                core.pipeline.check_epoch_forward(req.epoch)?;
                let (state, id, ahead) = match req.step {
                    Some(step) => {
                        let Some(checkpoints) = core.ckpt.location() else {
                            return Err(PsError::Config("checkpoint.dir is not set".into()));
                        };
                        core.ckpt.restore_cut(checkpoints, step)?
                    }
                    None => {
                        core.ckpt.restart_history()?;
                        let c = &core.job.config;
                        let (shard, _) = crate::resume::starting_shard(
                            &c.model_config()?,
                            c.seed,
                            core.layout,
                            core.id,
                            core.ckpt.resume(),
                            None,
                        )?;
                        let name = match core.ckpt.resume() {
                            Some(r) => format!("{}@{}", r.location, r.step),
                            None => "initial".to_string(),
                        };
                        (shard.state().clone(), name, Vec::new())
                    }
                };
                core.rebuilding.cancel_background();
                let mut shard = core.pipeline.shard_write()?;
                shard.replace_state(state)?;
                core.ckpt.reset_priority(&shard);
                core.pipeline.publish(req.epoch, |steps| {
                    *steps =
                        AppliedSteps::from_parts(req.step.unwrap_or(core.ckpt.first_step()), ahead)
                });
                core.metrics.add("ftrec_restores_total", 1);
                core.metrics.set("ftrec_epoch", req.epoch as f64);
                Ok(id)
            })
            .await??;
        Ok(Response::new(RestoreReply {
            id,
            seconds: started.elapsed().as_secs_f64(),
        }))
    }

    async fn set_epoch(
        &self,
        req: Request<SetEpochRequest>,
    ) -> Result<Response<SetEpochReply>, Status> {
        let core = &self.0;
        let req = req.into_inner();
        // Steps prepared in an older epoch hold the commit turn: the recovery decides
        // their fate, so they go first (and none of that epoch commits here from now on):
        // those some server committed are committed here too, the rest dropped.
        if req.epoch >= core.pipeline.live().epoch {
            core.settle_older_epochs(req.epoch, &req.finish)?;
        }
        // In the commit turn and under the shard lock, so no push straddles the change.
        let _turn = core.pipeline.turn().await;
        core.pipeline.check_epoch_forward(req.epoch)?;
        let _shard = core.pipeline.shard_write()?;
        core.pipeline.publish(req.epoch, |steps| {
            steps.settle_below(req.applied, &req.unsettled)
        });
        core.metrics.set("ftrec_epoch", req.epoch as f64);
        Ok(Response::new(SetEpochReply {}))
    }

    async fn fence(&self, req: Request<FenceRequest>) -> Result<Response<AppliedReply>, Status> {
        let core = &self.0;
        let req = req.into_inner();
        core.pipeline.check_epoch_forward(req.epoch)?;
        core.raise_fence(req.epoch)?;
        let reply = core.pipeline.applied_of(&req.steps);
        let rebuild_unfinished = !core.pipeline.shard_read()?.holds_its_rows();
        Ok(Response::new(AppliedReply {
            rebuild_unfinished,
            ..reply
        }))
    }

    type FetchRowsStream =
        std::pin::Pin<Box<dyn futures::Stream<Item = Result<FetchRowsChunk, Status>> + Send>>;

    async fn fetch_rows(
        &self,
        req: Request<FetchRowsRequest>,
    ) -> Result<Response<Self::FetchRowsStream>, Status> {
        let core = self.0.clone();
        let req = req.into_inner();
        core.pipeline.check_epoch(req.epoch)?;
        // Whole-table reads (the final gather, verify-parity) never see a pending slot.
        core.wait_rebuilt().await?;
        let table = req.table as usize;
        let parity = req.parity;
        let (rows, stride) = {
            let shard = core.pipeline.shard_read()?;
            let Some(t) = shard.state().tables().get(table) else {
                return Err(PsError::BadRequest(format!("table {table} does not exist")).into());
            };
            if parity {
                let Some(red) = shard.redundancy() else {
                    return Err(
                        PsError::BadRequest("this server holds no parity rows".into()).into(),
                    );
                };
                (red.parity[table].len() / red.row_bytes.max(1), t.stride())
            } else {
                (t.rows(), t.stride())
            }
        };
        let end = (req.end_row as usize).min(rows);
        let per_chunk = (FETCH_CHUNK_BYTES / (4 * stride)).max(1);
        // Each piece is copied under a short read lock when the stream is polled, so a large
        // table is never held in memory twice, nor in one message.
        let pieces = futures::stream::unfold(req.first_row as usize, move |first| {
            let core = core.clone();
            async move {
                if first >= end {
                    return None;
                }
                if let Some(pause) = core.faults.delay_at(ftrec_faults::points::SEND_ROWS, None) {
                    tokio::time::sleep(pause).await;
                }
                let last = (first + per_chunk).min(end);
                let piece = core
                    .pipeline
                    .shard_read()
                    .map_err(Status::from)
                    .map(|shard| {
                        let bytes = match shard.redundancy().filter(|_| parity) {
                            Some(red) => &red.parity[table][..],
                            None => shard.state().tables()[table].as_bytes(),
                        };
                        FetchRowsChunk {
                            first_row: first as u32,
                            rows: Bytes::copy_from_slice(
                                &bytes[first * stride * 4..last * stride * 4],
                            ),
                        }
                    });
                Some((piece, last))
            }
        });
        Ok(Response::new(Box::pin(pieces)))
    }

    async fn fetch_dense(
        &self,
        req: Request<FetchDenseRequest>,
    ) -> Result<Response<FetchDenseReply>, Status> {
        let core = &self.0;
        let req = req.into_inner();
        core.pipeline.check_epoch(req.epoch)?;
        let shard = core.pipeline.shard_read()?;
        let steps = core.pipeline.steps();
        let (applied_below, applied_ahead) = (steps.low(), steps.ahead().collect());
        drop(steps);
        if let Some(stripe) = req.dense_parity_stripe {
            let Some(row) = shard
                .redundancy()
                .and_then(|r| r.dense_parity_row(stripe as usize))
            else {
                return Err(PsError::BadRequest(format!(
                    "this server holds no parity of dense stripe {stripe}"
                ))
                .into());
            };
            return Ok(Response::new(FetchDenseReply {
                dense_parity: Bytes::copy_from_slice(row),
                applied_below,
                applied_ahead,
                ..Default::default()
            }));
        }
        if req.replica {
            let Some(replica) = shard.redundancy().and_then(|r| r.replica.as_ref()) else {
                return Err(
                    PsError::BadRequest("this server keeps no dense replica".into()).into(),
                );
            };
            return Ok(Response::new(FetchDenseReply {
                params: f32s_to_bytes(&replica.params),
                state: f32s_to_bytes(&replica.state),
                step: replica.step,
                applied_below,
                applied_ahead,
                dense_parity: Bytes::new(),
            }));
        }
        Ok(Response::new(FetchDenseReply {
            params: f32s_to_bytes(shard.dense_params()),
            state: f32s_to_bytes(shard.dense_optimizer_state()),
            step: shard.dense_step(),
            applied_below,
            applied_ahead,
            dense_parity: Bytes::new(),
        }))
    }

    async fn applied(
        &self,
        req: Request<AppliedRequest>,
    ) -> Result<Response<AppliedReply>, Status> {
        let core = self.0.clone();
        let req = req.into_inner();
        core.pipeline.check_epoch(req.epoch)?;
        let reply = core.pipeline.applied_of(&req.steps);
        let shard_digest = if req.digest {
            core.wait_rebuilt().await?;
            // Hashing a whole shard is CPU work: off the RPC threads.
            let network = core.job.network().clone();
            network
                .blocking(move || {
                    core.pipeline
                        .shard_read()
                        .map(|shard| shard.digest())
                        .map_err(Status::from)
                })
                .await??
        } else {
            String::new()
        };
        Ok(Response::new(AppliedReply {
            shard_digest,
            ..reply
        }))
    }

    async fn prune(&self, req: Request<PruneRequest>) -> Result<Response<PruneReply>, Status> {
        let core = self.0.clone();
        let req = req.into_inner();
        core.pipeline.check_epoch(req.epoch)?;
        let network = core.job.network().clone();
        let deleted = network
            .blocking(move || core.ckpt.prune(&req.keep_steps))
            .await??;
        Ok(Response::new(PruneReply { deleted }))
    }

    async fn parity_update(
        &self,
        req: Request<ParityUpdateRequest>,
    ) -> Result<Response<ParityUpdateReply>, Status> {
        let req = req.into_inner();
        let bytes: usize = req.tables.iter().map(|t| t.deltas.len()).sum();
        self.0.parity_update(req)?;
        self.0.metrics.add("ftrec_rpc_bytes_in_total", bytes as u64);
        Ok(Response::new(ParityUpdateReply {}))
    }

    async fn commit_step(
        &self,
        req: Request<StepDecision>,
    ) -> Result<Response<StepDecisionReply>, Status> {
        let req = req.into_inner();
        let applied = self.0.commit_step(req.epoch, req.step).await?;
        Ok(Response::new(StepDecisionReply { applied }))
    }

    async fn abort_step(
        &self,
        req: Request<StepDecision>,
    ) -> Result<Response<StepDecisionReply>, Status> {
        let req = req.into_inner();
        let applied = self.0.abort_step(req.epoch, req.step, req.attempt)?;
        Ok(Response::new(StepDecisionReply { applied }))
    }

    type RebuildStream =
        std::pin::Pin<Box<dyn futures::Stream<Item = Result<RebuildReply, Status>> + Send>>;

    async fn rebuild(
        &self,
        req: Request<RebuildRequest>,
    ) -> Result<Response<Self::RebuildStream>, Status> {
        let core = self.0.clone();
        let req = req.into_inner();
        let (progress, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            let last = match core.rebuild(req, progress.clone()).await {
                Ok(totals) => Ok(totals),
                Err(e) => Err(Status::from(e)),
            };
            let _ = progress.send(last).await;
        });
        let tick = crate::rebuild::ticks::tick_for(self.0.job.deadlines().stream_progress);
        Ok(Response::new(Box::pin(crate::rebuild::ticks::with_ticks(
            rx, tick,
        ))))
    }

    async fn fetch_slots(
        &self,
        req: Request<FetchSlotsRequest>,
    ) -> Result<Response<FetchSlotsReply>, Status> {
        let reply = self.0.fetch_slots(req.get_ref())?;
        // Bytes sent through the bulk port are counted there (`RangeSource for Core`).
        self.0.metrics.add(
            "ftrec_rpc_bytes_out_total",
            (reply.data.len() + reply.parity.len()) as u64,
        );
        Ok(Response::new(reply))
    }

    async fn shutdown(
        &self,
        _req: Request<ShutdownRequest>,
    ) -> Result<Response<ShutdownReply>, Status> {
        self.0.stop.notify_one();
        Ok(Response::new(ShutdownReply {}))
    }
}
