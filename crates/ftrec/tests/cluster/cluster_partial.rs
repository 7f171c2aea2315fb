//! CPR partial recovery in the cluster (`--ft partial`): a SIGKILLed server's replacement
//! reloads only its own shard from its last checkpoint, nobody rolls back, the workers do
//! not rewind, and the PLS the run reports is Eq. 3 of what the event log says was lost.

use ftrec_proto::timeline::EventKind;
use ftrec_testkit::ClusterRun;
use ftrec_testkit::cli::json_of;
use ftrec_testkit::cluster::events;

use crate::FTREC;

use std::path::Path;

use serde_json::Value;

/// 7200 training samples in batches of 128: samples before step `n` (n <= 56).
fn samples_before(n: u64) -> u64 {
    n * 128
}

fn partial_run(data: &str, run: &Path, steps: &str, extra: &[&str]) -> Value {
    let args = ClusterRun::new(data)
        .run_dir(run)
        .steps(steps)
        .servers(3)
        .workers(1)
        .deterministic()
        .no_eval()
        .ft("partial")
        .set("checkpoint.every_steps=20")
        .extend(extra)
        .args();
    json_of(&FTREC.run(&args))
}

/// The `shard_digests` of a run report, or of one of its recoveries.
fn digests(report: &Value) -> Vec<String> {
    report["shard_digests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap().to_string())
        .collect()
}

/// The `partial-restore` events of a run, in order.
fn partial_restores(run: &Path) -> Vec<String> {
    events(run)
        .into_iter()
        .filter(|(k, _)| *k == EventKind::PartialRestore)
        .map(|(_, d)| d)
        .collect()
}

/// The number after `key` in an event's text (`S_i 6400 samples`).
fn number_after(text: &str, key: &str) -> u64 {
    let rest = &text[text.find(key).unwrap_or_else(|| panic!("{key} in {text}")) + key.len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .unwrap_or_else(|e| panic!("{key} in {text}: {e}"))
}

#[test]
fn a_lost_server_reloads_only_its_shard_and_nobody_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    // Uninterrupted runs to the last cut before the kill and to the kill itself.
    let at_cut = digests(&partial_run(&data, &dir.path().join("r40"), "40", &[]));
    let at_kill = digests(&partial_run(&data, &dir.path().join("r50"), "50", &[]));
    let run = dir.path().join("run");
    let report = partial_run(&data, &run, "56", &["--kill", "server:1@step:50"]);
    assert_eq!(report["steps"], 56);
    assert_eq!(report["recovery_mode"], "partial");
    let recoveries = report["recoveries"].as_array().unwrap();
    assert_eq!(recoveries.len(), 1, "{report}");
    let r = &recoveries[0];
    assert_eq!(r["server"], 1);
    assert_eq!(r["mode"], "partial");
    assert_eq!(r["steps_rolled_back"], 0, "the workers do not rewind");
    assert_eq!(report["steps_rolled_back"], 0);
    let recovered = digests(r);
    // The survivors kept their state at the failure, bit for bit; the replacement holds
    // exactly its own checkpoint of the cut at step 40.
    assert_eq!(recovered[0], at_kill[0]);
    assert_eq!(recovered[2], at_kill[2]);
    assert_eq!(recovered[1], at_cut[1]);
    assert_ne!(recovered[1], at_kill[1], "server 1 lost steps 40..49");

    // PLS is Eq. 3 of what the event log says: (S_i − S_last_ckpt) / (S_total · N_emb).
    let restores = partial_restores(&run);
    assert_eq!(restores.len(), 1, "{restores:?}");
    let s_i = number_after(&restores[0], "S_i ");
    let s_ckpt = number_after(&restores[0], "S_last_ckpt ");
    assert_eq!((s_i, s_ckpt), (samples_before(50), samples_before(40)));
    let s_total = samples_before(56);
    let expected = (s_i - s_ckpt) as f64 / (s_total as f64 * 3.0);
    let pls = report["pls"].as_f64().unwrap();
    assert!((pls - expected).abs() < 1e-12, "{pls} vs {expected}");
}

#[test]
fn a_failure_right_after_a_cut_loses_nothing_and_ends_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let run = dir.path().join("run");
    let report = partial_run(&data, &run, "50", &["--kill", "server:2@step:40"]);
    assert_eq!(report["recoveries"][0]["mode"], "partial");
    assert_eq!(report["pls"].as_f64().unwrap(), 0.0);
    assert_eq!(
        report["state_digest"],
        FTREC.single_process_digest(&data, "50")
    );
}

#[test]
fn partial_recovery_falls_back_to_a_full_rollback_when_it_does_not_pay() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let run = dir.path().join("run");
    // A tiny PLS target needs a checkpoint every few milliseconds (Eq. 4): far costlier
    // than full recovery at its own optimum, so the comparison picks full recovery.
    let report = partial_run(
        &data,
        &run,
        "50",
        &[
            "--kill",
            "server:1@step:45",
            "--set",
            "cpr.mtbf_seconds=10",
            "--set",
            "cpr.target_pls=0.0001",
        ],
    );
    assert_eq!(report["recovery_mode"], "full", "{report}");
    assert_eq!(report["recoveries"][0]["mode"], "rollback");
    assert!(
        report["steps_rolled_back"].as_u64().unwrap() > 0,
        "{report}"
    );
    let decision: Vec<String> = events(&run)
        .into_iter()
        .filter(|(k, _)| *k == EventKind::CprDecision)
        .map(|(_, d)| d)
        .collect();
    assert_eq!(decision.len(), 1);
    assert!(decision[0].starts_with("Full recovery"), "{}", decision[0]);
    assert_eq!(
        report["state_digest"],
        FTREC.single_process_digest(&data, "50")
    );
}

#[test]
fn prioritised_saves_between_cuts_are_what_a_partial_restore_reloads_for_mfu_ssu_and_scar() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    // Saves change nothing in training: a plain uninterrupted run gives the survivors'
    // state at the failure.
    let at_kill = digests(&partial_run(&data, &dir.path().join("r35"), "35", &[]));
    let at_cut = digests(&partial_run(&data, &dir.path().join("r20"), "20", &[]));
    let mut tracker_bytes = Vec::new();
    for kind in ["mfu", "ssu", "scar"] {
        let run = dir.path().join(kind);
        let priority_set = format!("cpr.priority={kind:?}");
        // Cuts every 20 steps, saves of half the rows every 10 steps in between.
        let report = partial_run(
            &data,
            &run,
            "56",
            &[
                "--kill",
                "server:1@step:35",
                "--set",
                &priority_set,
                "--set",
                "cpr.r=0.5",
            ],
        );
        let saves: Vec<(u64, bool)> = report["checkpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["step"].as_u64().unwrap(),
                    c["priority"].as_bool().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            saves,
            vec![
                (20, false),
                (30, true),
                (40, false),
                (50, true),
                (56, false)
            ],
            "no save before the first cut; cuts stay cuts; a final cut at the last step"
        );
        let r = &report["recoveries"][0];
        assert_eq!(r["mode"], "partial");
        let recovered = digests(r);
        assert_eq!(recovered[0], at_kill[0]);
        assert_eq!(recovered[2], at_kill[2]);
        // The replacement holds the cut of step 20 with the most used rows as of step 30.
        assert_ne!(recovered[1], at_cut[1]);
        assert_ne!(recovered[1], at_kill[1]);
        let restore = events(&run)
            .into_iter()
            .find(|(k, _)| *k == EventKind::PartialRestore)
            .unwrap()
            .1;
        assert!(restore.contains("the cut of step 30"), "{restore}");
        assert_eq!(number_after(&restore, "S_last_ckpt "), samples_before(30));
        let expected =
            (samples_before(35) - samples_before(30)) as f64 / (samples_before(56) as f64 * 3.0);
        assert!((report["pls"].as_f64().unwrap() - expected).abs() < 1e-12);
        let priority = &report["cpr_priority"];
        assert_eq!(priority["priority"], kind);
        assert_eq!(priority["saves"], 2);
        // Recording accesses is timed on the servers, a small share of the training.
        let tracking = priority["tracking_seconds"].as_f64().unwrap();
        let train = report["train_seconds"].as_f64().unwrap();
        assert!(
            tracking > 0.0 && tracking < train / 2.0,
            "{tracking} of {train}"
        );
        tracker_bytes.push(priority["tracker_bytes"].as_u64().unwrap());
    }
    // Table 1's memory order: SSU's bounded list < MFU's 4-byte counter per row of the
    // prioritised tables (all servers) < SCAR's copy of every embedding.
    let [mfu, ssu, scar] = tracker_bytes[..] else {
        panic!("{tracker_bytes:?}")
    };
    assert!(mfu > 0 && mfu <= 4 * 26 * 2000 && mfu % 4 == 0, "{mfu}");
    assert!(ssu < mfu && scar > mfu, "{tracker_bytes:?}");
}

/// `cpr.uncoordinated`: each server saves its own shard on its own schedule, server `j`
/// due at its turns of the 20-step interval (steps 0, 6 and 13 mod 20 for 3 servers), as
/// the shard stands, while training goes on: no drain, and no cut spans the servers. The
/// replacement of server 0, killed at step 50, reloads its own newest save, not the newest
/// save of any server: bit for bit what an uninterrupted run holds at that save's step.
/// The PLS counts from there.
#[test]
fn uncoordinated_saves_are_staggered_and_a_replacement_reloads_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let own = ["--set", "cpr.uncoordinated=true"];
    let run = dir.path().join("run");
    let mut args = own.to_vec();
    args.extend(["--kill", "server:0@step:50"]);
    let report = partial_run(&data, &run, "56", &args);
    assert_eq!(report["steps"], 56);
    assert_eq!(report["steps_rolled_back"], 0);
    let r = &report["recoveries"][0];
    assert_eq!(r["mode"], "partial", "{report}");

    // Each save is one server's, taken at its turn or after (the control loop asks within
    // a tick, a few of this model's steps; steps granted but not yet applied can put the
    // step saved up to a few before the turn), at most one per turn.
    let saves: Vec<(u64, u64, f64)> = events(&run)
        .into_iter()
        .filter(|(k, d)| *k == EventKind::CheckpointEnd && d.contains("own save"))
        .map(|(_, d)| {
            let seconds = |key: &str| -> f64 {
                let rest = &d[d.find(key).unwrap() + key.len()..];
                rest[..rest.find('s').unwrap()].parse().unwrap()
            };
            // The copy that held the shard is a part of the save, the write the rest.
            let (total, held) = (seconds(" in "), seconds("held the shard "));
            assert!(held < total, "{d}");
            (number_after(&d, "server "), number_after(&d, "step "), held)
        })
        .collect();
    for (j, turn) in [(0u64, 0u64), (1, 6), (2, 13)] {
        // The job ends with every server's own save of its last step (the final cut).
        let mut steps: Vec<u64> = saves
            .iter()
            .filter(|&&(server, _, _)| server == j)
            .map(|&(_, step, _)| step)
            .collect();
        assert_eq!(steps.pop(), Some(56), "server {j}: {saves:?}");
        let turns: Vec<u64> = (1..56).filter(|s| s % 20 == turn).collect();
        assert!(
            !steps.is_empty() && steps.len() <= turns.len(),
            "server {j}: {saves:?}"
        );
        for (k, (step, due)) in steps.iter().zip(&turns).enumerate() {
            assert!(
                *step + 3 >= *due && steps[..k].iter().all(|s| s < step),
                "server {j}: its save of step {step} for its turn at step {due}: {saves:?}"
            );
        }
    }

    // Server 0's newest save before the kill, which its replacement reloads.
    let restores = partial_restores(&run);
    assert_eq!(restores.len(), 1, "{restores:?}");
    let reloaded = number_after(&restores[0], "its own save of step ");
    let newest = saves
        .iter()
        .filter(|&&(server, step, _)| server == 0 && step < 50)
        .map(|&(_, step, _)| step)
        .max()
        .unwrap();
    assert_eq!(reloaded, newest, "{}", restores[0]);

    let at_save = digests(&partial_run(
        &data,
        &dir.path().join("r-save"),
        &reloaded.to_string(),
        &own,
    ));
    let at_kill = digests(&partial_run(&data, &dir.path().join("r50"), "50", &own));
    let recovered = digests(r);
    assert_eq!(recovered[1], at_kill[1]);
    assert_eq!(recovered[2], at_kill[2]);
    assert_eq!(
        recovered[0], at_save[0],
        "server 0 holds its own save of step {reloaded}"
    );

    let s_ckpt = number_after(&restores[0], "S_last_ckpt ");
    assert_eq!(s_ckpt, samples_before(reloaded));
    let expected = (samples_before(50) - s_ckpt) as f64 / (samples_before(56) as f64 * 3.0);
    let pls = report["pls"].as_f64().unwrap();
    assert!((pls - expected).abs() < 1e-12, "{pls} vs {expected}");

    // Asked of another mode, the option is refused with the fields named.
    let bad = dir.path().join("bad");
    let args = ClusterRun::new(&data)
        .run_dir(&bad)
        .steps(10)
        .ft("checkpoint")
        .set("cpr.uncoordinated=true")
        .args();
    let out = FTREC.run(&args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cpr.uncoordinated") && err.contains("cluster.ft"),
        "{err}"
    );
}
