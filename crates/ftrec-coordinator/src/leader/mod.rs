//! Leading with a standby (`cluster.membership = "etcd"`): the durable record a standby
//! needs (`durable.rs`), how a standby that won the election takes the job over
//! (`takeover.rs`), and the spares an earlier leader gave slots through an etcd outage,
//! without a record (`spare_claims.rs`); `OutageClock`, how a wait for etcd says so.

pub(crate) mod durable;
pub(crate) mod finished_rebuilds;
pub mod progress;
pub(crate) mod spare_claims;
pub(crate) mod takeover;

use std::time::Duration;

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
