//! What the workspace's integration tests share, as one crate instead of source files
//! included across crates: the servers tests start (moto's S3, Azurite, etcd), the `ftrec` binary's helpers, the one `cluster run` argument builder, and the
//! model states the checkpoint tests save.
//!
//! A dependency that a test needs and this machine lacks fails the test, naming the
//! missing piece and `./scripts/test-deps`: a test never skips itself ([`deps`]).
//!
//! The `ftrec` binary's path is known only to the ftrec package's own tests
//! (`env!("CARGO_BIN_EXE_ftrec")`), so they hand it in: [`cli::Ftrec::new`].

pub mod azurite;
pub mod by_hand;
pub mod cli;
pub mod cluster;
pub mod deps;
pub mod etcd;
pub mod loopback;
pub mod model;
pub mod moto;

pub use cli::Ftrec;
pub use cluster::ClusterRun;
