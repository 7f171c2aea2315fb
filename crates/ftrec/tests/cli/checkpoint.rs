//! Checkpoints through the CLI: resume equivalence and crash safety with real SIGKILLs.

use ftrec_testkit::cli::{MODEL, json_of};
use ftrec_testkit::{azurite, moto};

use crate::FTREC;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn train_args<'a>(data: &'a str, steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "train", "--data", data, "--seed", "4", "--steps", steps, "--json",
    ];
    a.extend(MODEL);
    a.extend(extra);
    a
}

#[test]
fn resumed_run_is_bit_identical_to_uninterrupted_for_every_strategy() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    // 7200 train samples / 128 = 56.25 steps per epoch: 80 steps cross an epoch.
    let full = json_of(&FTREC.run(&train_args(&data, "80", &[])));
    for strategy in [
        "full",
        "differential",
        "naive-incremental",
        "incrcp",
        "deck",
    ] {
        let ck = dir.path().join(format!("ck-{strategy}"));
        let ck = ck.to_str().unwrap();
        let strategy_set = format!("checkpoint.strategy=\"{strategy}\"");
        let part = json_of(&FTREC.run(&train_args(
            &data,
            "60",
            &[
                "--checkpoint-dir",
                ck,
                "--set",
                "checkpoint.every_steps=12",
                "--set",
                &strategy_set,
                "--set",
                "checkpoint.full_every=3",
                "--set",
                "checkpoint.incrcp_threshold=0.0",
                "--set",
                "checkpoint.deck.full_every_deltas=4",
            ],
        )));
        assert_eq!(
            part["checkpoints"]["written"], 5,
            "steps 12, 24, 36, 48, 60"
        );
        let ls: Value =
            serde_json::from_slice(&FTREC.run(&["ckpt", "ls", ck, "--json"]).stdout).unwrap();
        let all = ls.as_array().unwrap();
        // DECK merges deltas away: the four deltas after the full checkpoint at step 12
        // become one merged checkpoint (stride 2, two layers).
        assert_eq!(all.len(), if strategy == "deck" { 2 } else { 5 }, "{ls}");
        for m in all {
            for key in ["id", "kind", "step", "parents", "bytes", "time"] {
                assert!(!m[key].is_null(), "ckpt ls --json lacks {key}");
            }
        }
        let kinds: Vec<&str> = all.iter().map(|m| m["kind"].as_str().unwrap()).collect();
        let want: &[&str] = match strategy {
            "full" => &["full"; 5],
            "differential" => &[
                "full",
                "differential",
                "differential",
                "full",
                "differential",
            ],
            "naive-incremental" => &[
                "full",
                "naive-incremental",
                "naive-incremental",
                "full",
                "naive-incremental",
            ],
            // The cap (full_every = 3) resets the baseline at least this often; IncrCP's
            // cost model may reset it earlier.
            _ => &[],
        };
        if strategy == "deck" {
            assert_eq!(kinds, ["full", "merged"], "{ls}");
            assert_eq!(all[1]["step"], 60);
        } else if strategy == "incrcp" {
            assert_eq!(kinds[0], "full");
            assert!(
                kinds.iter().all(|k| ["full", "incrcp"].contains(k)),
                "{kinds:?}"
            );
            assert!(kinds.contains(&"incrcp"), "{kinds:?}");
            assert!(
                !kinds.windows(3).any(|w| w.iter().all(|k| *k == "incrcp")),
                "{kinds:?}"
            );
        } else {
            assert_eq!(kinds, want, "{strategy}");
        }
        let restored = json_of(&FTREC.run(&["ckpt", "restore", ck, "--json"]));
        assert_eq!(
            restored["state_digest"], part["state_digest"],
            "{strategy}: newest checkpoint"
        );
        for m in all {
            let spec = format!("{ck}@{}", m["id"].as_str().unwrap());
            let resumed = json_of(&FTREC.run(&train_args(&data, "80", &["--resume", &spec])));
            assert_eq!(
                resumed["state_digest"], full["state_digest"],
                "{strategy}: resumed from {spec}"
            );
        }
    }
}

const STRATEGIES: [&str; 5] = [
    "checkpoint.strategy=\"full\"",
    "checkpoint.strategy=\"differential\"",
    "checkpoint.strategy=\"naive-incremental\"",
    "checkpoint.strategy=\"incrcp\"",
    "checkpoint.strategy=\"deck\"",
];

#[test]
fn sigkill_while_checkpointing_never_damages_committed_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let full = json_of(&FTREC.run(&train_args(&data, "40", &[])));
    let (mut killed_mid_run, mut resumed_trials) = (0, 0);
    for trial in 0..20u64 {
        let ck = dir.path().join(format!("ck{trial}"));
        let ck = ck.to_str().unwrap();
        let mut child = FTREC
            .command()
            .args(train_args(
                &data,
                "40",
                &[
                    "--checkpoint-dir",
                    ck,
                    "--set",
                    "checkpoint.every_steps=1",
                    "--set",
                    STRATEGIES[trial as usize % STRATEGIES.len()],
                    "--set",
                    "checkpoint.full_every=4",
                ],
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Spread the kills over start-up, training and checkpoint writes.
        std::thread::sleep(Duration::from_millis(40 + (trial * 7919) % 600));
        let _ = child.kill(); // SIGKILL on Unix
        let status = child.wait().unwrap();
        killed_mid_run += (!status.success()) as usize;
        // A kill can land after the manifests directory exists but before the first
        // manifest's rename, so ask the engine what is committed rather than the file system.
        let ls = FTREC.run(&["ckpt", "ls", ck, "--json"]);
        let committed = Path::new(ck).exists()
            && ls.status.success()
            && !json_of(&ls).as_array().is_none_or(|list| list.is_empty());
        if !committed {
            continue; // killed before the first commit
        }
        let verify = FTREC.run(&["ckpt", "verify", ck]);
        assert!(
            verify.status.success(),
            "trial {trial}: {}",
            String::from_utf8_lossy(&verify.stdout)
        );
        let resumed = json_of(&FTREC.run(&train_args(&data, "40", &["--resume", ck])));
        assert_eq!(
            resumed["state_digest"], full["state_digest"],
            "trial {trial}"
        );
        resumed_trials += 1;
    }
    eprintln!(
        "{killed_mid_run} runs killed mid-run, {resumed_trials} resumed from their newest checkpoint"
    );
    assert!(
        resumed_trials >= 10,
        "only {resumed_trials} trials got as far as a checkpoint"
    );
    assert!(
        killed_mid_run >= 10,
        "only {killed_mid_run} of 20 runs were killed before finishing"
    );
}

#[test]
fn checkpoints_to_s3_resume_bit_identically() {
    let server = moto::start_server();
    moto::create_bucket(server.port, "runs");
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let run = |args: Vec<&str>| {
        let out = FTREC
            .command()
            .args(args)
            .envs(moto::env(&server))
            .output()
            .unwrap();
        json_of(&out)
    };
    let full = json_of(&FTREC.run(&train_args(&data, "30", &[])));
    let part = run(train_args(
        &data,
        "20",
        &[
            "--checkpoint-dir",
            "s3://runs/job-7",
            "--set",
            "checkpoint.every_steps=8",
            "--set",
            "checkpoint.strategy=\"naive-incremental\"",
        ],
    ));
    assert_eq!(part["checkpoints"]["written"], 3);
    let ls = run(vec!["ckpt", "ls", "s3://runs/job-7", "--json"]);
    assert_eq!(ls.as_array().unwrap().len(), 3);
    let verify = FTREC
        .command()
        .args(["ckpt", "verify", "s3://runs/job-7"])
        .envs(moto::env(&server))
        .output()
        .unwrap();
    assert!(verify.status.success());
    let resumed = run(train_args(
        &data,
        "30",
        &["--resume", "s3://runs/job-7@000000000016-incr"],
    ));
    assert_eq!(resumed["state_digest"], full["state_digest"]);
}

/// The documented user path to Azure: the emulator settings in the environment, IncrCP
/// checkpoints written by `train`, listed and verified by `ckpt`, and a resume from a
/// middle checkpoint that ends bit-identical to an uninterrupted run.
#[test]
fn incrcp_checkpoints_to_azure_resume_bit_identically() {
    let server = azurite::start_server();
    azurite::create_container(server.port, "runs");
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let command = |args: &[&str]| {
        FTREC
            .command()
            .args(args)
            .envs(azurite::env(&server))
            .output()
            .unwrap()
    };
    let full = json_of(&FTREC.run(&train_args(&data, "30", &[])));
    let part = json_of(&command(&train_args(
        &data,
        "20",
        &[
            "--checkpoint-dir",
            "az://runs/job-9",
            "--set",
            "checkpoint.every_steps=8",
            "--set",
            "checkpoint.strategy=\"incrcp\"",
        ],
    )));
    assert_eq!(part["checkpoints"]["written"], 3);
    let ls = json_of(&command(&["ckpt", "ls", "az://runs/job-9", "--json"]));
    let ids: Vec<&str> = ls
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 3, "{ls}");
    assert!(
        command(&["ckpt", "verify", "az://runs/job-9"])
            .status
            .success()
    );
    let resumed = json_of(&command(&train_args(
        &data,
        "30",
        &["--resume", &format!("az://runs/job-9@{}", ids[1])],
    )));
    assert_eq!(resumed["state_digest"], full["state_digest"]);
}

#[test]
fn safetensors_export_loads_in_python_with_the_right_values() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let ck = dir.path().join("ck");
    let ck = ck.to_str().unwrap();
    json_of(&FTREC.run(&train_args(
        &data,
        "12",
        &[
            "--checkpoint-dir",
            ck,
            "--set",
            "optimizer.dense.kind=\"adam\"",
        ],
    )));
    let out = dir.path().join("model.safetensors");
    let snap = dir.path().join("model.ftm");
    json_of(&FTREC.run(&[
        "ckpt",
        "export",
        ck,
        "--format",
        "safetensors",
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]));
    json_of(&FTREC.run(&[
        "ckpt",
        "restore",
        ck,
        "--out",
        snap.to_str().unwrap(),
        "--json",
    ]));
    let script = r#"
import json, sys
from safetensors.numpy import load_file
t = load_file(sys.argv[1])
print(json.dumps({k: {"shape": list(v.shape), "dtype": str(v.dtype), "first": [float(x) for x in v.reshape(-1)[:40]]} for k, v in t.items()}))
"#;
    ftrec_testkit::deps::python_module(
        "safetensors.numpy",
        "Python's safetensors (the Python packages safetensors and numpy)",
    );
    let py = Command::new("python3")
        .args(["-c", script, out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        py.status.success(),
        "python safetensors: {}",
        String::from_utf8_lossy(&py.stderr)
    );
    let tensors: Value = serde_json::from_slice(&py.stdout).unwrap();
    let (state, _) = ftrec_train::snapshot::load(&snap).unwrap();
    let dim = state.config().dim;
    let e = &tensors["embedding_bags.3.weight"];
    assert_eq!(e["shape"], serde_json::json!([2000, dim]));
    assert_eq!(e["dtype"], "float32");
    let row1 = &state.tables()[3].row(1);
    for d in 0..dim {
        assert_eq!(
            e["first"][dim + d].as_f64().unwrap() as f32,
            row1[d],
            "embedding row 1"
        );
        assert_eq!(
            tensors["embedding_bags.3.exp_avg_sq"]["first"][dim + d]
                .as_f64()
                .unwrap() as f32,
            row1[2 * dim + d]
        );
    }
    assert_eq!(tensors["embedding_bags.3.step"]["dtype"], "uint32");
    assert_eq!(
        tensors["embedding_bags.3.step"]["first"][1]
            .as_f64()
            .unwrap() as u32,
        row1[3 * dim].to_bits()
    );
    let w = &tensors["top_mlp.0.weight"];
    assert_eq!(w["shape"], serde_json::json!([32, 16 + 27 * 26 / 2]));
    let first_param =
        state.dense.params[ftrec_model::MlpSpec::dlrm_pair(state.config()).1.layers()[0].weight];
    assert_eq!(w["first"][0].as_f64().unwrap() as f32, first_param);
    assert!(tensors.get("top_mlp.0.weight.exp_avg").is_some());
    assert_eq!(tensors["dense.step"]["first"][0], 12.0);
}

#[test]
fn a_damaged_newest_checkpoint_is_an_error_unless_fallback_is_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let ck = dir.path().join("ck");
    let ck_s = ck.to_str().unwrap();
    let full = json_of(&FTREC.run(&train_args(&data, "30", &[])));
    json_of(&FTREC.run(&train_args(
        &data,
        "20",
        &[
            "--checkpoint-dir",
            ck_s,
            "--set",
            "checkpoint.every_steps=10",
        ],
    )));
    // Flip one byte in a row chunk of the newest checkpoint.
    let chunk = std::fs::read_dir(ck.join("data/000000000020-full"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "chunk"))
        .unwrap();
    let mut bytes = std::fs::read(&chunk).unwrap();
    let n = bytes.len();
    bytes[n - 9] ^= 0x20;
    std::fs::write(&chunk, &bytes).unwrap();

    let strict = FTREC.run(&train_args(&data, "30", &["--resume", ck_s]));
    assert!(
        !strict.status.success(),
        "a damaged checkpoint must not be used silently"
    );
    let err = String::from_utf8_lossy(&strict.stderr);
    let name = chunk.file_name().unwrap().to_str().unwrap();
    assert!(err.contains(name) && err.contains("checksum"), "{err}");
    let verify = FTREC.run(&["ckpt", "verify", ck_s]);
    assert!(!verify.status.success());

    let fell_back =
        json_of(&FTREC.run(&train_args(&data, "30", &["--resume", ck_s, "--fallback"])));
    assert_eq!(fell_back["resumed_from"], "000000000010-full");
    assert_eq!(fell_back["state_digest"], full["state_digest"]);
}

#[test]
fn standalone_merge_survives_sigkill_and_ends_in_the_hierarchical_layout() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let ck = dir.path().join("deck");
    let ck = ck.to_str().unwrap();
    // One full checkpoint, then 39 deltas left for an external merger.
    let run = json_of(&FTREC.run(&train_args(
        &data,
        "40",
        &[
            "--checkpoint-dir",
            ck,
            "--set",
            "checkpoint.strategy=\"deck\"",
            "--set",
            "checkpoint.every_steps=1",
            "--set",
            "checkpoint.deck.merge_in_background=false",
            "--set",
            "checkpoint.deck.live_factor=0.0",
        ],
    )));
    let listed = |ck: &str| -> Vec<Value> {
        let out = FTREC.run(&["ckpt", "ls", ck, "--json"]);
        serde_json::from_slice::<Value>(&out.stdout)
            .unwrap()
            .as_array()
            .unwrap()
            .clone()
    };
    assert_eq!(listed(ck).len(), 40);
    // Kills land at adaptive delays until enough of them provably landed inside a
    // merge: on a loaded machine the process may take anywhere from milliseconds to
    // seconds to start, so no fixed delay is reliable.
    let pristine = dir.path().join("deck-pristine");
    copy_dir(Path::new(ck), &pristine);
    let lease = Path::new(ck).join("locks/merger.lease");
    let started = Instant::now();
    let mut delay_ms = 20.0f64;
    let mut outcomes: Vec<KillOutcome> = Vec::new();
    let mid = |o: &[KillOutcome]| o.iter().filter(|o| o.mid_merge()).count();
    let cut_off = |o: &[KillOutcome]| {
        o.iter()
            .filter(|o| matches!(o, KillOutcome::MidMerge { progressed: true }))
            .count()
    };
    while (mid(&outcomes) < 3 || cut_off(&outcomes) < 1)
        && outcomes.len() < 40
        && started.elapsed() < Duration::from_secs(10)
    {
        let trial = outcomes.len();
        let before = merge_state(ck);
        let mut child = FTREC
            .command()
            .args(["ckpt", "merge", ck])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_secs_f64(delay_ms / 1000.0));
        let _ = child.kill();
        let exited_by_itself = child.wait().unwrap().success();
        // The independent witness: the merger lease, taken before any merge work and
        // released once all of it is done, still names the killed process, unreleased.
        let holder: Option<Value> = std::fs::read(&lease)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let released = holder
            .as_ref()
            .filter(|h| h["pid"].as_u64() == Some(u64::from(child.id())))
            .map(|h| h["released"] == Value::Bool(true));
        let after = merge_state(ck);
        let outcome = match released {
            _ if exited_by_itself => KillOutcome::Late,
            Some(true) => KillOutcome::Late,
            // Merged checkpoints committed, inputs deleted, or a merged checkpoint's
            // files written without its manifest: the store shows work cut off.
            Some(false) => KillOutcome::MidMerge {
                progressed: after != before || !after.1.is_empty(),
            },
            None => KillOutcome::Early,
        };
        let verify = FTREC.run(&["ckpt", "verify", ck]);
        assert!(
            verify.status.success(),
            "trial {trial} ({outcome:?} after {delay_ms:.0} ms): {}\nmanifests: {:?}",
            String::from_utf8_lossy(&verify.stdout),
            after.0
        );
        let restored = json_of(&FTREC.run(&["ckpt", "restore", ck, "--json"]));
        assert_eq!(
            restored["state_digest"], run["state_digest"],
            "trial {trial} ({outcome:?})"
        );
        // Too early: wait longer. Too late: shorter. Mid-merge: spread the next kill
        // around this one, to land at other points of the merge.
        match outcome {
            KillOutcome::Early => delay_ms = delay_ms * 1.6 + 5.0,
            KillOutcome::Late => delay_ms *= 0.6,
            KillOutcome::MidMerge { .. } => delay_ms *= [0.7, 1.3, 0.85, 1.15][trial % 4],
        }
        // Fully merged (5 checkpoints): start over from the unmerged history, so that the
        // next kill has merge work to cut into.
        if merge_state(ck).0.len() <= 5 {
            std::fs::remove_dir_all(ck).unwrap();
            copy_dir(&pristine, Path::new(ck));
        }
        outcomes.push(outcome);
    }
    eprintln!(
        "{} merges killed mid-merge ({} with merge work cut off) in {} trials, {:.1} s: \
         {outcomes:?}",
        mid(&outcomes),
        cut_off(&outcomes),
        outcomes.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        mid(&outcomes) >= 3 && cut_off(&outcomes) >= 1,
        "too few kills landed mid-merge: {outcomes:?}"
    );
    let merged = json_of(&FTREC.run(&["ckpt", "merge", ck, "--json"]));
    assert!(merged["bytes_per_second"].as_f64().is_some());
    // 39 deltas at stride 2: 32 + 4 + 2 + 1.
    let layout: Vec<(String, u64)> = listed(ck)
        .iter()
        .map(|m| {
            (
                m["kind"].as_str().unwrap().to_string(),
                m["step"].as_u64().unwrap(),
            )
        })
        .collect();
    let kinds: Vec<&str> = layout.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        ["full", "merged", "merged", "merged", "delta"],
        "{layout:?}"
    );
    let restored = json_of(&FTREC.run(&["ckpt", "restore", ck, "--json"]));
    assert_eq!(restored["state_digest"], run["state_digest"]);
    assert_eq!(FTREC.run(&["ckpt", "gc", ck]).status.code(), Some(0));
    let again = json_of(&FTREC.run(&["ckpt", "restore", ck, "--json"]));
    assert_eq!(again["state_digest"], run["state_digest"]);
}

/// Where a SIGKILL of `ckpt merge` landed.
#[derive(Debug)]
enum KillOutcome {
    /// Before the merger lease was taken (the process was still starting).
    Early,
    /// While the process held the merger lease; `progressed`: the store shows merge work
    /// done or cut off halfway.
    MidMerge { progressed: bool },
    /// After the merge finished (it exited, or had released the lease).
    Late,
}

impl KillOutcome {
    fn mid_merge(&self) -> bool {
        matches!(self, KillOutcome::MidMerge { .. })
    }
}

/// The manifests of a checkpoint location, and the data directories no manifest names
/// (a merged checkpoint whose files were written but not committed).
fn merge_state(ck: &str) -> (Vec<String>, Vec<String>) {
    let names = |sub: &str| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(Path::new(ck).join(sub))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    let manifests: Vec<String> = names("manifests")
        .into_iter()
        .filter_map(|m| m.strip_suffix(".man").map(str::to_string))
        .collect();
    let orphans = names("data")
        .into_iter()
        .filter(|d| !manifests.contains(d))
        .collect();
    (manifests, orphans)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}
