//! One run of the soak's job, with faults or without: the cluster started, the schedule
//! played against what the job has recovered from, live parity scrubs whenever nothing is
//! being recovered, and the outcome read from the coordinator that ended the job.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::Serialize;
use serde_json::Value;

use ftrec_proto::timeline::{Event, EventKind, TimelineData};

use super::cluster::{Cluster, PORT, Shape};
use super::inject::{Active, FaultRecord, strike};
use super::members::MemberUsage;
use super::schedule::{InFlight, Planned, admissible};
use crate::error::{BenchError, Result};

pub struct RunSpec<'a> {
    pub name: &'a str,
    pub shape: &'a Shape,
    pub dir: PathBuf,
    pub exe: PathBuf,
    pub job_text: &'a dyn Fn(&str) -> String,
    pub plan: Vec<Planned>,
    pub tolerance: usize,
    pub seed: u64,
    pub batch: u64,
    pub time_limit: Duration,
    /// Seconds between live parity scrubs (when nothing is being recovered).
    pub scrub_every: f64,
    /// Calibration: stop this many seconds after training starts, and only measure.
    pub stop_after: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct RunOutcome {
    pub name: String,
    pub result: String,
    /// Training start to the job's end, on the bench's clock.
    pub train_seconds: f64,
    pub steps: u64,
    pub samples_per_sec: f64,
    pub state_digest: Option<String>,
    pub lost_samples: Option<u64>,
    pub recoveries: Option<u64>,
    pub failovers: Option<u64>,
    pub parity_mismatches: u64,
    pub replica_mismatches: u64,
    pub scrubs: u64,
    pub scrubs_unfinished: u64,
    pub max_stall_seconds: f64,
    /// Members the supervisor started again after they left on their own.
    pub supervisor_restarts: Vec<String>,
    pub faults: Vec<FaultRecord>,
    /// Faults of the schedule the job ended before (they waited for a recovery).
    pub not_injected: Vec<Planned>,
    pub members: Vec<MemberUsage>,
    pub run_dir: PathBuf,
    /// Committed samples per second, and the faults' and recoveries' moments.
    pub timeline: TimelineData,
}

struct Scrub {
    child: Child,
    out: PathBuf,
}

pub fn run(spec: RunSpec<'_>) -> Result<RunOutcome> {
    std::fs::create_dir_all(&spec.dir).map_err(BenchError::file(&spec.dir))?;
    let secret = spec.dir.join("job.secret");
    std::fs::write(&secret, random_hex()).map_err(BenchError::file(&secret))?;
    let mut cluster = Cluster::new(spec.shape, &spec.dir, &spec.exe, spec.job_text)?;
    let outcome = drive(&spec, &mut cluster);
    cluster.stop();
    let mut outcome = outcome?;
    outcome.members = cluster.usage();
    Ok(outcome)
}

fn random_hex() -> String {
    use rand::Rng;
    let mut rng = rand::thread_rng();
    (0..32)
        .map(|_| format!("{:02x}", rng.r#gen::<u8>()))
        .collect()
}

fn drive(spec: &RunSpec<'_>, cluster: &mut Cluster) -> Result<RunOutcome> {
    let deadline = Instant::now() + spec.time_limit;
    let shape = spec.shape;
    cluster.start_etcd_cluster(deadline)?;
    cluster.start_coordinator(0, false)?;
    wait_for(cluster, deadline, "the first coordinator never led", |c| {
        c.leader.is_some()
    })?;
    cluster.start_coordinator(1, true)?;
    for h in 0..shape.servers + shape.spares {
        cluster.start_server(h, (h < shape.servers).then_some(h))?;
    }
    let joined = |c: &Cluster, kind: EventKind, n: usize| {
        c.seen
            .iter()
            .filter(|s| matches!(s.seen, super::watch::Seen::Event { kind: k, .. } if k == kind))
            .count()
            >= n
    };
    wait_for(cluster, deadline, "the servers never joined", |c| {
        joined(c, EventKind::ServerJoined, shape.servers)
            && joined(c, EventKind::SpareJoined, shape.spares)
    })?;
    for w in 0..shape.workers {
        cluster.start_worker(w)?;
    }
    wait_for(cluster, deadline, "training never started", |c| {
        c.events_since(EventKind::TrainingStart, None, 0.0)
            .is_some()
    })?;
    let origin = cluster
        .events_since(EventKind::TrainingStart, None, 0.0)
        .unwrap_or_else(|| cluster.now());
    cluster.sample();

    let mut rng = Xoshiro256PlusPlus::seed_from_u64(spec.seed);
    let mut pending: std::collections::VecDeque<Planned> = spec.plan.iter().copied().collect();
    let mut active: Vec<Active> = Vec::new();
    let mut done: Vec<FaultRecord> = Vec::new();
    let mut progress: Vec<(f64, u64)> = vec![(origin, 0)];
    let mut counted = 0u64;
    let mut scrub: Option<Scrub> = None;
    let mut last_scrub = cluster.now();
    let (mut parity, mut replicas, mut scrubs, mut unfinished) = (0u64, 0u64, 0u64, 0u64);
    let mut last_sample = cluster.now();
    let mut ended: Option<usize> = None;
    let mut result = "ok".to_string();
    let mut restarts: Vec<String> = Vec::new();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let total = cluster.poll();
        let now = cluster.now();
        if total > counted {
            counted = total;
            progress.push((now, total));
        }
        if now - last_sample >= 2.0 {
            cluster.sample();
            last_sample = now;
        }
        if spec.stop_after.is_some_and(|stop| now - origin >= stop) {
            break;
        }
        // The job's end: a coordinator left having written its report.
        for (i, c) in cluster.coordinators.iter_mut().enumerate() {
            if !c.alive() && c.exited == Some(0) && report_of(&c.out).is_some() {
                ended = Some(i);
            }
        }
        if ended.is_some() {
            break;
        }
        if Instant::now() > deadline {
            result = format!("timed out after {} s", spec.time_limit.as_secs());
            break;
        }
        if cluster.coordinators.iter_mut().all(|c| !c.alive()) {
            result = "every coordinator exited without a report".into();
            break;
        }
        let after = |t: f64| progress.iter().find(|(at, _)| *at > t).map(|(at, _)| *at);
        let mut still = Vec::new();
        for mut a in active.drain(..) {
            if a.advance(cluster, &after)? {
                a.record.over_at = Some(cluster.now() - origin);
                done.push(a.record);
            } else {
                still.push(a);
            }
        }
        active = still;
        // The operator's supervisor: a member that left on its own (a coordinator deposed
        // by a quorum loss, a spare told to stop) is started again on its host, unless a
        // fault still holds the host.
        let held: Vec<String> = active.iter().flat_map(Active::held).collect();
        restarts.extend(cluster.supervise(&held)?);
        if let Some(next) = pending.front().copied() {
            let in_flight = InFlight {
                servers_lost: active.iter().map(Active::servers_lost).sum(),
                control_plane: active.iter().any(Active::control_plane),
                lossy: active.iter().any(Active::lossy),
            };
            if now - origin >= next.at && admissible(next.kind, in_flight, spec.tolerance) {
                let busy: Vec<String> = active.iter().flat_map(Active::held).collect();
                if let Some(a) = strike(
                    cluster,
                    &mut rng,
                    next.kind,
                    next.at,
                    origin,
                    &busy,
                    shape.workers,
                )? {
                    tracing::info!(fault = next.kind.name(), target = %a.record.target, "soak: struck");
                    active.push(a);
                    pending.pop_front();
                }
            }
        }
        // A live parity scrub whenever nothing is being recovered.
        if let Some(s) = scrub.as_mut() {
            if let Ok(Some(_)) = s.child.try_wait() {
                scrubs += 1;
                match std::fs::read_to_string(&s.out)
                    .ok()
                    .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                {
                    Some(v) => {
                        parity += v["parity_mismatches"].as_u64().unwrap_or(0);
                        replicas += v["replica_mismatches"].as_u64().unwrap_or(0);
                    }
                    None => unfinished += 1,
                }
                scrub = None;
                last_scrub = now;
            }
        } else if active.is_empty()
            && now - last_scrub >= spec.scrub_every
            && spec.stop_after.is_none()
        {
            scrub = start_scrub(cluster, spec, scrubs)?;
        }
    }
    if let Some(mut s) = scrub {
        let _ = s.child.kill();
        let _ = s.child.wait();
        unfinished += 1;
    }
    let end = cluster.now();
    // The other coordinators and the members leave on their own once the job ended.
    let grace = Instant::now() + Duration::from_secs(15);
    while Instant::now() < grace
        && (cluster.coordinators.iter_mut().any(|c| c.alive())
            || cluster.workers.iter_mut().any(|w| w.alive()))
    {
        cluster.poll();
        std::thread::sleep(Duration::from_millis(100));
    }
    for a in active {
        let mut r = a.record;
        r.notes
            .push("still being followed when the job ended".into());
        done.push(r);
    }
    let steps_at = |t: f64| {
        progress
            .iter()
            .take_while(|(at, _)| *at <= origin + t)
            .last()
            .map_or(0, |(_, n)| *n)
    };
    for f in &mut done {
        // A fault can be over (its slot rebuilt) before the soak saw a step after its
        // recovery: its resume is read here, from the whole run.
        if f.resume_seconds.is_none()
            && let Some(d) = f.detect_seconds
        {
            let detected = origin + f.injected_at + d;
            let from = if f.kind.control_plane() && f.kind.servers_lost() == 0 {
                Some(detected)
            } else {
                cluster.events_since(EventKind::RecoveryEnd, None, detected)
            };
            if let Some(r) = from.and_then(|r| progress.iter().find(|(at, _)| *at > r)) {
                f.resume_seconds = Some(r.0 - origin - f.injected_at);
            }
        }
        if let Some(over) = f.over_at {
            f.steps_during = Some(steps_at(over).saturating_sub(steps_at(f.injected_at)));
        }
    }
    let report = ended.and_then(|i| report_of(&cluster.coordinators[i].out));
    let stall = progress
        .windows(2)
        .map(|w| w[1].0 - w[0].0)
        .chain(progress.last().map(|l| end - l.0))
        .fold(0.0, f64::max);
    let train_seconds = end - origin;
    let steps = report
        .as_ref()
        .and_then(|r| r["steps"].as_u64())
        .unwrap_or(counted);
    let timeline = timeline_of(&progress, origin, spec.batch, &done, cluster);
    if ended.is_none() && spec.stop_after.is_none() && result == "ok" {
        result = "no coordinator reported the job's state".into();
    }
    let n = |k: &str| report.as_ref().and_then(|r| r[k].as_u64());
    let len = |k: &str| {
        report
            .as_ref()
            .and_then(|r| r[k].as_array().map(|a| a.len() as u64))
    };
    Ok(RunOutcome {
        name: spec.name.to_string(),
        result,
        train_seconds,
        steps,
        samples_per_sec: if train_seconds > 0.0 {
            steps as f64 * spec.batch as f64 / train_seconds
        } else {
            0.0
        },
        state_digest: report
            .as_ref()
            .and_then(|r| r["state_digest"].as_str().map(str::to_string)),
        lost_samples: n("lost_samples"),
        recoveries: len("recoveries"),
        failovers: len("coordinator_failovers").or(Some(0)),
        parity_mismatches: parity,
        replica_mismatches: replicas,
        scrubs,
        scrubs_unfinished: unfinished,
        max_stall_seconds: stall,
        supervisor_restarts: restarts,
        faults: done,
        not_injected: pending.into_iter().collect(),
        members: Vec::new(),
        run_dir: spec.dir.clone(),
        timeline,
    })
}

fn wait_for(
    cluster: &mut Cluster,
    deadline: Instant,
    what: &str,
    ready: impl Fn(&Cluster) -> bool,
) -> Result<()> {
    loop {
        cluster.poll();
        if ready(cluster) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BenchError::Failed(format!(
                "soak: {what} (logs under {})",
                cluster.logs().display()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The coordinator's report: its `--json` stdout, where it holds the job's state digest.
fn report_of(out: &std::path::Path) -> Option<Value> {
    let text = std::fs::read_to_string(out).ok()?;
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    v.get("state_digest")?;
    Some(v)
}

fn start_scrub(cluster: &mut Cluster, spec: &RunSpec<'_>, n: u64) -> Result<Option<Scrub>> {
    let Some(leader) = cluster.leader_proc().map(|p| p.host.clone()) else {
        return Ok(None);
    };
    let address = format!("{}:{PORT}", cluster.net.host(&leader).ip);
    let out = spec.dir.join(format!("scrub-{n}.json"));
    let file = std::fs::File::create(&out).map_err(BenchError::file(&out))?;
    let child = Command::new(&spec.exe)
        .args([
            "cluster",
            "verify-parity",
            "--coordinator",
            &address,
            "--job",
        ])
        .arg(&cluster.job)
        .arg("--json")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(Stdio::null())
        .spawn()
        .map_err(|source| BenchError::IoDuring {
            what: "soak: starting a parity scrub".into(),
            source,
        })?;
    Ok(Some(Scrub { child, out }))
}

/// Samples per second over the run, and the faults' moments as events, for the plot.
fn timeline_of(
    progress: &[(f64, u64)],
    origin: f64,
    batch: u64,
    faults: &[FaultRecord],
    cluster: &Cluster,
) -> TimelineData {
    let mut samples_per_second = Vec::new();
    for w in progress.windows(2) {
        let second = (w[1].0 - origin).max(0.0) as usize;
        if samples_per_second.len() <= second {
            samples_per_second.resize(second + 1, 0);
        }
        samples_per_second[second] += (w[1].1 - w[0].1) * batch;
    }
    let mut events = Vec::new();
    for f in faults {
        events.push(Event {
            t: f.injected_at,
            kind: EventKind::Killed,
            subject: None,
            step: None,
            detail: format!("{}: {}", f.kind.name(), f.target),
        });
    }
    for s in &cluster.seen {
        if let super::watch::Seen::Event { kind, .. } = s.seen
            && matches!(kind, EventKind::FailureDetected | EventKind::RebuildEnd)
            && s.at >= origin
        {
            events.push(Event {
                t: s.at - origin,
                kind,
                subject: None,
                step: None,
                detail: s.from.clone(),
            });
        }
    }
    TimelineData {
        samples_per_second,
        events,
    }
}
