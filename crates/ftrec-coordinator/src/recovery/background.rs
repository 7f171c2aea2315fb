//! A replacement that serves while it rebuilds in the background (2PC), followed to the
//! end of its rebuild.

use std::sync::Arc;
use std::time::Duration;

use ftrec_proto::proto::*;
use ftrec_proto::timeline::{EventKind, Subject};
use ftrec_rpc::PsError;

use super::calls::{RebuildStream, report_progress};
use crate::Shared;
use crate::state::Phase;

pub(super) fn rebuild_end_event(server: usize, r: &RebuildReply) -> String {
    format!(
        "server {server}: {} rows, {} bytes in {:.3} s ({:.0} MB/s); full redundancy restored",
        r.rows,
        r.bytes,
        r.seconds,
        r.bytes as f64 / r.seconds.max(1e-9) / 1e6
    )
}

/// Follows a background rebuild to its end: progress events, then the `rebuild-end`
/// event and the recovery's rebuild figures, and the server leaves `rebuilding`. A rebuild
/// that fails on a server still alive ends the run with the cause (it would never end);
/// one whose server died is the failure detector's. A server silent past the streams'
/// progress deadline (frozen, its link down) counts as a failed rebuild: without the
/// deadline it held every cut and the end of the run.
pub(super) async fn follow_background(
    shared: Arc<Shared>,
    server: usize,
    epoch: u64,
    mut stream: RebuildStream,
) {
    let mut quarter = 0;
    let failure = loop {
        match stream.message().await {
            Ok(Some(reply)) if reply.done => {
                shared.die_at(ftrec_faults::points::REBUILD_ENDED).await;
                let mut s = shared.lock();
                if !s.recovery.rebuild_ended(server, epoch) {
                    return;
                }
                let now = s.timeline.event_about(
                    EventKind::RebuildEnd,
                    Subject::Server(server as u32),
                    None,
                    rebuild_end_event(server, &reply),
                );
                let next_step = s.steps.ledger.next_step();
                let unsettled = s.steps.ledger.unsettled();
                for r in s
                    .recovery
                    .recoveries
                    .iter_mut()
                    .filter(|r| r.server == server && r.epoch == epoch)
                {
                    r.rebuild_seconds = reply.seconds;
                    r.rebuild_bytes = reply.bytes;
                    r.degraded_seconds = now - r.detected_at;
                    r.steps_while_degraded = next_step.saturating_sub(r.resumed_step);
                    let in_flight = unsettled.iter().filter(|&&u| u >= r.resumed_step).count();
                    r.steps_committed_while_degraded =
                        r.steps_while_degraded.saturating_sub(in_flight as u64);
                }
                return;
            }
            Ok(Some(reply)) => report_progress(&shared, server, &reply, &mut quarter),
            Ok(None) => break "the stream ended without its totals".to_string(),
            Err(status) => match PsError::rpc(format!("server {server}'s rebuild"), &status) {
                // A rebuild superseded by a rollback or a newer rebuild is no failure.
                PsError::Superseded(_) => return,
                e => break e.to_string(),
            },
        }
    };
    // The stream broke: the replacement may be dead (SIGKILLed mid-rebuild). Every
    // server's port is probed, as after a worker's lost step, so a refused one is declared
    // at once: its silence alone took the failure timeout, with no step committed
    // meanwhile (the shoot-out's strike during a rebuild, issue 45).
    shared.lock().members.probe_requested = true;
    // Give the failure detector time to tell a dead server from a failed rebuild.
    let wait = Duration::from_millis(shared.job.config.cluster.failure_timeout_ms * 2);
    // A recovery under way decides the slot's fate (a rollback clears `rebuilding`).
    let mut s = loop {
        tokio::time::sleep(wait).await;
        let s = shared.lock();
        if s.phase != Phase::Recovering {
            break s;
        }
    };
    if s.recovery.rebuilding.contains(&(server, epoch)) {
        let why = format!("server {server}'s background rebuild failed: {failure}");
        shared.fail_run(&mut s, why);
    }
}
