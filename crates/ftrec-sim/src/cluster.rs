//! One simulated run: the real coordinator, servers and workers as turmoil hosts of one
//! simulation, a fault schedule applied between its ticks, and what the run ended with.
//!
//! The coordinator runs as the simulation's client: the run is over when it has seen
//! every step trained and gathered the model (or gave up). Servers and workers are hosts,
//! restarted in place when the coordinator asks for a replacement (its `Spawner`).

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ftrec_cluster::parity_check::{ParityReport, verify_parity};
use ftrec_config::JobConfig;
use ftrec_coordinator::{CoordinatorOptions, RunSummary, Spawner};
use ftrec_faults::{FaultSpec, Faults};
use ftrec_proto::proto::Role;
use ftrec_rpc::network::Network;
use ftrec_rpc::{Job, PsError};

use crate::SimError;
use crate::schedule::{Fault, Member, Schedule};
use crate::transport::TurmoilTransport;

/// Steps at the end of a run that no scheduled fault hits.
pub(crate) const QUIET_STEPS: u64 = 10;

/// The coordinator's simulated host, and the port it listens on.
pub const COORDINATOR: &str = "coordinator";
const COORDINATOR_PORT: u16 = 7000;

/// The network's latency when no fault raises it (each message takes a random time up to
/// this): replies interleave differently under each seed, and a step takes tens of
/// simulated milliseconds, so that a schedule's faults land while training runs.
pub(crate) const BASE_LATENCY: Duration = Duration::from_millis(5);

/// One run to simulate.
pub struct RunOptions {
    pub config: JobConfig,
    /// Seeds turmoil (message latencies, the order hosts run in) and nothing else: the
    /// schedule is drawn separately, so that a test can fix one and vary the other.
    pub seed: u64,
    pub schedule: Schedule,
    /// Fault points armed on members from the start: a planted bug.
    pub armed: Vec<(Member, FaultSpec)>,
    /// Simulated time after which the run counts as hung.
    pub time_limit: Duration,
    /// Replacements start on new hosts even for a crashed one, whose old address then
    /// stays silent (no refusal ever comes), instead of restarting in place.
    pub replace_on_new_host: bool,
}

/// What a run ended with.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub summary: RunSummary,
    /// The digest of the model gathered from the servers.
    pub state_digest: String,
    /// Erasure-coded modes: the end-of-run parity and replica check.
    pub parity: Option<ParityReport>,
    /// The coordinator's timeline, one line per event (simulated time, kind, subject,
    /// step, detail): equal across two runs of one seed.
    pub trace: Vec<String>,
    /// The same timeline's events, typed, for the checks.
    pub events: Vec<ftrec_proto::timeline::Event>,
    /// The planted fault points that fired, per member.
    pub fired: Vec<(Member, FaultSpec)>,
    pub simulated_seconds: f64,
}

/// Replacements the coordinator asked for, served by the driver between ticks.
#[derive(Default)]
pub(crate) struct Requests {
    pub(crate) restart: Vec<Member>,
    pub(crate) crash: Vec<Member>,
    /// Slots whose process the schedule crashed, until one is started again: what a
    /// launcher knows of its children ([`Spawner::exited`]).
    pub(crate) crashed: BTreeSet<Member>,
}

pub(crate) type SharedRequests = Arc<Mutex<Requests>>;

pub(crate) fn requests(shared: &SharedRequests) -> std::sync::MutexGuard<'_, Requests> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// The coordinator's way to start a replacement: restart the member's host.
pub(crate) struct SimSpawner(pub(crate) SharedRequests);

impl SimSpawner {
    fn restart(&self, member: Member) {
        let mut r = requests(&self.0);
        r.crashed.remove(&member);
        r.restart.push(member);
    }
}

impl Spawner for SimSpawner {
    fn spawn_server(&self, id: usize, _coordinator: &str) -> Result<(), PsError> {
        self.restart(Member::Server(id));
        Ok(())
    }

    fn spawn_worker(&self, id: usize, _coordinator: &str) -> Result<(), PsError> {
        self.restart(Member::Worker(id));
        Ok(())
    }

    fn exited(&self, role: Role, id: usize) -> bool {
        let member = match role {
            Role::Server => Member::Server(id),
            Role::Worker => Member::Worker(id),
            _ => return false,
        };
        requests(&self.0).crashed.contains(&member)
    }
}

/// The job as `member` sees it: the cluster's job over that member's simulated network.
pub(crate) fn job_on(job: &Job, host: &str) -> Job {
    job.clone()
        .with_network(Network::simulated(Arc::new(TurmoilTransport::new(host))))
}

/// The simulation's member hosts: which host serves each slot now, and which are silent.
pub(crate) struct Hosts {
    pub(crate) job: Job,
    /// The coordinator's fixed address, or none: members find the leader in etcd.
    pub(crate) coordinator: Option<String>,
    /// Each slot's fault registry, shared by every process that holds the slot.
    pub(crate) registries: Vec<(Member, Faults)>,
    pub(crate) current: Vec<(Member, String)>,
    pub(crate) all: Vec<String>,
    pub(crate) frozen: Vec<String>,
    pub(crate) replacements: u32,
    pub(crate) on_new_host: bool,
}

impl Hosts {
    /// The host that holds `member`'s slot now.
    /// Crashes `member`'s host (SIGKILL): its launcher learns that it exited.
    pub(crate) fn crash(&self, sim: &mut turmoil::Sim<'_>, member: Member, r: &SharedRequests) {
        requests(r).crashed.insert(member);
        sim.crash(self.of(member));
    }

    /// Serves what the members asked of the driver since the last tick: crashes (a fault
    /// point's kill) and replacements.
    pub(crate) fn serve(&mut self, sim: &mut turmoil::Sim<'_>, r: &SharedRequests) {
        let (restart, crash) = {
            let mut r = requests(r);
            (std::mem::take(&mut r.restart), std::mem::take(&mut r.crash))
        };
        for m in crash {
            self.crash(sim, m, r);
        }
        for m in restart {
            self.replace(sim, m);
        }
    }

    pub(crate) fn of(&self, member: Member) -> &str {
        self.current
            .iter()
            .rev()
            .find(|(m, _)| *m == member)
            .map_or("", |(_, h)| h.as_str())
    }

    /// A replacement restarts on the slot's host, as `cluster run` restarts a dead process
    /// on its machine; on a new host, as a spare machine would take the slot, when the old
    /// host is silent (or `on_new_host` asks for it: a crashed host then stays silent too,
    /// the real-failures issue's standard failure).
    pub(crate) fn replace(&mut self, sim: &mut turmoil::Sim<'_>, member: Member) {
        let current = self.of(member).to_string();
        if !self.on_new_host && !self.frozen.contains(&current) {
            sim.bounce(current.as_str());
            return;
        }
        self.replacements += 1;
        let host = format!("{}-r{}", member.host(), self.replacements);
        self.start(sim, member, host);
    }

    pub(crate) fn start(&mut self, sim: &mut turmoil::Sim<'_>, member: Member, host: String) {
        let faults = self
            .registries
            .iter()
            .find(|(m, _)| *m == member)
            .map(|(_, f)| f.clone())
            .unwrap_or_else(|| Faults::with_kill_hook(Arc::new(|_| {})));
        let job = job_on(&self.job, &host);
        let coordinator = match &self.coordinator {
            Some(address) => ftrec_rpc::leader::CoordinatorSource::Address(address.clone()),
            None => ftrec_rpc::leader::CoordinatorSource::Etcd,
        };
        sim.host(host.as_str(), move || {
            let (job, coordinator, faults) = (job.clone(), coordinator.clone(), faults.clone());
            async move {
                let result = match member {
                    Member::Server(id) => {
                        ftrec_server::run(ftrec_server::ServerOptions {
                            job,
                            id: Some(id),
                            coordinator,
                            host: "0.0.0.0".into(),
                            faults,
                            hosted_by: None,
                            // The simulation's schedules bring their replacements.
                            start_spare: None,
                        })
                        .await
                    }
                    Member::Worker(id) => {
                        ftrec_worker::run_async(ftrec_worker::WorkerOptions {
                            job,
                            id,
                            coordinator,
                            faults,
                        })
                        .await
                    }
                };
                // A member that gives up is a finding for the coordinator to act on (it
                // sees the silence), not an error of the simulation.
                if let Err(e) = result {
                    tracing::info!("{member} stopped: {e}");
                }
                Ok(())
            }
        });
        // A silent host stays silent to newcomers too.
        for frozen in &self.frozen {
            sim.hold(frozen.as_str(), host.as_str());
        }
        self.current.push((member, host.clone()));
        self.all.push(host);
    }

    pub(crate) fn freeze(&mut self, sim: &turmoil::Sim<'_>, host: &str) {
        for other in self.all.iter().filter(|h| *h != host) {
            sim.hold(host, other.as_str());
        }
        self.frozen.push(host.to_string());
    }

    pub(crate) fn thaw(&mut self, sim: &turmoil::Sim<'_>, host: &str) {
        self.frozen.retain(|h| h != host);
        // A link to a host still frozen stays held: releasing it let a frozen leader hear
        // a thawed server, and only that one, so it declared the other two dead at once
        // (the control-plane sweep, seed 175 with a server freeze); a stopped process
        // hears no one.
        for other in self.all.iter().filter(|h| *h != host) {
            if !self.frozen.contains(other) {
                sim.release(host, other.as_str());
            }
        }
    }
}

/// Simulations take turns in a process: tokio's task ids come from one counter per
/// process (see `align_task_ids`), so two at once would each change the other's run.
pub(crate) static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Runs `opts` to its end. An error means the harness could not run it; a run that
/// failed (a member gave up, the time limit passed) is an `Err` inside the outcome.
pub fn run(opts: RunOptions) -> Result<Result<Outcome, String>, SimError> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    align_task_ids()?;
    let job = Job::new(opts.config).map_err(SimError::Job)?;
    let cluster = job.config.cluster.clone();
    let mut sim = turmoil::Builder::new()
        .rng_seed(opts.seed)
        .simulation_duration(opts.time_limit + Duration::from_secs(30))
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::ZERO)
        .max_message_latency(BASE_LATENCY)
        .build();
    let shared_requests = SharedRequests::default();
    let mut registries = Vec::new();
    let mut members = Vec::new();
    members.extend((0..cluster.servers).map(Member::Server));
    members.extend((0..cluster.workers).map(Member::Worker));
    for &member in &members {
        let killed = shared_requests.clone();
        let faults = Faults::with_kill_hook(Arc::new(move |_spec: &FaultSpec| {
            requests(&killed).crash.push(member);
        }));
        for (m, spec) in &opts.armed {
            if *m == member {
                faults.arm(spec.clone());
            }
        }
        registries.push((member, faults));
    }
    let mut hosts = Hosts {
        job: job.clone(),
        coordinator: Some(format!("{COORDINATOR}:{COORDINATOR_PORT}")),
        registries: registries.clone(),
        current: Vec::new(),
        all: vec![COORDINATOR.to_string()],
        frozen: Vec::new(),
        replacements: 0,
        on_new_host: opts.replace_on_new_host,
    };
    for &member in &members {
        hosts.start(&mut sim, member, member.host());
    }
    let slot: Rc<RefCell<Option<Result<Outcome, String>>>> = Rc::default();
    let result_slot = slot.clone();
    let coordinator_job = job_on(&job, COORDINATOR);
    let spawner = Arc::new(SimSpawner(shared_requests.clone()));
    let limit = opts.time_limit;
    // Faults hit training, and none lands in its last steps: a server lost after the
    // last step is noticed by nobody before the end-of-run checks gather from it.
    let steps_done = Arc::new(AtomicU64::new(0));
    let progress = steps_done.clone();
    let quiet_from = job.config.train.steps.saturating_sub(QUIET_STEPS);
    sim.client(COORDINATOR, async move {
        let outcome = coordinate(coordinator_job, spawner, limit, &progress).await;
        *result_slot.borrow_mut() = Some(outcome);
        Ok(())
    });
    let mut pending = opts.schedule.events.clone();
    let mut thaw: Vec<(Duration, String)> = Vec::new();
    let mut repair: Vec<(Duration, String, String)> = Vec::new();
    let mut latency_until: Option<Duration> = None;
    loop {
        let now = sim.elapsed();
        if steps_done.load(Ordering::SeqCst) >= quiet_from {
            pending.clear();
        }
        while pending.first().is_some_and(|e| e.at <= now) {
            let event = pending.remove(0);
            match event.fault {
                Fault::Crash(m) => hosts.crash(&mut sim, m, &shared_requests),
                Fault::Bounce(m) => sim.bounce(hosts.of(m)),
                Fault::Latency { max, lasting } => {
                    sim.set_max_message_latency(max);
                    latency_until = Some(now + lasting);
                }
                Fault::Partition { a, b, lasting } => {
                    let (a, b) = (hosts.of(a).to_string(), hosts.of(b).to_string());
                    sim.partition(a.as_str(), b.as_str());
                    if let Some(lasting) = lasting {
                        repair.push((now + lasting, a, b));
                    }
                }
                Fault::Freeze { member, lasting } => {
                    let host = hosts.of(member).to_string();
                    hosts.freeze(&sim, &host);
                    if let Some(lasting) = lasting {
                        thaw.push((now + lasting, host));
                    }
                }
            }
        }
        while let Some(at) = repair.iter().position(|(at, _, _)| *at <= now) {
            let (_, a, b) = repair.remove(at);
            sim.repair(a.as_str(), b.as_str());
        }
        while let Some(at) = thaw.iter().position(|(at, _)| *at <= now) {
            let (_, host) = thaw.remove(at);
            hosts.thaw(&sim, &host);
        }
        if latency_until.is_some_and(|until| now >= until) {
            sim.set_max_message_latency(BASE_LATENCY);
            latency_until = None;
        }
        hosts.serve(&mut sim, &shared_requests);
        match sim.step() {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => return Err(SimError::Simulation(e.to_string())),
        }
    }
    let simulated_seconds = sim.elapsed().as_secs_f64();
    let outcome = slot
        .borrow_mut()
        .take()
        .ok_or_else(|| SimError::Simulation("the coordinator left no outcome".into()))?;
    Ok(outcome.map(|mut o| {
        o.simulated_seconds = simulated_seconds;
        o.fired = registries
            .iter()
            .flat_map(|(m, faults)| faults.fired().into_iter().map(|spec| (*m, spec)))
            .collect();
        o
    }))
}

/// Tokio numbers tasks from one counter per process, and a runtime torn down (a crashed or
/// bounced host) shuts its tasks down shard by shard, by task id modulo the shard count.
/// That order decides the order of the dying host's last messages, and so the rest of the
/// run. Starting every simulation at the same residue makes a run replay the same in a
/// process that ran other simulations before; `run` lets none run beside it.
pub(crate) fn align_task_ids() -> Result<(), SimError> {
    const RESIDUES: u64 = 64;
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| SimError::Simulation(format!("a runtime to align task ids: {e}")))?;
    rt.block_on(async {
        loop {
            let id = tokio::spawn(async { tokio::task::id().to_string() })
                .await
                .ok()
                .and_then(|id| id.parse::<u64>().ok());
            match id {
                Some(id) if id % RESIDUES != RESIDUES - 1 => continue,
                _ => return Ok(()),
            }
        }
    })
}

/// The coordinator's host: runs the job to its end, then gathers the model and checks
/// parity, as `cluster run` does.
async fn coordinate(
    job: Job,
    spawner: Arc<SimSpawner>,
    limit: Duration,
    steps_done: &Arc<AtomicU64>,
) -> Result<Outcome, String> {
    let mut handle = ftrec_coordinator::start(CoordinatorOptions {
        job: job.clone(),
        host: "0.0.0.0".into(),
        port: COORDINATOR_PORT,
        spawner: Some(spawner),
        standby: false,
        id: None,
        faults: Default::default(),
        resume: None,
    })
    .await
    .map_err(|e| format!("coordinator: {e}"))?;
    let shared = handle.shared.clone();
    let watched = shared.clone();
    let progress = steps_done.clone();
    let watch = tokio::spawn(async move {
        loop {
            progress.store(watched.summary().steps, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    let finished = handle.wait_done(limit).await;
    watch.abort();
    steps_done.store(u64::MAX, Ordering::SeqCst);
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
    shared.stop();
    checked.map_err(|e| format!("{e}\ntimeline:\n{}", trace.join("\n")))
}

pub(crate) fn trace_of(timeline: &ftrec_proto::timeline::TimelineData) -> Vec<String> {
    timeline
        .events
        .iter()
        .map(|e| {
            format!(
                "{:.3} {} {:?} {:?} {}",
                e.t, e.kind, e.subject, e.step, e.detail
            )
        })
        .collect()
}
