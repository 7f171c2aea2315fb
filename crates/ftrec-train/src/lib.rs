//! Single-process training: configuration (TOML, presets, `--set` overrides), the training
//! loop over a binary dataset, evaluation, model snapshots, and the training benchmark.

pub mod bench;
pub mod bench_ckpt;
pub mod config;
mod error;
pub mod snapshot;
pub mod trainer;

pub use config::TrainConfig;
pub use error::TrainError;
pub use trainer::{Progress, StepInfo, TrainReport, Trainer};
