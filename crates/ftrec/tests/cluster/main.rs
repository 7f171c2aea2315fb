//! Multi-process clusters: `cluster run` with real SIGKILLs, freezes and bit flips, and
//! jobs whose processes are started by hand. One test binary; each module is a former
//! test file, so a test's path names it (`cluster_ec::...`). Every `cluster run` command
//! line comes from `ftrec_testkit::ClusterRun`.

use ftrec_testkit::Ftrec;

mod cluster;
mod cluster_auto;
mod cluster_ec;
mod cluster_etcd;
mod cluster_lifecycle;
mod cluster_outage;
mod cluster_partial;
mod cluster_resume;
mod cluster_safety;
mod cluster_scale;
mod cluster_scrub;
mod cluster_security;
mod cluster_strategies;

/// The binary under test: Cargo sets `CARGO_BIN_EXE_ftrec` only for this package's tests,
/// so the path is handed to the testkit from here.
const FTREC: Ftrec = Ftrec::new(env!("CARGO_BIN_EXE_ftrec"));
