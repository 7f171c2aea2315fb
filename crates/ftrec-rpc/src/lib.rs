//! The runtime every member of the cluster talks through, over the contract of
//! `ftrec-proto`: the errors a caller acts on and how they travel in a gRPC status,
//! authenticated channels, the job every member joins, finding the coordinator in charge,
//! the network seam the simulator replaces, metrics endpoints, and gathering a model from
//! live servers. The contract's own items (messages, wire bytes, placement, timeline) are
//! imported from `ftrec_proto`, not through this crate, so a caller shows which side it
//! needs.

mod error;
#[cfg(target_os = "linux")]
mod retransmit;

pub mod auth;
pub mod client;
pub mod gather;
pub mod hedge;
pub mod job;
pub mod leader;
pub mod loss_watch;
pub mod metrics;
pub mod network;
pub mod stream;
pub mod tail_probe;

pub use error::PsError;
pub use job::Job;

/// How long a server asked to start a spare on its host (`HeartbeatReply.start_spare`) has
/// for that spare to join. The coordinator says so on every heartbeat of that server until
/// the spare joins or this passes (a heartbeat goes over two links at once, and the reply
/// that wins may be the other one's), and asks another server after it; the server starts
/// at most one spare in this long.
pub const SPARE_ASK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(15);
