//! Committed checkpoints are immutable (issue 12): a resume from an older checkpoint forks
//! a branch instead of rewriting later steps, a SIGKILL during the forked run's writes
//! damages nothing committed, a fresh run into a used location is refused, and two live
//! writers exclude each other by lease. All through the CLI, with real processes.

use ftrec_testkit::cli::{MODEL, json_of};

use crate::FTREC;

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;

const STRATEGIES: [&str; 5] = [
    "full",
    "differential",
    "naive-incremental",
    "incrcp",
    "deck",
];

fn train_args<'a>(data: &'a str, steps: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "train", "--data", data, "--seed", "4", "--steps", steps, "--json",
    ];
    a.extend(MODEL);
    a.extend(extra);
    a
}

/// Every committed checkpoint's id and the digest of its restore.
fn digests(ck: &str) -> BTreeMap<String, String> {
    let ls = json_of(&FTREC.run(&["ckpt", "ls", ck, "--json"]));
    ls.as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let id = m["id"].as_str().unwrap().to_string();
            let r = json_of(&FTREC.run(&["ckpt", "restore", ck, "--id", &id, "--json"]));
            (id, r["state_digest"].as_str().unwrap().to_string())
        })
        .collect()
}

fn ids_at(ck: &str) -> Vec<(String, u64, u64)> {
    json_of(&FTREC.run(&["ckpt", "ls", ck, "--json"]))
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_string(),
                m["step"].as_u64().unwrap(),
                m["branch"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn second_dataset(dir: &std::path::Path) -> String {
    let data = dir.join("data2");
    json_of(&FTREC.run(&[
        "data",
        "gen",
        "--rows",
        "4000",
        "--seed",
        "9",
        "--out",
        data.to_str().unwrap(),
        "--json",
    ]));
    data.to_str().unwrap().to_string()
}

/// The scenario, for every strategy: train 12 steps, then resume from step 4 on
/// other data into the same location. Every checkpoint committed before the fork restores
/// to its original digest afterwards, the fork is a new branch, and `--resume DIR` picks
/// the newest commit of the newest branch.
#[test]
fn a_resume_from_an_older_checkpoint_forks_a_branch_and_rewrites_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let data2 = second_dataset(dir.path());
    for strategy in STRATEGIES {
        let ck = dir.path().join(format!("ck-{strategy}"));
        let ck = ck.to_str().unwrap();
        let strategy_set = format!("checkpoint.strategy=\"{strategy}\"");
        let settings = [
            "--set",
            "checkpoint.every_steps=2",
            "--set",
            &strategy_set,
            "--set",
            "checkpoint.full_every=3",
            "--set",
            "checkpoint.deck.merge_in_background=false",
        ];
        let mut args = vec!["--checkpoint-dir", ck];
        args.extend(settings);
        json_of(&FTREC.run(&train_args(&data, "12", &args)));
        let before = digests(ck);
        assert!(before.len() >= 6, "{strategy}: {before:?}");
        let at4 = ids_at(ck)
            .into_iter()
            .find(|(_, step, _)| *step == 4)
            .unwrap()
            .0;
        let from = format!("{ck}@{at4}");
        let mut args = vec!["--checkpoint-dir", ck, "--resume", &from];
        args.extend(settings);
        let forked = json_of(&FTREC.run(&train_args(&data2, "10", &args)));
        assert_eq!(forked["forked_from"], at4.as_str(), "{strategy}: {forked}");
        let branch = forked["checkpoint_branch"].as_u64().unwrap();
        assert!(branch >= 1, "{strategy}: {forked}");
        let after = digests(ck);
        for (id, digest) in &before {
            assert_eq!(
                after.get(id),
                Some(digest),
                "{strategy}: {id} changed or vanished after the fork"
            );
        }
        assert!(
            after.len() > before.len(),
            "{strategy}: the fork wrote nothing"
        );
        assert!(FTREC.run(&["ckpt", "verify", ck]).status.success());
        // `--resume DIR` continues the newest branch from its newest commit.
        let newest = ids_at(ck)
            .into_iter()
            .filter(|(_, _, b)| *b == branch)
            .max_by_key(|(_, step, _)| *step)
            .unwrap();
        assert_eq!(newest.1, 10, "{strategy}");
        let mut args = vec!["--checkpoint-dir", ck, "--resume", ck];
        args.extend(settings);
        let continued = json_of(&FTREC.run(&train_args(&data2, "12", &args)));
        assert_eq!(continued["resumed_from"], newest.0.as_str(), "{strategy}");
        assert_eq!(continued["checkpoint_branch"], branch, "{strategy}");
        assert_eq!(continued["forked_from"], Value::Null, "{strategy}");
        // Branch 1's own policies (DECK's lineage policy after its new full checkpoint)
        // may thin branch 1; branch 0 is not theirs to touch.
        let last = digests(ck);
        for (id, digest) in &before {
            assert_eq!(last.get(id), Some(digest), "{strategy}: {id}");
        }
        // A flipped byte in a branch record is damage that `ckpt verify` names.
        let record = std::path::Path::new(ck).join(format!("branches/{branch:06}.branch"));
        let good = std::fs::read(&record).unwrap();
        let mut bad = good.clone();
        let last_byte = bad.len() - 1;
        bad[last_byte] ^= 1;
        std::fs::write(&record, &bad).unwrap();
        let verify = FTREC.run(&["ckpt", "verify", ck]);
        let said = String::from_utf8_lossy(&verify.stdout);
        assert!(!verify.status.success(), "{strategy}: {said}");
        assert!(
            said.contains(&format!("branches/{branch:06}.branch: DAMAGED")),
            "{strategy}: {said}"
        );
        std::fs::write(&record, &good).unwrap();
        assert!(FTREC.run(&["ckpt", "verify", ck]).status.success());
    }
}

/// SIGKILLs at spread moments of a forked run's writes: every checkpoint committed before
/// stays intact and restorable, and the next resume cleans up after the dead writer.
#[test]
fn sigkill_during_a_forked_run_damages_nothing_committed() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let ck = dir.path().join("ck");
    let ck = ck.to_str().unwrap();
    let settings = [
        "--set",
        "checkpoint.every_steps=1",
        "--set",
        "checkpoint.strategy=\"naive-incremental\"",
        "--set",
        "checkpoint.full_every=4",
    ];
    let mut args = vec!["--checkpoint-dir", ck];
    args.extend(settings);
    json_of(&FTREC.run(&train_args(&data, "8", &args)));
    let before = digests(ck);
    for trial in 0..4u64 {
        let from = format!("{ck}@000000000003-incr");
        let mut args = vec!["--checkpoint-dir", ck, "--resume", &from];
        args.extend(settings);
        let mut child = FTREC
            .command()
            .args(train_args(&data, "40", &args))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(150 + trial * 170));
        let _ = child.kill();
        let _ = child.wait();
        let now = digests(ck);
        for (id, digest) in &before {
            assert_eq!(now.get(id), Some(digest), "trial {trial}: {id}");
        }
        let verify = FTREC.run(&["ckpt", "verify", ck]);
        assert!(
            verify.status.success(),
            "trial {trial}: {}",
            String::from_utf8_lossy(&verify.stdout)
        );
    }
}

/// A fresh run into a location with history is refused unless it asks for a new branch;
/// with `--new-branch` it writes an independent branch and the old one stays.
#[test]
fn a_fresh_run_into_a_used_location_is_refused_unless_it_starts_a_new_branch() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let ck = dir.path().join("ck");
    let ck = ck.to_str().unwrap();
    let args = ["--checkpoint-dir", ck, "--set", "checkpoint.every_steps=2"];
    json_of(&FTREC.run(&train_args(&data, "6", &args)));
    let before = digests(ck);
    let refused = FTREC.run(&train_args(&data, "4", &args));
    assert!(!refused.status.success());
    let message = String::from_utf8_lossy(&refused.stderr);
    assert!(
        message.contains("already holds checkpoints") && message.contains("--new-branch"),
        "{message}"
    );
    let mut with = args.to_vec();
    with.push("--new-branch");
    let other = json_of(&FTREC.run(&train_args(&data, "4", &with)));
    assert_eq!(other["checkpoint_branch"], 1);
    let after = digests(ck);
    for (id, digest) in &before {
        assert_eq!(after.get(id), Some(digest), "{id}");
    }
    assert_eq!(after.len(), before.len() + 2);
}

/// Two trainers at once on one location: the second is refused by the first's lease,
/// with a message naming the holder, and the first finishes with all its checkpoints.
#[test]
fn two_concurrent_trainers_are_excluded_by_the_writer_lease() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let ck = dir.path().join("ck");
    let ck_s = ck.to_str().unwrap();
    let args = [
        "--checkpoint-dir",
        ck_s,
        "--set",
        "checkpoint.every_steps=5",
    ];
    let first = FTREC
        .command()
        .args(train_args(&data, "300", &args))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lease = ck.join("locks/writer.lease");
    let started = Instant::now();
    while !lease.exists() && started.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut with = args.to_vec();
    with.push("--new-branch");
    let second = FTREC.run(&train_args(&data, "20", &with));
    let out = first.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(!second.status.success(), "the second writer was admitted");
    let message = String::from_utf8_lossy(&second.stderr);
    assert!(
        message.contains("lease is held by ftrec train (pid"),
        "{message}"
    );
    let ids = ids_at(ck_s);
    assert_eq!(ids.len(), 60, "{ids:?}");
    assert!(ids.iter().all(|(_, _, b)| *b == 0));
    assert!(FTREC.run(&["ckpt", "verify", ck_s]).status.success());
}

/// Two `ckpt merge` processes and a `ckpt gc` loop on one DECK location at once: the
/// merger lease lets one of them work at a time (the others say who holds it), no merged
/// id is ever written twice, and every checkpoint stays restorable to the same state.
#[test]
fn concurrent_mergers_and_gc_take_turns_and_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let ck = dir.path().join("deck");
    let ck = ck.to_str().unwrap();
    let run = json_of(&FTREC.run(&train_args(
        &data,
        "33",
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
    let mut mergers: Vec<_> = (0..2)
        .map(|_| {
            FTREC
                .command()
                .args(["ckpt", "merge", ck, "--watch", "0.01"])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let (mut gc_ran, mut gc_refused) = (0, 0);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        let gc = FTREC.run(&["ckpt", "gc", ck, "--keep", "100", "--json"]);
        if gc.status.success() {
            gc_ran += 1;
        } else {
            let message = String::from_utf8_lossy(&gc.stderr);
            assert!(message.contains("merger lease is held by"), "{message}");
            gc_refused += 1;
        }
    }
    // On a loaded machine two mergers polling every 10 ms can hold the lease at every
    // instant a fresh gc process looks; `--wait` retries, with the mergers still running,
    // until one of them lets go.
    let waited = FTREC.run(&["ckpt", "gc", ck, "--keep", "100", "--wait", "60", "--json"]);
    assert!(
        waited.status.success(),
        "{}",
        String::from_utf8_lossy(&waited.stderr)
    );
    // It ran between the mergers' turns, not after them: both still run.
    let gc = json_of(&waited);
    assert!(gc["checkpoints"].is_array(), "{gc}");
    for m in &mut mergers {
        assert!(
            m.try_wait().unwrap().is_none(),
            "a merger exited during the gc"
        );
    }
    // The waited gc above is the deterministic proof that gc runs beside live mergers;
    // the loop's tries only show how often a gc finds the lease free on this host.
    assert!(gc_ran + gc_refused > 0, "no gc was tried in 3 s");
    for mut m in mergers {
        let _ = m.kill();
        let out = m.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("already exists"), "{stderr}");
    }
    eprintln!("gc ran {gc_ran} times and was refused {gc_refused} times");
    let merged = json_of(&FTREC.run(&["ckpt", "merge", ck, "--json"]));
    assert!(merged["merged"].is_array());
    assert!(FTREC.run(&["ckpt", "verify", ck]).status.success());
    let restored = json_of(&FTREC.run(&["ckpt", "restore", ck, "--json"]));
    assert_eq!(restored["state_digest"], run["state_digest"]);
    // 32 deltas at stride 2 end as one merged checkpoint over the full one.
    assert_eq!(ids_at(ck).len(), 2, "{:?}", ids_at(ck));
}
