//! The soak's processes: each started by hand in its host's namespace, as an operator's
//! supervisor would start it, with its stdout and log in the run directory; and what each
//! one costs (peak RSS, open files), read from `/proc` while it runs so that a leak shows
//! between the start and the end.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde::Serialize;

use super::net::HostNet;
use crate::error::{BenchError, Result};

/// One process of the job.
pub struct Proc {
    /// The name it reports and logs under (`server-h3`, `leader-c1`, `etcd-e0`).
    pub name: String,
    pub host: String,
    pub child: Child,
    pub log: PathBuf,
    pub out: PathBuf,
    /// Directories it writes to (its disk use is reported).
    pub dirs: Vec<PathBuf>,
    pub exited: Option<i32>,
    pub frozen: bool,
    pub first: Option<Usage>,
    pub last: Option<Usage>,
}

/// One reading of a process's resources.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Usage {
    pub peak_rss_bytes: u64,
    pub open_files: u64,
    pub disk_bytes: u64,
}

/// Starts `program args` in `host`'s namespace.
pub fn spawn(
    host: &HostNet,
    name: &str,
    logs: &Path,
    program: &Path,
    args: &[String],
    dirs: Vec<PathBuf>,
) -> Result<Proc> {
    let log = logs.join(format!("{name}.log"));
    let out = logs.join(format!("{name}.out"));
    let file = |p: &Path| std::fs::File::create(p).map_err(BenchError::file(p));
    let child = Command::new("ip")
        .args(["netns", "exec", &host.ns])
        .arg("env")
        .arg(format!(
            "FTREC_LOG={}",
            std::env::var("FTREC_LOG").unwrap_or_else(|_| "info".into())
        ))
        .arg("NO_COLOR=1")
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(file(&out)?)
        .stderr(file(&log)?)
        .spawn()
        .map_err(|source| BenchError::IoDuring {
            what: format!("soak: starting {name} in {}", host.ns),
            source,
        })?;
    Ok(Proc {
        name: name.to_string(),
        host: host.name.clone(),
        child,
        log,
        out,
        dirs,
        exited: None,
        frozen: false,
        first: None,
        last: None,
    })
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it still runs (reaps it and keeps its exit code once it has ended).
    pub fn alive(&mut self) -> bool {
        if self.exited.is_some() {
            return false;
        }
        match self.child.try_wait() {
            Ok(Some(status)) => {
                self.exited = Some(status.code().unwrap_or(-1));
                false
            }
            Ok(None) => true,
            Err(_) => false,
        }
    }

    pub fn signal(&mut self, signal: &str) {
        if self.alive() {
            let _ = Command::new("kill")
                .args([format!("-{signal}"), self.pid().to_string()])
                .status();
        }
        match signal {
            "STOP" => self.frozen = true,
            "CONT" => self.frozen = false,
            _ => {}
        }
    }

    /// SIGKILL (a frozen one too), then reaps it.
    pub fn kill(&mut self) {
        if self.alive() {
            let _ = self.child.kill();
            if let Ok(status) = self.child.wait() {
                self.exited = Some(status.code().unwrap_or(-9));
            }
        }
        self.frozen = false;
    }

    /// Reads its resources now; the first reading and the latest are kept.
    pub fn sample(&mut self) {
        if !self.alive() {
            return;
        }
        let pid = self.pid();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let kb = |key: &str| {
            status
                .lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let open_files = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count() as u64)
            .unwrap_or(0);
        let usage = Usage {
            peak_rss_bytes: kb("VmHWM:") * 1024,
            open_files,
            disk_bytes: self.dirs.iter().map(|d| disk_use(d)).sum(),
        };
        if self.first.is_none() {
            self.first = Some(usage);
        }
        self.last = Some(usage);
    }

    /// Its report: what it cost at the start and the end.
    pub fn usage(&self) -> MemberUsage {
        MemberUsage {
            name: self.name.clone(),
            host: self.host.clone(),
            start: self.first,
            end: self.last,
            exit: self.exited,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct MemberUsage {
    pub name: String,
    pub host: String,
    pub start: Option<Usage>,
    pub end: Option<Usage>,
    pub exit: Option<i32>,
}

/// Bytes under `dir` (0 where it is not there).
pub fn disk_use(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => disk_use(&e.path()),
            Ok(_) => e.metadata().map(|m| m.len()).unwrap_or(0),
            Err(_) => 0,
        })
        .sum()
}
