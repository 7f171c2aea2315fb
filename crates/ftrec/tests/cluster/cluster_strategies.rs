//! Every checkpoint strategy runs on every server of a cluster: a server SIGKILLed at an
//! exact step is replaced, every server rolls back to the last consistent cut, and the run
//! ends bit-identical to the single-process trainer.

use ftrec_testkit::ClusterRun;
use ftrec_testkit::cli::json_of;

use crate::FTREC;

use serde_json::Value;

#[test]
fn every_strategy_recovers_a_killed_server_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = FTREC.single_process_digest(&data, "300");
    // The last scheduled cut (every 40 steps) before the final one, at step 300.
    let at_280 = FTREC.single_process_digest(&data, "280");
    for strategy in [
        "full",
        "differential",
        "naive-incremental",
        "incrcp",
        "deck",
    ] {
        let run = dir.path().join(strategy);
        let set_strategy = format!("checkpoint.strategy=\"{strategy}\"");
        let args = ClusterRun::new(&data)
            .run_dir(&run)
            .steps(300)
            .servers(2)
            .workers(1)
            .deterministic()
            .ft("checkpoint")
            .set("checkpoint.every_steps=40")
            .set(&set_strategy)
            .kill("server:1@step:130")
            .no_eval()
            .args();
        let out = json_of(&FTREC.run(&args));
        assert_eq!(out["state_digest"], expected, "{strategy}: {out}");
        let recoveries = out["recoveries"].as_array().unwrap();
        assert_eq!(recoveries.len(), 1, "{strategy}: {out}");
        // Killed when step 130 was granted: back to the newest committed cut, 120 (or 80
        // when 120 was still committing in the background).
        let resumed = recoveries[0]["resumed_step"].as_u64().unwrap();
        assert!(
            resumed == 120 || (resumed == 80 && strategy != "full"),
            "{strategy}: {out}"
        );
        assert_eq!(out["shard_digests"].as_array().unwrap().len(), 2);
        for s in 0..2 {
            let ck = run.join(format!("checkpoints/server-{s}"));
            let ck = ck.to_str().unwrap();
            let verify = FTREC.run(&["ckpt", "verify", ck]);
            assert!(
                verify.status.success(),
                "{strategy} server {s}: {}",
                String::from_utf8_lossy(&verify.stdout)
            );
            let listed: Value = json_of(&FTREC.run(&["ckpt", "ls", ck, "--json"]));
            let newest = listed.as_array().unwrap().last().unwrap().clone();
            // The strategy really ran on the shard: after the recovery's first (full)
            // cut, the newest cut is the strategy's own kind.
            let kind = newest["kind"].as_str().unwrap();
            assert_eq!(
                kind == "full",
                strategy == "full",
                "{strategy} server {s}: newest checkpoint is {newest}"
            );
        }
        // The cluster location as a whole: listed, verified, merged, and exported as one
        // global model equal to the single-process trainer's at the cut. The newest is
        // the final cut, at the job's last step: the trained model itself.
        let location = run.join("checkpoints");
        let location = location.to_str().unwrap();
        for args in [
            vec!["ckpt", "ls", location],
            vec!["ckpt", "verify", location],
            vec!["ckpt", "merge", location],
        ] {
            let out = FTREC.run(&args);
            assert!(
                out.status.success(),
                "{strategy} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // The cut before the final one is 280, the last scheduled. Once, with the whole
        // test suite running on 2 cores, no server held one (session 67; its run
        // directory was gone, and alone or beside two busy loops the test kept it in 4
        // runs of 4). Likely a cut that failed there under load: the schedule owes it and
        // takes it after a backoff, at a later step (`CutSchedule::due`). So: the newest
        // cut below 300 that both servers hold after the merge, against the
        // single-process trainer at its step.
        let before_final = newest_common_step_below(&run, 300);
        let at_before_final = if before_final == 280 {
            at_280.clone()
        } else {
            eprintln!("{strategy}: no cut at 280; the one before the final is {before_final}");
            FTREC.single_process_digest(&data, &before_final.to_string())
        };
        let before_final = before_final.to_string();
        for (id, digest) in [
            (None, &expected),
            (Some(before_final.as_str()), &at_before_final),
        ] {
            let file = run.join(format!("export-{}.safetensors", id.unwrap_or("newest")));
            let mut args = vec![
                "ckpt",
                "export",
                location,
                "--format",
                "safetensors",
                "--out",
                file.to_str().unwrap(),
                "--json",
            ];
            if let Some(id) = id {
                args.extend(["--id", id]);
            }
            let out = json_of(&FTREC.run(&args));
            assert_eq!(
                &out["state_digest"], digest,
                "{strategy} export {id:?}: {out}"
            );
        }
    }
}

/// The newest step below `below` at which both servers of the job in `run` hold a
/// checkpoint.
fn newest_common_step_below(run: &std::path::Path, below: u64) -> u64 {
    let steps = |s: usize| -> std::collections::BTreeSet<u64> {
        let ck = run.join(format!("checkpoints/server-{s}"));
        let listed: Value = json_of(&FTREC.run(&["ckpt", "ls", ck.to_str().unwrap(), "--json"]));
        listed
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["step"].as_u64())
            .filter(|&step| step < below)
            .collect()
    };
    let (first, second) = (steps(0), steps(1));
    *first
        .intersection(&second)
        .max()
        .unwrap_or_else(|| panic!("no cut below {below} on both servers: {first:?} {second:?}"))
}
