//! Deaths planned at exact protocol points, for the tests that must hit them: a server
//! SIGKILLs itself in 2PC phase 1 (its parity differences staged at the holders, before
//! it answers), in phase 2 (before it installs the step), or in the middle of a rebuild.
//! The launcher hands each point to one process through `FTREC_FAULTS`; a point fires
//! once, in that process.

pub const FAULTS_ENV: &str = "FTREC_FAULTS";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPoint {
    /// After staging step N and propagating its differences, before answering phase 1.
    Prepare(u64),
    /// On phase 2 of step N, before installing it (the other servers install it).
    Commit(u64),
    /// A replacement, after decoding its first table.
    Rebuild,
}

impl FaultPoint {
    /// `prepare:N`, `commit:N` or `rebuild`.
    pub fn parse(s: &str) -> Option<Self> {
        if s == "rebuild" {
            return Some(Self::Rebuild);
        }
        let (what, step) = s.split_once(':')?;
        let step = step.parse().ok()?;
        match what {
            "prepare" => Some(Self::Prepare(step)),
            "commit" => Some(Self::Commit(step)),
            _ => None,
        }
    }

    pub fn name(self) -> String {
        match self {
            Self::Prepare(n) => format!("prepare:{n}"),
            Self::Commit(n) => format!("commit:{n}"),
            Self::Rebuild => "rebuild".into(),
        }
    }
}

/// The points at which this process dies.
#[derive(Clone, Debug, Default)]
pub struct Faults(Vec<FaultPoint>);

impl Faults {
    pub fn from_env() -> Self {
        Self(
            std::env::var(FAULTS_ENV)
                .unwrap_or_default()
                .split(',')
                .filter_map(FaultPoint::parse)
                .collect(),
        )
    }

    pub fn encode(points: &[FaultPoint]) -> String {
        points
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// SIGKILLs this process if `point` is one of its planned deaths.
    pub fn die_at(&self, point: FaultPoint) {
        if self.0.contains(&point) {
            tracing::warn!("planned death at {}: SIGKILL", point.name());
            let me = rustix::process::getpid();
            let _ = rustix::process::kill_process(me, rustix::process::Signal::KILL);
            // Not reached: SIGKILL cannot be caught.
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_round_trip_and_nonsense_is_ignored() {
        for p in [
            FaultPoint::Prepare(3),
            FaultPoint::Commit(40),
            FaultPoint::Rebuild,
        ] {
            assert_eq!(FaultPoint::parse(&p.name()), Some(p));
        }
        for bad in [
            "",
            "prepare",
            "prepare:x",
            "commit:-1",
            "rebuild:2",
            "phase:3",
        ] {
            assert_eq!(FaultPoint::parse(bad), None, "{bad}");
        }
        let encoded = Faults::encode(&[FaultPoint::Prepare(3), FaultPoint::Rebuild]);
        assert_eq!(encoded, "prepare:3,rebuild");
    }
}
