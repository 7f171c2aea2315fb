//! The data crate's integration tests, one binary; each module is a former test file.

mod convert;
mod formats;
