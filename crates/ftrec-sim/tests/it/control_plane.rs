//! The control plane under seeded faults (issue 42, §2): an in-memory etcd served over the
//! simulated network, two coordinators (a leader and a standby) under `membership =
//! "etcd"`, and the leader crashed or frozen, etcd paused (2–60 s) or slow, alone or beside
//! a server or worker crash. Every schedule ends with its mode's invariants and with at
//! most one leader deciding at a time. `FTREC_SIM_SEED=N` replays one seed.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use ftrec_config::FaultTolerance;
use ftrec_sim::processes;
use ftrec_sim::{
    ControlFault, ControlOutcome, ControlRun, ControlSchedule, CoordinatorPoint, Member, SERVERS,
    Violation, WORKERS, WorkerKill, WorkerPoint, check_control, job_config, reference_digest,
    run_control,
};

use crate::data_dir;

/// Long enough (about a simulated second of training, within one epoch of the dataset) for every fault to land while
/// training runs.
const STEPS: u64 = 85;
/// Seeded control-plane schedules of the sweep, the count: over two processes on
/// the 2-core machine (nothing else running) they took 126 s, within its 180 s.
const SCHEDULES: u64 = 300;
const MODE: FaultTolerance = FaultTolerance::Ec;
/// An etcd pause lasts up to 60 s, and the run goes on after it.
const TIME_LIMIT: Duration = Duration::from_secs(120);

/// `ftrec train`'s digest after `steps` steps (computed once per count).
fn reference(steps: u64) -> String {
    static REFERENCES: Mutex<BTreeMap<u64, String>> = Mutex::new(BTreeMap::new());
    let mut references = REFERENCES.lock().unwrap_or_else(|p| p.into_inner());
    references
        .entry(steps)
        .or_insert_with(|| {
            reference_digest(&job_config(MODE, data_dir(), data_dir(), steps).unwrap()).unwrap()
        })
        .clone()
}

/// The seeds of a sweep: `count` of them, or the one `FTREC_SIM_SEED` names (a replay).
fn seeds(count: u64) -> Vec<u64> {
    match std::env::var("FTREC_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("FTREC_SIM_SEED must be a number")],
        Err(_) => (0..count).collect(),
    }
}

/// Runs `schedule` under `seed` and returns its broken promises.
fn violations(seed: u64, schedule: ControlSchedule, plant_grant_bug: bool) -> Vec<Violation> {
    simulate(seed, schedule, plant_grant_bug, STEPS, Outage::TrainThrough).1
}

/// What a leader whose lease is in doubt does (`cluster.train_through_etcd_outage`).
#[derive(Clone, Copy, PartialEq)]
enum Outage {
    /// The default: it grants while every server is well, and recovers on hard evidence.
    TrainThrough,
    /// It grants nothing and decides nothing until etcd answers.
    Wait,
}

/// Runs `schedule` under `seed` for `steps`: what it ended with, and its broken promises.
fn simulate(
    seed: u64,
    schedule: ControlSchedule,
    plant_grant_bug: bool,
    steps: u64,
    outage: Outage,
) -> (ControlOutcome, Vec<Violation>) {
    let checkpoints = tempfile::tempdir().unwrap();
    let mode = if schedule.checkpoints {
        FaultTolerance::EcCheckpoint
    } else {
        MODE
    };
    let mut config = job_config(mode, data_dir(), checkpoints.path(), steps).unwrap();
    config.cluster.deterministic = !schedule.asynchronous;
    config.cluster.train_through_etcd_outage = outage == Outage::TrainThrough;
    // Two cuts, at steps 30 and 60, while the faults strike (every 10 steps cost each run
    // about a second more).
    config.checkpoint.every_steps = 30;
    let outcome = run_control(ControlRun {
        config: config.clone(),
        seed,
        schedule,
        time_limit: TIME_LIMIT,
        plant_grant_bug,
    })
    .unwrap();
    if std::env::var("FTREC_SIM_TRACE").is_ok()
        && let Ok(o) = &outcome.outcome
    {
        eprintln!("seed {seed}: {schedule}\n{}", o.trace.join("\n"));
    }
    let violations = check_control(&config, &outcome, &reference(steps));
    (outcome, violations)
}

/// The coordinators that granted steps, in turn (a leader that grants again after another
/// did appears twice): which fault points fired, and who finished.
fn deciders(outcome: &ControlOutcome) -> Vec<usize> {
    let mut deciders: Vec<usize> = outcome.grants.iter().map(|g| g.coordinator).collect();
    deciders.dedup();
    deciders
}

/// etcd paused at 0.4 s for `lasting`, with `member` crashed at its moment, and nothing
/// else: synchronous workers, no cuts.
fn etcd_paused(lasting: Duration, member: Option<(Duration, Member)>) -> ControlSchedule {
    ControlSchedule {
        control: Some((
            Duration::from_millis(400),
            ControlFault::EtcdPause { lasting },
        )),
        member,
        ..ControlSchedule::default()
    }
}

fn fails_with_seeds(
    test: &str,
    runs: impl IntoIterator<Item = (u64, ControlSchedule)>,
) -> Vec<String> {
    let mut failures = Vec::new();
    let timed = std::env::var("FTREC_SIM_TIMES").is_ok();
    for (seed, schedule) in runs {
        let started = std::time::Instant::now();
        let v = violations(seed, schedule, false);
        if timed {
            eprintln!(
                "{:.3} s: seed {seed}: {schedule}",
                started.elapsed().as_secs_f64()
            );
        }
        if !v.is_empty() {
            let list: Vec<String> = v.iter().map(|v| v.to_string()).collect();
            failures.push(format!(
                "seed {seed} ({schedule}): {}\n  replay: FTREC_SIM_SEED={seed} cargo test -p \
                 ftrec-sim --test it control_plane::{test}",
                list.join("; ")
            ));
        }
    }
    failures
}

#[test]
fn two_coordinators_under_etcd_end_exact_without_faults() {
    ftrec_sim::logs_from_env();
    let failures = fails_with_seeds(
        "two_coordinators_under_etcd_end_exact_without_faults",
        seeds(2)
            .into_iter()
            .map(|s| (s, ControlSchedule::default())),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_standby_takes_over_a_leader_killed_mid_run_and_the_run_ends_exact() {
    ftrec_sim::logs_from_env();
    let schedule = ControlSchedule {
        control: Some((Duration::from_millis(500), ControlFault::LeaderCrash)),
        member: None,
        asynchronous: false,
        checkpoints: false,
        worker_kill: None,
        coordinator_kill: None,
        ..Default::default()
    };
    for seed in seeds(2) {
        let (outcome, violations) = simulate(seed, schedule, false, STEPS, Outage::TrainThrough);
        assert!(
            violations.is_empty(),
            "seed {seed}: {violations:?}\n  replay: FTREC_SIM_SEED={seed} cargo test -p \
             ftrec-sim --test it control_plane::the_standby"
        );
        let deciders = deciders(&outcome);
        assert_eq!(
            deciders,
            vec![0, 1],
            "seed {seed}: the standby never took over"
        );
        assert_eq!(outcome.leaders, vec![ftrec_sim::coordinator_host(0)]);
    }
}

#[test]
fn etcd_paused_for_a_minute_while_a_server_crashes_ends_exact() {
    ftrec_sim::logs_from_env();
    let schedule = etcd_paused(
        Duration::from_secs(60),
        Some((Duration::from_millis(800), Member::Server(1))),
    );
    let failures = fails_with_seeds(
        "etcd_paused_for_a_minute_while_a_server_crashes_ends_exact",
        seeds(1).into_iter().map(|s| (s, schedule)),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A quorum loss with a host crash inside it, in a job long enough to train through it
/// (issue 44 §1): etcd paused at 0.4 s for a minute, and server 1's host crashed at 2.5 s,
/// once the leader's lease is in doubt. The leader goes on granting while every server is
/// well; the crashed host falls silent, which is no hard evidence (its port does not
/// refuse: the host is gone, not only its process), so grants stop until etcd returns and
/// the standby recovers it. The run ends exact; the steps the leader granted in doubt are
/// its successor's to settle. With `train_through_etcd_outage = false` nothing is granted
/// in doubt. (A SIGKILLed process, whose port refuses, is recovered in the outage: the
/// real-process test `cluster_outage::etcd_frozen_for_a_minute_while_a_server_dies`.)
#[test]
fn a_leader_trains_through_an_etcd_outage_while_its_servers_are_well() {
    ftrec_sim::logs_from_env();
    const LONG: u64 = 250;
    let schedule = etcd_paused(
        Duration::from_secs(60),
        Some((Duration::from_millis(2_500), Member::Server(1))),
    );
    for seed in seeds(2) {
        let (outcome, violations) = simulate(seed, schedule, false, LONG, Outage::TrainThrough);
        assert!(
            violations.is_empty(),
            "seed {seed}: {violations:?}\n  replay: FTREC_SIM_SEED={seed} cargo test -p \
             ftrec-sim --test it control_plane::a_leader_trains_through"
        );
        let in_doubt = outcome
            .grants
            .iter()
            .filter(|g| g.coordinator == 0 && !g.held_lease)
            .count();
        assert!(
            in_doubt > 20,
            "seed {seed}: the leader granted {in_doubt} steps with its lease in doubt"
        );
        let (strict, violations) = simulate(seed, schedule, false, LONG, Outage::Wait);
        assert!(
            violations.is_empty(),
            "seed {seed}, waiting: {violations:?}"
        );
        assert!(
            strict.grants.iter().all(|g| g.held_lease),
            "seed {seed}: a job that waits for etcd granted with its lease in doubt"
        );
    }
}

/// The sweep: every seed's control-plane fault (and half the time a member crash
/// beside it), each run checked for its mode's invariants and for leaders that decided
/// at once; a failure names the seed that replays it. The seeds are split over
/// `FTREC_SIM_SHARDS` processes (default 2, one per core of the CI machine): one process
/// runs one simulation at a time (they share tokio's task ids), and each simulation is
/// exact whichever process runs it.
#[test]
fn seeded_control_plane_schedules_keep_their_promises() {
    const NAME: &str = "seeded_control_plane_schedules_keep_their_promises";
    ftrec_sim::logs_from_env();
    let started = std::time::Instant::now();
    // `FTREC_SIM_SCHEDULES=N` runs the first N seeds (to time the sweep).
    let count = std::env::var("FTREC_SIM_SCHEDULES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(SCHEDULES);
    let shards: u64 = std::env::var(processes::SHARDS)
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2)
        .max(1);
    let shard: Option<u64> = std::env::var(processes::SHARD)
        .ok()
        .and_then(|n| n.parse().ok());
    let replay = std::env::var("FTREC_SIM_SEED").is_ok();
    if shard.is_none() && !replay && shards > 1 {
        let failures = processes::in_shards(NAME, shards);
        eprintln!(
            "{count} control-plane schedules in {:.1} s over {shards} processes",
            started.elapsed().as_secs_f64()
        );
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        return;
    }
    let runs: Vec<(u64, ControlSchedule)> = seeds(count)
        .into_iter()
        .filter(|s| shard.is_none_or(|k| s % shards == k))
        .map(|s| (s, ControlSchedule::random(s, SERVERS, WORKERS)))
        .collect();
    let count = runs.len();
    let failures = fails_with_seeds(NAME, runs);
    let took = started.elapsed().as_secs_f64();
    eprintln!(
        "{count} control-plane schedules in {took:.1} s ({:.3} s each)",
        took / count.max(1) as f64
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The planted bug: leaders grant without checking their lease, in a job that asked to
/// wait out etcd outages (`cluster.train_through_etcd_outage = false`). With etcd paused
/// past the lease's TTL, the leader goes on granting after its lease's deadline, when no
/// lease covers its grants (a standby could lead by then): the check names the grant. The
/// same schedules without the bug report nothing of the kind. The job is long enough to
/// train past that deadline (`STEPS` ends in about a simulated second, within the lease).
#[test]
fn a_leader_that_grants_without_its_lease_is_caught() {
    ftrec_sim::logs_from_env();
    const LONG: u64 = 250;
    let schedule = etcd_paused(Duration::from_secs(4), None);
    let unleased = |v: &[Violation]| {
        v.iter().any(|v| {
            matches!(
                v,
                Violation::GrantWithoutLease(_) | Violation::InterleavedLeaders { .. }
            )
        })
    };
    let mut caught = Vec::new();
    for seed in seeds(3) {
        let clean = simulate(seed, schedule, false, LONG, Outage::Wait).1;
        assert!(clean.is_empty(), "seed {seed} without the bug: {clean:?}");
        let planted = simulate(seed, schedule, true, LONG, Outage::Wait).1;
        if unleased(&planted) {
            caught.push(seed);
        }
    }
    assert!(
        !caught.is_empty(),
        "no schedule with the planted bug reported a grant without the lease"
    );
    eprintln!("the planted bug caught under seeds {caught:?}");
}

/// Found by the sweep (seed 1 of its first draw): a leader frozen past its lease (its
/// links held while it runs). It heard nobody, declared every server dead one after
/// another and had them replaced; the standby then found all three servers of the group
/// lost at once, and the job failed. A member's silence now counts only when the
/// coordinator heard from someone else after the member's deadline.
#[test]
fn a_leader_frozen_past_its_lease_is_survived() {
    ftrec_sim::logs_from_env();
    let schedule = ControlSchedule {
        control: Some((
            Duration::from_millis(440),
            ControlFault::LeaderFreeze {
                lasting: Duration::from_millis(1_910),
            },
        )),
        member: None,
        asynchronous: false,
        checkpoints: false,
        worker_kill: None,
        coordinator_kill: None,
        ..Default::default()
    };
    let failures = fails_with_seeds(
        "a_leader_frozen_past_its_lease_is_survived",
        seeds(1).into_iter().map(|s| (s + 1, schedule)),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Found by the sweep (seed 17 of its first draw): etcd 632 ms slower for 1.5 s while a
/// worker crashes, before it joined; the run did not finish within 120 s, the start
/// waiting for that worker. A slot whose process exited before it joined is now started
/// again (`Spawner::exited`).
#[test]
fn slow_etcd_beside_a_worker_crash_is_survived() {
    ftrec_sim::logs_from_env();
    let schedule = ControlSchedule {
        control: Some((
            Duration::from_millis(371),
            ControlFault::SlowEtcd {
                delay: Duration::from_millis(632),
                lasting: Duration::from_millis(1_513),
            },
        )),
        member: Some((Duration::from_millis(190), Member::Worker(1))),
        asynchronous: false,
        checkpoints: false,
        worker_kill: None,
        coordinator_kill: None,
        ..Default::default()
    };
    let failures = fails_with_seeds(
        "slow_etcd_beside_a_worker_crash_is_survived",
        seeds(1).into_iter().map(|s| (s + 17, schedule)),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Found by the sweep (seed 69 of its second draw): a worker crashed before training
/// starts, then the leader crashed; the standby's run did not finish within 120 s (seeds
/// 92 and 169 of that draw likewise, with a server crashed early and etcd paused or the
/// leader crashed). Fixed as the test above.
#[test]
fn a_member_crashed_before_training_then_the_leader_is_survived() {
    ftrec_sim::logs_from_env();
    let schedule = ControlSchedule {
        control: Some((Duration::from_millis(252), ControlFault::LeaderCrash)),
        member: Some((Duration::ZERO, Member::Worker(0))),
        asynchronous: false,
        checkpoints: false,
        worker_kill: None,
        coordinator_kill: None,
        ..Default::default()
    };
    let failures = fails_with_seeds(
        "a_member_crashed_before_training_then_the_leader_is_survived",
        seeds(1).into_iter().map(|s| (s + 69, schedule)),
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Found by the sweep once it drew asynchronous workers (seeds 44 and 188): a worker that
/// crashed between its prepares left a prepared copy of its step on some servers, which
/// took the step's new grant for a retry and committed the old gradient; with the
/// parameters moved since, the dense replicas parted. Seeds 0 and 1 crash nothing.
#[test]
fn a_worker_crash_with_asynchronous_workers_keeps_the_replicas_equal() {
    ftrec_sim::logs_from_env();
    let runs = seeds(4).into_iter().map(|s| {
        let schedule = ControlSchedule {
            control: None,
            member: (s > 1).then(|| (Duration::from_millis(500 + 150 * s), Member::Worker(0))),
            asynchronous: true,
            checkpoints: false,
            worker_kill: None,
            coordinator_kill: None,
            ..Default::default()
        };
        (s, schedule)
    });
    let failures = fails_with_seeds(
        "a_worker_crash_with_asynchronous_workers_keeps_the_replicas_equal",
        runs,
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A worker killed by its own fault point: with step 40 pulled and nothing sent, prepared
/// on the first server only (asynchronous workers prepare one at a time), or prepared on
/// every server and committed on none (between 2PC's phases). The step is resolved
/// (applied nowhere) and granted again, and the run keeps every promise. The point is
/// armed in each worker in turn: only the one that takes step 40 dies. Prepared on the
/// first server only, the old gradient was committed there and the dense replicas parted
/// (before orphan resolution aborted unapplied steps everywhere).
#[test]
fn a_worker_killed_before_its_push_or_between_its_phases_is_survived() {
    ftrec_sim::logs_from_env();
    let cases = [
        (WorkerPoint::Push, false),
        (WorkerPoint::Push, true),
        (WorkerPoint::Prepared, false),
        (WorkerPoint::Prepared, true),
        (WorkerPoint::PreparedFirst, true),
    ];
    for (point, asynchronous) in cases {
        let mut resolved = 0;
        for worker in 0..WORKERS {
            let schedule = ControlSchedule {
                worker_kill: Some(WorkerKill {
                    worker,
                    point,
                    step: 40,
                }),
                asynchronous,
                ..ControlSchedule::default()
            };
            let (outcome, violations) = simulate(3, schedule, false, STEPS, Outage::TrainThrough);
            assert!(violations.is_empty(), "{schedule}: {violations:?}");
            let trace = outcome.outcome.map(|o| o.trace).unwrap_or_default();
            resolved += usize::from(
                trace
                    .iter()
                    .any(|l| l.contains("step 40: applied on 0 of 3 servers")),
            );
        }
        assert_eq!(
            resolved, 1,
            "{point:?}, asynchronous {asynchronous}: step 40 should be resolved as \
             applied nowhere in exactly one of the runs (the one whose worker took it)"
        );
    }
}

/// Coordinators killed by their own fault points: the leader with a recovery decided and
/// nothing sent (server 1 crashed), and the standby just elected, before it fenced anyone
/// (the leader crashed). Either way the run keeps every promise. Who granted shows the
/// points fired: the standby finishes the first run; in the second it never grants, and
/// the first leader, restarted as a standby, takes over and finishes.
#[test]
fn a_leader_killed_mid_recovery_or_its_successor_mid_takeover_is_survived() {
    ftrec_sim::logs_from_env();
    let cases = [
        (
            ControlSchedule {
                member: Some((Duration::from_millis(600), Member::Server(1))),
                coordinator_kill: Some(CoordinatorPoint::Recovery),
                ..ControlSchedule::default()
            },
            vec![0, 1],
        ),
        (
            ControlSchedule {
                control: Some((Duration::from_millis(500), ControlFault::LeaderCrash)),
                coordinator_kill: Some(CoordinatorPoint::Takeover),
                ..ControlSchedule::default()
            },
            vec![0],
        ),
    ];
    for (schedule, want) in cases {
        let (outcome, violations) = simulate(5, schedule, false, STEPS, Outage::TrainThrough);
        assert!(violations.is_empty(), "{schedule}: {violations:?}");
        let deciders = deciders(&outcome);
        assert_eq!(deciders, want, "{schedule}: who granted");
    }
}

/// The leader killed as it hears that server 1's replacement ended its background
/// rebuild, so its record still has the slot rebuilding (as a write an etcd outage held,
/// applied after the rebuild ended, leaves it). The successor asks the slot's process,
/// which holds every row: it keeps them, and nobody rebuilds the slot again (before, the
/// successor rebuilt it from the survivors, a second window of lost redundancy).
#[test]
fn a_rebuild_that_ended_after_the_records_last_write_is_not_run_again() {
    ftrec_sim::logs_from_env();
    let schedule = ControlSchedule {
        member: Some((Duration::from_millis(600), Member::Server(1))),
        coordinator_kill: Some(CoordinatorPoint::RebuildEnded),
        ..ControlSchedule::default()
    };
    let (outcome, violations) = simulate(5, schedule, false, STEPS, Outage::TrainThrough);
    assert!(violations.is_empty(), "{schedule}: {violations:?}");
    let deciders = deciders(&outcome);
    assert_eq!(
        deciders,
        vec![0, 1],
        "{schedule}: the point fired, the standby finished"
    );
    let finished = outcome.outcome.expect("the run ended");
    let starts = finished
        .trace
        .iter()
        .filter(|l| l.contains("rebuild-start"))
        .count();
    assert_eq!(
        starts, 0,
        "{schedule}: the successor rebuilt the slot again: {:#?}",
        finished.trace
    );
    assert!(
        finished
            .trace
            .iter()
            .any(|l| l.contains("ended under an earlier leader")),
        "{schedule}: the successor kept the rebuilt rows: {:#?}",
        finished.trace
    );
}

/// The leader killed by its own fault point just after it reported the cut of step 30
/// committed. A cut it reported is one its successor knows: the report waits for the etcd
/// record that holds the cut. Before, the record followed at the next flush: the new
/// leader (which finishes the run) did not know the cut and took it again when its steps
/// passed 30, and a failure before then would have rolled back to the initial state.
#[test]
fn a_leader_killed_just_after_it_reported_a_cut_leaves_that_cut_to_its_successor() {
    ftrec_sim::logs_from_env();
    let schedule = ControlSchedule {
        checkpoints: true,
        coordinator_kill: Some(CoordinatorPoint::CutCommitted),
        ..ControlSchedule::default()
    };
    let (outcome, violations) = simulate(7, schedule, false, STEPS, Outage::TrainThrough);
    assert!(violations.is_empty(), "{schedule}: {violations:?}");
    let deciders = deciders(&outcome);
    assert_eq!(
        deciders,
        vec![0, 1],
        "{schedule}: the point fired, the standby finished"
    );
    let finished = outcome.outcome.expect("the run ended");
    let cut_again = finished
        .trace
        .iter()
        .find(|l| l.contains("checkpoint-start") && l.ends_with(" step 30"));
    assert!(
        cut_again.is_none(),
        "{schedule}: the successor took the cut of step 30 again, not knowing it: {cut_again:?}"
    );
    let cuts: Vec<u64> = finished
        .summary
        .checkpoints
        .iter()
        .map(|c| c.step)
        .collect();
    assert_eq!(
        cuts.first(),
        Some(&30),
        "{schedule}: the successor's cuts {cuts:?}"
    );
}
