//! The control plane in the simulation (issue 42, §2): an etcd host (the in-memory etcd
//! serving etcd's own gRPC over turmoil), two coordinators under `membership = "etcd"`
//! (one leader, one standby), and members that find the leader in etcd. The schedule's
//! control-plane fault (the leader crashed or frozen, etcd paused or slow) strikes alone
//! or beside a member crash (by the clock, or a worker's own fault point at a step), and every grant a coordinator makes is logged in simulated
//! order, so that a check can tell whether two leaders' decisions ever interleaved.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ftrec_cluster::parity_check::verify_parity;
use ftrec_config::{JobConfig, Membership};
use ftrec_coordinator::{CoordinatorOptions, TestHooks};
use ftrec_etcd_memory::MemoryEtcd;
use ftrec_faults::{FaultAction, FaultSpec, Faults};
use ftrec_rpc::{Job, PsError};

use crate::SimError;
use crate::cluster::{
    BASE_LATENCY, Hosts, ONE_AT_A_TIME, QUIET_STEPS, SharedRequests, SimSpawner, align_task_ids,
    job_on, requests, trace_of,
};
use crate::control_schedule::{ControlFault, ControlSchedule};
use crate::{Member, Outcome};

/// The etcd host, and the port it serves on.
pub const ETCD: &str = "etcd";
const ETCD_PORT: u16 = 2379;
/// The coordinators of every control-plane run: one leader and one standby.
pub const COORDINATORS: usize = 2;
const COORDINATOR_PORT: u16 = 7000;
/// The standbys start this long after the first coordinator.
const STANDBY_AFTER: Duration = Duration::from_millis(150);
/// The simulation's client: it ends the run once a coordinator reported.
const OBSERVER: &str = "observer";
/// A crashed coordinator's host starts again (as a standby) this long after, as `cluster
/// run --coordinators N` starts a new standby for each one that dies: after the standby
/// took over (a lease TTL), so that the takeover is the standby's.
const COORDINATOR_RESTART: Duration = Duration::from_secs(5);

/// The coordinator host of slot `index`.
pub fn coordinator_host(index: usize) -> String {
    format!("coordinator-{index}")
}

/// Makes `config` a job whose membership lives in the simulation's etcd, with etcd's
/// shortest lease (a takeover costs one TTL).
pub fn etcd_membership(config: &mut JobConfig) {
    let c = &mut config.cluster;
    c.membership = Membership::Etcd;
    c.etcd_endpoints = vec![format!("{ETCD}:{ETCD_PORT}")];
    c.etcd_prefix = Some("/ftrec/sim".into());
    c.etcd_lease_ttl_s = ftrec_config::MIN_LEASE_TTL_S;
}

/// One control-plane run to simulate.
pub struct ControlRun {
    /// The job; [`run_control`] puts its membership in etcd.
    pub config: JobConfig,
    pub seed: u64,
    pub schedule: ControlSchedule,
    pub time_limit: Duration,
    /// The planted bug: leaders grant without checking their lease.
    pub plant_grant_bug: bool,
}

/// A step granted, in simulated order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub coordinator: usize,
    pub epoch: u64,
    pub step: u64,
    /// Whether etcd's leader key named this coordinator when it granted, under a lease
    /// whose deadline had not passed (read from the in-memory etcd's state at that
    /// simulated instant, whatever its knobs hold back: a paused etcd expires the lease
    /// only once it resumes, but a grant after the deadline was covered by nothing).
    pub held_lease: bool,
    /// Whether etcd named another coordinator the leader then, under a live lease: a
    /// grant beside a leader that is surely alive, which no mode allows (a leader acting
    /// through an etcd outage grants while etcd names nobody it can reach).
    pub beside_leader: bool,
}

/// What a control-plane run ended with.
#[derive(Clone, Debug)]
pub struct ControlOutcome {
    pub outcome: Result<Outcome, String>,
    /// Every step granted by any coordinator, in the order the simulation ran them.
    pub grants: Vec<Grant>,
    /// Which coordinator led when each control-plane fault struck, and the leaders seen.
    pub leaders: Vec<String>,
}

type Slot = Arc<Mutex<Option<Result<Outcome, String>>>>;

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What every coordinator host shares.
#[derive(Clone)]
struct Coordinators {
    job: Job,
    spawner: Arc<SimSpawner>,
    limit: Duration,
    progress: Arc<AtomicU64>,
    slot: Slot,
    grants: Arc<Mutex<Vec<Grant>>>,
    plant: bool,
    etcd: MemoryEtcd,
    leader_key: String,
    /// Each coordinator's fault points (by index), shared by its restarts; a kill there
    /// names its host in `crashes`, for the driver to crash between ticks.
    faults: Vec<Faults>,
}

impl Coordinators {
    fn start(&self, sim: &mut turmoil::Sim<'_>, index: usize) {
        let host = coordinator_host(index);
        let starts = Arc::new(AtomicUsize::new(0));
        let this = self.clone();
        let name = host.clone();
        sim.host(name.as_str(), move || {
            // The first coordinator starts as the leader; every other start, and every
            // restart, waits as a standby.
            let first = starts.fetch_add(1, Ordering::SeqCst) == 0;
            let standby = index > 0 || !first;
            let (this, host) = (this.clone(), host.clone());
            async move {
                // As `cluster run` does: the standbys start once the leader is elected.
                if index > 0 && first {
                    tokio::time::sleep(STANDBY_AFTER).await;
                }
                coordinate(this, index, host, standby).await;
                Ok(())
            }
        });
    }
}

/// One coordinator's host: leads (now or after a takeover) to the end of the run, gathers
/// the model and publishes the outcome; a coordinator that never led, or was deposed,
/// publishes nothing and stays idle.
async fn coordinate(c: Coordinators, index: usize, host: String, standby: bool) {
    let job = job_on(&c.job, &host);
    let grants = c.grants.clone();
    let (etcd, key, me) = (c.etcd.clone(), c.leader_key.clone(), host.clone());
    let hooks = TestHooks {
        grant_without_lease_check: c.plant,
        on_grant: Some(Arc::new(move |epoch, step| {
            let leased = leased_leader(&etcd, &key);
            let held_lease = leased.as_ref().is_some_and(|l| *l == me);
            locked(&grants).push(Grant {
                coordinator: index,
                epoch,
                step,
                held_lease,
                beside_leader: leased.is_some() && !held_lease,
            });
        })),
    };
    let started = ftrec_coordinator::start_with(
        CoordinatorOptions {
            job: job.clone(),
            host: "0.0.0.0".into(),
            port: COORDINATOR_PORT,
            spawner: Some(c.spawner.clone()),
            standby,
            id: Some(host.clone()),
            faults: c.faults[index].clone(),
            resume: None,
        },
        hooks,
    )
    .await;
    let mut handle = match started {
        Ok(h) if !h.inherited_done => h,
        Ok(_) => return std::future::pending().await,
        Err(e) => {
            tracing::info!("{host}: {e}");
            return std::future::pending().await;
        }
    };
    let shared = handle.shared.clone();
    let watched = shared.clone();
    let progress = c.progress.clone();
    let watch = tokio::spawn(async move {
        loop {
            progress.fetch_max(watched.summary().steps, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    let finished = handle.wait_done(c.limit).await;
    watch.abort();
    if let Err(e) = &finished
        && shared.is_deposed()
    {
        tracing::info!("{host}: {e}");
        return std::future::pending().await;
    }
    c.progress.store(u64::MAX, Ordering::SeqCst);
    let timeline = shared.timeline();
    let trace = trace_of(&timeline);
    let checked = async {
        finished?;
        let summary = shared.summary();
        let addresses = shared.server_addresses();
        let (state, _) = ftrec_rpc::gather::gather_state(&job, &addresses, summary.epoch).await?;
        let parity = if job.config.cluster.ft.erasure_coded() {
            Some(verify_parity(&job, &addresses, summary.epoch, &state).await?)
        } else {
            None
        };
        Ok::<_, PsError>(Outcome {
            summary,
            state_digest: state.digest().to_string(),
            parity,
            trace: trace.clone(),
            events: timeline.events,
            fired: Vec::new(),
            simulated_seconds: 0.0,
        })
    }
    .await;
    let outcome = checked.map_err(|e| format!("{host}: {e}\ntimeline:\n{}", trace.join("\n")));
    locked(&c.slot).get_or_insert(outcome);
    if let Err(e) = handle.finish().await {
        tracing::info!("{host}: resigning: {e}");
    }
    shared.stop();
    std::future::pending().await
}

/// The coordinator the leader key names, while its lease's deadline has not passed.
fn leased_leader(etcd: &MemoryEtcd, key: &str) -> Option<String> {
    let kv = etcd.get(key.as_bytes())?;
    let deadline = etcd.lease_deadline(kv.lease)?;
    (deadline > tokio::time::Instant::now())
        .then(|| leader_named(&kv.value))
        .flatten()
}

/// The coordinator that leads now, by the leader key.
fn leader(etcd: &MemoryEtcd, key: &str) -> Option<String> {
    leader_named(&etcd.get(key.as_bytes())?.value)
}

/// The coordinator a leader key's value names.
fn leader_named(value: &[u8]) -> Option<String> {
    let info: ftrec_etcd::LeaderInfo = serde_json::from_slice(value).ok()?;
    Some(info.id)
}

/// Control-plane faults in progress, undone when their time comes.
#[derive(Default)]
struct Undo {
    thaw: Vec<(Duration, String)>,
    resume: Option<Duration>,
    undelay: Option<Duration>,
    restart: Vec<(Duration, String)>,
}

/// Runs `opts` to its end. An error means the harness could not run it; a run that
/// failed is an `Err` inside the outcome.
pub fn run_control(opts: ControlRun) -> Result<ControlOutcome, SimError> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    align_task_ids()?;
    let mut config = opts.config;
    etcd_membership(&mut config);
    let job = Job::new(config).map_err(SimError::Job)?;
    let leader_key = format!("{}/leader", job.etcd_prefix());
    let cluster = job.config.cluster.clone();
    let mut sim = turmoil::Builder::new()
        .rng_seed(opts.seed)
        .simulation_duration(opts.time_limit + Duration::from_secs(30))
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::ZERO)
        .max_message_latency(BASE_LATENCY)
        // An etcd host held for a minute gets every held segment at once when released.
        .tcp_capacity(1 << 16)
        .build();
    let etcd = MemoryEtcd::new();
    let served = etcd.clone();
    sim.host(ETCD, move || {
        let served = served.clone();
        async move {
            let transport = crate::TurmoilTransport::new(ETCD);
            let (incoming, _) = ftrec_rpc::network::Transport::bind(&transport, ETCD_PORT).await?;
            served.serve_with_incoming(incoming).await?;
            Ok(())
        }
    });
    let shared_requests = SharedRequests::default();
    let mut members = Vec::new();
    members.extend((0..cluster.servers).map(Member::Server));
    members.extend((0..cluster.workers).map(Member::Worker));
    let registries: Vec<(Member, Faults)> = members
        .iter()
        .map(|&member| {
            let killed = shared_requests.clone();
            let faults = Faults::with_kill_hook(Arc::new(move |_spec: &FaultSpec| {
                requests(&killed).crash.push(member);
            }));
            (member, faults)
        })
        .collect();
    if let Some(k) = opts.schedule.worker_kill
        && let Some((_, faults)) = registries
            .iter()
            .find(|(m, _)| *m == Member::Worker(k.worker))
    {
        faults.arm(FaultSpec::new(
            k.point.name(),
            Some(k.step),
            FaultAction::Kill,
        ));
    }
    if let Some((server, stall)) = opts.schedule.stalled_stream
        && let Some((_, faults)) = registries
            .iter()
            .find(|(m, _)| *m == Member::Server(server))
    {
        faults.arm(FaultSpec::new(
            ftrec_faults::points::SEND_ROWS,
            None,
            FaultAction::Delay {
                ms: stall.as_millis() as u64,
            },
        ));
    }
    let mut all = vec![ETCD.to_string(), OBSERVER.to_string()];
    all.extend((0..COORDINATORS).map(coordinator_host));
    let mut hosts = Hosts {
        job: job.clone(),
        coordinator: None,
        registries,
        current: Vec::new(),
        all,
        frozen: Vec::new(),
        replacements: 0,
        on_new_host: false,
    };
    let crashes: Arc<Mutex<Vec<String>>> = Arc::default();
    let coordinator_faults: Vec<Faults> = (0..COORDINATORS)
        .map(|index| {
            let crashes = crashes.clone();
            Faults::with_kill_hook(Arc::new(move |_spec: &FaultSpec| {
                locked(&crashes).push(coordinator_host(index));
            }))
        })
        .collect();
    if let Some(point) = opts.schedule.coordinator_kill {
        coordinator_faults[point.coordinator()].arm(FaultSpec::new(
            point.name(),
            point.step(),
            FaultAction::Kill,
        ));
    }
    let slot = Slot::default();
    let grants = Arc::new(Mutex::new(Vec::new()));
    let steps_done = Arc::new(AtomicU64::new(0));
    let coordinators = Coordinators {
        job: job.clone(),
        spawner: Arc::new(SimSpawner(shared_requests.clone())),
        limit: opts.time_limit,
        progress: steps_done.clone(),
        slot: slot.clone(),
        grants: grants.clone(),
        plant: opts.plant_grant_bug,
        etcd: etcd.clone(),
        leader_key: leader_key.clone(),
        faults: coordinator_faults,
    };
    for index in 0..COORDINATORS {
        coordinators.start(&mut sim, index);
    }
    for &member in &members {
        hosts.start(&mut sim, member, member.host());
    }
    let observed = slot.clone();
    let limit = opts.time_limit;
    sim.client(OBSERVER, async move {
        let started = tokio::time::Instant::now();
        while locked(&observed).is_none() {
            if started.elapsed() > limit + Duration::from_secs(10) {
                locked(&observed).get_or_insert(Err(format!(
                    "no coordinator ended the run within {limit:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    });
    let quiet_from = job.config.train.steps.saturating_sub(QUIET_STEPS);
    let mut control = opts.schedule.control;
    let mut member = opts.schedule.member;
    let mut undo = Undo::default();
    let mut leaders = Vec::new();
    loop {
        let now = sim.elapsed();
        if steps_done.load(Ordering::SeqCst) >= quiet_from {
            control = None;
            member = None;
        }
        if let Some((at, fault)) = control
            && at <= now
            && let Some(led) = leader(&etcd, &leader_key)
        {
            control = None;
            leaders.push(led.clone());
            strike(&mut sim, &mut hosts, &etcd, &mut undo, now, fault, &led);
        }
        if let Some((at, m)) = member
            && at <= now
        {
            member = None;
            match opts.schedule.member_frozen_for {
                Some(lasting) => {
                    let host = hosts.of(m).to_string();
                    hosts.freeze(&sim, &host);
                    undo.thaw.push((now + lasting, host));
                }
                None => hosts.crash(&mut sim, m, &shared_requests),
            }
        }
        undo_due(&mut sim, &mut hosts, &etcd, &mut undo, now);
        hosts.serve(&mut sim, &shared_requests);
        for host in std::mem::take(&mut *locked(&crashes)) {
            // As `cluster run --coordinators N` replaces a dead coordinator: a new standby.
            sim.crash(host.as_str());
            undo.restart.push((now + COORDINATOR_RESTART, host));
        }
        match sim.step() {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => return Err(SimError::Simulation(e.to_string())),
        }
    }
    let simulated_seconds = sim.elapsed().as_secs_f64();
    let outcome = locked(&slot)
        .take()
        .ok_or_else(|| SimError::Simulation("no coordinator left an outcome".into()))?;
    let grants = locked(&grants).clone();
    Ok(ControlOutcome {
        outcome: outcome.map(|mut o| {
            o.simulated_seconds = simulated_seconds;
            o
        }),
        grants,
        leaders,
    })
}

/// Applies a control-plane fault to the leader `led` (or to etcd) at `now`.
fn strike(
    sim: &mut turmoil::Sim<'_>,
    hosts: &mut Hosts,
    etcd: &MemoryEtcd,
    undo: &mut Undo,
    now: Duration,
    fault: ControlFault,
    led: &str,
) {
    match fault {
        ControlFault::LeaderCrash => {
            sim.crash(led);
            undo.restart
                .push((now + COORDINATOR_RESTART, led.to_string()));
        }
        ControlFault::LeaderFreeze { lasting } => {
            hosts.freeze(sim, led);
            undo.thaw.push((now + lasting, led.to_string()));
        }
        ControlFault::EtcdPause { lasting } => {
            // `pause` alone still answers HTTP/2 pings: the host's links are held too,
            // as for a SIGSTOPped process.
            etcd.pause();
            hosts.freeze(sim, ETCD);
            undo.resume = Some(now + lasting);
        }
        ControlFault::SlowEtcd { delay, lasting } => {
            etcd.set_delay(Some(delay));
            undo.undelay = Some(now + lasting);
        }
    }
}

fn undo_due(
    sim: &mut turmoil::Sim<'_>,
    hosts: &mut Hosts,
    etcd: &MemoryEtcd,
    undo: &mut Undo,
    now: Duration,
) {
    while let Some(i) = undo.thaw.iter().position(|(at, _)| *at <= now) {
        let (_, host) = undo.thaw.remove(i);
        hosts.thaw(sim, &host);
    }
    while let Some(i) = undo.restart.iter().position(|(at, _)| *at <= now) {
        let (_, host) = undo.restart.remove(i);
        sim.bounce(host.as_str());
    }
    if undo.resume.is_some_and(|at| at <= now) {
        undo.resume = None;
        etcd.resume();
        hosts.thaw(sim, ETCD);
    }
    if undo.undelay.is_some_and(|at| at <= now) {
        undo.undelay = None;
        etcd.set_delay(None);
    }
}
