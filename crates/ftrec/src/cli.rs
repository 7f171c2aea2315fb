use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(name = "ftrec", version, about = "Fault-tolerant DLRM training")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train a DLRM on a dataset directory.
    Train(TrainArgs),
    /// Evaluate a saved model on a dataset's test split.
    Eval(EvalArgs),
    /// Generate, convert and inspect datasets.
    #[command(subcommand)]
    Data(DataCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Generate Criteo-shaped data, train it on a local cluster (2 servers, 2 workers) with
    /// checkpoints, SIGKILL a server mid-run, recover, and compare AUC with the teacher's.
    Demo(DemoArgs),
    /// Inspect, verify and restore checkpoints.
    #[command(subcommand)]
    Ckpt(CkptCommand),
    /// Run a parameter-server cluster on this host, or act on a running one.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// A parameter server process (started by `cluster run`, or by hand across hosts).
    Server(ServerArgs),
    /// A worker process.
    Worker(WorkerArgs),
    /// A standalone coordinator (multi-host); `cluster run` embeds one.
    Coordinator(CoordinatorArgs),
    /// Plots.
    #[command(subcommand)]
    Plot(PlotCommand),
}

#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Launch servers and workers as separate processes on loopback and train.
    Run(Box<ClusterRunArgs>),
    /// SIGKILL a member of a running cluster, e.g. `server:1`.
    Kill {
        /// The coordinator's address (printed by `cluster run`).
        #[arg(long)]
        coordinator: String,
        /// The job file (`RUN_DIR/job.toml`, printed by `cluster run`): its secret admits
        /// the call. Not needed when `FTREC_JOB_SECRET` is set.
        #[arg(long)]
        job: Option<PathBuf>,
        /// `server:ID` or `worker:ID`.
        member: String,
    },
}

#[derive(Args, Debug)]
pub struct ClusterRunArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Dataset directory (overrides data.dir).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Total steps over all workers (overrides train.steps).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Parameter servers (overrides cluster.servers).
    #[arg(long)]
    pub servers: Option<usize>,
    /// Workers (overrides cluster.workers).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Fault tolerance: none, checkpoint, ec, ec+checkpoint or partial (overrides cluster.ft).
    #[arg(long, value_parser = str::parse::<ftrec_config::FaultTolerance>)]
    pub ft: Option<ftrec_config::FaultTolerance>,
    /// Steps in strict order: bit-reproducible (overrides cluster.deterministic).
    #[arg(long)]
    pub deterministic: bool,
    /// SIGKILL `ROLE:ID` this long after training starts, e.g. `server:1@10s` (repeatable).
    #[arg(long = "kill", value_name = "ROLE:ID@SECONDS")]
    pub kills: Vec<String>,
    /// Arm a fault point in a server, `server:J@POINT[:STEP][=kill|skip]` (repeatable):
    /// prepare, commit, rebuild or fold-parity. `server:1@fold-parity:20=skip` drops one
    /// parity difference, a planted bug the end-of-run parity check must report.
    #[arg(long = "fault", value_name = "server:J@SPEC")]
    pub faults: Vec<String>,
    /// Spare servers to start; a failed server's slot goes to a spare before a new process.
    #[arg(long, default_value_t = 0)]
    pub spares: usize,
    /// Checkpoint directory for `--ft checkpoint` (default: RUN_DIR/checkpoints).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Job file, process logs, timeline CSV/JSON (default: a new temporary directory).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 3600.0)]
    pub time_limit: f64,
    /// Skip the final evaluation on the test split.
    #[arg(long)]
    pub no_eval: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ServerArgs {
    /// The job file `cluster run` writes (a TOML training configuration).
    #[arg(long)]
    pub job: PathBuf,
    #[arg(long)]
    pub coordinator: String,
    /// Server slot; omit with `--spare`.
    #[arg(long, required_unless_present = "spare")]
    pub id: Option<usize>,
    /// Join as a standby that takes over a failed server's slot.
    #[arg(long, conflicts_with = "id")]
    pub spare: bool,
    /// Interface to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Arm a fault point in this server, NAME[:STEP][=kill|skip] (prepare, commit, rebuild,
    /// fold-parity); it fires once. `cluster run --kill server:J@commit:N` passes these.
    #[arg(long = "fault", value_name = "SPEC")]
    pub faults: Vec<String>,
}

#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[arg(long)]
    pub job: PathBuf,
    #[arg(long)]
    pub coordinator: String,
    #[arg(long)]
    pub id: usize,
}

#[derive(Args, Debug)]
pub struct CoordinatorArgs {
    #[arg(long)]
    pub job: PathBuf,
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    #[arg(long, default_value_t = 7070)]
    pub port: u16,
    /// Where the timeline goes.
    #[arg(long, default_value = ".")]
    pub out: PathBuf,
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum PlotCommand {
    /// Throughput against time with failure, detection and recovery marked (PNG).
    Timeline {
        /// `timeline.json` from a cluster run (or its run directory).
        input: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "ftrec cluster throughput")]
        title: String,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExportFormat {
    /// Loadable by Python's `safetensors` and PyTorch; names in FORMAT.md.
    Safetensors,
}

#[derive(Subcommand, Debug)]
pub enum CkptCommand {
    /// List committed checkpoints.
    Ls {
        dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Print a checkpoint's manifest.
    Show { dir: PathBuf, id: String },
    /// Check everything a restore of one checkpoint (or of each) reads, its whole lineage
    /// included; exits non-zero on any damage.
    Verify {
        dir: PathBuf,
        id: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Export a checkpoint (newest by default) as named tensors.
    Export {
        dir: PathBuf,
        #[arg(long)]
        id: Option<String>,
        #[arg(long, value_enum, default_value_t = ExportFormat::Safetensors)]
        format: ExportFormat,
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Merge DECK deltas hierarchically (stride s), as the trainer's background merger
    /// does; run it on any host that reaches the store, e.g. with
    /// `checkpoint.deck.merge_in_background = false` in the trainer.
    Merge {
        dir: PathBuf,
        #[arg(long, default_value_t = 2)]
        stride: u32,
        /// Keep merging as new deltas arrive, checking every this many seconds.
        #[arg(long)]
        watch: Option<f64>,
        #[arg(long)]
        json: bool,
    },
    /// Delete checkpoints not retained and the data of crashed writes.
    Gc {
        dir: PathBuf,
        /// Keep the newest N checkpoints of every branch (and every checkpoint their
        /// restore needs).
        #[arg(long)]
        keep: Option<usize>,
        /// Delete branch B entirely (repeatable): the explicit way to drop a branch.
        #[arg(long = "drop-branch", value_name = "B")]
        drop_branch: Vec<u32>,
        /// While a writer holds the location, uncommitted data this old (seconds) is
        /// taken as abandoned; without a live writer, all uncommitted data is.
        #[arg(long, default_value_t = 3600.0)]
        abandoned_after: f64,
        #[arg(long)]
        json: bool,
    },
    /// Restore a checkpoint (newest by default): report its state digest and the restore
    /// time, and with `--out` save it as a model snapshot file.
    Restore {
        dir: PathBuf,
        #[arg(long)]
        id: Option<String>,
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

/// Model and training configuration: a preset, a TOML file, then `--set` overrides.
#[derive(Args, Debug, Clone)]
pub struct ConfigArgs {
    /// Built-in configuration to start from (tiny, demo).
    #[arg(long)]
    pub preset: Option<String>,
    /// TOML configuration file (applied over the preset).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override a configuration key, e.g. `--set optimizer.sparse.lr=0.05` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Random seed (same as `--set seed=S`).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Worker threads (same as `--set threads=N`; 0 = all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Dataset directory with train.ftrd and test.ftrd (overrides data.dir).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Total steps (overrides train.steps).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Save the final model to this snapshot file.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Write checkpoints here (same as `--set checkpoint.dir=DIR`); strategy `full` unless
    /// `checkpoint.strategy` says otherwise, every `checkpoint.every_steps` and at the end.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Resume from `DIR` (newest checkpoint) or `DIR@ID`. `--steps` still counts total steps.
    #[arg(long, value_name = "DIR[@ID]")]
    pub resume: Option<String>,
    /// With `--resume`: if the checkpoint is damaged, use the newest older one that
    /// restores cleanly (reported as `resumed_from`).
    #[arg(long, requires = "resume")]
    pub fallback: bool,
    /// Start an independent branch of history in a checkpoint location that already
    /// holds checkpoints (a fresh run there is refused otherwise).
    #[arg(long)]
    pub new_branch: bool,
    /// Print one JSON object with the results.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Snapshot written by `ftrec train --save`.
    #[arg(long)]
    pub model: PathBuf,
    /// Dataset directory (its test split is used) or a .ftrd file.
    #[arg(long)]
    pub data: PathBuf,
    #[arg(long, default_value_t = 4096)]
    pub batch_size: usize,
    /// Evaluate at most this many samples (0 = all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Synthetic Criteo-shaped data with a planted teacher model.
    Gen(GenArgs),
    /// Convert Criteo TSV or schema-described text to the binary format.
    Convert(ConvertArgs),
    /// Statistics of a dataset directory or .ftrd file.
    Stats(StatsArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum GenFormat {
    Binary,
    CriteoTsv,
}

#[derive(Args, Debug)]
pub struct GenArgs {
    /// Preset sizing: `tiny` scales the Criteo Kaggle cardinalities by 0.01.
    #[arg(long)]
    pub preset: Option<String>,
    /// Total samples (train + test).
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Factor applied to the Criteo Kaggle cardinalities (overrides the preset's).
    #[arg(long)]
    pub scale: Option<f64>,
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    #[arg(long, default_value_t = 0.1)]
    pub test_fraction: f64,
    #[arg(long, value_enum, default_value_t = GenFormat::Binary)]
    pub format: GenFormat,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Input text files, or directories of them (read in natural name order); plain,
    /// gzip or zstd, told by their first bytes, not their names.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The dataset directory: its train.ftrd and test.ftrd are replaced only once the
    /// whole input converted, and a stale meta.json is removed.
    #[arg(long)]
    pub out: PathBuf,
    /// Schema file for non-Criteo data; Criteo TSV when absent.
    #[arg(long)]
    pub schema: Option<PathBuf>,
    /// Share of samples held out for test. Exact for any size: sample i (0-based) is a
    /// test sample iff floor((i+1)*f) > floor(i*f), so the first n samples hold
    /// floor(n*f) test samples, evenly interleaved. An empty split is warned about.
    #[arg(long, default_value_t = 0.1)]
    pub test_fraction: f64,
    /// Skip malformed lines (and report how many) instead of stopping at the first.
    #[arg(long)]
    pub skip_bad_lines: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    pub path: PathBuf,
    /// Only the first N samples.
    #[arg(long)]
    pub limit: Option<usize>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Median training step time on in-memory batches.
    Train(BenchTrainArgs),
    /// Checkpoint strategies side by side on a Criteo-shaped model (~2.3 GB at scale 1):
    /// IncrCP and DECK experiments, disk bandwidth by dd; CSV, PNG plots, summary JSON.
    Ckpt(BenchCkptArgs),
    /// The cluster (2 servers, 2 workers by default) against the single-process trainer on
    /// the same cores; RPC bytes per sample; checkpoint pause; SIGKILL to training resumed.
    Cluster(BenchClusterArgs),
    /// ECRec against no fault tolerance and against checkpoints on the same cluster and
    /// data: normal-mode overhead (with and without 2PC), SIGKILL to the next step,
    /// rebuild rate, recovery speed-up over checkpoints, memory overhead.
    Ec(BenchEcArgs),
    /// The CPR emulation study: full recovery, partial recovery and CPR (vanilla, SCAR,
    /// MFU, SSU) under injected failures; AUC, PLS, checkpoint overhead, plots.
    Cpr(crate::bench_cpr::BenchCprArgs),
}

#[derive(Args, Debug)]
pub struct BenchEcArgs {
    /// Dataset directory (generated with the tiny Criteo shape when missing).
    #[arg(long, default_value = "bench-cluster-data")]
    pub data: PathBuf,
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    #[arg(long, default_value_t = 3)]
    pub servers: usize,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// SIGKILL server 1 this many seconds into the runs with a failure.
    #[arg(long, default_value_t = 5.0)]
    pub kill_after: f64,
    /// Standby servers started up front (ECRec's replacement server), in every run.
    #[arg(long, default_value_t = 1)]
    pub spares: usize,
    /// Cut interval of the `--ft checkpoint` run compared with.
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: u64,
    /// Where summary.json and the timeline plots go.
    #[arg(long, default_value = "bench-ec")]
    pub out: PathBuf,
    /// Override a configuration key (repeatable), e.g. `--set ec.k=3`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BenchClusterArgs {
    /// Dataset directory (generated with the tiny Criteo shape when missing).
    #[arg(long, default_value = "bench-cluster-data")]
    pub data: PathBuf,
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    #[arg(long, default_value_t = 2)]
    pub servers: usize,
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    #[arg(long, default_value_t = 50)]
    pub checkpoint_every: u64,
    /// SIGKILL server 1 this many seconds into the checkpointed run.
    #[arg(long, default_value_t = 5.0)]
    pub kill_after: f64,
    /// Checkpoint strategies to run side by side, each with a SIGKILLed server (comma
    /// separated: full, differential, naive-incremental, incrcp, deck).
    #[arg(long, value_delimiter = ',', default_value = "full")]
    pub strategies: Vec<String>,
    /// Cut interval for the strategies other than `full` (default: --checkpoint-every),
    /// e.g. 12x more often for DECK's experiment.
    #[arg(long)]
    pub delta_every: Option<u64>,
    /// Where summary.json and the timeline plots go.
    #[arg(long, default_value = "bench-cluster")]
    pub out: PathBuf,
    /// Override a configuration key of the preset (repeatable), e.g.
    /// `--set model.rows_per_table=300000` for a larger model.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BenchCkptArgs {
    /// Scratch directory for checkpoints (emptied per strategy).
    #[arg(long, default_value = "bench-ckpt-scratch")]
    pub dir: PathBuf,
    /// Where the CSV files, plots and summary go.
    #[arg(long, default_value = "bench-ckpt")]
    pub out: PathBuf,
    /// Scale of the Criteo Kaggle table sizes (1.0: 33.8M rows, ~2.3 GB).
    #[arg(long, default_value_t = 1.0)]
    pub scale: f64,
    #[arg(long, default_value_t = 150)]
    pub checkpoints: usize,
    /// Training steps between checkpoints.
    #[arg(long, default_value_t = 10)]
    pub interval: u64,
    /// Time the restore of every N-th checkpoint (and the last).
    #[arg(long, default_value_t = 5)]
    pub restore_every: usize,
    /// Full checkpoints actually written by the full strategy (the rest extrapolated).
    #[arg(long, default_value_t = 3)]
    pub full_samples: usize,
    /// Differential (Check-N-Run) baseline reset: a full checkpoint every N.
    #[arg(long, default_value_t = 50)]
    pub differential_full_every: u64,
    #[arg(long, default_value_t = 0.02)]
    pub incrcp_threshold: f64,
    /// DECK: a full checkpoint when live deltas exceed this many times one delta.
    #[arg(long, default_value_t = 64.0)]
    pub deck_live_factor: f64,
    #[arg(long, default_value_t = 2048)]
    pub batch_size: usize,
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long)]
    pub skip_deck: bool,
    /// Strategies of the IncrCP experiment, comma-separated (full must be among them for
    /// the disk comparison).
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_experiment_strategy,
        default_value = "full,differential,naive-incremental,incrcp"
    )]
    pub strategies: Vec<ftrec_ckpt::Strategy>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BenchTrainArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Where to put the generated data.
    #[arg(long, default_value = "demo-data")]
    pub dir: PathBuf,
    /// Samples to generate (train + test).
    #[arg(long, default_value_t = 2_600_000)]
    pub rows: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// SIGKILL server 1 this many seconds after training starts.
    #[arg(long, default_value_t = 20.0)]
    pub kill_after: f64,
    /// How the cluster survives the kill: `ec` (3 servers, erasure coded: the server is
    /// rebuilt from the others, nothing rolls back) or `checkpoint` (2 servers, roll back to
    /// the last consistent checkpoint).
    #[arg(long, default_value = "ec", value_parser = str::parse::<ftrec_config::FaultTolerance>)]
    pub ft: ftrec_config::FaultTolerance,
    #[arg(long)]
    pub json: bool,
}

fn parse_experiment_strategy(s: &str) -> Result<ftrec_ckpt::Strategy, String> {
    use ftrec_ckpt::Strategy;
    match serde_json::from_value(serde_json::Value::String(s.into())) {
        Ok(Strategy::Deck) => Err("deck has its own experiment (see --skip-deck)".into()),
        Ok(strategy) => Ok(strategy),
        Err(_) => Err(format!(
            "unknown strategy {s:?}: expected full, differential, naive-incremental or incrcp"
        )),
    }
}
