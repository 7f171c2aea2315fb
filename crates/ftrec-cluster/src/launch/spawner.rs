//! The launcher's children: every server and worker is an `ftrec` process started here,
//! with its fault points as `--fault` flags, reaped or killed at the end.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ftrec_coordinator::Spawner;
use ftrec_faults::{FaultSpec, points};
use ftrec_proto::proto::Role;
use ftrec_rpc::PsError;

/// Set in every child's environment: the launcher's pid, so the child dies with it.
pub const LAUNCHER_PID_ENV: &str = "FTREC_LAUNCHER_PID";

/// Called first thing by `ftrec server` and `ftrec worker`. When a launcher started this
/// process, the kernel SIGKILLs it as soon as the launcher dies, even by SIGKILL
/// (`PR_SET_PDEATHSIG`), so no server or worker lingers as an orphan. The launcher spawns
/// children only from threads that live as long as it does (its main thread and its
/// runtime's workers), since the signal follows the spawning thread's exit.
pub fn die_with_launcher() -> Result<(), PsError> {
    let Some(launcher) = std::env::var(LAUNCHER_PID_ENV)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    else {
        return Ok(());
    };
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL)).map_err(
        |e| PsError::Io {
            path: "prctl(PR_SET_PDEATHSIG)".into(),
            error: e.into(),
        },
    )?;
    // The launcher may have died before the call above: this process was then adopted.
    let parent = rustix::process::getppid().map(|p| p.as_raw_pid());
    if parent != Some(launcher) {
        return Err(PsError::Stopped(format!(
            "the launcher (pid {launcher}) is gone; not starting without it"
        )));
    }
    Ok(())
}

/// Child processes started by the launcher; every one is reaped or killed at the end.
pub(super) struct LocalSpawner {
    pub(super) exe: PathBuf,
    pub(super) job_file: PathBuf,
    pub(super) logs: PathBuf,
    pub(super) children: Mutex<Vec<(String, Child)>>,
    /// Planned deaths not yet handed to a process, by member slot.
    pub(super) faults: Mutex<Vec<(Role, usize, FaultSpec)>>,
    /// Processes started per server slot so far.
    pub(super) spawned: Mutex<Vec<usize>>,
    /// etcd membership: children find the coordinator through these endpoints
    /// (`--etcd`), not an address.
    pub(super) etcd: Option<String>,
    /// Children die with this process (the launcher). A coordinator's replacements do
    /// not: the coordinator may die and be replaced while they serve.
    pub(super) tied: bool,
}

/// A spawner for a coordinator process of an etcd job (`ftrec coordinator --spawn`): it
/// starts replacement servers and workers on this host, found through etcd, logging into
/// `logs`. They outlive the coordinator (a standby leads them next) and exit when the job
/// is over or no coordinator has answered for their patience.
pub fn replacement_spawner(
    exe: PathBuf,
    job_file: PathBuf,
    logs: PathBuf,
    etcd: &[String],
) -> Result<std::sync::Arc<dyn Spawner>, PsError> {
    std::fs::create_dir_all(&logs).map_err(|error| PsError::Io {
        path: logs.display().to_string(),
        error,
    })?;
    Ok(std::sync::Arc::new(LocalSpawner {
        exe,
        job_file,
        logs,
        children: Mutex::new(Vec::new()),
        faults: Mutex::new(Vec::new()),
        spawned: Mutex::new(Vec::new()),
        etcd: Some(etcd.join(",")),
        tied: false,
    }))
}

impl LocalSpawner {
    /// The `--fault` flags of the next process of server slot `id`: phase points go to its
    /// first process, a rebuild death to its first replacement (the process that rebuilds).
    fn faults_for(&self, id: usize) -> Vec<String> {
        let Ok(mut spawned) = self.spawned.lock() else {
            return Vec::new();
        };
        if spawned.len() <= id {
            spawned.resize(id + 1, 0);
        }
        let replacement = spawned[id] > 0;
        spawned[id] += 1;
        self.take_faults(Role::Server, id, |spec| {
            (spec.point == points::REBUILD) == replacement
        })
    }

    /// The `--fault` flags of the planned deaths of slot `role` `id` that `due` picks,
    /// each handed to one process only (a worker's go to its first process).
    fn take_faults(&self, role: Role, id: usize, due: impl Fn(&FaultSpec) -> bool) -> Vec<String> {
        let Ok(mut faults) = self.faults.lock() else {
            return Vec::new();
        };
        let mut mine = Vec::new();
        faults.retain(|(r, slot, spec)| {
            let taken = *r == role && *slot == id && due(spec);
            if taken {
                mine.extend(["--fault".to_string(), spec.to_string()]);
            }
            !taken
        });
        mine
    }

    fn spawn(&self, name: String, args: &[String]) -> Result<(), PsError> {
        self.spawn_with(name, args, Vec::new())
    }

    fn spawn_with(
        &self,
        name: String,
        args: &[String],
        faults: Vec<String>,
    ) -> Result<(), PsError> {
        let n = self.children.lock().map_or(0, |c| c.len());
        let log_path = self.logs.join(format!("{name}-{n}.log"));
        let log = std::fs::File::create(&log_path).map_err(|error| PsError::Io {
            path: log_path.display().to_string(),
            error,
        })?;
        let err_log = log.try_clone().map_err(|error| PsError::Io {
            path: log_path.display().to_string(),
            error,
        })?;
        let mut command = Command::new(&self.exe);
        if self.tied {
            command.env(LAUNCHER_PID_ENV, std::process::id().to_string());
        } else {
            command.env_remove(LAUNCHER_PID_ENV);
        }
        let child = command
            .args(args)
            .args(faults)
            .env(
                "FTREC_LOG",
                std::env::var("FTREC_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .spawn()
            .map_err(|error| PsError::Io {
                path: self.exe.display().to_string(),
                error,
            })?;
        if let Ok(mut c) = self.children.lock() {
            c.push((name, child));
        }
        Ok(())
    }

    fn base_args(&self, role: &str, coordinator: &str) -> Vec<String> {
        let (flag, value) = match &self.etcd {
            Some(endpoints) => ("--etcd", endpoints.as_str()),
            None => ("--coordinator", coordinator),
        };
        vec![
            role.to_string(),
            "--job".into(),
            self.job_file.display().to_string(),
            flag.into(),
            value.to_string(),
        ]
    }

    /// A coordinator of an etcd job: its report (`--json`) goes to `report`, its log
    /// beside the others.
    pub(super) fn spawn_coordinator(
        &self,
        name: &str,
        standby: bool,
        out: &std::path::Path,
        report: &std::path::Path,
        save: Option<&std::path::Path>,
    ) -> Result<u32, PsError> {
        let endpoints = self.etcd.clone().unwrap_or_default();
        let mut args: Vec<String> = vec![
            "coordinator".into(),
            "--job".into(),
            self.job_file.display().to_string(),
            "--etcd".into(),
            endpoints,
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            "0".into(),
            "--id".into(),
            name.into(),
            "--spawn".into(),
            "--out".into(),
            out.display().to_string(),
            "--json".into(),
        ];
        if standby {
            args.push("--standby".into());
        }
        if let Some(save) = save {
            args.extend(["--save".into(), save.display().to_string()]);
        }
        let io = |path: &std::path::Path| {
            let path = path.display().to_string();
            move |error| PsError::Io { path, error }
        };
        let n = self.children.lock().map_or(0, |c| c.len());
        let log_path = self.logs.join(format!("{name}-{n}.log"));
        let log = std::fs::File::create(&log_path).map_err(io(&log_path))?;
        let stdout = std::fs::File::create(report).map_err(io(report))?;
        let child = Command::new(&self.exe)
            .args(&args)
            .env(LAUNCHER_PID_ENV, std::process::id().to_string())
            .env(
                "FTREC_LOG",
                std::env::var("FTREC_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log)
            .spawn()
            .map_err(io(&self.exe))?;
        let pid = child.id();
        if let Ok(mut c) = self.children.lock() {
            c.push((name.to_string(), child));
        }
        Ok(pid)
    }

    /// Whether the child named `name` has exited, and with which status.
    pub(super) fn exit_status(&self, name: &str) -> Option<std::process::ExitStatus> {
        let mut children = self.children.lock().ok()?;
        children
            .iter_mut()
            .filter(|(n, _)| n == name)
            .find_map(|(_, c)| c.try_wait().ok().flatten())
    }

    /// Reaps the children that have exited, so a killed one does not linger as a zombie
    /// (whose pid would still look alive to the checkpoint leases it held).
    pub(super) fn reap_exited(&self) {
        if let Ok(mut children) = self.children.lock() {
            for (_, child) in children.iter_mut() {
                let _ = child.try_wait();
            }
        }
    }

    /// SIGKILLs every child whose slot a later process holds now: the coordinator declared
    /// it dead and fenced it (it may be frozen or cut off rather than gone), so nothing it
    /// could still do is wanted, and waiting for it to exit would only delay the end of
    /// the run. `holder` gives a slot's current process id. Returns the names and pids
    /// killed.
    pub(super) fn kill_superseded(
        &self,
        holder: impl Fn(Role, usize) -> Option<u32>,
    ) -> Vec<(String, u32)> {
        // Not under the children's lock while asking the coordinator: it calls this
        // spawner (which takes that lock) while holding its own.
        let listed: Vec<(String, u32)> = match self.children.lock() {
            Ok(children) => children.iter().map(|(n, c)| (n.clone(), c.id())).collect(),
            Err(_) => return Vec::new(),
        };
        let superseded: Vec<u32> = listed
            .iter()
            .enumerate()
            .filter_map(|(i, (name, pid))| {
                let (role, slot) = slot_of(name)?;
                let current = holder(role, slot)?;
                // Only a process started after this one can have superseded it.
                listed[i + 1..]
                    .iter()
                    .any(|(_, later)| *later == current)
                    .then_some(*pid)
            })
            .collect();
        let Ok(mut children) = self.children.lock() else {
            return Vec::new();
        };
        let mut killed = Vec::new();
        for (name, child) in children.iter_mut() {
            if superseded.contains(&child.id()) && matches!(child.try_wait(), Ok(None)) {
                let pid = child.id();
                let _ = child.kill();
                let _ = child.wait();
                killed.push((name.clone(), pid));
            }
        }
        killed
    }

    /// Waits up to `grace` for every child to exit, then SIGKILLs the rest.
    pub(super) fn reap(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        let Ok(mut children) = self.children.lock() else {
            return;
        };
        for (name, child) in children.iter_mut() {
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        tracing::warn!("{name} did not exit; killing it");
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
    }
}

impl Spawner for LocalSpawner {
    fn spawn_server(&self, id: usize, coordinator: &str) -> Result<(), PsError> {
        let mut args = self.base_args("server", coordinator);
        args.extend(["--id".into(), id.to_string()]);
        self.spawn_with(format!("server-{id}"), &args, self.faults_for(id))
    }

    fn spawn_worker(&self, id: usize, coordinator: &str) -> Result<(), PsError> {
        let mut args = self.base_args("worker", coordinator);
        args.extend(["--id".into(), id.to_string()]);
        let faults = self.take_faults(Role::Worker, id, |_| true);
        self.spawn_with(format!("worker-{id}"), &args, faults)
    }

    fn exited(&self, role: Role, id: usize) -> bool {
        let name = match role {
            Role::Server => format!("server-{id}"),
            Role::Worker => format!("worker-{id}"),
            _ => return false,
        };
        let Ok(mut children) = self.children.lock() else {
            return false;
        };
        // The slot's latest process: an earlier one may have exited long ago.
        children
            .iter_mut()
            .rev()
            .find(|(n, _)| *n == name)
            .is_some_and(|(_, c)| matches!(c.try_wait(), Ok(Some(_))))
    }
}

impl LocalSpawner {
    pub(super) fn spawn_spare(&self, n: usize, coordinator: &str) -> Result<(), PsError> {
        let mut args = self.base_args("server", coordinator);
        args.push("--spare".into());
        self.spawn(format!("spare-{n}"), &args)
    }
}

/// The slot a child was started for, from its name (`server-J`, `worker-J`; spares have
/// none until assigned).
fn slot_of(name: &str) -> Option<(Role, usize)> {
    let (role, id) = name.rsplit_once('-')?;
    let role = match role {
        "server" => Role::Server,
        "worker" => Role::Worker,
        _ => return None,
    };
    Some((role, id.parse().ok()?))
}
