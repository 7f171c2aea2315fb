//! The soak's fault schedule and the rule that decides whether a fault may strike now.
//! Both are pure: the schedule is a function of the seed, and admission a function of
//! what is still being recovered from, so both are tested without a network.

use std::collections::BTreeMap;

use rand::Rng;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::{Deserialize, Serialize};

/// Every kind of fault the soak injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// A server SIGKILLed.
    ServerKill,
    /// A server SIGSTOPped for good (the operator kills it once it is replaced).
    ServerFreeze,
    /// A server SIGSTOPped for 8 s, then SIGCONTed: it comes back after its replacement.
    ServerZombie,
    /// A server host's link to its bridge down.
    LinkDown,
    /// Silent drops between one worker and one server, one way or both.
    Partition,
    /// 5% loss on everything one server sends and receives, for 30 s: no recovery.
    Loss,
    /// The leading coordinator SIGKILLed.
    LeaderKill,
    /// The leading coordinator cut off from every etcd member (it still reaches the job).
    LeaderEtcdCut,
    /// One etcd member SIGKILLed, then started again on its data.
    EtcdRestart,
    /// A server SIGKILLed, and once its failure is detected, two of the three etcd
    /// members lost for 30 s: quorum gone during a recovery.
    EtcdQuorumLoss,
    /// Both servers of one rack lost at once (the rack's uplink down).
    Rack,
}

impl FaultKind {
    pub const ALL: [FaultKind; 11] = [
        FaultKind::ServerKill,
        FaultKind::ServerFreeze,
        FaultKind::ServerZombie,
        FaultKind::LinkDown,
        FaultKind::Partition,
        FaultKind::Loss,
        FaultKind::LeaderKill,
        FaultKind::LeaderEtcdCut,
        FaultKind::EtcdRestart,
        FaultKind::EtcdQuorumLoss,
        FaultKind::Rack,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::ServerKill => "server-kill",
            FaultKind::ServerFreeze => "server-freeze",
            FaultKind::ServerZombie => "server-zombie",
            FaultKind::LinkDown => "link-down",
            FaultKind::Partition => "partition",
            FaultKind::Loss => "loss",
            FaultKind::LeaderKill => "leader-kill",
            FaultKind::LeaderEtcdCut => "leader-etcd-cut",
            FaultKind::EtcdRestart => "etcd-restart",
            FaultKind::EtcdQuorumLoss => "etcd-quorum-loss",
            FaultKind::Rack => "rack",
        }
    }

    pub fn parse(name: &str) -> Option<FaultKind> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Servers the job loses (and must replace) when this fault strikes.
    pub fn servers_lost(self) -> usize {
        match self {
            FaultKind::ServerKill
            | FaultKind::ServerFreeze
            | FaultKind::ServerZombie
            | FaultKind::LinkDown
            | FaultKind::Partition
            | FaultKind::EtcdQuorumLoss => 1,
            FaultKind::Rack => 2,
            FaultKind::Loss
            | FaultKind::LeaderKill
            | FaultKind::LeaderEtcdCut
            | FaultKind::EtcdRestart => 0,
        }
    }

    /// Whether it strikes the control plane (a coordinator or etcd).
    pub fn control_plane(self) -> bool {
        matches!(
            self,
            FaultKind::LeaderKill
                | FaultKind::LeaderEtcdCut
                | FaultKind::EtcdRestart
                | FaultKind::EtcdQuorumLoss
        )
    }
}

/// One fault of the schedule: `at` seconds after training starts.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Planned {
    pub at: f64,
    pub kind: FaultKind,
}

/// A fault every `every` seconds (jittered by up to a quarter of it either way, so that
/// faults do not fall in step with the job's own periods) for `seconds`, the kinds drawn
/// from `kinds` as from a bag: every kind once, in a seeded order, then again. A soak of
/// `kinds.len()` faults meets each kind exactly once.
pub fn draw(seed: u64, seconds: f64, every: f64, kinds: &[FaultKind]) -> Vec<Planned> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let count = if every > 0.0 {
        (seconds / every).floor() as usize
    } else {
        0
    };
    let mut bag: Vec<FaultKind> = Vec::new();
    (0..count)
        .filter_map(|i| {
            if bag.is_empty() {
                bag = kinds.to_vec();
                bag.shuffle(&mut rng);
            }
            let kind = bag.pop()?;
            let jitter = rng.gen_range(-0.25..=0.25) * every;
            Some(Planned {
                at: (every * (i as f64 + 1.0) + jitter).max(0.0),
                kind,
            })
        })
        .collect()
}

/// What the job has not yet recovered from, as admission sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InFlight {
    /// Servers lost and not yet back at full redundancy.
    pub servers_lost: usize,
    /// A coordinator or etcd fault not yet over (or a standby not yet back).
    pub control_plane: bool,
    /// A server under loss.
    pub lossy: bool,
}

/// Whether `kind` may strike now: never past what the mode survives at once
/// (`tolerance` servers: `ec.r` under erasure coding), never a second control-plane fault
/// before the first is over (the standby must be back), one lossy server at a time. A
/// fault refused here waits; it is not dropped.
pub fn admissible(kind: FaultKind, now: InFlight, tolerance: usize) -> bool {
    if now.servers_lost + kind.servers_lost() > tolerance {
        return false;
    }
    if kind.control_plane() && now.control_plane {
        return false;
    }
    !(kind == FaultKind::Loss && now.lossy)
}

/// Counts by kind, every kind present (0 where none), for the report.
pub fn by_kind<'a>(kinds: impl Iterator<Item = &'a FaultKind>) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = FaultKind::ALL
        .iter()
        .map(|k| (k.name().to_string(), 0))
        .collect();
    for k in kinds {
        *out.entry(k.name().to_string()).or_default() += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_schedule_is_ordered_balanced_and_a_function_of_its_seed(
            seed in any::<u64>(), every in 1.0f64..60.0, minutes in 0.5f64..30.0,
        ) {
            let seconds = minutes * 60.0;
            let plan = draw(seed, seconds, every, &FaultKind::ALL);
            prop_assert_eq!(plan.len(), (seconds / every).floor() as usize);
            prop_assert_eq!(&plan, &draw(seed, seconds, every, &FaultKind::ALL));
            for w in plan.windows(2) {
                // Jitter is a quarter of the gap either way: order is kept.
                prop_assert!(w[0].at <= w[1].at);
            }
            // Bag draws: after n faults, no kind is ahead of another by more than one.
            let counts = by_kind(plan.iter().map(|p| &p.kind));
            let (lo, hi) = (counts.values().min().copied(), counts.values().max().copied());
            prop_assert!(hi.unwrap_or(0) - lo.unwrap_or(0) <= 1);
        }

        #[test]
        fn admission_never_exceeds_the_tolerance(
            lost in 0usize..3, control in any::<bool>(), lossy in any::<bool>(),
            k in 0usize..11, tolerance in 1usize..3,
        ) {
            let kind = FaultKind::ALL[k];
            let now = InFlight { servers_lost: lost, control_plane: control, lossy };
            if admissible(kind, now, tolerance) {
                prop_assert!(lost + kind.servers_lost() <= tolerance);
                prop_assert!(!(kind.control_plane() && control));
                prop_assert!(!(kind == FaultKind::Loss && lossy));
            }
        }
    }

    #[test]
    fn eleven_faults_meet_every_kind_once() {
        let plan = draw(7, 110.0, 10.0, &FaultKind::ALL);
        let counts = by_kind(plan.iter().map(|p| &p.kind));
        assert!(counts.values().all(|&n| n == 1), "{counts:?}");
    }

    #[test]
    fn a_rack_waits_for_a_lost_server_under_r1_but_not_r2() {
        let one_lost = InFlight {
            servers_lost: 1,
            ..Default::default()
        };
        assert!(!admissible(FaultKind::Rack, InFlight::default(), 1));
        assert!(admissible(FaultKind::Rack, InFlight::default(), 2));
        assert!(!admissible(FaultKind::Rack, one_lost, 2));
        assert!(admissible(FaultKind::ServerKill, one_lost, 2));
        assert!(admissible(FaultKind::LeaderKill, one_lost, 2));
    }

    #[test]
    fn names_read_back() {
        for k in FaultKind::ALL {
            assert_eq!(FaultKind::parse(k.name()), Some(k));
        }
    }
}
