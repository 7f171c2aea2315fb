//! One fault from the moment it strikes to the moment the job has recovered from it:
//! what it does to the cluster, what the soak waits to see (a failure detected, a new
//! leader, the lost slot rebuilt), and how the host is put right afterwards, as an
//! operator's supervisor would (the old process killed, the link restored, a new spare
//! or standby started on the host).

use rand::Rng;
use rand::seq::SliceRandom;
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::Serialize;

use ftrec_proto::timeline::EventKind;

mod leader;

use super::cluster::{Cluster, server_host, worker_host};
use super::schedule::FaultKind;
use crate::error::Result;
use leader::etcd_rules;

/// How long a zombie stays frozen, a lossy server lossy, the leader cut off from etcd,
/// quorum lost, and an etcd member down.
const ZOMBIE_SECONDS: f64 = 8.0;
const LOSS_SECONDS: f64 = 30.0;
const LOSS_PROBABILITY: f64 = 0.05;
const LEADER_CUT_SECONDS: f64 = 10.0;
const QUORUM_LOSS_SECONDS: f64 = 30.0;
const ETCD_DOWN_SECONDS: f64 = 5.0;
/// A fault the job has not noticed in this long is written down as undetected and undone
/// (long enough for a detection that waits out a quorum loss).
const DETECT_WITHIN: f64 = 60.0;

/// One fault as the report gives it; times are seconds after training started.
#[derive(Clone, Debug, Serialize)]
pub struct FaultRecord {
    pub kind: FaultKind,
    pub planned_at: f64,
    pub injected_at: f64,
    /// How long it waited for the job to recover from earlier faults.
    pub delayed_seconds: f64,
    /// Whom it struck (`h3 (server 1)`, `c0 (leader)`, `e2`).
    pub target: String,
    /// Injection to the failure detected (or the new leader's lead).
    pub detect_seconds: Option<f64>,
    /// Injection to training going on again.
    pub resume_seconds: Option<f64>,
    /// Injection to full redundancy (every lost slot rebuilt).
    pub redundant_seconds: Option<f64>,
    /// Over, and the job went on.
    pub over: bool,
    /// When the soak saw it over (seconds after training started).
    pub over_at: Option<f64>,
    /// Steps the job committed from the injection to `over_at`.
    pub steps_during: Option<u64>,
    /// `over_at` less `injected_at`, less the time the failure-free run takes for
    /// `steps_during`: the training time this fault cost (the report fills it in; faults
    /// that overlap share their windows, so their sum can exceed the soak's whole loss).
    pub lost_training_seconds: Option<f64>,
    pub notes: Vec<String>,
}

/// The state of one fault still being followed.
pub struct Active {
    pub record: FaultRecord,
    /// When it struck, on the cluster's clock.
    t0: f64,
    hosts: Vec<String>,
    slots: Vec<usize>,
    detected: Vec<Option<f64>>,
    worker: Option<String>,
    directions: (bool, bool),
    coordinator: Option<(usize, String)>,
    etcd: Vec<usize>,
    undone: bool,
    repaired: bool,
    spurious: bool,
}

/// What admission needs to know of an active fault.
impl Active {
    pub fn servers_lost(&self) -> usize {
        if self.record.kind == FaultKind::Loss && !self.spurious {
            return 0;
        }
        self.slots.len()
    }

    pub fn control_plane(&self) -> bool {
        self.record.kind.control_plane()
    }

    pub fn lossy(&self) -> bool {
        self.record.kind == FaultKind::Loss
    }

    /// The hosts it holds: the supervisor leaves them to it.
    pub fn held(&self) -> Vec<String> {
        let mut held = self.hosts.clone();
        held.extend(self.etcd.iter().map(|i| format!("e{i}")));
        held
    }
}

/// Server slots that are healthy and not struck by an active fault, with their hosts.
fn healthy_slots(cluster: &mut Cluster, busy: &[String]) -> Vec<(usize, String)> {
    let slots: Vec<(usize, String)> = cluster.slots.iter().map(|(s, h)| (*s, h.clone())).collect();
    slots
        .into_iter()
        .filter(|(_, h)| !busy.contains(h))
        .filter(|(_, h)| {
            cluster
                .servers
                .get_mut(h)
                .is_some_and(|p| p.alive() && !p.frozen)
        })
        .collect()
}

/// Strikes with `kind` now, or returns `None` where nothing it could strike is healthy
/// (it then waits).
#[allow(clippy::too_many_arguments)]
pub fn strike(
    cluster: &mut Cluster,
    rng: &mut Xoshiro256PlusPlus,
    kind: FaultKind,
    planned_at: f64,
    train_origin: f64,
    busy: &[String],
    workers: usize,
) -> Result<Option<Active>> {
    let t0 = cluster.now();
    let mut a = Active {
        record: FaultRecord {
            kind,
            planned_at,
            injected_at: t0 - train_origin,
            delayed_seconds: (t0 - train_origin - planned_at).max(0.0),
            target: String::new(),
            detect_seconds: None,
            resume_seconds: None,
            redundant_seconds: None,
            over: false,
            over_at: None,
            steps_during: None,
            lost_training_seconds: None,
            notes: Vec::new(),
        },
        t0,
        hosts: Vec::new(),
        slots: Vec::new(),
        detected: Vec::new(),
        worker: None,
        directions: (true, true),
        coordinator: None,
        etcd: Vec::new(),
        undone: false,
        repaired: false,
        spurious: false,
    };
    let healthy = healthy_slots(cluster, busy);
    let pick_server = |rng: &mut Xoshiro256PlusPlus| healthy.choose(rng).cloned();
    match kind {
        FaultKind::ServerKill
        | FaultKind::ServerFreeze
        | FaultKind::ServerZombie
        | FaultKind::LinkDown
        | FaultKind::Partition
        | FaultKind::Loss
        | FaultKind::EtcdQuorumLoss => {
            let Some((slot, host)) = pick_server(rng) else {
                return Ok(None);
            };
            a.record.target = format!("{host} (server {slot})");
            match kind {
                FaultKind::ServerKill => {
                    if let Some(p) = cluster.servers.get_mut(&host) {
                        p.kill();
                    }
                }
                FaultKind::EtcdQuorumLoss => {
                    // Quorum goes at the kill: the job detects the failure and recovers
                    // (or waits to) with two of three etcd members gone.
                    if let Some(p) = cluster.servers.get_mut(&host) {
                        p.kill();
                    }
                    let up: Vec<usize> = (0..3).filter(|&i| cluster.etcd_up(i)).take(2).collect();
                    for &i in &up {
                        if let Some(p) = cluster.etcd[i].proc.as_mut() {
                            p.signal("STOP");
                        }
                    }
                    a.record.target.push_str(&format!(
                        "; etcd {} frozen for {QUORUM_LOSS_SECONDS} s",
                        up.iter()
                            .map(|i| format!("e{i}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                    a.etcd = up;
                }
                FaultKind::ServerFreeze | FaultKind::ServerZombie => {
                    if let Some(p) = cluster.servers.get_mut(&host) {
                        p.signal("STOP");
                    }
                }
                FaultKind::LinkDown => {
                    let h = cluster.net.host(&host).clone();
                    cluster.net.link(&h, false)?;
                }
                FaultKind::Partition => {
                    let w = rng.gen_range(0..workers);
                    let directions = match rng.gen_range(0..3) {
                        0 => (true, false),
                        1 => (false, true),
                        _ => (true, true),
                    };
                    let (wh, sh) = (
                        cluster.net.host(&worker_host(w)).clone(),
                        cluster.net.host(&host).clone(),
                    );
                    cluster
                        .net
                        .partition(&wh, &sh, directions.0, directions.1, true)?;
                    a.worker = Some(worker_host(w));
                    a.directions = directions;
                    let way = match directions {
                        (true, false) => "worker to server",
                        (false, true) => "server to worker",
                        _ => "both ways",
                    };
                    a.record.target =
                        format!("{} <-> {host} (server {slot}), {way}", worker_host(w));
                }
                FaultKind::Loss => {
                    let h = cluster.net.host(&host).clone();
                    cluster.net.loss(&h, LOSS_PROBABILITY, true)?;
                }
                _ => {}
            }
            a.hosts.push(host);
            a.slots.push(slot);
            a.detected.push(None);
        }
        FaultKind::Rack => {
            let racks = cluster.net.racks();
            let mut eligible: Vec<usize> = (0..racks)
                .filter(|&r| {
                    let on: Vec<&(usize, String)> = healthy
                        .iter()
                        .filter(|(_, h)| cluster.net.host(h).rack == Some(r))
                        .collect();
                    on.len() == 2
                })
                .collect();
            eligible.shuffle(rng);
            let Some(&rack) = eligible.first() else {
                return Ok(None);
            };
            for (slot, host) in healthy
                .iter()
                .filter(|(_, h)| cluster.net.host(h).rack == Some(rack))
            {
                a.hosts.push(host.clone());
                a.slots.push(*slot);
                a.detected.push(None);
            }
            a.record.target = format!(
                "rack {rack}: {}",
                a.hosts
                    .iter()
                    .zip(&a.slots)
                    .map(|(h, s)| format!("{h} (server {s})"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            cluster.net.rack_uplink(rack, false)?;
        }
        FaultKind::LeaderKill | FaultKind::LeaderEtcdCut => {
            let Some(i) = cluster.leader else {
                return Ok(None);
            };
            let standby_ready = cluster
                .coordinators
                .iter_mut()
                .enumerate()
                .any(|(j, c)| j != i && c.alive());
            if !standby_ready {
                return Ok(None);
            }
            let (name, host) = {
                let c = &mut cluster.coordinators[i];
                (c.name.clone(), c.host.clone())
            };
            let slot = host.trim_start_matches('c').parse().unwrap_or(0);
            a.record.target = format!("{host} (leader {name})");
            if kind == FaultKind::LeaderKill {
                cluster.coordinators[i].kill();
            } else {
                etcd_rules(cluster, &host, true)?;
            }
            a.hosts.push(host);
            a.coordinator = Some((slot, name));
        }
        FaultKind::EtcdRestart => {
            let i = rng.gen_range(0..3);
            if let Some(p) = cluster.etcd[i].proc.as_mut() {
                p.kill();
            }
            a.etcd.push(i);
            a.record.target = format!("e{i}");
        }
    }
    Ok(Some(a))
}

impl Active {
    fn rel(&self, t: f64) -> f64 {
        t - self.t0
    }

    /// Follows the fault one poll further: undoes what is due, repairs hosts once the job
    /// has replaced what it lost, and says whether it is over.
    pub fn advance(
        &mut self,
        cluster: &mut Cluster,
        first_progress_after: &dyn Fn(f64) -> Option<f64>,
    ) -> Result<bool> {
        let now = cluster.now();
        let since = now - self.t0;
        let kind = self.record.kind;
        match kind {
            FaultKind::LeaderKill | FaultKind::LeaderEtcdCut => {
                self.advance_leader(cluster, now, since, first_progress_after)?
            }
            FaultKind::EtcdRestart => {
                if !self.undone && since >= ETCD_DOWN_SECONDS {
                    for &i in &self.etcd {
                        cluster.start_etcd(i, true)?;
                    }
                    self.undone = true;
                }
                if self.undone && since >= ETCD_DOWN_SECONDS + 3.0 {
                    self.record.over = true;
                }
            }
            _ => self.advance_servers(cluster, since, first_progress_after)?,
        }
        Ok(self.record.over)
    }

    fn advance_servers(
        &mut self,
        cluster: &mut Cluster,
        since: f64,
        first_progress_after: &dyn Fn(f64) -> Option<f64>,
    ) -> Result<()> {
        let kind = self.record.kind;
        for (i, &slot) in self.slots.iter().enumerate() {
            if self.detected[i].is_none() {
                self.detected[i] =
                    cluster.events_since(EventKind::FailureDetected, Some(slot), self.t0);
            }
        }
        let all_detected = self.detected.iter().all(Option::is_some);
        let first_detect = self.detected.iter().flatten().copied().reduce(f64::min);
        if let Some(t) = first_detect {
            self.record.detect_seconds.get_or_insert(self.rel(t));
        }
        // Timed undos: a zombie thawed, loss lifted, quorum back.
        match kind {
            FaultKind::ServerZombie if !self.undone && since >= ZOMBIE_SECONDS => {
                for h in &self.hosts {
                    if let Some(p) = cluster.servers.get_mut(h) {
                        p.signal("CONT");
                    }
                }
                self.undone = true;
            }
            FaultKind::Loss if !self.undone && since >= LOSS_SECONDS => {
                let h = cluster.net.host(&self.hosts[0]).clone();
                cluster.net.loss(&h, LOSS_PROBABILITY, false)?;
                self.undone = true;
            }
            FaultKind::EtcdQuorumLoss if !self.undone && since >= QUORUM_LOSS_SECONDS => {
                for &i in &self.etcd {
                    if let Some(p) = cluster.etcd[i].proc.as_mut() {
                        p.signal("CONT");
                    }
                }
                self.undone = true;
            }
            _ => {}
        }
        if kind == FaultKind::Loss {
            if self.detected[0].is_some() && !self.spurious {
                self.spurious = true;
                self.record
                    .notes
                    .push("a failure was declared under loss (a false recovery)".into());
            }
            if !self.spurious {
                if self.undone {
                    self.record.over = true;
                }
                return Ok(());
            }
        }
        if kind == FaultKind::ServerZombie
            && !all_detected
            && self.undone
            && since >= ZOMBIE_SECONDS + 3.0
            && cluster
                .servers
                .get_mut(&self.hosts[0])
                .is_some_and(|p| p.alive())
        {
            // Thawed before anyone declared it dead (the control plane may have been
            // unable to decide meanwhile): it simply serves on.
            self.record
                .notes
                .push("thawed before it was declared dead; it serves on".into());
            self.record.over = true;
            return Ok(());
        }
        if !all_detected && since >= DETECT_WITHIN {
            self.record
                .notes
                .push(format!("not detected within {DETECT_WITHIN} s"));
            self.restore(cluster)?;
            self.record.over = true;
            return Ok(());
        }
        let thawed = kind != FaultKind::ServerZombie || self.undone;
        if all_detected && !self.repaired && thawed {
            if kind == FaultKind::ServerZombie {
                // Give the zombie a moment to learn it was replaced and leave by itself.
                let exited = cluster
                    .servers
                    .get_mut(&self.hosts[0])
                    .is_some_and(|p| !p.alive());
                if !exited && since < ZOMBIE_SECONDS + 3.0 {
                    return Ok(());
                }
                self.record.notes.push(if exited {
                    "the zombie left by itself once thawed".into()
                } else {
                    "the zombie was still running 3 s after its thaw; killed".into()
                });
            }
            self.restore(cluster)?;
            self.repaired = true;
        }
        // Resumed: the first step counted after the recovery that followed the detection.
        if let Some(t) = first_detect
            && self.record.resume_seconds.is_none()
            && let Some(r) = cluster
                .events_since(EventKind::RecoveryEnd, None, t)
                .and_then(first_progress_after)
        {
            self.record.resume_seconds = Some(self.rel(r));
        }
        if all_detected {
            let rebuilt: Vec<Option<f64>> = self
                .slots
                .iter()
                .zip(&self.detected)
                .map(|(&s, d)| {
                    d.and_then(|d| cluster.events_since(EventKind::RebuildEnd, Some(s), d))
                })
                .collect();
            let quorum_back = kind != FaultKind::EtcdQuorumLoss || self.undone;
            // Training must have gone on too: after a quorum loss full redundancy came
            // back before the first step, the next fault struck then, and the first's
            // resume was counted after the second's.
            let resumed = first_detect.is_none() || self.record.resume_seconds.is_some();
            if rebuilt.iter().all(Option::is_some) && self.repaired && quorum_back && resumed {
                let last = rebuilt.iter().flatten().copied().fold(f64::MIN, f64::max);
                self.record.redundant_seconds = Some(self.rel(last));
                self.record.over = true;
            }
        }
        Ok(())
    }

    /// Puts the struck hosts right: the network restored, the old process gone, a spare
    /// started in its place.
    fn restore(&mut self, cluster: &mut Cluster) -> Result<()> {
        match self.record.kind {
            FaultKind::LinkDown => {
                let h = cluster.net.host(&self.hosts[0]).clone();
                cluster.net.link(&h, true)?;
            }
            FaultKind::Partition => {
                if let Some(w) = &self.worker {
                    let (wh, sh) = (
                        cluster.net.host(w).clone(),
                        cluster.net.host(&self.hosts[0]).clone(),
                    );
                    cluster
                        .net
                        .partition(&wh, &sh, self.directions.0, self.directions.1, false)?;
                }
            }
            FaultKind::Rack => {
                if let Some(rack) = cluster.net.host(&self.hosts[0]).rack {
                    // The old processes die before the rack comes back: they were replaced.
                    for h in &self.hosts {
                        if let Some(p) = cluster.servers.get_mut(h) {
                            p.kill();
                        }
                    }
                    cluster.net.rack_uplink(rack, true)?;
                }
            }
            FaultKind::Loss if !self.undone => {
                let h = cluster.net.host(&self.hosts[0]).clone();
                cluster.net.loss(&h, LOSS_PROBABILITY, false)?;
                self.undone = true;
            }
            _ => {}
        }
        for h in self.hosts.clone() {
            if let Some(p) = cluster.servers.get_mut(&h) {
                p.kill();
            }
            let index = h.trim_start_matches('h').parse().unwrap_or(0);
            debug_assert_eq!(server_host(index), h);
            cluster.start_server(index, None)?;
        }
        Ok(())
    }
}
