//! Inputs that used to crash ftrec or end it silently (issue 13): oversized models and
//! cluster members, a reader that closes the pipe, gzipped day files, stale datasets,
//! resumes that cannot do what they were asked, and a guessable cluster run directory.

use ftrec_testkit::ClusterRun;
use ftrec_testkit::cli::json_of;

use crate::FTREC;

use std::io::Write;
use std::path::Path;
use std::process::{Output, Stdio};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn generate(dir: &Path, rows: &str) {
    json_of(&FTREC.run(&[
        "data",
        "gen",
        "--rows",
        rows,
        "--out",
        dir.to_str().unwrap(),
        "--json",
    ]));
}

const SMALL: [&str; 10] = [
    "--set",
    "model.rows_per_table=500",
    "--set",
    "model.dim=8",
    "--set",
    "model.bottom=[16, 8]",
    "--set",
    "model.top=[16, 1]",
    "--set",
    "train.batch_size=64",
];

#[test]
fn sizes_that_cannot_fit_are_refused_by_key_not_aborted() {
    for (sets, key) in [
        (
            &["train.batch_size=1000000000"][..],
            "train.batch_size = 1000000000",
        ),
        (
            &["model.rows_per_table=4294967295"],
            "model.rows_per_table = 4294967295",
        ),
        (
            &["model.dim=100000", "model.bottom=[512,100000]"],
            "model.dim = 100000",
        ),
        (
            &["model.bottom=[100000000,64]"],
            "model.bottom = [100000000, 64]",
        ),
    ] {
        let mut args = vec!["train", "--data", "/nonexistent"];
        for s in sets {
            args.extend(["--set", s]);
        }
        let out = FTREC.run(&args);
        let err = stderr(&out);
        // An allocation failure aborts with SIGABRT (no exit code) and this text.
        assert_eq!(out.status.code(), Some(1), "{sets:?}: {err}");
        assert!(!err.contains("memory allocation"), "{sets:?}: {err}");
        assert!(
            err.contains("needs about") && err.contains("available") && err.contains(key),
            "{sets:?}: {err}"
        );
    }
}

/// Runs ftrec with a reader that goes away: before any output, or (`| head -c1`) after the
/// first byte. Returns its stderr after checking that it exited 0 without a panic.
fn with_closed_pipe(args: &[&str], read_first_byte: bool) -> String {
    let mut child = FTREC
        .command()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    if read_first_byte {
        let mut byte = [0u8; 1];
        std::io::Read::read_exact(&mut stdout, &mut byte).unwrap();
    }
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(
        !err.contains("panicked") && !err.contains("Broken pipe"),
        "{args:?}: {err}"
    );
    assert!(out.status.success(), "{args:?}: {:?}: {err}", out.status);
    err
}

#[test]
fn a_reader_that_closes_the_pipe_ends_the_output_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    generate(&data, "2000");
    let ck = dir.path().join("ck");
    let (d, c) = (data.to_str().unwrap(), ck.to_str().unwrap());
    let mut train = vec!["train", "--data", d, "--steps", "6", "--checkpoint-dir", c];
    train.extend(["--set", "checkpoint.every_steps=2"]);
    train.extend(SMALL);
    json_of(&FTREC.run(&[&train[..], &["--json"]].concat()));
    let gen_out = dir.path().join("gen");
    let gen_args = [
        "data",
        "gen",
        "--rows",
        "500",
        "--out",
        gen_out.to_str().unwrap(),
    ];
    // Every command prints through one helper; these cover the data, checkpoint and
    // generator commands and clap's own help.
    for args in [
        &["data", "stats", d][..],
        &["ckpt", "ls", c],
        &["ckpt", "ls", c, "--json"],
        &["ckpt", "verify", c],
        &gen_args,
        &["--help"],
    ] {
        for read_first_byte in [false, true] {
            with_closed_pipe(args, read_first_byte);
        }
    }
}

#[test]
fn servers_and_workers_started_by_hand_are_sized_against_memory() {
    let dir = tempfile::tempdir().unwrap();
    let job = |name: &str, rows: &str, batch: &str| {
        // The tiny preset written out, with the dataset a cluster job needs (the default
        // cluster section: 2 servers).
        let text = include_str!("../../../../configs/tiny.toml")
            .replace(
                "rows_per_table = 100000",
                &format!("rows_per_table = {rows}"),
            )
            .replace("batch_size = 2048", &format!("batch_size = {batch}"));
        let path = dir.path().join(name);
        std::fs::write(&path, format!("{text}\ndir = \"/nonexistent\"\n")).unwrap();
        path.to_str().unwrap().to_string()
    };
    let run = |args: &[&str]| {
        let out = FTREC
            .command()
            .args(args)
            .env("FTREC_JOB_SECRET", "a-test-secret-of-enough-length")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        stderr(&out)
    };
    let coordinator = ["--coordinator", "127.0.0.1:1"];
    let huge_rows = job("rows.toml", "4294967295", "2048");
    for who in [&["--id", "1"][..], &["--spare"]] {
        let err = run(&[&["server", "--job", &huge_rows][..], &coordinator, who].concat());
        assert!(!err.contains("memory allocation"), "{err}");
        let subject = if who[0] == "--spare" {
            "a spare server"
        } else {
            "server 1"
        };
        assert!(
            err.contains(&format!("{subject} of this job needs about"))
                && err.contains("available")
                && err.contains("model.rows_per_table = 4294967295")
                && err.contains("cluster.servers = 2"),
            "{err}"
        );
    }
    // A worker holds no tables: the same job is refused only for its batch.
    let huge_batch = job("batch.toml", "1000", "1000000000");
    let worker =
        |job: &str| run(&[&["worker", "--job", job, "--id", "0"][..], &coordinator].concat());
    let err = worker(&huge_batch);
    assert!(
        err.contains("a worker of this job needs about")
            && err.contains("train.batch_size = 1000000000"),
        "{err}"
    );
    assert!(!worker(&huge_rows).contains("needs about"));
}

#[test]
fn data_gen_replaces_a_stale_dataset_whole() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("d");
    let gen_into = |format: &str, rows: &str| {
        json_of(&FTREC.run(&[
            "data",
            "gen",
            "--rows",
            rows,
            "--format",
            format,
            "--out",
            out.to_str().unwrap(),
            "--json",
        ]))
    };
    let names = || {
        let mut n: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    };
    gen_into("binary", "2000");
    assert_eq!(names(), ["meta.json", "test.ftrd", "train.ftrd"]);
    // Text data into the same directory: the old binary files would be read by `train`
    // with the new meta.json, so they go; nothing staged is left.
    gen_into("criteo-tsv", "1000");
    assert_eq!(names(), ["meta.json", "test.txt", "train.txt"]);
    // Back to binary: the text files may be someone's convert input and stay; the binary
    // files and meta.json describe the new 500 rows.
    let r = gen_into("binary", "500");
    assert_eq!(
        names(),
        [
            "meta.json",
            "test.ftrd",
            "test.txt",
            "train.ftrd",
            "train.txt"
        ]
    );
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["train_samples"], r["train_samples"]);
    let stats = json_of(&FTREC.run(&[
        "data",
        "stats",
        out.join("train.ftrd").to_str().unwrap(),
        "--json",
    ]));
    assert!(
        stats
            .to_string()
            .contains(&format!("{}", r["train_samples"])),
        "{stats}"
    );
    // A file where the directory should be is named, not "File exists (os error 17)".
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let e = FTREC.run(&[
        "data",
        "gen",
        "--rows",
        "100",
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(stderr(&e).contains("is not a directory"), "{}", stderr(&e));
}

#[test]
fn the_default_cluster_run_directory_is_private_and_unpredictable() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    generate(&data, "2000");
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let cluster = |extra: &[&str]| {
        // No --run-dir: the launcher makes one under $TMPDIR.
        let args = ClusterRun::bare(data.to_str().unwrap())
            .steps(4)
            .servers(1)
            .workers(1)
            .no_eval()
            .json()
            .extend(SMALL)
            .extend(extra)
            .args();
        FTREC
            .command()
            .args(&args)
            .env("TMPDIR", &tmp)
            .output()
            .unwrap()
    };
    let mut seen = Vec::new();
    for _ in 0..2 {
        let r = json_of(&cluster(&[]));
        let run_dir = r["run_dir"].as_str().unwrap().to_string();
        let name = run_dir
            .strip_prefix(&format!("{}/ftrec-cluster-", tmp.display()))
            .unwrap();
        // 128 random bits: neither a pid nor a clock another user could guess.
        assert_eq!(name.len(), 32, "{run_dir}");
        assert_eq!(r["run_dir_removed"], true);
        seen.push(run_dir);
    }
    assert_ne!(seen[0], seen[1]);
    // A run refused before launching leaves no empty directory behind.
    let out = cluster(&["--kill", "server:5@1s"]);
    assert!(!out.status.success());
    assert_eq!(std::fs::read_dir(&tmp).unwrap().count(), 0);
}

#[test]
fn gzipped_criteo_converts_and_all_bad_lines_fail() {
    let dir = tempfile::tempdir().unwrap();
    let good = format!("0{}{}", "\t1".repeat(13), "\t0a0b0c0d".repeat(26));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    for _ in 0..20 {
        writeln!(gz, "{good}").unwrap();
    }
    let input = dir.path().join("day_0.gz");
    std::fs::write(&input, gz.finish().unwrap()).unwrap();
    let out_dir = dir.path().join("out");
    let args = [
        "data",
        "convert",
        input.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
        "--skip-bad-lines",
        "--json",
    ];
    let r = json_of(&FTREC.run(&args));
    assert_eq!(
        (r["train_samples"].as_u64(), r["test_samples"].as_u64()),
        (Some(18), Some(2))
    );
    assert_eq!(r["bad_lines"], 0);
    std::fs::write(&input, "garbage\n".repeat(20)).unwrap();
    let out = FTREC.run(&args);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("all 20 lines"), "{}", stderr(&out));
}

#[test]
fn resumes_say_what_differs_and_refuse_to_go_backwards() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    generate(&data, "3000");
    let ck = dir.path().join("ck");
    let base = |extra: &[&str]| {
        let mut a = vec!["train", "--data", data.to_str().unwrap(), "--json"];
        a.extend(SMALL);
        a.extend(extra);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| FTREC.run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let ck_s = ck.to_str().unwrap();
    json_of(&run(base(&["--steps", "10", "--checkpoint-dir", ck_s])));

    let out = run(base(&["--steps", "4", "--resume", ck_s]));
    let err = stderr(&out);
    assert!(!out.status.success(), "ran 0 steps and succeeded: {err}");
    assert!(
        err.contains("at step 10") && err.contains("stops at step 4"),
        "{err}"
    );

    let mut other = base(&["--steps", "12", "--resume", ck_s]);
    other.extend(["--set".into(), "model.dim=4".into()]);
    other.extend(["--set".into(), "model.bottom=[16, 4]".into()]);
    let err = stderr(&run(other));
    assert!(err.contains("model.dim: 8 vs 4"), "{err}");
    assert!(err.contains("model.bottom: [16, 8] vs [16, 4]"), "{err}");

    let out = run(base(&[
        "--steps",
        "12",
        "--resume",
        ck_s,
        "--seed",
        "9",
        "--set",
        "train.batch_size=32",
    ]));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("seed 1") && err.contains("seed = 9"), "{err}");
    assert!(
        err.contains("train.batch_size = 64") && err.contains("with 32"),
        "{err}"
    );
}
