//! Training configuration: a preset or defaults, then a TOML file, then `--set key=value`
//! overrides, validated into a [`TrainConfig`]. Errors name the offending key.

use std::path::{Path, PathBuf};

use ftrec_model::{ModelConfig, Optimizer};
use serde::{Deserialize, Serialize};
use toml::Value;

use crate::TrainError;

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

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub seed: u64,
    /// Worker threads; results are bit-identical for a fixed value (and, as tested, across
    /// values). 0 means all cores.
    #[serde(default)]
    pub threads: usize,
    pub model: ModelSection,
    pub optimizer: OptimizerSection,
    pub train: TrainSection,
    #[serde(default)]
    pub data: DataSection,
    #[serde(default)]
    pub checkpoint: CheckpointSection,
    /// Parameter-server cluster settings (`ftrec cluster run`); ignored by `ftrec train`.
    #[serde(default)]
    pub cluster: ClusterSection,
}

/// What a cluster does when a server dies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultTolerance {
    /// A replacement server starts from the initial state: the shard's training is lost.
    #[default]
    None,
    /// Periodic consistent checkpoints; on a failure every server rolls back to the last
    /// one and the workers rewind their data position (Ckpt-T in the papers).
    Checkpoint,
}

impl FaultTolerance {
    pub const ALL: [Self; 2] = [Self::None, Self::Checkpoint];

    /// The name used in configuration files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Checkpoint => "checkpoint",
        }
    }
}

impl std::str::FromStr for FaultTolerance {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|f| f.name()).collect();
                format!("unknown fault tolerance {s:?}: one of {}", names.join(", "))
            })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    pub servers: usize,
    pub workers: usize,
    #[serde(default)]
    pub ft: FaultTolerance,
    /// Workers take steps strictly in order (each pull waits for the previous step's
    /// push): bit-reproducible, and with one worker equal to `ftrec train`.
    #[serde(default)]
    pub deterministic: bool,
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A member silent this long is declared dead.
    #[serde(default = "default_failure_timeout_ms")]
    pub failure_timeout_ms: u64,
    /// Bound on every RPC and every wait in the cluster.
    #[serde(default = "default_rpc_timeout_ms")]
    pub rpc_timeout_ms: u64,
}

fn default_heartbeat_ms() -> u64 {
    100
}
fn default_failure_timeout_ms() -> u64 {
    1000
}
fn default_rpc_timeout_ms() -> u64 {
    30_000
}

impl Default for ClusterSection {
    fn default() -> Self {
        Self {
            servers: 2,
            workers: 2,
            ft: FaultTolerance::None,
            deterministic: false,
            heartbeat_ms: default_heartbeat_ms(),
            failure_timeout_ms: default_failure_timeout_ms(),
            rpc_timeout_ms: default_rpc_timeout_ms(),
        }
    }
}

/// Checkpoint strategies. Only `none` and `full` exist so far; the incremental ones are
/// accepted by name and rejected with a clear message until they land.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointStrategy {
    #[default]
    None,
    Full,
    Differential,
    NaiveIncremental,
    Incrcp,
    Deck,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// `full` when a directory is given and no strategy is set.
    #[serde(default)]
    pub strategy: Option<CheckpointStrategy>,
    /// Take a checkpoint every this many steps (0 = only at the end of training).
    #[serde(default)]
    pub every_steps: u64,
    /// Directory (local path) to write checkpoints to.
    #[serde(default)]
    pub dir: Option<PathBuf>,
    /// Incremental strategies: a full checkpoint every this many checkpoints (0 = only the
    /// first one). Unset: 10 for differential and naive-incremental; for incrcp no cap, as
    /// it resets its baseline when that is cheaper.
    #[serde(default)]
    pub full_every: Option<u64>,
    /// IncrCP's extraction threshold R: an extraction must move at least this fraction of
    /// a chunk's rows.
    #[serde(default = "default_incrcp_threshold")]
    pub incrcp_threshold: f64,
    /// DECK's knobs (`checkpoint.deck.stride`, `.full_every_deltas`, `.live_factor`, ...).
    #[serde(default)]
    pub deck: ftrec_ckpt::deck::DeckOptions,
    /// Start an independent branch of history in a location that already holds
    /// checkpoints (`--new-branch`); a fresh run there is refused otherwise.
    #[serde(default)]
    pub new_branch: bool,
    /// Cluster: keep the newest this many consistent cuts; older shard checkpoints are
    /// deleted once a newer cut commits (0 keeps every cut).
    #[serde(default = "default_keep")]
    pub keep: usize,
}

fn default_keep() -> usize {
    2
}

fn default_incrcp_threshold() -> f64 {
    ftrec_ckpt::incrcp::DEFAULT_THRESHOLD
}

impl Default for CheckpointSection {
    fn default() -> Self {
        Self {
            strategy: None,
            every_steps: 0,
            dir: None,
            full_every: None,
            incrcp_threshold: default_incrcp_threshold(),
            deck: Default::default(),
            new_branch: false,
            keep: default_keep(),
        }
    }
}

impl CheckpointSection {
    /// The strategy in effect: none without a directory, full by default with one.
    pub fn effective_strategy(&self) -> CheckpointStrategy {
        match (self.strategy, &self.dir) {
            (_, None) => CheckpointStrategy::None,
            (None, Some(_)) => CheckpointStrategy::Full,
            (Some(s), Some(_)) => s,
        }
    }

    /// The checkpoint engine's strategy for this section (`None`: no checkpoints).
    pub fn engine_strategy(&self) -> Option<ftrec_ckpt::Strategy> {
        use ftrec_ckpt::Strategy;
        Some(match self.effective_strategy() {
            CheckpointStrategy::None => return None,
            CheckpointStrategy::Full => Strategy::Full,
            CheckpointStrategy::Differential => Strategy::Differential,
            CheckpointStrategy::NaiveIncremental => Strategy::NaiveIncremental,
            CheckpointStrategy::Incrcp => Strategy::Incrcp,
            CheckpointStrategy::Deck => Strategy::Deck,
        })
    }

    /// The checkpointer this section asks for, writing through `checkpoints` (a handle
    /// that holds the location's writer lease), for a model of `tables` tables: the
    /// trainer's, and each cluster server's over its shard.
    pub fn checkpointer(
        &self,
        checkpoints: ftrec_ckpt::Checkpoints,
        tables: usize,
    ) -> Result<Option<ftrec_ckpt::Checkpointer>, TrainError> {
        use ftrec_ckpt::{Checkpointer, Strategy};
        let Some(strategy) = self.engine_strategy() else {
            return Ok(None);
        };
        Ok(Some(if strategy == Strategy::Deck {
            Checkpointer::deck(checkpoints, tables, self.deck.clone())?
        } else {
            Checkpointer::with_threshold(
                checkpoints,
                strategy,
                self.full_every
                    .unwrap_or_else(|| strategy.default_full_every()),
                tables,
                self.incrcp_threshold,
            )?
        }))
    }
}

impl TrainConfig {
    /// Built-in presets. `tiny`: 26 tables x 100,000 rows x 64, bottom 13-512-256-64, top
    /// 415-512-256-1, batch 2048, SGD lr 0.01 (the benchmark configuration).
    pub fn preset(name: &str) -> Result<Self, TrainError> {
        match name {
            "tiny" => Ok(Self {
                seed: 1,
                threads: 0,
                model: ModelSection {
                    num_dense: 13,
                    table_rows: Vec::new(),
                    num_tables: 26,
                    rows_per_table: 100_000,
                    dim: 64,
                    bottom: vec![512, 256, 64],
                    top: vec![512, 256, 1],
                },
                optimizer: OptimizerSection {
                    sparse: Optimizer::Sgd { lr: 0.01 },
                    dense: Optimizer::Sgd { lr: 0.01 },
                },
                train: TrainSection {
                    batch_size: 2048,
                    steps: 0,
                    epochs: 1,
                    eval_samples: 0,
                },
                data: DataSection::default(),
                checkpoint: CheckpointSection::default(),
                cluster: ClusterSection::default(),
            }),
            // The demo: the tiny architecture with optimizers that learn the synthetic
            // teacher within a minute (plain SGD at 0.01 needs many epochs).
            "demo" => {
                let mut c = Self::preset("tiny")?;
                c.optimizer.sparse = Optimizer::RowwiseAdagrad {
                    lr: 0.05,
                    eps: 1e-8,
                    initial_accumulator: 0.0,
                };
                c.optimizer.dense = Optimizer::Adagrad {
                    lr: 0.01,
                    eps: 1e-8,
                    initial_accumulator: 0.0,
                };
                Ok(c)
            }
            other => Err(TrainError::Config(format!(
                "unknown preset {other:?} (known: tiny, demo)"
            ))),
        }
    }

    /// A configuration that rebuilds `model` exactly (for evaluating a saved model), with
    /// the given evaluation batch size and threads.
    pub fn for_model(model: &ModelConfig, batch_size: usize, threads: usize) -> Self {
        Self {
            seed: 0,
            threads,
            model: ModelSection {
                num_dense: model.num_dense,
                table_rows: model.table_rows.clone(),
                num_tables: 0,
                rows_per_table: 0,
                dim: model.dim,
                bottom: model.bottom.clone(),
                top: model.top.clone(),
            },
            optimizer: OptimizerSection {
                sparse: model.sparse_optimizer,
                dense: model.dense_optimizer,
            },
            train: TrainSection {
                batch_size,
                steps: 0,
                epochs: 1,
                eval_samples: 0,
            },
            data: DataSection::default(),
            checkpoint: CheckpointSection::default(),
            cluster: ClusterSection::default(),
        }
    }

    /// `base` (a preset) merged with an optional TOML file, then `overrides` (`a.b=value`,
    /// value parsed as TOML, or as a string when it is not valid TOML).
    pub fn load(
        base: Option<&str>,
        file: Option<&Path>,
        overrides: &[String],
    ) -> Result<Self, TrainError> {
        let mut value = match base {
            Some(p) => {
                Value::try_from(Self::preset(p)?).map_err(|e| TrainError::Config(e.to_string()))?
            }
            None => Value::Table(Default::default()),
        };
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|e| TrainError::Io {
                path: path.to_path_buf(),
                error: e,
            })?;
            let file_value: Value = toml::from_str(&text)
                .map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))?;
            merge(&mut value, file_value);
        }
        for o in overrides {
            apply_override(&mut value, o)?;
        }
        let config: TrainConfig = value.try_into().map_err(|e: toml::de::Error| {
            let origin = file.map_or_else(String::new, |p| format!("{}: ", p.display()));
            TrainError::Config(format!("{origin}{}", e.message()))
        })?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), TrainError> {
        if self.train.batch_size == 0 {
            return Err(TrainError::Config(
                "train.batch_size must be positive".into(),
            ));
        }
        if self.train.epochs == 0 && self.train.steps == 0 {
            return Err(TrainError::Config(
                "train.epochs or train.steps must be positive".into(),
            ));
        }
        self.model_config()?.validate()?;
        match self.checkpoint.effective_strategy() {
            CheckpointStrategy::None
            | CheckpointStrategy::Full
            | CheckpointStrategy::Differential
            | CheckpointStrategy::NaiveIncremental
            | CheckpointStrategy::Incrcp
            | CheckpointStrategy::Deck => {}
        }
        let c = &self.cluster;
        if c.servers == 0 || c.workers == 0 {
            return Err(TrainError::Config(format!(
                "cluster.servers = {} and cluster.workers = {}: a cluster needs at least one of each",
                c.servers, c.workers
            )));
        }
        if c.heartbeat_ms == 0 || c.failure_timeout_ms <= c.heartbeat_ms {
            return Err(TrainError::Config(format!(
                "cluster.failure_timeout_ms = {} must exceed cluster.heartbeat_ms = {} (> 0)",
                c.failure_timeout_ms, c.heartbeat_ms
            )));
        }
        if c.rpc_timeout_ms == 0 {
            return Err(TrainError::Config(
                "cluster.rpc_timeout_ms must be positive".into(),
            ));
        }
        self.checkpoint
            .deck
            .validate()
            .map_err(|e| TrainError::Config(format!("checkpoint.deck: {e}")))?;
        let r = self.checkpoint.incrcp_threshold;
        if !(0.0..=1.0).contains(&r) {
            return Err(TrainError::Config(format!(
                "checkpoint.incrcp_threshold = {r}: must be within 0..=1"
            )));
        }
        Ok(())
    }

    /// A single-process run that names a strategy must say where checkpoints go (a
    /// cluster defaults to its run directory, so this is not part of [`Self::validate`]).
    pub fn require_checkpoint_dir(&self) -> Result<(), TrainError> {
        if self
            .checkpoint
            .strategy
            .is_some_and(|s| s != CheckpointStrategy::None)
            && self.checkpoint.dir.is_none()
        {
            return Err(TrainError::Config(
                "checkpoint.strategy needs a directory: --checkpoint-dir or checkpoint.dir".into(),
            ));
        }
        Ok(())
    }

    pub fn model_config(&self) -> Result<ModelConfig, TrainError> {
        let m = &self.model;
        let table_rows = if !m.table_rows.is_empty() {
            if m.num_tables != 0 && m.num_tables != m.table_rows.len() {
                return Err(TrainError::Config(format!(
                    "model.num_tables = {} disagrees with the {} entries of model.table_rows",
                    m.num_tables,
                    m.table_rows.len()
                )));
            }
            m.table_rows.clone()
        } else if m.num_tables > 0 && m.rows_per_table > 0 {
            vec![m.rows_per_table; m.num_tables]
        } else {
            return Err(TrainError::Config(
                "model: set model.table_rows, or model.num_tables and model.rows_per_table".into(),
            ));
        };
        Ok(ModelConfig {
            num_dense: m.num_dense,
            table_rows,
            dim: m.dim,
            bottom: m.bottom.clone(),
            top: m.top.clone(),
            sparse_optimizer: self.optimizer.sparse,
            dense_optimizer: self.optimizer.dense,
        })
    }

    pub fn threads(&self) -> usize {
        if self.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            self.threads
        }
    }
}

fn merge(base: &mut Value, top: Value) {
    match (base, top) {
        (Value::Table(b), Value::Table(t)) => {
            for (k, v) in t {
                match b.get_mut(&k) {
                    // A new optimizer kind replaces the whole table so stale
                    // hyper-parameters of the old kind are not carried over.
                    Some(existing)
                        if v.get("kind").is_none() || v.get("kind") == existing.get("kind") =>
                    {
                        merge(existing, v)
                    }
                    _ => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, t) => *b = t,
    }
}

fn apply_override(value: &mut Value, assignment: &str) -> Result<(), TrainError> {
    let (key, raw) = assignment
        .split_once('=')
        .ok_or_else(|| TrainError::Config(format!("--set {assignment:?}: expected key=value")))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(TrainError::Config(format!(
            "--set {assignment:?}: empty key"
        )));
    }
    let parsed = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| Value::String(raw.to_string()));
    let mut cursor = value;
    let parts: Vec<&str> = key.split('.').collect();
    for part in &parts[..parts.len() - 1] {
        let table = cursor.as_table_mut().ok_or_else(|| {
            TrainError::Config(format!("--set {key}: {part} is not inside a table"))
        })?;
        cursor = table
            .entry(part.to_string())
            .or_insert_with(|| Value::Table(Default::default()));
    }
    let last = parts[parts.len() - 1];
    let table = cursor
        .as_table_mut()
        .ok_or_else(|| TrainError::Config(format!("--set {key}: parent is not a table")))?;
    if last == "kind" && table.get("kind") != Some(&parsed) {
        // Switching optimizer: drop the old kind's hyper-parameters except the lr.
        table.retain(|k, _| k == "lr");
    }
    table.insert(last.to_string(), parsed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_file_and_overrides_layer_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "seed = 9\n[train]\nbatch_size = 64\n").unwrap();
        let c = TrainConfig::load(
            Some("tiny"),
            Some(&f),
            &[
                "train.batch_size=32".into(),
                "optimizer.sparse.kind=\"adam\"".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.seed, 9);
        assert_eq!(c.train.batch_size, 32);
        assert!(matches!(c.optimizer.sparse, Optimizer::Adam { lr, .. } if lr == 0.01));
        assert_eq!(c.model_config().unwrap().table_rows.len(), 26);
    }

    #[test]
    fn errors_name_the_field() {
        let e = TrainConfig::load(Some("tiny"), None, &["train.batch_sise=3".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("batch_sise"), "{e}");
        let e = TrainConfig::load(Some("tiny"), None, &["model.bottom=[512, 32]".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.bottom"), "{e}");
        let e = TrainConfig::load(Some("tiny"), None, &["optimizer.dense.lr=-1".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("optimizer.dense"), "{e}");
        let e = TrainConfig::load(Some("tiny"), None, &["seed".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("key=value"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bad.toml");
        std::fs::write(&f, "[train]\nbatch_size = \"big\"\n").unwrap();
        let e = TrainConfig::load(Some("tiny"), Some(&f), &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.toml"), "{e}");
    }

    #[test]
    fn fault_tolerance_names_round_trip_and_unknown_ones_are_named() {
        for ft in FaultTolerance::ALL {
            assert_eq!(ft.name().parse::<FaultTolerance>(), Ok(ft));
            let toml = format!("{:?}", ft.name());
            let back: FaultTolerance = toml::from_str(&format!("v = {toml}"))
                .map(|t: std::collections::HashMap<String, FaultTolerance>| t["v"])
                .unwrap();
            assert_eq!(back, ft, "the config file uses the same names");
        }
        let e = "ecc".parse::<FaultTolerance>().unwrap_err();
        assert!(
            e.contains("\"ecc\"") && e.contains("none, checkpoint"),
            "{e}"
        );
    }
}
