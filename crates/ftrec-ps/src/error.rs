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
    /// A row sent to a server that does not hold it: the sender's placement map is stale.
    #[error("row {row} of table {table} belongs to server {owner} (stale placement map?)")]
    NotOwner { table: u32, row: u32, owner: u32 },
    /// Rows being rebuilt; the same request succeeds once they are.
    #[error("rows {first_row}..{end_row} of table {table} are being rebuilt")]
    Recovering {
        table: u32,
        first_row: u32,
        end_row: u32,
    },
    /// The server (or the connection to it) cannot serve now: it may be dead.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Deterministic mode: the step was applied here already, so the state it was computed
    /// from is gone.
    #[error("server {server} applied step {step} already: the state it was computed from is gone")]
    AlreadyApplied { server: u32, step: u64 },
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
    Job(#[from] ftrec_config::ConfigError),
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
    /// A failed call, typed from the status details the other side attached (see
    /// `ErrorDetail` in the proto); transport failures are [`PsError::Unavailable`].
    pub fn rpc(what: impl Into<String>, status: &tonic::Status) -> Self {
        use crate::proto::error_detail::Kind;
        use prost::Message;
        let what = what.into();
        if let Ok(detail) = crate::proto::ErrorDetail::decode(status.details()) {
            match detail.kind {
                Some(Kind::NotOwner(n)) => {
                    return Self::NotOwner {
                        table: n.table,
                        row: n.row,
                        owner: n.owner,
                    };
                }
                Some(Kind::Recovering(r)) => {
                    return Self::Recovering {
                        table: r.table,
                        first_row: r.first_row,
                        end_row: r.end_row,
                    };
                }
                Some(Kind::StaleEpoch(e)) => {
                    return Self::StaleEpoch {
                        got: e.got,
                        current: e.current,
                    };
                }
                Some(Kind::Unavailable(_)) => {
                    return Self::Unavailable(format!("{what}: {}", status.message()));
                }
                Some(Kind::AlreadyApplied(a)) => {
                    return Self::AlreadyApplied {
                        server: a.server,
                        step: a.step,
                    };
                }
                None => {}
            }
        }
        match status.code() {
            tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown
                if status.details().is_empty() =>
            {
                Self::Unavailable(format!("{what}: {}", status.message()))
            }
            _ => Self::Rpc {
                what,
                message: format!("{:?}: {}", status.code(), status.message()),
            },
        }
    }

    /// Whether the same request may succeed if sent again shortly (to the same or a
    /// refreshed placement).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::NotOwner { .. } | Self::Recovering { .. } | Self::Unavailable(_)
        )
    }

    fn detail(&self) -> Option<crate::proto::ErrorDetail> {
        use crate::proto::error_detail::Kind;
        use crate::proto::{AlreadyApplied, NotOwner, Recovering, StaleEpoch, Unavailable};
        let kind = match *self {
            Self::NotOwner { table, row, owner } => Kind::NotOwner(NotOwner { table, row, owner }),
            Self::Recovering {
                table,
                first_row,
                end_row,
            } => Kind::Recovering(Recovering {
                table,
                first_row,
                end_row,
            }),
            Self::StaleEpoch { got, current } => Kind::StaleEpoch(StaleEpoch { got, current }),
            Self::Unavailable(_) => Kind::Unavailable(Unavailable {}),
            Self::AlreadyApplied { server, step } => {
                Kind::AlreadyApplied(AlreadyApplied { server, step })
            }
            _ => return None,
        };
        Some(crate::proto::ErrorDetail { kind: Some(kind) })
    }
}

impl From<PsError> for tonic::Status {
    fn from(e: PsError) -> Self {
        use prost::Message;
        let code = match &e {
            PsError::Request(_) | PsError::Config(_) => tonic::Code::InvalidArgument,
            PsError::StaleEpoch { .. } | PsError::AlreadyApplied { .. } => {
                tonic::Code::FailedPrecondition
            }
            PsError::NotOwner { .. } => tonic::Code::InvalidArgument,
            PsError::Recovering { .. } | PsError::Unavailable(_) => tonic::Code::Unavailable,
            PsError::Refused(_) => tonic::Code::PermissionDenied,
            PsError::Timeout(_) => tonic::Code::DeadlineExceeded,
            _ => tonic::Code::Internal,
        };
        let message = e.to_string();
        match e.detail() {
            Some(d) => tonic::Status::with_details(code, message, d.encode_to_vec().into()),
            None => tonic::Status::new(code, message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PsError;

    #[test]
    fn typed_errors_survive_the_wire() {
        let cases = [
            PsError::NotOwner {
                table: 3,
                row: 17,
                owner: 1,
            },
            PsError::Recovering {
                table: 0,
                first_row: 10,
                end_row: 20,
            },
            PsError::StaleEpoch { got: 2, current: 5 },
            PsError::AlreadyApplied { server: 1, step: 9 },
        ];
        for e in cases {
            let shown = e.to_string();
            let status: tonic::Status = e.into();
            let back = PsError::rpc("pull", &status);
            assert_eq!(back.to_string(), shown);
        }
        let back = PsError::rpc("push", &PsError::Unavailable("down".into()).into());
        assert!(matches!(back, PsError::Unavailable(_)) && back.is_retryable());
        let plain = PsError::rpc("pull", &tonic::Status::internal("boom"));
        assert!(matches!(plain, PsError::Rpc { .. }) && !plain.is_retryable());
        let transport = PsError::rpc("pull", &tonic::Status::unavailable("connection refused"));
        assert!(matches!(transport, PsError::Unavailable(_)));
    }
}
