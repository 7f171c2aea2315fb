//! A real etcd on loopback (Debian's `etcd-server`), each member with its own data
//! directory: what the tests and `ftrec bench coordinator` run against. Nothing here is a
//! stand-in: it starts the `etcd` binary and waits until it serves.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One etcd process; killed and reaped when dropped.
pub struct LocalEtcd {
    child: Child,
    pub name: String,
    /// `127.0.0.1:PORT`, what `--etcd` takes.
    pub endpoint: String,
    pub log: PathBuf,
}

/// Why a local etcd did not start.
#[derive(Debug, thiserror::Error)]
pub enum LocalEtcdError {
    #[error(
        "cannot start {binary}: {error} (install Debian's etcd-server, or run scripts/test-deps)"
    )]
    Spawn {
        binary: String,
        error: std::io::Error,
    },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("etcd {name} did not serve on {endpoint} within {limit:?}; its log: {log}")]
    NotServing {
        name: String,
        endpoint: String,
        limit: Duration,
        log: String,
    },
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts an etcd cluster of `members` processes under `dir` and waits until every member
/// serves. One member is a single-node cluster.
/// A port found free may be taken by another process before etcd binds it (tests start
/// many servers at once): a member that exits or does not serve gets the whole cluster
/// started again on new ports, up to three times.
pub fn start_cluster(dir: &Path, members: usize) -> Result<Vec<LocalEtcd>, LocalEtcdError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        match start_cluster_once(&dir.join(format!("attempt-{attempt}")), members) {
            Err(LocalEtcdError::NotServing { .. }) if attempt < 3 => continue,
            result => return result,
        }
    }
}

fn start_cluster_once(dir: &Path, members: usize) -> Result<Vec<LocalEtcd>, LocalEtcdError> {
    let binary = std::env::var("FTREC_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
    let ports: Vec<(u16, u16)> = (0..members)
        .map(|_| Ok((free_port()?, free_port()?)))
        .collect::<std::io::Result<_>>()?;
    let initial: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
        .collect();
    let initial = initial.join(",");
    let mut started = Vec::new();
    for (i, (client, peer)) in ports.into_iter().enumerate() {
        let name = format!("m{i}");
        let data = dir.join(format!("etcd-{name}"));
        std::fs::create_dir_all(&data)?;
        let log = dir.join(format!("etcd-{name}.log"));
        let out = std::fs::File::create(&log)?;
        let err = out.try_clone()?;
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new(&binary)
            .args(["--name", &name, "--data-dir"])
            .arg(&data)
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-state", "new"])
            // etcd 3.5's default (off in 3.4): a member cut off from its peers does not
            // raise its raft term, so it does not depose their leader when it returns.
            .arg("--pre-vote")
            .args([
                "--initial-cluster-token",
                &format!("ftrec-{}", std::process::id()),
            ])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|error| LocalEtcdError::Spawn {
                binary: binary.clone(),
                error,
            })?;
        started.push(LocalEtcd {
            child,
            name,
            endpoint: format!("127.0.0.1:{client}"),
            log,
        });
    }
    let limit = Duration::from_secs(20);
    for member in &mut started {
        member.wait_serving(limit)?;
    }
    Ok(started)
}

/// One single-member etcd under `dir`.
pub fn start(dir: &Path) -> Result<LocalEtcd, LocalEtcdError> {
    let mut members = start_cluster(dir, 1)?;
    Ok(members.remove(0))
}

impl LocalEtcd {
    /// Waits until the member answers its health endpoint (it has joined a quorum).
    fn wait_serving(&mut self, limit: Duration) -> Result<(), LocalEtcdError> {
        let started = Instant::now();
        while started.elapsed() < limit {
            if self.healthy() {
                return Ok(());
            }
            // Exited (its port was taken, say): no use waiting out the limit.
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(LocalEtcdError::NotServing {
            name: self.name.clone(),
            endpoint: self.endpoint.clone(),
            limit,
            log: self.log.display().to_string(),
        })
    }

    /// `GET /health` says `"health":"true"`.
    fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(&self.endpoint) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let request = format!("GET /health HTTP/1.0\r\nHost: {}\r\n\r\n", self.endpoint);
        if s.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        reply.contains("\"health\":\"true\"")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILLs the member (a host lost).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        self.kill();
    }
}
