//! The errors of the cluster, one variant per cause a caller acts on. The ones a remote
//! caller must tell apart travel as an `ErrorDetail` in the gRPC status (see the proto)
//! and come back as the same variant through [`PsError::rpc`].

use ftrec_proto::ProtoError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum PsError {
    #[error("configuration: {0}")]
    Config(String),
    /// A malformed or misdirected request (wrong table, row, length or server).
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The request belongs to an older cluster epoch (before a failure and recovery).
    #[error("stale epoch {got}: the cluster is in epoch {current}")]
    StaleEpoch { got: u64, current: u64 },
    /// The receiver declared the caller dead (and may have replaced it): stop, do not retry.
    #[error("fenced: {0}")]
    Fenced(String),
    /// The receiver is not the coordinator in charge; `leader` names it when known.
    #[error("not the leader{}", leader.as_ref().map(|l| format!("; the leader is {l}")).unwrap_or_default())]
    NotLeader { leader: Option<String> },
    /// Short of a resource (memory, queue room); the same request may succeed later.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// The caller did not prove it belongs to this job (job secret, TLS).
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
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
    /// The server's port refused the connection: no process listens there. A SIGKILLed
    /// server's sockets close once the kernel has torn its memory down (tens of ms for a
    /// GB), and from then on every dial is refused at once: the caller may give up now
    /// instead of asking again after waits (two 50 ms waits delayed every SIGKILL's
    /// detection by 0.1 s, issue 45). Anything [`PsError::Unavailable`] allows, it allows.
    #[error("refused: {0}")]
    Refused(String),
    /// The server answered, but what it needed could not be reached (a peer holding parity,
    /// a survivor): a fault elsewhere, in `peer` when known. Kept apart from
    /// [`PsError::Unavailable`] so that a caller does not blame the server that answered: a
    /// worker that reports a step lost names `peer`, not it (blaming it got a healthy
    /// server fenced beside a SIGKILLed neighbour, two of a group lost at once).
    /// `refused`: the peer's port refused the connection ([`PsError::Refused`]).
    #[error("unavailable: {message}")]
    PeerUnavailable {
        peer: Option<u32>,
        message: String,
        refused: bool,
    },
    /// Deterministic mode: the step was applied here already, so the state it was computed
    /// from is gone.
    #[error("server {server} applied step {step} already: the state it was computed from is gone")]
    AlreadyApplied { server: u32, step: u64 },
    /// 2PC phase 2 for a step this server does not hold prepared (aborted, or its prepare
    /// failed): it cannot commit here.
    #[error(
        "server {server}: step {step} of epoch {epoch} is not prepared here (aborted, or its prepare failed): it cannot commit"
    )]
    NotPrepared { server: u32, step: u64, epoch: u64 },
    /// The work was replaced by newer work (a restore, a newer rebuild): not a failure.
    #[error("superseded: {0}")]
    Superseded(String),
    /// Lost state cannot be decoded now: survivors unreachable, or disagreeing on the steps
    /// they hold.
    #[error("degraded: {0}")]
    Degraded(String),
    /// The run cannot go on (a loss beyond what its redundancy covers, a failed run).
    #[error("{0}")]
    Fatal(String),
    /// The member or the run was stopped (a signal, its launcher gone, told to stop).
    #[error("stopped: {0}")]
    Stopped(String),
    /// The job's etcd (`cluster.membership = "etcd"`): unreachable, another job's prefix,
    /// a changed job file, or this coordinator deposed. The message names the endpoint or
    /// key.
    #[error("{0}")]
    Membership(#[from] ftrec_etcd::EtcdError),
    /// A broken invariant inside this process (a poisoned lock, a lost task).
    #[error("internal: {0}")]
    Internal(String),
    #[error("{what}: {message}")]
    Rpc { what: String, message: String },
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("{what}: {error}")]
    Ec {
        what: String,
        error: ftrec_ec::EcError,
    },
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

impl From<ftrec_ec::EcError> for PsError {
    fn from(error: ftrec_ec::EcError) -> Self {
        Self::Ec {
            what: "erasure coding".into(),
            error,
        }
    }
}

impl PsError {
    /// This process could not reach `server` (transport): as its callers must hear it, a
    /// fault of that server and not of this one. Anything else is kept as it is (a
    /// relayed [`PsError::PeerUnavailable`] already names its server).
    pub fn blaming(self, server: usize) -> Self {
        match self {
            Self::Unavailable(message) => Self::PeerUnavailable {
                peer: Some(server as u32),
                message,
                refused: false,
            },
            Self::Refused(message) => Self::PeerUnavailable {
                peer: Some(server as u32),
                message,
                refused: true,
            },
            other => other,
        }
    }

    /// The server a failed call could not reach: `called` itself when its transport
    /// failed, the peer it names when it answered that a peer was unreachable, none
    /// otherwise (an answer is not an unreachable server).
    pub fn unreachable_server(&self, called: usize) -> Option<usize> {
        match self {
            Self::Unavailable(_) | Self::Refused(_) => Some(called),
            Self::PeerUnavailable { peer, .. } => peer.map(|p| p as usize),
            _ => None,
        }
    }

    /// A connection was refused, by the callee or by the peer it names: nobody listens
    /// there, so the same call would be refused again.
    pub fn is_refused(&self) -> bool {
        matches!(
            self,
            Self::Refused(_) | Self::PeerUnavailable { refused: true, .. }
        )
    }

    /// The checkpoint name a write found taken (committed history is never overwritten),
    /// for a caller without `ftrec-ckpt` of its own.
    pub fn taken_name(&self) -> Option<&str> {
        match self {
            Self::Checkpoint(ftrec_ckpt::CkptError::AlreadyExists { key }) => Some(key),
            _ => None,
        }
    }

    /// An erasure-coding error with what was being coded.
    pub fn ec(what: impl Into<String>, error: ftrec_ec::EcError) -> Self {
        Self::Ec {
            what: what.into(),
            error,
        }
    }
}

/// Each contract error as the variant it was before the contract had its own type, so a
/// remote caller gets the same status code and message: a malformed payload or record is
/// a bad request (`InvalidArgument`), a placement that does not fit a configuration error.
impl From<ProtoError> for PsError {
    fn from(e: ProtoError) -> Self {
        match e {
            ProtoError::Malformed(m) => Self::BadRequest(m.to_string()),
            ProtoError::Placement(p) => Self::Config(p.to_string()),
            ProtoError::Io { path, error } => Self::Io {
                path: path.display().to_string(),
                error,
            },
            ProtoError::NotATimeline { path, error } => {
                Self::Config(format!("{}: not a timeline: {error}", path.display()))
            }
            ProtoError::TimelineEncode(error) => Self::Config(error.to_string()),
            ProtoError::Model(error) => Self::Model(error),
        }
    }
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
        use ftrec_proto::proto::error_detail::Kind;
        use prost::Message;
        let what = what.into();
        if let Ok(detail) = ftrec_proto::proto::ErrorDetail::decode(status.details()) {
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
                Some(Kind::Unavailable(u)) => {
                    // The other side answered: what it could not reach is elsewhere.
                    return Self::PeerUnavailable {
                        peer: u.peer,
                        message: format!("{what}: {}", status.message()),
                        refused: u.refused,
                    };
                }
                Some(Kind::AlreadyApplied(a)) => {
                    return Self::AlreadyApplied {
                        server: a.server,
                        step: a.step,
                    };
                }
                Some(Kind::Fenced(_)) => {
                    return Self::Fenced(format!("{what}: {}", status.message()));
                }
                Some(Kind::NotLeader(n)) => {
                    return Self::NotLeader {
                        leader: Some(n.leader).filter(|l| !l.is_empty()),
                    };
                }
                Some(Kind::Overloaded(_)) => {
                    return Self::Overloaded(format!("{what}: {}", status.message()));
                }
                Some(Kind::NotPrepared(n)) => {
                    return Self::NotPrepared {
                        server: n.server,
                        step: n.step,
                        epoch: n.epoch,
                    };
                }
                Some(Kind::Superseded(_)) => {
                    return Self::Superseded(format!("{what}: {}", status.message()));
                }
                Some(Kind::CheckpointExists(c)) => {
                    return Self::Checkpoint(ftrec_ckpt::CkptError::AlreadyExists { key: c.key });
                }
                None => {}
            }
        }
        match status.code() {
            tonic::Code::Unauthenticated => {
                Self::Unauthenticated(format!("{what}: {}", status.message()))
            }
            tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown
                if status.details().is_empty() =>
            {
                if connection_refused(status) {
                    Self::Refused(format!("{what}: {}: connection refused", status.message()))
                } else {
                    Self::Unavailable(format!("{what}: {}", status.message()))
                }
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
            Self::NotOwner { .. }
                | Self::Recovering { .. }
                | Self::Unavailable(_)
                | Self::Refused(_)
                | Self::PeerUnavailable { .. }
                | Self::Overloaded(_)
        )
    }

    fn detail(&self) -> Option<ftrec_proto::proto::ErrorDetail> {
        use ftrec_proto::proto::error_detail::Kind;
        use ftrec_proto::proto::{
            AlreadyApplied, CheckpointExists, Fenced, NotLeader, NotOwner, NotPrepared, Overloaded,
            Recovering, StaleEpoch, Superseded, Unavailable,
        };
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
            Self::Unavailable(_) => Kind::Unavailable(Unavailable {
                peer: None,
                refused: false,
            }),
            Self::Refused(_) => Kind::Unavailable(Unavailable {
                peer: None,
                refused: true,
            }),
            Self::PeerUnavailable { peer, refused, .. } => {
                Kind::Unavailable(Unavailable { peer, refused })
            }
            Self::AlreadyApplied { server, step } => {
                Kind::AlreadyApplied(AlreadyApplied { server, step })
            }
            Self::Fenced(_) => Kind::Fenced(Fenced {}),
            Self::NotLeader { ref leader } => Kind::NotLeader(NotLeader {
                leader: leader.clone().unwrap_or_default(),
            }),
            Self::Overloaded(_) => Kind::Overloaded(Overloaded {}),
            Self::NotPrepared {
                server,
                step,
                epoch,
            } => Kind::NotPrepared(NotPrepared {
                server,
                step,
                epoch,
            }),
            Self::Superseded(_) => Kind::Superseded(Superseded {}),
            Self::Checkpoint(ftrec_ckpt::CkptError::AlreadyExists { ref key }) => {
                Kind::CheckpointExists(CheckpointExists { key: key.clone() })
            }
            _ => return None,
        };
        Some(ftrec_proto::proto::ErrorDetail { kind: Some(kind) })
    }
}

impl From<PsError> for tonic::Status {
    fn from(e: PsError) -> Self {
        use prost::Message;
        let code = match &e {
            PsError::BadRequest(_) | PsError::Config(_) => tonic::Code::InvalidArgument,
            PsError::StaleEpoch { .. }
            | PsError::AlreadyApplied { .. }
            | PsError::NotLeader { .. }
            | PsError::NotPrepared { .. } => tonic::Code::FailedPrecondition,
            PsError::NotOwner { .. } => tonic::Code::InvalidArgument,
            PsError::Recovering { .. }
            | PsError::Unavailable(_)
            | PsError::Refused(_)
            | PsError::PeerUnavailable { .. }
            | PsError::Degraded(_) => tonic::Code::Unavailable,
            PsError::Fenced(_) => tonic::Code::PermissionDenied,
            PsError::Unauthenticated(_) => tonic::Code::Unauthenticated,
            PsError::Overloaded(_) => tonic::Code::ResourceExhausted,
            PsError::Superseded(_) | PsError::Stopped(_) | PsError::Fatal(_) => {
                tonic::Code::Aborted
            }
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

/// Whether a transport failure was a refused connection: tonic says only "tcp connect
/// error" at the top, and the `io::Error` beneath it says why.
fn connection_refused(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::ConnectionRefused
        {
            return true;
        }
        source = cause.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::PsError;
    use ftrec_proto::ProtoError;
    use ftrec_proto::error::{BadPlacement, Malformed};

    /// A contract error reaches a caller, local or remote, as it did when the contract
    /// returned `PsError`: same message, same variant, same status code.
    #[test]
    fn contract_errors_keep_their_messages_and_status_codes() {
        let json = || serde_json::from_str::<u32>("x").unwrap_err();
        let cases = || {
            [
                ProtoError::from(Malformed::Ragged {
                    what: "pull rows".into(),
                    len: 3,
                }),
                ProtoError::from(BadPlacement::NoServers),
                ProtoError::Io {
                    path: "/run/timeline.json".into(),
                    error: std::io::Error::from(std::io::ErrorKind::NotFound),
                },
                ProtoError::NotATimeline {
                    path: "/run/t.json".into(),
                    error: json(),
                },
                ProtoError::TimelineEncode(json()),
                ProtoError::Model(ftrec_model::ModelError::Config("dim".into())),
            ]
        };
        for (e, again) in cases().into_iter().zip(cases()) {
            let shown = e.to_string();
            let direct = tonic::Status::from(e);
            let ps = PsError::from(again);
            assert_eq!(ps.to_string(), shown);
            let via = tonic::Status::from(ps);
            assert_eq!(
                (direct.code(), direct.message()),
                (via.code(), via.message())
            );
        }
        let ragged = ftrec_proto::wire::bytes_to_u32s(&[0; 3], "pull rows").unwrap_err();
        assert!(matches!(PsError::from(ragged), PsError::BadRequest(ref m)
            if m == "pull rows: 3 bytes is not a whole number of 4-byte values"));
        let layout = ftrec_proto::placement::Layout::new(0).unwrap_err();
        assert_eq!(
            PsError::from(layout).to_string(),
            "configuration: cluster.servers must be at least 1"
        );
    }

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
            PsError::NotLeader {
                leader: Some("10.0.0.2:7000".into()),
            },
            PsError::NotLeader { leader: None },
            PsError::NotPrepared {
                server: 2,
                step: 40,
                epoch: 3,
            },
            PsError::Checkpoint(ftrec_ckpt::CkptError::AlreadyExists {
                key: "server-1/ckpt-000040".into(),
            }),
        ];
        for e in cases {
            let shown = e.to_string();
            let status: tonic::Status = e.into();
            let back = PsError::rpc("pull", &status);
            assert_eq!(back.to_string(), shown);
        }
        // A server that answers "unavailable" relays a fault elsewhere (a peer it needed):
        // it is not itself unreachable, and the caller must be able to tell.
        let back = PsError::rpc("push", &PsError::Unavailable("down".into()).into());
        assert!(matches!(back, PsError::PeerUnavailable { peer: None, .. }) && back.is_retryable());
        let named = PsError::PeerUnavailable {
            peer: Some(1),
            message: "parity update to server 1: tcp connect error".into(),
            refused: false,
        };
        let relayed = PsError::rpc("prepare to server 0", &named.into());
        assert!(
            matches!(relayed, PsError::PeerUnavailable { peer: Some(1), ref message, refused: false }
                if message.contains("parity update to server 1")),
            "{relayed:?}"
        );
        assert!(!relayed.is_refused());
        // A refusal relayed by the server that met it stays a refusal of that peer.
        let refused = PsError::Refused("parity update to server 1: tcp connect error".into());
        let relayed = PsError::rpc("prepare to server 0", &refused.blaming(1).into());
        assert!(
            matches!(
                relayed,
                PsError::PeerUnavailable {
                    peer: Some(1),
                    refused: true,
                    ..
                }
            ),
            "{relayed:?}"
        );
        assert!(relayed.is_refused() && relayed.is_retryable());
        let fenced = PsError::rpc("heartbeat", &PsError::Fenced("declared dead".into()).into());
        assert!(matches!(fenced, PsError::Fenced(ref m) if m.contains("declared dead")));
        assert!(!fenced.is_retryable());
        let busy = PsError::rpc("push", &PsError::Overloaded("memory".into()).into());
        assert!(matches!(busy, PsError::Overloaded(_)) && busy.is_retryable());
        let old = PsError::rpc("rebuild", &PsError::Superseded("a restore".into()).into());
        assert!(matches!(old, PsError::Superseded(_)));
        // A cut whose name was taken: the coordinator tells it from any other failed write.
        let taken = PsError::Checkpoint(ftrec_ckpt::CkptError::AlreadyExists { key: "k".into() });
        let back = PsError::rpc("cut committed", &taken.into());
        assert!(
            matches!(back, PsError::Checkpoint(ftrec_ckpt::CkptError::AlreadyExists { ref key }) if key == "k"),
            "{back:?}"
        );
        let stranger = PsError::rpc("pull", &tonic::Status::unauthenticated("no secret"));
        assert!(matches!(stranger, PsError::Unauthenticated(_)));
        let plain = PsError::rpc("pull", &tonic::Status::internal("boom"));
        assert!(matches!(plain, PsError::Rpc { .. }) && !plain.is_retryable());
        let transport = PsError::rpc("pull", &tonic::Status::unavailable("connection refused"));
        assert!(matches!(transport, PsError::Unavailable(_)));
    }
}
