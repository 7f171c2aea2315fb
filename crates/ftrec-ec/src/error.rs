use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum EcError {
    /// A bad `ec.*` setting or combination; the message names the key.
    #[error("{0}")]
    Config(String),
    /// More shards of a stripe are missing than the code can rebuild.
    #[error("stripe has {missing} missing rows; the code rebuilds at most {r}")]
    TooManyLost { missing: usize, r: usize },
    #[error("rows of a stripe differ in length ({0} and {1} bytes)")]
    Ragged(usize, usize),
    #[error("reed-solomon: {0}")]
    Codec(String),
}
