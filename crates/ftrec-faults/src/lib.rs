//! Fault points, armed by name at run time, one registry per cluster member.
//!
//! TiKV's fail-rs is the model, but its registry is global to a process. Here every member
//! (a server, a worker, the coordinator) is handed its own [`Faults`] in its options: a
//! member started as a process gets one built from its `--fault` flags, and in the
//! in-process cluster every simulated host gets its own, so arming a point on one host never
//! fires it on another. Release builds keep the points: `cluster run --kill
//! server:J@prepare:N` depends on them.
//!
//! A point is a name in the code (`faults.kill_at(points::PREPARE, Some(step))`). An armed
//! spec `NAME[:STEP][=ACTION]` fires once, at the first pass through that point (at that
//! step, if it names one), and is then disarmed. `ACTION` is `kill` (the default), `skip`,
//! `flip` (the code at the point corrupts one bit of what it writes, as bad RAM would:
//! silent corruption for the parity checks to find), or `delay-MS`: the member stalls
//! there for MS milliseconds, as a slow disk, a long pause or a congested link would stall
//! it (the windows of 2PC that only a slow member opens). Each point takes only the
//! actions its code implements ([`points::actions`]); a spec naming another is refused.

use std::fmt;
use std::sync::{Arc, Mutex};

/// The points the code passes through. Each names where it is and what has happened there.
pub mod points {
    /// A server, after staging step N and sending its parity differences, before it
    /// answers 2PC phase 1.
    pub const PREPARE: &str = "prepare";
    /// A server, on 2PC phase 2 of step N, before it installs the step (the others do).
    pub const COMMIT: &str = "commit";
    /// A replacement server, after decoding its first range of lost state.
    pub const REBUILD: &str = "rebuild";
    /// A parity holder, on folding step N's difference from a data server: `skip` drops
    /// that difference, `flip` folds it with one bit flipped into the first parity row it
    /// touches (a parity row silently corrupted). Planted bugs for the tests that must
    /// show the checks can fail.
    pub const FOLD_PARITY: &str = "fold-parity";
    /// A server, installing step N (`Core::install`, under the shard's write lock):
    /// `flip` flips one bit of the first embedding row the step installs, after the
    /// parity differences went out, as bad RAM would (a data row silently corrupted).
    pub const INSTALL: &str = "install";
    /// A server, asked for its part of the coordinated cut of step N, before it writes
    /// anything (a cut that another server's death leaves abandoned).
    pub const CUT: &str = "cut";
    /// A server, asked to restore a cut (a rollback's part), before it loads anything: a
    /// member lost in the middle of another's recovery.
    pub const RESTORE: &str = "restore";

    /// A server of a resumed or moved job (`cluster scale`), joined, before it loads its
    /// rows from the cut: a new server lost in the middle of a move.
    pub const LOAD: &str = "load";

    /// A server, before each piece of a table it streams (`FetchRows`: to a replacement
    /// rebuilding, the final gather, verify-parity): `delay-MS` stalls the stream there
    /// while the server otherwise lives on (a stream stalled mid-way).
    pub const SEND_ROWS: &str = "send-rows";

    /// A worker, with step N pulled and computed, before it sends any of its pushes: a
    /// worker lost with its step granted and nothing of it sent.
    pub const PUSH: &str = "push";
    /// A worker, once every server prepared step N (2PC phase 1), before it sends any
    /// commit: a worker lost between the phases, its step prepared everywhere and
    /// decided nowhere.
    pub const PREPARED: &str = "prepared";
    /// A worker that prepares one server at a time (asynchronous workers), once the first
    /// server prepared step N, before the next: a step prepared on some servers only.
    pub const PREPARED_FIRST: &str = "prepared-first";
    /// A coordinator, with a recovery decided (and, with etcd, recorded), before it sends
    /// the servers anything: a leader lost in the middle of a recovery.
    pub const RECOVERY: &str = "recovery";
    /// A coordinator, with a move's cut committed and the move recorded, before it
    /// switches to the new layout: a leader lost in the middle of a move.
    pub const SWITCH: &str = "switch";
    /// A coordinator just elected, before it fences any server: a new leader lost in the
    /// middle of its takeover.
    pub const TAKEOVER: &str = "takeover";
    /// A coordinator, with the coordinated cut of step N committed and reported (with
    /// etcd, recorded), before it prunes older cuts: a leader lost just after a cut.
    pub const CUT_COMMITTED: &str = "cut-committed";
    /// A coordinator, told that a server's background rebuild ended, before it notes it:
    /// a leader lost while its record still has the slot rebuilding.
    pub const REBUILD_ENDED: &str = "rebuild-ended";

    /// Every point, for validating specs.
    pub const ALL: [&str; 17] = [
        PREPARE,
        COMMIT,
        REBUILD,
        FOLD_PARITY,
        INSTALL,
        CUT,
        RESTORE,
        LOAD,
        SEND_ROWS,
        PUSH,
        PREPARED,
        PREPARED_FIRST,
        RECOVERY,
        SWITCH,
        TAKEOVER,
        CUT_COMMITTED,
        REBUILD_ENDED,
    ];

    /// The actions the code at `point` takes: a spec asking a point for another is
    /// refused when it is parsed, not armed to fire never (a test that "holds step N" at a
    /// point that never stalls would pass or fail by luck).
    pub fn actions(point: &str) -> &'static [&'static str] {
        match point {
            PREPARE | COMMIT => &["kill", "delay-MS"],
            FOLD_PARITY => &["skip", "flip"],
            INSTALL => &["flip", "delay-MS"],
            SEND_ROWS => &["delay-MS"],
            _ => &["kill"],
        }
    }
}

/// What an armed point does when it fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultAction {
    /// The member dies at once, as a SIGKILLed process or a crashed host would.
    Kill,
    /// The code at the point skips its effect once (a planted bug).
    Skip,
    /// The code at the point flips one bit of what it writes, once (silent corruption).
    Flip,
    /// The member stalls at the point for this many milliseconds, then goes on.
    Delay { ms: u64 },
}

impl FaultAction {
    fn same_kind(self, other: Self) -> bool {
        std::mem::discriminant(&self) == std::mem::discriminant(&other)
    }
}

impl fmt::Display for FaultAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Kill => f.write_str("kill"),
            Self::Skip => f.write_str("skip"),
            Self::Flip => f.write_str("flip"),
            Self::Delay { ms } => write!(f, "delay-{ms}"),
        }
    }
}

/// One armed point: `NAME[:STEP][=ACTION]`, the action `kill` unless named.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FaultSpec {
    pub point: String,
    pub step: Option<u64>,
    pub action: FaultAction,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FaultError {
    #[error("fault spec {spec:?}: unknown point {point:?} (known: {known})")]
    UnknownPoint {
        spec: String,
        point: String,
        known: String,
    },
    #[error("fault spec {spec:?}: step {step:?} is not a non-negative integer")]
    BadStep { spec: String, step: String },
    #[error("fault spec {spec:?}: unknown action {action:?} (kill, skip, flip or delay-MS)")]
    BadAction { spec: String, action: String },
    #[error("fault spec {spec:?}: the point {point:?} never does {action:?} (it does: {does})")]
    UnsupportedAction {
        spec: String,
        point: String,
        action: String,
        does: String,
    },
}

impl FaultSpec {
    pub fn new(point: &str, step: Option<u64>, action: FaultAction) -> Self {
        Self {
            point: point.to_string(),
            step,
            action,
        }
    }

    pub fn parse(spec: &str) -> Result<Self, FaultError> {
        let (target, action) = match spec.split_once('=') {
            Some((target, "kill")) => (target, FaultAction::Kill),
            Some((target, "skip")) => (target, FaultAction::Skip),
            Some((target, "flip")) => (target, FaultAction::Flip),
            Some((target, other)) if delay_ms(other).is_some() => (
                target,
                FaultAction::Delay {
                    ms: delay_ms(other).unwrap_or_default(),
                },
            ),
            Some((_, other)) => {
                return Err(FaultError::BadAction {
                    spec: spec.into(),
                    action: other.into(),
                });
            }
            None => (spec, FaultAction::Kill),
        };
        let (point, step) = match target.split_once(':') {
            Some((point, step)) => {
                let parsed = step.parse().map_err(|_| FaultError::BadStep {
                    spec: spec.into(),
                    step: step.into(),
                })?;
                (point, Some(parsed))
            }
            None => (target, None),
        };
        if !points::ALL.contains(&point) {
            return Err(FaultError::UnknownPoint {
                spec: spec.into(),
                point: point.into(),
                known: points::ALL.join(", "),
            });
        }
        let does = points::actions(point);
        let kind = match action {
            FaultAction::Delay { .. } => "delay-MS".to_string(),
            other => other.to_string(),
        };
        if !does.contains(&kind.as_str()) {
            return Err(FaultError::UnsupportedAction {
                spec: spec.into(),
                point: point.into(),
                action: kind,
                does: does.join(", "),
            });
        }
        Ok(Self::new(point, step, action))
    }

    fn matches(&self, point: &str, step: Option<u64>) -> bool {
        self.point == point && (self.step.is_none() || self.step == step)
    }
}

/// The milliseconds of a `delay-MS` action.
fn delay_ms(action: &str) -> Option<u64> {
    action.strip_prefix("delay-")?.parse().ok()
}

impl fmt::Display for FaultSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.point)?;
        if let Some(step) = self.step {
            write!(f, ":{step}")?;
        }
        if self.action != FaultAction::Kill {
            write!(f, "={}", self.action)?;
        }
        Ok(())
    }
}

/// How a member dies when a `kill` fires: a process SIGKILLs itself; a simulated host has
/// its own hook that crashes only that host.
pub type KillHook = Arc<dyn Fn(&FaultSpec) + Send + Sync>;

/// One member's registry. Cheap to clone: clones share the armed points.
#[derive(Clone)]
pub struct Faults {
    armed: Arc<Mutex<Vec<FaultSpec>>>,
    /// Every spec that fired, in order, so a test can tell that a planted fault was reached.
    fired: Arc<Mutex<Vec<FaultSpec>>>,
    kill: KillHook,
}

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faults")
            .field("armed", &self.armed())
            .finish_non_exhaustive()
    }
}

impl Default for Faults {
    fn default() -> Self {
        Self::for_process()
    }
}

impl Faults {
    /// A registry whose `kill` SIGKILLs this process.
    pub fn for_process() -> Self {
        Self::with_kill_hook(Arc::new(|spec: &FaultSpec| {
            tracing::warn!("planned death at {spec}: SIGKILL");
            let me = rustix::process::getpid();
            let _ = rustix::process::kill_process(me, rustix::process::Signal::KILL);
            // Not reached: SIGKILL cannot be caught.
            std::process::abort();
        }))
    }

    /// A registry whose `kill` runs `kill` instead (a simulated host's crash). The code
    /// after the point runs on unless the hook stops it, so a hook must make the member's
    /// further work fail (the simulated host is torn down at its next await).
    pub fn with_kill_hook(kill: KillHook) -> Self {
        Self {
            armed: Arc::default(),
            fired: Arc::default(),
            kill,
        }
    }

    /// A process registry armed with `specs` (`--fault` flags).
    pub fn parse_all<'a>(specs: impl IntoIterator<Item = &'a str>) -> Result<Self, FaultError> {
        let faults = Self::for_process();
        for spec in specs {
            faults.arm(FaultSpec::parse(spec)?);
        }
        Ok(faults)
    }

    pub fn arm(&self, spec: FaultSpec) {
        lock(&self.armed).push(spec);
    }

    pub fn armed(&self) -> Vec<FaultSpec> {
        lock(&self.armed).clone()
    }

    pub fn fired(&self) -> Vec<FaultSpec> {
        lock(&self.fired).clone()
    }

    /// Fires the first spec armed with an action of `action`'s kind at `point` (and
    /// `step`), once.
    fn fire(&self, point: &str, step: Option<u64>, action: FaultAction) -> Option<FaultSpec> {
        let mut armed = lock(&self.armed);
        let at = armed
            .iter()
            .position(|s| s.action.same_kind(action) && s.matches(point, step))?;
        let spec = armed.remove(at);
        drop(armed);
        lock(&self.fired).push(spec.clone());
        Some(spec)
    }

    /// Dies here if a `kill` is armed at this point. Returns whether it fired. A process's hook never returns; a simulated member's does, and
    /// the caller must then do nothing more (its host is crashed between ticks).
    pub fn kill_at(&self, point: &str, step: Option<u64>) -> bool {
        match self.fire(point, step, FaultAction::Kill) {
            Some(spec) => {
                (self.kill)(&spec);
                true
            }
            None => false,
        }
    }

    /// True (once) if a `skip` is armed at this point: the caller leaves its effect out.
    pub fn skip_at(&self, point: &str, step: Option<u64>) -> bool {
        self.fire(point, step, FaultAction::Skip).is_some()
    }

    /// True (once) if a `flip` is armed at this point: the caller corrupts one bit of
    /// what it writes there.
    pub fn flip_at(&self, point: &str, step: Option<u64>) -> bool {
        self.fire(point, step, FaultAction::Flip).is_some()
    }

    /// How long to stall here (once) if a `delay` is armed at this point. The caller
    /// sleeps on its runtime's clock, so a simulated member stalls in simulated time.
    pub fn delay_at(&self, point: &str, step: Option<u64>) -> Option<std::time::Duration> {
        match self.fire(point, step, FaultAction::Delay { ms: 0 })?.action {
            FaultAction::Delay { ms } => {
                tracing::warn!("fault {point}: stalling {ms} ms");
                Some(std::time::Duration::from_millis(ms))
            }
            _ => None,
        }
    }
}

/// The registry's lists stay valid whatever a panicking holder left, so a poisoned lock is
/// taken as it is.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests;
