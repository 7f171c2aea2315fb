//! Spares on survivors' hosts (issue 42, hole 8): the decisions that span the state's
//! groups. A lost server slot gets a waiting spare as soon as one is there; once it has
//! waited `cluster.survivor_spare_after_s` with none, a live server is asked to start one
//! beside itself, and the job trains on with that host holding two shards instead of
//! standing still. In erasure-coded jobs the slot then moves to the first spare that
//! joins from elsewhere: that is a recovery like any other, rebuilt exactly from the
//! survivors. In the checkpoint modes the slot stays where it is: moving it would roll it
//! back to its last cut.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

use crate::Shared;
use crate::state::{Phase, State};
use ftrec_proto::proto::{HeartbeatReply, HeartbeatRequest, Role};
use ftrec_proto::timeline::EventKind;

/// While a recovery waits: gives each slot without a process a waiting spare, else, past
/// the delay, asks a live server to start one on its host.
pub(crate) fn fill_lost_slots(shared: &Shared, s: &mut State, now: Instant) {
    // A coordinator whose lease is not surely its own gives no slot and asks for no
    // process: a newer leader may be deciding about the same slots.
    if !shared.may_decide() {
        return;
    }
    for id in lost_slots(s) {
        crate::control::give_spare(s, id, now);
    }
    let lost = lost_slots(s);
    let c = &shared.job.config.cluster;
    // A `--spawn` coordinator starts replacements itself.
    let enabled = c.survivor_spares && shared.spawner.is_none();
    let after = Duration::from_secs(c.survivor_spare_after_s);
    if !s
        .members
        .hosting
        .due(now, enabled && !lost.is_empty(), after)
    {
        return;
    }
    // A server that hosts a slot already carries two shards, and a hosted slot runs on
    // such a host: ask another.
    let busy_hosts: BTreeSet<usize> = hosted_slots(s)
        .into_iter()
        .flat_map(|(slot, host)| [slot, host])
        .collect();
    let candidates: Vec<usize> = s
        .members
        .servers
        .iter()
        .enumerate()
        .filter(|(j, m)| m.joined && m.alive && m.ready && !busy_hosts.contains(j))
        .map(|(j, _)| j)
        .collect();
    let Some(server) = s.members.hosting.pick(&candidates) else {
        return;
    };
    s.members.hosting.asked_of(server, now);
    let waited = s
        .members
        .hosting
        .waiting_since
        .map_or(0.0, |t| now.duration_since(t).as_secs_f64());
    let slots: Vec<String> = lost.iter().map(|id| id.to_string()).collect();
    let text = format!(
        "server slot(s) {} waited {waited:.0} s with no replacement: server {server} is asked \
         to start a spare on its host (until a replacement joins elsewhere, that host holds \
         two shards, and its loss costs both)",
        slots.join(", ")
    );
    tracing::warn!("{text}");
    s.timeline.event(EventKind::Replacement, text);
}

/// Slots held by a process that a live server started on its host, with that server:
/// `(slot, host)`.
fn hosted_slots(s: &State) -> Vec<(usize, usize)> {
    s.members
        .spares
        .iter()
        .filter_map(|sp| {
            let (slot, host) = (sp.assigned?, sp.hosted_by?);
            let m = s.members.servers.get(slot)?;
            (m.alive && m.incarnation == sp.member.incarnation).then_some((slot, host))
        })
        .collect()
}

/// Server slots whose process was declared dead and that none holds yet.
fn lost_slots(s: &State) -> Vec<usize> {
    s.members
        .servers
        .iter()
        .enumerate()
        .filter(|(_, m)| !m.alive)
        .map(|(id, _)| id)
        .collect()
}

/// In a running erasure-coded job with every server ready and no rebuild under way:
/// moves a slot held by a process on a survivor's host to a spare that joined from
/// elsewhere. True when it did (the job is then recovering).
pub(crate) fn hand_over(shared: &Shared, s: &mut State) -> bool {
    let now = Instant::now();
    // A move we choose waits for a quiet moment, and for a coordinator that may decide:
    // no rebuild, recovery, suspicion, cut or step to resolve under way, training not
    // over. A second loss during the move's rebuild would cost the group two servers.
    let quiet = s.recovery.rebuilding.is_empty()
        && s.recovery.failed.is_empty()
        && !s.recovery.suspecting(now)
        && s.saves.pending().is_none()
        && s.steps.ledger.orphans().is_empty()
        && !s.steps.ledger.done()
        && s.members.servers_ready();
    if !shared.job.config.cluster.ft.erasure_coded() || !quiet || !shared.may_decide() {
        return false;
    }
    // A spare that waits is heard only through its heartbeats: one silent past the
    // failure timeout may be gone, and moving the slot to it would cost a recovery.
    let timeout = Duration::from_millis(shared.job.config.cluster.failure_timeout_ms);
    let Some(free) = s.members.spares.iter().find(|sp| {
        sp.assigned.is_none()
            && sp.member.alive
            && sp.hosted_by.is_none()
            && sp.member.silent_for() < timeout
    }) else {
        return false;
    };
    let (token, address) = (free.token, free.member.address.clone());
    let Some((slot, host)) = hosted_slots(s).first().copied() else {
        return false;
    };
    let incarnation = s.members.servers[slot].incarnation;
    s.members.hosting.handed_over.insert(incarnation);
    let why = format!(
        "moves to spare {token} at {address}: it ran on server {host}'s host while no \
         replacement came"
    );
    crate::control::server_failed(shared, s, slot, &why);
    true
}

/// A heartbeat answered `stop` before the usual checks: a hosted process whose slot moved
/// to a spare from elsewhere, and a spare on a survivor's host that no lost slot needs
/// any more (a spare from elsewhere came first). Neither is a zombie.
pub(crate) fn beat_of_a_moved_or_unwanted_host(
    s: &mut State,
    req: &HeartbeatRequest,
) -> Option<HeartbeatReply> {
    if req.role() != Role::Server {
        return None;
    }
    let stop = HeartbeatReply {
        epoch: s.epoch,
        stop: true,
        ..Default::default()
    };
    if !req.spare {
        return (req.incarnation != 0 && s.members.hosting.handed_over.contains(&req.incarnation))
            .then_some(stop);
    }
    // Unneeded only once every slot serves: a replacement still building may fail, and
    // its slot would then need this spare.
    if !s.steps.started || s.phase != Phase::Running || !s.members.servers_ready() {
        return None;
    }
    let spare = s
        .members
        .spares
        .iter_mut()
        .find(|sp| sp.token == req.id && sp.assigned.is_none() && sp.member.alive)?;
    let host = spare.hosted_by?;
    spare.member.alive = false;
    let text = format!(
        "spare {} on server {host}'s host is not needed (every slot has a process): told to \
         exit",
        spare.token
    );
    s.timeline.event(EventKind::Replacement, text);
    Some(stop)
}
