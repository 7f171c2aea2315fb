//! How `ftrec server` starts a spare on its own host when the coordinator asks (a lost
//! slot waited past `cluster.survivor_spare_after_s` with no replacement; issue 42,
//! hole 8): this same binary, `server --spare --hosted-by ID`, with the same job file and
//! the same way to the coordinator. The spare is a process of its own, in a process group
//! of its own, not a task in this one: it outlives this server if this server dies (not
//! a restart of the whole container or cgroup), and it is stopped on its own when its
//! slot moves to a spare from elsewhere.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use ftrec_rpc::PsError;
use ftrec_server::StartSpare;

/// Builds the starter from this server's own arguments.
pub(super) fn starter(job: &Path, coordinator: &super::CoordinatorArg, host: &str) -> StartSpare {
    let job = job.to_path_buf();
    let mut find = Vec::new();
    if let Some(address) = &coordinator.coordinator {
        find.extend(["--coordinator".to_string(), address.clone()]);
    }
    if let Some(endpoints) = &coordinator.etcd {
        find.extend(["--etcd".to_string(), endpoints.join(",")]);
    }
    let host = host.to_string();
    Arc::new(move |id| start(&job, &find, &host, id))
}

fn start(job: &Path, find: &[String], host: &str, id: usize) -> Result<String, PsError> {
    let io = |path: &Path, error: std::io::Error| PsError::Io {
        path: path.display().to_string(),
        error,
    };
    let exe = std::env::current_exe().map_err(|e| io(Path::new("/proc/self/exe"), e))?;
    let log = log_path(job, id);
    let file = std::fs::File::create(&log).map_err(|e| io(&log, e))?;
    let stderr = file.try_clone().map_err(|e| io(&log, e))?;
    let mut command = Command::new(&exe);
    command
        .arg("server")
        .arg("--job")
        .arg(job)
        .args(find)
        .args(["--spare", "--host", host, "--hosted-by", &id.to_string()])
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(stderr)
        // Its parent is this server, not a launcher.
        .env_remove(ftrec_cluster::launch::LAUNCHER_PID_ENV)
        // A process group of its own: a Ctrl-C or a signal to this server's group does
        // not take the slot it holds down with this server.
        .process_group(0);
    let mut child = command.spawn().map_err(|e| io(&exe, e))?;
    let pid = child.id();
    // Reaped when it exits, so that it never lingers as a zombie under this server.
    std::thread::spawn(move || {
        if let Ok(status) = child.wait() {
            tracing::info!("the spare (pid {pid}) started on this host exited: {status}");
        }
    });
    Ok(format!("pid {pid}, log {}", log.display()))
}

/// Beside the job file, which every member of the job on this host reads: the directory
/// an operator looks in. Named after the server and the time, never reused.
fn log_path(job: &Path, id: usize) -> PathBuf {
    let dir = job.parent().unwrap_or(Path::new("."));
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    dir.join(format!("spare-on-server-{id}-{millis}.log"))
}
