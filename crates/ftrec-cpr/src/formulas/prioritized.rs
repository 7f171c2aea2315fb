//! Eq. 2 for prioritised partial checkpoints (CPR-MFU, -SSU, -SCAR, cpr.txt §4.2).
//!
//! The paper decides full against partial recovery with Eq. 2 alone, which prices every
//! save as a whole-table save every `T_save`. A prioritised strategy saves differently: at
//! most `r·N` rows of the prioritised tables every `r·T_save`, and only rows touched since
//! their last save, so with frequent saves a save writes far less than `r` of a table. It
//! also pays on every step to record accesses, and at every save to choose the rows. Our
//! `bench cpr --sensitivity` runs showed the gap: CPR-SSU was 2-6x cheaper than full
//! recovery in 8 of 9 setups where Eq. 2 chose full. So the prioritised decision prices a
//! save as measured for that strategy:
//!
//! `O_prio = O_save,prio · T/max(r·T_save, T_step) + s_track · T + (O_load + O_res) · T/T_fail`
//!
//! where `O_save,prio` is one prioritised save's pause (writing the chosen rows and every
//! row of unprioritised tables, plus choosing them) and `s_track` the share of training
//! time spent recording accesses. `T_step` is the shortest interval saves can have (one
//! step): with many failures, Eq. 4 asks for saves more often than that.

use serde::{Deserialize, Serialize};

use super::{CostInputs, Decision, non_negative, positive};
use crate::CprError;

/// What one prioritised strategy's saves cost, measured by its caller.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrioritizedCosts {
    /// Saves come every `r·T_save`, each at most `r` of a prioritised table.
    pub r: f64,
    /// Pause of one save every `r·T_save`: writing what it saves and choosing it, seconds.
    pub o_save: f64,
    /// Time recording accesses, as a share of the training time (0 = free).
    pub tracking_share: f64,
    /// Saves come no closer than this, seconds: a system saves between steps, so at most
    /// once a step however short `r·T_save` is (0 = no limit).
    pub min_save_interval: f64,
}

impl PrioritizedCosts {
    pub fn validate(&self) -> Result<(), CprError> {
        if !(self.r > 0.0 && self.r <= 1.0) {
            return Err(CprError::Invalid(format!(
                "r = {} must be in (0, 1]",
                self.r
            )));
        }
        non_negative("prioritised O_save", self.o_save)?;
        non_negative("tracking share", self.tracking_share)?;
        non_negative("minimum save interval", self.min_save_interval)?;
        Ok(())
    }
}

impl std::fmt::Display for PrioritizedCosts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "prioritised saves of {:.4}s every r = {} of T_save,part, tracking {:.2}% of training",
            self.o_save,
            self.r,
            100.0 * self.tracking_share
        )
    }
}

impl CostInputs {
    /// Eq. 2 with prioritised saves, seconds, at the partial interval `t_save` (saves come
    /// every `r·t_save`).
    pub fn prioritized_overhead(
        &self,
        t_save: f64,
        costs: &PrioritizedCosts,
    ) -> Result<f64, CprError> {
        self.validate()?;
        costs.validate()?;
        positive("T_save", t_save)?;
        let every = (costs.r * t_save).max(costs.min_save_interval);
        Ok(costs.o_save * self.t_total / every
            + costs.tracking_share * self.t_total
            + (self.o_load + self.o_res) * self.t_total / self.t_fail)
    }
}

/// [`super::decide`] for a prioritised strategy: Eq. 1 at its optimum against the
/// prioritised Eq. 2 at the interval of the target PLS.
pub fn decide_prioritized(
    inputs: CostInputs,
    target_pls: f64,
    n_emb: usize,
    servers_per_failure: usize,
    min_benefit: f64,
    costs: PrioritizedCosts,
) -> Result<Decision, CprError> {
    super::decide_with(
        inputs,
        target_pls,
        n_emb,
        servers_per_failure,
        min_benefit,
        Some(costs),
    )
}
