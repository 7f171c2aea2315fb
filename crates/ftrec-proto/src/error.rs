//! The errors of the contract itself: bytes or records that do not decode as the protocol
//! says, a placement that cannot be laid out, a timeline file that cannot be read or
//! written. The runtime (`ftrec-rpc`) turns each into the `PsError` variant it stood for
//! before the split (`Malformed` a bad request, `Placement` a configuration error), so a
//! remote caller sees the same status code and message as before.
//!
//! The messages are the ones callers and tests have always seen: `bad request: ...` and
//! `configuration: ...` prefixes included.

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ProtoError {
    #[error("bad request: {0}")]
    Malformed(#[from] Malformed),
    #[error("configuration: {0}")]
    Placement(#[from] BadPlacement),
    /// A timeline file (or its directory) that could not be read or written.
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A file read as a timeline that does not parse as one.
    #[error("configuration: {}: not a timeline: {error}", path.display())]
    NotATimeline {
        path: PathBuf,
        error: serde_json::Error,
    },
    /// A timeline that did not serialise (kept without a path, as before the split).
    #[error("configuration: {0}")]
    TimelineEncode(serde_json::Error),
    #[error(transparent)]
    Model(#[from] ftrec_model::ModelError),
}

/// Bytes or a record that do not decode as the protocol says; `what` names the field, or
/// the checkpoint the record came from.
#[derive(Debug, Error)]
pub enum Malformed {
    #[error("{what}: {len} bytes is not a whole number of 4-byte values")]
    Ragged { what: String, len: usize },
    #[error("{what} carries no server identity; it is not a cluster shard checkpoint")]
    NoIdentity { what: String },
    #[error("{what}: its shard identity is malformed: {error}")]
    Identity {
        what: String,
        error: serde_json::Error,
    },
    #[error("{what}: shard identity version {version} is newer than this ftrec reads ({reads})")]
    IdentityVersion {
        what: String,
        version: u32,
        reads: u32,
    },
    #[error("{what} is server {owner}'s shard; server {server} refuses to restore it")]
    NotOwner {
        what: String,
        owner: usize,
        server: usize,
    },
    #[error("server {server}'s dense range is shorter than the placement's {len} parameters")]
    ShortDenseRange { server: usize, len: usize },
}

/// A placement that cannot be laid out, or shards that do not fit the one given.
#[derive(Debug, Error)]
pub enum BadPlacement {
    #[error("cluster.servers must be at least 1")]
    NoServers,
    #[error("no shards to assemble")]
    NoShards,
    /// The erasure code's parameters do not fit this many servers.
    #[error("{servers} servers: {why}")]
    Code { servers: usize, why: String },
    #[error("{shards} shards for a placement over {servers} servers")]
    ShardCount { shards: usize, servers: usize },
    #[error("server {server}'s table {table} has {rows} rows; the placement gives it {placed}")]
    TableRows {
        server: usize,
        table: usize,
        rows: usize,
        placed: usize,
    },
}

impl From<ftrec_fsio::IoAt> for ProtoError {
    fn from(e: ftrec_fsio::IoAt) -> Self {
        Self::Io {
            path: e.path,
            error: e.error,
        }
    }
}

/// A handler that decodes a request with `?` answers with the status it answered before
/// the contract had its own error: the code `PsError` gives the same error (a malformed
/// payload is `InvalidArgument`; `ftrec-rpc` tests that the two agree) and its message.
impl From<ProtoError> for tonic::Status {
    fn from(e: ProtoError) -> Self {
        let code = match &e {
            ProtoError::Malformed(_) | ProtoError::Placement(_) => tonic::Code::InvalidArgument,
            ProtoError::NotATimeline { .. } | ProtoError::TimelineEncode(_) => {
                tonic::Code::InvalidArgument
            }
            ProtoError::Io { .. } | ProtoError::Model(_) => tonic::Code::Internal,
        };
        tonic::Status::new(code, e.to_string())
    }
}
