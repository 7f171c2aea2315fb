//! Spares that an earlier leader gave a slot without a record. A leader acting through an
//! etcd outage (`cluster.train_through_etcd_outage`) gives a dead server's slot to a
//! waiting spare, and the spare rebuilds it, while etcd records nothing. The leader that
//! takes over when etcd returns reads that spare as free in the record. Given to another
//! slot, it crossed two slots' processes (a soak's quorum loss did: two spares fenced, two
//! more rebuilds, 7 s without training); fenced as a stranger, it took its live shard
//! with it. So a free spare of the record gets no slot until it is heard: as a spare, it
//! is free; as a server, it claims that slot.
//!
//! A claim heard while the takeover has not yet fenced the servers installs the claimer
//! in its slot with the shard it holds, and the record's process of the slot (which the
//! earlier leader declared dead before it gave the slot away) is fenced. Given the slot
//! back only once that process was declared dead, as a spare with no shard, it had to be
//! rebuilt from its group: a soak lost three servers of a group at once that way (the
//! claimer, fenced as superseded, and two others frozen and silent), and with them the
//! model, where keeping the claimer's shard leaves two of four, enough for `r = 2`.
//!
//! A spare that *joined* through the outage is not in the record at all. Its incarnation
//! is one the earlier leader handed out past the record's count, which no later leader
//! hands out again (`takeover.rs` skips them), so a slot's process with such an
//! incarnation was let in by this job's own leader: it is adopted as a free spare of the
//! record from what its heartbeat says (its address and pid), and claims like one.
//! Fenced as a stranger instead, its slot was rebuilt again.

use tokio::time::Instant;
use tonic::Status;

use crate::state::{Member, Spare, State};
use ftrec_proto::proto::AppliedReply;
use ftrec_proto::timeline::{EventKind, Subject};
use ftrec_rpc::PsError;

/// A server's heartbeat for slot `id` from `incarnation`, which the slot's member is not:
/// when that is a free spare's token, and the slot's process is still the record's, the
/// spare serves it by an earlier leader's unrecorded assignment. Heard within
/// `claims_until` of a takeover that has not yet fenced the servers, the claimer takes the
/// slot with its shard (`Ok`: the beat goes on as the slot's). Heard later, its claim is
/// noted and the beat is answered `unavailable`, which a server retries, until the slot is
/// given back to it (`Membership::assign_spare` prefers it). A process that joined
/// unrecorded (its incarnation past the record's count) is first adopted as such a spare,
/// at `address` with `pid`. `Ok` otherwise leaves the beat to the usual checks (a stranger
/// is fenced there).
pub(crate) fn claim_of_an_unrecorded_spare(
    s: &mut State,
    id: usize,
    incarnation: u64,
    ready: bool,
    (address, pid): (&str, u32),
) -> Result<(), Status> {
    let Some(slot) = s.members.servers.get(id) else {
        return Ok(());
    };
    if incarnation == 0 || slot.incarnation == incarnation {
        return Ok(());
    }
    // Claims are heard for a while after a takeover only: a claimer whose slot went
    // elsewhere meanwhile (a process that joined it) would otherwise wait forever.
    if s.members.claims_until.is_none_or(|t| Instant::now() >= t) {
        return Ok(());
    }
    // This leader gave the slot to another process since: the claim is stale. (The
    // record's holder of the slot, a spare listed as assigned to it, is not "another".)
    if s.members.recorded_incarnations.get(id) != Some(&slot.incarnation) {
        return Ok(());
    }
    let now = Instant::now();
    let installable = s.members.takeover_fencing
        && slot.alive
        && !s.recovery.failed.iter().any(|(f, _)| *f == id);
    adopt_an_unrecorded_joiner(s, incarnation, (address, pid), now);
    let Some(spare) = s
        .members
        .spares
        .iter_mut()
        .find(|sp| u64::from(sp.token) == incarnation && sp.assigned.is_none())
    else {
        return Ok(());
    };
    let token = spare.token;
    spare.unheard = false;
    spare.member.last_seen = Some(now);
    if installable {
        spare.assigned = Some(id);
        spare.claims = None;
        // As `Membership::assign_spare` gives a slot, but serving already, with its shard.
        let member = Member {
            joined: true,
            alive: true,
            ready,
            last_seen: Some(now),
            refused: false,
            incarnation,
            cut_off: None,
            ..spare.member.clone()
        };
        let address = member.address.clone();
        let old = std::mem::replace(&mut s.members.servers[id], member);
        if old.incarnation != 0 {
            s.members.zombies.insert(old.incarnation);
        }
        s.members.claimed.insert(id);
        s.recovery.unrecorded_kept.push(id);
        s.placement.assign(id, address.clone());
        s.timeline.event_about(
            EventKind::Replacement,
            Subject::Server(id as u32),
            None,
            format!(
                "spare {token} at {address} serves server {id} by an earlier leader's \
                 unrecorded assignment: it keeps the slot and its shard (the record's \
                 process {} of the slot is fenced)",
                old.incarnation
            ),
        );
        return Ok(());
    }
    if spare.claims.replace(id) != Some(id) {
        s.timeline.event_about(
            EventKind::Replacement,
            Subject::Server(id as u32),
            None,
            format!(
                "spare {token} serves server {id} by an earlier leader's unrecorded \
                 assignment: the slot goes back to it once its old process is declared dead"
            ),
        );
    }
    Err(Status::unavailable(format!(
        "server {id}: this process (spare {token}) holds the slot by an earlier leader's \
         unrecorded assignment, and gets it back once the slot's old process is declared dead"
    )))
}

/// A process whose incarnation no spare of the record has, but which an earlier leader
/// handed out past the record's count: listed as a free spare of the record, heard now.
/// In a slot, its claim then goes on as such a spare's; still waiting, it is a spare the
/// next lost slot can have. Nothing without an address to reach it by.
pub(crate) fn adopt_an_unrecorded_joiner(
    s: &mut State,
    incarnation: u64,
    (address, pid): (&str, u32),
    now: Instant,
) {
    let unrecorded = s
        .members
        .unrecorded_incarnations
        .as_ref()
        .is_some_and(|r| r.contains(&incarnation));
    let Ok(token) = u32::try_from(incarnation) else {
        return;
    };
    if !unrecorded
        || address.is_empty()
        || s.members.spares.iter().any(|sp| sp.token == token)
        || s.members
            .servers
            .iter()
            .any(|m| m.incarnation == incarnation)
        || s.members.zombies.contains(&incarnation)
    {
        return;
    }
    s.members.spares.push(Spare {
        token,
        member: Member {
            address: address.to_string(),
            pid,
            joined: true,
            alive: true,
            ready: false,
            last_seen: Some(now),
            refused: false,
            incarnation,
            cut_off: None,
        },
        assigned: None,
        hosted_by: None,
        unheard: false,
        claims: None,
        waiting_peak_rss: 0,
    });
    s.timeline.event(
        EventKind::Replacement,
        format!(
            "process {incarnation} at {address} (pid {pid}) joined through an etcd outage, \
             unrecorded: adopted as spare {token}"
        ),
    );
}

/// The takeover's last fence reached every live server: a claimer installed meanwhile
/// counts only if it was among them and applied every step the others did. Under 2PC a
/// step committed anywhere was prepared by every member of its epoch, and the takeover
/// finished it where it was prepared; a claimer that lacks one was no member then (an
/// earlier leader declared it dead in turn, and gave the slot to yet another spare). It
/// is then declared dead at the next tick (its slot rebuilt), and the takeover is tried
/// again.
pub(crate) fn vet_claimers(
    s: &mut State,
    fenced: &[usize],
    replies: &[AppliedReply],
) -> Result<(), PsError> {
    if s.members.claimed.is_empty() {
        return Ok(());
    }
    if let Some(late) = s.members.claimed.iter().find(|id| !fenced.contains(id)) {
        return Err(PsError::Superseded(format!(
            "server {late} was claimed by a spare after the takeover's fences went out"
        )));
    }
    let claimed = &s.members.claimed;
    let (behind, others_end) = super::behind_the_others(fenced, replies, |i| claimed.contains(&i));
    if behind.is_empty() {
        s.members.claimed.clear();
        return Ok(());
    }
    for &(id, end) in &behind {
        s.members.servers[id].refused = true;
        s.members.claimed.remove(&id);
        // Its slot is recovered again, by this leader and on its record.
        if let Some(at) = s.recovery.unrecorded_kept.iter().rposition(|&k| k == id) {
            s.recovery.unrecorded_kept.remove(at);
        }
        s.timeline.event_about(
            EventKind::Replacement,
            Subject::Server(id as u32),
            None,
            format!(
                "server {id}'s claimer applied steps up to {end} only, the others up to {}: \
                 an earlier leader replaced it too; it is declared dead",
                others_end.unwrap_or_default()
            ),
        );
    }
    Err(PsError::Superseded(format!(
        "claimers behind the other servers: {behind:?}"
    )))
}
