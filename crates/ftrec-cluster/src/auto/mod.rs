//! `--ft auto`: the system picks the fault tolerance and its interval from measured costs
//! and a mean time between failures (`model` for the arithmetic, `calibrate` for the
//! measurements, `probe` for the calibration runs on the job itself, `cache` to keep them
//! per configuration), and says what it chose and why.

pub mod cache;
pub mod calibrate;
pub mod model;
pub mod probe;

pub use calibrate::{CalibrateOptions, calibrate};
pub use model::{Choice, Costs, Measured, Prediction, choose};

use ftrec_config::{FaultTolerance, JobConfig};

/// `config` with the choice applied: erasure coding, or checkpoints every
/// `every_seconds` (with the configured strategy, full by default).
pub fn apply(config: &mut JobConfig, choice: &Choice) {
    match choice.strategy {
        "ec" => config.cluster.ft = FaultTolerance::Ec,
        _ => {
            config.cluster.ft = FaultTolerance::Checkpoint;
            config.checkpoint.every_seconds = choice.every_seconds;
            // The coordinator re-plans the interval as it measures failures.
            config.checkpoint.planned_mtbf_seconds = choice
                .every_seconds
                .map(|_| choice.costs.mtbf_seconds.value);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use ftrec_config::JobConfig;

    /// The `tiny` preset with `set` over it, as a cluster job (it names a dataset; the
    /// tests that use it never run it).
    pub(crate) fn tiny(set: &[&str]) -> JobConfig {
        let o: Vec<String> = std::iter::once("data.dir=\"/data\"")
            .chain(set.iter().copied())
            .map(String::from)
            .collect();
        JobConfig::load(Some("tiny"), None, &o).unwrap()
    }
}
