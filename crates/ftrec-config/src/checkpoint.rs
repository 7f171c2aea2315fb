//! The `[checkpoint]` section: which strategy, where, how often, and the checkpointer it
//! builds (the trainer's, and every cluster server's over its shard).

use std::path::PathBuf;

use ftrec_ckpt::{Strategy, StrategyConfig};
use serde::{Deserialize, Serialize};

use crate::ConfigError;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Unset: `full` when a directory is given. `Some(None)`: the file said `"none"`, no
    /// checkpoints even with a directory (it may still be resumed from).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "strategy_setting"
    )]
    pub strategy: Option<Option<Strategy>>,
    /// Take a checkpoint every this many steps (0 = only at the end of training).
    #[serde(default)]
    pub every_steps: u64,
    /// Cluster: take a consistent cut this many seconds of wall time after the last one
    /// committed (or training started), instead of every `every_steps` steps. A failure
    /// costs wall time, so a Young/Daly interval is a time (`cluster run --ft auto` sets it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_seconds: Option<f64>,
    /// Cluster: the MTBF `every_seconds` was planned for. Set, the coordinator re-plans the
    /// interval at each failure from the MTBF it measures and the cut pause it measured
    /// (`cluster run --ft auto` sets it when it chooses checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planned_mtbf_seconds: Option<f64>,
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
    /// `none` (f32, exact), `int8` or `int4`: embedding rows stored row-wise quantized
    /// with an fp16 scale and bias per row, as FBGEMM's fused row-wise formats, in every
    /// strategy's checkpoints. Lossy: a restore is close to the state saved, not equal.
    #[serde(default, skip_serializing_if = "is_default")]
    pub quantize: ftrec_ckpt::QuantKind,
    /// With `quantize`: quantize the optimizer state too (in segments of `model.dim`
    /// values, each with its own scale and bias); else it stays f32.
    #[serde(default, skip_serializing_if = "is_default")]
    pub quantize_optimizer: bool,
}

fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
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
            every_seconds: None,
            planned_mtbf_seconds: None,
            dir: None,
            full_every: None,
            incrcp_threshold: default_incrcp_threshold(),
            deck: Default::default(),
            new_branch: false,
            keep: default_keep(),
            quantize: Default::default(),
            quantize_optimizer: false,
        }
    }
}

/// Parses a strategy name as the configuration spells it: `none` or one of
/// [`Strategy::ALL`].
pub fn parse_strategy(name: &str) -> Result<Option<Strategy>, String> {
    if name == "none" {
        return Ok(None);
    }
    Strategy::ALL
        .into_iter()
        .find(|s| s.name() == name)
        .map(Some)
        .ok_or_else(|| {
            let names: Vec<&str> = Strategy::ALL.iter().map(|s| s.name()).collect();
            format!(
                "unknown checkpoint strategy {name:?}: one of none, {}",
                names.join(", ")
            )
        })
}

/// `checkpoint.strategy` as a name, where `"none"` is a setting of its own.
mod strategy_setting {
    use ftrec_ckpt::Strategy;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(
        value: &Option<Option<Strategy>>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(value.flatten().map_or("none", Strategy::name))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Option<Strategy>>, D::Error> {
        let name = String::deserialize(deserializer)?;
        super::parse_strategy(&name)
            .map(Some)
            .map_err(serde::de::Error::custom)
    }
}

impl CheckpointSection {
    /// How checkpoints store rows (`dim` is filled in from the model as each is written).
    pub fn quant(&self) -> ftrec_ckpt::Quant {
        ftrec_ckpt::Quant {
            kind: self.quantize,
            optimizer: self.quantize_optimizer,
            dim: 0,
        }
    }
}

impl CheckpointSection {
    /// The strategy in effect: none without a directory, full by default with one.
    pub fn effective_strategy(&self) -> Option<Strategy> {
        match (self.strategy, &self.dir) {
            (_, None) => None,
            (None, Some(_)) => Some(Strategy::Full),
            (Some(s), Some(_)) => s,
        }
    }

    /// Whether the section names a strategy other than `none`.
    pub fn names_a_strategy(&self) -> bool {
        self.strategy.flatten().is_some()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.quantize_optimizer && self.quantize == ftrec_ckpt::QuantKind::None {
            return Err(ConfigError::Invalid(
                "checkpoint.quantize_optimizer = true needs checkpoint.quantize = \"int8\" or \
                 \"int4\""
                    .into(),
            ));
        }
        self.deck
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("checkpoint.deck: {e}")))?;
        let r = self.incrcp_threshold;
        if !(0.0..=1.0).contains(&r) {
            return Err(ConfigError::Invalid(format!(
                "checkpoint.incrcp_threshold = {r}: must be within 0..=1"
            )));
        }
        if let Some(seconds) = self.every_seconds
            && !(seconds > 0.0 && seconds.is_finite())
        {
            return Err(ConfigError::Invalid(format!(
                "checkpoint.every_seconds = {seconds}: must be a positive number of seconds"
            )));
        }
        if let Some(mtbf) = self.planned_mtbf_seconds {
            if !(mtbf > 0.0 && mtbf.is_finite()) {
                return Err(ConfigError::Invalid(format!(
                    "checkpoint.planned_mtbf_seconds = {mtbf}: must be a positive number of seconds"
                )));
            }
            if self.every_seconds.is_none() {
                return Err(ConfigError::Invalid(
                    "checkpoint.planned_mtbf_seconds re-plans checkpoint.every_seconds: set that too"
                        .into(),
                ));
            }
        }
        self.strategy_config()?;
        Ok(())
    }

    /// The strategy this section asks for, complete and checked (`None`: no checkpoints).
    pub fn strategy_config(&self) -> Result<Option<StrategyConfig>, ConfigError> {
        let Some(strategy) = self.effective_strategy() else {
            return Ok(None);
        };
        let full_every = self
            .full_every
            .unwrap_or_else(|| strategy.default_full_every());
        StrategyConfig::new(
            strategy,
            full_every,
            self.incrcp_threshold,
            self.deck.clone(),
        )
        .map(Some)
        .map_err(|e| ConfigError::Invalid(format!("checkpoint: {e}")))
    }
}
