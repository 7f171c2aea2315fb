//! The model, optimizer, training and data sections.

use std::path::PathBuf;

use ftrec_model::Optimizer;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    #[serde(default = "default_num_dense")]
    pub num_dense: usize,
    /// Rows per table; when empty, `num_tables` tables of `rows_per_table` rows.
    #[serde(default)]
    pub table_rows: Vec<usize>,
    #[serde(default)]
    pub num_tables: usize,
    #[serde(default)]
    pub rows_per_table: usize,
    pub dim: usize,
    pub bottom: Vec<usize>,
    pub top: Vec<usize>,
}

fn default_num_dense() -> usize {
    13
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    pub sparse: Optimizer,
    pub dense: Optimizer,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    pub batch_size: usize,
    /// Steps to run; 0 means `epochs` passes over the training split.
    #[serde(default)]
    pub steps: u64,
    #[serde(default = "one")]
    pub epochs: u64,
    /// Held-out samples used by the final evaluation (0 = the whole test split).
    #[serde(default)]
    pub eval_samples: usize,
    /// Single-process training: put the embedding tables on transparent huge pages
    /// (`madvise`), so that random row reads stop missing the TLB: pooling and the sparse
    /// update 0.8-1 ms faster a `tiny` step on the Zen 4 host. Off by default because full
    /// checkpoints written from huge pages blocked about 20% longer there
    /// (bench-results/HISTORY.md, "Tables on whole huge pages"). Values are the same either
    /// way; needs THP at `madvise` or `always`. Applies to a fresh start: a resumed run
    /// restores its tables onto ordinary pages.
    #[serde(default)]
    pub huge_pages: bool,
}

fn one() -> u64 {
    1
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// A directory holding `train.ftrd` and `test.ftrd`.
    #[serde(default)]
    pub dir: Option<PathBuf>,
}
