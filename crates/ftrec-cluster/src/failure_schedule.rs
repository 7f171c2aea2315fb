//! A Poisson schedule of server failures, drawn once from a seed and a mean time between
//! failures, so that every strategy of a comparison (`bench shootout`) meets the same
//! failures at the same moments of wall time.

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::Serialize;

use crate::launch::{KillAt, KillSpec};
use ftrec_proto::proto::Role;

/// One failure: a server SIGKILLed, or frozen for good (SIGSTOP: silent, not gone).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScheduledFailure {
    /// Seconds after training starts (with `during_recovery`: not before then).
    pub at_seconds: f64,
    pub server: usize,
    pub freeze: bool,
    /// SIGKILL the slot's process at the first moment from `at_seconds` on that it
    /// recovers (`--kill server:J@Ts=recovering`): its replacement rebuilding, or its
    /// recovery (a restore) under way.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub during_recovery: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FailureSchedule {
    pub seed: u64,
    pub mtbf_seconds: f64,
    pub failures: Vec<ScheduledFailure>,
}

/// What a schedule is drawn over.
#[derive(Clone, Copy, Debug)]
pub struct ScheduleShape {
    pub servers: usize,
    /// Failures fall in `[start_seconds, horizon_seconds)` after training starts.
    pub start_seconds: f64,
    pub horizon_seconds: f64,
    /// Consecutive failures are at least this far apart: a failure while the last one is
    /// still being recovered from is a second-failure study of its own (ECRec with r = 1
    /// cannot survive it by design), not the strategies' steady-state cost.
    pub min_gap_seconds: f64,
    /// Share of the failures that freeze their server rather than kill it.
    pub freeze_share: f64,
    /// Every schedule holds at least one SIGKILL and one freeze (so at least two
    /// failures), whatever the draw: a comparison at a rate must meet both kinds.
    pub both_kinds: bool,
    /// Also strike the first SIGKILLed slot again while it recovers (its replacement
    /// rebuilds, or restores), at the first such moment at least this long after the
    /// first strike: a second failure during a recovery, which the minimum gap rules out
    /// otherwise. The slot's survivors still hold its state, so every strategy can
    /// survive it. A strike at a fixed delay missed erasure coding's 0.1 s rebuild.
    pub during_recovery_seconds: Option<f64>,
}

/// Draws of a schedule with no failure in the horizon before one is placed by hand.
const MAX_DRAWS: u32 = 1000;

impl FailureSchedule {
    /// Exponential gaps of mean `mtbf_seconds` (stretched to `min_gap_seconds` where
    /// shorter), a uniformly drawn server each, at least one failure, and at least one
    /// freeze among them (the last, if the draw gave none). With `both_kinds`, draws are
    /// repeated until one has two failures (placed by hand after `MAX_DRAWS`), and the
    /// first is a SIGKILL if none was; with `during_recovery_seconds`, the first SIGKILL's
    /// slot is struck again that long after it.
    pub fn poisson(seed: u64, mtbf_seconds: f64, shape: ScheduleShape) -> Result<Self, String> {
        if !(mtbf_seconds > 0.0 && mtbf_seconds.is_finite()) {
            return Err(format!("mtbf {mtbf_seconds} s: must be a positive number"));
        }
        let window = shape.horizon_seconds - shape.start_seconds;
        if shape.servers == 0 || window.is_nan() || window <= 0.0 {
            return Err(format!(
                "a failure schedule needs servers and a horizon after its start ({} servers, \
                 {}..{} s)",
                shape.servers, shape.start_seconds, shape.horizon_seconds
            ));
        }
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let wanted = if shape.both_kinds { 2 } else { 1 };
        let mut failures = Vec::new();
        for _ in 0..MAX_DRAWS {
            failures = draw(&mut rng, mtbf_seconds, &shape);
            if failures.len() >= wanted {
                break;
            }
        }
        if failures.len() < wanted {
            // The draws kept missing the horizon: evenly spaced by hand instead.
            failures = (0..wanted)
                .map(|i| ScheduledFailure {
                    at_seconds: shape.start_seconds + window * (i + 1) as f64 / (wanted + 1) as f64,
                    server: rng.gen_range(0..shape.servers),
                    freeze: false,
                    during_recovery: false,
                })
                .collect();
        }
        if (shape.freeze_share > 0.0 || shape.both_kinds)
            && !failures.iter().any(|f| f.freeze)
            && let Some(last) = failures.last_mut()
        {
            last.freeze = true;
        }
        if shape.both_kinds
            && !failures.iter().any(|f| !f.freeze)
            && let Some(first) = failures.first_mut()
        {
            first.freeze = false;
        }
        if let Some(after) = shape.during_recovery_seconds
            && let Some(kill) = failures.iter().find(|f| !f.freeze).cloned()
        {
            let again = ScheduledFailure {
                at_seconds: kill.at_seconds + after,
                server: kill.server,
                freeze: false,
                during_recovery: true,
            };
            let at = failures.partition_point(|f| f.at_seconds <= again.at_seconds);
            failures.insert(at, again);
        }
        Ok(Self {
            seed,
            mtbf_seconds,
            failures,
        })
    }

    /// The `--kill` specs of this schedule.
    pub fn kills(&self) -> Vec<KillSpec> {
        self.failures
            .iter()
            .map(|f| {
                let after = std::time::Duration::from_secs_f64(f.at_seconds);
                KillSpec {
                    role: Role::Server,
                    id: f.server,
                    at: if f.during_recovery {
                        KillAt::DuringRecovery(after)
                    } else if f.freeze {
                        KillAt::FreezeAfter(after)
                    } else {
                        KillAt::After(after)
                    },
                }
            })
            .collect()
    }
}

fn draw(
    rng: &mut Xoshiro256PlusPlus,
    mtbf_seconds: f64,
    shape: &ScheduleShape,
) -> Vec<ScheduledFailure> {
    let mut failures = Vec::new();
    let mut t = shape.start_seconds;
    loop {
        // Inverse transform of U in (0, 1]: never ln(0).
        let u: f64 = 1.0 - rng.r#gen::<f64>();
        let gap = -mtbf_seconds * u.ln();
        let gap = if failures.is_empty() {
            gap
        } else {
            gap.max(shape.min_gap_seconds)
        };
        t += gap;
        if t >= shape.horizon_seconds {
            return failures;
        }
        failures.push(ScheduledFailure {
            at_seconds: t,
            server: rng.gen_range(0..shape.servers),
            freeze: rng.r#gen::<f64>() < shape.freeze_share,
            during_recovery: false,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shape(horizon: f64) -> ScheduleShape {
        ScheduleShape {
            servers: 3,
            start_seconds: 2.0,
            horizon_seconds: horizon,
            min_gap_seconds: 3.0,
            freeze_share: 0.3,
            both_kinds: false,
            during_recovery_seconds: None,
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_schedule() {
        let a = FailureSchedule::poisson(7, 10.0, shape(60.0)).unwrap();
        let b = FailureSchedule::poisson(7, 10.0, shape(60.0)).unwrap();
        assert_eq!(a, b);
        let c = FailureSchedule::poisson(8, 10.0, shape(60.0)).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn the_mean_gap_follows_the_mtbf() {
        // Over a long horizon, the count is about horizon / mtbf (the minimum gap of 0.5 s
        // barely stretches gaps of mean 20 s).
        let s = FailureSchedule::poisson(
            3,
            20.0,
            ScheduleShape {
                min_gap_seconds: 0.5,
                ..shape(20_000.0)
            },
        )
        .unwrap();
        let n = s.failures.len() as f64;
        assert!((900.0..1100.0).contains(&n), "{n} failures");
        let freezes = s.failures.iter().filter(|f| f.freeze).count() as f64;
        assert!((0.25..0.35).contains(&(freezes / n)), "{freezes} freezes");
        for server in 0..3 {
            let k = s.failures.iter().filter(|f| f.server == server).count() as f64;
            assert!(k / n > 0.28, "server {server}: {k} of {n}");
        }
    }

    #[test]
    fn bad_inputs_are_refused() {
        assert!(FailureSchedule::poisson(1, 0.0, shape(10.0)).is_err());
        assert!(FailureSchedule::poisson(1, f64::NAN, shape(10.0)).is_err());
        assert!(FailureSchedule::poisson(1, 5.0, shape(1.0)).is_err());
    }

    proptest! {
        /// With both kinds asked for, a schedule has a SIGKILL and a freeze even at a rate
        /// that draws less than one failure in the horizon; a strike during the recovery
        /// hits the first SIGKILL's slot again, that long after it, and the rest keep
        /// their gaps.
        #[test]
        fn both_kinds_and_a_strike_during_recovery(seed in 0u64..2_000, mtbf in 5.0f64..400.0) {
            let shape = ScheduleShape {
                both_kinds: true,
                during_recovery_seconds: Some(0.6),
                ..shape(40.0)
            };
            let s = FailureSchedule::poisson(seed, mtbf, shape).unwrap();
            prop_assert!(s.failures.iter().any(|f| f.freeze));
            prop_assert!(s.failures.iter().any(|f| !f.freeze));
            prop_assert!(s.failures.windows(2).all(|w| w[0].at_seconds <= w[1].at_seconds));
            let kill = s.failures.iter().find(|f| !f.freeze).unwrap();
            let again: Vec<_> = s
                .failures
                .iter()
                .filter(|f| {
                    f.server == kill.server
                        && !f.freeze
                        && (f.at_seconds - kill.at_seconds - 0.6).abs() < 1e-9
                })
                .collect();
            prop_assert_eq!(again.len(), 1);
            prop_assert!(again[0].during_recovery);
            prop_assert_eq!(s.failures.iter().filter(|f| f.during_recovery).count(), 1);
            let spelled: Vec<String> = s.kills().iter().map(|k| k.to_string()).collect();
            prop_assert_eq!(spelled.iter().filter(|k| k.ends_with("=recovering")).count(), 1);
            let drawn: Vec<_> = s.failures.iter().filter(|f| !std::ptr::eq(*f, again[0])).collect();
            prop_assert!(drawn.len() >= 2);
            for w in drawn.windows(2) {
                prop_assert!(w[1].at_seconds - w[0].at_seconds >= 3.0 - 1e-9);
            }
        }

        /// Every schedule has a failure and a freeze, inside the window, in order, with
        /// the minimum gap, and its kill specs say the same.
        #[test]
        fn every_schedule_keeps_its_promises(seed in 0u64..10_000, mtbf in 0.5f64..500.0) {
            let s = FailureSchedule::poisson(seed, mtbf, shape(40.0)).unwrap();
            prop_assert!(!s.failures.is_empty());
            prop_assert!(s.failures.iter().any(|f| f.freeze));
            for f in &s.failures {
                prop_assert!((2.0..40.0).contains(&f.at_seconds));
                prop_assert!(f.server < 3);
            }
            for w in s.failures.windows(2) {
                prop_assert!(w[1].at_seconds - w[0].at_seconds >= 3.0 - 1e-9);
            }
            let kills = s.kills();
            prop_assert_eq!(kills.len(), s.failures.len());
            for (k, f) in kills.iter().zip(&s.failures) {
                let spelled = k.to_string();
                prop_assert_eq!(spelled.ends_with("=freeze"), f.freeze);
                prop_assert_eq!(&spelled.parse::<KillSpec>().unwrap(), k);
            }
        }
    }
}
