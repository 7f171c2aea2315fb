use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TrainError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Model(#[from] ftrec_model::ModelError),
    #[error(transparent)]
    Data(#[from] ftrec_data::DataError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Snapshot { path: PathBuf, message: String },
    #[error("thread pool: {0}")]
    Threads(String),
}
