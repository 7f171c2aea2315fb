//! What each `--ft` mode promises at the end of a run, checked on its outcome.

use std::fmt;

use ftrec_config::{FaultTolerance, JobConfig};
use ftrec_coordinator::RecoveryMode;
use ftrec_proto::timeline::EventKind;

use crate::Outcome;

/// A broken promise.
#[derive(Clone, Debug, PartialEq)]
pub enum Violation {
    /// The run did not finish (a member gave up, the time limit passed).
    Unfinished(String),
    /// An exact mode ended with another model than `ftrec train`.
    Digest {
        got: String,
        want: String,
    },
    ParityMismatches(u64),
    ReplicaMismatches(u64),
    /// An exact mode lost samples.
    LostSamples(u64),
    /// Not every step's samples were trained exactly once.
    Samples {
        got: u64,
        want: u64,
    },
    /// Partial recovery without its PLS, or over its target.
    Pls {
        pls: Option<f64>,
        target: f64,
    },
    /// A mode that restarts lost shards (`none`) lost one and did not say so.
    LossUnreported,
    /// A cut failed because a server would have written over a committed checkpoint: the
    /// cut was asked for again after an abandoned attempt, and the survivor's committed
    /// part was not recognised.
    CutCollided(String),
    /// Two leaders decided at once: a step was granted in an older epoch (an older term)
    /// after one had been granted in a newer one.
    InterleavedLeaders {
        newer: crate::Grant,
        older: crate::Grant,
    },
    /// A coordinator granted a step while etcd did not name it the leader.
    GrantWithoutLease(crate::Grant),
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unfinished(why) => write!(f, "the run did not finish: {why}"),
            Self::Digest { got, want } => {
                write!(f, "state digest {got}, but ftrec train ends with {want}")
            }
            Self::ParityMismatches(n) => write!(f, "{n} stripes with a wrong parity row"),
            Self::ReplicaMismatches(n) => write!(f, "{n} dense replicas differ from primary"),
            Self::LostSamples(n) => write!(f, "an exact mode lost {n} samples"),
            Self::Samples { got, want } => write!(
                f,
                "{got} samples trained, {want} scheduled (plus at most the rolled-back steps)"
            ),
            Self::Pls { pls, target } => write!(f, "PLS {pls:?} against a target of {target}"),
            Self::LossUnreported => {
                f.write_str("a server's shard restarted from scratch, and no loss was reported")
            }
            Self::CutCollided(event) => write!(f, "a cut collided with committed history: {event}"),
            Self::InterleavedLeaders { newer, older } => write!(
                f,
                "two leaders decided at once: coordinator-{} granted step {} in epoch {:#x} \
                 after coordinator-{} had granted step {} in epoch {:#x}",
                older.coordinator,
                older.step,
                older.epoch,
                newer.coordinator,
                newer.step,
                newer.epoch
            ),
            Self::GrantWithoutLease(g) => write!(
                f,
                "coordinator-{} granted step {} in epoch {:#x} while etcd named another leader \
                 or none",
                g.coordinator, g.step, g.epoch
            ),
        }
    }
}

/// The promises of `config`'s mode that `outcome` breaks (none: the run is correct).
/// `reference` is `ftrec train`'s digest of the same job.
/// The samples of the job's steps, short batches at the ends of epochs included (`None`
/// when the training data cannot be read).
fn scheduled_samples(config: &JobConfig) -> Option<u64> {
    let job = ftrec_rpc::Job::new(config.clone()).ok()?;
    let schedule = ftrec_rpc::job::Schedule {
        samples: job.train_data().ok()?.len() as u64,
        batch_size: config.train.batch_size as u64,
    };
    Some(schedule.samples_before(config.train.steps))
}

pub fn check(
    config: &JobConfig,
    outcome: &Result<Outcome, String>,
    reference: &str,
) -> Vec<Violation> {
    let o = match outcome {
        Ok(o) => o,
        Err(why) => return vec![Violation::Unfinished(why.clone())],
    };
    let mut violations = Vec::new();
    let summary = &o.summary;
    // A rollback trains its finished steps again, and counts them again; it also counts
    // the steps that were in flight (granted, never finished) as rolled back.
    let batch = config.train.batch_size as u64;
    let mut scheduled = config.train.steps * batch;
    if summary.samples < scheduled {
        // A run past an epoch's end has short batches there: the schedule says how many.
        scheduled = scheduled_samples(config).unwrap_or(scheduled);
    }
    let retrained_at_most = summary.steps_rolled_back * batch;
    if summary.samples < scheduled || summary.samples > scheduled + retrained_at_most {
        violations.push(Violation::Samples {
            got: summary.samples,
            want: scheduled,
        });
    }
    let mode = config.cluster.ft;
    if let Some(parity) = &o.parity {
        if parity.mismatches > 0 {
            violations.push(Violation::ParityMismatches(parity.mismatches));
        }
        if parity.replica_mismatches > 0 {
            violations.push(Violation::ReplicaMismatches(parity.replica_mismatches));
        }
    }
    if let Some(event) = o.events.iter().find(|e| e.kind == EventKind::CutCollided) {
        violations.push(Violation::CutCollided(event.detail.clone()));
    }
    match mode {
        FaultTolerance::Ec | FaultTolerance::EcCheckpoint | FaultTolerance::Checkpoint => {
            // Asynchronous workers train in an order of their own: no digest to match.
            if config.cluster.deterministic && o.state_digest != reference {
                violations.push(Violation::Digest {
                    got: o.state_digest.clone(),
                    want: reference.to_string(),
                });
            }
            if summary.lost_samples > 0 {
                violations.push(Violation::LostSamples(summary.lost_samples));
            }
        }
        FaultTolerance::Partial => {
            let target = config.cpr.target_pls;
            let restored = summary
                .recoveries
                .iter()
                .any(|r| r.mode == RecoveryMode::Partial);
            let within = summary.pls.is_some_and(|pls| pls <= target);
            if !within || (restored && summary.lost_samples == 0 && summary.pls != Some(0.0)) {
                violations.push(Violation::Pls {
                    pls: summary.pls,
                    target,
                });
            }
        }
        FaultTolerance::None => {
            let restarted = summary
                .recoveries
                .iter()
                .any(|r| r.mode == RecoveryMode::Keep);
            // A lost shard that had trained anything must show up as lost samples.
            let trained_before = summary
                .recoveries
                .iter()
                .any(|r| r.mode == RecoveryMode::Keep && r.resumed_step > 0);
            if restarted && trained_before && summary.lost_samples == 0 {
                violations.push(Violation::LossUnreported);
            }
        }
    }
    violations
}

/// [`check`] for a control-plane run, and at most one leader deciding at a time: every
/// step is granted by the coordinator that etcd names the leader at that simulated
/// instant, and the epochs of the steps granted, in simulated order, never go back. A later term's epochs
/// are above all of an earlier one's (`first_epoch`), so a grant in an older epoch after
/// one in a newer epoch is a deposed (or not yet deposed) leader deciding beside its
/// successor.
pub fn check_control(
    config: &JobConfig,
    outcome: &crate::ControlOutcome,
    reference: &str,
) -> Vec<Violation> {
    let mut violations = check(config, &outcome.outcome, reference);
    // A leader acting through an etcd outage (`cluster.train_through_etcd_outage`, under
    // 2PC) grants with its lease in doubt, and the servers' fences keep that safe; it
    // still never grants beside a leader whose lease etcd holds live.
    let through_outage = config.cluster.train_through_etcd_outage && config.two_phase_commit();
    if let Some(g) = outcome.grants.iter().find(|g| {
        if through_outage {
            g.beside_leader
        } else {
            !g.held_lease
        }
    }) {
        violations.push(Violation::GrantWithoutLease(*g));
    }
    let mut newest: Option<crate::Grant> = None;
    for &grant in &outcome.grants {
        match newest {
            Some(n) if grant.epoch < n.epoch => {
                violations.push(Violation::InterleavedLeaders {
                    newer: n,
                    older: grant,
                });
                break;
            }
            Some(n) if grant.epoch == n.epoch => {}
            _ => newest = Some(grant),
        }
    }
    violations
}
