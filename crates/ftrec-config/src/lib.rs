//! The job configuration: a preset or defaults, then a TOML file, then `--set key=value`
//! overrides, validated into a [`JobConfig`]. Errors name the offending key. One section
//! per concern, each validating itself; the trainer, the cluster and the CLI all read the
//! same type.

mod checkpoint;
mod cluster;
mod cpr;
mod error;
mod layering;
mod membership;
mod memory;
mod sections;
mod security;

use std::path::Path;

use ftrec_model::{ModelConfig, Optimizer};
use serde::{Deserialize, Serialize};
use toml::Value;

pub use checkpoint::{CheckpointSection, parse_strategy};
pub use cluster::{
    ClusterSection, Deadlines, DeadlinesSection, EcSection, FaultTolerance, Hedge, RebuildTransport,
};
pub use cpr::{CprPriority, CprSection};
pub use error::ConfigError;
pub use ftrec_ckpt::Strategy;
pub use membership::{MIN_LEASE_TTL_S, Membership};
pub use memory::{MemoryPart, available_memory, check_parts, parts_fit_in_memory};
pub use sections::{DataSection, ModelSection, OptimizerSection, TrainSection};
pub use security::{SECRET_ENV, SecuritySection};

/// More compute threads than this is a mistake, not a setting: each is an OS thread with
/// its own stack, and far more threads than cores only slow a step down.
pub const MAX_THREADS: usize = 1024;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobConfig {
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
    /// Erasure coding, with `cluster.ft = "ec"`.
    #[serde(default)]
    pub ec: EcSection,
    /// Job secret and TLS for the cluster's RPCs.
    #[serde(default)]
    pub security: SecuritySection,
    /// CPR partial recovery (`ftrec bench cpr`).
    #[serde(default)]
    pub cpr: CprSection,
}

impl JobConfig {
    /// Steps commit in two phases: the rows are erasure coded and `ec.two_phase_commit`
    /// is on (the worker drives prepare and commit; a recovery fences before it decides).
    pub fn two_phase_commit(&self) -> bool {
        self.cluster.ft.erasure_coded() && self.ec.two_phase_commit
    }

    /// Dense ranges are replicated on a second server rather than coded: `ec.replicate_dense`
    /// at `ec.r = 1` only. One replica cannot outlive two lost servers, and a user who asked
    /// for `r >= 2` was promised any `r`, so there the dense ranges are coded in dense
    /// stripes with the rows' `r` (exact for any `r` lost, and cheaper in memory than `r`
    /// replicas).
    pub fn dense_replicated(&self) -> bool {
        self.ec.replicate_dense && self.ec.r < 2
    }

    /// Built-in presets. `tiny`: 26 tables x 100,000 rows x 64, bottom 13-512-256-64, top
    /// 415-512-256-1, batch 2048, SGD lr 0.01 (the benchmark configuration). `demo`: tiny
    /// with Adagrad. `micro`: 26 tables x 1,000 rows x 8, batch 64, row-wise Adagrad and Adam
    /// (fault schedules in tests).
    pub fn preset(name: &str) -> Result<Self, ConfigError> {
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
                    huge_pages: false,
                },
                data: DataSection::default(),
                checkpoint: CheckpointSection::default(),
                cluster: ClusterSection::default(),
                ec: EcSection::default(),
                security: SecuritySection::default(),
                cpr: CprSection::default(),
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
            // Fault schedules in tests: tables of a few thousand rows, so that one
            // schedule trains in well under a second, with stateful optimizers on both
            // sides, so that redundancy must carry optimizer state too.
            "micro" => {
                let mut c = Self::preset("tiny")?;
                // The generated datasets' 13 dense and 26 sparse features, so that
                // `ftrec data gen` feeds it; only the tables and layers shrink.
                c.model.rows_per_table = 1_000;
                c.model.dim = 8;
                c.model.bottom = vec![16, 8];
                c.model.top = vec![16, 1];
                c.train.batch_size = 64;
                c.optimizer.sparse = Optimizer::RowwiseAdagrad {
                    lr: 0.05,
                    eps: 1e-8,
                    initial_accumulator: 0.0,
                };
                c.optimizer.dense = Optimizer::Adam {
                    lr: 0.01,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                };
                Ok(c)
            }
            other => Err(ConfigError::Invalid(format!(
                "unknown preset {other:?} (known: tiny, demo, micro)"
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
                huge_pages: false,
            },
            data: DataSection::default(),
            checkpoint: CheckpointSection::default(),
            cluster: ClusterSection::default(),
            ec: EcSection::default(),
            security: SecuritySection::default(),
            cpr: CprSection::default(),
        }
    }

    /// `base` (a preset) merged with an optional TOML file, then `overrides` (`a.b=value`,
    /// value parsed as TOML, or as a string when it is not valid TOML).
    pub fn load(
        base: Option<&str>,
        file: Option<&Path>,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let mut value = match base {
            Some(p) => Value::try_from(Self::preset(p)?)
                .map_err(|e| ConfigError::Invalid(e.to_string()))?,
            None => Value::Table(Default::default()),
        };
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
                path: path.to_path_buf(),
                error: e,
            })?;
            let file_value: Value = toml::from_str(&text)
                .map_err(|e| ConfigError::Invalid(format!("{}: {e}", path.display())))?;
            layering::merge(&mut value, file_value);
        }
        for o in overrides {
            layering::apply_override(&mut value, o)?;
        }
        // serde's own message names the type, not the key: track the path to say which.
        let config: JobConfig = serde_path_to_error::deserialize(value).map_err(
            |e: serde_path_to_error::Error<toml::de::Error>| {
                let origin = file.map_or_else(String::new, |p| format!("{}: ", p.display()));
                let path = e.path().to_string();
                let key = if path.is_empty() || path == "." {
                    String::new()
                } else {
                    format!("{path}: ")
                };
                let message = e.inner().message().to_string();
                let hint = if base.is_none() && message.starts_with("missing field") {
                    "; a --config file without --preset must set every key (add --preset \
                     tiny to layer it over the defaults)"
                } else {
                    ""
                };
                ConfigError::Invalid(format!("{origin}{key}{message}{hint}"))
            },
        )?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.train.batch_size == 0 {
            return Err(ConfigError::Invalid(
                "train.batch_size must be positive".into(),
            ));
        }
        if self.train.epochs == 0 && self.train.steps == 0 {
            return Err(ConfigError::Invalid(
                "train.epochs or train.steps must be positive".into(),
            ));
        }
        if self.threads > MAX_THREADS {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            return Err(ConfigError::Invalid(format!(
                "threads = {}: at most {MAX_THREADS} (this host has {cores} cores; 0 uses all of them)",
                self.threads
            )));
        }
        self.model_config()?.validate()?;
        self.checkpoint.validate()?;
        self.cluster.validate()?;
        self.ec.validate(&self.cluster)?;
        self.security.validate()?;
        self.cpr.validate(self.model_config()?.tables())?;
        Ok(())
    }

    /// A single-process run that names a strategy must say where checkpoints go (a
    /// cluster defaults to its run directory, so this is not part of [`Self::validate`]).
    pub fn require_checkpoint_dir(&self) -> Result<(), ConfigError> {
        if self.checkpoint.names_a_strategy() && self.checkpoint.dir.is_none() {
            return Err(ConfigError::Invalid(
                "checkpoint.strategy needs a directory: --checkpoint-dir or checkpoint.dir".into(),
            ));
        }
        Ok(())
    }

    pub fn model_config(&self) -> Result<ModelConfig, ConfigError> {
        let m = &self.model;
        let table_rows = if !m.table_rows.is_empty() {
            if m.num_tables != 0 && m.num_tables != m.table_rows.len() {
                return Err(ConfigError::Invalid(format!(
                    "model.num_tables = {} disagrees with the {} entries of model.table_rows",
                    m.num_tables,
                    m.table_rows.len()
                )));
            }
            m.table_rows.clone()
        } else if m.num_tables > 0 && m.rows_per_table > 0 {
            vec![m.rows_per_table; m.num_tables]
        } else {
            return Err(ConfigError::Invalid(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_is_valid_and_micro_is_small_and_stateful() {
        for name in ["tiny", "demo", "micro"] {
            let c = JobConfig::preset(name).unwrap();
            c.validate().unwrap();
            c.model_config().unwrap();
        }
        let micro = JobConfig::preset("micro").unwrap().model_config().unwrap();
        assert!(micro.table_rows.iter().all(|&r| r <= 2_000));
        assert!(!matches!(micro.sparse_optimizer, Optimizer::Sgd { .. }));
        assert!(!matches!(micro.dense_optimizer, Optimizer::Sgd { .. }));
        let e = JobConfig::preset("huge").unwrap_err().to_string();
        assert!(e.contains("\"huge\"") && e.contains("micro"), "{e}");
    }

    #[test]
    fn preset_file_and_overrides_layer_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "seed = 9\n[train]\nbatch_size = 64\n").unwrap();
        let c = JobConfig::load(
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
    fn deadlines_follow_the_failure_timeout_unless_set_and_are_checked_by_key() {
        let ms = std::time::Duration::from_millis;
        let c = JobConfig::load(
            Some("tiny"),
            None,
            &["cluster.failure_timeout_ms=2000".into()],
        )
        .unwrap();
        let d = c.cluster.deadlines();
        assert_eq!(
            (
                d.heartbeat,
                d.step,
                d.rebuild_stall,
                d.checkpoint_io,
                d.control,
                d.stream_progress
            ),
            (
                ms(2000),
                ms(10_000),
                ms(10_000),
                ms(120_000),
                ms(20_000),
                ms(10_000)
            )
        );
        let c = JobConfig::load(
            Some("tiny"),
            None,
            &[
                "cluster.deadlines.step_ms=700".into(),
                "cluster.rpc_timeout_ms=9000".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.cluster.deadlines().step, ms(700));
        assert_eq!(c.cluster.deadlines().control, ms(9000));
        assert_eq!(c.cluster.deadlines().retransmit_min, Some(ms(5)));
        let kernel = JobConfig::load(
            Some("tiny"),
            None,
            &["cluster.deadlines.retransmit_min_ms=0".into()],
        )
        .unwrap();
        assert_eq!(kernel.cluster.deadlines().retransmit_min, None);
        // Slow step calls are sent again by default: at 3 times their fast quartile, 2 ms at
        // least; 0 turns it off.
        assert_eq!(
            c.cluster.deadlines().hedge,
            Some(crate::Hedge {
                multiple: 3,
                floor: ms(2)
            })
        );
        let never = JobConfig::load(
            Some("tiny"),
            None,
            &["cluster.deadlines.hedge_multiple=0".into()],
        )
        .unwrap();
        assert_eq!(never.cluster.deadlines().hedge, None);
        for (key, named) in [
            (
                "cluster.deadlines.hedge_floor_ms=5000",
                "cluster.deadlines.hedge_floor_ms = 5000",
            ),
            (
                "cluster.deadlines.retransmit_min_ms=2",
                "cluster.deadlines.retransmit_min_ms = 2",
            ),
            (
                "cluster.deadlines.retransmit_min_ms=200",
                "cluster.deadlines.retransmit_min_ms = 200",
            ),
            (
                "cluster.deadlines.rebuild_stall_ms=50",
                "cluster.deadlines.rebuild_stall_ms = 50",
            ),
            (
                "cluster.deadlines.stream_progress_ms=100",
                "cluster.deadlines.stream_progress_ms = 100",
            ),
            ("cluster.rpc_timeout_ms=0", "cluster.rpc_timeout_ms = 0"),
            ("cluster.deadlines.stall_ms=5000", "stall_ms"),
        ] {
            let e = JobConfig::load(Some("tiny"), None, &[key.into()])
                .unwrap_err()
                .to_string();
            assert!(e.contains(named), "{key}: {e}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        let e = JobConfig::load(Some("tiny"), None, &["train.batch_sise=3".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("batch_sise"), "{e}");
        let e = JobConfig::load(Some("tiny"), None, &["model.bottom=[512, 32]".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.bottom"), "{e}");
        let e = JobConfig::load(Some("tiny"), None, &["optimizer.dense.lr=-1".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("optimizer.dense"), "{e}");
        let e = JobConfig::load(Some("tiny"), None, &["seed".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("key=value"), "{e}");
        for bad in ["0", "-2", "nan"] {
            let e = JobConfig::load(
                Some("tiny"),
                None,
                &[format!("checkpoint.every_seconds={bad}")],
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("checkpoint.every_seconds"), "{bad}: {e}");
        }
        let c =
            JobConfig::load(Some("tiny"), None, &["checkpoint.every_seconds=2.5".into()]).unwrap();
        assert_eq!(c.checkpoint.every_seconds, Some(2.5));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bad.toml");
        std::fs::write(&f, "[train]\nbatch_size = \"big\"\n").unwrap();
        let e = JobConfig::load(Some("tiny"), Some(&f), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("bad.toml") && e.contains("train.batch_size"),
            "{e}"
        );
        // Type errors name the key (serde alone says only "expected usize").
        for (set, key) in [
            ("model.dim=\"abc\"", "model.dim"),
            ("train.batch_size=-5", "train.batch_size"),
            ("seed=\"one\"", "seed"),
        ] {
            let e = JobConfig::load(Some("tiny"), None, &[set.into()])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("{key}: ")), "{set}: {e}");
        }
        // A partial file without a preset is told how to layer it.
        let partial = dir.path().join("partial.toml");
        std::fs::write(&partial, "[train]\nbatch_size = 64\n").unwrap();
        let e = JobConfig::load(None, Some(&partial), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing field") && e.contains("--preset tiny"),
            "{e}"
        );
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
            e.contains("\"ecc\"") && e.contains("none, checkpoint, ec, ec+checkpoint"),
            "{e}"
        );
    }

    #[test]
    fn strategy_none_is_its_own_setting_and_unknown_names_are_listed() {
        let c = JobConfig::load(Some("tiny"), None, &["checkpoint.dir=\"/x\"".into()]).unwrap();
        assert_eq!(c.checkpoint.effective_strategy(), Some(Strategy::Full));
        let c = JobConfig::load(
            Some("tiny"),
            None,
            &[
                "checkpoint.dir=\"/x\"".into(),
                "checkpoint.strategy=\"none\"".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.checkpoint.effective_strategy(), None);
        for s in Strategy::ALL {
            let c = JobConfig::load(
                Some("tiny"),
                None,
                &[format!("checkpoint.strategy={:?}", s.name())],
            )
            .unwrap();
            assert_eq!(c.checkpoint.strategy, Some(Some(s)));
            // Round trip through TOML, as presets are layered.
            let back: JobConfig = toml::Value::try_from(&c).unwrap().try_into().unwrap();
            assert_eq!(back.checkpoint.strategy, Some(Some(s)));
        }
        let e = JobConfig::load(
            Some("tiny"),
            None,
            &["checkpoint.strategy=\"delta\"".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("\"delta\"") && e.contains("none, full"), "{e}");
    }

    #[test]
    fn ec_settings_are_checked_against_the_cluster_with_key_names() {
        let base = ["cluster.ft=\"ec\"".to_string()];
        let c = JobConfig::load(
            Some("tiny"),
            None,
            &[base[0].clone(), "cluster.servers=3".into()],
        )
        .unwrap();
        assert_eq!((c.ec.k, c.ec.r, c.ec.groups), (2, 1, 1));
        let e = JobConfig::load(
            Some("tiny"),
            None,
            &[base[0].clone(), "cluster.servers=2".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("cluster.servers = 2") && e.contains("ec.k + ec.r"),
            "{e}"
        );
        let e = JobConfig::load(
            Some("tiny"),
            None,
            &[
                base[0].clone(),
                "cluster.servers=6".into(),
                "ec.groups=2".into(),
                "ec.r=2".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("ec.groups = 2"), "{e}");
        assert_eq!(
            c.ec.rebuild_nice, 0,
            "a renice needs a privilege: off by default"
        );
        assert_eq!(
            c.cluster.worker_nice, 5,
            "workers yield to their host's servers"
        );
        for bad in ["-1", "20"] {
            let e = JobConfig::load(Some("tiny"), None, &[format!("cluster.worker_nice={bad}")])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("cluster.worker_nice = {bad}")) && e.contains("0 to 19"),
                "{e}"
            );
        }
        assert_eq!(c.ec.rebuild_training_share, 0.5);
        let e = JobConfig::load(
            Some("tiny"),
            None,
            &[
                base[0].clone(),
                "cluster.servers=3".into(),
                "ec.rebuild_training_share=1.0".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("ec.rebuild_training_share = 1"), "{e}");
        let e = JobConfig::load(
            Some("tiny"),
            None,
            &[
                base[0].clone(),
                "cluster.servers=3".into(),
                "ec.rebuild_nice=-21".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("ec.rebuild_nice = -21"), "{e}");
        // Without erasure coding the section is not checked.
        JobConfig::load(Some("tiny"), None, &["ec.k=9".into()]).unwrap();
        let e = JobConfig::load(Some("tiny"), None, &["threads=100000".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("threads = 100000") && e.contains("at most 1024"),
            "{e}"
        );
    }
}
