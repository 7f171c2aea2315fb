//! A job's control-plane state in etcd (issue 22): the claim that a key prefix belongs to
//! one job and one configuration, the election of the coordinator that leads it (a lease
//! plus a transaction), writes that only the current leader can make, and the leader's
//! address for servers and workers to find.
//!
//! Files: `store.rs` connects and reads, and claims the prefix; `election.rs` elects and
//! renews; `fenced.rs` writes only as the leader, never over a newer write; `local.rs` starts a real etcd on loopback for tests and benchmarks.

mod election;
mod error;
mod fenced;
pub mod local;
mod store;

pub use election::{LeaderInfo, Leadership};
pub use error::EtcdError;
pub use store::{Etcd, EtcdOptions, JobClaim, validate_prefix};
