//! The soak's hosts: one Linux network namespace per member, each with a veth pair whose
//! other end sits on a bridge. Members that a rack fault may take down together (the
//! servers and their spares) sit two by two on rack bridges, each joined to the core
//! bridge by an uplink veth; everything else sits on the core bridge. The core bridge has
//! an address in the root namespace so that the bench reads the coordinators' metrics
//! without entering their namespaces. Every name starts with a prefix made of the bench's
//! pid, so two soaks (or a soak and the shell harness) never share a link; dropping the
//! [`Net`] deletes it all (the rules and qdiscs go with their namespaces).

use std::process::{Command, Stdio};

use crate::error::{BenchError, Result};

/// The subnet every host is on; `.254` is the root namespace's address on the core bridge.
pub const SUBNET: &str = "10.78.0";

/// One host: a namespace with one interface, `eth0`, at `ip`.
#[derive(Clone, Debug)]
pub struct HostNet {
    /// The short name the soak reports it by (`e0`, `c1`, `h3`, `w0`).
    pub name: String,
    /// The namespace.
    pub ns: String,
    /// The bridge end of its veth (taking it down cuts the host off).
    pub port: String,
    pub ip: String,
    /// The rack bridge it hangs from, where it has one.
    pub rack: Option<usize>,
}

pub struct Net {
    prefix: String,
    pub hosts: Vec<HostNet>,
    racks: usize,
    up: bool,
}

/// Runs a command that sets up or changes the network; its stderr in the error.
pub fn sh(program: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| BenchError::IoDuring {
            what: format!("soak: starting {program} {}", args.join(" ")),
            source,
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(BenchError::Failed(format!(
        "soak: {program} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

/// The same, where failing is fine (tearing down what may already be gone).
fn sh_quiet(program: &str, args: &[&str]) {
    let _ = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Why network namespaces cannot be used here, or `None`.
pub fn unusable() -> Option<String> {
    let uid = effective_uid();
    if uid != Some(0) {
        let uid = uid.map_or("unknown".to_string(), |u| u.to_string());
        return Some(format!("not root (uid {uid})"));
    }
    for tool in ["ip", "iptables", "tc"] {
        if which(tool).is_none() {
            return Some(format!(
                "no {tool} command (Debian's iproute2 and iptables)"
            ));
        }
    }
    let probe = format!("sk-probe-{}", std::process::id());
    if let Err(e) = sh("ip", &["netns", "add", &probe]) {
        return Some(e.to_string());
    }
    sh_quiet("ip", &["netns", "del", &probe]);
    None
}

/// The effective uid, from `/proc/self/status` (its `Uid:` line: real, effective, ...).
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// The full path of `program` on PATH.
pub fn which(program: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

impl Net {
    /// Hosts named `names` (core hosts first, then `rack_hosts` that go two to a rack);
    /// addresses are handed out in order from `.1`.
    pub fn up(core: &[String], rack_hosts: &[String]) -> Result<Self> {
        let prefix = format!("sk{}", std::process::id() % 100_000);
        let racks = rack_hosts.len().div_ceil(2);
        let mut net = Net {
            prefix: prefix.clone(),
            hosts: Vec::new(),
            racks,
            up: true,
        };
        let core_bridge = format!("{prefix}-br");
        net.bridge(&core_bridge)?;
        sh(
            "ip",
            &[
                "addr",
                "add",
                &format!("{SUBNET}.254/24"),
                "dev",
                &core_bridge,
            ],
        )?;
        for rack in 0..racks {
            let bridge = format!("{prefix}-r{rack}");
            net.bridge(&bridge)?;
            let (up, down) = (format!("{prefix}-r{rack}u"), format!("{prefix}-r{rack}d"));
            sh(
                "ip",
                &["link", "add", &up, "type", "veth", "peer", "name", &down],
            )?;
            sh("ip", &["link", "set", &up, "master", &core_bridge, "up"])?;
            sh("ip", &["link", "set", &down, "master", &bridge, "up"])?;
        }
        let placed = core
            .iter()
            .map(|n| (n, None))
            .chain(rack_hosts.iter().enumerate().map(|(i, n)| (n, Some(i / 2))));
        for (i, (name, rack)) in placed.enumerate() {
            let host = HostNet {
                name: name.clone(),
                ns: format!("{prefix}-{name}"),
                port: format!("{prefix}-{name}h"),
                ip: format!("{SUBNET}.{}", i + 1),
                rack,
            };
            let bridge = rack.map_or(core_bridge.clone(), |r| format!("{prefix}-r{r}"));
            net.attach(&host, &bridge)?;
            net.hosts.push(host);
        }
        Ok(net)
    }

    fn bridge(&self, name: &str) -> Result<()> {
        // Bridged frames skip the host's own iptables: a host FORWARD policy of DROP would
        // otherwise cut every member off.
        if sh(
            "ip",
            &[
                "link",
                "add",
                name,
                "type",
                "bridge",
                "nf_call_iptables",
                "0",
            ],
        )
        .is_err()
        {
            sh("ip", &["link", "add", name, "type", "bridge"])?;
        }
        sh("ip", &["link", "set", name, "up"])
    }

    fn attach(&self, host: &HostNet, bridge: &str) -> Result<()> {
        let inner = format!("{}n", host.ns);
        sh("ip", &["netns", "add", &host.ns])?;
        sh(
            "ip",
            &[
                "link", "add", &host.port, "type", "veth", "peer", "name", &inner,
            ],
        )?;
        sh("ip", &["link", "set", &host.port, "master", bridge, "up"])?;
        sh("ip", &["link", "set", &inner, "netns", &host.ns])?;
        let n = host.ns.as_str();
        sh("ip", &["-n", n, "link", "set", &inner, "name", "eth0"])?;
        sh(
            "ip",
            &[
                "-n",
                n,
                "addr",
                "add",
                &format!("{}/24", host.ip),
                "dev",
                "eth0",
            ],
        )?;
        sh("ip", &["-n", n, "link", "set", "eth0", "up"])?;
        sh("ip", &["-n", n, "link", "set", "lo", "up"])
    }

    pub fn host(&self, name: &str) -> &HostNet {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| unreachable!("the soak names only hosts it made: {name}"))
    }

    /// A host's link to its bridge, down or up.
    pub fn link(&self, host: &HostNet, up: bool) -> Result<()> {
        sh(
            "ip",
            &["link", "set", &host.port, if up { "up" } else { "down" }],
        )
    }

    /// A rack's uplink to the core bridge, down (every host on it lost at once) or up.
    pub fn rack_uplink(&self, rack: usize, up: bool) -> Result<()> {
        let port = format!("{}-r{rack}u", self.prefix);
        sh(
            "ip",
            &["link", "set", &port, if up { "up" } else { "down" }],
        )
    }

    pub fn racks(&self) -> usize {
        self.racks
    }

    /// Silent drops between `a` and `b`: `to_b` drops what `a` sends `b`, `to_a` the reverse;
    /// each in both hosts' namespaces and chains, so that neither side's kernel answers.
    /// `insert` false removes the same rules.
    pub fn partition(
        &self,
        a: &HostNet,
        b: &HostNet,
        to_b: bool,
        to_a: bool,
        insert: bool,
    ) -> Result<()> {
        let op = if insert { "-I" } else { "-D" };
        let rule = |host: &HostNet, chain: &str, flag: &str, peer: &HostNet| {
            sh(
                "ip",
                &[
                    "netns", "exec", &host.ns, "iptables", op, chain, flag, &peer.ip, "-j", "DROP",
                ],
            )
        };
        if to_b {
            rule(a, "OUTPUT", "-d", b)?;
            rule(b, "INPUT", "-s", a)?;
        }
        if to_a {
            rule(b, "OUTPUT", "-d", a)?;
            rule(a, "INPUT", "-s", b)?;
        }
        Ok(())
    }

    /// Random loss of `probability` on everything `host` sends and receives (or, with
    /// `insert` false, the same rules removed). Each packet is dropped where it arrives,
    /// in `host`'s INPUT chain or, for what `host` sends, in the receiver's, as a lossy
    /// wire loses it: a DROP in the sender's own OUTPUT chain fails the send locally, and
    /// Linux then waits at least 200 ms (its probe timer) before it sends again, a stall
    /// no real link's loss causes.
    pub fn loss(&self, host: &HostNet, probability: f64, insert: bool) -> Result<()> {
        let op = if insert { "-I" } else { "-D" };
        let p = format!("{probability}");
        let drop_from = |at: &HostNet, source: Option<&str>| {
            let mut args = vec!["netns", "exec", &at.ns, "iptables", op, "INPUT"];
            if let Some(source) = source {
                args.extend(["-s", source]);
            }
            args.extend([
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                &p,
                "-j",
                "DROP",
            ]);
            sh("ip", &args)
        };
        drop_from(host, None)?;
        for other in self.hosts.iter().filter(|h| h.ns != host.ns) {
            drop_from(other, Some(&host.ip))?;
        }
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        if !self.up {
            return;
        }
        self.up = false;
        for host in &self.hosts {
            // Whatever still runs in the namespace was started by this soak.
            if let Ok(out) = Command::new("ip")
                .args(["netns", "pids", &host.ns])
                .output()
            {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    sh_quiet("kill", &["-CONT", pid]);
                    sh_quiet("kill", &["-KILL", pid]);
                }
            }
        }
        for host in &self.hosts {
            sh_quiet("ip", &["netns", "del", &host.ns]);
            sh_quiet("ip", &["link", "del", &host.port]);
        }
        for rack in 0..self.racks {
            sh_quiet("ip", &["link", "del", &format!("{}-r{rack}u", self.prefix)]);
            sh_quiet("ip", &["link", "del", &format!("{}-r{rack}", self.prefix)]);
        }
        sh_quiet("ip", &["link", "del", &format!("{}-br", self.prefix)]);
    }
}
