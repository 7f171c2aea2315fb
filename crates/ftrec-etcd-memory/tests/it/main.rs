//! The in-memory etcd, one binary: its conformance with a real etcd server, and its use
//! under simulated time.

mod conformance;
mod simulation;
