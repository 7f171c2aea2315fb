//! One module per command, each with the clap arguments it takes beside the code that
//! runs it. Commands may use each other's helpers; none reaches back into `main.rs`.

pub mod bench;
pub mod ckpt;
pub mod cluster;
pub mod config;
pub mod data;
pub mod demo;
pub mod train;
