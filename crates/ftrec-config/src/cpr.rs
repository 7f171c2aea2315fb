//! The `[cpr]` section: CPR partial recovery (cpr.txt §4), read by `ftrec bench cpr` and,
//! later, by the cluster's `--ft partial`.

use serde::{Deserialize, Serialize};

use crate::ConfigError;
/// The priority kinds are CPR's own (`ftrec-cpr`); the section only names one.
pub use ftrec_cpr::CprPriority;

/// `[cpr]`: partial recovery with a PLS-driven checkpoint interval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CprSection {
    /// Portion of lost samples the user tolerates (Eq. 4); sets the checkpoint interval.
    #[serde(default = "default_target_pls")]
    pub target_pls: f64,
    /// Mean time between failures, T_fail. Unset: the user of the section derives it
    /// (the emulation study uses its job length over the number of failures).
    #[serde(default)]
    pub mtbf_seconds: Option<f64>,
    #[serde(default)]
    pub priority: CprPriority,
    /// Share of rows a prioritised checkpoint saves, and of the interval it saves at.
    #[serde(default = "default_r")]
    pub r: f64,
    /// CPR-SSU records the accesses of every `ssu_period`-th sample.
    #[serde(default = "default_ssu_period")]
    pub ssu_period: u32,
    /// Tables prioritised saving applies to; unset: the largest tables that hold 99% of
    /// the rows. The others are saved in full.
    #[serde(default)]
    pub tables: Option<Vec<usize>>,
    /// Uncoordinated per-server saves (`cluster.ft = "partial"`): each server saves its
    /// own shard on its own schedule, server `j` offset by `j/N` of the interval, and no
    /// cut spans the servers. Partial recovery needs no consistent global state, so a save
    /// is taken as the shard stands while training goes on: it holds up only the pushes
    /// to that shard, for the copy, where a cut drains every server's pipeline.
    #[serde(default)]
    pub uncoordinated: bool,
}

fn default_target_pls() -> f64 {
    0.1
}
fn default_r() -> f64 {
    0.125
}
fn default_ssu_period() -> u32 {
    2
}

impl Default for CprSection {
    fn default() -> Self {
        Self {
            target_pls: default_target_pls(),
            mtbf_seconds: None,
            priority: CprPriority::None,
            r: default_r(),
            ssu_period: default_ssu_period(),
            tables: None,
            uncoordinated: false,
        }
    }
}

impl CprSection {
    /// Checks the section against a model with `tables` embedding tables.
    pub fn validate(&self, tables: usize) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if !(self.target_pls > 0.0 && self.target_pls.is_finite()) {
            return bad(format!(
                "cpr.target_pls = {} must be a positive number",
                self.target_pls
            ));
        }
        if let Some(m) = self.mtbf_seconds
            && !(m > 0.0 && m.is_finite())
        {
            return bad(format!("cpr.mtbf_seconds = {m} must be positive"));
        }
        if !(self.r > 0.0 && self.r <= 1.0) {
            return bad(format!("cpr.r = {} must be in (0, 1]", self.r));
        }
        if self.ssu_period == 0 {
            return bad("cpr.ssu_period must be at least 1".into());
        }
        if let Some(list) = &self.tables {
            if let Some(t) = list.iter().find(|&&t| t >= tables) {
                return bad(format!(
                    "cpr.tables names table {t} but the model has {tables} tables (0..{})",
                    tables.saturating_sub(1)
                ));
            }
            let mut sorted = list.clone();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return bad(format!("cpr.tables names table {} twice", w[0]));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JobConfig;

    fn load(sets: &[&str]) -> Result<JobConfig, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        JobConfig::load(Some("tiny"), None, &sets)
    }

    #[test]
    fn defaults_and_overrides() {
        let c = load(&[]).unwrap();
        assert_eq!(c.cpr, CprSection::default());
        assert_eq!((c.cpr.r, c.cpr.ssu_period), (0.125, 2));
        let c = load(&[
            "cpr.r=0.25",
            "cpr.priority=\"ssu\"",
            "cpr.tables=[0, 3]",
            "cpr.mtbf_seconds=3600",
        ])
        .unwrap();
        assert_eq!(c.cpr.r, 0.25);
        assert_eq!(c.cpr.priority, CprPriority::Ssu);
        assert_eq!(c.cpr.tables, Some(vec![0, 3]));
        assert_eq!(c.cpr.mtbf_seconds, Some(3600.0));
    }

    #[test]
    fn errors_name_the_key() {
        for (set, key) in [
            ("cpr.r=0", "cpr.r"),
            ("cpr.r=1.5", "cpr.r"),
            ("cpr.target_pls=-1", "cpr.target_pls"),
            ("cpr.ssu_period=0", "cpr.ssu_period"),
            ("cpr.mtbf_seconds=0", "cpr.mtbf_seconds"),
            ("cpr.tables=[26]", "cpr.tables"),
            ("cpr.tables=[1, 1]", "cpr.tables"),
            ("cpr.priority=\"lru\"", "lru"),
            ("cpr.rr=1", "rr"),
        ] {
            let e = load(&[set]).unwrap_err().to_string();
            assert!(e.contains(key), "{set}: {e}");
        }
    }
}
