//! The windows of two-phase commit that only a slow member opens, each forced with a fault
//! point armed at run time (issue 21's audit). Every run must end with `ftrec train`'s
//! model and parity that matches the data: no step applied on some servers only.

use std::time::Duration;

use ftrec_config::FaultTolerance;
use ftrec_faults::{FaultAction, FaultSpec};
use ftrec_sim::{Member, RunOptions, Schedule, check, job_config, reference_digest, run};

const STEPS: u64 = 40;

fn delay(point: &str, step: u64, ms: u64) -> FaultSpec {
    FaultSpec::new(point, Some(step), FaultAction::Delay { ms })
}

/// Runs an erasure-coded job with `armed` and no scheduled fault; checks the mode's
/// invariants and that every armed point fired. Returns the outcome.
fn run_armed(armed: Vec<(Member, FaultSpec)>) -> ftrec_sim::Outcome {
    ftrec_sim::logs_from_env();
    let data = tempfile::tempdir().unwrap();
    ftrec_sim::generate_dataset(data.path()).unwrap();
    let ck = tempfile::tempdir().unwrap();
    let mut config = job_config(FaultTolerance::Ec, data.path(), ck.path(), STEPS).unwrap();
    config.cluster.workers = 1;
    let reference = reference_digest(&config).unwrap();
    let expected = armed.len();
    let outcome = run(RunOptions {
        config: config.clone(),
        seed: 5,
        schedule: Schedule { events: Vec::new() },
        armed,
        time_limit: Duration::from_secs(60),
        replace_on_new_host: false,
    })
    .unwrap();
    let violations = check(&config, &outcome, &reference);
    let o = outcome.unwrap();
    if std::env::var("FTREC_SIM_TRACE").is_ok() {
        eprintln!("{}", o.trace.join("\n"));
    }
    assert_eq!(violations, vec![], "{}", o.trace.join("\n"));
    assert_eq!(o.fired.len(), expected, "fired: {:?}", o.fired);
    o
}

/// Server 1's phase 1 answers long after the worker's step deadline (its differences went
/// out first): the worker gives the step up and aborts it everywhere, which drops those
/// differences at the parity holders, and only then does server 1 hold the step prepared.
/// The step is granted again in the same epoch and finds it prepared: the differences
/// must go out again, or the holders commit the step without them. Before the fix (no
/// resend, and a timer that aborted a prepare on its own) this ended with parity
/// mismatches. One late answer is no failure: nothing is recovered.
#[test]
fn a_prepare_answering_after_its_worker_gave_up_is_resent_whole() {
    let o = run_armed(vec![(Member::Server(1), delay("prepare", 20, 3_000))]);
    assert!(
        o.summary.recoveries.is_empty(),
        "a slow prepare is not a death: {:?}",
        o.summary.recoveries
    );
}

/// Step 20 commits on server 0, server 1 dies in its commit, and server 2's commit stalls
/// past the recovery that replaces server 1. The recovery fences the survivors first: the
/// stalled commit is refused (the fence and a commit are one step under the shard lock),
/// and since server 0 applied the step before its fence, server 2 commits it as the
/// recovery's decision. So the step is on every survivor and in every parity row, and the
/// replacement decodes server 1's rows with it. Before the fix the stalled commit, or the
/// fence's blanket drop, left it on server 0 only.
#[test]
fn a_commit_stalled_past_a_recovery_is_decided_by_the_recovery() {
    let o = run_armed(vec![
        (
            Member::Server(1),
            FaultSpec::new("commit", Some(20), FaultAction::Kill),
        ),
        (Member::Server(2), delay("commit", 20, 3_000)),
    ]);
    assert!(
        o.summary.recoveries.iter().any(|r| r.server == 1),
        "server 1 was not replaced: {}",
        o.trace.join("\n")
    );
}
