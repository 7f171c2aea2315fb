//! The run's timeline: samples trained per second and an event log (failures, detection,
//! recovery, checkpoints), written as CSV and JSON (the
//! `ftrec` binary plots it like ECRec's Fig. 6).

use std::path::Path;
use tokio::time::Instant;

use serde::{Deserialize, Serialize};

use crate::ProtoError;

/// Defines [`EventKind`] with each kind's name in the timeline files, in one list.
macro_rules! event_kinds {
    ($($variant:ident => $name:literal,)*) => {
        /// What happened. Serialised as its name (`"failure-detected"`), the spelling of
        /// `events.csv` and `timeline.json`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum EventKind {
            $(#[serde(rename = $name)] $variant,)*
        }

        impl EventKind {
            pub const ALL: &[EventKind] = &[$(EventKind::$variant,)*];

            pub fn name(self) -> &'static str {
                match self {
                    $(EventKind::$variant => $name,)*
                }
            }
        }
    };
}

event_kinds! {
    TrainingStart => "training-start",
    TrainingEnd => "training-end",
    Killed => "killed",
    Frozen => "frozen",
    KillSkipped => "kill-skipped",
    Interrupted => "interrupted",
    SuspicionConfirmed => "suspicion-confirmed",
    FailureDetected => "failure-detected",
    WorkerFailureDetected => "worker-failure-detected",
    RecoveryStart => "recovery-start",
    RecoveryRetry => "recovery-retry",
    RecoveryEnd => "recovery-end",
    RollbackNeeded => "rollback-needed",
    Replacement => "replacement",
    ReplacementFailed => "replacement-failed",
    RebuildStart => "rebuild-start",
    RebuildProgress => "rebuild-progress",
    RebuildEnd => "rebuild-end",
    Degraded => "degraded",
    PartialRestore => "partial-restore",
    SamplesLost => "samples-lost",
    SupersededKilled => "superseded-killed",
    CheckpointStart => "checkpoint-start",
    CheckpointEnd => "checkpoint-end",
    CheckpointFailed => "checkpoint-failed",
    CutCollided => "cut-collided",
    CheckpointAbandoned => "checkpoint-abandoned",
    CheckpointCopied => "checkpoint-copied",
    CheckpointsPruned => "checkpoints-pruned",
    PruneFailed => "prune-failed",
    CprDecision => "cpr-decision",
    CprInterval => "cpr-interval",
    CheckpointReplanned => "checkpoint-replanned",
    StepRegranted => "step-regranted",
    StepSettled => "step-settled",
    ServerJoined => "server-joined",
    SpareJoined => "spare-joined",
    WorkerJoined => "worker-joined",
    JoinRefused => "join-refused",
    ScaleAsked => "scale-asked",
    ScaleSwitched => "scale-switched",
    ScaleEnd => "scale-end",
    ScaleDropped => "scale-dropped",
    Coordinator => "coordinator",
    Fatal => "fatal",
    Error => "error",
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

/// The cluster member an event is about, where it is about one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Subject {
    Server(u32),
    Worker(u32),
}

impl std::fmt::Display for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Subject::Server(id) => write!(f, "server-{id}"),
            Subject::Worker(id) => write!(f, "worker-{id}"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Seconds since the timeline started.
    pub t: f64,
    pub kind: EventKind,
    /// The member the event is about (a kill, a failure), so readers need not parse `detail`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<Subject>,
    /// The global step the event happened at, where it has one (a kill at a step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// Words for a person; never parsed.
    pub detail: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TimelineData {
    /// Samples whose step finished in second `i`.
    pub samples_per_second: Vec<u64>,
    pub events: Vec<Event>,
}

pub struct Timeline {
    start: Instant,
    pub data: TimelineData,
}

impl Timeline {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            data: TimelineData::default(),
        }
    }

    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    pub fn samples(&mut self, n: u64) {
        let second = self.now() as usize;
        let v = &mut self.data.samples_per_second;
        if v.len() <= second {
            v.resize(second + 1, 0);
        }
        v[second] += n;
    }

    pub fn event(&mut self, kind: EventKind, detail: impl Into<String>) -> f64 {
        self.record(kind, None, None, detail.into())
    }

    /// An event about one member, at a step when it has one.
    pub fn event_about(
        &mut self,
        kind: EventKind,
        subject: Subject,
        step: Option<u64>,
        detail: impl Into<String>,
    ) -> f64 {
        self.record(kind, Some(subject), step, detail.into())
    }

    fn record(
        &mut self,
        kind: EventKind,
        subject: Option<Subject>,
        step: Option<u64>,
        detail: String,
    ) -> f64 {
        let t = self.now();
        // The subject as a field of its own, so that a reader of the log (the soak bench
        // follows the coordinators' logs live) need not parse the detail.
        match subject {
            Some(subject) => tracing::info!(%subject, "[{t:7.2}s] {kind}: {detail}"),
            None => tracing::info!("[{t:7.2}s] {kind}: {detail}"),
        }
        self.data.events.push(Event {
            t,
            kind,
            subject,
            step,
            detail,
        });
        t
    }
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ProtoError + '_ {
    move |error| ProtoError::Io {
        path: path.to_path_buf(),
        error,
    }
}

impl TimelineData {
    /// The events of one kind, in order.
    pub fn of(&self, kind: EventKind) -> impl Iterator<Item = &Event> {
        self.events.iter().filter(move |e| e.kind == kind)
    }

    /// The failures injected into the run: SIGKILLs and freezes, in time order.
    pub fn injected_failures(&self) -> impl Iterator<Item = &Event> {
        self.events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Killed | EventKind::Frozen))
    }

    /// Writes `throughput.csv`, `events.csv` and `timeline.json` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), ProtoError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let mut csv = String::from("second,samples_per_sec\n");
        for (i, n) in self.samples_per_second.iter().enumerate() {
            csv.push_str(&format!("{i},{n}\n"));
        }
        let p = dir.join("throughput.csv");
        ftrec_fsio::write_atomic(&p, csv.as_bytes())?;
        let mut csv = String::from("t,kind,detail\n");
        for e in &self.events {
            csv.push_str(&format!(
                "{:.3},{},\"{}\"\n",
                e.t,
                e.kind,
                e.detail.replace('"', "'")
            ));
        }
        let p = dir.join("events.csv");
        ftrec_fsio::write_atomic(&p, csv.as_bytes())?;
        let p = dir.join("timeline.json");
        let json = serde_json::to_vec_pretty(self).map_err(ProtoError::TimelineEncode)?;
        Ok(ftrec_fsio::write_atomic(&p, &json)?)
    }

    pub fn read(path: &Path) -> Result<Self, ProtoError> {
        let bytes = std::fs::read(path).map_err(io(path))?;
        serde_json::from_slice(&bytes).map_err(|error| ProtoError::NotATimeline {
            path: path.to_path_buf(),
            error,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_serialise_as_their_names_and_back() {
        for &kind in EventKind::ALL {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.name()));
            assert_eq!(serde_json::from_str::<EventKind>(&json).unwrap(), kind);
        }
        let names: std::collections::HashSet<_> = EventKind::ALL.iter().map(|k| k.name()).collect();
        assert_eq!(names.len(), EventKind::ALL.len(), "names are distinct");
    }

    #[test]
    fn a_timeline_round_trips_through_its_files() {
        let mut timeline = Timeline::new();
        timeline.event(EventKind::TrainingStart, "10 steps");
        timeline.event_about(
            EventKind::Killed,
            Subject::Server(2),
            Some(7),
            "server 2 by SIGKILL",
        );
        timeline.samples(64);
        let dir = tempfile::tempdir().unwrap();
        timeline.data.write(dir.path()).unwrap();
        let back = TimelineData::read(&dir.path().join("timeline.json")).unwrap();
        assert_eq!(back.events, timeline.data.events);
        let killed: Vec<_> = back.of(EventKind::Killed).collect();
        assert_eq!(killed[0].subject, Some(Subject::Server(2)));
        assert_eq!(killed[0].step, Some(7));
        let csv = std::fs::read_to_string(dir.path().join("events.csv")).unwrap();
        assert!(csv.contains(",killed,\"server 2 by SIGKILL\""), "{csv}");
        let unknown =
            r#"{"samples_per_second":[],"events":[{"t":1.0,"kind":"exploded","detail":""}]}"#;
        let path = dir.path().join("bad.json");
        std::fs::write(&path, unknown).unwrap();
        let e = TimelineData::read(&path).unwrap_err().to_string();
        assert!(e.contains("bad.json") && e.contains("exploded"), "{e}");
    }
}
