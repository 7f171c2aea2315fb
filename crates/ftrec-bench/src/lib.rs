//! The experiments behind BENCHMARKS.md, kept out of the libraries they measure. One module
//! per `ftrec bench` subcommand:
//! - `train_step`: the median training step on in-memory batches (`bench train`);
//! - `ckpt`: the checkpoint strategies side by side, IncrCP's and DECK's experiments
//!   (`bench ckpt`);
//! - `cpr_study`: CPR's emulation study under injected failures (`bench cpr`);
//! - `cluster`: the cluster against the single-process trainer, checkpoint pauses, a
//!   SIGKILL to training resumed (`bench cluster`);
//! - `ec`: ECRec's figures against no fault tolerance and checkpoints (`bench ec`);
//! - `faults`: silent failures across network namespaces, reduced (`bench faults`);
//! - `coordinator`: the coordinator in etcd, failovers (`bench coordinator`);
//! - `shootout`: every fault tolerance strategy under one failure schedule
//!   (`bench shootout`).
//!
//! Shared by the cluster benches: `cluster_run` (the dataset and one launched run),
//! `run_record` (a run's report as the figures read it, live or recorded), `rounds`
//! (medians over rounds), `timeline_plot` (a run's throughput drawn), `loopback` (the
//! host's TCP ceiling). `host` is what the binary lends them; `error` their error.
//! The binary keeps only the flags and the printing.

pub mod ckpt;
pub mod cluster;
pub mod cluster_run;
pub mod coordinator;
pub mod cpr_study;
pub mod ec;
pub mod error;
pub mod faults;
pub mod host;
pub mod loopback;
pub mod rounds;
pub mod run_record;
pub mod shootout;
pub mod soak;
pub mod timeline_plot;
pub mod train_step;

pub use error::BenchError;
pub use host::Host;
