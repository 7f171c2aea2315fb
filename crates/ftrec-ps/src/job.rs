//! The job every process of a cluster runs: one [`JobConfig`] written by the launcher,
//! read by each server and worker, and fingerprinted so a process started with another
//! configuration is refused when it joins.

use std::path::Path;

use ftrec_config::JobConfig;
use ftrec_data::{Dataset, TRAIN_FILE};

use crate::PsError;
use crate::placement::Layout;

#[derive(Clone, Debug)]
pub struct Job {
    pub config: JobConfig,
}

impl Job {
    pub fn new(config: JobConfig) -> Result<Self, PsError> {
        config.validate()?;
        if config.data.dir.is_none() {
            return Err(PsError::Config(
                "data.dir: a cluster job needs a dataset (--data DIR)".into(),
            ));
        }
        Ok(Self { config })
    }

    pub fn load(path: &Path) -> Result<Self, PsError> {
        Self::new(JobConfig::load(None, Some(path), &[])?)
    }

    pub fn save(&self, path: &Path) -> Result<(), PsError> {
        let text = toml::to_string(&self.config)
            .map_err(|e| PsError::Config(format!("cannot serialise the job: {e}")))?;
        Ok(ftrec_fsio::write_atomic(path, text.as_bytes())?)
    }

    /// xxh3 of the configuration, ignoring what may differ per process (thread counts).
    pub fn fingerprint(&self) -> u64 {
        let mut c = self.config.clone();
        c.threads = 0;
        let json = serde_json::to_vec(&c).unwrap_or_default();
        xxhash_rust::xxh3::xxh3_64(&json)
    }

    /// The placement arithmetic: striped with rotating parity when rows are erasure
    /// coded, row-modulo otherwise.
    pub fn layout(&self) -> Result<Layout, PsError> {
        let cluster = &self.config.cluster;
        if cluster.ft.erasure_coded() {
            let stripes = ftrec_ec::StripeLayout::new(self.config.ec.params(), cluster.servers)
                .map_err(|e| PsError::Config(e.to_string()))?;
            return Ok(Layout::striped(stripes));
        }
        Layout::new(cluster.servers)
    }

    pub fn train_data(&self) -> Result<Dataset, PsError> {
        let dir = self
            .config
            .data
            .dir
            .as_deref()
            .ok_or_else(|| PsError::Config("data.dir is not set".into()))?;
        Ok(Dataset::open_split(dir, TRAIN_FILE)?)
    }

    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.config.cluster.rpc_timeout_ms)
    }
}

/// The global batch schedule: batch `step` is the samples a single-process trainer reads at
/// that step (the last batch of an epoch may be short).
#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    pub samples: u64,
    pub batch_size: u64,
}

impl Schedule {
    pub fn batches_per_epoch(&self) -> u64 {
        self.samples.div_ceil(self.batch_size)
    }

    /// `(position, count)` of batch `step`.
    pub fn batch(&self, step: u64) -> (u64, u64) {
        let position = (step % self.batches_per_epoch()) * self.batch_size;
        (position, self.batch_size.min(self.samples - position))
    }

    pub fn samples_before(&self, step: u64) -> u64 {
        let per_epoch = self.batches_per_epoch();
        let (position, _) = self.batch(step);
        (step / per_epoch) * self.samples + position
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_matches_the_trainer_walk() {
        let s = Schedule {
            samples: 1000,
            batch_size: 128,
        };
        let (mut position, mut total) = (0u64, 0u64);
        for step in 0..30 {
            let n = (s.samples - position).min(s.batch_size);
            assert_eq!(s.batch(step), (position, n), "step {step}");
            assert_eq!(s.samples_before(step), total);
            total += n;
            position += n;
            if position == s.samples {
                position = 0;
            }
        }
    }
}
