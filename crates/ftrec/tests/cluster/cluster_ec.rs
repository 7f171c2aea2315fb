//! ECRec (`--ft ec`): rows and optimizer state erasure coded, dense parameters replicated.
//! A SIGKILLed server is rebuilt from the survivors, nothing rolls back, and in
//! deterministic mode with one worker the run ends at the uninterrupted `ftrec train`
//! digest: no update lost, every rebuilt row bit-identical. After every run every stripe's
//! parity and every dense replica are checked against the data.

use ftrec_testkit::ClusterRun;
use ftrec_testkit::cli::{json_of, model};

use crate::FTREC;

use serde_json::Value;

const STEPS: &str = "60";

/// `ftrec train`'s digest with `extra` settings.
fn train_digest(data: &str, extra: &[&str]) -> Value {
    let mut args = vec!["train", "--data", data, "--steps", STEPS, "--json"];
    args.extend(model());
    args.extend(extra);
    json_of(&FTREC.run(&args))["state_digest"].clone()
}

/// A deterministic one-worker `--ft ec` run with `extra` flags.
fn ec_run(data: &str, run: &std::path::Path, servers: &str, extra: &[&str]) -> Value {
    ec_run_with(data, run, servers, "ec", extra)
}

/// A deterministic one-worker run under fault tolerance `ft` with `extra` flags.
fn ec_run_with(
    data: &str,
    run: &std::path::Path,
    servers: &str,
    ft: &str,
    extra: &[&str],
) -> Value {
    ec_args(data, run, servers, ft, extra).report(FTREC)
}

/// The command line of a deterministic one-worker run under `ft` with `extra` flags.
fn ec_args(
    data: &str,
    run: &std::path::Path,
    servers: &str,
    ft: &str,
    extra: &[&str],
) -> ClusterRun {
    ClusterRun::new(data)
        .run_dir(run)
        .steps(STEPS)
        .servers(servers)
        .workers(1)
        .deterministic()
        .ft(ft)
        .no_eval()
        .extend(extra)
}

/// Runs `ftrec args`, which must fail, and returns what it said.
fn refused(args: &[String]) -> String {
    let out = FTREC.run(args);
    assert!(!out.status.success(), "{args:?} should have been refused");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Every stripe's parity matches its rows and every dense replica its primary.
fn assert_copies_agree(out: &Value, what: &str) {
    assert_eq!(out["parity_mismatches"], 0, "{what}: {out}");
    assert_eq!(out["replica_mismatches"], 0, "{what}: {out}");
}

/// The run ended in the uninterrupted run's state, bit for bit, with its copies agreeing.
fn assert_same_state(out: &Value, expected: &Value, what: &str) {
    assert_eq!(&out["state_digest"], expected, "{what}: {out}");
    assert_copies_agree(out, what);
}

/// The run ended exact and fully redundant, after one recovery per listed slot (in any
/// order: two servers killed at the same step die, and are found, in either order).
fn assert_exact(out: &Value, expected: &Value, rebuilt: &[u64], what: &str) {
    assert_same_state(out, expected, what);
    let recoveries = out["recoveries"].as_array().unwrap();
    let mut servers: Vec<u64> = recoveries
        .iter()
        .map(|r| r["server"].as_u64().unwrap())
        .collect();
    servers.sort_unstable();
    let mut rebuilt = rebuilt.to_vec();
    rebuilt.sort_unstable();
    assert_eq!(servers, rebuilt, "{what}: {out}");
    for (i, r) in recoveries.iter().enumerate() {
        assert_eq!(
            r["steps_rolled_back"], 0,
            "{what}: nothing rolls back: {out}"
        );
        // A replacement that died mid-rebuild rebuilt nothing; the slot's last one did.
        let last_of_slot = recoveries[i + 1..]
            .iter()
            .all(|l| l["server"] != r["server"]);
        if last_of_slot {
            assert!(r["rebuild_bytes"].as_u64().unwrap() > 0, "{what}: {out}");
        }
    }
}

#[test]
fn a_kill_of_any_server_is_rebuilt_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = train_digest(&data, &[]);
    let out = ec_run(&data, &dir.path().join("plain"), "3", &[]);
    assert_exact(&out, &expected, &[], "no failure");
    for server in 0..3u64 {
        let kill = format!("server:{server}@step:30");
        let out = ec_run(
            &data,
            &dir.path().join(format!("kill-{server}")),
            "3",
            &["--kill", &kill],
        );
        assert_exact(&out, &expected, &[server], &kill);
    }
}

#[test]
fn kills_in_both_commit_phases_mid_rebuild_and_after_a_rebuild_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = train_digest(&data, &[]);
    let cases: [(&[&str], &[u64]); 4] = [
        // Phase 1: its differences are staged at the parity holders, nobody commits.
        (&["--kill", "server:1@prepare:30"], &[1]),
        // Phase 2: the survivors commit, the rebuild decodes the rows with the step.
        (&["--kill", "server:2@commit:30"], &[2]),
        // The replacement dies while rebuilding; the next one rebuilds from scratch.
        (
            &["--kill", "server:0@step:20", "--kill", "server:0@rebuild"],
            &[0, 0],
        ),
        // A second failure after the first rebuild finished.
        (
            &["--kill", "server:1@step:15", "--kill", "server:2@step:40"],
            &[1, 2],
        ),
    ];
    for (i, (kills, rebuilt)) in cases.iter().enumerate() {
        let out = ec_run(&data, &dir.path().join(format!("case-{i}")), "3", kills);
        assert_exact(&out, &expected, rebuilt, &kills.join(" "));
    }
}

#[test]
fn wider_stripes_are_rebuilt_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = train_digest(&data, &[]);
    let out = ec_run(
        &data,
        &dir.path().join("k3"),
        "4",
        &["--set", "ec.k=3", "--kill", "server:3@commit:25"],
    );
    assert_exact(&out, &expected, &[3], "k = 3");
}

/// k = 2, r = 2 on 4 servers with the default `ec.replicate_dense`: `pair` SIGKILLed at
/// the same step, and the run ends exact.
fn two_of_four_lost_at_once(data: &str, dir: &std::path::Path, expected: &Value, pair: [u64; 2]) {
    let kills: Vec<String> = pair
        .iter()
        .flat_map(|s| ["--kill".to_string(), format!("server:{s}@step:30")])
        .collect();
    let mut extra = vec!["--set", "ec.r=2"];
    extra.extend(kills.iter().map(String::as_str));
    let run = dir.join(format!("r2-{}-{}", pair[0], pair[1]));
    let out = ec_run(data, &run, "4", &extra);
    assert_exact(
        &out,
        expected,
        &pair,
        &format!("r = 2, servers {pair:?} at once"),
    );
}

/// r = 2 promises any two: every pair of the 4 servers (6 runs, about 8 s), neighbours
/// too, whose dense ranges one replica each could not keep (the replica of server J lives
/// on J + 1), and the pair across the wrap.
#[test]
fn r2_survives_every_pair_of_servers_lost_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = train_digest(&data, &[]);
    for a in 0..4 {
        for b in a + 1..4 {
            two_of_four_lost_at_once(&data, dir.path(), &expected, [a, b]);
        }
    }
}

#[test]
fn every_stateful_optimizer_is_rebuilt_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    // Row-wise Adagrad exists for embedding rows only; its dense side uses Adagrad.
    for (kind, dense_kind, more) in [
        ("momentum", "momentum", ",momentum=0.9"),
        ("adagrad", "adagrad", ""),
        ("rowwise_adagrad", "adagrad", ""),
        ("adam", "adam", ""),
    ] {
        let sparse = format!("optimizer.sparse={{kind=\"{kind}\",lr=0.05{more}}}");
        let dense = format!("optimizer.dense={{kind=\"{dense_kind}\",lr=0.01{more}}}");
        let settings = ["--set", &sparse, "--set", &dense];
        let expected = train_digest(&data, &settings);
        let mut extra = settings.to_vec();
        extra.extend(["--kill", "server:1@commit:33"]);
        let out = ec_run(&data, &dir.path().join(kind), "3", &extra);
        assert_exact(&out, &expected, &[1], kind);
    }
}

#[test]
fn more_losses_than_the_code_covers_end_the_run_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let args = ec_args(&data, dir.path(), "3", "ec", &[])
        .kill("server:0@step:30")
        .kill("server:1@step:30")
        .args();
    let err = refused(&args);
    assert!(
        err.contains("2 servers of erasure-coding group 0") && err.contains("ec+checkpoint"),
        "{err}"
    );

    // A stripe needs k + r distinct servers: refused before anything starts.
    let args = ClusterRun::new(&data)
        .run_dir(dir.path())
        .steps(STEPS)
        .servers(2)
        .ft("ec")
        .args();
    let err = refused(&args);
    assert!(
        err.contains("cluster.servers = 2") && err.contains("ec.k + ec.r = 3"),
        "{err}"
    );

    // A kill of a server the cluster does not have is refused, not ignored.
    let args = ClusterRun::new(&data)
        .run_dir(dir.path())
        .steps(STEPS)
        .servers(3)
        .ft("ec")
        .kill("server:5@1s")
        .args();
    let err = refused(&args);
    assert!(
        err.contains("server 5") && err.contains("3 servers"),
        "{err}"
    );
}

#[test]
fn checkpoints_as_a_second_layer_take_over_when_the_code_cannot() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = train_digest(&data, &[]);
    let out = ec_run_with(
        &data,
        dir.path(),
        "3",
        "ec+checkpoint",
        &[
            "--set",
            "checkpoint.every_steps=10",
            // One loss the code rebuilds (the replacement's cuts then continue its slot's
            // history), then two at once, which roll back to the cut at step 40.
            "--kill",
            "server:2@step:15",
            "--kill",
            "server:0@step:45",
            "--kill",
            "server:1@step:45",
        ],
    );
    assert_same_state(&out, &expected, "ec+checkpoint");
    let recoveries = out["recoveries"].as_array().unwrap();
    let seen: Vec<(u64, u64)> = recoveries
        .iter()
        .map(|r| {
            (
                r["server"].as_u64().unwrap(),
                r["resumed_step"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(seen[0], (2, 16), "rebuilt, nothing rolled back: {out}");
    assert_eq!(recoveries[0]["steps_rolled_back"], 0, "{out}");
    let rolled: Vec<u64> = seen[1..].iter().map(|&(s, _)| s).collect();
    assert_eq!(rolled, [0, 1], "{out}");
    assert!(seen[1..].iter().all(|&(_, step)| step == 40), "{out}");
    // The erasure-coded cut reassembles into one global model (the striped layout
    // inverted, padding slots dropped) equal to the trainer's at that step.
    let file = dir.path().join("cut-50.safetensors");
    let export = json_of(&FTREC.run(&[
        "ckpt",
        "export",
        dir.path().join("checkpoints").to_str().unwrap(),
        "--id",
        "50",
        "--format",
        "safetensors",
        "--out",
        file.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(
        export["state_digest"],
        FTREC.single_process_digest(&data, "50"),
        "{export}"
    );
}

/// A cut that a server's death leaves without counting is owed: erasure coding rolls
/// nothing back, so training goes past the cut's step while the slot rebuilds, and the cut
/// is taken at the first step after it rather than a whole interval later.
#[test]
fn a_cut_lost_with_a_server_is_taken_after_the_rebuild_not_an_interval_later() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = train_digest(&data, &[]);
    let out = ec_run_with(
        &data,
        dir.path(),
        "3",
        "ec+checkpoint",
        &[
            "--set",
            "checkpoint.every_steps=20",
            // Server 1 dies when asked for its part of the cut of step 20.
            "--fault",
            "server:1@cut:20",
        ],
    );
    assert_same_state(&out, &expected, "owed cut");
    let recoveries = out["recoveries"].as_array().unwrap();
    assert_eq!(recoveries.len(), 1, "{out}");
    assert_eq!(recoveries[0]["steps_rolled_back"], 0, "{out}");
    let cuts: Vec<u64> = out["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["step"].as_u64().unwrap())
        .collect();
    assert!(
        !cuts.contains(&20),
        "the cut of step 20 cannot count: {cuts:?}"
    );
    assert!(
        cuts.iter().any(|&c| c > 20 && c < 40),
        "the owed cut comes before step 40: {cuts:?}"
    );
    assert!(cuts.contains(&40), "{cuts:?}");
}

#[test]
fn asynchronous_workers_keep_parity_exact_through_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let args = ClusterRun::new(&data)
        .run_dir(dir.path())
        .steps(120)
        .servers(3)
        .workers(2)
        .ft("ec")
        .no_eval()
        .kill("server:1@step:50")
        .args();
    let out = json_of(&FTREC.run(&args));
    // Two workers prepare one server at a time in slot order; whatever the interleaving,
    // every stripe's parity matches its rows, every replica its primary, and every step's
    // samples count once.
    assert_copies_agree(&out, "async workers");
    assert_eq!(out["lost_samples"], 0, "{out}");
    assert_eq!(out["steps"], 120, "{out}");
    assert_eq!(out["recoveries"].as_array().unwrap().len(), 1, "{out}");

    // The same with the replacement serving degraded while both workers commit around
    // its decodes: a snapshot straddling a commit is read again, never installed.
    let slow = dir.path().join("slow");
    let args = ClusterRun::new(&data)
        .run_dir(&slow)
        .steps(120)
        .servers(3)
        .workers(2)
        .ft("ec")
        .no_eval()
        .kill("server:1@step:30")
        .extend(SLOW_REBUILD)
        .args();
    let out = json_of(&FTREC.run(&args));
    assert_copies_agree(&out, "async workers, slow rebuild");
    assert_eq!(out["lost_samples"], 0, "{out}");
    assert_eq!(out["steps"], 120, "{out}");
    assert!(
        out["recoveries"][0]["steps_while_degraded"]
            .as_u64()
            .unwrap()
            > 0,
        "{out}"
    );
}

/// Caps the background rebuild (about 4.6 MB here) so training runs degraded a while.
const SLOW_REBUILD: [&str; 2] = ["--set", "ec.rebuild_bytes_per_sec=3000000"];

#[test]
fn training_goes_on_degraded_while_the_replacement_rebuilds_in_the_background() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = train_digest(&data, &[]);
    // Steps run while the replacement serves rows it has not rebuilt yet: each pull or
    // push decodes what it needs from the survivors, and parity slots not rebuilt yet
    // fold nothing; the run still ends at the trainer's digest.
    let mut extra = SLOW_REBUILD.to_vec();
    extra.extend(["--kill", "server:1@step:10"]);
    let out = ec_run(&data, &dir.path().join("slow"), "3", &extra);
    assert_exact(&out, &expected, &[1], "slow background rebuild");
    let r = &out["recoveries"][0];
    assert_eq!(r["background_rebuild"], true, "{out}");
    let kill_to_resume = r["kill_to_resume_seconds"].as_f64().unwrap();
    assert!(
        kill_to_resume > 0.0 && kill_to_resume < r["degraded_seconds"].as_f64().unwrap(),
        "training resumed long before the rebuild ended: {out}"
    );
    assert!(
        // At 3 MB/s the rebuild takes about 1.5 s; a loaded CI machine still trains a
        // few steps in that time.
        r["steps_while_degraded"].as_u64().unwrap() >= 3,
        "training went on during the rebuild: {out}"
    );
    assert!(
        r["degraded_seconds"].as_f64().unwrap()
            > r["resumed_at"].as_f64().unwrap() - r["detected_at"].as_f64().unwrap(),
        "training resumed before full redundancy was back: {out}"
    );
    // Not only allowed to: a worker finished a step before the rebuild ended.
    let first_step = r["first_step_at"].as_f64().unwrap();
    assert!(
        first_step >= r["resumed_at"].as_f64().unwrap()
            && first_step
                < r["detected_at"].as_f64().unwrap() + r["degraded_seconds"].as_f64().unwrap(),
        "a step settled during the background rebuild: {out}"
    );
    assert!(
        r["kill_to_first_step_seconds"].as_f64().unwrap() >= kill_to_resume,
        "{out}"
    );

    // The same with the survivors' ranges inside the RPC replies (what TLS jobs use)
    // rather than over their bulk ports.
    let mut extra = SLOW_REBUILD.to_vec();
    extra.extend([
        "--set",
        "ec.rebuild_transport=\"grpc\"",
        "--kill",
        "server:1@step:10",
    ]);
    let out = ec_run(&data, &dir.path().join("grpc"), "3", &extra);
    assert_exact(&out, &expected, &[1], "background rebuild over gRPC");

    // The replacement dies part-way through its background rebuild; the survivors kept
    // training meanwhile, and the next replacement rebuilds from scratch.
    let mut extra = SLOW_REBUILD.to_vec();
    extra.extend(["--kill", "server:1@step:10", "--kill", "server:1@rebuild"]);
    let out = ec_run(&data, &dir.path().join("mid"), "3", &extra);
    assert_exact(&out, &expected, &[1, 1], "killed mid background rebuild");

    // A spare takes the slot and rebuilds into the rows and parity it wrote while it
    // waited (`ec.spare_reserve`): reserved for the largest slot and cut to this one's
    // size, zero where the rebuild writes nothing. Its memory while waiting is reported.
    let mut extra = SLOW_REBUILD.to_vec();
    extra.extend(["--spares", "1", "--kill", "server:1@step:10"]);
    let run = dir.path().join("spare");
    let out = ec_run(&data, &run, "3", &extra);
    assert_exact(&out, &expected, &[1], "a spare rebuilt into its reserve");
    assert!(
        out["waiting_spare_peak_rss_bytes"].as_u64().unwrap() > 0,
        "{out}"
    );
    let spare_log = std::fs::read_dir(run.join("logs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("spare-")
        })
        .expect("the spare's log");
    let log = std::fs::read_to_string(&spare_log).unwrap();
    assert!(log.contains("memory reserve written"), "{log}");
    assert!(log.contains("server 1 at"), "the spare took slot 1: {log}");
}

#[test]
fn a_second_loss_while_a_slot_still_rebuilds_falls_back_to_the_last_cut() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = train_digest(&data, &[]);
    let out = ec_run_with(
        &data,
        dir.path(),
        "3",
        "ec+checkpoint",
        &[
            "--set",
            "checkpoint.every_steps=10",
            // So slow that server 0 is still rebuilding when server 2 dies: its pending rows
            // cannot help decode, so two of the group's three are unreadable (r = 1).
            "--set",
            "ec.rebuild_bytes_per_sec=100000",
            "--kill",
            "server:0@step:12",
            "--kill",
            "server:2@step:25",
        ],
    );
    assert_same_state(&out, &expected, "second loss mid-rebuild");
    let recoveries = out["recoveries"].as_array().unwrap();
    let seen: Vec<(u64, &str, u64)> = recoveries
        .iter()
        .map(|r| {
            (
                r["server"].as_u64().unwrap(),
                r["mode"].as_str().unwrap(),
                r["resumed_step"].as_u64().unwrap(),
            )
        })
        .collect();
    // No cut is taken while a slot rebuilds, so the rollback goes to step 10.
    assert_eq!(seen, [(0, "rebuild", 13), (2, "rollback", 10)], "{out}");
}

#[test]
fn dense_ranges_coded_instead_of_replicated_come_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = train_digest(&data, &[]);
    let coded = ["--set", "ec.replicate_dense=false"];
    // Each dense range is a row of a dense stripe; its changes go to the stripe's parity
    // holder as differences every step. A kill in phase 2, rebuilt in the background.
    let mut extra = coded.to_vec();
    extra.extend(SLOW_REBUILD);
    extra.extend(["--kill", "server:0@commit:20"]);
    let out = ec_run(&data, &dir.path().join("commit"), "3", &extra);
    assert_exact(&out, &expected, &[0], "dense coded, killed in phase 2");
    // r = 2 loses two neighbours at once, which replication cannot survive (server 1's
    // replica lives on server 2).
    let mut extra = coded.to_vec();
    extra.extend([
        "--set",
        "ec.r=2",
        "--kill",
        "server:1@step:30",
        "--kill",
        "server:2@step:30",
    ]);
    let out = ec_run(&data, &dir.path().join("r2"), "4", &extra);
    assert_exact(&out, &expected, &[1, 2], "dense coded, r = 2, neighbours");
}

/// The checks can fail: a parity difference dropped once, armed at run time through a
/// server's fault registry (`--fault server:J@fold-parity:N=skip`), leaves the model
/// itself exact but one stripe's parity wrong, and the end-of-run check reports it. Under
/// 2PC (staged differences folded at commit) and in one-round mode alike.
#[test]
fn a_planted_dropped_parity_difference_is_reported_by_the_parity_check() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = train_digest(&data, &[]);
    for (name, extra) in [
        ("2pc", &[][..]),
        ("one-round", &["--set", "ec.two_phase_commit=false"][..]),
    ] {
        let run_dir = dir.path().join(name);
        let args = ec_args(&data, &run_dir, "3", "ec", extra)
            .fault("server:1@fold-parity:20=skip")
            .args();
        // The run prints its report and fails: wrong parity is a failed run.
        let run = FTREC.run(&args);
        assert!(!run.status.success(), "{name}: exited 0 with wrong parity");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(
            stderr.contains("the parity check failed"),
            "{name}: {stderr}"
        );
        let out: Value = serde_json::from_slice(&run.stdout).expect("the JSON report");
        assert_eq!(
            out["state_digest"], expected,
            "{name}: the data is exact: {out}"
        );
        let mismatches = out["parity_mismatches"].as_u64().unwrap();
        eprintln!("{name}: {mismatches} parity mismatches");
        assert!(
            mismatches >= 1,
            "{name}: a dropped difference went unseen: {out}"
        );
        assert_eq!(out["replica_mismatches"], 0, "{name}: {out}");
    }
    let e = refused(
        &ClusterRun::bare(&data)
            .fault("server:1@fold-parity:x=skip")
            .args(),
    );
    assert!(e.contains("step \"x\""), "{e}");
    let e = refused(&ClusterRun::bare(&data).fault("worker:0@commit:3").args());
    assert!(e.contains("fault points are in servers"), "{e}");
}
