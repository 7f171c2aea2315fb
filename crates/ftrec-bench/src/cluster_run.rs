//! What the cluster benches share: the dataset and configuration they start from, and one
//! benchmark run of a cluster (launched, its timeline plotted, its checkpoints removed).

use std::path::Path;
use std::time::Duration;

use ftrec_cluster::launch::{self, LaunchOptions};
use ftrec_config::JobConfig;
use ftrec_data::TRAIN_FILE;
use ftrec_data::generate::{GenConfig, read_meta};
use ftrec_proto::timeline::TimelineData;

use crate::error::{BenchError, Result};
use crate::host::Host;
use crate::run_record::RunRecord;
use crate::timeline_plot::plot_timeline;

/// One benchmark run of a config named `name` under `out`: launched, its timeline plotted
/// to `<out>/<name>.png`, its checkpoints (if any) removed afterwards.
pub struct BenchRun<'a> {
    pub host: &'a dyn Host,
    pub out: &'a Path,
    pub name: &'a str,
    pub kills: &'a [String],
    pub spares: usize,
    pub quiet: bool,
    /// Evaluate the final model on the test split (AUC, logloss).
    pub evaluate: bool,
}

impl BenchRun<'_> {
    /// Checkpointed runs write every `every` steps into the run directory.
    pub fn launch(&self, config: &JobConfig, every: u64) -> Result<RunRecord> {
        let mut c = config.clone();
        let run_dir = std::path::absolute(self.out.join(self.name))?;
        let _ = std::fs::remove_dir_all(&run_dir);
        if c.cluster.ft.checkpoints() {
            c.checkpoint.dir = Some(run_dir.join("checkpoints"));
            c.checkpoint.every_steps = every;
        }
        let kills = self
            .kills
            .iter()
            .map(|k| k.parse().map_err(BenchError::Usage))
            .collect::<Result<Vec<_>>>()?;
        if !self.quiet {
            self.host.note(&format!("cluster run {} ...", self.name));
        }
        let (servers, workers) = (c.cluster.servers, c.cluster.workers);
        let report = launch::run(
            LaunchOptions {
                job: ftrec_rpc::Job::new(c)?,
                run_dir: run_dir.clone(),
                kills,
                spares: self.spares,
                exe: self.host.exe()?,
                time_limit: Duration::from_secs(1800),
                evaluate: self.evaluate.then(|| self.host.evaluator()),
                save: None,
                resume: None,
                scale_at: Vec::new(),
            },
            |_| {},
        )?;
        plot_timeline(
            &TimelineData::read(&run_dir.join("timeline.json"))?,
            &self.out.join(format!("{}.png", self.name)),
            &format!("{}: {servers} servers, {workers} workers", self.name),
        )?;
        // The figures and the plot are what a benchmark keeps; its checkpoints are scratch.
        let _ = std::fs::remove_dir_all(run_dir.join("checkpoints"));
        Ok(RunRecord::from(&report))
    }
}

/// Where a cluster bench starts: its dataset (generated when missing) and job.
pub struct Setup<'a> {
    pub out: &'a Path,
    pub data: &'a Path,
    /// Rows of the tiny Criteo shape generated when `data` does not hold them.
    pub rows: u64,
    pub preset: &'a str,
    pub overrides: &'a [String],
    pub steps: u64,
    pub quiet: bool,
}

impl Setup<'_> {
    /// The configuration: `preset` with `overrides`, `steps` steps over `data`.
    pub fn config(&self, host: &dyn Host) -> Result<JobConfig> {
        std::fs::create_dir_all(self.out).map_err(BenchError::file(self.out))?;
        ensure_dataset(
            host,
            &GenConfig::criteo(self.rows, 1, 0.01),
            self.data,
            self.quiet,
        )?;
        let mut config = JobConfig::load(Some(self.preset), None, self.overrides)?;
        config.fits_in_memory(0)?;
        config.train.steps = self.steps;
        config.data.dir = Some(std::path::absolute(self.data)?);
        Ok(config)
    }
}

/// Generates `wanted` into `data` unless it already holds exactly that dataset.
pub fn ensure_dataset(host: &dyn Host, wanted: &GenConfig, data: &Path, quiet: bool) -> Result<()> {
    let fresh =
        read_meta(data).is_some_and(|m| m.config == *wanted) && data.join(TRAIN_FILE).exists();
    if !fresh {
        host.generate(wanted, data, quiet)
            .map_err(BenchError::Host)?;
    }
    Ok(())
}
