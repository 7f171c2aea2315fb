//! The `ftrec` binary as users and scripts call it.

use std::path::Path;

use serde_json::Value;

use ftrec_testkit::cli::json_of;

use crate::FTREC;

fn generate_data(dir: &Path, rows: &str, seed: &str) -> Value {
    json_of(&FTREC.run(&[
        "data",
        "gen",
        "--preset",
        "tiny",
        "--rows",
        rows,
        "--seed",
        seed,
        "--out",
        dir.to_str().unwrap(),
        "--json",
    ]))
}

const SMALL: [&str; 10] = [
    "--set",
    "model.rows_per_table=3000",
    "--set",
    "model.dim=16",
    "--set",
    "model.bottom=[64, 16]",
    "--set",
    "model.top=[64, 1]",
    "--set",
    "train.batch_size=256",
];

#[test]
fn gen_train_save_eval_round_trip_with_json_contracts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let g = generate_data(&data, "6000", "3");
    assert!(g["teacher_auc"].as_f64().unwrap() > 0.6);
    let model = dir.path().join("m.ftm");
    let mut args = vec![
        "train",
        "--preset",
        "tiny",
        "--data",
        data.to_str().unwrap(),
        "--seed",
        "3",
        "--steps",
        "12",
        "--json",
        "--save",
        model.to_str().unwrap(),
    ];
    args.extend(SMALL);
    let a = json_of(&FTREC.run(&args));
    for key in [
        "auc",
        "logloss",
        "samples",
        "samples_per_sec",
        "state_digest",
    ] {
        assert!(!a[key].is_null(), "train --json lacks {key}: {a}");
    }
    assert_eq!(a["samples"], 12 * 256);
    let b = json_of(&FTREC.run(&args));
    assert_eq!(
        a["state_digest"], b["state_digest"],
        "same seed must give the same bits"
    );
    let e = json_of(&FTREC.run(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(
        e["auc"], a["auc"],
        "eval of the saved model must match train's evaluation"
    );
    assert_eq!(e["state_digest"], a["state_digest"]);
    assert_eq!(e["model_step"], 12);
}

#[test]
fn exact_preset_forms_work() {
    let dir = tempfile::tempdir().unwrap();
    generate_data(dir.path(), "3000", "1");
    let t = json_of(&FTREC.run(&[
        "train",
        "--preset",
        "tiny",
        "--data",
        dir.path().to_str().unwrap(),
        "--seed",
        "1",
        "--steps",
        "1",
        "--json",
    ]));
    assert_eq!(t["samples"], 2048);
    let b = json_of(&FTREC.run(&[
        "bench", "train", "--preset", "tiny", "--json", "--warmup", "1", "--steps", "2",
    ]));
    assert!(b["samples_per_sec"].as_f64().unwrap() > 0.0);
    assert!(b["step_ms_median"].as_f64().unwrap() > 0.0);
}

#[test]
fn malformed_data_names_file_and_line_and_can_be_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let good = format!("0{}{}", "\t1".repeat(13), "\t0a0b0c0d".repeat(26));
    let input = dir.path().join("day_0");
    std::fs::write(
        &input,
        format!("{good}\n{good}\n1\t2\tnot-enough\n{good}\n"),
    )
    .unwrap();
    let out_dir = dir.path().join("out");
    let args = [
        "data",
        "convert",
        input.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
        "--json",
    ];
    let fail = FTREC.run(&args);
    assert!(!fail.status.success());
    let err = String::from_utf8_lossy(&fail.stderr);
    assert!(
        err.contains("day_0:3:") && err.contains("field 3 (I2)"),
        "{err}"
    );
    let mut skip = args.to_vec();
    skip.push("--skip-bad-lines");
    let r = json_of(&FTREC.run(&skip));
    assert_eq!(r["bad_lines"], 1);
    assert_eq!(
        r["train_samples"].as_u64().unwrap() + r["test_samples"].as_u64().unwrap(),
        3
    );
}

#[test]
fn bad_configuration_is_reported_by_key() {
    let out = FTREC.run(&[
        "train",
        "--preset",
        "tiny",
        "--data",
        "/nonexistent",
        "--set",
        "train.bach_size=3",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bach_size"), "{err}");
    let out = FTREC.run(&["train", "--preset", "tiny", "--data", "/nonexistent"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent"), "{err}");
}

#[test]
fn bench_ckpt_writes_csv_plots_and_a_verified_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let scratch = dir.path().join("scratch");
    let summary = json_of(&FTREC.run(&[
        "bench",
        "ckpt",
        "--scale",
        "0.003",
        "--checkpoints",
        "6",
        "--interval",
        "2",
        "--restore-every",
        "2",
        "--full-samples",
        "2",
        "--differential-full-every",
        "4",
        "--batch-size",
        "256",
        "--dir",
        scratch.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]));
    let strategies = summary["strategies"].as_array().unwrap();
    let names: Vec<&str> = strategies
        .iter()
        .map(|s| s["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["full", "differential", "naive-incremental", "incrcp"]
    );
    for s in strategies {
        assert_eq!(s["verified_digest"], true, "{s}");
        assert_eq!(s["checkpoints"], 6, "{s}");
    }
    assert!(summary["incrcp_restore_speedup_vs_naive"].as_f64().unwrap() > 0.0);
    // IncrCP's rectangle never holds more than naive's chain: the extracted rows are
    // de-duplicated, never copied.
    assert!(
        summary["incrcp_restore_bytes_ratio_vs_naive"]
            .as_f64()
            .unwrap()
            >= 1.0
    );
    let disk = &summary["disk"];
    for side in ["write", "read"] {
        let best = disk[format!("dd_{side}_bytes_per_second")]
            .as_f64()
            .unwrap();
        let buffered = disk[format!("dd_{side}_buffered_bytes_per_second")]
            .as_f64()
            .unwrap();
        let direct = disk[format!("dd_{side}_direct_bytes_per_second")]
            .as_f64()
            .unwrap();
        assert!(buffered > 0.0 && direct > 0.0, "{disk}");
        // Per sample the faster of the two, so its median is at least either median.
        assert!(best >= buffered.max(direct), "{disk}");
    }
    let deck = summary["deck"].as_array().unwrap();
    assert_eq!(deck.len(), 2);
    assert!(deck[1]["peak_resident_chunks"].as_u64().unwrap() <= 4);
    let csv = std::fs::read_to_string(out.join("incrcp.csv")).unwrap();
    // A header and 6 rows per strategy; restores timed on rows 0, 2, 4 and 5.
    assert_eq!(csv.lines().count(), 1 + 4 * 6, "{csv}");
    let timed = csv
        .lines()
        .skip(1)
        .filter(|l| !l.split(',').nth(7).unwrap().is_empty());
    assert_eq!(timed.count(), 4 * 4, "{csv}");
    for png in ["restore.png", "construction.png", "storage.png", "deck.png"] {
        let bytes = std::fs::read(out.join(png)).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "{png}");
    }
    assert!(!scratch.exists(), "scratch space is removed");
}

#[test]
fn bench_ckpt_rejects_an_unknown_or_deck_strategy_by_name() {
    for (value, expected) in [
        ("foo", "unknown strategy \"foo\""),
        ("deck", "own experiment"),
    ] {
        let out = FTREC.run(&["bench", "ckpt", "--strategies", value]);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{stderr}");
    }
}
