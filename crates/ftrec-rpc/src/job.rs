//! The job every process of a cluster runs: one [`JobConfig`] written by the launcher,
//! read by each server and worker, and fingerprinted so a process started with another
//! configuration is refused when it joins. The job also carries what admits a process to
//! the cluster: the job secret and, optionally, TLS material (`auth.rs`).

use std::path::Path;

use ftrec_config::{JobConfig, MemoryPart, parts_fit_in_memory};
use ftrec_data::{Dataset, TRAIN_FILE};

use crate::PsError;
use crate::auth::{JobSecret, TlsMaterial};
use crate::client::{Connector, HeartbeatClient};
use crate::network::Network;
use ftrec_proto::placement::Layout;

/// The file name a generated secret is saved under, beside the job file.
pub const SECRET_FILE: &str = "job.secret";

#[derive(Clone, Debug)]
pub struct Job {
    pub config: JobConfig,
    secret: JobSecret,
    /// The secret was made for this job (not configured): `save` writes it.
    generated: bool,
    tls: Option<TlsMaterial>,
    network: Network,
}

impl Job {
    /// The job as a launcher creates it: the configured secret, or a new one.
    pub fn new(mut config: JobConfig) -> Result<Self, PsError> {
        Self::checked(&config)?;
        // The job file is read from the run directory: paths given relative to where the
        // launcher was started must not change meaning there.
        let s = &mut config.security;
        for path in [
            &mut s.secret_file,
            &mut s.tls_cert,
            &mut s.tls_key,
            &mut s.tls_ca,
        ]
        .into_iter()
        .flatten()
        {
            if path.is_relative() {
                *path = std::path::absolute(&*path).map_err(|error| PsError::Io {
                    path: path.display().to_string(),
                    error,
                })?;
            }
        }
        let configured = JobSecret::configured(&config, None)?;
        let tls = TlsMaterial::configured(&config, None)?;
        Ok(Self {
            generated: configured.is_none(),
            secret: configured.unwrap_or_else(JobSecret::generate),
            config,
            tls,
            network: Network::default(),
        })
    }

    fn checked(config: &JobConfig) -> Result<(), PsError> {
        config.validate()?;
        if config.data.dir.is_none() {
            return Err(PsError::Config(
                "data.dir: a cluster job needs a dataset (--data DIR)".into(),
            ));
        }
        let ck = &config.checkpoint;
        if config.cluster.ft == ftrec_config::FaultTolerance::Partial {
            // Without checkpoints a partial restore would silently reset the lost shard to
            // its initial state while everyone else trains on.
            let takes_cuts = ck.every_steps > 0 || config.cpr.mtbf_seconds.is_some();
            if ck.dir.is_none() || matches!(ck.strategy, Some(None)) || !takes_cuts {
                return Err(PsError::Config(
                    "cluster.ft = \"partial\" reloads a lost shard from its checkpoint: it \
                     needs checkpoint.dir, a checkpoint.strategy other than \"none\", and \
                     checkpoint.every_steps > 0 or cpr.mtbf_seconds"
                        .into(),
                ));
            }
            // Prioritised saves are deltas on the newest checkpoint; with full cuts (the
            // paper's baseline) nothing else writes deltas that a save could interleave with.
            if config.cpr.priority != ftrec_config::CprPriority::None
                && ck.effective_strategy() != Some(ftrec_config::Strategy::Full)
            {
                return Err(PsError::Config(format!(
                    "cpr.priority = \"{}\" saves its rows as deltas between full cuts: it \
                     needs checkpoint.strategy = \"full\"",
                    config.cpr.priority.name()
                )));
            }
            // Each server's saves stand alone: no cut for a full-recovery fallback, no
            // deltas layered across servers' saves, no background commit to confirm.
            if config.cpr.uncoordinated
                && (config.cpr.priority != ftrec_config::CprPriority::None
                    || ck.effective_strategy() != Some(ftrec_config::Strategy::Full))
            {
                return Err(PsError::Config(
                    "cpr.uncoordinated saves each shard on its own as a full checkpoint: it \
                     needs checkpoint.strategy = \"full\" and cpr.priority = \"none\""
                        .into(),
                ));
            }
        } else if config.cpr.uncoordinated {
            return Err(PsError::Config(format!(
                "cpr.uncoordinated is partial recovery's (each shard restores from its own \
                 save): it needs cluster.ft = \"partial\", not \"{}\"",
                config.cluster.ft.name()
            )));
        }
        Ok(())
    }

    /// The job a member process was started with; it must carry a secret.
    pub fn load(path: &Path) -> Result<Self, PsError> {
        let config = JobConfig::load(None, Some(path), &[])?;
        Self::checked(&config)?;
        let dir = path.parent();
        let secret = JobSecret::configured(&config, dir)?.ok_or_else(|| {
            PsError::Config(format!(
                "{}: no job secret (set {} or security.secret_file): the cluster admits \
                 only its own job's processes",
                path.display(),
                ftrec_config::SECRET_ENV
            ))
        })?;
        let tls = TlsMaterial::configured(&config, dir)?;
        Ok(Self {
            config,
            secret,
            generated: false,
            tls,
            network: Network::default(),
        })
    }

    /// Writes the job file, and a generated secret beside it (readable by its owner only),
    /// so that the processes started with this file join.
    pub fn save(&self, path: &Path) -> Result<(), PsError> {
        let mut config = self.config.clone();
        if self.generated {
            let dir = path.parent().unwrap_or(Path::new("."));
            self.secret.write(&dir.join(SECRET_FILE))?;
            config.security.secret_file = Some(SECRET_FILE.into());
        }
        let text = toml::to_string(&config)
            .map_err(|e| PsError::Config(format!("cannot serialise the job: {e}")))?;
        Ok(ftrec_fsio::write_atomic(path, text.as_bytes())?)
    }

    /// xxh3 of the configuration, ignoring what may differ per process (thread counts,
    /// where each host keeps the secret and certificates).
    pub fn fingerprint(&self) -> u64 {
        let mut c = self.config.clone();
        c.threads = 0;
        c.security = Default::default();
        // Each process may reach etcd through endpoints of its own (`--etcd`).
        c.cluster.etcd_endpoints.clear();
        let json = serde_json::to_vec(&c).unwrap_or_default();
        xxhash_rust::xxh3::xxh3_64(&json)
    }

    /// With `cluster.membership = "etcd"`: where the job's keys are, and how long one etcd
    /// call may take (the control plane's deadline).
    pub fn etcd_options(&self) -> Option<ftrec_etcd::EtcdOptions> {
        let c = &self.config.cluster;
        (c.membership == ftrec_config::Membership::Etcd).then(|| ftrec_etcd::EtcdOptions {
            endpoints: c.etcd_endpoints.clone(),
            prefix: self.etcd_prefix(),
            request_timeout: self
                .deadlines()
                .control
                .min(std::time::Duration::from_secs(c.etcd_lease_ttl_s)),
        })
    }

    /// `cluster.etcd_prefix`, or `/ftrec/JOB_ID`.
    pub fn etcd_prefix(&self) -> String {
        self.config
            .cluster
            .etcd_prefix
            .clone()
            .unwrap_or_else(|| format!("/ftrec/{}", self.secret.job_id()))
    }

    /// What the job's etcd prefix must hold: this job's id and configuration.
    pub fn etcd_claim(&self) -> ftrec_etcd::JobClaim {
        ftrec_etcd::JobClaim {
            job_id: self.secret.job_id(),
            fingerprint: format!("{:016x}", self.fingerprint()),
        }
    }

    /// The same job reaching etcd through `endpoints` (`--etcd URL,...`), which also
    /// selects etcd membership.
    pub fn with_etcd(mut self, endpoints: Vec<String>) -> Self {
        self.config.cluster.membership = ftrec_config::Membership::Etcd;
        self.config.cluster.etcd_endpoints = endpoints;
        self
    }

    /// How this process calls the others: the job's timeout, secret and TLS, and how its
    /// connections notice a silent peer.
    pub fn connector(&self) -> Result<Connector, PsError> {
        Ok(Connector::new(
            self.timeout(),
            &self.secret,
            self.tls.as_ref(),
            self.network.clone(),
        )?
        .with_liveness(self.liveness()))
    }

    /// How this job's connections notice a silent peer (`cluster.failure_timeout_ms`,
    /// `cluster.deadlines.stream_progress_ms`).
    pub fn liveness(&self) -> crate::client::Liveness {
        crate::client::Liveness::of(&self.deadlines())
    }

    /// Listens for this job's RPCs on `host:port` (port 0: any) through its network; see
    /// [`Network::bind`].
    pub async fn bind(
        &self,
        host: &str,
        port: u16,
    ) -> Result<(crate::network::Incoming, String), PsError> {
        let mut liveness = self.liveness();
        if self.tls.is_some() {
            // tonic puts TLS over these connections: no byte may be added in its stream.
            liveness.tail_probes = 0;
        }
        self.network.bind(host, port, liveness).await
    }

    /// Heartbeats' own clients: two connections of their own (see [`HeartbeatClient`]),
    /// never queued behind other calls, and each beat bounded by the failure timeout (a
    /// beat that takes longer cannot keep anyone alive anyway).
    pub async fn heartbeat_client(
        &self,
        coordinator: &crate::leader::Locator,
    ) -> Result<HeartbeatClient, PsError> {
        let connector = self.connector_for(self.deadlines().heartbeat)?;
        Ok(HeartbeatClient::new(
            coordinator.link(connector.clone()).await?,
            coordinator.link(connector).await?,
        ))
    }

    /// The network this member's listeners and channels use.
    pub fn network(&self) -> &Network {
        &self.network
    }

    /// The same job over another network (a simulated one, in `ftrec-sim`).
    pub fn with_network(self, network: Network) -> Self {
        Self { network, ..self }
    }

    pub fn secret(&self) -> &JobSecret {
        &self.secret
    }

    pub fn tls(&self) -> Option<&TlsMaterial> {
        self.tls.as_ref()
    }

    /// The placement arithmetic: striped with rotating parity when rows are erasure
    /// coded, row-modulo otherwise.
    pub fn layout(&self) -> Result<Layout, PsError> {
        self.layout_for(self.config.cluster.servers)
    }

    /// The same placement scheme over `servers` servers: the layout a job runs on after
    /// `ftrec cluster scale` (or a resume) moved it from the count its file names.
    pub fn layout_for(&self, servers: usize) -> Result<Layout, PsError> {
        if self.config.cluster.ft.erasure_coded() {
            let stripes = ftrec_ec::StripeLayout::new(self.config.ec.params(), servers)
                .map_err(|e| PsError::Config(format!("{servers} servers: {e}")))?;
            return Ok(
                Layout::striped(stripes).with_replicated_dense(self.config.dense_replicated())
            );
        }
        Ok(Layout::new(servers)?)
    }

    /// What server `id` holds (the largest server's share for a spare, which may be given
    /// any slot): its rows of every table with their optimizer state, under erasure coding
    /// its parity rows and the dense replica it keeps, and the dense model, which a shard
    /// holds at full size and builds from a second full copy.
    pub fn server_memory(&self, id: Option<usize>) -> Result<Vec<MemoryPart>, PsError> {
        let c = &self.config;
        let model = c.model_config()?;
        let layout = self.layout()?;
        let servers = layout.servers();
        let ids = match id {
            Some(id) if id < servers => id..id + 1,
            Some(id) => {
                return Err(PsError::Config(format!(
                    "--id {id}: the job has {servers} servers (0..={})",
                    servers - 1
                )));
            }
            None => 0..servers,
        };
        let row_bytes = model.row_stride() as u128 * 4;
        let state_per_word = model.dense_optimizer.dense_state_len(1).unwrap_or(2) as u128;
        let dense_words = model.dense_words();
        let dense_bytes = |words: u128| words * (1 + state_per_word) * 4;
        let share = |server: usize| {
            let rows: u128 = model
                .table_rows
                .iter()
                .enumerate()
                .map(|(t, &rows)| layout.local_rows(t, server, rows) as u128)
                .sum();
            let parity: u128 = model
                .table_rows
                .iter()
                .map(|&rows| layout.parity_rows(server, rows) as u128)
                .sum();
            let replica = layout.replicates(server).map_or(0, |of| {
                dense_words * (of as u128 + 1) / servers as u128
                    - dense_words * of as u128 / servers as u128
            });
            (
                rows * row_bytes,
                parity * row_bytes,
                dense_bytes(2 * dense_words + replica),
            )
        };
        // The largest share, part by part (a spare must fit whichever slot it is given).
        let (rows, parity, dense) = ids
            .map(share)
            .fold((0, 0, 0), |a, b| (a.0.max(b.0), a.1.max(b.1), a.2.max(b.2)));
        let mut parts = vec![MemoryPart::new(
            rows,
            "server's rows of the embedding tables",
            format!(
                "{}, or spread the rows over more servers (cluster.servers = {servers})",
                c.table_keys()
            ),
        )];
        if layout.stripes().is_some() {
            parts.push(MemoryPart::new(
                parity,
                "parity rows",
                format!(
                    "ec.r = {} (parity rows per stripe of ec.k = {} rows), or {}",
                    c.ec.r,
                    c.ec.k,
                    c.table_keys()
                ),
            ));
        }
        parts.push(MemoryPart::new(
            dense,
            "dense parameters and optimizer state",
            format!(
                "model.bottom = {:?} and model.top = {:?}",
                c.model.bottom, c.model.top
            ),
        ));
        Ok(parts)
    }

    /// What a worker holds: no tables, but the dense model, the activations of a batch and
    /// the rows it pulls for it.
    pub fn worker_memory(&self) -> Result<Vec<MemoryPart>, PsError> {
        let c = &self.config;
        let e = c.memory_estimate()?;
        Ok(vec![
            MemoryPart::new(e.bottom, "bottom MLP", c.bottom_keys()),
            MemoryPart::new(e.top, "top MLP", c.top_keys()),
            MemoryPart::new(e.batch, "per-batch buffers and pulled rows", c.batch_keys()),
        ])
    }

    /// Each server slot's bytes ([`Self::server_memory`] summed), in slot order.
    pub fn server_bytes(&self) -> Result<Vec<u128>, PsError> {
        (0..self.config.cluster.servers)
            .map(|id| Ok(self.server_memory(Some(id))?.iter().map(|p| p.bytes).sum()))
            .collect()
    }

    /// Refuses to start server `id` (a spare: `None`) that this host cannot hold, before
    /// it allocates anything or joins the cluster.
    pub fn check_server_memory(&self, id: Option<usize>) -> Result<(), PsError> {
        let subject = match id {
            Some(id) => format!("server {id} of this job"),
            None => "a spare server of this job".to_string(),
        };
        // A slot past the job file's count is one of a layout the job moved to (`cluster
        // scale`): sized as the largest share of the file's layout, as a spare is; the
        // coordinator's layout is known only at the join.
        let id = id.filter(|&id| id < self.config.cluster.servers);
        let parts = self.server_memory(id)?;
        match self.config.cluster.server_memory_bytes {
            0 => Ok(parts_fit_in_memory(&subject, &parts)?),
            budget => {
                let available = ftrec_config::available_memory().map_or(budget, |a| a.min(budget));
                let subject = format!("{subject} (cluster.server_memory_bytes = {budget})");
                Ok(ftrec_config::check_parts(&subject, &parts, 0, available)?)
            }
        }
    }

    /// Refuses to start a worker this host cannot hold.
    pub fn check_worker_memory(&self) -> Result<(), PsError> {
        Ok(parts_fit_in_memory(
            "a worker of this job",
            &self.worker_memory()?,
        )?)
    }

    pub fn train_data(&self) -> Result<Dataset, PsError> {
        let dir = self
            .config
            .data
            .dir
            .as_deref()
            .ok_or_else(|| PsError::Config("data.dir is not set".into()))?;
        Ok(Dataset::open_split(dir, TRAIN_FILE)?)
    }

    /// The control plane's deadline (`cluster.rpc_timeout_ms`), and the bound on waits
    /// that have no deadline of their own.
    pub fn timeout(&self) -> std::time::Duration {
        self.deadlines().control
    }

    /// Every deadline of the job, per kind of call.
    pub fn deadlines(&self) -> ftrec_config::Deadlines {
        self.config.cluster.deadlines()
    }

    /// How this process calls the others for one kind of work: the connector bounded by
    /// that kind's deadline.
    pub fn connector_for(&self, deadline: std::time::Duration) -> Result<Connector, PsError> {
        Ok(self.connector()?.with_timeout(deadline))
    }
}

/// The global batch schedule: batch `step` is the samples a single-process trainer reads at
/// that step (the last batch of an epoch may be short).
#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    pub samples: u64,
    pub batch_size: u64,
}

impl Schedule {
    pub fn batches_per_epoch(&self) -> u64 {
        self.samples.div_ceil(self.batch_size)
    }

    /// `(position, count)` of batch `step`.
    pub fn batch(&self, step: u64) -> (u64, u64) {
        let position = (step % self.batches_per_epoch()) * self.batch_size;
        (position, self.batch_size.min(self.samples - position))
    }

    pub fn samples_before(&self, step: u64) -> u64 {
        let per_epoch = self.batches_per_epoch();
        let (position, _) = self.batch(step);
        (step / per_epoch) * self.samples + position
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_matches_the_trainer_walk() {
        let s = Schedule {
            samples: 1000,
            batch_size: 128,
        };
        let (mut position, mut total) = (0u64, 0u64);
        for step in 0..30 {
            let n = (s.samples - position).min(s.batch_size);
            assert_eq!(s.batch(step), (position, n), "step {step}");
            assert_eq!(s.samples_before(step), total);
            total += n;
            position += n;
            if position == s.samples {
                position = 0;
            }
        }
    }

    /// A server whose share exceeds its budget refuses to start, naming the key; a spare
    /// is held to the same budget; with room it starts.
    #[test]
    fn a_server_over_its_memory_budget_refuses_to_start_by_the_key() {
        let job = |budget: u64| {
            let set = [
                "data.dir=\"/data\"".to_string(),
                "cluster.servers=3".to_string(),
                "cluster.ft=\"ec\"".to_string(),
                format!("cluster.server_memory_bytes={budget}"),
            ];
            Job::new(JobConfig::load(Some("tiny"), None, &set).unwrap()).unwrap()
        };
        let share: u128 = job(0)
            .server_memory(Some(1))
            .unwrap()
            .iter()
            .map(|p| p.bytes)
            .sum();
        let tight = job(share as u64 - 1);
        for id in [Some(1), None] {
            let e = tight.check_server_memory(id).unwrap_err().to_string();
            assert!(e.contains("cluster.server_memory_bytes"), "{e}");
            assert!(e.contains("parity rows"), "{e}");
        }
        job(share as u64 * 2).check_server_memory(Some(1)).unwrap();
    }
}
