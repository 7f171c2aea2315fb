//! One job of the soak across namespaces: a 3-member etcd, a leader and a standby
//! coordinator, the servers and spares two to a rack, the workers; every process started
//! by hand with the per-role commands (`ftrec coordinator|server|worker --etcd ...`), as
//! README's "Coordinators in etcd" runs them across hosts. The cluster also keeps what
//! the logs said: which coordinator leads, which host serves which slot, and the events.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ftrec_proto::timeline::EventKind;

use super::members::{MemberUsage, Proc, spawn};
use super::net::{HostNet, Net, which};
use super::watch::{Follower, Seen, parse_line, steps_total};
use crate::error::{BenchError, Result};

pub const PORT: u16 = 7070;
const ETCD_CLIENT: u16 = 2379;
const ETCD_PEER: u16 = 2380;

/// The soak's shape.
#[derive(Clone, Debug)]
pub struct Shape {
    pub servers: usize,
    pub spares: usize,
    pub workers: usize,
}

/// A line a log gained, stamped with the bench's clock (seconds since the cluster began).
#[derive(Clone, Debug)]
pub struct Stamped {
    pub at: f64,
    pub from: String,
    pub seen: Seen,
}

pub struct EtcdMember {
    pub host: String,
    pub data: PathBuf,
    pub proc: Option<Proc>,
}

pub struct Cluster {
    pub net: Net,
    pub dir: PathBuf,
    logs: PathBuf,
    exe: PathBuf,
    etcd_exe: PathBuf,
    pub job: PathBuf,
    endpoints: String,
    token: String,
    pub began: Instant,
    pub etcd: Vec<EtcdMember>,
    /// Every coordinator started, in order; the leader is the last to say it leads.
    pub coordinators: Vec<Proc>,
    pub leader: Option<usize>,
    /// Each server host's current process (a slot's server or a spare).
    pub servers: BTreeMap<String, Proc>,
    /// Processes replaced on their host, kept for the report.
    pub retired: Vec<Proc>,
    /// Which host serves which slot, as the servers' logs say.
    pub slots: BTreeMap<usize, String>,
    pub workers: Vec<Proc>,
    followers: BTreeMap<String, Follower>,
    metrics: BTreeMap<String, String>,
    /// Each coordinator's `ftrec_steps_total`, last read.
    counted: BTreeMap<String, u64>,
    pub seen: Vec<Stamped>,
    generation: usize,
}

fn etcd_host(i: usize) -> String {
    format!("e{i}")
}
fn coordinator_host(i: usize) -> String {
    format!("c{i}")
}
pub fn server_host(i: usize) -> String {
    format!("h{i}")
}
pub fn worker_host(i: usize) -> String {
    format!("w{i}")
}

impl Cluster {
    /// The namespaces and the job's files; nothing runs yet.
    pub fn new(
        shape: &Shape,
        dir: &Path,
        exe: &Path,
        job_text: &dyn Fn(&str) -> String,
    ) -> Result<Self> {
        let etcd_exe = which("etcd").ok_or_else(|| {
            BenchError::Usage(
                "soak: no etcd on PATH (Debian's etcd-server; scripts/test-deps installs it)"
                    .into(),
            )
        })?;
        let core: Vec<String> = (0..3)
            .map(etcd_host)
            .chain((0..2).map(coordinator_host))
            .chain((0..shape.workers).map(worker_host))
            .collect();
        let racked: Vec<String> = (0..shape.servers + shape.spares).map(server_host).collect();
        let net = Net::up(&core, &racked)?;
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs).map_err(BenchError::file(&logs))?;
        let endpoints = (0..3)
            .map(|i| format!("{}:{ETCD_CLIENT}", net.host(&etcd_host(i)).ip))
            .collect::<Vec<_>>()
            .join(",");
        let job = dir.join("job.toml");
        std::fs::write(&job, job_text(&endpoints)).map_err(BenchError::file(&job))?;
        let etcd = (0..3)
            .map(|i| EtcdMember {
                host: etcd_host(i),
                data: dir.join(format!("etcd-{i}")),
                proc: None,
            })
            .collect();
        Ok(Self {
            net,
            dir: dir.to_path_buf(),
            logs,
            exe: exe.to_path_buf(),
            etcd_exe,
            job,
            endpoints,
            token: format!(
                "soak-{}-{}",
                std::process::id(),
                dir.display().to_string().len()
            ),
            began: Instant::now(),
            etcd,
            coordinators: Vec::new(),
            leader: None,
            servers: BTreeMap::new(),
            retired: Vec::new(),
            slots: BTreeMap::new(),
            workers: Vec::new(),
            followers: BTreeMap::new(),
            metrics: BTreeMap::new(),
            counted: BTreeMap::new(),
            seen: Vec::new(),
            generation: 0,
        })
    }

    pub fn now(&self) -> f64 {
        self.began.elapsed().as_secs_f64()
    }

    fn host(&self, name: &str) -> HostNet {
        self.net.host(name).clone()
    }

    fn start(
        &mut self,
        host: &str,
        name: &str,
        args: Vec<String>,
        dirs: Vec<PathBuf>,
    ) -> Result<Proc> {
        let h = self.host(host);
        let proc = spawn(&h, name, &self.logs, &self.exe, &args, dirs)?;
        self.followers
            .insert(name.to_string(), Follower::new(proc.log.clone()));
        Ok(proc)
    }

    fn unique(&mut self, base: &str) -> String {
        self.generation += 1;
        format!("{base}-g{}", self.generation)
    }

    /// Member `i` of etcd, on its data (`existing`: it rejoins the cluster it was in).
    pub fn start_etcd(&mut self, i: usize, existing: bool) -> Result<()> {
        let ip = |j: usize| self.net.host(&etcd_host(j)).ip.clone();
        let cluster = (0..3)
            .map(|j| format!("e{j}=http://{}:{ETCD_PEER}", ip(j)))
            .collect::<Vec<_>>()
            .join(",");
        let me = ip(i);
        let args: Vec<String> = [
            "--name".to_string(),
            format!("e{i}"),
            "--data-dir".into(),
            self.etcd[i].data.display().to_string(),
            "--listen-client-urls".into(),
            format!("http://{me}:{ETCD_CLIENT}"),
            "--advertise-client-urls".into(),
            format!("http://{me}:{ETCD_CLIENT}"),
            "--listen-peer-urls".into(),
            format!("http://{me}:{ETCD_PEER}"),
            "--initial-advertise-peer-urls".into(),
            format!("http://{me}:{ETCD_PEER}"),
            "--initial-cluster".into(),
            cluster,
            "--initial-cluster-token".into(),
            self.token.clone(),
            "--initial-cluster-state".into(),
            if existing { "existing" } else { "new" }.into(),
            // etcd 3.5's default, off in Debian's 3.4: without it the member left alone
            // in a quorum loss raised its raft term with every lonely campaign, and its
            // peers, thawed, lost their leader to it and served nothing for 4 s more.
            "--pre-vote".into(),
        ]
        .into();
        let name = self.unique(&format!("etcd-e{i}"));
        let host = self.host(&etcd_host(i));
        let proc = spawn(
            &host,
            &name,
            &self.logs,
            &self.etcd_exe,
            &args,
            vec![self.etcd[i].data.clone()],
        )?;
        self.etcd[i].proc = Some(proc);
        Ok(())
    }

    /// All three members, then waits until the cluster elects a leader and serves.
    pub fn start_etcd_cluster(&mut self, deadline: Instant) -> Result<()> {
        for i in 0..3 {
            self.start_etcd(i, false)?;
        }
        let health = format!("{}:{ETCD_CLIENT}", self.net.host(&etcd_host(0)).ip);
        while !super::watch::http_get(&health, "/health", Duration::from_secs(1))
            .is_some_and(|body| body.contains("\"true\""))
        {
            if Instant::now() > deadline {
                return Err(BenchError::Failed(format!(
                    "soak: etcd never served (see {})",
                    self.logs.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// `ftrec ROLE --job JOB --etcd ENDPOINTS`: what every member's command starts with.
    fn role_args(&self, role: &str) -> Vec<String> {
        vec![
            role.into(),
            "--job".into(),
            self.job.display().to_string(),
            "--etcd".into(),
            self.endpoints.clone(),
        ]
    }

    /// A coordinator on `host` (`standby`: it waits for the leader's lease to lapse).
    pub fn start_coordinator(&mut self, slot: usize, standby: bool) -> Result<()> {
        let host = coordinator_host(slot);
        let ip = self.net.host(&host).ip.clone();
        let id = self.unique(&format!("coordinator-c{slot}"));
        let out = self.dir.join(&id);
        let mut args = self.role_args("coordinator");
        args.extend([
            "--id".into(),
            id.clone(),
            "--host".into(),
            ip,
            "--port".into(),
            PORT.to_string(),
            "--out".into(),
            out.display().to_string(),
            "--json".into(),
        ]);
        if standby {
            args.push("--standby".into());
        }
        let proc = self.start(&host, &id, args, vec![out])?;
        self.coordinators.push(proc);
        Ok(())
    }

    /// The server on rack host `h` (`slot`: a slot's first server; `None`: a spare).
    pub fn start_server(&mut self, h: usize, slot: Option<usize>) -> Result<()> {
        let host = server_host(h);
        let ip = self.net.host(&host).ip.clone();
        let mut args = self.role_args("server");
        args.extend(["--host".into(), ip]);
        match slot {
            Some(id) => args.extend(["--id".into(), id.to_string()]),
            None => args.push("--spare".into()),
        }
        let name = self.unique(&format!("server-{host}"));
        let proc = self.start(&host, &name, args, Vec::new())?;
        if let Some(old) = self.servers.insert(host, proc) {
            self.retired.push(old);
        }
        Ok(())
    }

    pub fn start_worker(&mut self, id: usize) -> Result<()> {
        let mut args = self.role_args("worker");
        args.extend(["--id".into(), id.to_string()]);
        let name = format!("worker-{id}");
        let proc = self.start(&worker_host(id), &name, args, Vec::new())?;
        self.workers.push(proc);
        Ok(())
    }

    /// Reads what the logs gained and what the coordinators counted; returns the steps
    /// counted over every coordinator so far (each counts the steps it finished).
    pub fn poll(&mut self) -> u64 {
        let at = self.now();
        let names: Vec<String> = self.followers.keys().cloned().collect();
        for name in names {
            let lines = self
                .followers
                .get_mut(&name)
                .map(Follower::poll)
                .unwrap_or_default();
            for line in lines {
                let Some(seen) = parse_line(&line) else {
                    continue;
                };
                match &seen {
                    Seen::Leads => {
                        self.leader = self.coordinators.iter().position(|c| c.name == name);
                    }
                    Seen::Metrics(address) => {
                        self.metrics.insert(name.clone(), address.clone());
                    }
                    Seen::Serves(slot) => {
                        if let Some(host) = self
                            .servers
                            .iter()
                            .find(|(_, p)| p.name == name)
                            .map(|(h, _)| h.clone())
                        {
                            self.slots.insert(*slot, host);
                        }
                    }
                    Seen::Event { .. } => {}
                }
                self.seen.push(Stamped {
                    at,
                    from: name.clone(),
                    seen,
                });
            }
        }
        let mut live: Vec<(String, String)> = Vec::new();
        for c in self.coordinators.iter_mut() {
            if c.alive()
                && !c.frozen
                && let Some(m) = self.metrics.get(&c.name)
            {
                live.push((c.name.clone(), m.clone()));
            }
        }
        for (name, address) in live {
            if let Some(n) = steps_total(&address, Duration::from_millis(300)) {
                self.counted.insert(name, n);
            }
        }
        self.counted.values().sum()
    }

    /// Events of `kind` (about `server`, where given) seen after `since`.
    pub fn events_since(&self, kind: EventKind, server: Option<usize>, since: f64) -> Option<f64> {
        self.seen.iter().find_map(|s| match s.seen {
            Seen::Event {
                kind: k,
                server: sv,
            } if k == kind && s.at >= since && (server.is_none() || sv == server) => Some(s.at),
            _ => None,
        })
    }

    /// When a coordinator other than `old` said it leads, after `since`.
    pub fn new_leader_since(&self, old: &str, since: f64) -> Option<f64> {
        self.seen
            .iter()
            .find(|s| s.at >= since && s.seen == Seen::Leads && s.from != old)
            .map(|s| s.at)
    }

    /// Whether etcd member `i` runs and is not frozen.
    pub fn etcd_up(&mut self, i: usize) -> bool {
        self.etcd[i]
            .proc
            .as_mut()
            .is_some_and(|p| p.alive() && !p.frozen)
    }

    pub fn leader_proc(&mut self) -> Option<&mut Proc> {
        let i = self.leader?;
        self.coordinators.get_mut(i)
    }

    /// Starts again, on its own host, every member that left on its own while no fault
    /// holds the host: a standby coordinator, a spare server, an etcd member on its data.
    /// Returns what it started, and why.
    pub fn supervise(&mut self, held: &[String]) -> Result<Vec<String>> {
        let mut started = Vec::new();
        // Once training ended, members leave because the job is over.
        if self
            .events_since(EventKind::TrainingEnd, None, 0.0)
            .is_some()
        {
            return Ok(started);
        }
        for slot in 0..2 {
            let host = coordinator_host(slot);
            if held.contains(&host) {
                continue;
            }
            let mut gone = None;
            let mut running = false;
            for c in self.coordinators.iter_mut().filter(|c| c.host == host) {
                if c.alive() {
                    running = true;
                } else {
                    gone = Some(format!("{} exited {:?}", c.name, c.exited));
                }
            }
            if !running {
                self.start_coordinator(slot, true)?;
                started.push(format!(
                    "standby on {host} ({})",
                    gone.unwrap_or_else(|| "none ran".into())
                ));
            }
        }
        let hosts: Vec<String> = self.servers.keys().cloned().collect();
        for host in hosts {
            if held.contains(&host) {
                continue;
            }
            // Exit code 0: it left because the job finished, not because it failed.
            let gone = self.servers.get_mut(&host).and_then(|p| {
                (!p.alive() && p.exited != Some(0))
                    .then(|| format!("{} exited {:?}", p.name, p.exited))
            });
            if let Some(why) = gone {
                let index = host.trim_start_matches('h').parse().unwrap_or(0);
                self.start_server(index, None)?;
                started.push(format!("spare on {host} ({why})"));
            }
        }
        for i in 0..3 {
            let host = etcd_host(i);
            let gone = self.etcd[i].proc.as_mut().is_none_or(|p| !p.alive());
            if gone && !held.contains(&host) {
                self.start_etcd(i, true)?;
                started.push(format!("etcd {host}"));
            }
        }
        for s in &started {
            tracing::info!("soak: the supervisor started {s}");
        }
        Ok(started)
    }

    /// Reads every live process's resources.
    pub fn sample(&mut self) {
        for p in self.all_procs() {
            p.sample();
        }
    }

    fn all_procs(&mut self) -> Vec<&mut Proc> {
        let mut out: Vec<&mut Proc> = Vec::new();
        out.extend(self.etcd.iter_mut().filter_map(|e| e.proc.as_mut()));
        out.extend(self.coordinators.iter_mut());
        out.extend(self.servers.values_mut());
        out.extend(self.retired.iter_mut());
        out.extend(self.workers.iter_mut());
        out
    }

    pub fn usage(&mut self) -> Vec<MemberUsage> {
        self.all_procs().into_iter().map(|p| p.usage()).collect()
    }

    /// Kills every process (the namespaces go when the cluster is dropped).
    pub fn stop(&mut self) {
        for p in self.all_procs() {
            p.kill();
        }
    }

    pub fn logs(&self) -> &Path {
        &self.logs
    }
}
