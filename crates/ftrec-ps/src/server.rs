//! `ftrec server`: one parameter server process. It joins the coordinator (or waits as a
//! spare until it is given a slot), builds or restores its shard, serves pulls and pushes
//! over gRPC and heartbeats until told to stop.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ftrec_ckpt::lease::LeaseOptions;
use ftrec_ckpt::{BranchStart, CheckpointKind, Checkpoints, open_store};
use tokio::sync::{Notify, watch};
use tonic::{Request, Response, Status};

use crate::PsError;
use crate::client::connect_coordinator;
use crate::job::Job;
use crate::metrics::{self, Metrics};
use crate::placement::Layout;
use crate::proto::parameter_server_server::{ParameterServer, ParameterServerServer};
use crate::proto::*;
use crate::shard::{Shard, Update};
use crate::wire::{bytes_to_f32s, bytes_to_u32s, f32s_to_bytes};

pub struct ServerOptions {
    pub job: Job,
    /// The server slot; `None` starts a spare that waits to be assigned one.
    pub id: Option<usize>,
    /// Coordinator address, `host:port`.
    pub coordinator: String,
    /// Host to listen on (port chosen by the OS).
    pub host: String,
}

/// Epoch and steps applied, published together so a waiting pull sees both change at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Live {
    epoch: u64,
    applied: u64,
}

struct Core {
    job: Job,
    layout: Layout,
    id: usize,
    shard: RwLock<Shard>,
    live: watch::Sender<Live>,
    /// The shard's checkpoint location (for reads).
    checkpoints: Option<Checkpoints>,
    /// The handle that writes there, holding the location's writer lease: started on the
    /// first checkpoint of a fresh run, and again on every restore (a restore to a cut
    /// older than this shard's newest checkpoint forks a new branch, so no committed
    /// checkpoint is ever rewritten).
    writer: std::sync::Mutex<Option<Checkpoints>>,
    metrics: Arc<Metrics>,
    stop: Arc<Notify>,
}

fn server_metrics(id: &str) -> Metrics {
    Metrics::new(format!("role=\"server\",id=\"{id}\""))
        .counter("ftrec_pulls_total", "Pull requests served")
        .counter("ftrec_pushes_total", "Push requests applied")
        .counter("ftrec_rows_pulled_total", "Embedding rows sent")
        .counter("ftrec_rows_updated_total", "Embedding rows updated")
        .counter("ftrec_rpc_bytes_in_total", "Payload bytes received")
        .counter("ftrec_rpc_bytes_out_total", "Payload bytes sent")
        .counter("ftrec_checkpoints_total", "Shard checkpoints written")
        .counter("ftrec_restores_total", "Shard restores")
        .gauge("ftrec_epoch", "Cluster epoch")
        .gauge("ftrec_applied_steps", "Global steps applied to this shard")
}

impl Core {
    fn live(&self) -> Live {
        *self.live.borrow()
    }

    fn check_epoch(&self, epoch: u64) -> Result<(), PsError> {
        let current = self.live().epoch;
        if epoch != current {
            return Err(PsError::StaleEpoch {
                got: epoch,
                current,
            });
        }
        Ok(())
    }

    /// Deterministic mode: waits (bounded) until exactly `target` steps are applied.
    async fn wait_applied(&self, epoch: u64, target: u64) -> Result<(), PsError> {
        let mut rx = self.live.subscribe();
        let waited = tokio::time::timeout(
            self.job.timeout(),
            rx.wait_for(|l| l.epoch != epoch || l.applied >= target),
        )
        .await;
        let live = match waited {
            Ok(Ok(l)) => *l,
            Ok(Err(_)) => return Err(PsError::Refused("server shutting down".into())),
            Err(_) => {
                return Err(PsError::Timeout(format!(
                    "server {} waited {:?} for step {target} (at {})",
                    self.id,
                    self.job.timeout(),
                    self.live().applied
                )));
            }
        };
        if live.epoch != epoch {
            return Err(PsError::StaleEpoch {
                got: epoch,
                current: live.epoch,
            });
        }
        if live.applied != target {
            return Err(PsError::Request(format!(
                "step {target} asked for after {} steps were applied",
                live.applied
            )));
        }
        Ok(())
    }

    /// A lease key shared by every process that holds this job's slot, so a replacement
    /// takes the lease over from its predecessor, which the coordinator declared dead and
    /// fenced off by epoch.
    fn lease_options(&self) -> LeaseOptions {
        LeaseOptions {
            owner_key: Some(format!(
                "job {:016x} server {}",
                self.job.fingerprint(),
                self.id
            )),
            ..LeaseOptions::new(format!("ftrec server {}", self.id))
        }
    }

    /// The writing handle, started as a fresh run's when no restore started one.
    fn writer(&self, checkpoints: &Checkpoints) -> Result<Checkpoints, PsError> {
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = writer.as_ref() {
            return Ok(w.clone());
        }
        let start = BranchStart::Fresh {
            new_branch: self.job.config.checkpoint.new_branch,
        };
        let (w, _) = checkpoints.start_writing(start, &self.lease_options())?;
        *writer = Some(w.clone());
        Ok(w)
    }

    /// Restores the shard checkpoint of cut `step`, then writes on from there.
    fn restore_cut(
        &self,
        checkpoints: &Checkpoints,
        step: u64,
    ) -> Result<(ftrec_model::ModelState, String), PsError> {
        // The cut's checkpoint at this step written last: an older one at the same step
        // belongs to a cut that failed part-way and was rolled back below it.
        let id = checkpoints
            .list()?
            .into_iter()
            .filter(|m| m.step == step && m.kind == CheckpointKind::Full)
            .max_by_key(|m| m.created_unix_ms)
            .map(|m| m.id)
            .ok_or_else(|| {
                PsError::Config(format!(
                    "server {}: no checkpoint of step {step} in {}",
                    self.id,
                    checkpoints.store().describe("")
                ))
            })?;
        let (state, manifest) = checkpoints.restore(&id)?;
        check_owner(
            &manifest.trainer,
            self.id,
            &checkpoints.store().describe(&id),
        )?;
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        // Let go of the old lease first; the same owner key could take it over anyway.
        *writer = None;
        let (w, started) = checkpoints.start_writing(
            BranchStart::Resume { from: id.clone() },
            &self.lease_options(),
        )?;
        if let Some(fork) = &started.forked_from {
            tracing::info!(
                "server {}: restored {fork}, newer checkpoints exist: writing branch {}",
                self.id,
                started.branch
            );
        }
        *writer = Some(w);
        Ok((state, id))
    }
}

/// Refuses a shard checkpoint written by another server (a swapped or copied directory):
/// restoring it would silently put another shard's rows in this server's slots.
fn check_owner(identity: &serde_json::Value, server: usize, what: &str) -> Result<(), PsError> {
    match identity.get("server").and_then(|v| v.as_u64()) {
        Some(owner) if owner == server as u64 => Ok(()),
        Some(owner) => Err(PsError::Refused(format!(
            "{what} is server {owner}'s shard; server {server} refuses to restore it"
        ))),
        None => Err(PsError::Refused(format!(
            "{what} carries no server identity; it is not a cluster shard checkpoint"
        ))),
    }
}

struct Service(Arc<Core>);

#[tonic::async_trait]
impl ParameterServer for Service {
    async fn pull(&self, req: Request<PullRequest>) -> Result<Response<PullReply>, Status> {
        let core = &self.0;
        let req = req.into_inner();
        core.check_epoch(req.epoch)?;
        if let Some(target) = req.wait_applied {
            core.wait_applied(req.epoch, target).await?;
        }
        let mut embeddings = Vec::with_capacity(req.tables.len());
        let mut rows_sent = 0;
        let (dense, applied) = {
            let shard = core
                .shard
                .read()
                .map_err(|_| Status::internal("shard lock"))?;
            for t in &req.tables {
                let rows = bytes_to_u32s(&t.rows, "pull rows")?;
                let mut out = Vec::new();
                shard.gather(t.table as usize, &rows, &mut out)?;
                rows_sent += rows.len() as u64;
                embeddings.push(Bytes::from(out));
            }
            (f32s_to_bytes(shard.dense_params()), core.live().applied)
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
        core.check_epoch(req.epoch)?;
        let deterministic = core.job.config.cluster.deterministic;
        if deterministic {
            core.wait_applied(req.epoch, req.step).await?;
        }
        let mut in_bytes = req.dense.len();
        let mut update = Update {
            step: req.step,
            dense: bytes_to_f32s(&req.dense, "push dense gradient")?,
            sparse: Vec::with_capacity(req.tables.len()),
        };
        for t in &req.tables {
            in_bytes += t.rows.len() + t.grads.len();
            update.sparse.push((
                t.table as usize,
                bytes_to_u32s(&t.rows, "push rows")?,
                bytes_to_f32s(&t.grads, "push gradients")?,
            ));
        }
        let rows: usize = update.sparse.iter().map(|(_, r, _)| r.len()).sum();
        let applied = {
            let mut shard = core
                .shard
                .write()
                .map_err(|_| Status::internal("shard lock"))?;
            // Checked again under the lock: a restore may have run while this push waited.
            core.check_epoch(req.epoch)?;
            shard.apply(&update)?;
            let mut live = core.live();
            live.applied = if deterministic {
                req.step + 1
            } else {
                live.applied + 1
            };
            core.live.send_replace(live);
            live.applied
        };
        core.metrics.add("ftrec_pushes_total", 1);
        core.metrics.add("ftrec_rows_updated_total", rows as u64);
        core.metrics
            .add("ftrec_rpc_bytes_in_total", in_bytes as u64);
        core.metrics.set("ftrec_applied_steps", applied as f64);
        Ok(Response::new(PushReply { applied }))
    }

    async fn checkpoint(
        &self,
        req: Request<CheckpointRequest>,
    ) -> Result<Response<CheckpointReply>, Status> {
        let core = self.0.clone();
        let req = req.into_inner();
        core.check_epoch(req.epoch)?;
        let Some(checkpoints) = core.checkpoints.clone() else {
            return Err(PsError::Config("checkpoint.dir is not set".into()).into());
        };
        let started = Instant::now();
        let manifest = tokio::task::spawn_blocking(move || -> Result<_, PsError> {
            let checkpoints = core.writer(&checkpoints)?;
            let shard = core
                .shard
                .read()
                .map_err(|_| PsError::Refused("shard lock poisoned".into()))?;
            let applied = core.live().applied;
            if applied != req.step {
                return Err(PsError::Request(format!(
                    "checkpoint of step {} asked for, but server {} has applied {applied} steps",
                    req.step, core.id
                )));
            }
            let identity = serde_json::json!({
                "server": core.id,
                "servers": core.layout.servers,
                "fingerprint": core.job.fingerprint(),
                "step": req.step,
            });
            let m = checkpoints.write_full(shard.state(), req.step, identity)?;
            core.metrics.add("ftrec_checkpoints_total", 1);
            Ok(m)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(CheckpointReply {
            id: manifest.id.clone(),
            bytes: manifest.bytes(),
            seconds: started.elapsed().as_secs_f64(),
        }))
    }

    async fn restore(
        &self,
        req: Request<RestoreRequest>,
    ) -> Result<Response<RestoreReply>, Status> {
        let core = self.0.clone();
        let req = req.into_inner();
        let started = Instant::now();
        let id = tokio::task::spawn_blocking(move || -> Result<String, PsError> {
            let (state, id) = match req.step {
                Some(step) => {
                    let Some(checkpoints) = &core.checkpoints else {
                        return Err(PsError::Config("checkpoint.dir is not set".into()));
                    };
                    core.restore_cut(checkpoints, step)?
                }
                None => {
                    // Back to the initial shard: whatever this slot committed before is
                    // another history, so new checkpoints go to a branch of their own.
                    if let Some(checkpoints) = &core.checkpoints {
                        let mut writer = core.writer.lock().unwrap_or_else(|p| p.into_inner());
                        *writer = None;
                        let start = BranchStart::Fresh { new_branch: true };
                        *writer = Some(checkpoints.start_writing(start, &core.lease_options())?.0);
                    }
                    let c = &core.job.config;
                    let shard = Shard::initial(&c.model_config()?, c.seed, core.layout, core.id)?;
                    (shard.state().clone(), "initial".to_string())
                }
            };
            let mut shard = core
                .shard
                .write()
                .map_err(|_| PsError::Refused("shard lock poisoned".into()))?;
            shard.replace_state(state)?;
            core.live.send_replace(Live {
                epoch: req.epoch,
                applied: req.step.unwrap_or(0),
            });
            core.metrics.add("ftrec_restores_total", 1);
            core.metrics.set("ftrec_epoch", req.epoch as f64);
            Ok(id)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))??;
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
        // Under the shard lock so no push straddles the change.
        let _shard = core
            .shard
            .write()
            .map_err(|_| Status::internal("shard lock"))?;
        core.live.send_replace(Live {
            epoch: req.epoch,
            applied: req.applied,
        });
        core.metrics.set("ftrec_epoch", req.epoch as f64);
        Ok(Response::new(SetEpochReply {}))
    }

    async fn fetch_shard(
        &self,
        req: Request<FetchShardRequest>,
    ) -> Result<Response<FetchShardReply>, Status> {
        let core = &self.0;
        let table = req.into_inner().table as usize;
        let shard = core
            .shard
            .read()
            .map_err(|_| Status::internal("shard lock"))?;
        let Some(t) = shard.state().tables().get(table) else {
            return Err(Status::invalid_argument(format!(
                "table {table} does not exist"
            )));
        };
        Ok(Response::new(FetchShardReply {
            rows: Bytes::copy_from_slice(t.as_bytes()),
            dense_params: f32s_to_bytes(shard.dense_params()),
            dense_state: f32s_to_bytes(shard.dense_optimizer_state()),
            dense_step: shard.dense_step(),
        }))
    }

    async fn shutdown(
        &self,
        _req: Request<ShutdownRequest>,
    ) -> Result<Response<ShutdownReply>, Status> {
        self.0.stop.notify_one();
        Ok(Response::new(ShutdownReply {}))
    }
}

/// Runs a server until the coordinator stops it or becomes unreachable.
pub async fn run(opts: ServerOptions) -> Result<(), PsError> {
    let job = opts.job;
    let layout = job.layout()?;
    let cluster = job.config.cluster.clone();
    let (listener, address) = crate::client::bind(&opts.host, 0).await?;
    let label = opts.id.map_or("spare".to_string(), |i| i.to_string());
    let metrics = Arc::new(server_metrics(&label));
    let metrics_address = metrics::start(&opts.host, metrics.clone())
        .await
        .unwrap_or_default();
    let mut coordinator = connect_coordinator(&opts.coordinator, job.timeout()).await?;
    let joined = coordinator
        .join(JoinRequest {
            role: Role::Server as i32,
            id: opts.id.unwrap_or(0) as u32,
            address: address.clone(),
            fingerprint: job.fingerprint(),
            pid: std::process::id(),
            metrics_address,
            spare: opts.id.is_none(),
        })
        .await
        .map_err(|s| PsError::rpc(format!("joining coordinator {}", opts.coordinator), &s))?
        .into_inner();
    let heartbeat = Duration::from_millis(cluster.heartbeat_ms);
    let id = match opts.id {
        Some(id) => id,
        None => {
            tracing::info!("spare server at {address} waiting for a slot");
            wait_for_assignment(&mut coordinator, joined.spare_token, heartbeat, &job).await?
        }
    };
    tracing::info!("server {id} at {address}, epoch {}", joined.epoch);
    let c = &job.config;
    let model = c.model_config()?;
    let (seed, host_layout) = (c.seed, layout);
    // Building a large shard takes longer than the failure timeout: heartbeat (not yet
    // ready) meanwhile, or the coordinator would declare the newcomer dead.
    let starting = tokio::spawn(crate::client::keep_alive(
        coordinator.clone(),
        HeartbeatRequest {
            role: Role::Server as i32,
            id: id as u32,
            epoch: 0,
            spare: false,
            ready: false,
        },
        heartbeat,
    ));
    let shard = tokio::task::spawn_blocking(move || Shard::initial(&model, seed, host_layout, id))
        .await
        .map_err(|e| PsError::Refused(e.to_string()));
    starting.abort();
    let shard = shard??;
    let checkpoints = match &c.checkpoint.dir {
        Some(dir) => {
            let location = format!(
                "{}/server-{id}",
                dir.to_string_lossy().trim_end_matches('/')
            );
            Some(Checkpoints::new(open_store(&location)?))
        }
        None => None,
    };
    let (live, _) = watch::channel(Live {
        epoch: joined.epoch,
        applied: 0,
    });
    let stop = Arc::new(Notify::new());
    let core = Arc::new(Core {
        job: job.clone(),
        layout,
        id,
        shard: RwLock::new(shard),
        live,
        checkpoints,
        writer: std::sync::Mutex::new(None),
        metrics,
        stop: stop.clone(),
    });
    let service = ParameterServerServer::new(Service(core.clone()))
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let serve_stop = stop.clone();
    let serving = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, async move { serve_stop.notified().await })
            .await
    });
    heartbeat_loop(
        &mut coordinator,
        core,
        heartbeat,
        cluster.failure_timeout_ms,
    )
    .await?;
    stop.notify_waiters();
    let _ = tokio::time::timeout(Duration::from_secs(2), serving).await;
    Ok(())
}

async fn wait_for_assignment(
    coordinator: &mut crate::client::CoordinatorClient,
    token: u32,
    period: Duration,
    job: &Job,
) -> Result<usize, PsError> {
    let mut silent_since = Instant::now();
    loop {
        tokio::time::sleep(period).await;
        match coordinator
            .heartbeat(HeartbeatRequest {
                role: Role::Server as i32,
                id: token,
                epoch: 0,
                spare: true,
                ready: false,
            })
            .await
        {
            Ok(r) => {
                let r = r.into_inner();
                if r.stop {
                    return Err(PsError::Refused("stopped while a spare".into()));
                }
                if let Some(slot) = r.assign {
                    return Ok(slot as usize);
                }
                silent_since = Instant::now();
            }
            Err(s) if silent_since.elapsed() > job.timeout() => {
                return Err(PsError::rpc("coordinator unreachable", &s));
            }
            Err(_) => {}
        }
    }
}

/// Heartbeats until the coordinator says stop, a Shutdown RPC arrives, or the coordinator
/// has been unreachable for ten failure timeouts (so no server outlives its cluster).
async fn heartbeat_loop(
    coordinator: &mut crate::client::CoordinatorClient,
    core: Arc<Core>,
    period: Duration,
    failure_timeout_ms: u64,
) -> Result<(), PsError> {
    let give_up = Duration::from_millis(failure_timeout_ms * 10).max(Duration::from_secs(5));
    let mut last_ok = Instant::now();
    loop {
        tokio::select! {
            _ = core.stop.notified() => return Ok(()),
            _ = tokio::time::sleep(period) => {}
        }
        let reply = coordinator
            .heartbeat(HeartbeatRequest {
                role: Role::Server as i32,
                id: core.id as u32,
                epoch: core.live().epoch,
                spare: false,
                ready: true,
            })
            .await;
        match reply {
            Ok(r) if r.get_ref().stop => return Ok(()),
            Ok(_) => last_ok = Instant::now(),
            Err(s) if s.code() == tonic::Code::PermissionDenied => {
                return Err(PsError::rpc("coordinator removed this server", &s));
            }
            Err(s) if last_ok.elapsed() > give_up => {
                return Err(PsError::rpc("coordinator unreachable; exiting", &s));
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::check_owner;

    #[test]
    fn a_shard_checkpoint_of_another_server_is_refused() {
        let identity = serde_json::json!({"server": 1, "servers": 2, "step": 40});
        assert!(check_owner(&identity, 1, "ck").is_ok());
        let e = check_owner(&identity, 0, "ck").unwrap_err().to_string();
        assert!(
            e.contains("server 1's shard") && e.contains("server 0 refuses"),
            "{e}"
        );
        let e = check_owner(&serde_json::json!({"step": 3}), 0, "ck").unwrap_err();
        assert!(e.to_string().contains("no server identity"));
    }
}
