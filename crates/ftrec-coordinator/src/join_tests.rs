//! Joins against the coordinator's state, in process: what a joining server is told, and
//! what its join does to the slot it takes (issue 42, hole 6), and what a recovery with
//! no process for a slot says (hole 8). The coordinator here is embedded (no etcd), with
//! no listener and no control loop: a test sets the state and calls the RPC handler.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tonic::Request;

use ftrec_config::{FaultTolerance, JobConfig};
use ftrec_proto::proto::coordinator_server::Coordinator;
use ftrec_proto::proto::*;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::job::{Job, Schedule};
use ftrec_rpc::metrics::Metrics;

use crate::service::Service;
use crate::state::{Member, Phase, State};
use crate::{Shared, control};

fn shared() -> Arc<Shared> {
    let mut c = JobConfig::preset("micro").unwrap();
    c.cluster.servers = 3;
    c.cluster.ft = FaultTolerance::Ec;
    c.data.dir = Some(std::env::temp_dir());
    c.train.steps = 100;
    c.validate().unwrap();
    let job = Job::new(c).unwrap();
    let schedule = Schedule {
        samples: 12_800,
        batch_size: job.config.train.batch_size as u64,
    };
    Arc::new(Shared {
        schedule,
        address: "127.0.0.1:7000".into(),
        state: Mutex::new(State::new(&job, 100, schedule.samples_before(100), None).unwrap()),
        spawner: None,
        metrics: Arc::new(Metrics::new("role=\"coordinator\"".into())),
        done: watch::channel(false).0,
        epochs: watch::Sender::new(0),
        durable: None,
        wake: tokio::sync::Notify::new(),
        testing: Default::default(),
        faults: Default::default(),
        job,
    })
}

fn member(port: u16, pid: u32) -> Member {
    Member {
        address: format!("127.0.0.1:{port}"),
        pid,
        joined: true,
        alive: true,
        ready: true,
        last_seen: Some(Instant::now()),
        refused: false,
        incarnation: u64::from(pid),
        cut_off: None,
    }
}

/// Every server slot held; training under way (or not) in `phase`.
fn with_members(shared: &Shared, phase: Phase, started: bool) {
    let mut s = shared.lock();
    for id in 0..3 {
        s.members.servers[id] = member(7001 + id as u16, 100 + id as u32);
    }
    s.phase = phase;
    s.steps.started = started;
}

async fn join_server(shared: &Arc<Shared>, id: u32) -> Result<JoinReply, tonic::Status> {
    let request = JoinRequest {
        role: Role::Server as i32,
        id,
        address: "127.0.0.1:7101".into(),
        fingerprint: shared.job.fingerprint(),
        pid: 4242,
        metrics_address: String::new(),
        spare: false,
        hosted_by: None,
    };
    Service(shared.clone())
        .join(Request::new(request))
        .await
        .map(|r| r.into_inner())
}

/// A new leader is `Recovering` while it takes over, whether or not the job had started.
/// A server that joined then was told it replaced a member, built an all-zero shard to be
/// rebuilt, and nothing rebuilt it: the job trained on zeros.
#[tokio::test]
async fn a_server_joining_a_takeover_of_a_job_not_yet_started_builds_its_shard_from_the_seed() {
    let shared = shared();
    shared.lock().phase = Phase::Recovering;
    let reply = join_server(&shared, 1).await.unwrap();
    assert!(!reply.replacement, "told to wait for a rebuild nobody runs");

    let shared = self::shared();
    with_members(&shared, Phase::Running, true);
    shared.lock().members.servers[1].alive = false;
    let reply = join_server(&shared, 1).await.unwrap();
    assert!(reply.replacement, "a slot of a started job is rebuilt");
}

/// A member silent past the failure timeout but not yet declared dead (the control loop
/// had not run, or could not decide) was replaced by a join in place: no new epoch, no
/// recovery, and the newcomer served a fresh shard as if it were the old one's.
#[tokio::test]
async fn a_join_that_replaces_a_silent_member_declares_it_dead_in_a_new_epoch() {
    let shared = shared();
    with_members(&shared, Phase::Running, true);
    let timeout = Duration::from_millis(shared.job.config.cluster.failure_timeout_ms);
    let before = {
        let mut s = shared.lock();
        s.members.servers[1].last_seen = Instant::now().checked_sub(timeout * 2);
        s.epoch
    };
    let reply = join_server(&shared, 1).await.unwrap();
    assert!(reply.replacement);
    {
        let s = shared.lock();
        assert!(s.epoch > before, "no new epoch for the replaced member");
        assert_eq!(reply.epoch, s.epoch, "the newcomer joins the new epoch");
        assert_eq!(s.phase, Phase::Recovering);
        assert!(s.recovery.failed.iter().any(|&(id, _)| id == 1));
        assert_eq!(s.members.servers[1].pid, 4242);
        assert!(!s.members.servers[1].ready, "it serves after its rebuild");
    }

    // A live member that answers keeps its slot.
    let shared = self::shared();
    with_members(&shared, Phase::Running, true);
    let e = join_server(&shared, 2).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e}");
}

/// A recovery with no process for a slot, and no spawner: it says which slot waits for
/// what, and how to start one, and does not say it again within the minute. Before, the
/// job stood still in silence.
#[tokio::test]
async fn a_recovery_without_a_replacement_says_who_it_waits_for() {
    let shared = shared();
    with_members(&shared, Phase::Running, true);
    {
        let mut s = shared.lock();
        control::declare_server_dead(&shared, &mut s, 1, "killed");
        // The plan waits: no process holds slot 1.
        assert!(control::plan_for_test(&shared, &mut s).is_none());
    }
    let said = |shared: &Shared| {
        shared
            .timeline()
            .events
            .iter()
            .filter(|e| e.kind == EventKind::Replacement && e.detail.contains("waits for"))
            .map(|e| e.detail.clone())
            .collect::<Vec<_>>()
    };
    let t0 = Instant::now();
    let at = |seconds: u64| {
        let mut s = shared.lock();
        control::say_who_is_awaited(&shared, &mut s, t0 + Duration::from_secs(seconds));
    };
    at(1);
    assert!(said(&shared).is_empty(), "said before the wait is long");
    at(6);
    let text = said(&shared);
    assert_eq!(text.len(), 1, "{text:?}");
    assert!(
        text[0].contains("server 1: no process")
            && text[0].contains("ftrec server --job JOB --coordinator 127.0.0.1:7000 --id 1")
            && text[0].contains("--spawn"),
        "{}",
        text[0]
    );
    at(36);
    assert_eq!(said(&shared).len(), 1, "said again within the minute");
    at(67);
    assert_eq!(said(&shared).len(), 2, "said again after a minute");
}

async fn beat(shared: &Arc<Shared>, id: u32, spare: bool, incarnation: u64) -> HeartbeatReply {
    beat_result(shared, id, spare, incarnation).await.unwrap()
}

async fn beat_result(
    shared: &Arc<Shared>,
    id: u32,
    spare: bool,
    incarnation: u64,
) -> Result<HeartbeatReply, tonic::Status> {
    let request = HeartbeatRequest {
        role: Role::Server as i32,
        id,
        spare,
        ready: true,
        incarnation,
        ..Default::default()
    };
    Service(shared.clone())
        .heartbeat(Request::new(request))
        .await
        .map(|r| r.into_inner())
}

async fn join_spare(shared: &Arc<Shared>, hosted_by: Option<u32>) -> JoinReply {
    let request = JoinRequest {
        role: Role::Server as i32,
        address: format!("127.0.0.1:{}", 7200 + hosted_by.unwrap_or(9)),
        fingerprint: shared.job.fingerprint(),
        pid: 5000 + hosted_by.unwrap_or(9),
        spare: true,
        hosted_by,
        ..Default::default()
    };
    Service(shared.clone())
        .join(Request::new(request))
        .await
        .unwrap()
        .into_inner()
}

/// Hole 8, training on with no replacement: past `cluster.survivor_spare_after_s` a live
/// server is told (once) to start a spare on its host; that spare takes the lost slot;
/// a spare from elsewhere that joins later takes the slot over (an `ec` job: a recovery
/// rebuilt from parity), and the hosted process is told to stop, not fenced.
#[tokio::test]
async fn a_lost_slot_gets_a_spare_on_a_survivors_host_and_moves_to_one_from_elsewhere() {
    let shared = shared();
    with_members(&shared, Phase::Running, true);
    let after = Duration::from_secs(shared.job.config.cluster.survivor_spare_after_s);
    let t0 = Instant::now();
    {
        let mut s = shared.lock();
        control::declare_server_dead(&shared, &mut s, 1, "killed");
        crate::hosting::fill_lost_slots(&shared, &mut s, t0);
        assert_eq!(s.members.hosting.ask, None, "asked before the wait is long");
        crate::hosting::fill_lost_slots(&shared, &mut s, t0 + after);
        assert_eq!(s.members.hosting.ask.as_ref().map(|a| a.server), Some(0));
    }
    assert!(
        !beat(&shared, 2, false, 102).await.start_spare,
        "server 2 was not asked"
    );
    // Told on every beat (a heartbeat's two links race), until its spare joins.
    assert!(beat(&shared, 0, false, 100).await.start_spare);
    assert!(beat(&shared, 0, false, 100).await.start_spare);

    let hosted = join_spare(&shared, Some(0)).await.spare_token;
    assert!(!beat(&shared, 0, false, 100).await.start_spare, "answered");
    {
        let mut s = shared.lock();
        crate::hosting::fill_lost_slots(&shared, &mut s, t0 + after);
        assert_eq!(s.members.servers[1].incarnation, u64::from(hosted));
        // Its recovery done: slot 1 serves from server 0's host.
        s.members.servers[1].ready = true;
        s.recovery.failed.clear();
        s.phase = Phase::Running;
        assert!(
            !crate::hosting::hand_over(&shared, &mut s),
            "no spare from elsewhere yet"
        );
    }
    let events = shared.timeline().events;
    assert!(
        events.iter().any(|e| e.detail.contains(&format!(
            "spare {hosted} at 127.0.0.1:7200 on server 0's host takes server 1"
        ))),
        "{events:?}"
    );

    let elsewhere = join_spare(&shared, None).await.spare_token;
    {
        let mut s = shared.lock();
        let epoch = s.epoch;
        assert!(crate::hosting::hand_over(&shared, &mut s));
        assert_eq!(s.phase, Phase::Recovering);
        assert!(s.epoch > epoch, "the move is a recovery in a new epoch");
        assert_eq!(s.members.servers[1].incarnation, u64::from(elsewhere));
    }
    let reply = beat(&shared, 1, false, u64::from(hosted)).await;
    assert!(reply.stop, "the hosted process is told to stop");
    assert_eq!(shared.lock().members.zombies.len(), 0, "and is no zombie");
}

/// A coordinator's summary reads back as written: the `--etcd` launcher takes the
/// finishing coordinator's report from its JSON.
#[test]
fn a_summary_reads_back_as_written() {
    let shared = shared();
    shared.lock().recovery.recoveries.push(crate::Recovery {
        server: 1,
        detected_at: 1.0,
        resumed_at: 1.5,
        resumed_step: 7,
        steps_rolled_back: 0,
        rebuild_seconds: 0.1,
        rebuild_bytes: 4096,
        degraded_seconds: 0.2,
        background_rebuild: true,
        steps_while_degraded: 2,
        steps_committed_while_degraded: 2,
        kill_to_resume_seconds: Some(1.2),
        first_step_at: Some(1.6),
        kill_to_first_step_seconds: Some(1.3),
        epoch: 2,
        mode: crate::RecoveryMode::Rebuild,
        shard_digests: Vec::new(),
    });
    let written = serde_json::to_value(shared.summary()).unwrap();
    let back: crate::RunSummary = serde_json::from_value(written.clone()).unwrap();
    assert_eq!(serde_json::to_value(&back).unwrap(), written);
    assert_eq!(back.recoveries[0].mode, crate::RecoveryMode::Rebuild);
}

/// A leader that took over from one that trained through an etcd outage: slot 1's
/// record process is spare 6 (its recorded assignment), dead by now, and spare 7 (free in
/// the record) holds the slot by the old leader's unrecorded assignment. With the takeover
/// still to fence the servers.
fn taken_over_with_a_claimer(shared: &Shared) {
    with_members(shared, Phase::Recovering, true);
    let mut s = shared.lock();
    let spare = |token: u32, assigned: Option<usize>, unheard: bool| crate::state::Spare {
        token,
        member: member(7300 + token as u16, u32::from(token as u16)),
        assigned,
        hosted_by: None,
        unheard,
        claims: None,
        waiting_peak_rss: 0,
    };
    s.members.servers[1] = Member {
        incarnation: 6,
        refused: true,
        ..member(7306, 6)
    };
    s.members.spares = vec![spare(6, Some(1), false), spare(7, None, true)];
    s.members.claims_until = Some(Instant::now() + Duration::from_secs(60));
    s.members.recorded_incarnations = s.members.servers.iter().map(|m| m.incarnation).collect();
    s.members.takeover_fencing = true;
}

/// Issue 44's soak (seed 2, every 20 s) lost its model here: the claimer was taken for a
/// stale one (the record's own holder, spare 6, is listed as assigned to the slot), fenced
/// as superseded, and the slot rebuilt from survivors that were two short. Now the record's
/// dead process is not declared while the claim is awaited, the claimer takes the slot
/// with its shard, and the old process is fenced.
#[tokio::test]
async fn a_claim_heard_in_a_takeover_keeps_the_slot_and_its_shard() {
    let shared = shared();
    taken_over_with_a_claimer(&shared);
    let timeout = Duration::from_millis(shared.job.config.cluster.failure_timeout_ms);
    {
        let s = shared.lock();
        assert_eq!(
            s.members.server_refused(1),
            None,
            "declared before the claim"
        );
        assert_eq!(
            s.members.server_failure(1, timeout, Some(Instant::now())),
            None
        );
    }
    let reply = beat_result(&shared, 1, false, 7).await.unwrap();
    assert!(!reply.stop);
    {
        let s = shared.lock();
        let slot = &s.members.servers[1];
        assert_eq!((slot.incarnation, slot.alive, slot.ready), (7, true, true));
        assert_eq!(slot.address, "127.0.0.1:7307");
        assert_eq!(s.placement.servers[1], "127.0.0.1:7307");
        assert!(
            s.members.zombies.contains(&6),
            "the record's process is fenced"
        );
        assert_eq!(s.members.spares[1].assigned, Some(1));
        assert!(s.members.claimed.contains(&1));
        assert!(s.recovery.failed.is_empty(), "nothing to rebuild");
        assert_eq!(s.recovery.unrecorded_kept, vec![1], "the report names it");
    }
    let e = beat_result(&shared, 1, false, 6).await.unwrap_err();
    assert!(e.message().contains("declared dead"), "{e}");

    // Once the takeover is done, a late claim is only noted (the slot goes back to the
    // claimer as a spare, rebuilt), and the record's process may be declared.
    let shared = self::shared();
    taken_over_with_a_claimer(&shared);
    shared.lock().members.takeover_fencing = false;
    let e = beat_result(&shared, 1, false, 7).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    let s = shared.lock();
    assert_eq!(s.members.servers[1].incarnation, 6);
    assert_eq!(s.members.spares[1].claims, Some(1));
    assert!(
        s.members.server_refused(1).is_some(),
        "heard: no claim awaited"
    );
}

/// A claimer that an earlier leader declared dead in turn (frozen, its slot given to yet
/// another spare) is behind the others once the takeover fenced them: it does not count,
/// and is declared at the next tick. One as far along as the others counts; one the
/// fences did not reach makes the takeover try again.
#[tokio::test]
async fn a_claimer_behind_the_others_is_declared_and_the_takeover_tried_again() {
    use crate::leader::spare_claims::vet_claimers;
    let shared = shared();
    let reply = |end: u64| AppliedReply {
        applied_end: end,
        ..Default::default()
    };
    let mut s = shared.lock();
    s.members.claimed.insert(1);
    s.recovery.unrecorded_kept.push(1);
    let e = vet_claimers(&mut s, &[0, 2], &[reply(50), reply(50)]).unwrap_err();
    assert!(e.to_string().contains("after the takeover's fences"), "{e}");
    vet_claimers(&mut s, &[0, 1, 2], &[reply(50), reply(50), reply(50)]).unwrap();
    assert!(s.members.claimed.is_empty());

    s.members.claimed.insert(1);
    let e = vet_claimers(&mut s, &[0, 1, 2], &[reply(50), reply(41), reply(50)]).unwrap_err();
    assert!(e.to_string().contains("behind"), "{e}");
    assert!(s.members.servers[1].refused, "declared at the next tick");
    assert!(s.members.claimed.is_empty());
    assert!(
        s.recovery.unrecorded_kept.is_empty(),
        "recovered again, on the record"
    );
}

/// A server's beat for slot `id` from `incarnation`, saying where it serves.
async fn beat_from(
    shared: &Arc<Shared>,
    id: u32,
    incarnation: u64,
    address: &str,
) -> Result<HeartbeatReply, tonic::Status> {
    let request = HeartbeatRequest {
        role: Role::Server as i32,
        id,
        ready: true,
        incarnation,
        address: address.into(),
        pid: 4242,
        ..Default::default()
    };
    Service(shared.clone())
        .heartbeat(Request::new(request))
        .await
        .map(|r| r.into_inner())
}

/// The same takeover, but the claimer joined through the outage: the record lists no
/// spare of its incarnation, which the earlier leader handed out past the record's count.
/// It is adopted as a spare of the record and keeps the slot with its shard. Fenced as a
/// stranger, as before, its slot was rebuilt again. An incarnation the record's count
/// covers, or a beat with no address, is still a stranger's.
#[tokio::test]
async fn a_process_that_joined_through_an_outage_claims_its_slot_as_a_spare_of_the_record() {
    let unrecorded = |shared: &Shared| {
        taken_over_with_a_claimer(shared);
        let mut s = shared.lock();
        s.members.spares.retain(|sp| sp.token != 7);
        s.members.unrecorded_incarnations = Some(100..200);
    };
    let shared = shared();
    unrecorded(&shared);
    let reply = beat_from(&shared, 1, 150, "127.0.0.1:7450").await.unwrap();
    assert!(!reply.stop);
    {
        let s = shared.lock();
        let slot = &s.members.servers[1];
        assert_eq!(
            (slot.incarnation, slot.alive, slot.ready),
            (150, true, true)
        );
        assert_eq!((slot.address.as_str(), slot.pid), ("127.0.0.1:7450", 4242));
        assert_eq!(s.placement.servers[1], "127.0.0.1:7450");
        assert!(
            s.members.zombies.contains(&6),
            "the record's process is fenced"
        );
        let adopted = s.members.spares.iter().find(|sp| sp.token == 150).unwrap();
        assert_eq!(adopted.assigned, Some(1));
        assert!(s.members.claimed.contains(&1));
        assert!(s.recovery.failed.is_empty(), "nothing to rebuild");
    }
    // Its next beats are the slot's own.
    assert!(
        !beat_from(&shared, 1, 150, "127.0.0.1:7450")
            .await
            .unwrap()
            .stop
    );

    for (incarnation, address) in [(99, "127.0.0.1:7450"), (150, "")] {
        let shared = self::shared();
        unrecorded(&shared);
        let refused = match beat_from(&shared, 1, incarnation, address).await {
            Ok(reply) => reply.stop,
            Err(_) => true,
        };
        assert!(
            refused,
            "incarnation {incarnation} at {address:?} was let in"
        );
        let s = shared.lock();
        assert_eq!(
            s.members.servers[1].incarnation, 6,
            "{incarnation} {address:?}"
        );
        assert!(
            s.members
                .spares
                .iter()
                .all(|sp| sp.token != incarnation as u32)
        );
    }
}

/// A spare that joined through the outage and still waits: to the new leader it was an
/// unknown spare (refused on every beat until it gave up, 10 minutes later), though the
/// job's own leader had let it in. It is adopted as a free spare of the record; a token
/// the record's count covers is still unknown.
#[tokio::test]
async fn a_spare_that_joined_through_an_outage_and_waits_is_adopted_as_a_free_spare() {
    let shared = shared();
    taken_over_with_a_claimer(&shared);
    shared.lock().members.unrecorded_incarnations = Some(100..200);
    let spare_beat = |token: u32, address: &'static str| {
        let shared = shared.clone();
        async move {
            let request = HeartbeatRequest {
                role: Role::Server as i32,
                id: token,
                spare: true,
                incarnation: u64::from(token),
                address: address.into(),
                pid: 4343,
                ..Default::default()
            };
            Service(shared).heartbeat(Request::new(request)).await
        }
    };
    let e = spare_beat(99, "127.0.0.1:7499").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e}");
    let reply = spare_beat(120, "127.0.0.1:7420")
        .await
        .unwrap()
        .into_inner();
    assert!(!reply.stop && reply.assign.is_none());
    let s = shared.lock();
    let adopted = s.members.spares.iter().find(|sp| sp.token == 120).unwrap();
    assert_eq!(adopted.member.address, "127.0.0.1:7420");
    assert_eq!((adopted.assigned, adopted.unheard), (None, false));
    assert!(adopted.member.alive && adopted.member.joined);
    assert!(s.members.spares.iter().all(|sp| sp.token != 99));
}
