//! Leading with a standby (`cluster.membership = "etcd"`): the durable record a standby
//! needs (`durable.rs`), and how a standby that won the election takes the job over
//! (`takeover.rs`).

pub(crate) mod durable;
pub mod progress;
pub(crate) mod takeover;
