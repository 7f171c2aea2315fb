//! `ftrec cluster scale`: the job moves to another server count while its coordinator and
//! workers go on. The move goes through a consistent cut (see `state/scaling.rs`):
//!
//! 1. asked for ([`ask`]): checked, and remembered;
//! 2. at the next step boundary where a cut may start ([`take_cut`]), fresh grants stop
//!    and the cut is taken (or the cut of that very step, committed already, is used);
//! 3. once every server committed its part, the switch ([`switch`]), one decision under
//!    the lock: a new epoch, the old servers retired (told to stop), the new layout's
//!    slots opened and its servers started; each loads its rows from the cut, placed by the
//!    new layout (parity and replicas derived as it loads), as a resumed job's servers do;
//! 4. every new server in: training goes on at the cut's step ([`trained_again`]).
//!
//! Until the cut commits, a failure leaves the job on its old layout (the move's cut is
//! lost with the epoch, and taken again later); after the switch, a failure is a failure
//! of the new layout, recovered there, its initial state being the cut.

use tokio::time::Instant;

use crate::Shared;
use crate::state::{PendingMove, Phase, State};
use ftrec_proto::placement::PlacementMap;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::PsError;

/// Checks a move to `servers` and remembers it; returns the server count and step it
/// moves from (the step is where its cut goes at the earliest).
pub(crate) fn ask(shared: &Shared, s: &mut State, servers: usize) -> Result<(usize, u64), PsError> {
    let c = &shared.job.config;
    let refuse = |why: String| {
        Err(PsError::BadRequest(format!(
            "scale to {servers} servers: {why}"
        )))
    };
    if !c.cluster.ft.checkpoints() || c.checkpoint.dir.is_none() {
        return refuse(format!(
            "a move goes through a consistent cut, and --ft {} writes none (use checkpoint, \
             partial or ec+checkpoint, with checkpoint.dir)",
            c.cluster.ft.name()
        ));
    }
    if c.cpr.uncoordinated {
        return refuse(
            "cpr.uncoordinated saves each server on its own schedule, with no cut to move \
             through"
                .into(),
        );
    }
    shared.job.layout_for(servers)?;
    if servers == s.scaling.servers {
        return refuse(format!("the job runs on {servers} servers already"));
    }
    if let Some(m) = &s.scaling.pending {
        return refuse(format!("a move to {} servers is under way", m.to));
    }
    if s.stopping || s.phase == Phase::Done || s.steps.ledger.next_step() >= s.steps.ledger.total()
    {
        return refuse("the job has no step left to train".into());
    }
    let from = (s.scaling.servers, s.steps.ledger.next_step());
    let asked_at = s.timeline.event(
        EventKind::ScaleAsked,
        format!(
            "from {} to {servers} servers, through a cut at step {} or later",
            from.0, from.1
        ),
    );
    s.scaling.pending = Some(PendingMove {
        to: servers,
        asked_at,
        cut: None,
        committed: false,
    });
    Ok(from)
}

/// At a grant: a pending move takes its cut at this step boundary if a cut may start
/// now. True while the move holds fresh steps back (its cut taken and not yet switched
/// to, or an earlier cut still committing ahead of it).
pub(crate) fn take_cut(s: &mut State) -> bool {
    let next = s.steps.ledger.next_step();
    let now = Instant::now();
    let Some(m) = s.scaling.pending.as_ref() else {
        return false;
    };
    if m.cut.is_some() {
        return true;
    }
    if next >= s.steps.ledger.total() {
        s.scaling.pending = None;
        s.timeline.event(
            EventKind::ScaleDropped,
            "the job trained its last step before the move's cut could be taken".to_string(),
        );
        return false;
    }
    // A cut still committing in the background: fresh steps wait for it (a short wait),
    // so the move goes through at this very step.
    if s.saves.pending().is_some() {
        return true;
    }
    // A slot rebuilding in the background, or a failed cut's backoff: training goes on,
    // and the move waits for a later boundary.
    if !s.recovery.rebuilding.is_empty() || s.cuts.backing_off(now) {
        return false;
    }
    let committed_here = s.saves.last_checkpoint == Some(next);
    if !committed_here && s.saves.last_save == Some(next) {
        // A save of another kind took this step: the move's cut goes at a later one.
        return false;
    }
    let at = s.timeline.now();
    let Some(m) = s.scaling.pending.as_mut() else {
        return false;
    };
    m.cut = Some(next);
    m.committed = committed_here;
    s.scaling.paused_at = Some(at);
    if !committed_here {
        s.phase = Phase::Checkpointing;
        s.cuts.pause(false, now);
    }
    true
}

/// The control loop's check: the pending move's cut was lost (a recovery took the epoch,
/// or it failed) unless it is still being taken, committing, or committed.
pub(crate) fn forget_lost_cut(s: &mut State) {
    let Some(cut) = s
        .scaling
        .pending
        .as_ref()
        .filter(|m| !m.committed)
        .and_then(|m| m.cut)
    else {
        return;
    };
    let taking = s.phase == Phase::Checkpointing;
    let committing = s.saves.pending().is_some_and(|p| p.step == cut);
    if !taking && !committing {
        s.scaling.cut_lost(cut);
        s.timeline.event(
            EventKind::ScaleAsked,
            format!("the move's cut at step {cut} did not commit: taken again at a later step"),
        );
    }
}

/// The move's cut committed and nothing is in flight: the switch is due.
pub(crate) fn switch_due(s: &State) -> bool {
    s.scaling.pending.as_ref().is_some_and(|m| m.committed) && s.steps.ledger.quiet()
}

/// The switch as a task of the control loop. With etcd membership the decision (the move
/// and its committed cut) is recorded before anything changes, and the switch after: a
/// leader lost at any moment leaves its successor the move to make, or the layout made.
pub(crate) async fn switch_recorded(shared: &Shared, epoch: u64) {
    if let Err(e) = shared.sync_durable().await {
        tracing::warn!("the move's switch waits for etcd: {e}");
        return;
    }
    shared.die_at(ftrec_faults::points::SWITCH).await;
    {
        let mut s = shared.lock();
        if s.epoch != epoch || !switch(shared, &mut s) {
            return;
        }
    }
    if let Err(e) = shared.sync_durable().await {
        tracing::warn!("recording the move's switch: {e}; the flush loop retries");
    }
}

/// The switch, once the move's cut committed: one decision under the lock. True when it
/// happened.
pub(crate) fn switch(shared: &Shared, s: &mut State) -> bool {
    if !switch_due(s) {
        return false;
    }
    let Some(location) = shared.job.config.checkpoint.dir.as_ref() else {
        return false;
    };
    let location = location.to_string_lossy().trim_end_matches('/').to_string();
    let from = s.scaling.servers;
    let now = s.timeline.now();
    if s.scaling.switch(location, now).is_none() {
        return false;
    }
    let to = s.scaling.servers;
    let step = s.scaling.first_step();
    s.epoch += 1;
    shared.epoch_moved(s.epoch);
    shared.metrics.set("ftrec_epoch", s.epoch as f64);
    s.members.retire_servers(to);
    let version = s.placement.version + 1;
    s.placement = match s.layout(&shared.job) {
        Ok(layout) => PlacementMap {
            version,
            ..PlacementMap::new(&layout)
        },
        // Checked when the move was asked for; the same arithmetic cannot fail now.
        Err(e) => {
            shared.fail_run(s, format!("the move to {to} servers: {e}"));
            return true;
        }
    };
    // The new servers' initial state is the cut itself: a rollback before their first cut
    // of their own goes back to it (`Scaling::base`), never to a cut of the old layout.
    s.saves.last_checkpoint = None;
    s.phase = Phase::Starting;
    s.timeline.event(
        EventKind::ScaleSwitched,
        format!(
            "from {from} to {to} servers through the cut at step {step}; epoch {}; the old \
             servers stop, the new ones load their rows from the cut",
            s.epoch
        ),
    );
    start_servers(shared, s, to);
    true
}

/// Starts the new layout's servers. Never a waiting spare: a spare given a slot rebuilds it
/// from its group under erasure coding, and these slots have no survivors yet.
fn start_servers(shared: &Shared, s: &mut State, servers: usize) {
    let Some(spawner) = shared.spawner.clone() else {
        s.timeline.event(
            EventKind::Replacement,
            format!(
                "waiting for the new layout's servers: `ftrec server --id J` for J in 0..{servers}"
            ),
        );
        return;
    };
    for id in 0..servers {
        let (kind, detail) = match spawner.spawn_server(id, &shared.address) {
            Ok(()) => (EventKind::Replacement, format!("spawned a new server {id}")),
            Err(e) => (EventKind::ReplacementFailed, format!("server {id}: {e}")),
        };
        s.timeline.event(kind, detail);
    }
}

/// Every server of the new layout is in: training goes on, and the move's pause is said.
pub(crate) fn trained_again(s: &mut State) -> bool {
    let now = s.timeline.now();
    let Some(m) = s.scaling.trained_again(now).cloned() else {
        return false;
    };
    s.phase = Phase::Running;
    s.timeline.event(
        EventKind::ScaleEnd,
        format!(
            "training goes on at step {} on {} servers (moved from {}; paused {:.3} s)",
            m.step,
            m.to_servers,
            m.from_servers,
            m.pause_seconds.unwrap_or(0.0)
        ),
    );
    true
}
