//! The contract between the cluster's roles. Servers, workers, the coordinator and the
//! launcher depend on this crate and never on each other: everything one role says to
//! another is a message of `proto/ftrec.proto`, typed here.
//!
//! - `proto`: the generated gRPC services and messages;
//! - `wire`, `error`: how rows travel as bytes, and the errors a client acts on;
//! - `state`: placement (which server holds which row), applied steps, and the reassembly
//!   of a global model from shards;
//! - `net`: authenticated channels, the job every member joins, metrics endpoints;
//! - `timeline`: the run's typed event stream.

mod error;
pub mod net;
pub mod state;
pub mod timeline;
pub mod wire;

pub mod proto {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("ftrec.v1");
}

pub use error::PsError;
pub use net::job::Job;
pub use net::{auth, client, job, leader, metrics, network};
pub use state::{applied, assemble, gather, identity, placement};
