//! The trainer's integration tests, one binary; each module is a former test file.

mod determinism;
mod learning;
