use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Parse {
        path: PathBuf,
        line: u64,
        message: String,
    },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{path}: invalid schema: {message}")]
    Schema { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
}

impl DataError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
    pub fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Format {
            path: path.into(),
            message: message.into(),
        }
    }
}
