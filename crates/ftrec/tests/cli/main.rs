//! The `ftrec` binary driven one command at a time: the CLI's contracts, inputs that used
//! to crash it, checkpoint history and checkpoints through the CLI. One test binary; each
//! module is a former test file, so a test's path names it (`history::...`).

use ftrec_testkit::Ftrec;

mod checkpoint;
mod cli;
mod cli_hardening;
mod history;

/// The binary under test: Cargo sets `CARGO_BIN_EXE_ftrec` only for this package's tests,
/// so the path is handed to the testkit from here.
const FTREC: Ftrec = Ftrec::new(env!("CARGO_BIN_EXE_ftrec"));
