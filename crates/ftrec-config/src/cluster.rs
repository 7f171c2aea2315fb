//! The `[cluster]` section: shape, fault tolerance and timing of a parameter-server job.

use serde::{Deserialize, Serialize};

use crate::ConfigError;
use crate::membership::{Membership, default_flush_ms, default_lease_ttl_s};

/// What a cluster does when a server dies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultTolerance {
    /// A replacement server starts from the initial state: the shard's training is lost.
    #[default]
    None,
    /// Periodic consistent checkpoints; on a failure every server rolls back to the last
    /// one and the workers rewind their data position (Ckpt-T in the papers).
    Checkpoint,
    /// ECRec: rows and their optimizer state erasure coded across servers, dense
    /// parameters replicated; a lost server is rebuilt from the survivors, nothing rolls
    /// back (`[ec]` section).
    Ec,
    /// Erasure coding, plus low-frequency checkpoints as a second layer for when more
    /// servers of a group are lost than the code can rebuild (ECRec §4).
    #[serde(rename = "ec+checkpoint")]
    EcCheckpoint,
    /// CPR: per-server checkpoints; a lost server reloads only its own shard from its last
    /// checkpoint, nobody else rolls back and the workers do not rewind (`[cpr]` section).
    /// The updates since that checkpoint are lost, counted as PLS.
    Partial,
}

impl FaultTolerance {
    pub const ALL: [Self; 5] = [
        Self::None,
        Self::Checkpoint,
        Self::Ec,
        Self::EcCheckpoint,
        Self::Partial,
    ];

    /// Whether the cluster takes checkpoints.
    pub fn checkpoints(self) -> bool {
        matches!(self, Self::Checkpoint | Self::EcCheckpoint | Self::Partial)
    }

    /// Whether a recovery promises the state of an uninterrupted run (so a step applied
    /// twice is refused rather than trained again). Partial recovery and none do not.
    pub fn exact_recovery(self) -> bool {
        matches!(self, Self::Checkpoint | Self::EcCheckpoint)
    }

    /// Whether rows are erasure coded and dense parameters replicated.
    pub fn erasure_coded(self) -> bool {
        matches!(self, Self::Ec | Self::EcCheckpoint)
    }

    /// The name used in configuration files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Checkpoint => "checkpoint",
            Self::Ec => "ec",
            Self::EcCheckpoint => "ec+checkpoint",
            Self::Partial => "partial",
        }
    }
}

impl std::str::FromStr for FaultTolerance {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|f| f.name()).collect();
                format!("unknown fault tolerance {s:?}: one of {}", names.join(", "))
            })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    pub servers: usize,
    pub workers: usize,
    #[serde(default)]
    pub ft: FaultTolerance,
    /// Workers take steps strictly in order (each pull waits for the previous step's
    /// push): bit-reproducible, and with one worker equal to `ftrec train`.
    #[serde(default)]
    pub deterministic: bool,
    /// Start from another job's cut instead of the seed: `DIR` (its newest cut that every
    /// server committed) or `DIR@STEP`, where `DIR` is that job's checkpoint location
    /// (`server-<i>` beneath it). `cluster run --resume` and `coordinator --resume` set it;
    /// the job's server and worker counts and `train.steps` may differ from the cut's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<String>,
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A member silent this long is declared dead.
    #[serde(default = "default_failure_timeout_ms")]
    pub failure_timeout_ms: u64,
    /// Bound on the control plane's RPCs (joins, placement, epoch changes, orphan
    /// resolution) and on the waits that have no deadline of their own below. Default:
    /// 10 x the failure timeout.
    #[serde(default)]
    pub rpc_timeout_ms: Option<u64>,
    /// Deadlines per kind of RPC, derived from `failure_timeout_ms` when not set.
    #[serde(default)]
    pub deadlines: DeadlinesSection,
    /// `embedded` (default) or `etcd`: where membership, epoch and cuts live.
    #[serde(default)]
    pub membership: Membership,
    /// etcd members, `host:port` (`--etcd URL,...` overrides it per process, so it is not
    /// part of the job's fingerprint).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub etcd_endpoints: Vec<String>,
    /// Every key of the job starts with it. Default: `/ftrec/JOB_ID`, from the job secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_prefix: Option<String>,
    /// The leader's lease: a dead leader is replaced this long after its last renewal.
    #[serde(default = "default_lease_ttl_s")]
    pub etcd_lease_ttl_s: u64,
    /// How often the leader writes its step ledger and counters to etcd (the per-step
    /// path never waits for etcd).
    #[serde(default = "default_flush_ms")]
    pub etcd_flush_ms: u64,
    /// With etcd membership: how long a stateless member (a worker, a spare without a
    /// slot) waits for a control plane that does not answer (no coordinator, or etcd
    /// down) before it exits. A server that holds a shard never exits on a timeout: it
    /// waits until etcd records the job's end or an operator stops it.
    #[serde(default = "default_control_plane_grace_s")]
    pub control_plane_grace_s: u64,
    /// With etcd membership, in `ec` and `ec+checkpoint` under 2PC: a leader whose lease
    /// is in doubt because etcd does not answer (a quorum loss) goes on granting steps
    /// while every server is well, and declares a server dead and rebuilds it when its
    /// port refuses a connection (no process listens: hard evidence), without a record;
    /// the servers' epoch fences keep a newer leader's view safe, and a newer leader finds
    /// the dead server again. `false`: training waits for etcd (no decision, no grant).
    #[serde(default = "yes")]
    pub train_through_etcd_outage: bool,
    /// A lost server slot that waits this long with no replacement (no spare, no
    /// `ftrec server --id N`, and a coordinator without `--spawn`) gets one on a survivor's
    /// host: the coordinator asks a live server to start a spare beside itself, and the
    /// job trains on with that host holding two shards. In `ec` and `ec+checkpoint` the
    /// slot moves to a spare from elsewhere as soon as one joins (rebuilt exactly from
    /// parity); in the checkpoint modes it stays (moving it would roll it back).
    #[serde(default = "default_survivor_spare_after_s")]
    pub survivor_spare_after_s: u64,
    /// `false`: a lost slot waits for a replacement however long it takes (the
    /// coordinator says every minute which process it waits for).
    #[serde(default = "yes")]
    pub survivor_spares: bool,
    /// Each server's memory budget in bytes (0: whatever its host has available). A
    /// server whose share (rows, optimizer state, parity, replicas) exceeds it refuses to
    /// start, naming the parts; `--ft auto` rules out erasure coding when the parity does
    /// not fit.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub server_memory_bytes: u64,
    /// The nice value a worker process trains at (0 to 19; raising one's own is what any
    /// process may do, where renicing a rebuild up needs a privilege). Above 0, a host's
    /// servers (their replies, a rebuild) come before the workers' compute where the two
    /// share cores; on hosts of their own it changes nothing. At 5, `bench ec` on 2 cores
    /// rebuilt at 1.16 GB/s against 0.92 (full redundancy 0.71 s after a SIGKILL against
    /// 0.85), losing no more training (0.44 s against 0.43), and failure-free training
    /// kept its speed (BENCHMARKS.md, ECRec).
    #[serde(default = "default_worker_nice")]
    pub worker_nice: i32,
}

fn default_worker_nice() -> i32 {
    5
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `[cluster.deadlines]`: how long each kind of call may take before its callee counts as
/// unreachable for it. A silent peer (a frozen host, a link down, a partition) costs a
/// caller exactly one of these, so each is as short as its work allows, and derived from
/// the failure timeout unless set. Heartbeats are bounded by `failure_timeout_ms` itself.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadlinesSection {
    /// Pull, push, 2PC prepare/commit/abort, and a server's parity update to a peer: the
    /// whole call, retries included. Default: 5 x the failure timeout.
    pub step_ms: Option<u64>,
    /// A rebuild transfer that moves no bytes for this long fails (progress, not total
    /// time: a large shard may take minutes). Default: 5 x the failure timeout.
    pub rebuild_stall_ms: Option<u64>,
    /// A checkpoint write, a cut's commit or a restore (local disk or object store).
    /// Default: 60 x the failure timeout.
    pub checkpoint_io_ms: Option<u64>,
    /// A streamed reply (a rebuild's progress, a table's rows) that brings no message for
    /// this long fails as a call to a dead member: its sender froze or lost its link
    /// mid-stream. Silence, not total time: a sender keeps a slow stream alive with
    /// progress messages. Also how long an HTTP/2 ping and unacknowledged TCP data
    /// (`TCP_USER_TIMEOUT`) may wait before a connection is closed. Default: 5 x the
    /// failure timeout.
    pub stream_progress_ms: Option<u64>,
    /// TCP's minimum retransmission timeout and longest delayed ACK on the job's RPC
    /// connections (Linux 6.15+: `TCP_RTO_MIN_US`, `TCP_DELACK_MAX_US`). The kernel's
    /// 200 ms minimum is what a lost packet of a small call costs, since such a call has
    /// too few packets in flight for a fast retransmit: on a lossy link nearly every step
    /// waited it out. At least 5 (the kernel's floor); 0 keeps the kernel's own. A kernel
    /// without the options keeps its own too (said once). Default 5.
    pub retransmit_min_ms: Option<u64>,
    /// A step call (a pull, a push, 2PC's prepare and commit, a server's parity update to
    /// a peer) still unanswered after this many times the fast quartile (the 25th
    /// percentile, which stands for the loss-free median) of its kind's recent calls to
    /// that member is sent again on a second connection to it, and the first answer wins
    /// ("The Tail at Scale"; issue 44 §3). A lost packet of such a call otherwise waits
    /// for TCP's loss probe or retransmission timer, which the kernel keeps in whole
    /// ticks: at least 8-12 ms at 250 Hz, against calls of about a millisecond. Every
    /// such call is safe to repeat (servers drop a step they hold already). 0 sends no
    /// second copy. Default 3.
    pub hedge_multiple: Option<u32>,
    /// No call is sent again sooner than this. Default 2.
    pub hedge_floor_ms: Option<u64>,
    /// Empty frames that a connection writes after each burst while it loses packets, so
    /// that a lost last segment is found in a round trip rather than by TCP's loss-probe
    /// timer (whole ticks: 8 ms at least at 250 Hz); see `ftrec_rpc::tail_probe`. 2 is
    /// TCP's duplicate threshold with the burst's own last segment. 0 sends none; at most
    /// 4. Never under TLS. Default 2.
    pub tail_probes: Option<u32>,
}

/// When a step call is sent again on a second connection ([`DeadlinesSection`]'s
/// `hedge_multiple` and `hedge_floor_ms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hedge {
    /// Times the fast quartile of the call's kind.
    pub multiple: u32,
    /// Never sooner than this.
    pub floor: std::time::Duration,
}

impl Hedge {
    /// When a call of a kind whose recent fast quartile is `base` is sent again.
    pub fn after(&self, base: std::time::Duration) -> std::time::Duration {
        base.saturating_mul(self.multiple).max(self.floor)
    }
}

/// `cluster.deadlines.hedge_multiple` when unset.
pub const DEFAULT_HEDGE_MULTIPLE: u32 = 3;
/// `cluster.deadlines.hedge_floor_ms` when unset.
pub const DEFAULT_HEDGE_FLOOR_MS: u64 = 2;

/// `cluster.deadlines.tail_probes` when unset, and the most it may be.
pub const DEFAULT_TAIL_PROBES: u32 = 2;
pub const MAX_TAIL_PROBES: u32 = 4;

/// `cluster.deadlines.retransmit_min_ms` when unset.
pub const DEFAULT_RETRANSMIT_MIN_MS: u64 = 5;
/// The least the kernel takes for `TCP_RTO_MIN_US` and `TCP_DELACK_MAX_US`, in ms.
const KERNEL_RETRANSMIT_FLOOR_MS: u64 = 5;

/// Every deadline of a job, resolved (see [`DeadlinesSection`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadlines {
    pub step: std::time::Duration,
    pub heartbeat: std::time::Duration,
    pub rebuild_stall: std::time::Duration,
    pub checkpoint_io: std::time::Duration,
    pub control: std::time::Duration,
    pub stream_progress: std::time::Duration,
    /// None: the kernel's own.
    pub retransmit_min: Option<std::time::Duration>,
    /// None: no call is sent twice.
    pub hedge: Option<Hedge>,
    /// Probes after each burst of a connection losing packets; 0: none.
    pub tail_probes: u32,
}

/// `[ec]`: erasure coding (`cluster.ft = "ec"` or `"ec+checkpoint"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EcSection {
    /// Data rows per stripe.
    #[serde(default = "default_k")]
    pub k: usize,
    /// Parity rows per stripe: servers of a group that may be lost at once.
    #[serde(default = "default_r")]
    pub r: usize,
    /// Groups the servers are split into; each codes within itself (ECRec §4).
    #[serde(default = "default_groups")]
    pub groups: usize,
    /// Replicate dense parameters and their optimizer state on a second server (ECRec
    /// §3.3). `false` codes each server's dense range as a row of a dense stripe of its
    /// group instead, its changes sent as differences like embedding rows'. With `r >= 2`
    /// the dense ranges are always coded (`JobConfig::dense_replicated`).
    #[serde(default = "yes")]
    pub replicate_dense: bool,
    /// Two-phase commit per step (ECRec §3.5): a server failure mid-step leaves the step
    /// either applied everywhere (rows, parity, replicas) or nowhere.
    #[serde(default = "yes")]
    pub two_phase_commit: bool,
    /// Cycle ranges (about 2 MiB from each survivor) a background rebuild fetches and
    /// decodes at once.
    #[serde(default = "default_groups")]
    pub rebuild_locks: usize,
    /// Caps a background rebuild's decoding rate (bytes of rows per second); 0: no cap,
    /// the rebuild paces itself (`ec.rebuild_training_share`). Rows a pull or push needs
    /// are decoded at once whatever the cap.
    #[serde(default)]
    pub rebuild_bytes_per_sec: u64,
    /// A background rebuild paces itself from what it measures: it runs as fast as it
    /// goes while training commits at least this share of the steps per second it
    /// committed before the failure, and backs off (to no less than half its fastest rate) when
    /// training falls below it. Only where the group survives another loss meanwhile
    /// (fewer of its members lost than `ec.r`): with r = 1 a rebuild is never slowed, as
    /// a second loss before it ends loses the model. On a host whose cores training fills, the
    /// rebuild's core-seconds come out of training whenever they are spent, so a low share
    /// ends the window without redundancy sooner for about the same training lost; a high
    /// one spreads the rebuild out. 0 turns the pacing off (as fast as it goes).
    #[serde(default = "default_rebuild_training_share")]
    pub rebuild_training_share: f64,
    /// The nice value (-20 to 19) that the replacement and the survivors sending to it run
    /// at while an uncapped rebuild lasts, then put back. 0 (the default) leaves
    /// priorities alone. A negative value needs `CAP_SYS_NICE`, which a container rarely
    /// has; without it the servers log a warning and rebuild at the normal priority.
    #[serde(default)]
    pub rebuild_nice: i32,
    /// How a survivor's cycle ranges reach a replacement: `bulk` (a raw TCP stream from
    /// the survivor's bulk port, claimed with a one-time ticket issued over the job's
    /// authenticated RPC; the default, and what lets a rebuild approach the link's speed)
    /// or `grpc` (the bytes inside the RPC reply). Jobs with TLS, and simulated networks,
    /// use `grpc` whatever this says: the bulk stream is not encrypted.
    #[serde(default)]
    pub rebuild_transport: RebuildTransport,
    /// A spare allocates and writes a shard's worth of zeroed rows and parity while it
    /// waits, so that a rebuild into it faults in no page (about a fifth of the
    /// replacement's CPU otherwise). Costs each idle spare the memory of the largest
    /// shard; `false` allocates at promotion instead.
    #[serde(default = "yes")]
    pub spare_reserve: bool,
}

/// `ec.rebuild_transport`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RebuildTransport {
    #[default]
    Bulk,
    Grpc,
}

fn default_k() -> usize {
    2
}
fn default_r() -> usize {
    1
}
fn default_groups() -> usize {
    1
}
fn yes() -> bool {
    true
}
fn default_rebuild_training_share() -> f64 {
    0.5
}

impl Default for EcSection {
    fn default() -> Self {
        Self {
            k: default_k(),
            r: default_r(),
            groups: default_groups(),
            replicate_dense: true,
            two_phase_commit: true,
            rebuild_locks: default_groups(),
            rebuild_bytes_per_sec: 0,
            rebuild_training_share: default_rebuild_training_share(),
            rebuild_nice: 0,
            rebuild_transport: RebuildTransport::Bulk,
            spare_reserve: true,
        }
    }
}

impl EcSection {
    pub fn params(&self) -> ftrec_ec::EcParams {
        ftrec_ec::EcParams {
            k: self.k,
            r: self.r,
            groups: self.groups,
        }
    }

    /// Checks the section against the cluster it codes over; errors name the keys.
    pub fn validate(&self, cluster: &ClusterSection) -> Result<(), ConfigError> {
        if !cluster.ft.erasure_coded() {
            return Ok(());
        }
        self.params()
            .validate(cluster.servers)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        if self.rebuild_locks == 0 {
            return Err(ConfigError::Invalid(
                "ec.rebuild_locks must be at least 1".into(),
            ));
        }
        if !(-20..=19).contains(&self.rebuild_nice) {
            return Err(ConfigError::Invalid(format!(
                "ec.rebuild_nice = {}: a nice value is from -20 to 19",
                self.rebuild_nice
            )));
        }
        if !(0.0..1.0).contains(&self.rebuild_training_share) {
            return Err(ConfigError::Invalid(format!(
                "ec.rebuild_training_share = {}: a share of training's rate, from 0 (no pacing) to below 1",
                self.rebuild_training_share
            )));
        }
        Ok(())
    }
}

fn default_heartbeat_ms() -> u64 {
    100
}
fn default_failure_timeout_ms() -> u64 {
    1000
}
/// Ten minutes: an etcd outage or a failover that an operator fixes by hand should not
/// cost the job its workers.
fn default_control_plane_grace_s() -> u64 {
    600
}
/// Long enough for an operator's or an orchestrator's replacement to come first (a
/// second move of the slot costs a second recovery), short enough that a job does not
/// stand still for long.
fn default_survivor_spare_after_s() -> u64 {
    30
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            servers: 2,
            workers: 2,
            ft: FaultTolerance::None,
            deterministic: false,
            resume_from: None,
            heartbeat_ms: default_heartbeat_ms(),
            failure_timeout_ms: default_failure_timeout_ms(),
            rpc_timeout_ms: None,
            deadlines: DeadlinesSection::default(),
            membership: Membership::Embedded,
            etcd_endpoints: Vec::new(),
            etcd_prefix: None,
            etcd_lease_ttl_s: default_lease_ttl_s(),
            etcd_flush_ms: default_flush_ms(),
            control_plane_grace_s: default_control_plane_grace_s(),
            train_through_etcd_outage: true,
            survivor_spare_after_s: default_survivor_spare_after_s(),
            survivor_spares: true,
            server_memory_bytes: 0,
            worker_nice: default_worker_nice(),
        }
    }
}

impl ClusterSection {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.servers == 0 || self.workers == 0 {
            return Err(ConfigError::Invalid(format!(
                "cluster.servers = {} and cluster.workers = {}: a cluster needs at least one of each",
                self.servers, self.workers
            )));
        }
        if self.heartbeat_ms == 0 || self.failure_timeout_ms <= self.heartbeat_ms {
            return Err(ConfigError::Invalid(format!(
                "cluster.failure_timeout_ms = {} must exceed cluster.heartbeat_ms = {} (> 0)",
                self.failure_timeout_ms, self.heartbeat_ms
            )));
        }
        if !(0..=19).contains(&self.worker_nice) {
            return Err(ConfigError::Invalid(format!(
                "cluster.worker_nice = {}: from 0 to 19 (a worker may lower its own priority, \
                 not raise it)",
                self.worker_nice
            )));
        }
        let d = &self.deadlines;
        for (key, value) in [
            ("rpc_timeout_ms", self.rpc_timeout_ms),
            ("step_ms", d.step_ms),
            ("rebuild_stall_ms", d.rebuild_stall_ms),
            ("checkpoint_io_ms", d.checkpoint_io_ms),
            ("stream_progress_ms", d.stream_progress_ms),
        ] {
            if value.is_some_and(|v| v <= self.heartbeat_ms) {
                return Err(ConfigError::Invalid(format!(
                    "cluster.{}{key} = {} must exceed cluster.heartbeat_ms = {}",
                    if key == "rpc_timeout_ms" {
                        ""
                    } else {
                        "deadlines."
                    },
                    value.unwrap_or_default(),
                    self.heartbeat_ms
                )));
            }
        }
        if let Some(v) = d.retransmit_min_ms
            && v != 0
            && !(KERNEL_RETRANSMIT_FLOOR_MS..200).contains(&v)
        {
            return Err(ConfigError::Invalid(format!(
                "cluster.deadlines.retransmit_min_ms = {v}: must be 0 (the kernel's own) or \
                 from {KERNEL_RETRANSMIT_FLOOR_MS} to 199 (the kernel's floor, and below its \
                 default of 200)"
            )));
        }
        if let Some(v) = d.hedge_floor_ms
            && v >= self.deadlines().step.as_millis() as u64
        {
            return Err(ConfigError::Invalid(format!(
                "cluster.deadlines.hedge_floor_ms = {v}: must be below the step deadline \
                 ({} ms): a call is sent again before its deadline or never",
                self.deadlines().step.as_millis()
            )));
        }
        if let Some(v) = d.tail_probes
            && v > MAX_TAIL_PROBES
        {
            return Err(ConfigError::Invalid(format!(
                "cluster.deadlines.tail_probes = {v}: at most {MAX_TAIL_PROBES} (TCP retransmits \
                 at once with 2 segments past a hole; more only cost segments)"
            )));
        }
        if self.control_plane_grace_s == 0 {
            return Err(ConfigError::Invalid(
                "cluster.control_plane_grace_s = 0: a member needs some time to wait for the \
                 control plane (default 600 s)"
                    .into(),
            ));
        }
        crate::membership::validate(
            self.membership,
            &self.etcd_endpoints,
            self.etcd_prefix.as_deref(),
            self.etcd_lease_ttl_s,
            self.etcd_flush_ms,
        )
    }

    /// The job's deadlines, each the configured value or its default derived from the
    /// failure timeout.
    pub fn deadlines(&self) -> Deadlines {
        let ms = std::time::Duration::from_millis;
        let failure = self.failure_timeout_ms;
        let d = &self.deadlines;
        Deadlines {
            step: ms(d.step_ms.unwrap_or(5 * failure)),
            heartbeat: ms(failure),
            rebuild_stall: ms(d.rebuild_stall_ms.unwrap_or(5 * failure)),
            checkpoint_io: ms(d.checkpoint_io_ms.unwrap_or(60 * failure)),
            control: ms(self.rpc_timeout_ms.unwrap_or(10 * failure)),
            stream_progress: ms(d.stream_progress_ms.unwrap_or(5 * failure)),
            retransmit_min: Some(d.retransmit_min_ms.unwrap_or(DEFAULT_RETRANSMIT_MIN_MS))
                .filter(|&v| v > 0)
                .map(ms),
            hedge: Some(d.hedge_multiple.unwrap_or(DEFAULT_HEDGE_MULTIPLE))
                .filter(|&m| m > 0)
                .map(|multiple| Hedge {
                    multiple,
                    floor: ms(d.hedge_floor_ms.unwrap_or(DEFAULT_HEDGE_FLOOR_MS)),
                }),
            tail_probes: d.tail_probes.unwrap_or(DEFAULT_TAIL_PROBES),
        }
    }
}
