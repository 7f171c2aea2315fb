//! The coordinator's durable record (`cluster.membership = "etcd"`): everything a standby
//! needs to lead the job after this coordinator, in one etcd key written in one fenced
//! transaction. The control loop's decisions (a new epoch, a join, pruning old cuts) wait
//! until the record that holds them is written; the per-step path never waits: a flush
//! every `cluster.etcd_flush_ms` carries the step ledger's progress, and a new leader asks
//! the servers for the steps after it (`takeover.rs`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use ftrec_etcd::{EtcdError, Leadership};
use ftrec_proto::placement::PlacementMap;
use ftrec_proto::timeline::EventKind;
use ftrec_rpc::PsError;

use crate::Shared;
use crate::state::{Member, Phase, State};
use crate::summary::{CheckpointRecord, Failover, Recovery};

/// The record's key under the job's prefix.
pub const STATE_KEY: &str = "state";
/// The record's format; a coordinator refuses one it does not know.
const FORMAT: u32 = 1;
/// Reports kept in the record (the newest): a month-long job takes thousands of cuts, and
/// an etcd value stays far below etcd's 1.5 MiB request limit this way.
const KEPT_REPORTS: usize = 256;

/// One server's or worker's slot as the record keeps it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct MemberRecord {
    pub address: String,
    pub pid: u32,
    pub incarnation: u64,
    pub joined: bool,
    /// False for a slot declared dead whose replacement has not joined yet.
    pub alive: bool,
}

/// A spare server as the record keeps it: a new leader knows it, and gives it a slot,
/// as the old one would have (issue 42, hole 7: spares registered with one leader only
/// exited at its failover with "unknown spare", and a later dead server was never
/// replaced).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct SpareRecord {
    pub token: u32,
    pub address: String,
    pub pid: u32,
    /// The slot it was given, which it may not have heard of yet.
    pub assigned: Option<usize>,
    /// The live server that started it on its host (`Spare::hosted_by`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hosted_by: Option<usize>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Record {
    pub format: u32,
    /// The coordinator that wrote it, and its term.
    pub leader: String,
    pub term: u64,
    /// When it was written (seconds since the Unix epoch, the writer's clock).
    pub written_at_unix: f64,
    pub epoch: u64,
    pub started: bool,
    pub done: bool,
    /// Why the job cannot go on (a loss beyond its redundancy, a crash loop): a new
    /// leader ends with it rather than try again.
    #[serde(default)]
    pub fatal: Option<String>,
    /// Seconds trained (under every leader so far) when it was written.
    pub train_seconds: f64,
    pub placement: PlacementMap,
    pub servers: Vec<MemberRecord>,
    pub workers: Vec<MemberRecord>,
    /// Spares that joined and are alive (an older record has none).
    #[serde(default)]
    pub spares: Vec<SpareRecord>,
    pub next_token: u32,
    /// Every step below it is applied on every server.
    pub settled_through: u64,
    /// The samples of the steps below `settled_through` (retrained ones counted again).
    pub samples_settled: u64,
    pub lost_samples: u64,
    pub steps_rolled_back: u64,
    pub rpc_bytes: u64,
    pub zombies: Vec<u64>,
    pub last_checkpoint: Option<u64>,
    pub last_save: Option<u64>,
    pub retained_cuts: Vec<CheckpointRecord>,
    /// `cpr.uncoordinated`: each server's own saves on disk, by slot, oldest first.
    #[serde(default)]
    pub own_saves: Vec<Vec<u64>>,
    pub checkpoints: Vec<CheckpointRecord>,
    /// Slots waiting for (or in) a recovery, and slots rebuilding in the background: a
    /// new leader recovers them again.
    pub failed: Vec<usize>,
    pub rebuilding: Vec<usize>,
    pub recoveries: Vec<Recovery>,
    #[serde(default)]
    pub unrecorded_recoveries: Vec<usize>,
    pub worker_respawns: Vec<u32>,
    pub failovers: Vec<Failover>,
    /// The cut the current servers' shards came from (a resume or a move), and the moves
    /// done (an older record has neither: the job file's layout, from the seed).
    #[serde(default)]
    pub base: Option<BaseCut>,
    #[serde(default)]
    pub moves: Vec<crate::state::MoveRecord>,
    /// Incarnations of the servers a move retired (told to stop).
    #[serde(default)]
    pub retired: Vec<u64>,
    /// A move asked for and not yet switched to (its cut, once taken, and whether that
    /// committed: a new leader then switches itself).
    #[serde(default)]
    pub pending_move: Option<PendingMoveRecord>,
    /// The new layout's servers were joining after a switch: a new leader starts the slots
    /// no process joined, and joins stay fresh slots that load the base cut.
    #[serde(default)]
    pub joining: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct PendingMoveRecord {
    pub to: usize,
    pub asked_at: f64,
    pub cut: Option<u64>,
    pub committed: bool,
}

/// [`ftrec_proto::proto::ResumePoint`] in the record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct BaseCut {
    pub location: String,
    pub step: u64,
    pub servers: u32,
}

impl BaseCut {
    pub fn of(p: &ftrec_proto::proto::ResumePoint) -> Self {
        Self {
            location: p.location.clone(),
            step: p.step,
            servers: p.servers,
        }
    }

    pub fn point(&self) -> ftrec_proto::proto::ResumePoint {
        ftrec_proto::proto::ResumePoint {
            location: self.location.clone(),
            step: self.step,
            servers: self.servers,
        }
    }
}

/// This coordinator's leadership, and the writes of its record.
pub(crate) struct Durable {
    pub leadership: Leadership,
    pub id: String,
    /// One write at a time, each of the view at its start: an older view never lands
    /// after a newer one.
    writing: tokio::sync::Mutex<()>,
    /// The last flush failed (said once, until one succeeds).
    failing: AtomicBool,
    /// The lease TTL, for the report.
    pub ttl: Duration,
    /// This coordinator learned it no longer leads (etcd said so, or a server is in a
    /// newer leader's epoch). An atomic, not part of `State`: asked under its lock.
    deposed: AtomicBool,
}

impl Durable {
    pub fn new(leadership: Leadership, id: String) -> Self {
        Self {
            ttl: leadership.ttl(),
            leadership,
            id,
            writing: tokio::sync::Mutex::new(()),
            failing: AtomicBool::new(false),
            deposed: AtomicBool::new(false),
        }
    }
}

pub(crate) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn member_record(m: &Member) -> MemberRecord {
    MemberRecord {
        address: m.address.clone(),
        pid: m.pid,
        incarnation: m.incarnation,
        joined: m.joined,
        alive: m.alive,
    }
}

fn tail<T: Clone>(v: &[T]) -> Vec<T> {
    v[v.len().saturating_sub(KEPT_REPORTS)..].to_vec()
}

impl Record {
    /// The record of `s`, as `durable`'s leader writes it.
    pub fn of(shared: &Shared, s: &State, durable: &Durable) -> Self {
        let settled_through = s.steps.ledger.settled_through();
        let above: u64 = s
            .steps
            .ledger
            .settled_from(settled_through)
            .into_iter()
            .map(|step| shared.schedule.batch(step).1)
            .sum();
        Self {
            format: FORMAT,
            leader: durable.id.clone(),
            term: durable.leadership.term(),
            written_at_unix: unix_now(),
            epoch: s.epoch,
            started: s.steps.started,
            done: s.phase == Phase::Done && s.recovery.fatal.is_none(),
            // A deposed coordinator's reason is its own, not the job's (and it cannot
            // write anyway).
            fatal: s.recovery.fatal.clone().filter(|_| !s.leader.deposed),
            train_seconds: s.train_seconds() + s.leader.train_seconds_before,
            placement: s.placement.clone(),
            servers: s.members.servers.iter().map(member_record).collect(),
            workers: s.members.workers.iter().map(member_record).collect(),
            spares: s
                .members
                .spares
                .iter()
                .filter(|sp| sp.member.alive)
                .map(|sp| SpareRecord {
                    token: sp.token,
                    address: sp.member.address.clone(),
                    pid: sp.member.pid,
                    assigned: sp.assigned,
                    hosted_by: sp.hosted_by,
                })
                .collect(),
            next_token: s.members.next_token,
            settled_through,
            samples_settled: s.steps.samples.saturating_sub(above),
            lost_samples: s.steps.lost_samples,
            steps_rolled_back: s.recovery.steps_rolled_back,
            rpc_bytes: s.steps.rpc_bytes,
            zombies: s.members.zombies.iter().copied().collect(),
            last_checkpoint: s.saves.last_checkpoint,
            last_save: s.saves.last_save,
            retained_cuts: s.saves.retained_cuts.clone(),
            own_saves: s
                .cuts
                .own_saves
                .as_ref()
                .map(|o| o.retained().to_vec())
                .unwrap_or_default(),
            checkpoints: tail(&s.saves.checkpoints),
            failed: s.recovery.failed.iter().map(|&(id, _)| id).collect(),
            rebuilding: s.recovery.rebuilding.iter().map(|&(id, _)| id).collect(),
            recoveries: tail(&s.recovery.recoveries),
            unrecorded_recoveries: s.recovery.unrecorded_kept.clone(),
            worker_respawns: s.members.worker_respawns.clone(),
            failovers: s.leader.failovers.clone(),
            base: s.scaling.base.as_ref().map(BaseCut::of),
            moves: s.scaling.moves.clone(),
            retired: s.members.retired.iter().copied().collect(),
            pending_move: s.scaling.pending.as_ref().map(|m| PendingMoveRecord {
                to: m.to,
                asked_at: m.asked_at,
                cut: m.cut,
                committed: m.committed,
            }),
            joining: s.scaling.joining,
        }
    }

    /// Checks a record read from etcd against this job before anything is taken from it.
    pub fn check(&self, key: &str, servers: usize, workers: usize) -> Result<(), PsError> {
        if self.format != FORMAT {
            return Err(PsError::Config(format!(
                "etcd key {key} holds a record of format {} and this ftrec reads format \
                 {FORMAT}",
                self.format
            )));
        }
        // A move (`cluster scale`) leaves the job on another server count than its file's.
        let servers_differ = self.servers.len() != servers && self.moves.is_empty();
        if servers_differ || self.workers.len() != workers {
            return Err(PsError::Config(format!(
                "etcd key {key} records {} servers and {} workers; the job has {servers} \
                 and {workers}",
                self.servers.len(),
                self.workers.len()
            )));
        }
        Ok(())
    }

    /// A member of the record, alive as of now: it has a failure timeout to reach the
    /// new leader before it is declared dead.
    pub fn member(m: &MemberRecord, server: bool) -> Member {
        Member {
            address: m.address.clone(),
            pid: m.pid,
            joined: m.joined,
            alive: m.alive && m.joined,
            ready: m.alive && m.joined && server,
            last_seen: Some(Instant::now()),
            refused: false,
            incarnation: m.incarnation,
            cut_off: None,
        }
    }
}

impl Shared {
    /// Whether this coordinator may act: always with embedded membership; with etcd
    /// until it learns it was deposed. An etcd that does not answer deposes nothing:
    /// training goes on, and whatever a newer leader (if there is one) has taken over is
    /// refused by the servers' epoch fence; the decisions wait for etcd (`sync_durable`).
    pub(crate) fn leading(&self) -> bool {
        self.durable.as_ref().is_none_or(|d| {
            !d.deposed.load(Ordering::Relaxed) && d.leadership.lost().borrow().is_none()
        })
    }

    /// Whether this coordinator may take a decision now: with etcd membership, only while
    /// its lease is surely alive (renewed within the TTL). A coordinator that wakes from a
    /// freeze longer than its lease still `leading()` until etcd answers, and must not
    /// fence members meanwhile: a newer leader may hold them.
    pub(crate) fn may_decide(&self) -> bool {
        self.leading() && self.durable.as_ref().is_none_or(|d| d.leadership.valid())
    }

    /// Whether this leader acts through an etcd outage: its lease is in doubt (etcd has
    /// not answered a renewal within the TTL, and has not said the lease is gone), and
    /// `cluster.train_through_etcd_outage` lets an erasure-coded job under 2PC go on. No
    /// lease covers what it does then, so the servers' fences keep it safe: every epoch of
    /// a newer leader is above this one's, a server fenced by it commits nothing of this
    /// one's, and a step this one granted that some server applied is an orphan of the
    /// newer leader's takeover like any step of a leader that died in flight. What this
    /// one decides without a record (a server declared dead on hard evidence, a spare
    /// given its slot, the rebuild) a newer leader finds again from the servers: the dead
    /// port refuses its fence too, and the recovery runs again in its epoch.
    pub(crate) fn acts_through_outage(&self) -> bool {
        self.may_act_unrecorded() && !self.may_decide()
    }

    /// Whether a decision that etcd does not record in time may go on unrecorded: a
    /// leader, with `cluster.train_through_etcd_outage` in an erasure-coded job under
    /// 2PC, whether its lease is still sure or already in doubt ([`acts_through_outage`]
    /// says why that is safe).
    pub(crate) fn may_act_unrecorded(&self) -> bool {
        self.durable.is_some()
            && self.job.config.cluster.train_through_etcd_outage
            && self.job.config.two_phase_commit()
            && self.leading()
    }

    /// Whether a leader whose lease is in doubt grants steps now: only while it acts
    /// through the outage, training runs, and every server is well (heard within the
    /// failure timeout, none refused). A server that falls silent then cannot be declared
    /// dead without etcd (a freeze is not hard evidence), so grants stop until etcd
    /// answers rather than lose step after step to it.
    pub(crate) fn grants_through_outage(&self, s: &crate::state::State) -> bool {
        let timeout = Duration::from_millis(self.job.config.cluster.failure_timeout_ms);
        self.acts_through_outage()
            && s.phase == crate::state::Phase::Running
            && s.recovery.failed.is_empty()
            && s.members
                .servers
                .iter()
                .all(|m| m.alive && m.ready && !m.refused && m.silent_for() < timeout)
    }

    /// When this coordinator last reached etcd (an answered lease renewal); `None` with
    /// embedded membership.
    pub(crate) fn etcd_reached_at(&self) -> Option<Instant> {
        self.durable.as_ref()?.leadership.renewed_at()
    }

    /// `cluster.membership = "etcd"`.
    pub(crate) fn durable_membership(&self) -> bool {
        self.durable.is_some()
    }

    /// The answer of a coordinator that may no longer lead: the member asks etcd who does.
    pub(crate) fn check_leading(&self) -> Result<(), tonic::Status> {
        if self.leading() {
            return Ok(());
        }
        Err(PsError::NotLeader { leader: None }.into())
    }

    /// Writes the record now (no-op with embedded membership). A decision waits on this
    /// before anyone acts on it.
    pub(crate) async fn sync_durable(&self) -> Result<(), PsError> {
        let Some(d) = &self.durable else {
            return Ok(());
        };
        let _one_at_a_time = d.writing.lock().await;
        let bytes = {
            let s = self.lock();
            serde_json::to_vec(&Record::of(self, &s, d))
                .map_err(|e| PsError::Internal(format!("encoding the coordinator record: {e}")))?
        };
        match d.leadership.put(STATE_KEY, bytes).await {
            Ok(_) => {
                if d.failing.swap(false, Ordering::Relaxed) {
                    self.event(EventKind::Coordinator, "etcd answers again");
                }
                Ok(())
            }
            Err(EtcdError::Deposed(why)) => {
                self.deposed(&why);
                Err(PsError::Membership(EtcdError::Deposed(why)))
            }
            // A record changed behind this leader's back is not written over: like a
            // failed write, decisions wait, and the next flush tries again.
            Err(e @ EtcdError::Stale { .. }) => {
                if !d.failing.swap(true, Ordering::Relaxed) {
                    tracing::error!("writing the coordinator record: {e}");
                    self.event(
                        EventKind::Coordinator,
                        format!("the coordinator record was not written: {e}"),
                    );
                }
                Err(PsError::Membership(e))
            }
            Err(e) => {
                if !d.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "writing the coordinator record: {e}; training goes on while the \
                         lease holds"
                    );
                    self.event(
                        EventKind::Coordinator,
                        format!(
                            "etcd does not answer ({e}): training goes on while the lease \
                             holds and then waits, and decisions (recoveries, joins, pruning \
                             cuts) wait for etcd"
                        ),
                    );
                }
                Err(PsError::Membership(e))
            }
        }
    }

    /// This coordinator no longer leads: it stops without changing anything (it does not
    /// tell the members to stop: they belong to the new leader).
    pub(crate) fn deposed(&self, why: &str) {
        if let Some(d) = &self.durable {
            d.deposed.store(true, Ordering::Relaxed);
        }
        let mut s = self.lock();
        if !s.leader.depose() {
            return;
        }
        let message = format!(
            "this coordinator no longer leads the job and exits without changing anything: {why}"
        );
        tracing::error!("{message}");
        self.fail_run(&mut s, message);
    }
}

/// Writes the record every `cluster.etcd_flush_ms` until this coordinator is deposed.
pub(crate) async fn flush_loop(shared: Arc<Shared>) {
    let period = Duration::from_millis(shared.job.config.cluster.etcd_flush_ms);
    loop {
        tokio::time::sleep(period).await;
        if shared.lock().leader.deposed {
            return;
        }
        if let Err(PsError::Membership(EtcdError::Deposed(_))) = shared.sync_durable().await {
            return;
        }
    }
}

/// Ends the coordinator's run once its lease is lost.
pub(crate) async fn watch_leadership(shared: Arc<Shared>) {
    let Some(d) = &shared.durable else {
        return;
    };
    let mut lost = d.leadership.lost();
    let why = match lost.wait_for(|l| l.is_some()).await {
        Ok(why) => why.clone().unwrap_or_default(),
        Err(_) => return,
    };
    shared.deposed(&why);
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A record as a leader writes it, with every optional part present and absent.
    pub(crate) fn record(reports: bool) -> Record {
        let recovery = Recovery {
            server: 1,
            detected_at: 1.5,
            resumed_at: 2.0,
            resumed_step: 40,
            steps_rolled_back: 0,
            rebuild_seconds: 0.2,
            rebuild_bytes: 1 << 20,
            degraded_seconds: 0.5,
            background_rebuild: true,
            steps_while_degraded: 3,
            steps_committed_while_degraded: 2,
            kill_to_resume_seconds: None,
            first_step_at: Some(4.5),
            kill_to_first_step_seconds: None,
            epoch: 7,
            mode: crate::summary::RecoveryMode::Rebuild,
            // Skipped when empty: a reader must accept its absence.
            shard_digests: Vec::new(),
        };
        let cut = CheckpointRecord {
            step: 30,
            started_at: 1.0,
            pause_seconds: 0.01,
            bytes: 4096,
            ids: vec!["a".into(), "b".into()],
            priority: false,
        };
        let member = MemberRecord {
            address: "127.0.0.1:7001".into(),
            pid: 42,
            incarnation: 3,
            joined: true,
            alive: true,
        };
        Record {
            format: FORMAT,
            leader: "c1".into(),
            term: 9,
            written_at_unix: 1.0e9,
            epoch: (9 << 20) + 2,
            started: true,
            done: false,
            fatal: reports.then(|| "server 1 and server 2 lost at once".into()),
            train_seconds: 3.5,
            placement: PlacementMap {
                scheme: "striped".into(),
                version: 2,
                servers: vec!["127.0.0.1:7001".into(), "127.0.0.1:7002".into()],
            },
            servers: vec![member.clone(), member.clone()],
            workers: vec![member],
            spares: if reports {
                vec![SpareRecord {
                    token: 4,
                    address: "127.0.0.1:7009".into(),
                    pid: 43,
                    assigned: Some(1),
                    hosted_by: Some(0),
                }]
            } else {
                Vec::new()
            },
            next_token: 5,
            settled_through: 40,
            samples_settled: 5120,
            lost_samples: 0,
            steps_rolled_back: 0,
            rpc_bytes: 1 << 30,
            zombies: vec![2],
            last_checkpoint: reports.then_some(30),
            last_save: reports.then_some(30),
            retained_cuts: if reports {
                vec![cut.clone()]
            } else {
                Vec::new()
            },
            own_saves: Vec::new(),
            checkpoints: if reports { vec![cut] } else { Vec::new() },
            failed: vec![1],
            rebuilding: Vec::new(),
            recoveries: if reports { vec![recovery] } else { Vec::new() },
            unrecorded_recoveries: if reports { vec![2] } else { Vec::new() },
            worker_respawns: vec![0],
            failovers: vec![Failover {
                from: "c0".into(),
                to: "c1".into(),
                failover_seconds: 2.5,
                term: 9,
                first_step_at_unix: None,
            }],
            base: reports.then(|| BaseCut {
                location: "s3://b/ck".into(),
                step: 80,
                servers: 3,
            }),
            moves: Vec::new(),
            retired: if reports { vec![4, 5] } else { Vec::new() },
            pending_move: reports.then_some(PendingMoveRecord {
                to: 5,
                asked_at: 1.5,
                cut: Some(80),
                committed: true,
            }),
            joining: reports,
        }
    }

    #[test]
    fn a_record_reads_back_as_written() {
        for reports in [false, true] {
            let r = record(reports);
            let bytes = serde_json::to_vec(&r).unwrap();
            let back: Record = serde_json::from_slice(&bytes).unwrap();
            // Written again, it is the same bytes: nothing was lost on the way.
            assert_eq!(serde_json::to_vec(&back).unwrap(), bytes);
            back.check("/k/state", 2, 1).unwrap();
        }
    }

    #[test]
    fn a_record_of_another_shape_or_format_is_refused_naming_the_key() {
        let mut r = record(true);
        let e = r.check("/k/state", 3, 1).unwrap_err().to_string();
        assert!(e.contains("/k/state") && e.contains("2 servers"), "{e}");
        r.format = FORMAT + 1;
        let e = r.check("/k/state", 2, 1).unwrap_err().to_string();
        assert!(e.contains("/k/state") && e.contains("format"), "{e}");
    }
}
