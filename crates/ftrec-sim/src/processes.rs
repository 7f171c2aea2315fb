//! Simulations in more than one process. One process runs one simulation at a time (they
//! share tokio's task ids, which a seed's replay depends on), so a test binary's sweeps
//! would use one core however many the machine has. A test can run itself in a child
//! process instead ([`ran_in_child_process`]), or split its seeds over several
//! ([`in_shards`]); each simulation is exact whichever process runs it.

use std::process::{Command, Output, Stdio};

/// Set in a child process: run the test here.
const CHILD: &str = "FTREC_SIM_CHILD";
/// Set in a shard's process: its index, and how many there are.
pub const SHARD: &str = "FTREC_SIM_SHARD";
pub const SHARDS: &str = "FTREC_SIM_SHARDS";

/// Runs the calling test (named by its thread, as the test harness names it) in a child
/// process of this test binary, and returns true once that child passed: the test then
/// returns at once. False where the test is to run here: in the child, in a replay
/// (`FTREC_SIM_SEED`), or on the main thread (`--test-threads=1`). Panics, with the
/// child's output, when the child failed.
pub fn ran_in_child_process() -> bool {
    if std::env::var_os(CHILD).is_some() || std::env::var_os("FTREC_SIM_SEED").is_some() {
        return false;
    }
    let current = std::thread::current();
    let Some(name) = current.name().filter(|n| *n != "main") else {
        return false;
    };
    let out = run_test(name, &[(CHILD, "1".into())]);
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "{name} failed in its own process ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    true
}

/// Runs test `name` of this binary in `shards` processes at once, the k-th with
/// `FTREC_SIM_SHARD=k`; returns what the failed ones said.
pub fn in_shards(name: &str, shards: u64) -> Vec<String> {
    let children: Vec<_> = (0..shards)
        .map(|k| {
            let envs = [(SHARD, k.to_string()), (SHARDS, shards.to_string())];
            spawn_test(name, &envs)
        })
        .collect();
    let mut failures = Vec::new();
    for (k, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().expect("a shard's process ends");
        let said = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            failures.push(format!(
                "shard {k} of {shards} failed ({}):\n{}{said}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
            ));
        } else if let Some(count) = said.lines().last() {
            eprintln!("shard {k}: {count}");
        }
    }
    failures
}

fn spawn_test(name: &str, envs: &[(&str, String)]) -> std::process::Child {
    let exe = std::env::current_exe().expect("the test binary's path");
    Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("a test's child process starts")
}

fn run_test(name: &str, envs: &[(&str, String)]) -> Output {
    spawn_test(name, envs)
        .wait_with_output()
        .expect("a test's child process ends")
}
