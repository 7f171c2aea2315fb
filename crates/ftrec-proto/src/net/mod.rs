//! Talking to other members: authenticated channels, the job, metrics endpoints.

pub mod auth;
pub mod client;
pub mod job;
pub mod leader;
pub mod metrics;
pub mod network;
