//! What a run reports: its recoveries, its cuts and the summary `cluster run --json`
//! prints.

use serde::{Deserialize, Serialize};

use crate::cpr;

/// How the servers came back from a failure; the run report names it in lower case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecoveryMode {
    /// Every server restored the last consistent cut.
    Rollback,
    /// The survivors kept their state; the replacement started fresh (`ft = none`).
    Keep,
    /// The lost shard was rebuilt from the survivors (erasure coding).
    Rebuild,
    /// Only the lost shard restored its checkpoint (CPR).
    Partial,
    /// Nothing could bring the lost state back.
    Abandon,
}

/// One recovery from a server failure, in seconds since the timeline started.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Recovery {
    pub server: usize,
    pub detected_at: f64,
    pub resumed_at: f64,
    /// Step training continued from.
    pub resumed_step: u64,
    pub steps_rolled_back: u64,
    /// Erasure coding: the longest replacement's rebuild, and the bytes rebuilt (with a
    /// background rebuild, filled in when it ends).
    pub rebuild_seconds: f64,
    pub rebuild_bytes: u64,
    /// Erasure coding: failure detection to full redundancy restored (with a background
    /// rebuild, training ran degraded meanwhile).
    pub degraded_seconds: f64,
    /// The rebuild ran in the background while training went on (2PC on).
    pub background_rebuild: bool,
    /// Steps granted while the replacement rebuilt in the background.
    pub steps_while_degraded: u64,
    /// Of those, the steps applied on every server by the time the rebuild ended (a
    /// granted step may still be in flight, or be lost and granted again): what training
    /// actually achieved while degraded.
    pub steps_committed_while_degraded: u64,
    /// From the SIGKILL of this server (an injected `--kill`) to training resumed; filled
    /// in by `cluster run` from the timeline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kill_to_resume_seconds: Option<f64>,
    /// When the first step a worker finished after the resume settled: training really
    /// going on, not only allowed to (the resume is when grants start again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_step_at: Option<f64>,
    /// From the SIGKILL to `first_step_at`; filled in by `cluster run`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kill_to_first_step_seconds: Option<f64>,
    /// The epoch this recovery began.
    pub epoch: u64,
    /// How the servers came back.
    pub mode: RecoveryMode,
    /// Partial recovery: every server's shard digest once recovered, before training
    /// went on (survivors: their state at the failure; replacements: their checkpoint).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shard_digests: Vec<String>,
}

impl Recovery {
    /// When this recovery stopped costing training: full redundancy restored, or the run's
    /// last step (`last_step_at`) if that came first.
    pub fn degraded_until(&self, last_step_at: Option<f64>) -> f64 {
        let redundant_at = self.detected_at + self.degraded_seconds;
        last_step_at.map_or(redundant_at, |t| t.min(redundant_at))
    }

    /// A background rebuild's committed samples per second, from the resume to
    /// [`Self::degraded_until`], with `batch` samples a step; `None` without one. (A slow
    /// rebuild can outlast the steps, and the run then waits for it: counting that wait as
    /// degraded training put the ratio at 0.886 for runs that trained at full speed while
    /// degraded; issue 23.)
    pub fn committed_rate_while_degraded(
        &self,
        last_step_at: Option<f64>,
        batch: f64,
    ) -> Option<f64> {
        self.background_rebuild.then(|| {
            let window = self.degraded_until(last_step_at) - self.resumed_at;
            self.steps_committed_while_degraded as f64 * batch / window.max(1e-9)
        })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointRecord {
    pub step: u64,
    pub started_at: f64,
    /// Training was paused from the cut request to the end of the write.
    pub pause_seconds: f64,
    pub bytes: u64,
    /// Each server's checkpoint id of this cut, by server slot.
    pub ids: Vec<String>,
    /// A CPR prioritised save (chosen rows on top of the last cut), not a cut.
    pub priority: bool,
}

/// What a finished run reports.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunSummary {
    /// The step reached: every step below it is trained.
    pub steps: u64,
    /// A resumed job: the step of the cut it started from (0 for a fresh start), the
    /// server count that wrote it, and where it is (`null` for a fresh start).
    pub resumed_from_step: u64,
    pub resumed_from_servers: Option<u32>,
    pub resumed_from: Option<String>,
    /// The servers the job ended on (`cluster scale` may have moved it). Not serialised
    /// here: `cluster run`'s report carries it as `servers`.
    #[serde(skip)]
    pub servers: usize,
    /// Every move to another server count (`cluster scale`), in order.
    pub moves: Vec<crate::state::MoveRecord>,
    pub samples: u64,
    /// Samples whose updates a lost shard no longer holds, summed over shards: under
    /// `none` all a replaced shard had trained, under `partial` what it trained since its
    /// cut. 0 in the exact modes.
    pub lost_samples: u64,
    /// Processes that came back after being declared dead (after SIGCONT, link-up, the
    /// end of a partition) and were turned away, each counted once.
    pub zombies_refused: u64,
    pub train_seconds: f64,
    pub samples_per_sec: f64,
    /// Pull and push payload bytes the workers moved (what `rpc_bytes_per_sample` counts).
    pub rpc_bytes: u64,
    pub rpc_bytes_per_sample: f64,
    /// Every data-plane RPC the servers served (workers' and their peers': parity
    /// updates, 2PC, degraded reads and rebuild fetches too) and the payload bytes in and
    /// out of them, from the servers' heartbeats (the last beat's worth may be missing).
    pub server_rpcs: u64,
    pub server_rpc_bytes: u64,
    pub epoch: u64,
    pub checkpoints: Vec<CheckpointRecord>,
    pub recoveries: Vec<Recovery>,
    /// Servers an earlier leader recovered through an etcd outage without a record, whose
    /// replacement a later leader kept with its shard (no times: they died with it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unrecorded_recoveries: Vec<usize>,
    /// When the last step was counted, on the timeline's clock (the recoveries' clock).
    /// Training ends later when a background rebuild outlasts the steps: the run waits for
    /// full redundancy, and `train_seconds` counts that wait.
    pub last_step_at: Option<f64>,
    pub recovery_seconds: f64,
    /// Steps trained again because of rollbacks, over every recovery (0 under partial
    /// recovery and erasure coding).
    pub steps_rolled_back: u64,
    /// Partial recovery: the portion of lost samples (CPR Eq. 3), the recovery in force
    /// (`partial`, or `full` when the comparison fell back), and that comparison.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pls: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovery_mode: Option<ftrec_cpr::Recovery>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpr_decision: Option<ftrec_cpr::Decision>,
    /// `checkpoint.planned_mtbf_seconds`: the MTBF measured and the interval in force.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replan: Option<crate::replan::Replan>,
    /// CPR prioritised saves: how many, and their trackers' cost (cpr.txt Table 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpr_priority: Option<cpr::PriorityReport>,
    /// Membership in etcd: the leader's lease, and every takeover by a standby.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_ttl_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coordinator_failovers: Option<Vec<Failover>>,
    /// The coordinator that reports (etcd: the one leading at the end).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coordinator: Option<String>,
}

/// A standby coordinator took over from a leader that stopped renewing its lease.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Failover {
    /// The deposed leader's id, and the new one's.
    pub from: String,
    pub to: String,
    /// From the old leader's last write to etcd (it was alive then) to the first step
    /// settled under the new leader: an upper bound on the time without a coordinator,
    /// larger than it by at most one `cluster.etcd_flush_ms`. Wall clocks of the two
    /// coordinators' hosts.
    pub failover_seconds: f64,
    /// The new leader's term (the leader key's create revision in etcd).
    pub term: u64,
    /// When that first step settled (seconds since the Unix epoch, the new leader's
    /// clock): `cluster run` measures from its SIGKILL of the old leader to it.
    #[serde(default)]
    pub first_step_at_unix: Option<f64>,
}
