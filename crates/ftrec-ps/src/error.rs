use thiserror::Error;

#[derive(Debug, Error)]
pub enum PsError {
    #[error("configuration: {0}")]
    Config(String),
    /// A malformed or misdirected request (wrong table, row, length or server).
    #[error("bad request: {0}")]
    Request(String),
    /// The request belongs to an older cluster epoch (before a failure and recovery).
    #[error("stale epoch {got}: the cluster is in epoch {current}")]
    StaleEpoch { got: u64, current: u64 },
    #[error("{what}: {message}")]
    Rpc { what: String, message: String },
    #[error("{0}")]
    Refused(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error(transparent)]
    Model(#[from] ftrec_model::ModelError),
    #[error(transparent)]
    Data(#[from] ftrec_data::DataError),
    #[error(transparent)]
    Checkpoint(#[from] ftrec_ckpt::CkptError),
    #[error(transparent)]
    Train(#[from] ftrec_train::TrainError),
    #[error("{path}: {error}")]
    Io { path: String, error: std::io::Error },
}

impl From<ftrec_fsio::IoAt> for PsError {
    fn from(e: ftrec_fsio::IoAt) -> Self {
        Self::Io {
            path: e.path.display().to_string(),
            error: e.error,
        }
    }
}

impl PsError {
    pub fn rpc(what: impl Into<String>, status: &tonic::Status) -> Self {
        Self::Rpc {
            what: what.into(),
            message: format!("{:?}: {}", status.code(), status.message()),
        }
    }
}

impl From<PsError> for tonic::Status {
    fn from(e: PsError) -> Self {
        match &e {
            PsError::Request(_) | PsError::Config(_) => {
                tonic::Status::invalid_argument(e.to_string())
            }
            PsError::StaleEpoch { .. } => tonic::Status::failed_precondition(e.to_string()),
            PsError::Refused(_) => tonic::Status::permission_denied(e.to_string()),
            PsError::Timeout(_) => tonic::Status::deadline_exceeded(e.to_string()),
            _ => tonic::Status::internal(e.to_string()),
        }
    }
}
