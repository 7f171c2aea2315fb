//! The `ftrec` binary under test: run it, parse its JSON, make data.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// A handle on the `ftrec` binary. Its path is `env!("CARGO_BIN_EXE_ftrec")`, which Cargo
/// sets only while compiling the ftrec package's own tests, so the test crate passes it
/// in: `const FTREC: Ftrec = Ftrec::new(env!("CARGO_BIN_EXE_ftrec"));`.
#[derive(Clone, Copy, Debug)]
pub struct Ftrec {
    bin: &'static str,
}

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

/// The seed every cluster test shares, then the small [`MODEL`].
pub fn model() -> Vec<&'static str> {
    let mut m = vec!["--seed", "4"];
    m.extend(MODEL);
    m
}

impl Ftrec {
    pub const fn new(bin: &'static str) -> Self {
        Ftrec { bin }
    }

    /// The binary's path, for tests that spawn it themselves.
    pub const fn bin(&self) -> &'static str {
        self.bin
    }

    pub fn command(&self) -> Command {
        Command::new(self.bin)
    }

    /// Runs `ftrec args` to completion.
    pub fn run<S: AsRef<OsStr>>(&self, args: &[S]) -> Output {
        self.command().args(args).output().expect("run ftrec")
    }

    /// Runs `ftrec args`, which must succeed, and parses the one JSON object it prints.
    pub fn json<S: AsRef<OsStr>>(&self, args: &[S]) -> Value {
        json_of(&self.run(args))
    }

    /// 8000 generated samples (7200 train) in `dir/data`; returns the directory.
    pub fn setup(&self, dir: &Path) -> String {
        let data = dir.join("data");
        self.json(&[
            "data",
            "gen",
            "--rows",
            "8000",
            "--seed",
            "2",
            "--out",
            data.to_str().unwrap(),
            "--json",
        ]);
        data.to_str().unwrap().to_string()
    }

    /// The state digest `ftrec train` of the cluster tests' [`model`] reaches after
    /// `steps` steps.
    pub fn single_process_digest(&self, data: &str, steps: &str) -> Value {
        let mut args = vec!["train", "--data", data, "--steps", steps, "--json"];
        args.extend(model());
        self.json(&args)["state_digest"].clone()
    }
}

/// The JSON object a successful `ftrec ... --json` printed.
pub fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "ftrec failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}
