//! What the benches borrow from the binary that runs them. The cluster benches start the
//! binary itself as servers and workers, generate datasets with its progress bar, evaluate
//! final models with the single-process trainer, and let `--ft auto` choose: those pieces
//! belong to the CLI (the cluster crates do not depend on the trainer), so the binary hands
//! them in through this trait instead of the library growing a second copy.

use std::path::{Path, PathBuf};

use ftrec_cluster::auto::Choice;
use ftrec_cluster::launch::Evaluator;
use ftrec_config::JobConfig;
use ftrec_data::generate::GenConfig;

use crate::error::Boxed;

pub trait Host {
    /// The `ftrec` binary the clusters and the `cluster run` children are started from.
    fn exe(&self) -> std::io::Result<PathBuf>;
    /// Generates `config` into `dir` (binary format); `quiet` hides the progress.
    fn generate(&self, config: &GenConfig, dir: &Path, quiet: bool) -> Result<(), Boxed>;
    /// Evaluates a cluster's final model on the job's test split.
    fn evaluator(&self) -> Evaluator;
    /// `--ft auto`: calibrates on `config` with `spares` spares (scratch files and the
    /// calibration cache under `scratch`), chooses for `mtbf`, and applies the choice to
    /// `config`.
    fn choose_ft(
        &self,
        config: &mut JobConfig,
        scratch: &Path,
        mtbf: Option<f64>,
        spares: usize,
    ) -> Result<Choice, Boxed>;
    /// A progress line for a person (stderr in the binary).
    fn note(&self, line: &str);
}
