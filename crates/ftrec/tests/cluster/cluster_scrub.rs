//! Parity verification that names what it finds, at the end of a run and live.
//!
//! Silent corruption is planted through the servers' fault registries: `fold-parity:N=flip`
//! folds step N's difference with one bit flipped into a parity row, `install:N=flip` flips
//! one bit of a data row step N installs (as bad RAM would). Each server logs which
//! (table, slot) it flipped; the parity checks must name that parity row's holder and
//! slot, and that data row's table, row and server. A live scrub (`ftrec cluster
//! verify-parity`) of a cluster that keeps training must find both, and a clean cluster
//! scrubbed while it trains must show no mismatch at all.

use ftrec_testkit::ClusterRun;
use ftrec_testkit::cluster::launch_announced;

use crate::FTREC;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const STEPS: &str = "40";
/// A parity row of server 1 corrupted at step 10, a data row of server 2 at step 15 (in
/// different stripes, for this seed and data).
const FLIPS: [&str; 4] = [
    "--fault",
    "server:1@fold-parity:10=flip",
    "--fault",
    "server:2@install:15=flip",
];

/// What the servers' logs say they flipped.
#[derive(Debug, Default)]
struct Flipped {
    /// (table, parity slot, server).
    parity: Option<(u64, u64, u64)>,
    /// (table, global row, server, local slot).
    data: Option<(u64, u64, u64, u64)>,
}

/// The number after `key` in `line` (`"table 3"` -> 3).
fn number_after(line: &str, key: &str) -> u64 {
    let at = line
        .find(key)
        .unwrap_or_else(|| panic!("{key:?} in {line:?}"))
        + key.len();
    line[at..]
        .trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("a number after {key:?} in {line:?}"))
}

/// Reads every process log of the run for the flips the servers logged.
fn flipped(run_dir: &Path) -> Flipped {
    let mut found = Flipped::default();
    let Ok(logs) = std::fs::read_dir(run_dir.join("logs")) else {
        return found;
    };
    for log in logs {
        let text = std::fs::read_to_string(log.unwrap().path()).unwrap_or_default();
        for line in text.lines() {
            if line.contains("fault fold-parity: flipped") {
                found.parity = Some((
                    number_after(line, "into table "),
                    number_after(line, "parity slot "),
                    number_after(line, "(server "),
                ));
            }
            if line.contains("fault install: flipped") {
                found.data = Some((
                    number_after(line, "of table "),
                    number_after(line, " row "),
                    number_after(line, "(server "),
                    number_after(line, "local slot "),
                ));
            }
        }
    }
    found
}

/// Asserts that `details` (a report's `parity_mismatch_details`) names both flips: a
/// stripe of the flipped parity row's table whose differing parity rows include its
/// (server, slot), and a stripe of the flipped data row's table listing (row, server,
/// slot) among its data rows.
fn assert_names_both(details: &Value, flips: &Flipped, what: &str) {
    let details = details
        .as_array()
        .unwrap_or_else(|| panic!("{what}: {details}"));
    let (pt, plocal, pserver) = flips.parity.expect("the parity flip was logged");
    let (dt, drow, dserver, dlocal) = flips.data.expect("the data flip was logged");
    assert_eq!(pserver, 1, "{what}: armed on server 1");
    assert_eq!(dserver, 2, "{what}: armed on server 2");
    let stripes = || {
        details
            .iter()
            .filter(|m| m["kind"] == "stripe")
            .map(|m| (m["table"].as_u64().unwrap(), m))
    };
    let parity_named = stripes().any(|(t, m)| {
        t == pt
            && m["parity"].as_array().unwrap().iter().any(|p| {
                p["server"].as_u64() == Some(pserver) && p["local"].as_u64() == Some(plocal)
            })
    });
    assert!(
        parity_named,
        "{what}: no mismatch names server {pserver}'s parity slot {plocal} of table {pt}: {details:#?}"
    );
    let data_named = stripes().any(|(t, m)| {
        t == dt
            && m["data"].as_array().unwrap().iter().any(|d| {
                d["row"].as_u64() == Some(drow)
                    && d["server"].as_u64() == Some(dserver)
                    && d["local"].as_u64() == Some(dlocal)
            })
    });
    assert!(
        data_named,
        "{what}: no mismatch names row {drow} of table {dt} on server {dserver}: {details:#?}"
    );
}

/// The end-of-run check names both corrupted rows, says so in text, and fails the run.
#[test]
fn the_end_of_run_check_names_a_flipped_parity_row_and_a_flipped_data_row() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let run_dir = dir.path().join("json");
    let args = ClusterRun::new(&data)
        .run_dir(&run_dir)
        .steps(STEPS)
        .servers(3)
        .workers(1)
        .deterministic()
        .ft("ec")
        .no_eval()
        .extend(FLIPS)
        .args();
    let run = FTREC.run(&args);
    assert!(!run.status.success(), "exited 0 with corrupted rows");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("the parity check failed"), "{stderr}");
    let out: Value = serde_json::from_slice(&run.stdout).expect("the JSON report");
    let flips = flipped(&run_dir);
    eprintln!("{flips:?}");
    let mismatches = out["parity_mismatches"].as_u64().unwrap();
    assert!((1..=2).contains(&mismatches), "{out}");
    assert_eq!(out["replica_mismatches"], 0, "{out}");
    let details = &out["parity_mismatch_details"];
    assert_eq!(
        details.as_array().unwrap().len() as u64,
        mismatches,
        "{out}"
    );
    assert_names_both(details, &flips, "end of run");

    // The text report prints each mismatch.
    let text_dir = dir.path().join("text");
    let args = ClusterRun::new(&data)
        .run_dir(&text_dir)
        .steps(STEPS)
        .no_json()
        .servers(3)
        .workers(1)
        .deterministic()
        .ft("ec")
        .no_eval()
        .extend(FLIPS)
        .args();
    let run = FTREC.run(&args);
    assert!(!run.status.success());
    let stdout = String::from_utf8_lossy(&run.stdout);
    let flips = flipped(&text_dir);
    let (pt, plocal, _) = flips.parity.unwrap();
    let (dt, drow, _, _) = flips.data.unwrap();
    assert!(
        stdout.lines().any(|l| l.contains("mismatch: table")
            && l.contains(&format!("table {pt} "))
            && l.contains(&format!("on server 1 (parity slot {plocal})"))),
        "{stdout}"
    );
    assert!(
        stdout.lines().any(|l| l.contains("mismatch: table")
            && l.contains(&format!("table {dt} "))
            && l.contains(&format!(" {drow} on server 2 "))),
        "{stdout}"
    );
    eprintln!("end-of-run test: {:.1}s", started.elapsed().as_secs_f64());
}

/// A cluster that trains until stopped (a million steps), its launcher's stderr drained.
struct Live {
    child: Child,
    coordinator: String,
    run_dir: std::path::PathBuf,
}

impl Live {
    fn start(data: &str, run_dir: &Path, extra: &[&str]) -> Self {
        let args = ClusterRun::new(data)
            .run_dir(run_dir)
            .steps(1000000)
            .servers(3)
            .workers(2)
            .ft("ec")
            .no_eval()
            .extend(extra)
            .args();
        let (child, coordinator) = launch_announced(FTREC, &args, Stdio::null());
        Self {
            child,
            coordinator,
            run_dir: run_dir.to_path_buf(),
        }
    }

    /// `ftrec cluster verify-parity` against it with the job file `job` and `extra` flags.
    fn verify_parity(&self, job: &Path, extra: &[&str]) -> std::process::Output {
        let mut args = vec![
            "cluster",
            "verify-parity",
            "--coordinator",
            &self.coordinator,
            "--job",
            job.to_str().unwrap(),
        ];
        args.extend(extra);
        FTREC.run(&args)
    }

    /// `ftrec cluster verify-parity --json` against it: exit status and the report.
    fn scrub(&self) -> (bool, Value) {
        let out = self.verify_parity(&self.run_dir.join("job.toml"), &["--json"]);
        let report = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("no JSON report: {}", String::from_utf8_lossy(&out.stderr)));
        (out.status.success(), report)
    }

    /// The launcher is still running (training until stopped).
    fn still_training(&mut self) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "the cluster stopped while being scrubbed"
        );
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The live scrub finds both flips while the cluster keeps training, and a clean cluster
/// scrubbed (twice) while it trains shows no mismatch: no false positive from a read that
/// straddles a commit, with two asynchronous workers committing all along.
#[test]
fn a_live_scrub_names_both_flips_and_finds_nothing_on_a_clean_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());

    let started = Instant::now();
    let mut clean = Live::start(&data, &dir.path().join("clean"), &[]);
    let mut epoch = None;
    for n in 0..2 {
        let (ok, report) = clean.scrub();
        epoch = report["epoch"].as_u64();
        eprintln!(
            "clean scrub {n}: {} stripes, {} ranges, {} reads again, {} unsettled, {:.2}s, \
             applied steps {} to {}",
            report["stripes"],
            report["ranges"],
            report["rereads"],
            report["unsettled"],
            report["seconds"],
            report["first_applied"],
            report["last_applied"]
        );
        assert!(ok, "{report}");
        assert_eq!(report["parity_mismatches"], 0, "{report}");
        assert_eq!(report["replica_mismatches"], 0, "{report}");
        assert_eq!(report["unsettled"], 0, "{report}");
        // Under 2PC a settled read is exact: no stripe ever looked broken, not even once.
        assert_eq!(report["unconfirmed"], 0, "{report}");
        assert_eq!(
            report["parity_mismatch_details"],
            serde_json::json!([]),
            "{report}"
        );
        assert!(report["stripes"].as_u64().unwrap() > 0, "{report}");
        // Training went on while the scrub read.
        assert!(
            report["last_applied"].as_u64() > report["first_applied"].as_u64(),
            "{report}"
        );
        clean.still_training();
    }
    // A server SIGKILLed and rebuilt in the background while training goes on: the scrub
    // follows the new epoch and placement, waits out the rows still being rebuilt, and
    // still finds nothing wrong.
    let killed = FTREC.run(&[
        "cluster",
        "kill",
        "--coordinator",
        &clean.coordinator,
        "--job",
        clean.run_dir.join("job.toml").to_str().unwrap(),
        "server:1",
    ]);
    assert!(killed.status.success(), "{killed:?}");
    let (ok, report) = clean.scrub();
    eprintln!(
        "scrub after a kill: epoch {}, {} reads again, {} unsettled, {:.2}s",
        report["epoch"], report["rereads"], report["unsettled"], report["seconds"]
    );
    assert_eq!(report["parity_mismatches"], 0, "{report}");
    assert_eq!(report["replica_mismatches"], 0, "{report}");
    assert_eq!(report["unconfirmed"], 0, "{report}");
    assert!(
        report["epoch"].as_u64() > epoch,
        "a recovery moves the epoch: {report}"
    );
    if report["unsettled"] == 0 {
        assert!(ok, "{report}");
    }
    clean.still_training();

    // One-round propagation is refused: no read of a training cluster is known consistent.
    let job = std::fs::read_to_string(clean.run_dir.join("job.toml")).unwrap();
    assert!(job.contains("two_phase_commit = true"), "{job}");
    // Beside the original: its secret file is named relative to it.
    let one_round = clean.run_dir.join("one-round.toml");
    std::fs::write(
        &one_round,
        job.replace("two_phase_commit = true", "two_phase_commit = false"),
    )
    .unwrap();
    let refused = clean.verify_parity(&one_round, &[]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("ec.two_phase_commit"), "{stderr}");
    drop(clean);
    eprintln!("clean live scrubs: {:.1}s", started.elapsed().as_secs_f64());

    let started = Instant::now();
    let mut live = Live::start(&data, &dir.path().join("flipped"), &FLIPS);
    let deadline = Instant::now() + Duration::from_secs(60);
    let flips = loop {
        let flips = flipped(&live.run_dir);
        if flips.parity.is_some() && flips.data.is_some() {
            break flips;
        }
        assert!(
            Instant::now() < deadline,
            "the flips never fired: {flips:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let (ok, report) = live.scrub();
    eprintln!("{flips:?}: {report}");
    assert!(!ok, "the scrub exited 0 with corrupted rows: {report}");
    assert_eq!(report["replica_mismatches"], 0, "{report}");
    assert!(
        report["parity_mismatches"].as_u64().unwrap() >= 1,
        "{report}"
    );
    assert_names_both(&report["parity_mismatch_details"], &flips, "live scrub");
    // Without --json each mismatch is printed, and the scrub fails saying why.
    let text = live.verify_parity(&live.run_dir.join("job.toml"), &[]);
    assert!(!text.status.success());
    let stdout = String::from_utf8_lossy(&text.stdout);
    let (pt, plocal, _) = flips.parity.unwrap();
    assert!(
        stdout.contains(&format!("mismatch: table {pt} stripe"))
            && stdout.contains(&format!("on server 1 (parity slot {plocal})")),
        "{stdout}"
    );
    assert!(
        String::from_utf8_lossy(&text.stderr).contains("the scrub found"),
        "{}",
        String::from_utf8_lossy(&text.stderr)
    );
    live.still_training();
    drop(live);
    eprintln!(
        "flipped live scrub: {:.1}s",
        started.elapsed().as_secs_f64()
    );
}
