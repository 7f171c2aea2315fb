//! `ftrec server`: one parameter server process. It joins the coordinator (or waits as a
//! spare until it is given a slot), builds or restores its shard, serves pulls and pushes
//! over gRPC and heartbeats until told to stop.
//!
//! Files: this one runs the process and holds its state (`Core`), the composition of three
//! parts, each with its own invariants: the update pipeline (`pipeline/state.rs`), the
//! rebuild context (`rebuild/context.rs`) and the checkpoint context
//! (`checkpoints/context.rs`). `start.rs` builds them from the job and the coordinator's
//! answer; `service.rs` answers the RPCs.

mod bulk;
mod checkpoints;
mod degraded;
mod ec;
mod pipeline;
mod rebuild;
pub mod resume;
mod service;
pub mod shard;
mod start;
#[cfg(test)]
mod test_core;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::Notify;

use crate::checkpoints::CheckpointContext;
use crate::pipeline::UpdatePipeline;
use crate::rebuild::RebuildContext;
use ftrec_proto::placement::Layout;
use ftrec_proto::proto::*;
use ftrec_rpc::PsError;
use ftrec_rpc::job::Job;
use ftrec_rpc::leader::{CoordinatorLink, Locator};
use ftrec_rpc::metrics::Metrics;

pub struct ServerOptions {
    pub job: Job,
    /// The server slot; `None` starts a spare that waits to be assigned one.
    pub id: Option<usize>,
    /// Where the coordinator is: an address, or the job's leader in etcd.
    pub coordinator: ftrec_rpc::leader::CoordinatorSource,
    /// Host to listen on (port chosen by the OS).
    pub host: String,
    /// This server's fault points (tests, `cluster run --kill server:J@commit:N`).
    pub faults: ftrec_faults::Faults,
    /// A spare: the live server that started it on its host while a lost slot waited
    /// (`HeartbeatReply.start_spare`); the coordinator hands the slot it takes to a spare
    /// from elsewhere once one joins.
    pub hosted_by: Option<usize>,
    /// How this server starts a spare on its host when the coordinator asks; `None`
    /// refuses (the request is logged).
    pub start_spare: Option<StartSpare>,
}

/// Starts a spare server of this job beside this one, given this server's slot; returns
/// what to log about it (its pid and log file). The binary builds it from its own command
/// line; a simulation starts a spare in its own world.
pub type StartSpare = Arc<dyn Fn(usize) -> Result<String, PsError> + Send + Sync>;

/// The server's state: what identifies it, shared by every part, and the parts by role.
/// A module takes the part it needs (checkpoint code a [`CheckpointContext`] and the
/// pipeline it reads the shard from); what spans roles (a rebuild installs a shard and
/// continues the checkpoint history) is a method here.
struct Core {
    job: Job,
    layout: Layout,
    id: usize,
    /// This process's incarnation of its slot (`JoinReply.incarnation`), sent with every
    /// heartbeat so the coordinator refuses it once a newer process holds the slot.
    incarnation: u64,
    /// Where this process serves (its join's address), sent with every heartbeat: a new
    /// leader whose record never saw the join adopts the process by it.
    address: String,
    metrics: Arc<Metrics>,
    stop: Arc<Notify>,
    /// Fault points armed for this member (`ftrec-faults`).
    faults: ftrec_faults::Faults,
    /// The shard and every update's way to it.
    pipeline: UpdatePipeline,
    /// Peers, bulk transport, reserve and the background rebuild.
    rebuilding: RebuildContext,
    /// Checkpoint location, writer lease, strategy, own saves and priority trackers.
    ckpt: CheckpointContext,
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
            "ftrec_hedged_calls_total",
            "Parity updates sent again on a second connection after going unanswered",
        )
        .counter(
            "ftrec_duplicate_pushes_total",
            "Pushes of a step applied already (a dead worker's step granted again), ignored",
        )
        .gauge("ftrec_epoch", "Cluster epoch")
        .gauge("ftrec_applied_steps", "Global steps applied to this shard")
}

impl Core {
    /// Deterministic mode: waits (bounded by the job's timeout) until every step below
    /// `target` is applied.
    async fn wait_applied(&self, epoch: u64, target: u64) -> Result<(), PsError> {
        self.pipeline
            .wait_applied(epoch, target, self.job.timeout(), self.id)
            .await
    }
}

/// Runs a server until the coordinator stops it or becomes unreachable.
pub async fn run(opts: ServerOptions) -> Result<(), PsError> {
    let started = start::start(opts).await?;
    started.serve().await
}

/// A spare's slot, with the job's layout as it is when the slot is given.
struct Assignment {
    slot: usize,
    servers: u32,
    resume: Option<ResumePoint>,
}

async fn wait_for_assignment(
    coordinator: &CoordinatorLink,
    (token, address): (u32, &str),
    period: Duration,
    job: &Job,
) -> Result<Assignment, PsError> {
    let mut silent_since = Instant::now();
    // A spare asks often: how soon it hears of its slot bounds how soon a failed
    // server's slot serves again.
    let period = period.min(Duration::from_millis(20));
    // A spare holds nothing yet: with etcd it waits out `cluster.control_plane_grace_s`
    // for a control plane that may come back (an etcd outage, a failover), else the
    // control deadline of the one coordinator there is.
    let patience = match job.etcd_options() {
        Some(_) => Duration::from_secs(job.config.cluster.control_plane_grace_s),
        None => job.timeout(),
    };
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
                address: address.to_string(),
                pid: job.network().pid(),
                peak_rss_bytes: own_peak_rss_bytes(),
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
                    return Ok(Assignment {
                        slot: slot as usize,
                        servers: r.servers,
                        resume: r.resume,
                    });
                }
                silent_since = Instant::now();
            }
            Err(s) if silent_since.elapsed() > patience => {
                return Err(PsError::rpc("coordinator unreachable", &s));
            }
            Err(_) => {}
        }
    }
}

/// What a server does while no coordinator answers its heartbeats.
pub(crate) enum WhenCutOff {
    /// Embedded membership: the one coordinator was the job's control plane, and no
    /// standby can come; once it has been silent this long, the job is gone and the server
    /// exits (so no server outlives its cluster).
    GiveUp(Duration),
    /// etcd membership: a standby or an operator may bring the control plane back (an
    /// etcd outage, a failover). The shard this server holds is not whole anywhere else,
    /// so it never exits on a timeout: it waits until etcd records the job's end, or an
    /// operator stops it, and says so every minute (issue 42, hole 2).
    HoldOn(Box<Locator>),
}

/// How often a server cut off from the control plane says so, and asks etcd whether the
/// job ended.
const CUT_OFF_REPORT: Duration = Duration::from_secs(60);
const CUT_OFF_CHECK: Duration = Duration::from_secs(5);

impl WhenCutOff {
    /// Embedded: ten failure timeouts (at least 5 s), time enough for a slow coordinator.
    pub(crate) fn of(job: &Job, locator: &Locator) -> Self {
        if locator.follows_etcd() {
            return Self::HoldOn(Box::new(locator.clone()));
        }
        let c = &job.config.cluster;
        Self::GiveUp(Duration::from_millis(c.failure_timeout_ms * 10).max(Duration::from_secs(5)))
    }
}

/// A server that no coordinator has answered since `last_ok`: whether it exits now.
/// `next_report` and `next_check` pace what it says and asks.
struct CutOff {
    next_report: Duration,
    next_check: Duration,
}

impl CutOff {
    fn new() -> Self {
        Self {
            next_report: CUT_OFF_REPORT,
            next_check: CUT_OFF_CHECK,
        }
    }

    async fn exit_now(
        &mut self,
        when: &WhenCutOff,
        silent: Duration,
        id: usize,
        error: &PsError,
    ) -> Result<bool, PsError> {
        let locator = match when {
            WhenCutOff::GiveUp(after) if silent > *after => {
                return Err(PsError::Unavailable(format!(
                    "coordinator unreachable; exiting: {error}"
                )));
            }
            WhenCutOff::GiveUp(_) => return Ok(false),
            WhenCutOff::HoldOn(locator) => locator,
        };
        if silent >= self.next_check {
            self.next_check = silent + CUT_OFF_CHECK;
            if let Some(why) = locator.job_ended().await {
                tracing::info!("server {id}: the job is over ({why}); exiting");
                return Ok(true);
            }
        }
        if silent >= self.next_report {
            self.next_report = silent + CUT_OFF_REPORT;
            tracing::warn!(
                "server {id}: no coordinator has answered for {:.0} s ({error}). This server \
                 holds shard {id}, which no other member or checkpoint has whole: it keeps \
                 waiting until etcd records the job's end, or an operator stops it",
                silent.as_secs_f64()
            );
        }
        Ok(false)
    }
}

/// Heartbeats until the coordinator says stop, a Shutdown RPC arrives, or the control
/// plane is gone for good (see [`WhenCutOff`]).
async fn heartbeat_loop(
    beats: &ftrec_rpc::client::HeartbeatClient,
    core: Arc<Core>,
    period: Duration,
    when_cut_off: WhenCutOff,
    start_spare: Option<StartSpare>,
) -> Result<(), PsError> {
    let mut last_ok = Instant::now();
    let mut cut_off = CutOff::new();
    // The coordinator says "start a spare" on every beat until that spare joins: one
    // spare per `SPARE_ASK_PATIENCE`.
    let mut spare_started: Option<Instant> = None;
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
                epoch: core.pipeline.live().epoch,
                spare: false,
                ready: true,
                incarnation: core.incarnation,
                rpcs_served: core.metrics.get("ftrec_rpcs_served_total"),
                rpc_bytes_served: core.metrics.get("ftrec_rpc_bytes_in_total")
                    + core.metrics.get("ftrec_rpc_bytes_out_total"),
                address: core.address.clone(),
                pid: core.job.network().pid(),
                // Only a waiting spare says what standing by costs.
                peak_rss_bytes: 0,
            })
            .await;
        match reply.map_err(|s| PsError::rpc("heartbeat", &s)) {
            Ok(r) if r.get_ref().stop => return Ok(()),
            Ok(r) => {
                last_ok = Instant::now();
                cut_off = CutOff::new();
                if r.get_ref().start_spare
                    && spare_started.is_none_or(|t| t.elapsed() >= ftrec_rpc::SPARE_ASK_PATIENCE)
                {
                    spare_started = Some(Instant::now());
                    start_spare_here(start_spare.as_ref(), core.id);
                }
            }
            Err(e @ PsError::Fenced(_)) => {
                return Err(PsError::Fenced(format!(
                    "the coordinator removed this server ({e})"
                )));
            }
            Err(e) => {
                if cut_off
                    .exit_now(&when_cut_off, last_ok.elapsed(), core.id, &e)
                    .await?
                {
                    return Ok(());
                }
            }
        }
    }
}

/// The coordinator asked this server to start a spare on its host: a lost slot has no
/// replacement coming (issue 42, hole 8). The coordinator asks again, or asks another
/// server, if no spare joins; so a failure here is only logged.
fn start_spare_here(start_spare: Option<&StartSpare>, id: usize) {
    match start_spare.map(|start| start(id)) {
        Some(Ok(what)) => tracing::warn!(
            "server {id}: started a spare on this host for a lost slot with no replacement \
             ({what}); this host holds two shards until a replacement joins elsewhere"
        ),
        Some(Err(e)) => tracing::warn!("server {id}: could not start a spare on this host: {e}"),
        None => tracing::warn!(
            "server {id}: the coordinator asked for a spare on this host, and this server \
             was started without a way to start one"
        ),
    }
}

/// This process's peak resident set (Linux `VmHWM`), 0 where it cannot be read.
fn own_peak_rss_bytes() -> u64 {
    ftrec_rpc::metrics::peak_rss_bytes("self").unwrap_or(0)
}

#[cfg(test)]
mod peak_rss_tests {
    /// A process has a peak resident set on Linux: the spare's report is not 0 there.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_process_reads_its_own_peak_resident_set() {
        let peak = super::own_peak_rss_bytes();
        assert!(peak > 1 << 20, "VmHWM of a test process: {peak} bytes");
    }
}
