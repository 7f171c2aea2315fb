//! The checkpoint strategies and their complete configurations.

use serde::{Deserialize, Serialize};

use crate::CkptError;
use crate::deck::DeckOptions;
use crate::incrcp;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Every checkpoint is full.
    Full,
    /// Rows changed since the last full baseline (Check-N-Run).
    Differential,
    /// Rows changed since the previous checkpoint; restore replays the chain.
    NaiveIncremental,
    /// Rows changed since the previous checkpoint, in IncrCP's 2-D chunk list: written in
    /// the background, restored from one rectangle, baseline reset when cheaper.
    Incrcp,
    /// DECK: deltas staged through local disk in the background, merged hierarchically,
    /// a new full checkpoint every N deltas or when the live deltas grow too large.
    Deck,
}

impl Strategy {
    pub const ALL: [Self; 5] = [
        Self::Full,
        Self::Differential,
        Self::NaiveIncremental,
        Self::Incrcp,
        Self::Deck,
    ];

    /// The name used in configuration files, on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Differential => "differential",
            Self::NaiveIncremental => "naive-incremental",
            Self::Incrcp => "incrcp",
            Self::Deck => "deck",
        }
    }

    /// `checkpoint.full_every` when the user sets none: IncrCP decides its baseline
    /// resets from measured costs, so it has no fixed cap.
    pub fn default_full_every(self) -> u64 {
        match self {
            Strategy::Incrcp | Strategy::Deck => 0,
            _ => 10,
        }
    }
}

/// A complete checkpoint strategy: each variant carries exactly what its strategy needs,
/// so no value names a strategy with another one's options, or misses its own. Built and
/// validated once ([`StrategyConfig::new`], from `[checkpoint]` by `ftrec-config`).
#[derive(Clone, Debug, PartialEq)]
pub enum StrategyConfig {
    /// Every checkpoint is full.
    Full,
    /// Rows changed since the last full baseline; a new baseline every `full_every`
    /// checkpoints (0: only the first).
    Differential { full_every: u64 },
    /// Rows changed since the previous checkpoint; a full one every `full_every` (0: only
    /// the first).
    NaiveIncremental { full_every: u64 },
    /// IncrCP: `full_every` caps the chain (0: the cost model alone resets it); an
    /// extraction round must move at least `threshold` of a column's rows.
    Incrcp {
        full_every: u64,
        threshold: IncrcpThreshold,
    },
    /// DECK, with its own full interval and staging options.
    Deck(DeckOptions),
}

/// IncrCP's extraction threshold R, within 0..=1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IncrcpThreshold(f64);

impl IncrcpThreshold {
    pub fn new(r: f64) -> Result<Self, CkptError> {
        if !(0.0..=1.0).contains(&r) {
            return Err(CkptError::Invalid(format!(
                "incrcp threshold R = {r}: must be within 0..=1"
            )));
        }
        Ok(Self(r))
    }

    pub fn get(self) -> f64 {
        self.0
    }
}

impl Default for IncrcpThreshold {
    fn default() -> Self {
        Self(incrcp::DEFAULT_THRESHOLD)
    }
}

impl StrategyConfig {
    /// The strategy `strategy` with the options a configuration gives every strategy; each
    /// takes the ones it uses, and those are checked here.
    pub fn new(
        strategy: Strategy,
        full_every: u64,
        incrcp_threshold: f64,
        deck: DeckOptions,
    ) -> Result<Self, CkptError> {
        Ok(match strategy {
            Strategy::Full => Self::Full,
            Strategy::Differential => Self::Differential { full_every },
            Strategy::NaiveIncremental => Self::NaiveIncremental { full_every },
            Strategy::Incrcp => Self::Incrcp {
                full_every,
                threshold: IncrcpThreshold::new(incrcp_threshold)?,
            },
            Strategy::Deck => {
                deck.validate()?;
                Self::Deck(deck)
            }
        })
    }

    pub fn strategy(&self) -> Strategy {
        match self {
            Self::Full => Strategy::Full,
            Self::Differential { .. } => Strategy::Differential,
            Self::NaiveIncremental { .. } => Strategy::NaiveIncremental,
            Self::Incrcp { .. } => Strategy::Incrcp,
            Self::Deck(_) => Strategy::Deck,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_strategy_gets_exactly_its_own_options_checked_once() {
        let deck = DeckOptions::default();
        for strategy in Strategy::ALL {
            let config = StrategyConfig::new(strategy, 4, 0.5, deck.clone()).unwrap();
            assert_eq!(config.strategy(), strategy);
        }
        assert_eq!(
            StrategyConfig::new(Strategy::Differential, 4, 2.0, deck.clone()).unwrap(),
            StrategyConfig::Differential { full_every: 4 },
            "the threshold is IncrCP's alone"
        );
        let e = StrategyConfig::new(Strategy::Incrcp, 0, 1.5, deck.clone()).unwrap_err();
        assert!(e.to_string().contains("R = 1.5"), "{e}");
        let bad_deck = DeckOptions {
            stride: 1,
            ..DeckOptions::default()
        };
        let e = StrategyConfig::new(Strategy::Deck, 0, 0.5, bad_deck.clone()).unwrap_err();
        assert!(e.to_string().contains("stride 1"), "{e}");
        // A bad DECK option does not concern the other strategies.
        assert!(StrategyConfig::new(Strategy::Full, 0, 0.5, bad_deck).is_ok());
    }
}
