//! `--kill` specs: which member dies, and when (after a time, at a granted step, or at a
//! fault point inside a server).

use std::time::Duration;

use ftrec_faults::{FaultAction, FaultSpec, points};
use ftrec_proto::proto::Role;

/// When a `--kill` fires.
#[derive(Clone, Debug, PartialEq)]
pub enum KillAt {
    /// This long after training starts.
    After(Duration),
    /// SIGSTOP this long after training starts: the process is frozen for good, silent
    /// rather than gone (its connections stay open), until the cluster fences it and the
    /// launcher SIGKILLs the superseded process.
    FreezeAfter(Duration),
    /// SIGKILL a server slot's process at the first moment, this long after training
    /// starts or later, that it recovers: a replacement rebuilding in the background
    /// (erasure coding with 2PC), else a slot waiting for its recovery (a restore, a
    /// blocking rebuild) with a process of its own. A second failure during a recovery,
    /// whatever the strategy's recovery takes; it never strikes the process it finds dead.
    DuringRecovery(Duration),
    /// As soon as the coordinator grants this global step (exact, for tests).
    Step(u64),
    /// The member kills itself at this fault point (armed in its registry,
    /// `ftrec-faults`): a server's `prepare:N`, `commit:N` or `rebuild`, a worker's
    /// `push:N`, `prepared-first:N` or `prepared:N`.
    Point(FaultSpec),
}

/// `role:id@seconds` (`server:1@10s`) or `role:id@step:N` (`server:1@step:8`): SIGKILL
/// that process that long after training starts, or as soon as step N is granted.
/// `role:id@seconds=freeze` (`server:1@10s=freeze`) SIGSTOPs it instead.
#[derive(Clone, Debug, PartialEq)]
pub struct KillSpec {
    pub role: Role,
    pub id: usize,
    pub at: KillAt,
}

/// The points a `--kill` may name (a kill, not a planted skip): a server's `prepare:N`,
/// `commit:N`, `rebuild` or `restore`, a worker's `push:N`, `prepared-first:N` or
/// `prepared:N`.
fn is_kill_point(role: Role, when: &str) -> bool {
    FaultSpec::parse(when).is_ok_and(|spec| {
        spec.action == FaultAction::Kill
            && match (role, spec.point.as_str()) {
                (Role::Server, points::REBUILD | points::RESTORE) => spec.step.is_none(),
                (Role::Server, points::PREPARE | points::COMMIT) => spec.step.is_some(),
                (Role::Worker, points::PUSH | points::PREPARED | points::PREPARED_FIRST) => {
                    spec.step.is_some()
                }
                _ => false,
            }
    })
}

impl std::str::FromStr for KillSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "--kill {s:?}: expected ROLE:ID@SECONDS, ROLE:ID@SECONDS=freeze, \
                 server:ID@SECONDS=recovering, ROLE:ID@step:N, \
                 (servers of an erasure-coded run) server:ID@prepare:N, @commit:N or @rebuild, \
                 or worker:ID@push:N, @prepared-first:N or @prepared:N, e.g. server:1@10s, \
                 server:1@10s=freeze, server:1@step:8, server:1@commit:8 or worker:0@prepared:8"
            )
        };
        let (who, when) = s.split_once('@').ok_or_else(bad)?;
        let (role, id) = parse_member(who).map_err(|_| bad())?;
        if let Some(secs) = when.strip_suffix("=freeze") {
            return Ok(Self {
                role,
                id,
                at: KillAt::FreezeAfter(parse_seconds(secs).ok_or_else(bad)?),
            });
        }
        if let Some(secs) = when.strip_suffix("=recovering") {
            if role != Role::Server {
                return Err(bad());
            }
            return Ok(Self {
                role,
                id,
                at: KillAt::DuringRecovery(parse_seconds(secs).ok_or_else(bad)?),
            });
        }
        let at = match when.strip_prefix("step:") {
            Some(step) => KillAt::Step(step.parse().map_err(|_| bad())?),
            None if is_kill_point(role, when) => {
                KillAt::Point(FaultSpec::parse(when).map_err(|_| bad())?)
            }
            None => KillAt::After(parse_seconds(when).ok_or_else(bad)?),
        };
        Ok(Self { role, id, at })
    }
}

/// `10s` or `10`: a finite, non-negative number of seconds.
fn parse_seconds(s: &str) -> Option<Duration> {
    let secs: f64 = s.trim_end_matches('s').parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs))
}

impl std::fmt::Display for KillSpec {
    /// The `--kill` spelling that parses back to this spec.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let who = match self.role {
            Role::Server => "server",
            _ => "worker",
        };
        match &self.at {
            KillAt::After(t) => write!(f, "{who}:{}@{}s", self.id, t.as_secs_f64()),
            KillAt::FreezeAfter(t) => write!(f, "{who}:{}@{}s=freeze", self.id, t.as_secs_f64()),
            KillAt::DuringRecovery(t) => {
                write!(f, "{who}:{}@{}s=recovering", self.id, t.as_secs_f64())
            }
            KillAt::Step(step) => write!(f, "{who}:{}@step:{step}", self.id),
            KillAt::Point(p) => write!(f, "{who}:{}@{p}", self.id),
        }
    }
}

/// When `--kill coordinator@...` SIGKILLs the leading coordinator (`cluster run --etcd`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CoordinatorKill {
    /// This long after training starts (`coordinator@8s`).
    After(Duration),
    /// As soon as a server rebuilds in the background (`coordinator@rebuild`): the new
    /// leader must finish or restart a recovery it did not start.
    DuringRebuild,
}

/// `coordinator@SECONDS` or `coordinator@rebuild`; `None` when `s` names another member.
pub fn coordinator_kill(s: &str) -> Option<Result<CoordinatorKill, String>> {
    let when = s.strip_prefix("coordinator@")?;
    if when == "rebuild" {
        return Some(Ok(CoordinatorKill::DuringRebuild));
    }
    let secs = when.trim_end_matches('s').parse::<f64>();
    Some(match secs {
        Ok(secs) if secs.is_finite() && secs >= 0.0 => {
            Ok(CoordinatorKill::After(Duration::from_secs_f64(secs)))
        }
        _ => Err(format!(
            "--kill {s:?}: expected coordinator@SECONDS or coordinator@rebuild, e.g. \
             coordinator@8s"
        )),
    })
}

impl KillSpec {
    /// `server:J@POINT[:STEP][=kill|skip|flip|delay-MS]`: any fault point of a server, any action
    /// (`cluster run --fault`).
    pub fn fault(s: &str) -> Result<Self, String> {
        let (who, spec) = s.split_once('@').ok_or_else(|| {
            format!("--fault {s:?}: expected server:J@POINT[:STEP][=kill|skip|flip|delay-MS]")
        })?;
        let (role, id) = parse_member(who).map_err(|e| format!("--fault {e}"))?;
        if role != Role::Server {
            return Err(format!("--fault {s:?}: fault points are in servers"));
        }
        let spec = FaultSpec::parse(spec).map_err(|e| format!("--fault: {e}"))?;
        Ok(Self {
            role,
            id,
            at: KillAt::Point(spec),
        })
    }
}

/// `server:1` or `worker:0`.
pub fn parse_member(s: &str) -> Result<(Role, usize), String> {
    let (role, id) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected ROLE:ID, e.g. server:1"))?;
    let role = match role {
        "server" => Role::Server,
        "worker" => Role::Worker,
        other => return Err(format!("{s:?}: unknown role {other:?} (server or worker)")),
    };
    let id = id
        .parse()
        .map_err(|_| format!("{s:?}: {id:?} is not a process id number"))?;
    Ok((role, id))
}

/// Every `--kill` names a member the cluster has, on the layouts it will run on (the job
/// file's, then those of `--scale-at`).
pub(super) fn check_members(
    job: &ftrec_rpc::Job,
    kills: &[KillSpec],
    scale_at: &[(u64, usize)],
) -> Result<(), ftrec_rpc::PsError> {
    let servers = scale_at
        .iter()
        .map(|&(_, n)| n)
        .fold(job.config.cluster.servers, usize::max);
    for k in kills {
        let (what, count) = match k.role {
            Role::Server => ("servers", servers),
            _ => ("workers", job.config.cluster.workers),
        };
        if k.id >= count {
            return Err(ftrec_rpc::PsError::Config(format!(
                "--kill names {} {}, but the cluster has {count} {what} (0..={})",
                &what[..what.len() - 1],
                k.id,
                count.saturating_sub(1)
            )));
        }
        if let KillAt::Point(p) = &k.at {
            check_worker_point(job, k, p)?;
        }
    }
    Ok(())
}

/// A worker's fault point the job never passes is refused, not armed to fire never:
/// `prepared` and `prepared-first` are 2PC's (an erasure-coded job with
/// `ec.two_phase_commit`), and `prepared-first` is asynchronous workers' (deterministic
/// ones prepare every server at once).
fn check_worker_point(
    job: &ftrec_rpc::Job,
    k: &KillSpec,
    p: &FaultSpec,
) -> Result<(), ftrec_rpc::PsError> {
    let c = &job.config;
    let two_phase = c.cluster.ft.erasure_coded() && c.ec.two_phase_commit;
    let why = match p.point.as_str() {
        points::PREPARED | points::PREPARED_FIRST if !two_phase => {
            "it is a point of the two-phase commit: an erasure-coded job (--ft ec or \
             ec+checkpoint) with ec.two_phase_commit"
        }
        points::PREPARED_FIRST if c.cluster.deterministic => {
            "deterministic workers prepare every server at once: use prepared:N, or \
             asynchronous workers"
        }
        _ => return Ok(()),
    };
    Err(ftrec_rpc::PsError::Config(format!(
        "--kill {k}: this job never passes {}: {why}",
        p.point
    )))
}

/// The fault points to arm, by member slot.
pub(super) fn fault_points(kills: &[KillSpec]) -> Vec<(Role, usize, FaultSpec)> {
    kills
        .iter()
        .filter_map(|k| match &k.at {
            KillAt::Point(p) => Some((k.role, k.id, p.clone())),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_freeze_parses_and_prints_back() {
        let spec: KillSpec = "server:2@1.5s=freeze".parse().unwrap();
        assert_eq!(spec.role, Role::Server);
        assert_eq!(spec.id, 2);
        assert_eq!(spec.at, KillAt::FreezeAfter(Duration::from_millis(1500)));
        let during: KillSpec = "server:1@2s=recovering".parse().unwrap();
        assert_eq!(during.at, KillAt::DuringRecovery(Duration::from_secs(2)));
        assert!("worker:1@2s=recovering".parse::<KillSpec>().is_err());
        for s in [
            "server:2@1.5s=freeze",
            "worker:0@3s",
            "server:1@step:8",
            "server:1@2.5s=recovering",
        ] {
            let spec: KillSpec = s.parse().unwrap();
            assert_eq!(spec.to_string().parse::<KillSpec>().unwrap(), spec, "{s}");
        }
    }

    #[test]
    fn worker_fault_points_parse_for_workers_only_and_are_armed_by_slot() {
        let spec: KillSpec = "worker:1@prepared:8".parse().unwrap();
        assert_eq!(spec.role, Role::Worker);
        assert_eq!(spec.to_string(), "worker:1@prepared:8");
        let server: KillSpec = "server:0@commit:5".parse().unwrap();
        let armed = fault_points(&[spec, server]);
        assert_eq!(armed.len(), 2);
        assert_eq!((armed[0].0, armed[0].1), (Role::Worker, 1));
        assert_eq!(armed[0].2.point, points::PREPARED);
        assert_eq!((armed[1].0, armed[1].1), (Role::Server, 0));
        // A server's point on a worker, a worker's on a server, and a point without its
        // step are refused, naming both kinds.
        for bad in ["worker:0@commit:5", "server:0@push:3", "worker:0@prepared"] {
            let err = bad.parse::<KillSpec>().unwrap_err();
            assert!(err.contains("worker:ID@push:N"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_worker_point_the_job_never_passes_is_refused() {
        let job = |ft: ftrec_config::FaultTolerance, deterministic: bool| {
            let mut c = ftrec_config::JobConfig::preset("tiny").unwrap();
            c.cluster.servers = 3;
            c.cluster.ft = ft;
            c.cluster.deterministic = deterministic;
            c.data.dir = Some(std::env::temp_dir());
            ftrec_rpc::Job::new(c).unwrap()
        };
        use ftrec_config::FaultTolerance::{Checkpoint, Ec};
        let kill = |s: &str| vec![s.parse::<KillSpec>().unwrap()];
        let refused =
            |job: &ftrec_rpc::Job, s: &str| check_members(job, &kill(s), &[]).unwrap_err();
        let e = refused(&job(Checkpoint, true), "worker:0@prepared:5").to_string();
        assert!(e.contains("two-phase commit"), "{e}");
        let e = refused(&job(Ec, true), "worker:0@prepared-first:5").to_string();
        assert!(e.contains("deterministic"), "{e}");
        check_members(&job(Ec, true), &kill("worker:0@prepared:5"), &[]).unwrap();
        check_members(&job(Ec, false), &kill("worker:1@prepared-first:5"), &[]).unwrap();
        check_members(&job(Checkpoint, true), &kill("worker:0@push:5"), &[]).unwrap();
        // A slot of a layout the job moves to (`--scale-at`) may be named; no other.
        let load = kill("server:4@step:90");
        let e = check_members(&job(Checkpoint, true), &load, &[]).unwrap_err();
        assert!(e.to_string().contains("3 servers"), "{e}");
        check_members(&job(Checkpoint, true), &load, &[(80, 5)]).unwrap();
        check_members(&job(Checkpoint, true), &load, &[(80, 4)]).unwrap_err();
    }

    #[test]
    fn a_freeze_needs_a_time() {
        for bad in [
            "server:1@step:8=freeze",
            "server:1@-1s=freeze",
            "server:1@=freeze",
            "server:1@nans=freeze",
        ] {
            let err = bad.parse::<KillSpec>().unwrap_err();
            assert!(err.contains("=freeze"), "{bad}: {err}");
        }
    }
}
