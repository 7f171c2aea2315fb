//! `ftrec worker`: a stateless worker. For each step the coordinator grants it reads that
//! batch, de-duplicates ids, pulls the unique rows and the dense parameters from every
//! server, computes gradients and pushes each server its part.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ftrec_data::Dataset;
use ftrec_model::{Batch, Dlrm, GemmMatMul, ModelConfig};
use futures::future::join_all;
use rayon::ThreadPool;

use crate::PsError;
use crate::client::{
    CoordinatorClient, ServerClient, connect_coordinator, keep_alive, server_client,
};
use crate::job::{Job, Schedule};
use crate::metrics::{self, Metrics};
use crate::placement::Layout;
use crate::proto::next_step_reply::Action;
use crate::proto::*;
use crate::wire::{extend_f32s, f32s_to_bytes, u32s_to_bytes};

pub struct WorkerOptions {
    pub job: Job,
    pub id: usize,
    pub coordinator: String,
}

/// What happened to one granted step.
enum Outcome {
    Finished(u64),
    Lost(u64),
}

struct Worker {
    job: Job,
    id: usize,
    rt: tokio::runtime::Runtime,
    coordinator: CoordinatorClient,
    servers: Vec<ServerClient>,
    placement_version: u64,
    layout: Layout,
    config: ModelConfig,
    data: Dataset,
    schedule: Schedule,
    table_rows: Vec<u32>,
    model: Dlrm,
    pool: ThreadPool,
    batch: Batch,
    dense: Vec<f32>,
    rpc_bytes: u64,
    times: StepTimes,
    metrics: Arc<Metrics>,
}

/// Where a worker's time goes, logged when it stops.
#[derive(Clone, Copy, Debug, Default)]
struct StepTimes {
    steps: u64,
    coordinator: f64,
    pull: f64,
    compute: f64,
    push: f64,
}

pub fn run(opts: WorkerOptions) -> Result<(), PsError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|error| PsError::Io {
            path: "tokio runtime".into(),
            error,
        })?;
    let job = opts.job;
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
    let model = Dlrm::new(
        &config,
        batch_size,
        threads,
        Box::new(GemmMatMul::new(threads)),
    )?;
    let metrics = Arc::new(
        Metrics::new(format!("role=\"worker\",id=\"{}\"", opts.id))
            .counter("ftrec_steps_total", "Steps finished")
            .counter("ftrec_lost_steps_total", "Steps lost to server errors")
            .counter("ftrec_rpc_bytes_total", "Pull and push payload bytes"),
    );
    let metrics_address = rt
        .block_on(metrics::start("127.0.0.1", metrics.clone()))
        .unwrap_or_default();
    let mut coordinator = rt.block_on(connect_coordinator(&opts.coordinator, job.timeout()))?;
    let joined = rt
        .block_on(coordinator.join(JoinRequest {
            role: Role::Worker as i32,
            id: opts.id as u32,
            address: String::new(),
            fingerprint: job.fingerprint(),
            pid: std::process::id(),
            metrics_address,
            spare: false,
        }))
        .map_err(|s| PsError::rpc(format!("worker {} joining", opts.id), &s))?
        .into_inner();
    tracing::info!("worker {} joined in epoch {}", opts.id, joined.epoch);
    let heartbeats = rt.spawn(keep_alive(
        coordinator.clone(),
        HeartbeatRequest {
            role: Role::Worker as i32,
            id: opts.id as u32,
            epoch: 0,
            spare: false,
            ready: true,
        },
        Duration::from_millis(job.config.cluster.heartbeat_ms),
    ));
    let mut worker = Worker {
        layout: job.layout()?,
        schedule: Schedule {
            samples: data.len() as u64,
            batch_size: batch_size as u64,
        },
        table_rows: config.table_rows.iter().map(|&r| r as u32).collect(),
        batch: Batch::with_tables(config.tables()),
        job,
        id: opts.id,
        rt,
        coordinator,
        servers: Vec::new(),
        placement_version: 0,
        config,
        data,
        model,
        pool,
        dense: Vec::new(),
        rpc_bytes: 0,
        times: StepTimes::default(),
        metrics,
    };
    let result = worker.run();
    heartbeats.abort();
    result
}

impl Worker {
    fn run(&mut self) -> Result<(), PsError> {
        let mut report: Option<Outcome> = None;
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
            };
            let asked = Instant::now();
            let reply = self
                .rt
                .block_on(self.coordinator.clone().next_step(request));
            self.times.coordinator += asked.elapsed().as_secs_f64();
            let reply = match reply {
                Ok(r) => r.into_inner(),
                Err(s) => {
                    let since = *unreachable_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > self.job.timeout() {
                        return Err(PsError::rpc("coordinator unreachable", &s));
                    }
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            unreachable_since = None;
            report = None;
            self.rpc_bytes = 0;
            match reply.action() {
                Action::Train => {
                    epoch = reply.epoch;
                    if reply.placement_version != self.placement_version {
                        self.refresh_placement()?;
                    }
                    let bytes_before = self.rpc_bytes;
                    let outcome = self.step(reply.step, reply.epoch);
                    self.metrics
                        .add("ftrec_rpc_bytes_total", self.rpc_bytes - bytes_before);
                    report = Some(match outcome {
                        Ok(()) => {
                            self.metrics.add("ftrec_steps_total", 1);
                            Outcome::Finished(reply.step)
                        }
                        Err(e) => {
                            self.metrics.add("ftrec_lost_steps_total", 1);
                            tracing::warn!("worker {}: step {} lost: {e}", self.id, reply.step);
                            Outcome::Lost(reply.step)
                        }
                    });
                }
                Action::Wait | Action::Unspecified => {
                    epoch = reply.epoch;
                    std::thread::sleep(Duration::from_millis(reply.wait_ms.max(1) as u64));
                }
                Action::Stop => {
                    let t = self.times;
                    let per = |x: f64| 1e3 * x / t.steps.max(1) as f64;
                    tracing::info!(
                        "worker {}: {} steps; per step: coordinator {:.2} ms, pull {:.2} ms, compute {:.2} ms, push {:.2} ms",
                        self.id,
                        t.steps,
                        per(t.coordinator),
                        per(t.pull),
                        per(t.compute),
                        per(t.push)
                    );
                    return Ok(());
                }
            }
        }
    }

    fn refresh_placement(&mut self) -> Result<(), PsError> {
        let p = self
            .rt
            .block_on(self.coordinator.placement(PlacementRequest {}))
            .map_err(|s| PsError::rpc("placement", &s))?
            .into_inner();
        let timeout = self.job.timeout();
        // Lazy channels spawn their connection task on the current runtime.
        let _runtime = self.rt.enter();
        self.servers = p
            .servers
            .iter()
            .map(|a| server_client(a, timeout))
            .collect::<Result<_, _>>()?;
        self.placement_version = p.version;
        Ok(())
    }

    /// One granted step: pull, compute, push. Any server error loses the step.
    fn step(&mut self, step: u64, epoch: u64) -> Result<(), PsError> {
        let started = Instant::now();
        let (position, count) = self.schedule.batch(step);
        self.data.fill_batch(
            position as usize,
            count as usize,
            &self.table_rows,
            &mut self.batch,
        )?;
        let (model, batch) = (&mut self.model, &self.batch);
        self.pool.install(|| model.prepare(batch))?;
        let servers = self.layout.servers;
        let tables = self.config.tables();
        let dim = self.config.dim;
        // Unique rows of each table split by owner, kept ascending.
        let mut owned: Vec<Vec<Vec<u32>>> = vec![vec![Vec::new(); tables]; servers];
        for t in 0..tables {
            for &row in self.model.unique_rows(t) {
                owned[self.layout.server_of(t, row)][t].push(row);
            }
        }
        let wait_applied = self.job.config.cluster.deterministic.then_some(step);
        let requests: Vec<PullRequest> = owned
            .iter()
            .map(|rows| PullRequest {
                epoch,
                wait_applied,
                tables: rows
                    .iter()
                    .enumerate()
                    .map(|(t, r)| TableRows {
                        table: t as u32,
                        rows: u32s_to_bytes(r),
                    })
                    .collect(),
            })
            .collect();
        self.rpc_bytes += requests
            .iter()
            .flat_map(|r| &r.tables)
            .map(|t| t.rows.len() as u64)
            .sum::<u64>();
        let pulls = requests
            .into_iter()
            .zip(&self.servers)
            .map(|(request, client)| {
                let mut client = client.clone();
                async move { client.pull(request).await }
            });
        let pull_started = Instant::now();
        let replies = self.rt.block_on(join_all(pulls));
        let pulled = pull_started.elapsed().as_secs_f64();
        self.times.pull += pulled;
        let mut decoded: Vec<Vec<Vec<f32>>> = Vec::with_capacity(servers);
        self.dense.clear();
        for (s, reply) in replies.into_iter().enumerate() {
            let reply = reply
                .map_err(|st| PsError::rpc(format!("pull from server {s}"), &st))?
                .into_inner();
            if reply.embeddings.len() != tables {
                return Err(PsError::Request(format!(
                    "server {s} answered {} tables of {tables}",
                    reply.embeddings.len()
                )));
            }
            let mut per_table = Vec::with_capacity(tables);
            for (t, e) in reply.embeddings.iter().enumerate() {
                self.rpc_bytes += e.len() as u64;
                let mut v = Vec::with_capacity(owned[s][t].len() * dim);
                extend_f32s(&mut v, e, "pulled embeddings")?;
                if v.len() != owned[s][t].len() * dim {
                    return Err(PsError::Request(format!(
                        "server {s} sent {} values for {} rows of table {t}",
                        v.len(),
                        owned[s][t].len()
                    )));
                }
                per_table.push(v);
            }
            decoded.push(per_table);
            self.rpc_bytes += reply.dense.len() as u64;
            extend_f32s(&mut self.dense, &reply.dense, "pulled dense parameters")?;
        }
        let mut cursor = vec![0usize; servers];
        let mut unique = Vec::new();
        for t in 0..tables {
            cursor.fill(0);
            unique.clear();
            unique.extend_from_slice(self.model.unique_rows(t));
            let pulled = self.model.pulled_mut(t);
            pulled.clear();
            for &row in &unique {
                let s = self.layout.server_of(t, row);
                let at = cursor[s];
                let from_server: &[Vec<f32>] = &decoded[s];
                pulled.extend_from_slice(&from_server[t][at * dim..(at + 1) * dim]);
                cursor[s] += 1;
            }
        }
        let (model, batch, dense) = (&mut self.model, &self.batch, &self.dense);
        self.pool.install(|| model.forward_backward(dense, batch));
        let grads = self.model.gradients();
        let mut pushes: Vec<PushRequest> = (0..servers)
            .map(|s| {
                let range = self.layout.dense_range(s, grads.dense.len());
                PushRequest {
                    epoch,
                    step,
                    tables: Vec::with_capacity(tables),
                    dense: f32s_to_bytes(&grads.dense[range]),
                }
            })
            .collect();
        let mut grads_by_server: Vec<Vec<f32>> = vec![Vec::new(); servers];
        for t in 0..tables {
            for g in &mut grads_by_server {
                g.clear();
            }
            for (i, &row) in self.model.unique_rows(t).iter().enumerate() {
                let s = self.layout.server_of(t, row);
                grads_by_server[s].extend_from_slice(&grads.sparse[t][i * dim..(i + 1) * dim]);
            }
            for ((push, rows), grads) in pushes.iter_mut().zip(&owned).zip(&grads_by_server) {
                push.tables.push(TableGrads {
                    table: t as u32,
                    rows: u32s_to_bytes(&rows[t]),
                    grads: f32s_to_bytes(grads),
                });
            }
        }
        self.rpc_bytes += pushes
            .iter()
            .map(|p| {
                p.dense.len() as u64
                    + p.tables
                        .iter()
                        .map(|t| (t.rows.len() + t.grads.len()) as u64)
                        .sum::<u64>()
            })
            .sum::<u64>();
        let push_started = Instant::now();
        let sends = pushes.into_iter().zip(&self.servers).map(|(p, c)| {
            let mut c = c.clone();
            async move { c.push(p).await }
        });
        for (s, r) in self.rt.block_on(join_all(sends)).into_iter().enumerate() {
            r.map_err(|st| PsError::rpc(format!("push to server {s}"), &st))?;
        }
        let pushed = push_started.elapsed().as_secs_f64();
        self.times.push += pushed;
        self.times.compute += started.elapsed().as_secs_f64() - pushed - pulled;
        self.times.steps += 1;
        Ok(())
    }
}
