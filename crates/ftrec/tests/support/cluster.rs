//! Helpers shared by the cluster tests: the small model, a `cluster run` command line,
//! the single-process digest to compare with, and the run's event log.

#![allow(dead_code)]

use std::path::Path;

use serde_json::Value;

use crate::cli::{MODEL, ftrec, json_of};

/// The small model with the seed every cluster test shares.
pub fn model() -> Vec<&'static str> {
    let mut m = vec!["--seed", "4"];
    m.extend(MODEL);
    m
}

/// The state digest `ftrec train` reaches after `steps` steps.
pub fn single_process_digest(data: &str, steps: &str) -> Value {
    let mut args = vec!["train", "--data", data, "--steps", steps, "--json"];
    args.extend(model());
    json_of(&ftrec(&args))["state_digest"].clone()
}

/// `cluster run` of the small model into `run_dir` with `extra` flags: its JSON report.
pub fn cluster_json(data: &str, run_dir: &Path, steps: &str, extra: &[&str]) -> Value {
    let mut args = cluster_args(data, run_dir, steps);
    args.extend(extra);
    json_of(&ftrec(&args))
}

/// `cluster run` of the small model into `run_dir`, with JSON output and a time limit.
pub fn cluster_args<'a>(data: &'a str, run_dir: &'a Path, steps: &'a str) -> Vec<&'a str> {
    let mut args = vec![
        "cluster",
        "run",
        "--data",
        data,
        "--steps",
        steps,
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--time-limit",
        "240",
        "--json",
    ];
    args.extend(model());
    args
}

/// The run's events: time, kind, detail.
pub fn timed_events(run_dir: &Path) -> Vec<(f64, String, String)> {
    let timeline: Value =
        serde_json::from_slice(&std::fs::read(run_dir.join("timeline.json")).unwrap()).unwrap();
    timeline["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["t"].as_f64().unwrap(),
                e["kind"].as_str().unwrap().to_string(),
                e["detail"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// The run's events: kind, detail.
pub fn events(run_dir: &Path) -> Vec<(String, String)> {
    timed_events(run_dir)
        .into_iter()
        .map(|(_, k, d)| (k, d))
        .collect()
}

/// The kinds of the run's events, in order.
pub fn event_kinds(run_dir: &Path) -> Vec<String> {
    timed_events(run_dir)
        .into_iter()
        .map(|(_, k, _)| k)
        .collect()
}

/// Reads a `cluster run`'s stderr until it announces its coordinator: returns the
/// coordinator's address and its metrics address. The rest of stderr stays readable.
pub fn announced(
    child: &mut std::process::Child,
) -> (
    String,
    String,
    std::io::BufReader<std::process::ChildStderr>,
) {
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut stderr, &mut line).unwrap() > 0,
            "the cluster exited without announcing its coordinator"
        );
        if let Some(rest) = line.trim().strip_prefix("coordinator at ") {
            let address = rest.split_whitespace().next().unwrap().to_string();
            let metrics = rest
                .split("http://")
                .nth(1)
                .and_then(|m| m.split('/').next())
                .expect("a metrics address")
                .to_string();
            return (address, metrics, stderr);
        }
    }
}
