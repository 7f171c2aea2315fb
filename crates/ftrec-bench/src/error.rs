//! The benches' one error type. Each variant keeps the context the failure happened in (the
//! file, the process, the flag), so that the binary, which prints the whole chain, says
//! where as well as what.

use std::error::Error as StdError;

/// An error a foreign piece of code gave back as a box: the binary's hooks (`Host`),
/// plotters' drawing errors.
pub type Boxed = Box<dyn StdError + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A flag or a combination the bench cannot run with (`--rounds 0`, an unknown
    /// strategy).
    #[error("{0}")]
    Usage(String),
    /// A file or directory the bench read or wrote.
    #[error("{path}")]
    File {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A step of the bench that failed: a process it started (the binary itself, the
    /// namespace harness), a measurement that came out wrong.
    #[error("{0}")]
    Failed(String),
    /// An I/O failure while doing `what`: starting a process, a loopback copy.
    #[error("{what}")]
    IoDuring {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A report that is not the JSON it should be.
    #[error("{what}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// A plot that could not be drawn or written (`what`: its file).
    #[error("{what}")]
    Plot {
        what: String,
        #[source]
        source: Boxed,
    },
    /// etcd on loopback, started for the coordinator bench.
    #[error("{what}")]
    Etcd {
        what: &'static str,
        #[source]
        source: ftrec_etcd::local::LocalEtcdError,
    },
    /// A failure inside one named run of a bench (`shoot-out run rare-ec-r1`).
    #[error("{what}")]
    Run {
        what: String,
        #[source]
        source: Box<BenchError>,
    },
    /// What the binary lent (dataset generation, evaluation, `--ft auto`) failed.
    #[error(transparent)]
    Host(Boxed),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    SerdeJson(#[from] serde_json::Error),
    #[error(transparent)]
    Config(#[from] ftrec_config::ConfigError),
    #[error(transparent)]
    Cluster(#[from] ftrec_rpc::PsError),
    /// A file of the cluster's contract (a run's timeline) could not be read.
    #[error(transparent)]
    Contract(#[from] ftrec_proto::ProtoError),
    #[error(transparent)]
    Train(#[from] ftrec_train::TrainError),
    #[error(transparent)]
    Data(#[from] ftrec_data::DataError),
    #[error(transparent)]
    Model(#[from] ftrec_model::ModelError),
    #[error(transparent)]
    Fmt(#[from] std::fmt::Error),
}

impl BenchError {
    /// `source` while reading or writing `path`.
    pub fn file(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| Self::File {
            path: path.display().to_string(),
            source,
        }
    }
}

/// Plotters' errors with the plot they were drawing.
pub(crate) trait Drawing<T> {
    /// Drawing into `path` failed.
    fn drawing(self, path: &std::path::Path) -> Result<T>;
    /// Writing `path` out failed.
    fn writing(self, path: &std::path::Path) -> Result<T>;
}

impl<T, E: StdError + Send + Sync + 'static> Drawing<T> for std::result::Result<T, E> {
    fn drawing(self, path: &std::path::Path) -> Result<T> {
        self.map_err(|e| BenchError::Plot {
            what: path.display().to_string(),
            source: Box::new(e),
        })
    }

    fn writing(self, path: &std::path::Path) -> Result<T> {
        self.map_err(|e| BenchError::Plot {
            what: format!("writing {}", path.display()),
            source: Box::new(e),
        })
    }
}

pub type Result<T, E = BenchError> = std::result::Result<T, E>;
