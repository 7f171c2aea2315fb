//! A cluster job keeps its result (issue 43 §0): `--save` writes the final model under
//! every `--ft`, and a job with checkpoints ends with a cut at its last step, so the end of
//! the job, not its last scheduled cut, is what an export or a resume starts from.

use std::path::Path;

use ftrec_testkit::ClusterRun;
use ftrec_testkit::cli::{json_of, model};

use crate::FTREC;

use serde_json::Value;

const STEPS: &str = "60";

/// `ftrec eval --model FILE --json`.
fn eval(model_file: &Path, data: &str) -> Value {
    json_of(&FTREC.run(&[
        "eval",
        "--model",
        model_file.to_str().unwrap(),
        "--data",
        data,
        "--json",
    ]))
}

/// The newest checkpoint's step in each server's history under `location`.
fn newest_steps(location: &Path, servers: usize) -> Vec<u64> {
    (0..servers)
        .map(|s| {
            let ck = location.join(format!("server-{s}"));
            let listed = json_of(&FTREC.run(&["ckpt", "ls", ck.to_str().unwrap(), "--json"]));
            let newest = listed.as_array().unwrap().last().cloned().unwrap();
            newest["step"].as_u64().unwrap()
        })
        .collect()
}

#[test]
fn an_erasure_coded_job_saves_the_model_the_trainer_would() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let trained = dir.path().join("train.ftm");
    let mut args = vec![
        "train",
        "--data",
        &data,
        "--steps",
        STEPS,
        "--save",
        trained.to_str().unwrap(),
        "--json",
    ];
    args.extend(model());
    let train = json_of(&FTREC.run(&args));
    let saved = dir.path().join("ec.ftm");
    let out = ClusterRun::new(&data)
        .run_dir(&dir.path().join("ec"))
        .steps(STEPS)
        .servers(3)
        .workers(1)
        .deterministic()
        .ft("ec")
        .arg("--save", saved.display())
        .report(FTREC);
    assert_eq!(out["saved_model"], saved.to_str().unwrap(), "{out}");
    assert_eq!(out["state_digest"], train["state_digest"], "{out}");
    // No checkpoint was configured, and none was written.
    assert!(!dir.path().join("ec/checkpoints").exists());
    let of_cluster = eval(&saved, &data);
    let of_trainer = eval(&trained, &data);
    assert_eq!(of_cluster["state_digest"], train["state_digest"]);
    assert_eq!(of_cluster["model_step"], 60);
    // The AUC the run reported, and exactly the trainer's model's.
    assert_eq!(of_cluster["auc"], out["auc"], "{of_cluster} vs {out}");
    assert_eq!(of_cluster["auc"], of_trainer["auc"]);
    assert_eq!(of_cluster["logloss"], of_trainer["logloss"]);

    // A path that cannot be written is refused before the run, not after it.
    let nowhere = dir.path().join("no-such-folder/m.ftm");
    let refused = FTREC.run(
        &ClusterRun::new(&data)
            .steps(STEPS)
            .servers(3)
            .workers(1)
            .ft("ec")
            .no_eval()
            .arg("--save", nowhere.display())
            .args(),
    );
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("no-such-folder") && said.contains("does not exist"),
        "{said}"
    );
}

#[test]
fn a_job_with_checkpoints_ends_with_a_cut_at_its_last_step() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = FTREC.single_process_digest(&data, STEPS);
    // Cuts every 25 steps fall at 25 and 50; the final one is at 60. Coordinated cuts
    // (DECK's committing in the background), and CPR's own saves of each server.
    for (name, ft, settings) in [
        ("deck", "checkpoint", vec!["checkpoint.strategy=\"deck\""]),
        ("own-saves", "partial", vec!["cpr.uncoordinated=true"]),
    ] {
        let run = dir.path().join(name);
        let saved = run.join("model.ftm");
        std::fs::create_dir_all(&run).unwrap();
        let mut args = ClusterRun::new(&data)
            .run_dir(&run)
            .steps(STEPS)
            .servers(2)
            .workers(1)
            .deterministic()
            .ft(ft)
            .no_eval()
            .set("checkpoint.every_steps=25")
            .arg("--save", saved.display());
        for s in settings {
            args = args.set(s);
        }
        let out = args.report(FTREC);
        assert_eq!(out["state_digest"], expected, "{name}: {out}");
        let location = run.join("checkpoints");
        assert_eq!(newest_steps(&location, 2), [60, 60], "{name}: {out}");
        // The location lists its cuts, each with the servers that hold a part of it.
        let listed = json_of(&FTREC.run(&["ckpt", "ls", location.to_str().unwrap(), "--json"]));
        let cuts = listed["cuts"].as_array().unwrap();
        let last = cuts.last().unwrap();
        assert_eq!(last["step"], 60, "{name}: {listed}");
        assert_eq!(last["servers"], 2, "{name}: {listed}");
        assert_eq!(last["complete"], true, "{name}: {listed}");
        assert_eq!(listed["servers"].as_array().unwrap().len(), 2, "{listed}");
        if name == "own-saves" {
            // Each server saves on its own turn: those steps are no cut of the job.
            assert!(cuts.iter().any(|c| c["complete"] == false), "{listed}");
        }
        assert_eq!(eval(&saved, &data)["state_digest"], expected, "{name}");
        if name == "deck" {
            // The final cut reassembles into the trainer's model at the end.
            let file = run.join("end.safetensors");
            let export = json_of(&FTREC.run(&[
                "ckpt",
                "export",
                location.to_str().unwrap(),
                "--format",
                "safetensors",
                "--out",
                file.to_str().unwrap(),
                "--json",
            ]));
            assert_eq!(export["state_digest"], expected, "{export}");
        }
    }
}
