//! A server process's start, step by step: join the coordinator, take a slot (a spare
//! waits for one), build the shard while heartbeating "not ready", assemble the parts of
//! [`Core`], then serve until stopped. The steps run in this order, and each builds only
//! what it names.

use std::sync::Arc;
use std::time::Duration;

use ftrec_ckpt::{Checkpoints, open_store};
use tokio::sync::{Notify, watch};

use crate::checkpoints::CheckpointContext;
use crate::checkpoints::priority::PriorityState;
use crate::ec::EcState;
use crate::pipeline::UpdatePipeline;
use crate::rebuild::RebuildContext;
use crate::rebuild::boost::RebuildBoost;
use crate::rebuild::reserve::{Reserve, SpareReserve};
use crate::resume::ResumeSource;
use crate::shard::Shard;
use crate::{Core, CountServed, ServerOptions, WhenCutOff, bulk, ec, heartbeat_loop};
use ftrec_proto::applied::AppliedSteps;
use ftrec_proto::placement::Layout;
use ftrec_proto::proto::parameter_server_server::ParameterServerServer;
use ftrec_proto::proto::*;
use ftrec_rpc::PsError;
use ftrec_rpc::client::HeartbeatClient;
use ftrec_rpc::job::Job;
use ftrec_rpc::leader::{CoordinatorLink, Locator};
use ftrec_rpc::metrics::{self, Metrics};
use ftrec_rpc::network::Incoming;

/// A server assembled and listening, about to serve.
pub(crate) struct Started {
    core: Arc<Core>,
    incoming: Incoming,
    beats: HeartbeatClient,
    heartbeat: Duration,
    when_cut_off: WhenCutOff,
    start_spare: Option<crate::StartSpare>,
}

/// Everything up to serving: joined, in its slot, its parts built.
pub(crate) async fn start(opts: ServerOptions) -> Result<Started, PsError> {
    let job = opts.job.clone();
    let layout = job.layout()?;
    let network = job.network().clone();
    let (incoming, address) = job.bind(&opts.host, 0).await?;
    let label = opts.id.map_or("spare".to_string(), |i| i.to_string());
    let metrics = Arc::new(crate::server_metrics(&label));
    let metrics_address = metrics::start(&network, &opts.host, metrics.clone())
        .await
        .unwrap_or_default();
    let locator = Locator::start(&job, &opts.coordinator).await?;
    let coordinator = locator.link(job.connector()?).await?;
    let mut joined = join(
        &coordinator,
        &job,
        (opts.id, opts.hosted_by),
        &address,
        metrics_address,
    )
    .await?;
    let heartbeat = Duration::from_millis(job.config.cluster.heartbeat_ms);
    let (id, reserve) = take_slot(
        &job,
        layout,
        &coordinator,
        &mut joined,
        opts.id,
        heartbeat,
        &address,
    )
    .await?;
    // The layout the job runs on now: a move (`cluster scale`) or a resume may have left
    // the count the job file names.
    let layout = match joined.servers {
        0 => layout,
        n => job.layout_for(n as usize)?,
    };
    tracing::info!("server {id} at {address}, epoch {}", joined.epoch);
    let slot = Slot {
        job: &job,
        layout,
        id,
        joined: &joined,
        address: &address,
    };
    if joined.resume.is_some() && opts.faults.kill_at(ftrec_faults::points::LOAD, None) {
        std::future::pending::<()>().await;
    }
    let (shard, own_part, beats) = slot
        .build_shard(&locator, opts.id.is_none(), heartbeat)
        .await?;
    let core = slot
        .assemble(shard, &opts, &coordinator, metrics, reserve)
        .await?;
    core.ckpt.continue_from_part(own_part);
    Ok(Started {
        core: Arc::new(core),
        incoming,
        beats,
        heartbeat,
        when_cut_off: WhenCutOff::of(&job, &locator),
        start_spare: opts.start_spare.clone(),
    })
}

async fn join(
    coordinator: &CoordinatorLink,
    job: &Job,
    (id, hosted_by): (Option<usize>, Option<usize>),
    address: &str,
    metrics_address: String,
) -> Result<JoinReply, PsError> {
    Ok(coordinator
        .client()?
        .join(JoinRequest {
            role: Role::Server as i32,
            id: id.unwrap_or(0) as u32,
            address: address.to_string(),
            fingerprint: job.fingerprint(),
            pid: job.network().pid(),
            metrics_address,
            spare: id.is_none(),
            hosted_by: hosted_by.map(|j| j as u32),
        })
        .await
        .map_err(|s| PsError::rpc(format!("joining coordinator {}", coordinator.address()), &s))?
        .into_inner())
}

/// The slot this process serves: `id` as started, or, for a spare, the one the
/// coordinator assigns it, with the reserve it built while it waited.
async fn take_slot(
    job: &Job,
    layout: Layout,
    coordinator: &CoordinatorLink,
    joined: &mut JoinReply,
    id: Option<usize>,
    heartbeat: Duration,
    address: &str,
) -> Result<(usize, Reserve), PsError> {
    if let Some(id) = id {
        return Ok((id, Reserve::default()));
    }
    tracing::info!("spare server at {address} waiting for a slot");
    let c = &job.config;
    let building =
        (c.cluster.ft.erasure_coded() && c.ec.spare_reserve && !job.network().is_simulated())
            .then(|| Ok::<_, PsError>(SpareReserve::start(c.model_config()?, layout)))
            .transpose()?;
    let given =
        crate::wait_for_assignment(coordinator, (joined.spare_token, address), heartbeat, job)
            .await?;
    if given.servers != 0 {
        joined.servers = given.servers;
        joined.resume = given.resume;
    }
    Ok((given.slot, building.map(|b| b.take()).unwrap_or_default()))
}

/// The slot taken, and what the coordinator said when this process joined.
struct Slot<'a> {
    job: &'a Job,
    layout: Layout,
    id: usize,
    joined: &'a JoinReply,
    /// Where this process serves, as its join said.
    address: &'a str,
}

impl Slot<'_> {
    /// The slot's shard, built while heartbeating "not ready" (building a large shard
    /// takes longer than the failure timeout, and the coordinator would declare the
    /// newcomer dead), and the heartbeat client that goes on afterwards.
    async fn build_shard(
        &self,
        locator: &Locator,
        spare: bool,
        heartbeat: Duration,
    ) -> Result<(Shard, Option<String>, HeartbeatClient), PsError> {
        let (job, id) = (self.job, self.id);
        let c = &job.config;
        let model = c.model_config()?;
        let (seed, host_layout) = (c.seed, self.layout);
        let beats = job.heartbeat_client(locator).await?;
        let starting = tokio::spawn(ftrec_rpc::client::keep_alive(
            beats.clone(),
            HeartbeatRequest {
                role: Role::Server as i32,
                id: id as u32,
                epoch: 0,
                spare: false,
                ready: false,
                incarnation: self.joined.incarnation,
                address: self.address.to_string(),
                pid: job.network().pid(),
                ..Default::default()
            },
            heartbeat,
        ));
        // An erasure-coded slot taken after a failure (or by a spare) is rebuilt from the
        // survivors before it serves: generating the initial tables would be wasted time.
        let replacement = c.cluster.ft.erasure_coded() && (self.joined.replacement || spare);
        let resume = self.resume();
        let own_location = checkpoint_location_name(job, id);
        let shard = job
            .network()
            .blocking(move || {
                if replacement {
                    Ok((
                        Shard::awaiting_rebuild(&model, seed, host_layout, id)?,
                        None,
                    ))
                } else {
                    crate::resume::starting_shard(
                        &model,
                        seed,
                        host_layout,
                        id,
                        resume.as_ref(),
                        own_location.as_deref(),
                    )
                }
            })
            .await;
        starting.abort();
        let (shard, own_part) = shard??;
        Ok((shard, own_part, beats))
    }

    /// The cut the coordinator says this job resumes from.
    fn resume(&self) -> Option<ResumeSource> {
        self.joined.resume.as_ref().map(ResumeSource::from_proto)
    }

    /// The parts of [`Core`], around `shard`.
    async fn assemble(
        &self,
        shard: Shard,
        opts: &ServerOptions,
        coordinator: &CoordinatorLink,
        metrics: Arc<Metrics>,
        reserve: Reserve,
    ) -> Result<Core, PsError> {
        let (job, layout, id) = (self.job, self.layout, self.id);
        let location = checkpoint_location(job, id)?;
        let priority = PriorityState::for_job(job, &shard, id);
        let ckpt =
            CheckpointContext::new(job.clone(), id, layout, location, priority, self.resume());
        let mut pipeline = UpdatePipeline::new(
            shard,
            self.joined.epoch,
            job.config.cluster.ft.erasure_coded(),
            metrics.clone(),
            opts.faults.clone(),
        );
        // A resumed job's steps below its cut are in the shard already.
        let first_step = ckpt.first_step();
        pipeline.publish(self.joined.epoch, |steps| {
            *steps = AppliedSteps::from_parts(first_step, Vec::new())
        });
        let peers = self.add_parity_propagator(&mut pipeline, coordinator, metrics.clone())?;
        for observer in ckpt.observers() {
            pipeline.add_post_commit(observer);
        }
        let rebuilding = rebuild_context(job, layout, &opts.host, peers, reserve).await?;
        Ok(Core {
            job: job.clone(),
            layout,
            id,
            incarnation: self.joined.incarnation,
            address: self.address.to_string(),
            metrics,
            stop: Arc::new(Notify::new()),
            faults: opts.faults.clone(),
            pipeline,
            rebuilding,
            ckpt,
        })
    }

    /// Erasure coding: the pre-commit observer that sends each update's differences to
    /// their parity holders, and the peer clients it sends through (shared with degraded
    /// reads and rebuilds). `None` without erasure coding.
    fn add_parity_propagator(
        &self,
        pipeline: &mut UpdatePipeline,
        coordinator: &CoordinatorLink,
        metrics: Arc<Metrics>,
    ) -> Result<Option<Arc<ec::Peers>>, PsError> {
        let Some(stripes) = self.layout.stripes() else {
            return Ok(None);
        };
        let job = self.job;
        let peers = Arc::new(ec::Peers::new(
            coordinator.clone(),
            job.connector_for(job.deadlines().step)?,
            job.deadlines().hedge,
            metrics,
        ));
        let codec = ftrec_ec::Codec::new(stripes.params.k, stripes.params.r)
            .map_err(|e| PsError::Config(e.to_string()))?;
        let fence = pipeline
            .ec_state()
            .map(EcState::fence_watch)
            .unwrap_or_else(|| watch::channel(0).1);
        let propagator = ec::ParityPropagator {
            id: self.id,
            stripes,
            codec: Arc::new(codec),
            two_phase: job.config.ec.two_phase_commit,
            peers: peers.clone(),
            epoch: pipeline.live_watch(),
            fence,
        };
        pipeline.add_pre_commit(Arc::new(propagator));
        Ok(Some(peers))
    }
}

/// The shard's checkpoint location, if the job keeps checkpoints.
fn checkpoint_location(job: &Job, id: usize) -> Result<Option<Checkpoints>, PsError> {
    match checkpoint_location_name(job, id) {
        Some(location) => Ok(Some(
            Checkpoints::new(open_store(&location)?).with_quant(job.config.checkpoint.quant()),
        )),
        None => Ok(None),
    }
}

fn checkpoint_location_name(job: &Job, id: usize) -> Option<String> {
    job.config.checkpoint.dir.as_ref().map(|dir| {
        format!(
            "{}/server-{id}",
            dir.to_string_lossy().trim_end_matches('/')
        )
    })
}

/// The rebuild context: the bulk transport where it can run, and the boost.
async fn rebuild_context(
    job: &Job,
    layout: Layout,
    host: &str,
    peers: Option<Arc<ec::Peers>>,
    reserve: Reserve,
) -> Result<RebuildContext, PsError> {
    // The bulk stream is plain TCP: not over a simulated network, not for a job with TLS.
    let use_bulk = layout.stripes().is_some()
        && job.config.ec.rebuild_transport == ftrec_config::RebuildTransport::Bulk
        && !job.network().is_simulated()
        && job.tls().is_none();
    // Only an uncapped rebuild goes first; a capped one is meant to be spread out.
    let boost = (use_bulk && job.config.ec.rebuild_bytes_per_sec == 0)
        .then(|| RebuildBoost::new(job.config.ec.rebuild_nice))
        .flatten();
    let (bulk, bulk_client) = if use_bulk {
        let stall = job.deadlines().rebuild_stall;
        (
            Some(bulk::BulkServer::start(host, stall, boost.clone()).await?),
            Some(Arc::new(bulk::BulkClient::new(stall))),
        )
    } else {
        (None, None)
    };
    Ok(RebuildContext::new(
        peers,
        bulk,
        bulk_client,
        boost,
        reserve,
    ))
}

impl Started {
    /// Serves the RPCs (and the bulk port) and heartbeats until the coordinator says stop,
    /// a Shutdown RPC arrives, or the coordinator is gone for good.
    pub(crate) async fn serve(self) -> Result<(), PsError> {
        let Self {
            core,
            incoming,
            beats,
            heartbeat,
            when_cut_off,
            start_spare,
        } = self;
        if let Some(bulk) = &core.rebuilding.bulk {
            let source: std::sync::Weak<dyn bulk::RangeSource> = Arc::downgrade(&core) as _;
            bulk.serve_from(source);
        }
        let job = core.job.clone();
        let service = tonic::service::interceptor::InterceptedService::new(
            ParameterServerServer::new(crate::service::Service(core.clone()))
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX),
            CountServed {
                check: job.secret().checker(),
                metrics: core.metrics.clone(),
            },
        );
        let stop = core.stop.clone();
        let serve_stop = stop.clone();
        let mut builder = ftrec_rpc::auth::server_builder(&job)?;
        let serving = tokio::spawn(async move {
            builder
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async move { serve_stop.notified().await })
                .await
        });
        let metrics = core.metrics.clone();
        heartbeat_loop(&beats, core, heartbeat, when_cut_off, start_spare).await?;
        stop.notify_waiters();
        tracing::info!(
            "parity updates sent again to a peer: {}",
            metrics.get("ftrec_hedged_calls_total")
        );
        let _ = tokio::time::timeout(Duration::from_secs(2), serving).await;
        Ok(())
    }
}
