//! Single-process training: the training loop over a binary dataset, evaluation, model
//! snapshots, and the training benchmark. The configuration is `ftrec-config`'s.

pub mod bench;
pub mod bench_ckpt;
pub mod cpr_study;
mod error;
pub mod snapshot;
pub mod trainer;

pub use error::TrainError;
pub use trainer::{Progress, StepInfo, TrainReport, Trainer};
