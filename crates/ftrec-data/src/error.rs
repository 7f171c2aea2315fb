use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum DataError {
    /// The io error is shown in the message rather than chained as a source, so a
    /// report prints it once.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
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

impl From<ftrec_fsio::IoAt> for DataError {
    fn from(e: ftrec_fsio::IoAt) -> Self {
        Self::io(e.path, e.error)
    }
}

impl DataError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            error: source,
        }
    }
    pub fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Format {
            path: path.into(),
            message: message.into(),
        }
    }
}
