//! Helpers shared by the CLI integration tests: run the binary, parse its JSON, make data.

#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_ftrec");

/// A small model (2000-row tables, dim 16, Adam rows) that trains in milliseconds per step.
pub const MODEL: [&str; 12] = [
    "--set",
    "model.rows_per_table=2000",
    "--set",
    "model.dim=16",
    "--set",
    "model.bottom=[32, 16]",
    "--set",
    "model.top=[32, 1]",
    "--set",
    "train.batch_size=128",
    "--set",
    "optimizer.sparse.kind=\"adam\"",
];

pub fn ftrec(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run ftrec")
}

pub fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "ftrec failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

/// 8000 generated samples (7200 train) in `dir/data`; returns the directory.
pub fn setup(dir: &Path) -> String {
    let data = dir.join("data");
    json_of(&ftrec(&[
        "data",
        "gen",
        "--rows",
        "8000",
        "--seed",
        "2",
        "--out",
        data.to_str().unwrap(),
        "--json",
    ]));
    data.to_str().unwrap().to_string()
}
