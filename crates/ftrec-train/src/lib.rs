//! Single-process training: the training loop over a binary dataset, evaluation and model
//! snapshots. The configuration is `ftrec-config`'s; the experiments built on it live in
//! `ftrec-bench`.

mod error;
pub mod snapshot;
pub mod trainer;

pub use error::TrainError;
pub use trainer::{Progress, StepInfo, TrainReport, Trainer, table_pages};
