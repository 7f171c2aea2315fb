//! `ftrec server`: one parameter server process. It joins the coordinator (or waits as a
//! spare until it is given a slot), builds or restores its shard, serves pulls and pushes
//! over gRPC and heartbeats until told to stop.
//!
//! Files: this one runs the process and holds its state (`Core`); `service.rs` answers the
//! RPCs; `checkpoints.rs` writes, restores and prunes the shard's checkpoints, and
//! `own_save.rs` takes `cpr.uncoordinated`'s saves while training goes on.

mod bulk;
mod checkpoints;
mod degraded;
mod ec;
mod own_save;
mod pipeline;
mod priority;
mod rebuild;
mod service;
pub mod shard;

use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use ftrec_ckpt::{Checkpoints, open_store};
use tokio::sync::{Notify, watch};

use crate::shard::{PostCommit, PreCommit, Shard};
use ftrec_proto::applied::AppliedSteps;
use ftrec_proto::placement::Layout;
use ftrec_proto::proto::parameter_server_server::ParameterServerServer;
use ftrec_proto::proto::*;
use ftrec_rpc::PsError;
use ftrec_rpc::job::Job;
use ftrec_rpc::leader::{CoordinatorLink, CoordinatorSource, Locator};
use ftrec_rpc::metrics::{self, Metrics};

pub struct ServerOptions {
    pub job: Job,
    /// The server slot; `None` starts a spare that waits to be assigned one.
    pub id: Option<usize>,
    /// Where the coordinator is: an address, or the job's leader in etcd.
    pub coordinator: CoordinatorSource,
    /// Host to listen on (port chosen by the OS).
    pub host: String,
    /// This server's fault points (tests, `cluster run --kill server:J@commit:N`).
    pub faults: ftrec_faults::Faults,
}

/// The epoch and the first step not applied (every step below it is), published together
/// so a waiting pull sees both change at once.
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
    /// Which steps the shard holds. Changed only under the shard's write lock, so the two
    /// always agree.
    steps: Mutex<AppliedSteps>,
    live: watch::Sender<Live>,
    /// One update at a time goes through stage, pre-commit, commit and post-commit, in
    /// arrival order (tokio's mutex is fair), so each is staged from the state its
    /// predecessor left. The shard lock is held only to stage (read) and to install
    /// (write): pulls are served while a pre-commit observer awaits. Restores, epoch changes
    /// and cuts take this turn too, so no update straddles them.
    commit_turn: Arc<tokio::sync::Mutex<()>>,
    /// Erasure coding: prepared steps and staged parity differences (`ec.rs`).
    ec: Option<ec::EcState>,
    pre_commit: Vec<Arc<dyn PreCommit>>,
    post_commit: Vec<Arc<dyn PostCommit>>,
    /// The job's checkpoint strategy over this shard.
    checkpointer: checkpoints::SharedCheckpointer,
    /// `cpr.uncoordinated`: the own saves' snapshot and checkpointer (`own_save.rs`).
    own_save: Mutex<own_save::OwnSaveSlot>,
    /// CPR's row trackers for prioritised saves (`priority.rs`).
    priority: Option<priority::SharedPriority>,
    /// The shard's checkpoint location (for reads).
    checkpoints: Option<Checkpoints>,
    /// The handle that writes there, holding the location's writer lease: started on the
    /// first checkpoint of a fresh run, and again on every restore (a restore to a cut
    /// older than this shard's newest checkpoint forks a new branch, so no committed
    /// checkpoint is ever rewritten).
    writer: std::sync::Mutex<Option<Checkpoints>>,
    metrics: Arc<Metrics>,
    stop: Arc<Notify>,
    /// Fault points armed for this member (`ftrec-faults`).
    faults: ftrec_faults::Faults,
    /// Erasure coding: clients for the other servers (parity differences, degraded reads).
    peers: Option<Arc<ec::Peers>>,
    /// Erasure coding over real TCP without TLS (`ec.rebuild_transport = "bulk"`): this
    /// server's bulk port, where it sends cycle ranges to a replacement straight from its
    /// tables, and its side for asking survivors' ranges when it is one (`bulk.rs`).
    bulk: Option<Arc<bulk::BulkServer>>,
    bulk_client: Option<Arc<bulk::BulkClient>>,
    /// Rebuild first (`rebuild/boost.rs`): raised while this server rebuilds uncapped into itself,
    /// and (through `bulk`) while it sends a replacement ranges.
    boost: Option<Arc<rebuild::boost::RebuildBoost>>,
    /// A background rebuild in progress here (`degraded.rs`).
    background: Mutex<Option<degraded::Background>>,
    /// Numbers each background rebuild, so a superseded one can tell.
    background_ids: std::sync::atomic::AtomicU64,
    /// This process's incarnation of its slot (`JoinReply.incarnation`), sent with every
    /// heartbeat so the coordinator refuses it once a newer process holds the slot.
    incarnation: u64,
    /// A promoted spare's memory, written while it waited (`rebuild/reserve.rs`); the rebuild
    /// takes it.
    reserve: Mutex<rebuild::reserve::Reserve>,
}

/// The job's secret check, counting every request it lets through: what `cluster run`
/// reports as `server_rpcs` (RPCs per step, side by side across `--ft` modes).
#[derive(Clone)]
struct CountServed {
    check: ftrec_rpc::auth::CheckSecret,
    metrics: Arc<Metrics>,
}

impl tonic::service::Interceptor for CountServed {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let request = self.check.call(request)?;
        self.metrics.add("ftrec_rpcs_served_total", 1);
        Ok(request)
    }
}

fn server_metrics(id: &str) -> Metrics {
    Metrics::new(format!("role=\"server\",id=\"{id}\""))
        .counter("ftrec_pulls_total", "Pull requests served")
        .counter("ftrec_pushes_total", "Push requests applied")
        .counter("ftrec_rows_pulled_total", "Embedding rows sent")
        .counter("ftrec_rows_updated_total", "Embedding rows updated")
        .counter("ftrec_rpc_bytes_in_total", "Payload bytes received")
        .counter("ftrec_rpc_bytes_out_total", "Payload bytes sent")
        .counter(
            "ftrec_rpcs_served_total",
            "RPCs served (every data-plane call: workers' and peers')",
        )
        .counter("ftrec_checkpoints_total", "Shard checkpoints written")
        .counter("ftrec_restores_total", "Shard restores")
        .counter(
            "ftrec_duplicate_pushes_total",
            "Pushes of a step applied already (a dead worker's step granted again), ignored",
        )
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

    /// Restores and epoch changes only move forward: a delayed one from an older recovery
    /// must not undo a newer one.
    fn check_epoch_forward(&self, epoch: u64) -> Result<(), PsError> {
        let current = self.live().epoch;
        if epoch < current {
            return Err(PsError::StaleEpoch {
                got: epoch,
                current,
            });
        }
        Ok(())
    }

    fn shard_read(&self) -> Result<std::sync::RwLockReadGuard<'_, Shard>, PsError> {
        self.shard
            .read()
            .map_err(|_| PsError::Internal("shard lock poisoned".into()))
    }

    fn shard_write(&self) -> Result<std::sync::RwLockWriteGuard<'_, Shard>, PsError> {
        self.shard
            .write()
            .map_err(|_| PsError::Internal("shard lock poisoned".into()))
    }

    /// Which of `steps` this server has applied, in their order.
    /// Which of `steps` are applied here, as the Applied and Fence RPCs answer it, with
    /// the range of steps applied.
    fn applied_of(&self, steps: &[u64]) -> AppliedReply {
        let applied = self.steps();
        AppliedReply {
            applied: steps.iter().map(|&s| applied.contains(s)).collect(),
            shard_digest: String::new(),
            applied_low: applied.low(),
            applied_end: applied.end(),
        }
    }

    fn steps(&self) -> MutexGuard<'_, AppliedSteps> {
        self.steps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes this shard's record of applied steps in place, adopts `epoch`, and wakes
    /// the waiting pulls and pushes. Returns how many steps are applied.
    fn publish(&self, epoch: u64, change: impl FnOnce(&mut AppliedSteps)) -> u64 {
        let mut steps = self.steps();
        change(&mut steps);
        let (low, count) = (steps.low(), steps.count());
        drop(steps);
        self.metrics.set("ftrec_applied_steps", count as f64);
        self.live.send_replace(Live {
            epoch,
            applied: low,
        });
        count
    }

    /// Deterministic mode: waits (bounded) until every step below `target` is applied.
    /// Whether `target` itself is applied already is the caller's question.
    async fn wait_applied(&self, epoch: u64, target: u64) -> Result<(), PsError> {
        let mut rx = self.live.subscribe();
        let waited = tokio::time::timeout(
            self.job.timeout(),
            rx.wait_for(|l| l.epoch != epoch || l.applied >= target),
        )
        .await;
        let live = match waited {
            Ok(Ok(l)) => *l,
            Ok(Err(_)) => return Err(PsError::Unavailable("server shutting down".into())),
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
        Ok(())
    }
}

/// Runs a server until the coordinator stops it or becomes unreachable.
pub async fn run(opts: ServerOptions) -> Result<(), PsError> {
    let job = opts.job;
    let layout = job.layout()?;
    let cluster = job.config.cluster.clone();
    let network = job.network().clone();
    let (incoming, address) = network.bind(&opts.host, 0).await?;
    let label = opts.id.map_or("spare".to_string(), |i| i.to_string());
    let metrics = Arc::new(server_metrics(&label));
    let metrics_address = metrics::start(&network, &opts.host, metrics.clone())
        .await
        .unwrap_or_default();
    let locator = Locator::start(&job, &opts.coordinator).await?;
    let coordinator = locator.link(job.connector()?).await?;
    let joined = coordinator
        .client()?
        .join(JoinRequest {
            role: Role::Server as i32,
            id: opts.id.unwrap_or(0) as u32,
            address: address.clone(),
            fingerprint: job.fingerprint(),
            pid: network.pid(),
            metrics_address,
            spare: opts.id.is_none(),
        })
        .await
        .map_err(|s| PsError::rpc(format!("joining coordinator {}", coordinator.address()), &s))?
        .into_inner();
    let heartbeat = Duration::from_millis(cluster.heartbeat_ms);
    let (id, reserve) = match opts.id {
        Some(id) => (id, rebuild::reserve::Reserve::default()),
        None => {
            tracing::info!("spare server at {address} waiting for a slot");
            let c = &job.config;
            let building =
                (c.cluster.ft.erasure_coded() && c.ec.spare_reserve && !network.is_simulated())
                    .then(|| {
                        Ok::<_, PsError>(rebuild::reserve::SpareReserve::start(
                            c.model_config()?,
                            layout,
                        ))
                    })
                    .transpose()?;
            let id = wait_for_assignment(&coordinator, joined.spare_token, heartbeat, &job).await?;
            (id, building.map(|b| b.take()).unwrap_or_default())
        }
    };
    tracing::info!("server {id} at {address}, epoch {}", joined.epoch);
    let c = &job.config;
    let model = c.model_config()?;
    let (seed, host_layout) = (c.seed, layout);
    // Building a large shard takes longer than the failure timeout: heartbeat (not yet
    // ready) meanwhile, or the coordinator would declare the newcomer dead.
    let beats = job.heartbeat_client(&locator).await?;
    let starting = tokio::spawn(ftrec_rpc::client::keep_alive(
        beats.clone(),
        HeartbeatRequest {
            role: Role::Server as i32,
            id: id as u32,
            epoch: 0,
            spare: false,
            ready: false,
            incarnation: joined.incarnation,
            ..Default::default()
        },
        heartbeat,
    ));
    // An erasure-coded slot taken after a failure (or by a spare) is rebuilt from the
    // survivors before it serves: generating the initial tables would be wasted time.
    let replacement = c.cluster.ft.erasure_coded() && (joined.replacement || opts.id.is_none());
    let shard = network
        .blocking(move || {
            if replacement {
                Shard::awaiting_rebuild(&model, seed, host_layout, id)
            } else {
                Shard::initial(&model, seed, host_layout, id)
            }
        })
        .await;
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
    let checkpointer = checkpoints::SharedCheckpointer::default();
    let tracking = Arc::new(checkpoints::Tracking::new(checkpointer.clone()));
    let mut pre_commit: Vec<Arc<dyn PreCommit>> = Vec::new();
    let erasure_coded = c.cluster.ft.erasure_coded();
    let ec_state = erasure_coded.then(ec::EcState::default);
    let mut peers = None;
    if let Some(stripes) = layout.stripes() {
        let shared_peers = Arc::new(ec::Peers::new(
            coordinator.clone(),
            job.connector_for(job.deadlines().step)?,
        ));
        peers = Some(shared_peers.clone());
        let codec = ftrec_ec::Codec::new(stripes.params.k, stripes.params.r)
            .map_err(|e| PsError::Config(e.to_string()))?;
        pre_commit.push(Arc::new(ec::ParityPropagator {
            id,
            stripes,
            codec: Arc::new(codec),
            two_phase: c.ec.two_phase_commit,
            peers: shared_peers,
            epoch: live.subscribe(),
            fence: ec_state
                .as_ref()
                .map(ec::EcState::fence_watch)
                .unwrap_or_else(|| watch::channel(0).1),
        }));
    }
    let priority = priority::PriorityState::for_job(&job, &shard, id);
    let mut post_commit: Vec<Arc<dyn PostCommit>> = vec![tracking];
    if let Some(p) = &priority {
        post_commit.push(Arc::new(priority::PriorityTracking(p.clone())));
    }
    // The bulk stream is plain TCP: not over a simulated network, not for a job with TLS.
    let use_bulk = layout.stripes().is_some()
        && job.config.ec.rebuild_transport == ftrec_config::RebuildTransport::Bulk
        && !network.is_simulated()
        && job.tls().is_none();
    // Only an uncapped rebuild goes first; a capped one is meant to be spread out.
    let boost = (use_bulk && job.config.ec.rebuild_bytes_per_sec == 0)
        .then(|| rebuild::boost::RebuildBoost::new(job.config.ec.rebuild_nice))
        .flatten();
    let (bulk, bulk_client) = if use_bulk {
        let stall = job.deadlines().rebuild_stall;
        (
            Some(bulk::BulkServer::start(&opts.host, stall, boost.clone()).await?),
            Some(Arc::new(bulk::BulkClient::new(stall))),
        )
    } else {
        (None, None)
    };
    let core = Arc::new(Core {
        commit_turn: Arc::new(tokio::sync::Mutex::new(())),
        ec: ec_state,
        pre_commit,
        post_commit,
        checkpointer,
        own_save: Mutex::default(),
        priority,
        job: job.clone(),
        layout,
        id,
        shard: RwLock::new(shard),
        steps: Mutex::new(AppliedSteps::default()),
        live,
        checkpoints,
        writer: std::sync::Mutex::new(None),
        metrics,
        stop: stop.clone(),
        faults: opts.faults.clone(),
        peers,
        bulk,
        bulk_client,
        boost,
        background: Mutex::new(None),
        background_ids: std::sync::atomic::AtomicU64::new(0),
        incarnation: joined.incarnation,
        reserve: Mutex::new(reserve),
    });
    if let Some(bulk) = &core.bulk {
        let source: std::sync::Weak<dyn bulk::RangeSource> = Arc::downgrade(&core) as _;
        bulk.serve_from(source);
    }
    let service = tonic::service::interceptor::InterceptedService::new(
        ParameterServerServer::new(service::Service(core.clone()))
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX),
        CountServed {
            check: job.secret().checker(),
            metrics: core.metrics.clone(),
        },
    );
    let serve_stop = stop.clone();
    let mut builder = ftrec_rpc::auth::server_builder(&job)?;
    let serving = tokio::spawn(async move {
        builder
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, async move { serve_stop.notified().await })
            .await
    });
    heartbeat_loop(&beats, core, heartbeat, give_up(&job)).await?;
    stop.notify_waiters();
    let _ = tokio::time::timeout(Duration::from_secs(2), serving).await;
    Ok(())
}

async fn wait_for_assignment(
    coordinator: &CoordinatorLink,
    token: u32,
    period: Duration,
    job: &Job,
) -> Result<usize, PsError> {
    let mut silent_since = Instant::now();
    // A spare asks often: how soon it hears of its slot bounds how soon a failed
    // server's slot serves again.
    let period = period.min(Duration::from_millis(20));
    loop {
        tokio::time::sleep(period).await;
        let Ok(mut client) = coordinator.client() else {
            continue;
        };
        match client
            .heartbeat(HeartbeatRequest {
                role: Role::Server as i32,
                id: token,
                epoch: 0,
                spare: true,
                ready: false,
                incarnation: u64::from(token),
                ..Default::default()
            })
            .await
        {
            Ok(r) => {
                let r = r.into_inner();
                if r.stop {
                    return Err(PsError::Stopped("while a spare".into()));
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

/// How long a server keeps trying a coordinator that does not answer: ten failure
/// timeouts (at least 5 s), and with etcd three lease TTLs, so a standby has time to take
/// over before the servers give up.
fn give_up(job: &Job) -> Duration {
    let c = &job.config.cluster;
    let mut patience = Duration::from_millis(c.failure_timeout_ms * 10).max(Duration::from_secs(5));
    if job.etcd_options().is_some() {
        patience = patience.max(Duration::from_secs(3 * c.etcd_lease_ttl_s));
    }
    patience
}

/// Heartbeats until the coordinator says stop, a Shutdown RPC arrives, or the coordinator
/// has been unreachable for ten failure timeouts (so no server outlives its cluster).
async fn heartbeat_loop(
    beats: &ftrec_rpc::client::HeartbeatClient,
    core: Arc<Core>,
    period: Duration,
    give_up: Duration,
) -> Result<(), PsError> {
    let mut last_ok = Instant::now();
    // The first beat goes at once: a replacement's "ready" starts the recovery.
    let mut wait = Duration::ZERO;
    loop {
        tokio::select! {
            _ = core.stop.notified() => return Ok(()),
            _ = tokio::time::sleep(wait) => {}
        }
        wait = period;
        let reply = beats
            .beat(HeartbeatRequest {
                role: Role::Server as i32,
                id: core.id as u32,
                epoch: core.live().epoch,
                spare: false,
                ready: true,
                incarnation: core.incarnation,
                rpcs_served: core.metrics.get("ftrec_rpcs_served_total"),
                rpc_bytes_served: core.metrics.get("ftrec_rpc_bytes_in_total")
                    + core.metrics.get("ftrec_rpc_bytes_out_total"),
            })
            .await;
        match reply.map_err(|s| PsError::rpc("heartbeat", &s)) {
            Ok(r) if r.get_ref().stop => return Ok(()),
            Ok(_) => last_ok = Instant::now(),
            Err(e @ PsError::Fenced(_)) => {
                return Err(PsError::Fenced(format!(
                    "the coordinator removed this server ({e})"
                )));
            }
            Err(e) if last_ok.elapsed() > give_up => {
                return Err(PsError::Unavailable(format!(
                    "coordinator unreachable; exiting: {e}"
                )));
            }
            Err(_) => {}
        }
    }
}
