//! Spares that an earlier leader gave a slot without a record. A leader acting through an
//! etcd outage (`cluster.train_through_etcd_outage`) gives a dead server's slot to a
//! waiting spare, and the spare rebuilds it, while etcd records nothing. The leader that
//! takes over when etcd returns reads that spare as free in the record. Given to another
//! slot, it crossed two slots' processes (a soak's quorum loss did: two spares fenced, two
//! more rebuilds, 7 s without training); fenced as a stranger, it took its live shard
//! with it. So a free spare of the record gets no slot until it is heard: as a spare, it
//! is free; as a server, it claims that slot, and gets it back once the slot's old process
//! is declared dead.

use tonic::Status;

use tokio::time::Instant;

use crate::state::State;
use ftrec_proto::timeline::{EventKind, Subject};

/// A server's heartbeat for slot `id` from `incarnation`, which the slot's member is not:
/// when that is a free spare's token, and no other process was given the slot since, the
/// spare serves it by an earlier leader's unrecorded assignment. Heard within
/// `claims_until` of a takeover, its claim is noted and
/// the beat is answered `unavailable`, which a server retries, until the slot is given
/// back to it (`Membership::assign_spare` prefers it). `Ok` leaves the beat to the usual
/// checks (a stranger is fenced there).
pub(crate) fn claim_of_an_unrecorded_spare(
    s: &mut State,
    id: usize,
    incarnation: u64,
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
    // The slot went to another spare since: this one's claim is stale.
    if s.members.spares.iter().any(|sp| sp.assigned == Some(id)) {
        return Ok(());
    }
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
    spare.member.last_seen = Some(Instant::now());
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
