//! Streams that go silent in the middle of a recovery (issue 42, hole 3). Servers 0 and 1
//! of the erasure-coded group (k = 2, r = 1) crash at once under `ec+checkpoint`: beyond
//! the code, so every server restores the last cut and then re-derives its parity from
//! the others' rows, each a rebuild that streams their tables in (`fetch_all`) while the
//! coordinator follows its progress stream (`follow_rebuild`). Before the streams had a
//! progress deadline, a survivor stalled mid-stream left the rebuild waiting for ever, and
//! a server frozen mid-rebuild left the coordinator waiting for ever: the run never ended.

use std::time::Duration;

use ftrec_config::FaultTolerance;
use ftrec_faults::{FaultAction, FaultSpec, points};
use ftrec_sim::{
    Event, Fault, Member, Outcome, RunOptions, Schedule, check, job_config, reference_digest, run,
};

const STEPS: u64 = 60;

/// Servers 0 and 1 crash at 300 ms and restart on their hosts; `events` and `armed` add
/// the stall. The run must end, exact, having re-derived the parity.
fn two_crashes_and_a_rollback(events: Vec<Event>, armed: Vec<(Member, FaultSpec)>) -> Outcome {
    ftrec_sim::logs_from_env();
    let data = tempfile::tempdir().unwrap();
    ftrec_sim::generate_dataset(data.path()).unwrap();
    let ck = tempfile::tempdir().unwrap();
    let config = job_config(FaultTolerance::EcCheckpoint, data.path(), ck.path(), STEPS).unwrap();
    let reference = reference_digest(&config).unwrap();
    let crash = |j| Event {
        at: Duration::from_millis(300),
        fault: Fault::Crash(Member::Server(j)),
    };
    let mut events = [vec![crash(0), crash(1)], events].concat();
    events.sort_by_key(|e| e.at);
    let expected = armed.clone();
    let outcome = run(RunOptions {
        config: config.clone(),
        seed: 1,
        schedule: Schedule { events },
        armed,
        time_limit: Duration::from_secs(60),
        replace_on_new_host: false,
    })
    .unwrap();
    let violations = check(&config, &outcome, &reference);
    let o = outcome.unwrap_or_else(|e| panic!("the run did not end: {e}"));
    let trace = o.trace.join("\n");
    if std::env::var("FTREC_SIM_TRACE").is_ok() {
        eprintln!("{trace}");
    }
    assert_eq!(violations, vec![], "{trace}");
    assert_eq!(o.fired, expected, "{trace}");
    assert!(
        o.trace.iter().any(|l| l.contains("rolled back")),
        "no rollback: {trace}"
    );
    o
}

/// Survivor 2 stalls (alive, heartbeating) before the first piece it streams, for longer
/// than the run may take. The rebuild reading from it gives the transfer up after
/// `cluster.deadlines.rebuild_stall_ms`, the recovery fails and is tried again, and the
/// stall (which fires once) is not met the second time.
#[test]
fn a_survivor_stalled_mid_stream_fails_the_rebuild_and_the_retry_ends_exact() {
    let stall = FaultSpec::new(
        points::SEND_ROWS,
        None,
        FaultAction::Delay { ms: 3_600_000 },
    );
    let o = two_crashes_and_a_rollback(Vec::new(), vec![(Member::Server(2), stall)]);
    let retried = o
        .trace
        .iter()
        .find(|l| l.contains("recovery-retry"))
        .unwrap_or_else(|| panic!("no recovery failed on the stall: {}", o.trace.join("\n")));
    assert!(
        retried.contains("from server 2: no message for 2000 ms"),
        "{retried}"
    );
}

/// Server 0's new process freezes for good while it re-derives its parity, its rebuild
/// held open across the freeze by survivor 2's slow first piece (1.5 s, within the
/// rebuild's stall deadline). The coordinator gives the silent progress stream up, and
/// the frozen server, declared dead meanwhile, is replaced on a new host.
#[test]
fn a_server_frozen_mid_rebuild_is_given_up_and_replaced() {
    let slow = FaultSpec::new(points::SEND_ROWS, None, FaultAction::Delay { ms: 1_500 });
    let freeze = Event {
        at: Duration::from_millis(1_200),
        fault: Fault::Freeze {
            member: Member::Server(0),
            lasting: None,
        },
    };
    let o = two_crashes_and_a_rollback(vec![freeze], vec![(Member::Server(2), slow)]);
    let trace = o.trace.join("\n");
    let detected = o
        .trace
        .iter()
        .filter(|l| l.contains("failure-detected Some(Server(0))"))
        .count();
    assert_eq!(
        detected, 2,
        "the frozen server was not declared dead: {trace}"
    );
    assert!(
        o.trace
            .iter()
            .any(|l| l.contains("server-joined") && l.contains("server 0 at 192.168.0.7")),
        "no server 0 on a new host: {trace}"
    );
}
