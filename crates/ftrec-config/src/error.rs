use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConfigError {
    /// A bad value or combination; the message names the key.
    #[error("configuration: {0}")]
    Invalid(String),
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] ftrec_model::ModelError),
    #[error(transparent)]
    Checkpoint(#[from] ftrec_ckpt::CkptError),
}
