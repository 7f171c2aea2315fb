//! The parameter-server cluster: sharded servers applying optimizers, stateless workers
//! pulling rows and pushing gradients, and a coordinator for membership, failure detection,
//! consistent checkpoints and recovery. All processes talk gRPC over TCP (tonic).

pub mod applied;
pub mod assemble;
pub mod auth;
pub mod client;
pub mod coordinator;
mod error;
pub mod faults;
pub mod gather;
pub mod job;
pub mod launch;
pub mod metrics;
pub mod parity_check;
pub mod placement;
pub mod server;
pub mod shard;
pub mod shard_client;
pub mod timeline;
pub mod wire;
pub mod worker;

pub mod proto {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("ftrec.v1");
}

pub use error::PsError;
pub use job::Job;
