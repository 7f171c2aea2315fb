//! Seeded fault schedules over the in-process cluster, each ending with its mode's
//! invariants checked. `FTREC_SIM_SEED=N` replays one seed of every mode. Each sweep runs
//! in a child process of its own, so that two run at once on two cores
//! (`ftrec_sim::processes`).

use std::time::Duration;

use ftrec_config::FaultTolerance;
use ftrec_sim::{RunOptions, SERVERS, Schedule, WORKERS, check, job_config, reference_digest, run};

use crate::data_dir;

const STEPS: u64 = 60;
/// Seeds per mode: 40 random schedules (200 in all) and 8 freezes.
const RANDOM_PER_MODE: u64 = 40;
const FREEZES_PER_MODE: u64 = 8;

/// Checkpoints in memory where the machine has a tmpfs: the schedules test the cluster's
/// logic, and fsync on a real disk would make them slow, not more thorough (the
/// multi-process tests write to disk).
fn checkpoint_dir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(dir) = tempfile::tempdir_in(shm)
    {
        return dir;
    }
    tempfile::tempdir().unwrap()
}

/// The seeds of a sweep: `count` of them, or the one `FTREC_SIM_SEED` names (a replay).
fn seeds(count: u64) -> Vec<u64> {
    match std::env::var("FTREC_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("FTREC_SIM_SEED must be a number")],
        Err(_) => (0..count).collect(),
    }
}

/// The kinds of schedule a sweep draws.
#[derive(Clone, Copy)]
enum Kind {
    /// Crashes, restarts and latency; a replacement restarts on its slot's host.
    Random,
    /// One server frozen, for good or for a while; its replacement starts elsewhere.
    Freeze,
}

/// Runs `count` seeds' schedules of `kind` under `mode` and fails with each broken
/// promise, naming the seed that replays it.
fn schedules_keep_their_promises(mode: FaultTolerance, kind: Kind, count: u64) {
    let test = match kind {
        Kind::Random => mode.name().replace('+', "_"),
        Kind::Freeze => format!("frozen_{}", mode.name().replace('+', "_")),
    };
    schedules_of_a_variant_keep_their_promises(mode, kind, count, &test, |_| {});
}

/// [`schedules_keep_their_promises`] for the job `variant` makes of `mode`'s, which the
/// test `test` runs.
fn schedules_of_a_variant_keep_their_promises(
    mode: FaultTolerance,
    kind: Kind,
    count: u64,
    test: &str,
    variant: fn(&mut ftrec_config::JobConfig),
) {
    ftrec_sim::logs_from_env();
    let started = std::time::Instant::now();
    let mut failures = Vec::new();
    let mut recoveries = 0;
    // The checkpoint directory is not part of what is trained.
    let reference =
        reference_digest(&job_config(mode, data_dir(), data_dir(), STEPS).unwrap()).unwrap();
    for seed in seeds(count) {
        let ck = checkpoint_dir();
        let mut config = job_config(mode, data_dir(), ck.path(), STEPS).unwrap();
        variant(&mut config);
        let (schedule, replace_on_new_host) = match kind {
            Kind::Random => (Schedule::random(seed, SERVERS, WORKERS), false),
            Kind::Freeze => (Schedule::freeze(seed, SERVERS), true),
        };
        let outcome = run(RunOptions {
            config: config.clone(),
            seed,
            schedule: schedule.clone(),
            armed: Vec::new(),
            time_limit: Duration::from_secs(60),
            replace_on_new_host,
        })
        .unwrap();
        if let Ok(o) = &outcome {
            recoveries += o.summary.recoveries.len();
            if let Ok(dir) = std::env::var("FTREC_SIM_DUMP") {
                let path = format!("{dir}/{}-{seed}.txt", mode.name());
                std::fs::write(path, o.trace.join("\n")).unwrap();
            }
            if std::env::var("FTREC_SIM_TRACE").is_ok() {
                eprintln!("seed {seed}: {schedule}\n{}", o.trace.join("\n"));
            }
        }
        let violations = check(&config, &outcome, &reference);
        if !violations.is_empty() {
            let list: Vec<String> = violations.iter().map(|v| v.to_string()).collect();
            failures.push(format!(
                "seed {seed} ({schedule}): {}\n  replay: FTREC_SIM_SEED={seed} cargo test -p ftrec-sim --test it schedules::{test}",
                list.join("; ")
            ));
        }
    }
    eprintln!(
        "{test}: {} schedules, {recoveries} recoveries, {:.1} s",
        seeds(count).len(),
        started.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn ec() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_keep_their_promises(FaultTolerance::Ec, Kind::Random, RANDOM_PER_MODE);
}

#[test]
fn ec_checkpoint() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_keep_their_promises(FaultTolerance::EcCheckpoint, Kind::Random, RANDOM_PER_MODE);
}

#[test]
fn checkpoint() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_keep_their_promises(FaultTolerance::Checkpoint, Kind::Random, RANDOM_PER_MODE);
}

#[test]
fn partial() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_keep_their_promises(FaultTolerance::Partial, Kind::Random, RANDOM_PER_MODE);
}

/// `cpr.uncoordinated`: each server saves its shard while training goes on. Steps in
/// order, and asynchronous, where a save catches pushes applied ahead of its floor (which
/// a restore must count applied).
#[test]
fn partial_uncoordinated() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    let own_saves = |c: &mut ftrec_config::JobConfig| {
        c.cpr.uncoordinated = true;
    };
    let count = RANDOM_PER_MODE / 4;
    schedules_of_a_variant_keep_their_promises(
        FaultTolerance::Partial,
        Kind::Random,
        count,
        "partial_uncoordinated",
        own_saves,
    );
    schedules_of_a_variant_keep_their_promises(
        FaultTolerance::Partial,
        Kind::Random,
        count,
        "partial_uncoordinated",
        |c| {
            c.cpr.uncoordinated = true;
            c.cluster.deterministic = false;
        },
    );
}

#[test]
fn none() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_keep_their_promises(FaultTolerance::None, Kind::Random, RANDOM_PER_MODE);
}

/// A seed replays: the same schedule and seed give the same timeline, event for event
/// and simulated time for time, and the same model, in every mode.
#[test]
fn a_seed_replays_exactly() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    // A schedule with a crash and a restart in it.
    let seed = 9;
    let schedule = Schedule::random(seed, SERVERS, WORKERS);
    for mode in FaultTolerance::ALL {
        let go = || {
            let ck = checkpoint_dir();
            run(RunOptions {
                config: job_config(mode, data_dir(), ck.path(), STEPS).unwrap(),
                seed,
                schedule: schedule.clone(),
                armed: Vec::new(),
                time_limit: Duration::from_secs(60),
                replace_on_new_host: false,
            })
            .unwrap()
            .unwrap()
        };
        let (a, b) = (go(), go());
        assert!(
            !a.summary.recoveries.is_empty(),
            "{mode:?} {schedule}: nothing recovered"
        );
        assert_eq!(a.trace, b.trace, "{mode:?}");
        assert_eq!(a.state_digest, b.state_digest, "{mode:?}");
        assert_eq!(a.simulated_seconds, b.simulated_seconds, "{mode:?}");
    }
}

/// The harness can fail: a parity difference dropped once on one server (armed at run
/// time through that member's fault registry) is caught by the parity check of some
/// schedule, and that schedule's seed replays the same failure.
#[test]
fn a_planted_dropped_parity_difference_is_caught_and_its_seed_replays_it() {
    use ftrec_faults::{FaultAction, FaultSpec};
    use ftrec_sim::{Member, Violation};
    let mode = FaultTolerance::Ec;
    let ck = checkpoint_dir();
    let config = job_config(mode, data_dir(), ck.path(), STEPS).unwrap();
    let reference = reference_digest(&config).unwrap();
    let go = |seed: u64| {
        let outcome = run(RunOptions {
            config: config.clone(),
            seed,
            schedule: Schedule::random(seed, SERVERS, WORKERS),
            armed: vec![(
                Member::Server(1),
                FaultSpec::new("fold-parity", Some(30), FaultAction::Skip),
            )],
            time_limit: Duration::from_secs(60),
            replace_on_new_host: false,
        })
        .unwrap();
        let violations = check(&config, &outcome, &reference);
        (outcome.map(|o| (o.trace, o.fired)), violations)
    };
    let caught = (0..20).find_map(|seed| {
        let (outcome, violations) = go(seed);
        violations
            .iter()
            .any(|v| matches!(v, Violation::ParityMismatches(_)))
            .then_some((seed, outcome, violations))
    });
    let Some((seed, outcome, violations)) = caught else {
        panic!("no schedule caught the dropped parity difference");
    };
    let fired = &outcome.as_ref().unwrap().1;
    assert_eq!(fired.len(), 1, "the planted fault fired once: {fired:?}");
    let (replayed, replayed_violations) = go(seed);
    assert_eq!(
        replayed_violations, violations,
        "seed {seed} did not replay"
    );
    assert_eq!(replayed.unwrap().0, outcome.unwrap().0);
}

// A server that goes silent (frozen for good, or thawed later as a zombie) is handled
// like a dead one: replaced on another host, the run ends with its mode's promises.
#[test]
fn frozen_ec() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_keep_their_promises(FaultTolerance::Ec, Kind::Freeze, FREEZES_PER_MODE);
}

#[test]
fn frozen_ec_checkpoint() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_keep_their_promises(FaultTolerance::EcCheckpoint, Kind::Freeze, FREEZES_PER_MODE);
}

#[test]
fn frozen_checkpoint() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_keep_their_promises(FaultTolerance::Checkpoint, Kind::Freeze, FREEZES_PER_MODE);
}

#[test]
fn frozen_partial() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_keep_their_promises(FaultTolerance::Partial, Kind::Freeze, FREEZES_PER_MODE);
}

/// `cpr.uncoordinated` with a frozen server: own saves run beside the coordinator's other
/// tasks (a recovery starts while one is being written, and a new epoch abandons it), so a
/// frozen server's hanging save must neither hold up its fencing nor leave the run inexact.
#[test]
fn frozen_partial_uncoordinated() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_of_a_variant_keep_their_promises(
        FaultTolerance::Partial,
        Kind::Freeze,
        FREEZES_PER_MODE / 2,
        "frozen_partial_uncoordinated",
        |c| c.cpr.uncoordinated = true,
    );
}

#[test]
fn frozen_none() {
    if ftrec_sim::processes::ran_in_child_process() {
        return;
    }
    schedules_keep_their_promises(FaultTolerance::None, Kind::Freeze, FREEZES_PER_MODE);
}

/// One fault on server 1 at 300 ms under `mode`; the run must end exact. Returns the
/// job's configuration and what happened.
fn one_fault_on_server_1(
    mode: FaultTolerance,
    fault: ftrec_sim::Fault,
    seed: u64,
    replace_on_new_host: bool,
) -> (ftrec_config::JobConfig, ftrec_sim::Outcome) {
    let ck = checkpoint_dir();
    let config = job_config(mode, data_dir(), ck.path(), STEPS).unwrap();
    let reference = reference_digest(&config).unwrap();
    let schedule = Schedule {
        events: vec![ftrec_sim::Event {
            at: Duration::from_millis(300),
            fault,
        }],
    };
    let outcome = run(RunOptions {
        config: config.clone(),
        seed,
        schedule,
        armed: Vec::new(),
        time_limit: Duration::from_secs(60),
        replace_on_new_host,
    })
    .unwrap();
    assert_eq!(check(&config, &outcome, &reference), vec![], "{mode:?}");
    (config, outcome.unwrap())
}

/// A server frozen past the failure timeout, then thawed while training goes on (SIGCONT,
/// link-up): its slot has a new process, so it is refused, counted once, and the run ends
/// exact.
#[test]
fn a_thawed_server_is_refused_as_a_zombie() {
    use ftrec_sim::{Fault, Member};
    ftrec_sim::logs_from_env();
    for mode in [FaultTolerance::Ec, FaultTolerance::Checkpoint] {
        let freeze = Fault::Freeze {
            member: Member::Server(1),
            lasting: Some(Duration::from_millis(600)),
        };
        let (_, o) = one_fault_on_server_1(mode, freeze, 3, true);
        assert_eq!(
            o.summary.zombies_refused,
            1,
            "{mode:?}: {}",
            o.trace.join("\n")
        );
    }
}

/// After a recovery, training goes on at once: the first step after the resume settles
/// within a failure timeout. A worker whose step was caught in the dead server's calls
/// reports the loss only after the resume; that report must not pause grants for a
/// failure timeout (the recovery dealt with its cause already).
#[test]
fn training_goes_on_right_after_the_resume() {
    use ftrec_sim::{Fault, Member};
    ftrec_sim::logs_from_env();
    for mode in [FaultTolerance::Ec, FaultTolerance::Checkpoint] {
        let (config, o) = one_fault_on_server_1(mode, Fault::Crash(Member::Server(1)), 5, false);
        let timeout = config.cluster.failure_timeout_ms as f64 / 1e3;
        let r = o.summary.recoveries.first().expect("a recovery");
        let first = r.first_step_at.expect("a step settled after the resume");
        assert!(
            first - r.resumed_at < timeout,
            "{mode:?}: first step {:.3} s after the resume (failure timeout {timeout} s)\n{}",
            first - r.resumed_at,
            o.trace.join("\n")
        );
    }
}

/// The nasty partition: the worker cannot reach a server that the coordinator still
/// sees. The worker names the server in its loss report; once a connection of its own got
/// no answer either (or after two lost steps in a row, before the worker has timed enough
/// calls to suspect one early), the coordinator declares the server dead, fences it and
/// recovers, and the old process (still talking to the coordinator) is refused as a
/// zombie.
#[test]
fn a_worker_cut_off_from_one_server_gets_it_replaced() {
    use ftrec_sim::Member;
    ftrec_sim::logs_from_env();
    for mode in [
        FaultTolerance::Ec,
        FaultTolerance::EcCheckpoint,
        FaultTolerance::Checkpoint,
    ] {
        let o = partitioned(mode, Some(1), Member::Worker(0), Member::Server(1));
        if std::env::var("FTREC_SIM_TRACE").is_ok() {
            eprintln!("{mode:?}\n{}", o.trace.join("\n"));
        }
        assert!(
            o.summary.recoveries.iter().any(|r| r.server == 1),
            "{mode:?}: server 1 was not replaced: {}",
            o.trace.join("\n")
        );
        assert!(
            o.trace.iter().any(|l| l.contains("cut off from")),
            "{mode:?}"
        );
    }
}

/// Two servers of a group cut off from each other, both still answering the workers and the
/// coordinator: each one's parity updates to the other fail, and the workers' prepares
/// come back "unavailable", relayed. The workers must blame the server named as
/// unreachable, not the one that answered: blaming the answering server fenced a healthy
/// server 0 beside a SIGKILLed server 1, two of a group lost at once (a run on `tiny` at
/// 400,000 rows did so in 2 of 3 tries). Exactly one server is replaced, and the run ends
/// exact.
#[test]
fn a_server_cut_off_from_a_peer_gets_the_peer_replaced() {
    use ftrec_sim::Member;
    ftrec_sim::logs_from_env();
    for mode in [FaultTolerance::Ec, FaultTolerance::EcCheckpoint] {
        let o = partitioned(mode, None, Member::Server(0), Member::Server(1));
        let trace = o.trace.join("\n");
        let replaced: Vec<usize> = o.summary.recoveries.iter().map(|r| r.server).collect();
        assert_eq!(replaced.len(), 1, "{mode:?}: {trace}");
        // Either side's updates to the other fail; whichever a worker hears of first, the
        // server declared cut off is the one its update could not reach.
        let declared = o
            .trace
            .iter()
            .find(|l| l.contains("cut off from the workers"))
            .unwrap_or_else(|| panic!("{mode:?}: no server declared cut off: {trace}"));
        assert!(
            declared.contains(&format!("parity update to server {}", replaced[0])),
            "{mode:?}: server {} was replaced, but the update that failed went elsewhere: \
             {declared}",
            replaced[0]
        );
    }
}

/// `a` and `b` cut off from each other for good from 300 ms, under `mode` (with `workers`
/// workers where given), each replacement on a new host; the run must end exact.
fn partitioned(
    mode: FaultTolerance,
    workers: Option<usize>,
    a: ftrec_sim::Member,
    b: ftrec_sim::Member,
) -> ftrec_sim::Outcome {
    use ftrec_sim::{Event, Fault};
    let ck = checkpoint_dir();
    let mut config = job_config(mode, data_dir(), ck.path(), STEPS).unwrap();
    if let Some(workers) = workers {
        config.cluster.workers = workers;
    }
    let reference = reference_digest(&config).unwrap();
    let schedule = Schedule {
        events: vec![Event {
            at: Duration::from_millis(300),
            fault: Fault::Partition {
                a,
                b,
                lasting: None,
            },
        }],
    };
    let outcome = run(RunOptions {
        config: config.clone(),
        seed: 1,
        schedule,
        armed: Vec::new(),
        time_limit: Duration::from_secs(60),
        replace_on_new_host: true,
    })
    .unwrap();
    assert_eq!(check(&config, &outcome, &reference), vec![], "{mode:?}");
    outcome.unwrap()
}
