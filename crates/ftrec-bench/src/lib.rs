//! The experiments behind BENCHMARKS.md, kept out of the libraries they measure:
//! - `train_step`: the median training step on in-memory batches (`ftrec bench train`);
//! - `ckpt`: the checkpoint strategies side by side, IncrCP's and DECK's experiments
//!   (`ftrec bench ckpt`);
//! - `cpr_study`: CPR's emulation study under injected failures (`ftrec bench cpr`).

pub mod ckpt;
pub mod cpr_study;
pub mod train_step;
