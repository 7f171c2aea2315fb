//! What a real full checkpoint of a model costs on a given file system: the write (to
//! the engine's durable, fsynced layout) and a cold restore. `bench cpr` feeds these into
//! CPR's Eq. 1-4 and `cluster run --ft auto` into its choice of strategy and interval.

use std::path::{Path, PathBuf};
use std::time::Instant;

use ftrec_model::ModelState;

use crate::{Checkpoints, CkptError, LocalStore};

/// Median seconds of a full checkpoint's write and of its cold restore.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CheckpointTiming {
    pub save_seconds: f64,
    pub load_seconds: f64,
    /// Bytes the checkpoint took on disk.
    pub bytes: u64,
}

/// Writes `state` as a full checkpoint into a fresh directory under `dir`, drops it from
/// the page cache and restores it, `attempts` times (at least once); checks each restore
/// against the state's digest and removes the directory after. The directory is scratch of
/// its own, never a location that holds committed history.
pub fn time_full_checkpoint(
    state: &ModelState,
    dir: &Path,
    attempts: u64,
) -> Result<CheckpointTiming, CkptError> {
    let root = dir.join(format!("ftrec-checkpoint-timing-{}", std::process::id()));
    let result = (|| {
        let (mut saves, mut loads, mut bytes) = (Vec::new(), Vec::new(), 0);
        for attempt in 0..attempts.max(1) {
            let at = root.join(attempt.to_string());
            std::fs::create_dir_all(&at).map_err(|error| CkptError::Io {
                path: at.clone(),
                error,
            })?;
            let checkpoints = Checkpoints::new(Box::new(LocalStore::open(&at)?));
            let started = Instant::now();
            let manifest = checkpoints.write_full(state, attempt, serde_json::Value::Null)?;
            saves.push(started.elapsed().as_secs_f64());
            bytes = dir_bytes(&at);
            evict_from_cache(&at);
            let started = Instant::now();
            let (restored, _) = checkpoints.restore(&manifest.id)?;
            loads.push(started.elapsed().as_secs_f64());
            if restored.digest() != state.digest() {
                return Err(CkptError::Corrupt {
                    key: at.display().to_string(),
                    message: "the timing checkpoint did not restore what was written".into(),
                });
            }
        }
        Ok(CheckpointTiming {
            save_seconds: median(&saves),
            load_seconds: median(&loads),
            bytes,
        })
    })();
    let _ = std::fs::remove_dir_all(&root);
    result
}

/// The middle value (the upper of the two middle ones for an even count); NaN when empty.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Every file under `dir`, recursively (unreadable folders are skipped).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// Bytes of all files under `dir`.
pub fn dir_bytes(dir: &Path) -> u64 {
    files_under(dir)
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

/// Drops `dir`'s files from the page cache (they are fsynced, so nothing is lost), so
/// the next read comes from the disk.
pub fn evict_from_cache(dir: &Path) {
    for p in files_under(dir) {
        if let Ok(f) = std::fs::File::open(&p) {
            let _ = f.sync_data();
            let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ftrec_model::{ModelConfig, Optimizer};

    /// The timing writes a real checkpoint, reads it back intact, and leaves nothing
    /// behind in the directory it was given.
    #[test]
    fn timing_writes_restores_and_cleans_up() {
        let config = ModelConfig {
            num_dense: 3,
            table_rows: vec![300, 70],
            dim: 4,
            bottom: vec![8, 4],
            top: vec![6, 1],
            sparse_optimizer: Optimizer::Adagrad {
                lr: 0.1,
                eps: 1e-8,
                initial_accumulator: 0.0,
            },
            dense_optimizer: Optimizer::Sgd { lr: 0.1 },
        };
        let state = ModelState::new(&config, 3).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let t = time_full_checkpoint(&state, dir.path(), 2).unwrap();
        assert!(t.save_seconds > 0.0 && t.load_seconds > 0.0, "{t:?}");
        assert!(t.bytes > 0);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn median_takes_the_upper_middle() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(&[]).is_nan());
    }
}
