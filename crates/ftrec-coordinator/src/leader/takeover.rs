//! A standby that won the election leads a job another coordinator started: its view
//! comes from the durable record, and the steps after the record's flush from the servers.
//!
//! The new leader's epoch is above every epoch of the old one (it starts from its term,
//! see [`first_epoch`]), so once every server has adopted it, nothing the old leader or a
//! worker holding its grants sends changes a shard. Under 2PC the servers first raise
//! their fence and report what they applied, so a step some server committed is finished
//! everywhere it is prepared (as a recovery does). Then every step from the first one some
//! server lacks to one past the newest any server applied is an orphan of the new epoch:
//! the ordinary orphan resolution asks the servers about each, and settles, grants again
//! or rolls back. No step is skipped and none is applied twice, so `lost_samples` stays 0.

use std::sync::Arc;
use std::time::Duration;

use ftrec_proto::proto::*;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::PsError;
use ftrec_rpc::client::ServerClient;
use ftrec_rpc::job::Job;

use crate::ledger::StepLedger;
use crate::state::Phase;
use crate::summary::Failover;
use crate::{Shared, control, durable};

/// A term's first epoch. Epochs within a term count up from it; a later leader's term is
/// a larger etcd revision, so its epochs are above all of this one's (for fewer than 2^20
/// epoch changes per term).
pub(crate) fn first_epoch(term: u64) -> u64 {
    (term << 20) + 1
}

/// The least a new leader gives the record's free spares to say which slot, if any, they
/// serve by its predecessor's unrecorded assignment: members follow the leader key every
/// 200 ms, and beat at once when it changes. It gives them the members' grace after a
/// takeover if that is longer (a member whose read of the leader key hung on an etcd
/// member just thawed hears late; with its test's processes beside four others, a
/// claimer heard after 1.5 s found its slot declared and was rebuilt). The wait ends
/// early once every such spare was heard.
const CLAIMS_WAIT: Duration = Duration::from_millis(1500);

/// Incarnations a leader skips after the record's count when it takes over: more than an
/// outage's joins could ever take.
const UNRECORDED_TOKENS: u32 = 1 << 16;

/// How long to wait before trying again when a server did not answer.
const RETRY: Duration = Duration::from_millis(300);

/// Brings every live server into the new leader's epoch and rebuilds the step ledger's
/// tail; retried until it succeeds. `settled_through` is the record's.
pub(crate) async fn take_over(shared: Arc<Shared>, settled_through: u64) {
    shared.die_at(ftrec_faults::points::TAKEOVER).await;
    loop {
        match attempt(&shared, settled_through).await {
            Ok(()) => return,
            Err(e) => {
                if !shared.leading() {
                    return;
                }
                tracing::warn!("taking over: {e}; trying again");
                // The members' silence is forgiven for a lease TTL and an etcd request
                // after a takeover (`restore`), so a server that died with the old leader
                // (a SIGKILL during a quorum loss) held the takeover for 7 s before it
                // was declared dead. A port that refuses a connection has no process
                // behind it: the control loop's probe marks that server dead at once,
                // as it does when a worker's call fails, and the next attempt leaves it out.
                shared.lock().members.probe_requested = true;
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

/// Every live server with its slot, but those waiting for a recovery (a replacement's
/// fresh shard says nothing of the steps; the recovery brings it into the epoch).
fn live_servers(shared: &Shared) -> Result<(u64, Vec<(usize, ServerClient)>), PsError> {
    let connector = shared.job.connector_for(shared.job.deadlines().control)?;
    let s = shared.lock();
    let clients = s
        .members
        .servers
        .iter()
        .enumerate()
        .filter(|(i, m)| {
            m.alive && !m.address.is_empty() && !s.recovery.failed.iter().any(|(f, _)| f == i)
        })
        .map(|(i, m)| Ok((i, connector.server(&m.address)?)))
        .collect::<Result<_, PsError>>()?;
    Ok((s.epoch, clients))
}

async fn fence_all(
    clients: &[(usize, ServerClient)],
    epoch: u64,
    steps: &[u64],
) -> Result<Vec<AppliedReply>, PsError> {
    let calls = clients.iter().cloned().map(|(i, mut c)| async move {
        c.fence(FenceRequest {
            epoch,
            steps: steps.to_vec(),
        })
        .await
        .map(|r| r.into_inner())
        .map_err(|s| PsError::rpc(format!("fencing server {i}"), &s))
    });
    futures::future::join_all(calls).await.into_iter().collect()
}

async fn attempt(shared: &Arc<Shared>, settled_through: u64) -> Result<(), PsError> {
    let (epoch, mut clients) = live_servers(shared)?;
    let kept = crate::leader::finished_rebuilds::ask(shared, epoch, &mut clients).await?;
    // Under 2PC: the fence goes up first, so no step of an older epoch commits from here
    // on, and the steps some server committed are finished where they are prepared.
    let finish = if shared.job.config.two_phase_commit() {
        let first = fence_all(&clients, epoch, &[]).await?;
        let (from, end) = range(&first, settled_through);
        let steps: Vec<u64> = (from..end).collect();
        let replies = fence_all(&clients, epoch, &steps).await?;
        let mut finish: Vec<u64> = steps
            .iter()
            .enumerate()
            .filter(|(k, _)| replies.iter().any(|r| r.applied.get(*k) == Some(&true)))
            .map(|(_, &s)| s)
            .collect();
        finish.sort_unstable();
        finish
    } else {
        Vec::new()
    };
    let calls = clients.iter().cloned().map(|(i, mut c)| {
        let finish = finish.clone();
        async move {
            c.set_epoch(SetEpochRequest {
                epoch,
                applied: 0,
                unsettled: Vec::new(),
                finish,
            })
            .await
            .map_err(|s| PsError::rpc(format!("moving server {i} to epoch {epoch}"), &s))
        }
    });
    for r in futures::future::join_all(calls).await {
        r?;
    }
    // Every server is in the new epoch now: what they applied no longer changes but
    // through the new leader's grants.
    let replies = fence_all(&clients, epoch, &[]).await?;
    let (from, end) = range(&replies, settled_through);
    let mut s = shared.lock();
    if s.epoch != epoch {
        // A server failed meanwhile (a new epoch): try again with the survivors.
        return Err(PsError::Superseded(format!(
            "epoch moved from {epoch} to {} during the takeover",
            s.epoch
        )));
    }
    let fenced: Vec<usize> = clients.iter().map(|(i, _)| *i).collect();
    crate::leader::spare_claims::vet_claimers(&mut s, &fenced, &replies)?;
    crate::leader::finished_rebuilds::vet(&mut s, &kept, &fenced, &replies)?;
    s.members.takeover_fencing = false;
    let total = s.steps.ledger.total();
    s.steps.ledger = StepLedger::taken_over(total, from, end, epoch);
    // Steps below the record's mark that some server lacks (a rollback after the last
    // flush) are asked about again: their samples count again when they settle.
    let recount: u64 = (from..settled_through.max(from))
        .map(|step| shared.schedule.batch(step).1)
        .sum();
    s.steps.samples = s.steps.samples.saturating_sub(recount);
    s.phase = if !s.recovery.failed.is_empty() {
        Phase::Recovering
    } else if s.scaling.joining {
        // A move's new layout, still joining: training goes on once every slot is in.
        Phase::Starting
    } else if s.steps.started {
        Phase::Running
    } else {
        Phase::Starting
    };
    s.busy = false;
    s.timeline.event(
        EventKind::Coordinator,
        format!(
            "took over in epoch {epoch}: steps {from}..{end} asked of the servers, training \
             continues from step {end}"
        ),
    );
    Ok(())
}

/// The steps to ask about: from the first step some server lacks (at most the record's
/// mark), to one past the newest step any server applied.
fn range(replies: &[AppliedReply], settled_through: u64) -> (u64, u64) {
    let from = replies
        .iter()
        .map(|r| r.applied_low)
        .fold(settled_through, u64::min);
    let end = replies
        .iter()
        .map(|r| r.applied_end)
        .fold(settled_through, u64::max);
    (from, end)
}

/// Whether `e` says etcd did not answer (down, frozen, cut off), not that it refused.
fn etcd_outage(e: &PsError) -> bool {
    use ftrec_etcd::EtcdError::{Request, Timeout, Unreachable};
    matches!(
        e,
        PsError::Membership(Unreachable { .. } | Request { .. } | Timeout { .. })
    )
}

/// Connects to the job's etcd, claims its prefix (or checks it is this job's), and leads
/// (a standby waits for the leader's lease to expire). Returns the leadership and the
/// record an earlier leader left, if any.
///
/// A standby (one started to take over, as the launcher's replacements are) waits out an
/// etcd outage, saying so every minute: exiting would leave the job with no coordinator
/// to take over when etcd returns (issue 42, hole 2). The first coordinator of a job
/// fails at once instead, naming the endpoints, so a wrong address is said at start.
pub(crate) async fn elect(
    job: &Job,
    etcd: &ftrec_etcd::EtcdOptions,
    address: &str,
    standby: bool,
    id: &str,
) -> Result<(durable::Durable, Option<durable::Record>), PsError> {
    let mut clock = super::OutageClock::start();
    loop {
        match elect_once(job, etcd, address, standby, id).await {
            Err(e) if standby && etcd_outage(&e) => {
                if let Some(waited) = clock.report_due() {
                    tracing::warn!(
                        "standby coordinator {id}: etcd does not answer ({e}); waiting for it \
                         ({waited:.0} s so far)"
                    );
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            other => return other,
        }
    }
}

async fn elect_once(
    job: &Job,
    etcd: &ftrec_etcd::EtcdOptions,
    address: &str,
    standby: bool,
    id: &str,
) -> Result<(durable::Durable, Option<durable::Record>), PsError> {
    let client = job.network().connect_etcd(etcd).await?;
    client.claim_job(&job.etcd_claim()).await?;
    let me = ftrec_etcd::LeaderInfo {
        id: id.to_string(),
        address: address.to_string(),
        pid: job.network().pid(),
    };
    let ttl = Duration::from_secs(job.config.cluster.etcd_lease_ttl_s);
    let leadership = client
        .campaign(&me, ttl, standby, |leader| {
            tracing::info!(
                "standby: coordinator {} leads at {} (pid {}); taking over when its lease \
                 expires",
                leader.id,
                leader.address,
                leader.pid
            );
        })
        .await?;
    tracing::info!(
        "coordinator {id} leads the job (term {}, lease TTL {ttl:?})",
        leadership.term()
    );
    // Read through the leadership: its first write of the record then expects this
    // revision, and refuses to put over anything written since (issue 42, hole 5).
    let record = leadership
        .get_json::<durable::Record>(durable::STATE_KEY)
        .await?
        .map(|(r, _)| r);
    if let Some(r) = &record {
        let c = &job.config.cluster;
        r.check(&client.key(durable::STATE_KEY), c.servers, c.workers)?;
    }
    Ok((durable::Durable::new(leadership, id.to_string()), record))
}

/// A new leader's view from the record an earlier one left: membership, layout, counters,
/// cuts and the recovery in progress. Returns the record's settled-through mark, from
/// which the takeover asks the servers about steps.
pub(crate) fn restore(
    shared: &Shared,
    d: &durable::Durable,
    record: durable::Record,
) -> Result<u64, PsError> {
    let epoch = first_epoch(d.leadership.term()).max(record.epoch + 1);
    let mut s = shared.lock();
    s.epoch = epoch;
    s.placement = record.placement;
    s.scaling.servers = record.servers.len();
    if let Some(base) = &record.base {
        s.scaling.base = Some(base.point());
    }
    s.scaling.moves = record.moves.clone();
    s.scaling.pending = record
        .pending_move
        .as_ref()
        .map(|m| crate::state::PendingMove {
            to: m.to,
            asked_at: m.asked_at,
            cut: m.cut,
            committed: m.committed,
        });
    s.scaling.joining = record.joining;
    s.members.retired = record.retired.iter().copied().collect();
    s.members.servers = record
        .servers
        .iter()
        .map(|m| durable::Record::member(m, true))
        .collect();
    s.members.workers = record
        .workers
        .iter()
        .map(|m| durable::Record::member(m, false))
        .collect();
    s.members.spares = record
        .spares
        .iter()
        .map(|sp| crate::state::Spare {
            token: sp.token,
            member: durable::Record::member(
                &durable::MemberRecord {
                    address: sp.address.clone(),
                    pid: sp.pid,
                    incarnation: u64::from(sp.token),
                    joined: true,
                    alive: true,
                },
                false,
            ),
            assigned: sp.assigned,
            hosted_by: sp.hosted_by,
            // A free spare of the record may hold a slot the old leader gave it through
            // an etcd outage, unrecorded: it says so in its first heartbeat.
            unheard: sp.assigned.is_none(),
            claims: None,
            waiting_peak_rss: 0,
        })
        .collect();
    // The members learn of the new leader from etcd while their calls to the old one (which
    // may be frozen, not gone) wait out their deadlines: their silence counts from one
    // lease TTL after the takeover. Without it, a loaded host let a new leader declare
    // live servers dead before they had found it, and they exited (cluster_etcd's
    // frozen-leader test, about one run in two with its tests in parallel). A member
    // whose read of the leader key hung on an etcd member that was frozen or cut off
    // learns of the takeover one etcd request timeout later still: after a quorum loss,
    // a new leader declared two live servers dead 4.0 s after taking over, and one of
    // them had found it at 4.7 s (`bench soak`, issue 44 §1).
    let member_read = shared
        .job
        .etcd_options()
        .map_or(std::time::Duration::ZERO, |o| o.request_timeout);
    let grace_until = tokio::time::Instant::now() + d.leadership.ttl() + member_read;
    // The record's members, spares included, are forgiven.
    s.members.forgive_silence(grace_until);
    s.members.claims_until = Some(grace_until.max(tokio::time::Instant::now() + CLAIMS_WAIT));
    s.members.recorded_incarnations = s.members.servers.iter().map(|m| m.incarnation).collect();
    s.members.takeover_fencing = true;
    // An earlier leader acting through an etcd outage may have handed out incarnations
    // the record never saw (joins, spares): this leader's start past them, so none of its
    // joins shares an incarnation with a process of that outage, which would then pass
    // for the slot's own.
    s.members.next_token = record.next_token.saturating_add(UNRECORDED_TOKENS);
    s.members.unrecorded_incarnations =
        Some(u64::from(record.next_token)..u64::from(s.members.next_token));
    s.steps.samples = record.samples_settled;
    s.steps.lost_samples = record.lost_samples;
    s.recovery.steps_rolled_back = record.steps_rolled_back;
    s.steps.rpc_bytes = record.rpc_bytes;
    s.members.zombies = record.zombies.into_iter().collect();
    s.saves.last_checkpoint = record.last_checkpoint;
    s.saves.last_save = record.last_save;
    s.saves.retained_cuts = record.retained_cuts;
    if let Some(own) = s.cuts.own_saves.as_mut() {
        own.restore_retained(record.own_saves);
    }
    s.saves.checkpoints = record.checkpoints;
    s.recovery.recoveries = record.recoveries;
    s.recovery.unrecorded_kept = record.unrecorded_recoveries;
    s.members.worker_respawns = record.worker_respawns;
    s.leader.failovers = record.failovers;
    let total = s.steps.ledger.total();
    s.steps.ledger =
        StepLedger::taken_over(total, record.settled_through, record.settled_through, epoch);
    s.steps.started = record.started;
    s.leader.train_seconds_before =
        record.train_seconds + (durable::unix_now() - record.written_at_unix).max(0.0);
    let now = s.timeline.event(
        EventKind::Coordinator,
        format!(
            "{} takes over from {} (term {} after {}), epoch {epoch}",
            d.id,
            record.leader,
            d.leadership.term(),
            record.term
        ),
    );
    if let Some(why) = &record.fatal {
        let why = format!("the job failed under coordinator {}: {why}", record.leader);
        s.timeline.event(EventKind::Fatal, why.clone());
        s.recovery.fatal = Some(why);
    }
    if record.done || record.fatal.is_some() {
        s.members.takeover_fencing = false;
        s.phase = Phase::Done;
        shared.done.send_replace(true);
        return Ok(record.settled_through);
    }
    s.leader.took_over(
        Failover {
            from: record.leader,
            to: d.id.clone(),
            failover_seconds: 0.0,
            term: d.leadership.term(),
            first_step_at_unix: None,
        },
        record.written_at_unix,
    );
    if record.started {
        let before = s.leader.train_seconds_before;
        s.timeline.event(
            EventKind::TrainingStart,
            format!("continued after {before:.3} s under earlier leaders"),
        );
    }
    // A recovery the old leader had not finished is run again: slots it was waiting for,
    // and slots rebuilding in the background (their rebuild restarts).
    let mut failed: Vec<usize> = record.failed;
    failed.extend(record.rebuilding.iter().copied());
    failed.sort_unstable();
    failed.dedup();
    s.recovery.failed = failed.iter().map(|&id| (id, now)).collect();
    // The record's last write may lag a rebuild's end: the takeover asks those slots.
    s.recovery.rebuilds_to_ask = record.rebuilding;
    // Until the takeover has every server in the new epoch, nothing is planned or granted.
    s.phase = Phase::Recovering;
    s.busy = true;
    for id in failed {
        if !s.members.servers[id].alive {
            control::replace_server(shared, &mut s, id);
        }
    }
    // A move's new layout that was joining: the slots no process joined are started (a
    // process the old leader started may still join; a second one is then refused).
    if s.scaling.joining {
        let vacant: Vec<usize> = (0..s.members.servers.len())
            .filter(|&id| !s.members.servers[id].joined)
            .collect();
        for id in vacant {
            control::replace_server(shared, &mut s, id);
        }
    }
    drop(s);
    shared.epoch_moved(epoch);
    Ok(record.settled_through)
}
