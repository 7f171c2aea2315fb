use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TrainError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Job(#[from] ftrec_config::ConfigError),
    #[error(transparent)]
    Model(#[from] ftrec_model::ModelError),
    #[error(transparent)]
    Data(#[from] ftrec_data::DataError),
    #[error(transparent)]
    Checkpoint(#[from] ftrec_ckpt::CkptError),
    /// The io error is shown in the message rather than chained as a source, so a
    /// report prints it once.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: {message}")]
    Snapshot { path: PathBuf, message: String },
    #[error("thread pool: {0}")]
    Threads(String),
}
