//! `ftrec worker`: a stateless worker. For each step the coordinator grants it reads that
//! batch, de-duplicates ids, pulls the unique rows and the dense parameters from every
//! server, computes gradients and pushes each server its part.

mod routed;
pub mod shard_client;
pub mod suspicion;

use ftrec_rpc::leader::{CoordinatorLink, CoordinatorSource, Locator};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use ftrec_data::Dataset;
use ftrec_model::{Batch, Dlrm, GemmMatMul, ModelConfig};
use rayon::ThreadPool;

use crate::shard_client::{CommitProtocol, ShardClient};
use ftrec_proto::proto::next_step_reply::Action;
use ftrec_proto::proto::*;
use ftrec_rpc::PsError;
use ftrec_rpc::job::{Job, Schedule};
use ftrec_rpc::metrics::{self, Metrics};

pub struct WorkerOptions {
    pub job: Job,
    pub id: usize,
    /// Where the coordinator is: an address, or the job's leader in etcd.
    pub coordinator: CoordinatorSource,
    /// This worker's fault points (`ftrec_faults::points::PUSH`, `PREPARED`).
    pub faults: ftrec_faults::Faults,
}

/// What happened to one granted step.
enum Outcome {
    Finished(u64),
    Lost(u64),
}

/// Why a step was lost, as the coordinator is told.
struct Loss {
    reason: String,
    /// A server refused the step for being in this later epoch: not a failure the
    /// coordinator caused, so it must end the run rather than retry forever.
    ahead_epoch: Option<u64>,
    /// The server whose calls failed in transport (it may be cut off from this worker).
    unreachable: Option<shard_client::Unreachable>,
}

impl Loss {
    fn of(error: &PsError, granted_epoch: u64) -> Self {
        const MAX_REASON: usize = 300;
        let mut reason = error.to_string();
        if reason.len() > MAX_REASON {
            let mut end = MAX_REASON;
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            reason.truncate(end);
            reason.push_str("...");
        }
        let ahead_epoch = match error {
            PsError::StaleEpoch { current, .. } if *current > granted_epoch => Some(*current),
            _ => None,
        };
        Self {
            reason,
            ahead_epoch,
            unreachable: None,
        }
    }
}

struct Worker {
    job: Job,
    id: usize,
    coordinator: CoordinatorLink,
    shards: ShardClient,
    config: ModelConfig,
    data: Dataset,
    schedule: Schedule,
    table_rows: Vec<u32>,
    model: Dlrm,
    pool: ThreadPool,
    batch: Batch,
    rpc_bytes: u64,
    /// Calls sent again, as `ftrec_hedged_calls_total` last counted them.
    hedged_counted: u64,
    times: StepTimes,
    metrics: Arc<Metrics>,
    /// The cluster's epoch, as the coordinator's heartbeat replies tell it.
    epochs: tokio::sync::watch::Receiver<u64>,
    /// This process's incarnation of its slot (`JoinReply.incarnation`).
    incarnation: u64,
    /// The step whose gradients (and unique rows) the model holds: computed, and not
    /// overwritten by another step since. If its push failed or was abandoned and the
    /// step comes back to this worker (`NextStepReply.reuse_gradients`), they are pushed
    /// again as they are, not pulled and computed again: erasure coding keeps the state
    /// they were computed from. After a SIGKILL both workers' steps are lost in their
    /// push, and computing them again held the first step after the resume back by about
    /// 0.1 s.
    computed: Option<u64>,
}

/// Keeps the worker alive at the coordinator while it computes, and publishes the epoch
/// each reply carries. Losing the coordinator is the main loop's to notice.
async fn heartbeat(
    beats: ftrec_rpc::client::HeartbeatClient,
    id: usize,
    incarnation: u64,
    period: Duration,
    epochs: tokio::sync::watch::Sender<u64>,
) {
    loop {
        let beat = beats.beat(HeartbeatRequest {
            role: Role::Worker as i32,
            id: id as u32,
            epoch: 0,
            spare: false,
            ready: true,
            incarnation,
            ..Default::default()
        });
        if let Ok(reply) = beat.await {
            epochs.send_if_modified(|e| {
                let newer = reply.get_ref().epoch > *e;
                if newer {
                    *e = reply.get_ref().epoch;
                }
                newer
            });
        }
        tokio::time::sleep(period).await;
    }
}

/// Where a worker's time goes, logged when it stops.
#[derive(Clone, Copy, Debug, Default)]
struct StepTimes {
    steps: u64,
    coordinator: f64,
    pull: f64,
    compute: f64,
    push: f64,
    /// Steps pushed again from the gradients the model held (`Worker::computed`).
    reused: u64,
}

/// Runs a worker process: its own runtime, with one thread for heartbeats while the
/// calling thread trains.
pub fn run(opts: WorkerOptions) -> Result<(), PsError> {
    // Before any thread is started: each takes its nice value from the thread that starts
    // it.
    lower_priority(opts.job.config.cluster.worker_nice);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|error| PsError::Io {
            path: "tokio runtime".into(),
            error,
        })?;
    rt.block_on(run_async(opts))
}

/// Sets this thread's nice value to `nice` (`cluster.worker_nice`; 0 leaves it). Any
/// process may raise its own; one that cannot is said and trains on as it was.
fn lower_priority(nice: i32) {
    if nice <= 0 {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: setpriority reads its three integer arguments only; `0` names the
        // calling thread (Linux keeps nice values per thread).
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
        if rc != 0 {
            tracing::warn!(
                "cluster.worker_nice = {nice} not set: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Runs a worker on the current runtime (a simulated host, in `ftrec-sim`). The compute
/// runs on the calling task: in a simulation it takes no simulated time.
pub async fn run_async(opts: WorkerOptions) -> Result<(), PsError> {
    let job = opts.job;
    let network = job.network().clone();
    let config = job.config.model_config()?;
    let data = job.train_data()?;
    if data.num_dense() != config.num_dense || data.num_sparse() != config.tables() {
        return Err(PsError::Config(format!(
            "{} has {} dense and {} sparse features but the model expects {} and {}",
            data.path().display(),
            data.num_dense(),
            data.num_sparse(),
            config.num_dense,
            config.tables()
        )));
    }
    let threads = job.config.threads();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| PsError::Config(format!("thread pool: {e}")))?;
    let batch_size = job.config.train.batch_size;
    let model = Dlrm::new(&config, batch_size, threads, Box::new(GemmMatMul))?;
    let metrics = Arc::new(
        Metrics::new(format!("role=\"worker\",id=\"{}\"", opts.id))
            .counter("ftrec_steps_total", "Steps finished")
            .counter("ftrec_lost_steps_total", "Steps lost to server errors")
            .counter("ftrec_rpc_bytes_total", "Pull and push payload bytes")
            .counter(
                "ftrec_hedged_calls_total",
                "Step calls sent again on a second connection after going unanswered",
            ),
    );
    let metrics_address = metrics::start(&network, "127.0.0.1", metrics.clone())
        .await
        .unwrap_or_default();
    let locator = Locator::start(&job, &opts.coordinator).await?;
    let coordinator = locator.link(job.connector()?).await?;
    let joined = coordinator
        .client()?
        .join(JoinRequest {
            role: Role::Worker as i32,
            id: opts.id as u32,
            address: String::new(),
            fingerprint: job.fingerprint(),
            pid: network.pid(),
            metrics_address,
            spare: false,
            hosted_by: None,
        })
        .await
        .map_err(|s| PsError::rpc(format!("worker {} joining", opts.id), &s))?
        .into_inner();
    tracing::info!("worker {} joined in epoch {}", opts.id, joined.epoch);
    let (epochs_tx, epochs) = tokio::sync::watch::channel(joined.epoch);
    let heartbeats = tokio::spawn(heartbeat(
        job.heartbeat_client(&locator).await?,
        opts.id,
        joined.incarnation,
        Duration::from_millis(job.config.cluster.heartbeat_ms),
        epochs_tx,
    ));
    let cluster = &job.config.cluster;
    let protocol = if job.config.two_phase_commit() {
        // One step at a time in deterministic mode: prepares cannot wait on each other.
        CommitProtocol::TwoPhase {
            ordered: !cluster.deterministic,
        }
    } else {
        CommitProtocol::OneRound
    };
    let shards = ShardClient::new(
        coordinator.clone(),
        job.layout()?,
        config.dim,
        job.connector_for(job.deadlines().step)?,
    )
    .with_protocol(protocol)
    .with_faults(opts.faults.clone())
    .with_suspicion(suspicion::Suspicion::of(Duration::from_millis(
        cluster.failure_timeout_ms,
    )))
    .with_hedge(job.deadlines().hedge);
    let mut worker = Worker {
        shards,
        schedule: Schedule {
            samples: data.len() as u64,
            batch_size: batch_size as u64,
        },
        table_rows: config.table_rows.iter().map(|&r| r as u32).collect(),
        batch: Batch::with_tables(config.tables()),
        job,
        id: opts.id,
        coordinator,
        config,
        data,
        model,
        pool,
        rpc_bytes: 0,
        hedged_counted: 0,
        times: StepTimes::default(),
        metrics,
        epochs,
        incarnation: joined.incarnation,
        computed: None,
    };
    let result = worker.run().await;
    heartbeats.abort();
    result
}

impl Worker {
    /// How long the coordinator may stay unreachable before this worker gives up: the
    /// control deadline of the one coordinator there is, and with etcd
    /// `cluster.control_plane_grace_s` (a worker holds no state, but an etcd outage or a
    /// failover an operator fixes should not cost the job its workers).
    fn patience(&self) -> Duration {
        let c = &self.job.config.cluster;
        match self.job.etcd_options() {
            Some(_) => self
                .job
                .timeout()
                .max(Duration::from_secs(c.control_plane_grace_s)),
            None => self.job.timeout(),
        }
    }

    async fn run(&mut self) -> Result<(), PsError> {
        let mut report: Option<Outcome> = None;
        let mut loss: Option<Loss> = None;
        let mut epoch = 0;
        let mut unreachable_since: Option<Instant> = None;
        loop {
            let request = NextStepRequest {
                worker: self.id as u32,
                epoch,
                finished: match report {
                    Some(Outcome::Finished(s)) => Some(s),
                    _ => None,
                },
                lost: match report {
                    Some(Outcome::Lost(s)) => Some(s),
                    _ => None,
                },
                rpc_bytes: self.rpc_bytes,
                pid: self.job.network().pid(),
                lost_reason: loss.as_ref().map(|l| l.reason.clone()).unwrap_or_default(),
                ahead_epoch: loss.as_ref().and_then(|l| l.ahead_epoch),
                incarnation: self.incarnation,
                unreachable_server: loss
                    .as_ref()
                    .and_then(|l| l.unreachable)
                    .map(|u| u.server as u32),
                unreachable_confirmed: loss
                    .as_ref()
                    .and_then(|l| l.unreachable)
                    .is_some_and(|u| u.confirmed),
            };
            let asked = Instant::now();
            let reply = match self.coordinator.client() {
                Ok(mut c) => c.next_step(request).await,
                Err(e) => Err(tonic::Status::unavailable(e.to_string())),
            };
            self.times.coordinator += asked.elapsed().as_secs_f64();
            let reply = match reply.map_err(|s| PsError::rpc("next step", &s)) {
                Ok(r) => r.into_inner(),
                Err(e @ PsError::Fenced(_)) => {
                    return Err(PsError::Fenced(format!(
                        "the coordinator removed this worker ({e})"
                    )));
                }
                Err(e) => {
                    let since = *unreachable_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > self.patience() {
                        return Err(PsError::Unavailable(format!(
                            "coordinator unreachable: {e}"
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            unreachable_since = None;
            report = None;
            loss = None;
            self.rpc_bytes = 0;
            match reply.action() {
                Action::Train => {
                    epoch = reply.epoch;
                    // A new epoch fences the step (the servers refuse it now), and a server
                    // declared dead may be silent: no call of the step waits on it.
                    let mut epochs = self.epochs.clone();
                    let granted = reply.epoch;
                    self.shards.take_unreachable();
                    let outcome = tokio::select! {
                        biased;
                        outcome = self.step(reply.step, reply.epoch, reply.placement_version, reply.reuse_gradients) => outcome,
                        moved = epochs.wait_for(|e| *e > granted) => {
                            self.shards.abandon(granted, reply.step);
                            Err(PsError::StaleEpoch {
                                got: granted,
                                current: moved.map(|e| *e).unwrap_or(granted),
                            })
                        }
                    };
                    let moved = self.shards.take_bytes();
                    self.rpc_bytes += moved;
                    self.metrics.add("ftrec_rpc_bytes_total", moved);
                    let hedged = self.shards.hedges().total();
                    self.metrics
                        .add("ftrec_hedged_calls_total", hedged - self.hedged_counted);
                    self.hedged_counted = hedged;
                    report = Some(match outcome {
                        Ok(()) => {
                            self.metrics.add("ftrec_steps_total", 1);
                            Outcome::Finished(reply.step)
                        }
                        Err(e) => {
                            self.metrics.add("ftrec_lost_steps_total", 1);
                            tracing::warn!("worker {}: step {} lost: {e}", self.id, reply.step);
                            loss = Some(Loss {
                                unreachable: self.shards.take_unreachable(),
                                ..Loss::of(&e, reply.epoch)
                            });
                            Outcome::Lost(reply.step)
                        }
                    });
                }
                Action::Wait | Action::Unspecified => {
                    epoch = reply.epoch;
                    tokio::time::sleep(Duration::from_millis(reply.wait_ms.max(1) as u64)).await;
                }
                Action::Stop => {
                    let t = self.times;
                    let per = |x: f64| 1e3 * x / t.steps.max(1) as f64;
                    tracing::info!(
                        "worker {}: recent calls (median/p90/p99): {}",
                        self.id,
                        self.shards.call_times().summary()
                    );
                    tracing::info!(
                        "worker {}: {} steps ({} pushed again from kept gradients); per step: coordinator {:.2} ms, pull {:.2} ms, compute {:.2} ms, push {:.2} ms; calls sent again: {}",
                        self.id,
                        t.steps,
                        t.reused,
                        per(t.coordinator),
                        per(t.pull),
                        per(t.compute),
                        per(t.push),
                        self.shards.hedges().summary()
                    );
                    return Ok(());
                }
            }
        }
    }

    /// One granted step: pull, compute, push. An error the shard client could not get
    /// past loses the step (the coordinator then resolves it).
    async fn step(
        &mut self,
        step: u64,
        epoch: u64,
        placement_version: u64,
        reuse: bool,
    ) -> Result<(), PsError> {
        if reuse && self.computed == Some(step) {
            return self.push_computed(step, epoch, placement_version).await;
        }
        self.computed = None;
        let started = Instant::now();
        self.shards.ensure_placement(placement_version).await?;
        let (position, count) = self.schedule.batch(step);
        self.data.fill_batch(
            position as usize,
            count as usize,
            &self.table_rows,
            &mut self.batch,
        )?;
        let (model, batch) = (&mut self.model, &self.batch);
        self.pool.install(|| model.prepare(batch))?;
        let tables = self.config.tables();
        let unique: Vec<Vec<u32>> = (0..tables)
            .map(|t| self.model.unique_rows(t).to_vec())
            .collect();
        let unique: Vec<&[u32]> = unique.iter().map(Vec::as_slice).collect();
        let routed = self.shards.route(&unique);
        let wait_applied = self.job.config.cluster.deterministic.then_some(step);
        let pull_started = Instant::now();
        let pulled = self.shards.pull(epoch, wait_applied, &routed).await?;
        let pulled_seconds = pull_started.elapsed().as_secs_f64();
        self.times.pull += pulled_seconds;
        for (t, rows) in unique.iter().enumerate() {
            self.shards
                .assemble(&pulled, t, rows, self.model.pulled_mut(t));
        }
        let (model, batch, dense) = (&mut self.model, &self.batch, &pulled.dense);
        self.pool.install(|| model.forward_backward(dense, batch));
        self.computed = Some(step);
        let grads = self.model.gradients();
        let sparse: Vec<&[f32]> = grads.sparse.iter().map(Vec::as_slice).collect();
        let push_started = Instant::now();
        self.shards
            .push(epoch, step, &unique, &sparse, &grads.dense)
            .await?;
        let pushed = push_started.elapsed().as_secs_f64();
        self.times.push += pushed;
        self.times.compute += started.elapsed().as_secs_f64() - pushed - pulled_seconds;
        self.times.steps += 1;
        Ok(())
    }

    /// Pushes the gradients the model holds for `step` again, in `epoch` (see
    /// `Worker::computed`).
    async fn push_computed(
        &mut self,
        step: u64,
        epoch: u64,
        placement_version: u64,
    ) -> Result<(), PsError> {
        self.shards.ensure_placement(placement_version).await?;
        let started = Instant::now();
        let tables = self.config.tables();
        let unique: Vec<&[u32]> = (0..tables).map(|t| self.model.unique_rows(t)).collect();
        let grads = self.model.gradients();
        let sparse: Vec<&[f32]> = grads.sparse.iter().map(Vec::as_slice).collect();
        self.shards
            .push(epoch, step, &unique, &sparse, &grads.dense)
            .await?;
        self.times.push += started.elapsed().as_secs_f64();
        self.times.steps += 1;
        self.times.reused += 1;
        Ok(())
    }
}
