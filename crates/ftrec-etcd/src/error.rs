use std::time::Duration;

/// What went wrong with the job's etcd. Every variant names the endpoints or the key.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("etcd at {endpoints} is unreachable: {error}")]
    Unreachable { endpoints: String, error: String },
    #[error("etcd at {endpoints}: {what} ({key}) failed: {error}")]
    Request {
        endpoints: String,
        what: &'static str,
        key: String,
        error: String,
    },
    #[error("etcd at {endpoints}: {what} ({key}) got no answer within {limit:?}")]
    Timeout {
        endpoints: String,
        what: &'static str,
        key: String,
        limit: Duration,
    },
    #[error(
        "etcd key {key} belongs to another job (job id {stored}, this job's is {ours}): \
         choose another cluster.etcd_prefix, or remove that job's keys if it is over"
    )]
    OtherJob {
        key: String,
        stored: String,
        ours: String,
    },
    #[error(
        "etcd key {key}: this job was started with configuration fingerprint {stored}, and \
         this process's job file has {ours}: every process of a job needs the same job file"
    )]
    ConfigChanged {
        key: String,
        stored: String,
        ours: String,
    },
    #[error(
        "etcd key {key} is held by coordinator {holder}: a second coordinator must be \
         started with --standby"
    )]
    LeaderHeld { key: String, holder: String },
    /// A fenced write found its key changed since this leader last wrote or read it, by
    /// something other than this leader: nothing was written.
    #[error(
        "etcd key {key} changed behind this leader's back (expected mod revision {expected}, \
         found {}): the write was refused rather than put over it",
        found.map_or("the key deleted".to_string(), |r| r.to_string())
    )]
    Stale {
        key: String,
        expected: i64,
        found: Option<i64>,
    },
    #[error("deposed: {0}")]
    Deposed(String),
    #[error("etcd key {key} holds what this version cannot read: {error}")]
    Corrupt { key: String, error: String },
    #[error("{0}")]
    Invalid(String),
}

impl EtcdError {
    /// etcd did not answer (down, stalled, or out of reach): unlike every other error, a
    /// later try may succeed.
    pub fn unanswered(&self) -> bool {
        matches!(self, Self::Unreachable { .. } | Self::Timeout { .. })
    }
}
