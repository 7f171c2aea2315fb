use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CkptError {
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// Damage or a format violation in a stored object, with where it was found.
    #[error("{key}: {message}")]
    Corrupt { key: String, message: String },
    #[error("{0}")]
    NotFound(String),
    /// A write found its name taken: committed history is never overwritten.
    #[error("{key} already exists; checkpoint files are never overwritten")]
    AlreadyExists { key: String },
    /// A compare-and-swap found the object changed by someone else.
    #[error("{0}")]
    Conflict(String),
    /// Another live process holds the lease this one needs.
    #[error("{0}")]
    Busy(String),
    /// This writer's lease was taken over (its successor writes the location now), so it
    /// commits nothing more; or a checkpoint is such a writer's late commit, never
    /// restored.
    #[error("{0}")]
    Fenced(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Model(#[from] ftrec_model::ModelError),
}

impl From<ftrec_fsio::IoAt> for CkptError {
    fn from(e: ftrec_fsio::IoAt) -> Self {
        Self::Io {
            path: e.path,
            error: e.error,
        }
    }
}

impl CkptError {
    pub fn corrupt(key: &str, message: impl Into<String>) -> Self {
        Self::Corrupt {
            key: key.to_string(),
            message: message.into(),
        }
    }
}
