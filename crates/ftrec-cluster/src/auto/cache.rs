//! Calibrations kept per configuration fingerprint, so a job run again on the same host
//! with the same build does not pay for its calibration twice. A file is keyed by the
//! job's fingerprint (its model, shape, optimizers, data, `k`, `r`: everything
//! `Job::fingerprint` covers, with the step count and fault tolerance left out, as the
//! calibration sets both) and holds the host and build it was measured on; either
//! differing, the job calibrates again. A cache file that does not parse is reported and
//! measured again, never trusted: it holds measurements, not history.

use std::path::{Path, PathBuf};

use ftrec_config::{FaultTolerance, JobConfig};
use ftrec_rpc::{Job, PsError};
use serde::{Deserialize, Serialize};

use super::probe::ProbeFigures;

/// The file format; a different one is measured again.
const FORMAT: u32 = 1;

/// What a calibration is valid for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheKey {
    pub fingerprint: String,
    /// The host and build: CPU model, logical CPUs, compute threads, spares, and the
    /// binary's size and modification time (a rebuilt binary calibrates again).
    pub host: String,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    format: u32,
    key: CacheKey,
    /// Seconds since the Unix epoch when it was measured.
    measured_at: u64,
    figures: ProbeFigures,
}

/// A cached calibration, and where it came from.
#[derive(Clone, Debug)]
pub struct Cached {
    pub figures: ProbeFigures,
    pub path: PathBuf,
    pub measured_at: u64,
}

pub fn key(config: &JobConfig, steps: u64, spares: usize, exe: &Path) -> Result<CacheKey, PsError> {
    let mut c = config.clone();
    c.train.steps = steps;
    c.cluster.ft = FaultTolerance::None;
    c.checkpoint.dir = None;
    c.checkpoint.every_seconds = None;
    c.checkpoint.planned_mtbf_seconds = None;
    c.cluster.resume_from = None;
    let fingerprint = format!("{:016x}", Job::new(c)?.fingerprint());
    let build = std::fs::metadata(exe)
        .map(|m| {
            let modified = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            format!("{} bytes, modified {modified}", m.len())
        })
        .unwrap_or_else(|_| "unknown build".into());
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    Ok(CacheKey {
        fingerprint,
        host: format!(
            "{} x {cpus}, threads {}, spares {spares}, ftrec {} ({build})",
            cpu_model(),
            config.threads,
            env!("CARGO_PKG_VERSION"),
        ),
    })
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn path(dir: &Path, key: &CacheKey) -> PathBuf {
    dir.join(format!("calibration-{}.json", key.fingerprint))
}

/// The calibration cached for `key` in `dir`, if one is there and was measured on the
/// same host and build.
pub fn load(dir: &Path, key: &CacheKey) -> Option<Cached> {
    let path = path(dir, key);
    let text = std::fs::read_to_string(&path).ok()?;
    let entry: Entry = match serde_json::from_str(&text) {
        Ok(entry) => entry,
        Err(e) => {
            tracing::warn!(
                "{}: not a calibration ({e}); --ft auto measures again",
                path.display()
            );
            return None;
        }
    };
    if entry.format != FORMAT || entry.key != *key {
        tracing::info!(
            "{}: measured on another host or build; --ft auto measures again",
            path.display()
        );
        return None;
    }
    Some(Cached {
        figures: entry.figures,
        path,
        measured_at: entry.measured_at,
    })
}

/// Keeps `figures` for `key` in `dir` (written to a temporary name, then renamed).
pub fn store(dir: &Path, key: &CacheKey, figures: &ProbeFigures) -> Result<PathBuf, PsError> {
    std::fs::create_dir_all(dir).map_err(crate::launch::io(dir))?;
    let measured_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let entry = Entry {
        format: FORMAT,
        key: key.clone(),
        measured_at,
        figures: figures.clone(),
    };
    let text = serde_json::to_vec_pretty(&entry)
        .map_err(|e| PsError::Fatal(format!("serialising a calibration: {e}")))?;
    let path = path(dir, key);
    ftrec_fsio::write_atomic(&path, &text)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auto::tests::tiny;

    fn figures() -> ProbeFigures {
        ProbeFigures {
            steps: 30,
            step_seconds: 0.05,
            ec: None,
            checkpoint_pause_seconds: 0.02,
            checkpoint_restore_seconds: 0.4,
            seconds: 9.5,
        }
    }

    #[test]
    fn a_calibration_is_found_again_only_for_the_same_job_host_and_build() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("ftrec");
        std::fs::write(&exe, b"build 1").unwrap();
        let job = tiny(&["cluster.servers=3"]);
        let k = key(&job, 30, 0, &exe).unwrap();
        assert!(load(dir.path(), &k).is_none());
        let stored = store(dir.path(), &k, &figures()).unwrap();
        let found = load(dir.path(), &k).expect("cached");
        assert_eq!(found.figures, figures());
        assert_eq!(found.path, stored);
        // The step count and the fault tolerance are the calibration's own.
        let again = tiny(&["cluster.servers=3", "train.steps=7", "cluster.ft=\"ec\""]);
        assert_eq!(key(&again, 30, 0, &exe).unwrap(), k);
        // Another shape, another redundancy, more spares: measured again.
        for other in [
            key(&tiny(&["cluster.servers=4"]), 30, 0, &exe).unwrap(),
            key(&tiny(&["cluster.servers=3", "ec.r=2"]), 30, 0, &exe).unwrap(),
            key(&job, 30, 1, &exe).unwrap(),
            key(&job, 60, 0, &exe).unwrap(),
        ] {
            assert_ne!(other, k);
            assert!(load(dir.path(), &other).is_none());
        }
        // A new build of the binary: the same file name, refused by its host line.
        std::fs::write(&exe, b"build 2, longer").unwrap();
        let rebuilt = key(&job, 30, 0, &exe).unwrap();
        assert_eq!(rebuilt.fingerprint, k.fingerprint);
        assert!(load(dir.path(), &rebuilt).is_none());
    }

    #[test]
    fn a_damaged_cache_file_is_measured_again_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("ftrec");
        std::fs::write(&exe, b"build").unwrap();
        let k = key(&tiny(&[]), 30, 0, &exe).unwrap();
        let stored = store(dir.path(), &k, &figures()).unwrap();
        let text = std::fs::read(&stored).unwrap();
        std::fs::write(&stored, &text[..text.len() / 2]).unwrap();
        assert!(load(dir.path(), &k).is_none());
    }
}
