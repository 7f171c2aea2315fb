use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum CprError {
    /// A quantity of the overhead model is out of its domain; the message names it.
    #[error("cpr: {0}")]
    Invalid(String),
}
