//! Control-plane fault schedules: one fault of the leader or of etcd, alone or beside a
//! member crash or freeze, a worker or coordinator killed at a fault point, and a stream
//! stalled mid-way, drawn from a seed.

use std::fmt;
use std::time::Duration;

use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::Member;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ControlFault {
    /// The leader's host stops at once (SIGKILL); the standby takes over once its lease
    /// expires, and the host starts again later as a standby.
    LeaderCrash,
    /// The leader goes silent (SIGSTOP: its links held) and comes back after `lasting`,
    /// by then usually deposed: a zombie that must decide nothing more.
    LeaderFreeze { lasting: Duration },
    /// etcd answers nothing for `lasting` (SIGSTOP of the only member): no lease renews
    /// and no decision that needs etcd is taken.
    EtcdPause { lasting: Duration },
    /// Every etcd request takes `delay` more, for `lasting`.
    SlowEtcd { delay: Duration, lasting: Duration },
}

impl fmt::Display for ControlFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LeaderCrash => f.write_str("crash the leader"),
            Self::LeaderFreeze { lasting } => write!(f, "freeze the leader for {lasting:?}"),
            Self::EtcdPause { lasting } => write!(f, "pause etcd for {lasting:?}"),
            Self::SlowEtcd { delay, lasting } => {
                write!(f, "etcd {delay:?} slower for {lasting:?}")
            }
        }
    }
}

/// Where a worker is killed by its own fault point (`ftrec_faults::points`), at a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerPoint {
    /// Step pulled and computed, nothing of it sent.
    Push,
    /// Prepared on every server (2PC phase 1), committed on none.
    Prepared,
    /// Prepared on the first server only (asynchronous workers prepare one at a time).
    PreparedFirst,
}

impl WorkerPoint {
    pub fn name(self) -> &'static str {
        match self {
            Self::Push => ftrec_faults::points::PUSH,
            Self::Prepared => ftrec_faults::points::PREPARED,
            Self::PreparedFirst => ftrec_faults::points::PREPARED_FIRST,
        }
    }
}

/// A worker killed at one of its fault points, at a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerKill {
    pub worker: usize,
    pub point: WorkerPoint,
    pub step: u64,
}

/// Where a coordinator is killed by its own fault point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoordinatorPoint {
    /// The first leader, with a recovery decided, before it calls any server.
    Recovery,
    /// The standby, just elected, before it fences any server.
    Takeover,
    /// The first leader, with the cut of step [`CUT_COMMITTED_STEP`] committed and
    /// reported, before it prunes (the job must take cuts: `checkpoints`).
    CutCommitted,
    /// The first leader, told that a background rebuild ended, before it notes it: its
    /// record still has the slot rebuilding (a server must fail: `member`).
    RebuildEnded,
}

/// The cut after which [`CoordinatorPoint::CutCommitted`] strikes: the first of the run's
/// cuts (`checkpoint.every_steps = 30`) that is not the initial one.
pub const CUT_COMMITTED_STEP: u64 = 30;

impl CoordinatorPoint {
    pub fn name(self) -> &'static str {
        match self {
            Self::Recovery => ftrec_faults::points::RECOVERY,
            Self::Takeover => ftrec_faults::points::TAKEOVER,
            Self::CutCommitted => ftrec_faults::points::CUT_COMMITTED,
            Self::RebuildEnded => ftrec_faults::points::REBUILD_ENDED,
        }
    }

    /// The step a spec of this point names, if it names one.
    pub fn step(self) -> Option<u64> {
        match self {
            Self::CutCommitted => Some(CUT_COMMITTED_STEP),
            Self::Recovery | Self::Takeover | Self::RebuildEnded => None,
        }
    }

    /// The coordinator whose registry arms it: the first leader for a recovery, the
    /// standby for a takeover.
    pub fn coordinator(self) -> usize {
        match self {
            Self::Recovery | Self::CutCommitted | Self::RebuildEnded => 0,
            Self::Takeover => 1,
        }
    }
}

/// The faults of one control-plane run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControlSchedule {
    /// A control-plane fault, at a simulated time (applied once a leader is elected).
    pub control: Option<(Duration, ControlFault)>,
    /// A member crash, at a simulated time; its replacement restarts on its host.
    pub member: Option<(Duration, Member)>,
    /// The workers train asynchronously (`cluster.deterministic = false`): no digest to
    /// match, every other promise holds.
    pub asynchronous: bool,
    /// The job is `ec+checkpoint` (cuts at steps 30 and 60), not `ec`: cuts during the
    /// faults, and the fence tokens of its checkpoint parts.
    pub checkpoints: bool,
    /// A worker killed at a fault point of its step (between 2PC's phases, say), beside
    /// the rest: timed by the step, not the clock.
    pub worker_kill: Option<WorkerKill>,
    /// A coordinator killed at a fault point (a recovery, a takeover), beside the rest.
    pub coordinator_kill: Option<CoordinatorPoint>,
    /// The member fault is a freeze (SIGSTOP) of this long, not a crash (servers only):
    /// past the failure timeout the server is replaced, and when it thaws it is a late
    /// writer (a step's commit, a cut's part) that must change nothing.
    pub member_frozen_for: Option<Duration>,
    /// A server stalls each stream it sends (a rebuild's rows, the final gather) once,
    /// for this long, while it otherwise lives on.
    pub stalled_stream: Option<(usize, Duration)>,
}

impl fmt::Display for ControlSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some((at, fault)) = self.control {
            parts.push(format!("{fault} at {:.3}s", at.as_secs_f64()));
        }
        if let Some((at, m)) = self.member {
            let at = at.as_secs_f64();
            match self.member_frozen_for {
                Some(d) => parts.push(format!(
                    "freeze {m} at {at:.3}s for {:.3}s",
                    d.as_secs_f64()
                )),
                None => parts.push(format!("crash {m} at {at:.3}s")),
            }
        }
        if parts.is_empty() {
            parts.push("no faults".into());
        }
        if self.asynchronous {
            parts.push("asynchronous workers".into());
        }
        if let Some(k) = self.worker_kill {
            let point = k.point.name();
            parts.push(format!("kill worker-{} at {point}:{}", k.worker, k.step));
        }
        if let Some(p) = self.coordinator_kill {
            let name = p.name();
            parts.push(format!("kill coordinator-{} at {name}", p.coordinator()));
        }
        if let Some((server, d)) = self.stalled_stream {
            let d = d.as_secs_f64();
            parts.push(format!("server-{server} stalls its first stream {d:.3}s"));
        }
        if self.checkpoints {
            parts.push("ec+checkpoint".into());
        }
        f.write_str(&parts.join(", "))
    }
}

impl ControlSchedule {
    /// One control-plane fault drawn from `seed`, half the time with a server or worker
    /// crash before, during or after it (before training starts, too).
    pub fn random(seed: u64, servers: usize, workers: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ 0xC04E_7A01);
        let at = Duration::from_millis(rng.gen_range(250..700));
        let ms = |rng: &mut StdRng, lo: u64, hi: u64| Duration::from_millis(rng.gen_range(lo..hi));
        let fault = match rng.gen_range(0..4) {
            0 => ControlFault::LeaderCrash,
            // From well within the lease (2 s) to well past it.
            1 => ControlFault::LeaderFreeze {
                lasting: ms(&mut rng, 300, 4_000),
            },
            2 => ControlFault::EtcdPause {
                lasting: ms(&mut rng, 2_000, 60_001),
            },
            _ => ControlFault::SlowEtcd {
                delay: ms(&mut rng, 20, 800),
                lasting: ms(&mut rng, 500, 5_000),
            },
        };
        let member = rng.gen_bool(0.5).then(|| {
            let m = if rng.gen_bool(0.7) {
                Member::Server(rng.gen_range(0..servers))
            } else {
                Member::Worker(rng.gen_range(0..workers))
            };
            // From the start (before the member joined) to 1.5 s after the fault.
            let crash = (at + ms(&mut rng, 0, 2_000)).saturating_sub(Duration::from_millis(500));
            (crash, m)
        });
        Self {
            control: Some((at, fault)),
            member,
            // A third of the runs: the issue asks for both kinds of worker.
            asynchronous: rng.gen_bool(1.0 / 3.0),
            // A tenth: each costs about twice an `ec` run.
            checkpoints: rng.gen_bool(0.1),
            worker_kill: rng.gen_bool(0.25).then(|| WorkerKill {
                worker: rng.gen_range(0..workers),
                point: match rng.gen_range(0..3) {
                    0 => WorkerPoint::Push,
                    1 => WorkerPoint::Prepared,
                    _ => WorkerPoint::PreparedFirst,
                },
                // Training runs steps 0..85; a step the worker never takes fires nothing.
                step: rng.gen_range(10..70),
            }),
            coordinator_kill: rng.gen_bool(0.2).then(|| {
                if rng.gen_bool(0.5) {
                    CoordinatorPoint::Recovery
                } else {
                    CoordinatorPoint::Takeover
                }
            }),
            // Drawn last, so that a seed's other faults are the ones it always drew.
            member_frozen_for: None,
            stalled_stream: None,
        }
        .with_freeze_and_stall(&mut rng, servers)
    }

    /// A third of the server faults become freezes, from within the failure timeout (1 s)
    /// to well past it; a fifth of the runs stall a server's first stream, from a hiccup
    /// to past the stream progress deadline.
    fn with_freeze_and_stall(mut self, rng: &mut StdRng, servers: usize) -> Self {
        let ms = |rng: &mut StdRng, lo: u64, hi: u64| Duration::from_millis(rng.gen_range(lo..hi));
        let freeze = rng.gen_bool(1.0 / 3.0);
        let lasting = ms(rng, 300, 4_000);
        if freeze && matches!(self.member, Some((_, Member::Server(_)))) {
            self.member_frozen_for = Some(lasting);
        }
        let server = rng.gen_range(0..servers);
        let stall = ms(rng, 200, 8_000);
        self.stalled_stream = rng.gen_bool(0.2).then_some((server, stall));
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_always_draws_the_same_schedule_and_every_kind_is_drawn() {
        let mut kinds = [0; 4];
        let mut early = 0;
        for seed in 0..400 {
            let s = ControlSchedule::random(seed, 3, 2);
            assert_eq!(s, ControlSchedule::random(seed, 3, 2));
            let (_, fault) = s.control.unwrap();
            kinds[match fault {
                ControlFault::LeaderCrash => 0,
                ControlFault::LeaderFreeze { lasting } => {
                    assert!(lasting < Duration::from_secs(4));
                    1
                }
                ControlFault::EtcdPause { lasting } => {
                    assert!((2..=60).contains(&lasting.as_secs()));
                    2
                }
                ControlFault::SlowEtcd { .. } => 3,
            }] += 1;
            early += usize::from(
                s.member
                    .is_some_and(|(at, _)| at < Duration::from_millis(200)),
            );
        }
        assert!(kinds.iter().all(|&k| k > 60), "{kinds:?}");
        assert!(
            early > 5,
            "only {early} members crashed before they could join"
        );
        let asynchronous = (0..400)
            .filter(|&seed| ControlSchedule::random(seed, 3, 2).asynchronous)
            .count();
        assert!(
            (80..200).contains(&asynchronous),
            "{asynchronous} asynchronous"
        );
        let cutting = (0..400)
            .filter(|&seed| ControlSchedule::random(seed, 3, 2).checkpoints)
            .count();
        assert!((20..80).contains(&cutting), "{cutting} with checkpoints");
        let killed: Vec<WorkerKill> = (0..400)
            .filter_map(|seed| ControlSchedule::random(seed, 3, 2).worker_kill)
            .collect();
        assert!(
            (60..140).contains(&killed.len()),
            "{} worker kills",
            killed.len()
        );
        assert!(killed.iter().any(|k| k.point == WorkerPoint::Prepared));
        assert!(killed.iter().any(|k| k.point == WorkerPoint::Push));
        let leaders_killed = (0..400)
            .filter(|&seed| {
                ControlSchedule::random(seed, 3, 2)
                    .coordinator_kill
                    .is_some()
            })
            .count();
        assert!(
            (40..120).contains(&leaders_killed),
            "{leaders_killed} coordinator kills"
        );
        let frozen = (0..400)
            .filter_map(|seed| ControlSchedule::random(seed, 3, 2).member_frozen_for)
            .count();
        assert!((25..90).contains(&frozen), "{frozen} server freezes");
        let stalled = (0..400)
            .filter_map(|seed| ControlSchedule::random(seed, 3, 2).stalled_stream)
            .count();
        assert!((50..120).contains(&stalled), "{stalled} stalled streams");
    }
}
