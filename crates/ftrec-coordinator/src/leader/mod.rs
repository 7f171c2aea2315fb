//! Leading with a standby (`cluster.membership = "etcd"`): the durable record a standby
//! needs (`durable.rs`), how a standby that won the election takes the job over
//! (`takeover.rs`), the spares an earlier leader gave slots through an etcd outage,
//! without a record (`spare_claims.rs`), and the background rebuilds that ended after the
//! record's last write (`finished_rebuilds.rs`); `behind_the_others`, the check both of
//! those last two make before a slot keeps its rows; `OutageClock`, how a wait for etcd
//! says so.

pub(crate) mod durable;
pub(crate) mod finished_rebuilds;
pub mod progress;
pub(crate) mod spare_claims;
pub(crate) mod takeover;

use std::time::Duration;

use ftrec_proto::proto::AppliedReply;

/// Of the fenced servers in `set`, those that applied fewer steps than the most any fenced
/// server outside it did, with their ends; and that most (None: every fenced server is
/// in `set`). A slot whose rows a takeover keeps without a rebuild (a spare's claim, a
/// rebuild that ended after the record's last write) must have applied every step the
/// others did, or it misses one they hold.
pub(crate) fn behind_the_others(
    fenced: &[usize],
    replies: &[AppliedReply],
    in_set: impl Fn(usize) -> bool,
) -> (Vec<(usize, u64)>, Option<u64>) {
    let others_end = fenced
        .iter()
        .zip(replies)
        .filter(|(i, _)| !in_set(**i))
        .map(|(_, r)| r.applied_end)
        .max();
    let behind = fenced
        .iter()
        .zip(replies)
        .filter(|(i, r)| in_set(**i) && others_end.is_some_and(|end| r.applied_end < end))
        .map(|(&i, r)| (i, r.applied_end))
        .collect();
    (behind, others_end)
}

/// How often a wait for an etcd that does not answer says so.
const OUTAGE_REPORT: Duration = Duration::from_secs(60);

/// A wait for etcd that repeats a call: says so on the first failure, then once a minute,
/// so an operator sees a stuck control plane without a line per attempt.
pub(crate) struct OutageClock {
    started: tokio::time::Instant,
    next_report: Duration,
}

impl OutageClock {
    pub(crate) fn start() -> Self {
        Self {
            started: tokio::time::Instant::now(),
            next_report: Duration::ZERO,
        }
    }

    /// The seconds waited so far when a report is due, else None.
    pub(crate) fn report_due(&mut self) -> Option<f64> {
        let waited = self.started.elapsed();
        (waited >= self.next_report).then(|| {
            self.next_report = waited + OUTAGE_REPORT;
            waited.as_secs_f64()
        })
    }
}
