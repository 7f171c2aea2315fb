//! `--ft auto` in the CLI: the model's pace timed with the single-process trainer (the
//! cluster crates do not depend on it), the rest of the costs measured by
//! `ftrec_cluster::auto::calibrate`, and the choice applied to the job.

use std::path::Path;
use std::time::Instant;

use anyhow::{Result, bail};
use ftrec_cluster::auto::{self, Choice, Measured};
use ftrec_config::JobConfig;

/// Steps of the model timed for its pace (after one untimed step).
const PROBE_STEPS: u64 = 20;

/// Seconds per step of `config`'s model on its training data: single process, one thread.
pub fn step_seconds(config: &JobConfig) -> Result<Measured> {
    let mut c = config.clone();
    c.threads = 1;
    c.checkpoint.dir = None;
    c.checkpoint.strategy = None;
    let Some(dir) = c.data.dir.clone() else {
        bail!("no dataset: pass --data DIR or set data.dir (--ft auto times the model on it)");
    };
    let data = ftrec_data::Dataset::open_split(&dir, ftrec_data::TRAIN_FILE)?;
    let mut trainer = ftrec_train::Trainer::new(&c)?;
    // The first step pays for allocation and page faults.
    trainer.train(&data, 1, |_| {})?;
    let started = Instant::now();
    let report = trainer.train(&data, 1 + PROBE_STEPS, |_| {})?;
    Ok(Measured::new(
        started.elapsed().as_secs_f64() / report.steps.max(1) as f64,
        format!("measured: {PROBE_STEPS} single-process steps on one thread"),
    ))
}

/// Measures the costs, chooses for `mtbf`, and applies the choice to `config`.
pub fn choose_and_apply(
    config: &mut JobConfig,
    scratch: &Path,
    mtbf: Option<f64>,
    ec_costs: Option<&Path>,
) -> Result<Choice> {
    let costs = auto::calibrate(
        config,
        &auto::CalibrateOptions {
            mtbf_seconds: mtbf,
            ec_summary: ec_costs,
            scratch,
            step_seconds: step_seconds(config)?,
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
    mtbf: Option<f64>,
    ec_costs: Option<&Path>,
    json: bool,
) -> Result<ftrec_cluster::auto::Choice> {
    let scratch = ftrec_cluster::auto::calibrate::scratch_dir(config, run_dir);
    let choice = choose_and_apply(config, &scratch, mtbf, ec_costs)?;
    if !json {
        outln!("--ft auto: {}", choice.why);
    }
    tracing::info!("--ft auto: {}", choice.why);
    Ok(choice)
}
