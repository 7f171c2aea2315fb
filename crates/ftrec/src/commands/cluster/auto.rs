//! `--ft auto` in the CLI: where the calibration cache lives, this binary as the one the
//! calibration starts, and the choice applied to the job.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ftrec_cluster::auto::{self, Choice};
use ftrec_config::JobConfig;

/// `--ft auto`'s inputs beside the job.
pub struct AutoArgs {
    pub mtbf: Option<f64>,
    /// Spares the job starts with.
    pub spares: usize,
    /// Where calibrations are kept (`None`: measured every time).
    pub cache: Option<PathBuf>,
    pub recalibrate: bool,
    pub probe_steps: u64,
}

/// `--calibration-cache`, else `$FTREC_CACHE_DIR`, else `$XDG_CACHE_HOME/ftrec`, else
/// `~/.cache/ftrec`; `none` keeps none.
pub fn cache_dir(flag: Option<&Path>) -> Option<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let dir = match flag {
        Some(dir) => dir.to_path_buf(),
        None => env("FTREC_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| env("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("ftrec")))
            .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".cache").join("ftrec")))?,
    };
    (dir.as_os_str() != "none").then_some(dir)
}

/// Measures the costs (or finds them cached), chooses, and applies the choice to `config`.
/// The timing checkpoint goes to `scratch`, the calibration's runs under `runs_dir`.
pub fn choose_and_apply(
    config: &mut JobConfig,
    scratch: &Path,
    runs_dir: &Path,
    args: &AutoArgs,
) -> Result<Choice> {
    let exe = std::env::current_exe().context("locating the ftrec binary")?;
    let costs = auto::calibrate(
        config,
        &auto::CalibrateOptions {
            mtbf_seconds: args.mtbf,
            scratch,
            runs_dir,
            exe: &exe,
            spares: args.spares,
            probe_steps: args.probe_steps,
            cache: args.cache.as_deref(),
            recalibrate: args.recalibrate,
        },
    )?;
    let choice = auto::choose(costs);
    auto::apply(config, &choice);
    Ok(choice)
}

/// `--ft`: a fault tolerance, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FtArg {
    Fixed(ftrec_config::FaultTolerance),
    Auto,
}

impl std::str::FromStr for FtArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Self::Auto);
        }
        s.parse()
            .map(Self::Fixed)
            .map_err(|e: String| format!("{e}, or auto"))
    }
}

/// `--ft auto`: measures the costs, chooses, applies the choice to `config` and says so.
pub(super) fn choose_ft(
    config: &mut ftrec_config::JobConfig,
    run_dir: &Path,
    args: &AutoArgs,
    json: bool,
) -> Result<ftrec_cluster::auto::Choice> {
    let scratch = ftrec_cluster::auto::calibrate::scratch_dir(config, run_dir);
    if !json {
        outln!(
            "--ft auto: calibrating on this job ({} steps a run; cached per configuration)",
            args.probe_steps
        );
    }
    let choice = choose_and_apply(config, &scratch, run_dir, args)?;
    if !json {
        outln!("--ft auto: {}", choice.why);
    }
    tracing::info!("--ft auto: {}", choice.why);
    Ok(choice)
}
