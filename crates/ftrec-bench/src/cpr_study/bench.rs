//! `ftrec bench cpr` around the study: its dataset and job before, its files after.

use std::path::Path;

use ftrec_config::JobConfig;
use ftrec_data::generate::{GenConfig, read_meta};
use ftrec_data::{Dataset, TEST_FILE, TRAIN_FILE};
use serde_json::Value;

use super::StudyReport;
use super::plot::{plot_auc_pls, plot_many_failures, plot_overhead, plot_sensitivity};
use crate::cluster_run::ensure_dataset;
use crate::error::{BenchError, Result};
use crate::host::Host;

/// The job the study trains, and where its data comes from.
#[derive(Clone, Debug)]
pub struct JobOptions<'a> {
    /// Generated (Criteo Kaggle shape at 1% of its cardinalities) unless it holds the
    /// `rows` dataset.
    pub data: &'a Path,
    pub rows: u64,
    pub preset: &'a str,
    /// `--set`, after the study's defaults.
    pub set: &'a [String],
    /// Steps per run (default: one epoch).
    pub steps: Option<u64>,
    pub seed: u64,
    pub target_pls: Option<f64>,
    pub quiet: bool,
}

/// The study's job with its train and test splits, the dataset generated first if needed.
pub fn prepare(host: &dyn Host, a: &JobOptions) -> Result<(JobConfig, Dataset, Dataset)> {
    ensure_dataset(host, &GenConfig::criteo(a.rows, 1, 0.01), a.data, a.quiet)?;
    let job = study_config(a)?;
    let train = Dataset::open_split(a.data, TRAIN_FILE)?;
    let test = Dataset::open_split(a.data, TEST_FILE)?;
    Ok((job, train, test))
}

/// The study's defaults (dim 16, MLPs 64-16 and 64-1, batch 1024, one table per generated
/// feature), then the flags, then `--set`.
fn study_config(a: &JobOptions) -> Result<JobConfig> {
    let mut overrides: Vec<String> = vec![
        "model.dim=16".into(),
        "model.bottom=[64, 16]".into(),
        "model.top=[64, 1]".into(),
        "train.batch_size=1024".into(),
        format!("seed={}", a.seed),
    ];
    if let Some(meta) = read_meta(a.data) {
        let rows: Vec<String> = meta
            .config
            .cardinalities
            .iter()
            .map(|c| c.max(&2).to_string())
            .collect();
        overrides.push(format!("model.table_rows=[{}]", rows.join(", ")));
    }
    if let Some(p) = a.target_pls {
        overrides.push(format!("cpr.target_pls={p}"));
    }
    if let Some(s) = a.steps {
        overrides.push(format!("train.steps={s}"));
    }
    overrides.extend(a.set.iter().cloned());
    let config = JobConfig::load(Some(a.preset), None, &overrides)?;
    config.fits_in_memory(0)?;
    Ok(config)
}

/// Writes `summary.json` and the plots into `out` (created); the report as JSON.
pub fn write(report: &StudyReport, out: &Path) -> Result<Value> {
    std::fs::create_dir_all(out).map_err(BenchError::file(out))?;
    let value = serde_json::to_value(report)?;
    let path = out.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&value)?)
        .map_err(BenchError::file(&path))?;
    plot_auc_pls(report, &out.join("auc_vs_pls.png"))?;
    plot_overhead(report, &out.join("overhead.png"))?;
    if let Some(sensitivity) = &report.sensitivity {
        plot_sensitivity(sensitivity, &out.join("sensitivity.png"))?;
    }
    if let Some(many) = &report.many_failures {
        plot_many_failures(many, &out.join("many_failures.png"))?;
    }
    Ok(value)
}
