//! The `--config`/`--set` arguments every training command shares, and the overrides they
//! turn into.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use ftrec_config::JobConfig;

/// Model and training configuration: a preset, a TOML file, then `--set` overrides.
#[derive(Args, Debug, Clone)]
pub struct ConfigArgs {
    /// Built-in configuration to start from (tiny, demo).
    #[arg(long)]
    pub preset: Option<String>,
    /// TOML configuration file (applied over the preset).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override a configuration key, e.g. `--set optimizer.sparse.lr=0.05` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Random seed (same as `--set seed=S`).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Worker threads (same as `--set threads=N`; 0 = all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

pub(crate) fn load_config(args: &ConfigArgs, extra: Vec<String>) -> Result<JobConfig> {
    let mut overrides = args.overrides.clone();
    if let Some(s) = args.seed {
        overrides.push(format!("seed={s}"));
    }
    if let Some(t) = args.threads {
        overrides.push(format!("threads={t}"));
    }
    overrides.extend(extra);
    let preset = match (&args.preset, &args.config) {
        (Some(p), _) => Some(p.as_str()),
        (None, None) => Some("tiny"),
        (None, Some(_)) => None,
    };
    let config = JobConfig::load(preset, args.config.as_deref(), &overrides)?;
    // Before anything is allocated: a model too large for this host would abort.
    config.fits_in_memory(0)?;
    Ok(config)
}

/// The `--set` overrides behind the run flags shared by `train` and `cluster run`.
pub(crate) fn run_overrides(
    steps: Option<u64>,
    data: Option<&Path>,
    checkpoint_dir: Option<&Path>,
) -> Vec<String> {
    let mut extra = Vec::new();
    if let Some(s) = steps {
        extra.push(format!("train.steps={s}"));
    }
    if let Some(d) = data {
        extra.push(format!(
            "data.dir={}",
            toml_string(&d.display().to_string())
        ));
    }
    if let Some(d) = checkpoint_dir {
        extra.push(format!(
            "checkpoint.dir={}",
            toml_string(&d.display().to_string())
        ));
    }
    extra
}

fn toml_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("{s:?}"))
}
