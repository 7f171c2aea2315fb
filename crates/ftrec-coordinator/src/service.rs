//! The coordinator's RPCs: join, heartbeat, step grants, placement, kill.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use tonic::{Request, Response, Status};

use crate::state::{Member, Spare};
use crate::{Shared, role_name, sigkill};
use ftrec_proto::proto::coordinator_server::Coordinator;
use ftrec_proto::proto::*;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::PsError;

pub(super) struct Service(pub(super) Arc<Shared>);

#[tonic::async_trait]
impl Coordinator for Service {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        let shared = &self.0;
        let req = req.into_inner();
        shared.check_leading()?;
        if let Some(e) = shared.fence_error(req.fingerprint) {
            shared.event(
                EventKind::JoinRefused,
                format!("{:?} {}: {}", req.role(), req.id, e.message()),
            );
            return Err(e);
        }
        let c = &shared.job.config.cluster;
        let timeout = Duration::from_millis(c.failure_timeout_ms);
        let reply = {
            let mut s = shared.lock();
            let mut spare_token = 0;
            let id = req.id as usize;
            // Every join is a new incarnation (a spare's is its token).
            let incarnation = s.members.next_incarnation();
            let member = Member {
                address: req.address.clone(),
                pid: req.pid,
                joined: true,
                alive: true,
                ready: false,
                last_seen: Some(Instant::now()),
                refused: false,
                incarnation: u64::from(incarnation),
                cut_off: None,
            };
            match (req.role(), req.spare) {
                (Role::Server, true) => {
                    spare_token = incarnation;
                    let hosted_by = req.hosted_by.map(|j| j as usize);
                    if let Some(host) = hosted_by {
                        s.members.hosting.answered_by(host);
                    }
                    s.members.spares.push(Spare {
                        token: spare_token,
                        member,
                        assigned: None,
                        hosted_by,
                        unheard: false,
                        claims: None,
                        waiting_peak_rss: 0,
                    });
                    let on = hosted_by.map_or(String::new(), |j| format!(" on server {j}'s host"));
                    s.timeline.event(
                        EventKind::SpareJoined,
                        format!("spare {spare_token} at {}{on}", req.address),
                    );
                }
                (Role::Server, false) => {
                    let Some(slot) = s.members.servers.get(id) else {
                        return Err(Status::invalid_argument(format!(
                            "server id {id} is outside this cluster's {} servers",
                            s.scaling.servers
                        )));
                    };
                    if slot.joined && slot.alive && slot.silent_for() < timeout {
                        return Err(Status::already_exists(format!(
                            "server {id} is already held by a live process (pid {} at {}); \
                             refusing a second server with that identity",
                            slot.pid, slot.address
                        )));
                    }
                    // A silent member not yet declared dead: the newcomer replaces it, and
                    // the slot's state must come from a recovery in a new epoch. Taking the
                    // slot quietly left the newcomer serving a fresh shard in the old epoch
                    // (issue 42, hole 6).
                    if slot.joined && slot.alive && s.steps.started {
                        if !shared.may_decide() {
                            return Err(Status::unavailable(format!(
                                "server {id}'s process has been silent for {:?}, and this \
                                 coordinator cannot declare it dead now (its etcd lease is not \
                                 surely its own): try again",
                                slot.silent_for()
                            )));
                        }
                        let why = format!(
                            "silent for {:?}; a new process (pid {} at {}) joins its slot",
                            slot.silent_for(),
                            req.pid,
                            req.address
                        );
                        crate::control::declare_server_dead(shared, &mut s, id, &why);
                    }
                    s.members.servers[id] = member;
                    s.placement.assign(id, req.address.clone());
                    s.timeline.event(
                        EventKind::ServerJoined,
                        format!(
                            "server {id} at {} (pid {}, metrics http://{}/metrics)",
                            req.address, req.pid, req.metrics_address
                        ),
                    );
                }
                (Role::Worker, _) => {
                    let Some(slot) = s.members.workers.get(id) else {
                        return Err(Status::invalid_argument(format!(
                            "worker id {id} is outside this cluster's {} workers",
                            c.workers
                        )));
                    };
                    if slot.joined && slot.alive && slot.silent_for() < timeout {
                        return Err(Status::already_exists(format!(
                            "worker {id} is already held by a live process (pid {})",
                            slot.pid
                        )));
                    }
                    s.members.workers[id] = Member {
                        ready: true,
                        ..member
                    };
                    s.timeline.event(
                        EventKind::WorkerJoined,
                        format!(
                            "worker {id} (pid {}, metrics http://{}/metrics)",
                            req.pid, req.metrics_address
                        ),
                    );
                }
                (Role::Unspecified, _) => {
                    return Err(Status::invalid_argument("join without a role"));
                }
            }
            JoinReply {
                epoch: s.epoch,
                servers: s.scaling.servers as u32,
                workers: c.workers as u32,
                spare_token,
                incarnation: u64::from(incarnation),
                // The new layout's servers joining after a move take fresh slots: they
                // load the move's cut, as a resumed job's do.
                replacement: s.steps.started && !s.scaling.joining,
                resume: s.scaling.base.clone(),
            }
        };
        // etcd membership: a join is recorded before it is answered, so a new leader
        // knows the member's incarnation and does not fence it as a stranger. Through an
        // etcd outage it is answered unrecorded, with an incarnation past the record's
        // count: a newer leader adopts the newcomer by it, from the address and pid its
        // heartbeats carry, as a free spare of the record, whose claim on a slot it holds
        // goes on as such a spare's (`leader/spare_claims.rs`).
        if let Err(e) = shared.sync_durable().await {
            if !shared.acts_through_outage() {
                return Err(e.into());
            }
            shared.event(
                EventKind::Coordinator,
                format!(
                    "etcd does not answer ({e}): {:?} {} joins without a record \
                     (cluster.train_through_etcd_outage)",
                    req.role(),
                    req.id
                ),
            );
        }
        Ok(Response::new(reply))
    }

    async fn heartbeat(
        &self,
        req: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatReply>, Status> {
        let shared = &self.0;
        let req = req.into_inner();
        shared.check_leading()?;
        let mut s = shared.lock();
        let stop = s.stopping;
        let mut assign = None;
        let id = req.id as usize;
        if let Some(reply) = crate::hosting::beat_of_a_moved_or_unwanted_host(&mut s, &req) {
            return Ok(Response::new(reply));
        }
        // A server of a layout the job moved off: its shard is in the move's cut, and it
        // is done.
        if req.role() == Role::Server && !req.spare && s.members.retired.contains(&req.incarnation)
        {
            return Ok(Response::new(HeartbeatReply {
                epoch: s.epoch,
                stop: true,
                ..Default::default()
            }));
        }
        if req.role() == Role::Server && !req.spare {
            crate::leader::spare_claims::claim_of_an_unrecorded_spare(
                &mut s,
                id,
                req.incarnation,
                req.ready,
                (&req.address, req.pid),
            )?;
        }
        let member = match (req.role(), req.spare) {
            (Role::Server, true) => {
                crate::leader::spare_claims::adopt_an_unrecorded_joiner(
                    &mut s,
                    u64::from(req.id),
                    (&req.address, req.pid),
                    tokio::time::Instant::now(),
                );
                let Some(spare) = s.members.spares.iter_mut().find(|sp| sp.token == req.id) else {
                    return Err(Status::not_found("unknown spare"));
                };
                spare.unheard = false;
                spare.waiting_peak_rss = spare.waiting_peak_rss.max(req.peak_rss_bytes);
                assign = spare.assigned.map(|a| a as u32);
                &mut spare.member
            }
            (Role::Server, false) => s
                .members
                .servers
                .get_mut(id)
                .ok_or_else(|| Status::invalid_argument("unknown server"))?,
            (Role::Worker, _) => s
                .members
                .workers
                .get_mut(id)
                .ok_or_else(|| Status::invalid_argument("unknown worker"))?,
            _ => return Err(Status::invalid_argument("heartbeat without a role")),
        };
        // Declared dead (and replaced): a paused or cut-off process that comes back must not
        // serve. Its slot may hold a newer process by now, told apart by its incarnation.
        let superseded = req.incarnation != 0 && req.incarnation != member.incarnation;
        if !member.alive || superseded {
            s.members.zombies.insert(req.incarnation);
            return Err(PsError::Fenced(
                "this process was declared dead; its slot has been replaced".into(),
            )
            .into());
        }
        member.last_seen = Some(Instant::now());
        // A replacement's first "ready" starts the recovery that waits for it: planned
        // now, not at the control loop's next tick.
        let became_ready = req.ready && !member.ready;
        member.ready |= req.ready;
        if became_ready {
            shared.wake.notify_one();
        }
        if req.role() == Role::Server && !req.spare && req.rpcs_served > 0 {
            s.members
                .served
                .insert(req.incarnation, (req.rpcs_served, req.rpc_bytes_served));
        }
        let start_spare = req.role() == Role::Server
            && !req.spare
            && !stop
            && s.members.hosting.tell(id, Instant::now());
        let given = assign.is_some();
        Ok(Response::new(HeartbeatReply {
            epoch: s.epoch,
            stop,
            assign,
            start_spare,
            servers: if given { s.scaling.servers as u32 } else { 0 },
            resume: s.scaling.base.clone().filter(|_| given),
        }))
    }

    async fn next_step(
        &self,
        req: Request<NextStepRequest>,
    ) -> Result<Response<NextStepReply>, Status> {
        let shared = &self.0;
        let req = req.into_inner();
        let worker = req.worker as usize;
        shared.check_leading()?;
        let mut s = shared.lock();
        if let Some(m) = s.members.workers.get_mut(worker) {
            // A worker declared dead whose slot went to a replacement must not take steps
            // under that slot: they would be settled or lost under the wrong process.
            let superseded = (req.pid != 0 && m.pid != 0 && m.pid != req.pid)
                || (req.incarnation != 0 && req.incarnation != m.incarnation);
            if superseded {
                let why = format!(
                    "worker {worker} is held by pid {} (incarnation {}); this process (pid {}, \
                     incarnation {}) was declared dead",
                    m.pid, m.incarnation, req.pid, req.incarnation
                );
                s.members.zombies.insert(req.incarnation);
                return Err(PsError::Fenced(why).into());
            }
            m.last_seen = Some(Instant::now());
        }
        s.steps.rpc_bytes += req.rpc_bytes;
        shared.metrics.add("ftrec_rpc_bytes_total", req.rpc_bytes);
        if let Some(step) = req.finished
            && s.steps.ledger.finish(step, worker, req.epoch)
        {
            s.steps.lost_in_a_row = 0;
            s.members.unreachable_reports.clear();
            shared.settled(&mut s, step);
            let now = s.timeline.now();
            if let Some(r) = s.recovery.recoveries.last_mut()
                && r.first_step_at.is_none()
            {
                r.first_step_at = Some(now);
            }
        }
        if let Some(step) = req.lost {
            s.steps.lost_in_a_row += 1;
            if let Some(ahead) = req.ahead_epoch.filter(|&e| e > s.epoch)
                && shared.durable_membership()
            {
                // With etcd, a server ahead of this coordinator's epoch is a newer
                // leader's: this one is deposed, not the job failed.
                drop(s);
                shared.deposed(&format!(
                    "a server refused step {step} in epoch {ahead}, above this \
                     coordinator's: a newer leader has taken over"
                ));
                return Err(PsError::NotLeader { leader: None }.into());
            }
            if let Some(why) = refusal(&s, step, &req) {
                tracing::error!("{why}");
                shared.fail_run(&mut s, why);
            }
            // The step becomes an orphan: the control loop asks the servers which of them
            // applied it, then grants it again or rolls back. Never skipped.
            s.steps.ledger.lose(step, worker, req.epoch);
            // Only a step granted in this epoch speaks of the slot's current process: an
            // older one's calls went to whoever held the slot before the last recovery.
            if let Some(server) = req.unreachable_server
                && req.epoch == s.epoch
            {
                s.members.report_unreachable(
                    server as usize,
                    worker,
                    &req.lost_reason,
                    req.unreachable_confirmed,
                );
            }
            // A loss in this epoch may mean a member is failing: grants wait for the
            // failure detector. A loss from an older epoch says nothing of the members
            // now: a recovery has already dealt with what failed then. (A worker stuck in a
            // dead server's call reports it only after the recovery; pausing grants for
            // it stalled training for a failure timeout after every resume, issue 23.)
            if req.epoch == s.epoch {
                let c = &shared.job.config.cluster;
                s.recovery.suspect_until = Some(
                    Instant::now()
                        + Duration::from_millis(c.failure_timeout_ms + 2 * c.heartbeat_ms),
                );
                s.members.probe_requested = true;
                // Probed now, not at the next tick: a refused port is a SIGKILLed server
                // declared within a millisecond of the report.
                shared.wake.notify_one();
            }
        }
        let reply = shared.grant(&mut s, worker);
        Ok(Response::new(reply))
    }

    async fn placement(
        &self,
        _req: Request<PlacementRequest>,
    ) -> Result<Response<PlacementReply>, Status> {
        self.0.check_leading()?;
        let s = self.0.lock();
        Ok(Response::new(PlacementReply {
            version: s.placement.version,
            servers: s.placement.servers.clone(),
        }))
    }

    async fn scale(&self, req: Request<ScaleRequest>) -> Result<Response<ScaleReply>, Status> {
        let shared = &self.0;
        shared.check_leading()?;
        let servers = req.into_inner().servers as usize;
        let (from_servers, from_step) = {
            let mut s = shared.lock();
            crate::scale::ask(shared, &mut s, servers)?
        };
        shared.sync_durable().await?;
        Ok(Response::new(ScaleReply {
            from_servers: from_servers as u32,
            from_step,
        }))
    }

    async fn kill(&self, req: Request<KillRequest>) -> Result<Response<KillReply>, Status> {
        let req = req.into_inner();
        let role = req.role();
        let Some(pid) = self.0.pid_of(role, req.id as usize) else {
            return Err(Status::not_found(format!(
                "no {role:?} {} has joined",
                req.id
            )));
        };
        sigkill(pid).map_err(|e| Status::internal(format!("kill {pid}: {e}")))?;
        self.0.event_about(
            EventKind::Killed,
            crate::subject(role, req.id as usize),
            None,
            format!("{} {} (pid {pid}) by SIGKILL", role_name(role), req.id),
        );
        Ok(Response::new(KillReply { pid }))
    }
}

/// Steps lost this many times in a row, with no step finishing in between, mean the
/// servers refuse work for a reason no recovery removes.
const MAX_LOST_IN_A_ROW: u32 = 64;

/// Why the run cannot go on after `req` lost `step`, if it cannot: a server in a later
/// epoch than the cluster's (changed from outside the job), or steps lost without end.
fn refusal(s: &crate::state::State, step: u64, req: &NextStepRequest) -> Option<String> {
    let reason = if req.lost_reason.is_empty() {
        "no reason given"
    } else {
        &req.lost_reason
    };
    if let Some(ahead) = req.ahead_epoch
        && ahead > s.epoch
    {
        return Some(format!(
            "a server refused step {step} of worker {}: it is in epoch {ahead}, ahead of the \
             cluster's epoch {}; something outside this job changed it ({reason})",
            req.worker, s.epoch
        ));
    }
    (s.steps.lost_in_a_row >= MAX_LOST_IN_A_ROW).then(|| {
        format!(
            "{} steps lost in a row with none finished: the servers refuse work; last cause \
             (step {step}, worker {}): {reason}",
            s.steps.lost_in_a_row, req.worker
        )
    })
}
