//! The checkpoint strategies (full, differential, naive-incremental, IncrCP, DECK), the
//! delta tracker they share, and merging.

pub(crate) mod config;
pub mod deck;
pub mod incrcp;
pub(crate) mod incrcp_worker;
pub mod merge;
pub(crate) mod partial;
pub(crate) mod policy;
pub mod tracker;
