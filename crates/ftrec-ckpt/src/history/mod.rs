//! The history of checkpoints: branches, the writer and merger leases, the fence records
//! that keep a superseded writer's late commits out of every restore, retention and
//! garbage collection, and the start of a writing session.

pub mod branch;
pub mod fence;
pub mod lease;
pub(crate) mod retention;
pub(crate) mod session;
