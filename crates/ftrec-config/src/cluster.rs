//! The `[cluster]` section: shape, fault tolerance and timing of a parameter-server job.

use serde::{Deserialize, Serialize};

use crate::ConfigError;

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
}

impl FaultTolerance {
    pub const ALL: [Self; 2] = [Self::None, Self::Checkpoint];

    /// The name used in configuration files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Checkpoint => "checkpoint",
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
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A member silent this long is declared dead.
    #[serde(default = "default_failure_timeout_ms")]
    pub failure_timeout_ms: u64,
    /// Bound on every RPC and every wait in the cluster.
    #[serde(default = "default_rpc_timeout_ms")]
    pub rpc_timeout_ms: u64,
}

fn default_heartbeat_ms() -> u64 {
    100
}
fn default_failure_timeout_ms() -> u64 {
    1000
}
fn default_rpc_timeout_ms() -> u64 {
    30_000
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            servers: 2,
            workers: 2,
            ft: FaultTolerance::None,
            deterministic: false,
            heartbeat_ms: default_heartbeat_ms(),
            failure_timeout_ms: default_failure_timeout_ms(),
            rpc_timeout_ms: default_rpc_timeout_ms(),
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
        if self.rpc_timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "cluster.rpc_timeout_ms must be positive".into(),
            ));
        }
        Ok(())
    }
}
