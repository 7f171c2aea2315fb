//! The history of checkpoints: branches, the writer and merger leases, retention and
//! garbage collection, and the start of a writing session.

pub mod branch;
pub mod lease;
pub(crate) mod retention;
pub(crate) mod session;
