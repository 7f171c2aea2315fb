//! What a recovery cost, counted under the lock once it went through: CPR's PLS of a
//! partial restore (Eq. 3), and the samples whose updates a lost shard no longer holds.

use ftrec_proto::timeline::EventKind;

use crate::Shared;
use crate::planner::RecoveryAction;
use crate::state::State;

/// Counts the PLS of a partial restore (CPR Eq. 3), one term per reloaded server, and
/// says each term's inputs in the event log so the figure can be checked from it.
pub(super) fn account_partial_restore(shared: &Shared, s: &mut State, action: &RecoveryAction) {
    let RecoveryAction::PartialRestore {
        servers,
        cuts,
        next_step,
        unsettled,
    } = action
    else {
        return;
    };
    let schedule = shared.schedule;
    // The updates every server had applied when the slot was lost: the granted steps
    // less those still in flight (granted again, so not lost).
    let in_flight: u64 = unsettled.iter().map(|&u| schedule.batch(u).1).sum();
    let s_i = schedule
        .samples_before(*next_step)
        .saturating_sub(in_flight);
    let own = s.cuts.own_saves.is_some();
    let Some(cpr) = s.cuts.cpr.as_mut() else {
        return;
    };
    let mut lines = Vec::new();
    // A resumed or moved layout's initial state is its base cut, not step 0.
    let base = s.scaling.first_step();
    for (&server, &cut) in servers.iter().zip(cuts) {
        let s_ckpt = schedule.samples_before(cut.unwrap_or(base));
        let increment = cpr.on_partial_restore(s_i, s_ckpt);
        lines.push(format!(
            "server {server} reloads its shard from {} (S_last_ckpt {s_ckpt} samples); \
             lost at S_i {s_i} samples; PLS += {increment:.6} -> {:.6}",
            match (cut, own) {
                (None, _) => "its initial state".to_string(),
                (Some(c), true) => format!("its own save of step {c}"),
                (Some(c), false) => format!("the cut of step {c}"),
            },
            cpr.pls()
        ));
    }
    let pls = cpr.pls();
    shared.metrics.set("ftrec_pls", pls);
    for line in lines {
        s.timeline.event(EventKind::PartialRestore, line);
    }
}

/// Counts the samples whose updates a lost shard no longer holds, summed over the shards:
/// under `none` everything a replaced shard had trained (it starts over from its initial
/// state), under partial recovery what it trained since the cut it reloads. Exact modes
/// lose nothing (a rollback retrains, counted in `steps_rolled_back`).
pub(super) fn account_lost_samples(shared: &Shared, s: &mut State, action: &RecoveryAction) {
    let schedule = shared.schedule;
    // A resumed or moved layout's initial state is its base cut: what a shard reset to it
    // loses was trained since.
    let base = s.scaling.first_step();
    let settled_before = |next_step: u64, unsettled: &[u64]| {
        let in_flight: u64 = unsettled.iter().map(|&u| schedule.batch(u).1).sum();
        schedule.samples_before(next_step).saturating_sub(in_flight)
    };
    let (per_shard, shards) = match action {
        RecoveryAction::KeepState {
            next_step,
            unsettled,
        } if shared.job.config.cluster.ft == ftrec_config::FaultTolerance::None => {
            let mut lost: Vec<usize> = s
                .recovery
                .failed
                .iter()
                .map(|&(server, _)| server)
                .collect();
            lost.sort_unstable();
            lost.dedup();
            let trained =
                settled_before(*next_step, unsettled).saturating_sub(schedule.samples_before(base));
            (trained, lost.len() as u64)
        }
        RecoveryAction::PartialRestore {
            cuts,
            next_step,
            unsettled,
            ..
        } => {
            let settled = settled_before(*next_step, unsettled);
            let lost: u64 = cuts
                .iter()
                .map(|cut| settled.saturating_sub(schedule.samples_before(cut.unwrap_or(base))))
                .sum();
            (lost, 1)
        }
        _ => return,
    };
    let lost = per_shard * shards;
    if lost > 0 {
        s.steps.lost_samples += lost;
        shared.metrics.add("ftrec_lost_samples_total", lost);
        s.timeline.event(
            EventKind::SamplesLost,
            format!("{shards} shard(s) lost the updates of {per_shard} samples each"),
        );
    }
}
