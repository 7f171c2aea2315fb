//! The in-process cluster: the real coordinator, servers and workers as hosts of one
//! turmoil simulation, their tonic channels over its simulated TCP, a seeded fault
//! schedule (crashes, restarts, latency) applied between ticks, and at the end of every
//! run the invariants of its `--ft` mode checked (`check.rs`).
//!
//! A seed fixes everything the simulation drives: the schedule, message latencies, the
//! order hosts run in, and time (tokio's clock, which turmoil advances). On those paths
//! members use `tokio::time::Instant`, and work they would hand to tokio's blocking pool
//! runs inline (`ftrec_rpc::network::Network`). What stays outside the seed:
//! - the job secret (random bytes; it changes no decision);
//! - tokio's own choice among `select!` branches that are ready at once (seeded only in
//!   a `tokio_unstable` build);
//! - wall-clock time read inside `ftrec-ckpt` (lease ages and checkpoint timings: a
//!   checkpoint's recorded duration, never a decision in these short runs);
//! - the checkpoint strategies that work in background threads (DECK's stager, IncrCP's
//!   worker): the schedules use `full`, which writes in the caller's turn;
//! - rayon's thread pools: the compute and checkpoint encoding run on them, blocking the
//!   simulation's thread until done, so their results (bit-exact in deterministic mode)
//!   enter the simulation at one point.
//!
//! One more thing reaches across simulations, and is handled: tokio numbers tasks from one
//! counter per process, and a torn-down runtime (a crashed or bounced host) shuts its
//! tasks down in an order that depends on their ids, which orders the dying host's last
//! messages. Each run starts the counter at the same residue, and simulations in a process
//! take turns, so a seed replays the same whether run alone or after others in the suite.
//! Two runs of a seed produce the same coordinator timeline, event for event and time for
//! time; a test asserts it, in every mode.

mod check;
mod cluster;
mod control;
mod control_schedule;
pub mod processes;
mod schedule;
mod transport;

use std::path::{Path, PathBuf};

use ftrec_config::{FaultTolerance, JobConfig};

pub use check::{Violation, check, check_control};
pub use cluster::{COORDINATOR, Outcome, RunOptions, run};
pub use control::{
    COORDINATORS, ControlOutcome, ControlRun, ETCD, Grant, coordinator_host, etcd_membership,
    run_control,
};
pub use control_schedule::{
    ControlFault, ControlSchedule, CoordinatorPoint, WorkerKill, WorkerPoint,
};
pub use schedule::{Event, Fault, Member, Schedule};
pub use transport::TurmoilTransport;

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("the job: {0}")]
    Job(ftrec_rpc::PsError),
    #[error("the simulation: {0}")]
    Simulation(String),
    #[error("the dataset: {0}")]
    Data(String),
    #[error("the reference run: {0}")]
    Reference(String),
}

/// Servers and workers of a simulated cluster.
pub const SERVERS: usize = 3;
pub const WORKERS: usize = 2;

/// Samples of the dataset that simulated runs train on.
const DATASET_ROWS: u64 = 6_000;

/// Writes the dataset the simulated runs train on into `dir`.
pub fn generate_dataset(dir: &Path) -> Result<(), SimError> {
    let mut config = ftrec_data::generate::GenConfig::criteo(DATASET_ROWS, 7, 0.001);
    config.test_fraction = 0.05;
    ftrec_data::generate::generate(
        &config,
        dir,
        ftrec_data::generate::OutputFormat::Binary,
        |_| {},
    )
    .map(|_| ())
    .map_err(|e| SimError::Data(format!("{}: {e}", dir.display())))
}

/// The `micro` job under `mode`, deterministic, on the dataset in `data`, with its
/// checkpoints (modes that take them) under `checkpoints`.
pub fn job_config(
    mode: FaultTolerance,
    data: &Path,
    checkpoints: &Path,
    steps: u64,
) -> Result<JobConfig, SimError> {
    let mut c = JobConfig::preset("micro").map_err(|e| SimError::Job(e.into()))?;
    c.threads = 1;
    c.data.dir = Some(data.to_path_buf());
    c.train.steps = steps;
    c.train.eval_samples = 0;
    let cluster = &mut c.cluster;
    cluster.servers = SERVERS;
    cluster.workers = WORKERS;
    cluster.ft = mode;
    cluster.deterministic = true;
    cluster.heartbeat_ms = 50;
    cluster.failure_timeout_ms = 400;
    cluster.rpc_timeout_ms = Some(5_000);
    if mode.checkpoints() {
        c.checkpoint.dir = Some(PathBuf::from(checkpoints));
        c.checkpoint.every_steps = 10;
    }
    if mode == FaultTolerance::Partial {
        c.cpr.target_pls = 0.1;
    }
    c.validate().map_err(|e| SimError::Job(e.into()))?;
    Ok(c)
}

/// The digest of `ftrec train` on `config` (one process, no cluster): what every exact
/// mode must end with.
pub fn reference_digest(config: &JobConfig) -> Result<String, SimError> {
    let mut c = config.clone();
    c.checkpoint.dir = None;
    c.checkpoint.every_steps = 0;
    let reference = |e: &dyn std::fmt::Display| SimError::Reference(e.to_string());
    let data_dir = c.data.dir.clone().unwrap_or_default();
    let data = ftrec_data::Dataset::open(&data_dir.join(ftrec_data::TRAIN_FILE))
        .map_err(|e| reference(&e))?;
    let mut trainer = ftrec_train::Trainer::new(&c).map_err(|e| reference(&e))?;
    trainer
        .train(&data, c.train.steps, |_| {})
        .map_err(|e| reference(&e))?;
    Ok(trainer.digest().to_string())
}

/// `FTREC_SIM_LOG=FILTER` (a tracing filter, `info` say) shows the simulated members' logs
/// in a test's output; without it, nothing is logged.
pub fn logs_from_env() {
    if let Ok(filter) = std::env::var("FTREC_SIM_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    }
}
