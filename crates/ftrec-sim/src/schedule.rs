//! Fault schedules: what happens to which simulated host, and when, drawn from a seed.
//! This schedules are crashes, restarts (bounce) and latency; partitions and
//! frozen hosts (`hold`) come with the real-failures work, which builds on this harness.

use std::fmt;
use std::time::Duration;

use rand::{Rng, SeedableRng, rngs::StdRng};

/// A member of the simulated cluster, by role and slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Member {
    Server(usize),
    Worker(usize),
}

impl Member {
    /// Its simulated host's name.
    pub fn host(self) -> String {
        match self {
            Self::Server(j) => format!("server-{j}"),
            Self::Worker(w) => format!("worker-{w}"),
        }
    }
}

impl fmt::Display for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.host())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The host stops at once, mid-RPC; the coordinator detects it and has it replaced (a
    /// replacement starts on the same host).
    Crash(Member),
    /// The host's software restarts at once: what was in its memory is gone, and a new
    /// process joins in its place before anyone noticed the old one die.
    Bounce(Member),
    /// Every message takes up to `max` for `lasting`.
    Latency { max: Duration, lasting: Duration },
    /// The member goes silent: nothing it sends arrives and nothing reaches it, as when
    /// its process is frozen (SIGSTOP) or its link is down; after `lasting` (if ever) the
    /// held messages flow again, as after SIGCONT or link-up.
    Freeze {
        member: Member,
        lasting: Option<Duration>,
    },
    /// Messages between two members are dropped (both ways) for `lasting`, if it ends;
    /// everyone else, the coordinator included, still reaches both.
    Partition {
        a: Member,
        b: Member,
        lasting: Option<Duration>,
    },
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Crash(m) => write!(f, "crash {m}"),
            Self::Bounce(m) => write!(f, "bounce {m}"),
            Self::Latency { max, lasting } => {
                write!(f, "latency up to {max:?} for {lasting:?}")
            }
            Self::Partition { a, b, lasting } => match lasting {
                Some(d) => write!(f, "partition {a} | {b} for {d:?}"),
                None => write!(f, "partition {a} | {b} for good"),
            },
            Self::Freeze { member, lasting } => match lasting {
                Some(d) => write!(f, "freeze {member} for {d:?}"),
                None => write!(f, "freeze {member} for good"),
            },
        }
    }
}

/// A fault at a simulated time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub at: Duration,
    pub fault: Fault,
}

/// The faults of one run, in time order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    pub events: Vec<Event>,
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.events.is_empty() {
            return f.write_str("no faults");
        }
        for (i, e) in self.events.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{} at {:.3}s", e.fault, e.at.as_secs_f64())?;
        }
        Ok(())
    }
}

/// Between two member faults: long enough for detection and a rebuild, so that the faults
/// stay within what every mode promises to survive (one server at a time).
const FAULT_SPACING_MS: u64 = 1_200;

impl Schedule {
    /// One or two faults drawn from `seed`: a crash or bounce of a server (most often) or a
    /// worker, and sometimes a window of latency, all while training runs.
    pub fn random(seed: u64, servers: usize, workers: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut events = Vec::new();
        let mut at = Duration::from_millis(rng.gen_range(200..900));
        for _ in 0..rng.gen_range(1..=2) {
            let member = if rng.gen_bool(0.8) {
                Member::Server(rng.gen_range(0..servers))
            } else {
                Member::Worker(rng.gen_range(0..workers))
            };
            let fault = if rng.gen_bool(0.6) {
                Fault::Crash(member)
            } else {
                Fault::Bounce(member)
            };
            events.push(Event { at, fault });
            at += Duration::from_millis(FAULT_SPACING_MS + rng.gen_range(0..400));
        }
        if rng.gen_bool(0.3) {
            events.push(Event {
                at: Duration::from_millis(rng.gen_range(100..1_200)),
                fault: Fault::Latency {
                    max: Duration::from_millis(rng.gen_range(5..40)),
                    lasting: Duration::from_millis(rng.gen_range(200..1_000)),
                },
            });
        }
        events.sort_by_key(|e| e.at);
        Self { events }
    }
}

impl Schedule {
    /// One server frozen while training runs, drawn from `seed`: for good (a host that
    /// went silent), or thawed after a while (a zombie: a member declared dead that comes
    /// back). The real-failures issue's standard failure.
    pub fn freeze(seed: u64, servers: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5EED_F00D);
        let member = Member::Server(rng.gen_range(0..servers));
        let lasting = rng
            .gen_bool(0.5)
            .then(|| Duration::from_millis(rng.gen_range(500..2_500)));
        Self {
            events: vec![Event {
                at: Duration::from_millis(rng.gen_range(150..450)),
                fault: Fault::Freeze { member, lasting },
            }],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_always_draws_the_same_schedule_and_member_faults_are_spaced() {
        for seed in 0..200 {
            let a = Schedule::random(seed, 3, 2);
            assert_eq!(a, Schedule::random(seed, 3, 2));
            let members: Vec<Duration> = a
                .events
                .iter()
                .filter(|e| !matches!(e.fault, Fault::Latency { .. }))
                .map(|e| e.at)
                .collect();
            assert!(!members.is_empty());
            for pair in members.windows(2) {
                assert!(pair[1] - pair[0] >= Duration::from_millis(FAULT_SPACING_MS));
            }
        }
        assert_ne!(Schedule::random(1, 3, 2), Schedule::random(2, 3, 2));
    }
}
