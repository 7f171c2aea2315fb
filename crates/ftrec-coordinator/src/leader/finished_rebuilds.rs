//! Background rebuilds that ended after the record's last write. A leader acting through
//! an etcd outage writes the record with a slot rebuilding; the write waits in the frozen
//! etcd's socket, the rebuild ends, the leader dies, and etcd, thawed, applies the write.
//! The next leader reads the slot as rebuilding and used to rebuild it again from the
//! survivors: a second window with the group's redundancy down, where the slot's process
//! held every row all along (issue 44's test of a spare given a slot in an outage, about
//! one CI run in twenty). So the takeover asks: a slot whose process says its rows are all
//! there is fenced with the other servers and keeps them, if it applied every step they
//! did; otherwise its rebuild starts again, as before.

use std::sync::Arc;

use ftrec_proto::proto::{AppliedReply, FenceRequest};
use ftrec_proto::timeline::{EventKind, Subject};
use ftrec_rpc::PsError;
use ftrec_rpc::client::ServerClient;

use crate::Shared;
use crate::state::State;

/// Asks the processes of the record's rebuilding slots (once per takeover) whether their
/// rebuild ended. Those that say so leave the recovery and join `clients`, the servers the
/// takeover fences; returns their slots. A process that does not answer stays in the
/// recovery, whose rebuild starts again.
pub(crate) async fn ask(
    shared: &Arc<Shared>,
    epoch: u64,
    clients: &mut Vec<(usize, ServerClient)>,
) -> Result<Vec<usize>, PsError> {
    let connector = shared.job.connector_for(shared.job.deadlines().control)?;
    let asked = {
        let mut s = shared.lock();
        let slots = std::mem::take(&mut s.recovery.rebuilds_to_ask);
        slots
            .into_iter()
            .filter_map(|id| {
                let m = s.members.servers.get(id)?;
                (m.alive && !m.address.is_empty()).then(|| Ok((id, connector.server(&m.address)?)))
            })
            .collect::<Result<Vec<_>, PsError>>()?
    };
    let calls = asked.into_iter().map(|(id, mut client)| async move {
        let reply = client
            .fence(FenceRequest {
                epoch,
                steps: Vec::new(),
            })
            .await;
        let ended = reply.is_ok_and(|r| !r.into_inner().rebuild_unfinished);
        ended.then_some((id, client))
    });
    let ended: Vec<(usize, ServerClient)> = futures::future::join_all(calls)
        .await
        .into_iter()
        .flatten()
        .collect();
    let mut s = shared.lock();
    let kept: Vec<usize> = ended.iter().map(|(id, _)| *id).collect();
    s.recovery.failed.retain(|(f, _)| !kept.contains(f));
    clients.extend(ended);
    clients.sort_by_key(|(id, _)| *id);
    Ok(kept)
}

/// After the takeover's last fence: a kept slot counts only if it applied every step the
/// other servers did (under 2PC a rebuilt slot takes part in each step, so one behind was
/// rebuilt again meanwhile, or its rebuild did not end where it says). One behind goes
/// back to the recovery, and the takeover is tried again without it.
pub(crate) fn vet(
    s: &mut State,
    kept: &[usize],
    fenced: &[usize],
    replies: &[AppliedReply],
) -> Result<(), PsError> {
    if kept.is_empty() {
        return Ok(());
    }
    let (behind, others_end) = super::behind_the_others(fenced, replies, |i| kept.contains(&i));
    let now = s.timeline.now();
    for &(id, end) in &behind {
        s.recovery.failed.push((id, now));
        s.timeline.event_about(
            EventKind::Coordinator,
            Subject::Server(id as u32),
            None,
            format!(
                "server {id} says its background rebuild ended, but it applied steps up \
                 to {end} only, the others up to {}: it is rebuilt again",
                others_end.unwrap_or_default()
            ),
        );
    }
    for &id in fenced
        .iter()
        .filter(|i| kept.contains(i) && !behind.iter().any(|(b, _)| b == *i))
    {
        s.timeline.event_about(
            EventKind::RebuildEnd,
            Subject::Server(id as u32),
            None,
            format!(
                "server {id}: its background rebuild ended under an earlier leader, \
                 after the record's last write; it keeps its rows; full redundancy \
                 restored"
            ),
        );
    }
    if behind.is_empty() {
        return Ok(());
    }
    Err(PsError::Superseded(format!(
        "slots whose rebuild had ended are behind the other servers: {behind:?}"
    )))
}
