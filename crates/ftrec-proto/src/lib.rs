//! The contract between the cluster's roles. Servers, workers, the coordinator and the
//! launcher depend on this crate and never on each other: everything one role says to
//! another is a message of `proto/ftrec.proto`, typed here. The runtime that sends those
//! messages (channels, the job, the errors a caller acts on) is `ftrec-rpc`; this crate
//! stays free of it, and of the storage stack, so that anything speaking the protocol can
//! depend on it cheaply.
//!
//! - `proto`: the generated gRPC services and messages;
//! - `wire`: how rows travel as bytes;
//! - `state`: placement (which server holds which row), applied steps, shard identities,
//!   and the reassembly of a global model from shards;
//! - `timeline`: the run's typed event stream;
//! - `error`: what goes wrong decoding any of these (`ProtoError`).

pub mod error;
pub mod state;
pub mod timeline;
pub mod wire;

pub mod proto {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("ftrec.v1");
}

pub use error::ProtoError;
pub use state::{applied, assemble, identity, placement};
