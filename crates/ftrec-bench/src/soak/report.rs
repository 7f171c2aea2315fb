//! The soak's report: faults injected and survived by kind, detect and resume seconds per
//! kind, the longest stall, lost samples, parity and replica mismatches, the digest
//! against `ftrec train`, and `training_time_ratio` with the failure-free rate it is
//! judged against; `soak.json` and a timeline plot per soak.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::SoakOptions;
use super::drive::RunOutcome;
use super::inject::FaultRecord;
use super::schedule::{FaultKind, Planned, by_kind};
use crate::error::{BenchError, Result};
use crate::rounds::median_mid;

#[derive(Clone, Debug, Serialize)]
pub struct Spread {
    pub median: Option<f64>,
    pub max: Option<f64>,
    pub n: usize,
}

fn spread(v: Vec<f64>) -> Spread {
    Spread {
        n: v.len(),
        max: v.iter().copied().reduce(f64::max),
        median: median_mid(v),
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct KindSeconds {
    /// Training seconds the kind cost, summed over its faults (see
    /// [`FaultRecord::lost_training_seconds`]); none without a failure-free run.
    pub lost_training_seconds: Option<f64>,
    pub detect_seconds: Spread,
    pub resume_seconds: Spread,
    pub redundant_seconds: Spread,
}

#[derive(Clone, Debug, Serialize)]
pub struct SoakReport {
    pub minutes: f64,
    pub every: f64,
    pub seed: u64,
    pub servers: usize,
    pub spares: usize,
    pub workers: usize,
    pub deterministic: bool,
    pub steps: u64,
    pub batch_size: u64,
    pub namespaces: usize,
    pub faults_planned: usize,
    pub faults_injected: BTreeMap<String, u64>,
    pub faults_survived: BTreeMap<String, u64>,
    /// The failure-free runs' committed samples per second (their median).
    pub failure_free_samples_per_sec: Option<f64>,
    pub soak_samples_per_sec: Option<f64>,
    /// Failure-free wall time over the soak's, for the same steps (medians over rounds).
    pub training_time_ratio: Option<f64>,
    /// Deterministic mode: every soak ended at `ftrec train`'s digest.
    pub exact: Option<bool>,
    pub reference_digest: Option<String>,
    pub lost_samples: Option<u64>,
    pub parity_mismatches: u64,
    pub replica_mismatches: u64,
    pub max_stall_seconds: f64,
    pub recoveries: Option<u64>,
    pub failovers: Option<u64>,
    pub by_kind: BTreeMap<String, KindSeconds>,
    /// Failure-free runs that recovered or failed over (they must not).
    pub spurious_in_failure_free: u64,
    pub runs: Vec<RunOutcome>,
}

fn survived(run: &RunOutcome, reference: Option<&str>, f: &FaultRecord) -> bool {
    let job_ok = run.result == "ok"
        && run.parity_mismatches == 0
        && run.replica_mismatches == 0
        && match reference {
            Some(r) => run.state_digest.as_deref() == Some(r),
            None => run.lost_samples == Some(0),
        };
    let unresolved = f.notes.iter().any(|n| {
        n.starts_with("not detected")
            || n.starts_with("no new leader")
            || n.starts_with("still being")
    });
    job_ok && f.over && !unresolved
}

impl SoakReport {
    pub fn new(
        a: &SoakOptions,
        steps: u64,
        batch_size: u64,
        plan: Vec<Planned>,
        mut runs: Vec<RunOutcome>,
        reference: Option<String>,
    ) -> Self {
        let free_steps_per_sec = median_mid(
            runs.iter()
                .filter(|r| {
                    r.name.starts_with("fault-free") && r.result == "ok" && r.train_seconds > 0.0
                })
                .map(|r| r.steps as f64 / r.train_seconds)
                .collect(),
        );
        if let Some(rate) = free_steps_per_sec {
            for f in runs.iter_mut().flat_map(|r| r.faults.iter_mut()) {
                if let (Some(over), Some(steps)) = (f.over_at, f.steps_during) {
                    f.lost_training_seconds = Some(over - f.injected_at - steps as f64 / rate);
                }
            }
        }
        let soaks: Vec<&RunOutcome> = runs.iter().filter(|r| r.name.starts_with("soak")).collect();
        let free: Vec<&RunOutcome> = runs
            .iter()
            .filter(|r| r.name.starts_with("fault-free"))
            .collect();
        let faults: Vec<(&RunOutcome, &FaultRecord)> = soaks
            .iter()
            .flat_map(|r| r.faults.iter().map(move |f| (*r, f)))
            .collect();
        let injected = by_kind(faults.iter().map(|(_, f)| &f.kind));
        let survived_kinds: Vec<FaultKind> = faults
            .iter()
            .filter(|(r, f)| survived(r, reference.as_deref(), f))
            .map(|(_, f)| f.kind)
            .collect();
        let faults_survived = by_kind(survived_kinds.iter());
        let mut by_kind_seconds = BTreeMap::new();
        for kind in FaultKind::ALL {
            let of: Vec<&FaultRecord> = faults
                .iter()
                .map(|(_, f)| *f)
                .filter(|f| f.kind == kind)
                .collect();
            if of.is_empty() {
                continue;
            }
            let pick = |g: fn(&FaultRecord) -> Option<f64>| {
                spread(of.iter().filter_map(|f| g(f)).collect())
            };
            by_kind_seconds.insert(
                kind.name().to_string(),
                KindSeconds {
                    lost_training_seconds: {
                        let lost: Vec<f64> =
                            of.iter().filter_map(|f| f.lost_training_seconds).collect();
                        (!lost.is_empty()).then(|| lost.iter().sum())
                    },
                    detect_seconds: pick(|f| f.detect_seconds),
                    resume_seconds: pick(|f| f.resume_seconds),
                    redundant_seconds: pick(|f| f.redundant_seconds),
                },
            );
        }
        let rate = |rs: &[&RunOutcome]| {
            median_mid(
                rs.iter()
                    .filter(|r| r.result == "ok")
                    .map(|r| r.samples_per_sec)
                    .collect(),
            )
        };
        let free_rate = rate(&free);
        let soak_rate = rate(&soaks);
        let sum =
            |g: fn(&RunOutcome) -> Option<u64>| -> Option<u64> { soaks.iter().map(|r| g(r)).sum() };
        SoakReport {
            minutes: a.minutes,
            every: a.every,
            seed: a.seed,
            servers: a.servers,
            spares: a.spares,
            workers: a.workers,
            deterministic: !a.asynchronous,
            steps,
            batch_size,
            namespaces: 3 + 2 + a.servers + a.spares + a.workers,
            faults_planned: plan.len(),
            faults_injected: injected,
            faults_survived,
            failure_free_samples_per_sec: free_rate,
            soak_samples_per_sec: soak_rate,
            training_time_ratio: match (free_rate, soak_rate) {
                (Some(f), Some(s)) if f > 0.0 => Some(s / f),
                _ => None,
            },
            exact: reference.as_ref().map(|r| {
                !soaks.is_empty() && soaks.iter().all(|s| s.state_digest.as_deref() == Some(r))
            }),
            reference_digest: reference.clone(),
            lost_samples: sum(|r| r.lost_samples),
            parity_mismatches: soaks.iter().map(|r| r.parity_mismatches).sum(),
            replica_mismatches: soaks.iter().map(|r| r.replica_mismatches).sum(),
            max_stall_seconds: soaks
                .iter()
                .map(|r| r.max_stall_seconds)
                .fold(0.0, f64::max),
            recoveries: sum(|r| r.recoveries),
            failovers: sum(|r| r.failovers),
            by_kind: by_kind_seconds,
            spurious_in_failure_free: free
                .iter()
                .map(|r| r.recoveries.unwrap_or(0) + r.failovers.unwrap_or(0))
                .sum(),
            runs,
        }
    }

    /// `soak.json` and one timeline plot per soak run under `out`.
    pub fn write(&self, out: &Path) -> Result<()> {
        let path = out.join("soak.json");
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(&path, text).map_err(BenchError::file(&path))?;
        for run in self.runs.iter().filter(|r| r.name.starts_with("soak")) {
            let png = out.join(format!("{}-timeline.png", run.name));
            crate::timeline_plot::plot_timeline(
                &run.timeline,
                &png,
                &format!(
                    "soak: {} faults, one per {} s ({} servers, ec 2+2)",
                    run.faults.len(),
                    self.every,
                    self.servers
                ),
            )?;
        }
        Ok(())
    }

    /// The lines a person reads.
    pub fn table(&self) -> Vec<String> {
        let mut lines = vec![format!(
            "{:<18} {:>8} {:>8} {:>10} {:>10} {:>10} {:>10}",
            "fault", "injected", "survived", "detect s", "resume s", "full s", "lost s"
        )];
        let med = |s: &Spread| s.median.map_or("-".into(), |v| format!("{v:.2}"));
        for (kind, n) in &self.faults_injected {
            let s = self.by_kind.get(kind);
            lines.push(format!(
                "{:<18} {:>8} {:>8} {:>10} {:>10} {:>10} {:>10}",
                kind,
                n,
                self.faults_survived.get(kind).copied().unwrap_or(0),
                s.map_or("-".into(), |s| med(&s.detect_seconds)),
                s.map_or("-".into(), |s| med(&s.resume_seconds)),
                s.map_or("-".into(), |s| med(&s.redundant_seconds)),
                s.and_then(|s| s.lost_training_seconds)
                    .map_or("-".into(), |v| format!("{v:.1}")),
            ));
        }
        lines.push(format!(
            "training_time_ratio {} (soak {} against failure-free {} samples/s); exact {:?}; lost_samples {:?}; mismatches {}/{}; longest stall {:.1} s",
            self.training_time_ratio.map_or("-".into(), |r| format!("{r:.3}")),
            self.soak_samples_per_sec.map_or("-".into(), |r| format!("{r:.0}")),
            self.failure_free_samples_per_sec.map_or("-".into(), |r| format!("{r:.0}")),
            self.exact,
            self.lost_samples,
            self.parity_mismatches,
            self.replica_mismatches,
            self.max_stall_seconds,
        ));
        lines
    }

    /// CI's goals: every fault injected was survived, the run exact (or nothing lost),
    /// no mismatch; the failures, one line each.
    pub fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        for run in &self.runs {
            if run.result != "ok" {
                out.push(format!("{}: {}", run.name, run.result));
            }
        }
        for (kind, n) in &self.faults_injected {
            let s = self.faults_survived.get(kind).copied().unwrap_or(0);
            if s < *n {
                out.push(format!("{kind}: {s} of {n} survived"));
            }
        }
        if self.exact == Some(false) {
            out.push(format!(
                "not exact: the soak's digest is not ftrec train's {:?}",
                self.reference_digest
            ));
        }
        if self.exact.is_none() && self.lost_samples != Some(0) {
            out.push(format!("lost_samples {:?}", self.lost_samples));
        }
        if self.parity_mismatches + self.replica_mismatches > 0 {
            out.push(format!(
                "parity/replica mismatches {}/{}",
                self.parity_mismatches, self.replica_mismatches
            ));
        }
        if self.spurious_in_failure_free > 0 {
            out.push(format!(
                "{} recoveries or failovers in the failure-free runs",
                self.spurious_in_failure_free
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soak::schedule::FaultKind;

    fn fault(kind: FaultKind, detect: Option<f64>, notes: &[&str]) -> FaultRecord {
        FaultRecord {
            kind,
            planned_at: 10.0,
            injected_at: 10.0,
            delayed_seconds: 0.0,
            target: "h1 (server 1)".into(),
            detect_seconds: detect,
            resume_seconds: detect.map(|d| d + 0.1),
            redundant_seconds: detect.map(|d| d + 0.5),
            over: true,
            over_at: Some(20.0),
            steps_during: Some(100),
            lost_training_seconds: None,
            notes: notes.iter().map(|n| n.to_string()).collect(),
        }
    }

    fn run(name: &str, seconds: f64, digest: &str, faults: Vec<FaultRecord>) -> RunOutcome {
        RunOutcome {
            name: name.into(),
            result: "ok".into(),
            train_seconds: seconds,
            steps: 1000,
            samples_per_sec: 1000.0 * 128.0 / seconds,
            state_digest: Some(digest.into()),
            lost_samples: Some(0),
            recoveries: Some(faults.len() as u64),
            failovers: Some(0),
            faults,
            ..Default::default()
        }
    }

    fn options() -> SoakOptions {
        SoakOptions {
            minutes: 1.0,
            every: 20.0,
            seed: 1,
            servers: 4,
            spares: 2,
            workers: 2,
            kinds: FaultKind::ALL.to_vec(),
            asynchronous: false,
            steps: Some(1000),
            rounds: 1,
            no_baseline: false,
            out: "x".into(),
            sets: Vec::new(),
        }
    }

    #[test]
    fn the_ratio_is_the_failure_free_time_over_the_soaks() {
        let runs = vec![
            run("fault-free-r1", 80.0, "d", Vec::new()),
            run(
                "soak-r1",
                100.0,
                "d",
                vec![
                    fault(FaultKind::ServerKill, Some(1.0), &[]),
                    fault(FaultKind::ServerKill, Some(3.0), &[]),
                    fault(FaultKind::Partition, None, &["not detected within 60 s"]),
                ],
            ),
        ];
        let r = SoakReport::new(&options(), 1000, 128, Vec::new(), runs, Some("d".into()));
        assert_eq!(r.training_time_ratio, Some(0.8));
        assert_eq!(r.exact, Some(true));
        assert_eq!(r.faults_injected["server-kill"], 2);
        assert_eq!(r.faults_survived["server-kill"], 2);
        assert_eq!(r.faults_injected["partition"], 1);
        assert_eq!(r.faults_survived["partition"], 0);
        assert_eq!(r.by_kind["server-kill"].detect_seconds.median, Some(2.0));
        assert_eq!(r.by_kind["server-kill"].detect_seconds.max, Some(3.0));
        // 10 s windows of 100 steps each, at the failure-free 12.5 steps/s: 2 s lost each.
        let lost = r.by_kind["server-kill"].lost_training_seconds;
        assert!(lost.is_some_and(|v| (v - 4.0).abs() < 1e-9), "{lost:?}");
        assert_eq!(r.failures(), vec!["partition: 0 of 1 survived".to_string()]);
    }

    #[test]
    fn a_soak_off_the_reference_survives_nothing() {
        let runs = vec![run(
            "soak-r1",
            100.0,
            "other",
            vec![fault(FaultKind::Rack, Some(1.0), &[])],
        )];
        let r = SoakReport::new(&options(), 1000, 128, Vec::new(), runs, Some("d".into()));
        assert_eq!(r.exact, Some(false));
        assert_eq!(r.faults_survived["rack"], 0);
        assert_eq!(r.training_time_ratio, None);
        assert_eq!(r.failures().len(), 2, "{:?}", r.failures());
    }
}
