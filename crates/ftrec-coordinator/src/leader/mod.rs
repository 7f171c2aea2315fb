//! Leading with a standby (`cluster.membership = "etcd"`): the durable record a standby
//! needs (`durable.rs`), how a standby that won the election takes the job over
//! (`takeover.rs`), and the spares an earlier leader gave slots through an etcd outage,
//! without a record (`spare_claims.rs`).

pub(crate) mod durable;
pub mod progress;
pub(crate) mod spare_claims;
pub(crate) mod takeover;
