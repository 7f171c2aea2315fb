//! Whole-job resume (issue 43 §1): a job SIGKILLed whole (launcher and every member)
//! resumes from its cuts on more servers, fewer, or another erasure-code group count, and
//! ends bit-identical to `ftrec train`; a cut of another model, an incomplete cut and a
//! damaged one are refused with their reason named, and nothing is overwritten.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use ftrec_testkit::ClusterRun;
use serde_json::Value;

use crate::FTREC;

const STEPS: &str = "200";

/// The complete cuts of a cluster location, as the resume reads them: `(step, servers)`.
pub(crate) fn complete_cuts(location: &Path) -> Vec<(u64, usize)> {
    let listings = ftrec_cluster::resume::list_slots(location.to_str().unwrap()).unwrap();
    ftrec_cluster::resume::cuts_of(&listings)
        .into_iter()
        .filter(|c| c.complete())
        .map(|c| (c.step, c.servers))
        .collect()
}

/// `cluster run --resume` of `resume` on these servers and one worker.
fn resumed(data: &str, resume: &Path, at: Option<u64>, servers: usize) -> ClusterRun {
    resumed_on(data, resume, at, servers, 1)
}

fn resumed_on(
    data: &str,
    resume: &Path,
    at: Option<u64>,
    servers: usize,
    workers: usize,
) -> ClusterRun {
    let spec = match at {
        Some(step) => format!("{}@{step}", resume.display()),
        None => resume.display().to_string(),
    };
    ClusterRun::new(data)
        .steps(STEPS)
        .servers(servers)
        .workers(workers)
        .deterministic()
        .no_eval()
        .arg("--resume", spec)
}

/// The same job on 3 servers with IncrCP cuts every 25 steps, SIGKILLed whole (its
/// process group: the launcher and every member) at a random moment after its first
/// cut, finishes on 5 servers exactly as an uninterrupted single process would.
#[test]
fn a_job_killed_whole_resumes_on_more_servers_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = FTREC.single_process_digest(&data, STEPS);
    let ck = dir.path().join("ck");
    let job = |run: ClusterRun| {
        run.ft("checkpoint")
            .set("checkpoint.strategy=\"incrcp\"")
            .set("checkpoint.every_steps=25")
    };
    // Server 0 holds step 150 for 5 s, so the job is surely alive when it is killed.
    let first = job(ClusterRun::new(&data)
        .steps(STEPS)
        .servers(3)
        .workers(1)
        .deterministic()
        .no_eval())
    .arg("--checkpoint-dir", ck.display())
    .arg("--run-dir", dir.path().join("first").display())
    .fault("server:0@install:150=delay-5000");
    let mut launcher = FTREC
        .command()
        .args(first.args())
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while complete_cuts(&ck).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no cut within 120 s"
        );
        assert!(
            launcher.try_wait().unwrap().is_none(),
            "the job ended early"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let wait = Duration::from_millis(u64::from(nanos % 1500));
    std::thread::sleep(wait);
    let group = format!("-{}", launcher.id());
    assert!(
        std::process::Command::new("kill")
            .args(["-KILL", "--", &group])
            .status()
            .unwrap()
            .success()
    );
    let _ = launcher.wait();
    let cuts = complete_cuts(&ck);
    let (newest, servers) = *cuts.last().unwrap();
    assert_eq!(servers, 3);
    assert!(
        newest < 200,
        "killed {wait:?} after the first cut: {cuts:?}"
    );

    let out = job(resumed(&data, &ck, None, 5)).report(FTREC);
    assert_eq!(
        out["state_digest"], expected,
        "killed {wait:?} after the first cut; {out}"
    );
    assert_eq!(out["resumed_from_step"], newest, "{out}");
    assert_eq!(out["resumed_from_servers"], 3, "{out}");
    assert_eq!(out["steps"], 200);
    // The old job's cuts are all still there, beside the new job's 5-server ones.
    let after = complete_cuts(&ck);
    for cut in &cuts {
        assert!(after.contains(cut), "{cut:?} of {cuts:?} gone: {after:?}");
    }
    assert!(after.contains(&(200, 5)), "{after:?}");
}

/// DECK from 4 servers to 2, from an older cut named by its step (its location holds
/// newer ones: the new job writes a branch of its own beside them).
#[test]
fn a_deck_job_resumes_on_fewer_servers_from_a_named_cut() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = FTREC.single_process_digest(&data, STEPS);
    let ck = dir.path().join("ck");
    let deck = |run: ClusterRun| {
        run.ft("checkpoint")
            .set("checkpoint.strategy=\"deck\"")
            .set("checkpoint.every_steps=25")
    };
    deck(
        ClusterRun::new(&data)
            .steps(100)
            .servers(4)
            .workers(1)
            .deterministic()
            .no_eval(),
    )
    .arg("--checkpoint-dir", ck.display())
    .report(FTREC);
    let before = complete_cuts(&ck);
    assert!(
        before.contains(&(75, 4)) && before.contains(&(100, 4)),
        "{before:?}"
    );
    let out = deck(resumed(&data, &ck, Some(75), 2)).report(FTREC);
    assert_eq!(out["state_digest"], expected, "{out}");
    assert_eq!(out["resumed_from_step"], 75, "{out}");
    assert_eq!(out["resumed_from_servers"], 4, "{out}");
    let after = complete_cuts(&ck);
    assert!(
        after.contains(&(100, 4)) && after.contains(&(200, 2)),
        "{after:?}"
    );
}

/// Erasure coded with k = 2 in one group of 3 servers and one worker, resumed on two
/// groups of 3 and two workers: the parity of the new layout is derived as the servers
/// load the cut, and checks out; the remaining batches are shared by the two workers, and
/// (deterministic) none is read twice or skipped.
#[test]
fn an_erasure_coded_job_resumes_on_another_group_count() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let expected = FTREC.single_process_digest(&data, STEPS);
    let ck = dir.path().join("ck");
    let ec = |run: ClusterRun| {
        run.ft("ec+checkpoint")
            .set("ec.k=2")
            .set("ec.r=1")
            .set("checkpoint.every_steps=25")
    };
    ec(ClusterRun::new(&data)
        .steps(100)
        .servers(3)
        .workers(1)
        .deterministic()
        .no_eval())
    .arg("--checkpoint-dir", ck.display())
    .report(FTREC);
    let out = ec(resumed_on(&data, &ck, None, 6, 2))
        .set("ec.groups=2")
        .report(FTREC);
    assert_eq!(out["state_digest"], expected, "{out}");
    assert_eq!(out["resumed_from_step"], 100, "{out}");
    assert_eq!(out["parity_mismatches"], 0, "{out}");
    assert_eq!(out["replica_mismatches"], 0, "{out}");
}

fn refused(run: &ClusterRun) -> String {
    let out = FTREC.run(&run.args());
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Files of a location, with their bytes: what "nothing overwritten" compares.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if !p.to_string_lossy().contains("lease") {
                out.push((p.display().to_string(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// A fresh start reports no resume; a cut of another model, an incomplete cut and a
/// damaged one are refused before anything starts, each with its reason, and leave the
/// location as it was; `--fallback` passes a damaged cut over for the newest whole one.
#[test]
fn a_resume_from_the_wrong_cut_is_refused_and_touches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let ck = dir.path().join("ck");
    let fresh = ClusterRun::new(&data)
        .steps(100)
        .servers(3)
        .workers(1)
        .deterministic()
        .no_eval()
        .ft("checkpoint")
        .set("checkpoint.every_steps=25")
        .arg("--checkpoint-dir", ck.display())
        .report(FTREC);
    assert_eq!(fresh["resumed_from_step"], 0, "{fresh}");
    assert_eq!(fresh["resumed_from_servers"], Value::Null, "{fresh}");
    let kept = files(&ck);
    let run = |at: Option<u64>| {
        resumed(&data, &ck, at, 2)
            .ft("checkpoint")
            .set("checkpoint.every_steps=25")
    };

    let said = refused(&run(None).set("model.top=[16, 1]"));
    assert!(said.contains("model.top: cut [32,1], job [16,1]"), "{said}");
    let said = refused(&run(None).set("train.batch_size=64"));
    assert!(said.contains("train.batch_size: cut 128, job 64"), "{said}");
    let said = refused(&run(Some(60)));
    assert!(said.contains("no cut at step 60"), "{said}");
    assert_eq!(files(&ck), kept, "a refused resume changed the location");

    // Server 2's part of the newest cut goes: that cut is incomplete.
    let server2 = ck.join("server-2/manifests");
    let newest = std::fs::read_dir(&server2)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("000000000100"))
        .collect::<Vec<_>>();
    assert!(!newest.is_empty());
    let aside = dir.path().join("aside");
    std::fs::create_dir_all(&aside).unwrap();
    for p in &newest {
        std::fs::rename(p, aside.join(p.file_name().unwrap())).unwrap();
    }
    let said = refused(&run(Some(100)));
    assert!(
        said.contains("incomplete") && said.contains("servers [2]"),
        "{said}"
    );
    for p in &newest {
        std::fs::rename(aside.join(p.file_name().unwrap()), p).unwrap();
    }

    // A bit flipped in a row chunk of server 1's part of the newest cut.
    let chunk = std::fs::read_dir(ck.join("server-1/data"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("000000000100"))
        .and_then(|d| {
            std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| !p.to_string_lossy().contains("dense"))
        })
        .unwrap();
    let mut bytes = std::fs::read(&chunk).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 1;
    std::fs::write(&chunk, &bytes).unwrap();
    let said = refused(&run(None));
    assert!(
        said.contains("damaged") && said.contains("--fallback"),
        "{said}"
    );
    let out = run(None).flag("--fallback").report(FTREC);
    assert_eq!(out["resumed_from_step"], 75, "{out}");
    assert_eq!(
        out["state_digest"],
        FTREC.single_process_digest(&data, STEPS),
        "{out}"
    );
}

/// The same from an object store (S3, served by moto): the cut is found, verified and
/// re-placed over HTTP, from 2 servers onto 3.
#[test]
fn a_job_resumes_from_an_object_store() {
    let server = ftrec_testkit::moto::start_server();
    ftrec_testkit::moto::create_bucket(server.port, "runs");
    let dir = tempfile::tempdir().unwrap();
    let data = FTREC.setup(dir.path());
    let run = |run: ClusterRun| {
        let out = FTREC
            .command()
            .args(
                run.ft("checkpoint")
                    .set("checkpoint.strategy=\"incrcp\"")
                    .set("checkpoint.every_steps=25")
                    .args(),
            )
            .envs(ftrec_testkit::moto::env(&server))
            .output()
            .unwrap();
        ftrec_testkit::cli::json_of(&out)
    };
    run(ClusterRun::new(&data)
        .steps(100)
        .servers(2)
        .workers(1)
        .deterministic()
        .no_eval()
        .arg("--checkpoint-dir", "s3://runs/ck"));
    let out = run(ClusterRun::new(&data)
        .steps(STEPS)
        .servers(3)
        .workers(1)
        .deterministic()
        .no_eval()
        .arg("--resume", "s3://runs/ck"));
    assert_eq!(out["resumed_from_step"], 100, "{out}");
    assert_eq!(out["resumed_from_servers"], 2, "{out}");
    assert_eq!(
        out["state_digest"],
        FTREC.single_process_digest(&data, STEPS),
        "{out}"
    );
}
