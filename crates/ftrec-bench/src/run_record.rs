//! One cluster run as the benches' figures read it. Built from the launcher's report, or
//! read from the JSON `cluster run --json` prints (the field names are that report's), so
//! the figures can be computed, and tested, on recorded runs as well as live ones.

use ftrec_cluster::launch::LaunchReport;
use ftrec_coordinator::{CheckpointRecord, Recovery};
use serde::Deserialize;

/// The job's CPU over a window of the timeline: only its total is used.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct CpuSeconds {
    pub cpu_seconds: f64,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct RunRecord {
    pub steps: u64,
    pub samples: u64,
    pub lost_samples: u64,
    pub train_seconds: f64,
    pub samples_per_sec: f64,
    pub rpc_bytes_per_sample: f64,
    pub server_rpcs: u64,
    pub server_rpc_bytes: u64,
    pub checkpoints: Vec<CheckpointRecord>,
    pub recoveries: Vec<Recovery>,
    /// When the last step was counted, on the recoveries' clock.
    pub last_step_at: Option<f64>,
    pub recovery_seconds: f64,
    pub steps_rolled_back: u64,
    pub pls: Option<f64>,
    /// From each injected SIGKILL to training resumed.
    pub kill_to_resume_seconds: Vec<f64>,
    pub server_peak_rss_bytes: Vec<Option<u64>>,
    /// A spare's peak resident set while it waited (its `ec.spare_reserve` is paid there).
    pub waiting_spare_peak_rss_bytes: Option<u64>,
    /// Every job process's CPU (servers, workers, the launcher); recorded runs from before
    /// issue 45 counted the servers only, under the old names.
    #[serde(alias = "server_cpu_training")]
    pub cpu_training: Option<CpuSeconds>,
    #[serde(alias = "server_cpu_rebuilds")]
    pub cpu_rebuilds: Vec<Option<CpuSeconds>>,
    pub parity_mismatches: Option<u64>,
    pub replica_mismatches: Option<u64>,
    pub auc: Option<f64>,
    pub logloss: Option<f64>,
}

impl From<&LaunchReport> for RunRecord {
    fn from(r: &LaunchReport) -> Self {
        let s = &r.summary;
        let cpu = |w: &ftrec_cluster::launch::CpuWindow| CpuSeconds {
            cpu_seconds: w.cpu_seconds,
        };
        Self {
            steps: s.steps,
            samples: s.samples,
            lost_samples: s.lost_samples,
            train_seconds: s.train_seconds,
            samples_per_sec: s.samples_per_sec,
            rpc_bytes_per_sample: s.rpc_bytes_per_sample,
            server_rpcs: s.server_rpcs,
            server_rpc_bytes: s.server_rpc_bytes,
            checkpoints: s.checkpoints.clone(),
            recoveries: s.recoveries.clone(),
            last_step_at: s.last_step_at,
            recovery_seconds: s.recovery_seconds,
            steps_rolled_back: s.steps_rolled_back,
            pls: s.pls,
            kill_to_resume_seconds: r.kill_to_resume_seconds.clone(),
            server_peak_rss_bytes: r.server_peak_rss_bytes.clone(),
            waiting_spare_peak_rss_bytes: r.waiting_spare_peak_rss_bytes,
            cpu_training: r.cpu_training.as_ref().map(cpu),
            cpu_rebuilds: r.cpu_rebuilds.iter().map(|w| w.as_ref().map(cpu)).collect(),
            parity_mismatches: r.parity_mismatches,
            replica_mismatches: r.replica_mismatches,
            auc: r.auc,
            logloss: r.logloss,
        }
    }
}

#[cfg(test)]
pub(crate) mod fixtures {
    //! Hand-made runs for the figures' tests, written as `cluster run --json` prints them.

    use super::*;
    use ftrec_coordinator::RecoveryMode;
    use serde_json::{Value, json};

    /// A recovery as the coordinator records it: a plain rebuild of server 1 with `fields`
    /// over it.
    fn recovery(fields: &Value) -> Value {
        let mut base = json!({
            "server": 1, "detected_at": 0.0, "resumed_at": 0.0, "resumed_step": 0,
            "steps_rolled_back": 0, "rebuild_seconds": 0.0, "rebuild_bytes": 0,
            "degraded_seconds": 0.0, "background_rebuild": false,
            "steps_while_degraded": 0, "steps_committed_while_degraded": 0,
            "epoch": 1, "mode": "rebuild",
        });
        if let (Some(b), Some(f)) = (base.as_object_mut(), fields.as_object()) {
            b.extend(f.clone());
        }
        base
    }

    /// A run reduced to `fields`; each of its `recoveries` needs only the fields a test
    /// is about.
    pub fn run(mut fields: Value) -> RunRecord {
        if let Some(list) = fields.get_mut("recoveries").and_then(Value::as_array_mut) {
            for r in list.iter_mut() {
                *r = recovery(r);
            }
        }
        serde_json::from_value(fields).expect("a valid run fixture")
    }

    #[test]
    fn a_recorded_report_reads_with_its_unknown_fields_ignored() {
        let r = run(json!({
            "steps": 10, "samples_per_sec": 5.5, "state_digest": "ab",
            "server_cpu_training": { "from": 1.0, "to": 2.0, "cpu_seconds": 3.0 },
            "server_cpu_rebuilds": [null, { "from": 0.0, "to": 1.0, "cpu_seconds": 0.5 }],
            "recoveries": [{ "mode": "rollback" }],
        }));
        assert_eq!(r.steps, 10);
        // Recorded under the old names, read under the new.
        assert_eq!(r.cpu_training.map(|c| c.cpu_seconds), Some(3.0));
        assert_eq!(r.cpu_rebuilds[1].map(|c| c.cpu_seconds), Some(0.5));
        assert_eq!(r.recoveries[0].mode, RecoveryMode::Rollback);
        assert!(r.auc.is_none() && r.kill_to_resume_seconds.is_empty());
    }
}
