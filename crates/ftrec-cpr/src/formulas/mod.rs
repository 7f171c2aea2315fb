//! The overhead model of cpr.txt §2 and the PLS of §4.1.
//!
//! All times are seconds of the same clock (the emulation study scales production times
//! to its own, §5.1); overheads are returned in seconds and as fractions of `t_total`.
//!
//! * Eq. 1, full recovery: `O = O_save·T/T_save + (O_load + T_save/2 + O_res)·T/T_fail`,
//!   minimised at `T_save,full = sqrt(2·O_save·T_fail)`.
//! * Eq. 2, partial recovery: no lost computation, `O = O_save·T/T_save + (O_load +
//!   O_res)·T/T_fail`.
//! * Eq. 3, PLS: on a failure at sample `S_i`, `PLS += (S_i − S_last_ckpt) / (S_total ·
//!   N_emb)` for the failed embedding server. The paper counts one server per failure; when
//!   `k` servers fail together each loses its own `1/N_emb` share, so the increment is
//!   counted once per failed server (with per-server checkpoints, each with its own
//!   `S_last_ckpt`).
//! * Eq. 4, expected PLS: `E[PLS] = 0.5·T_save / (T_fail·N_emb)`, so `T_save,part =
//!   2·PLS·N_emb·T_fail`. With `k` servers per failure the same derivation gives
//!   `E[PLS] = 0.5·T_save·k / (T_fail·N_emb)` and `T_save,part = 2·PLS·N_emb·T_fail / k`.

use serde::{Deserialize, Serialize};

use crate::CprError;

pub mod prioritized;
pub use prioritized::{PrioritizedCosts, decide_prioritized};

fn positive(name: &str, v: f64) -> Result<f64, CprError> {
    if v > 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(CprError::Invalid(format!("{name} = {v} must be positive")))
    }
}

fn non_negative(name: &str, v: f64) -> Result<f64, CprError> {
    if v >= 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(CprError::Invalid(format!("{name} = {v} must be >= 0")))
    }
}

/// The measured or configured system parameters of Eq. 1 and Eq. 2, in seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostInputs {
    /// Time to save one checkpoint.
    pub o_save: f64,
    /// Time to load a checkpoint after a failure.
    pub o_load: f64,
    /// Time to find and start a replacement node.
    pub o_res: f64,
    /// Mean time between failures.
    pub t_fail: f64,
    /// Failure-free length of the job.
    pub t_total: f64,
}

impl CostInputs {
    pub fn validate(&self) -> Result<(), CprError> {
        non_negative("O_save", self.o_save)?;
        non_negative("O_load", self.o_load)?;
        non_negative("O_res", self.o_res)?;
        positive("T_fail", self.t_fail)?;
        positive("T_total", self.t_total)?;
        Ok(())
    }

    /// Eq. 1 in seconds at checkpoint interval `t_save`.
    pub fn full_overhead(&self, t_save: f64) -> Result<f64, CprError> {
        self.validate()?;
        positive("T_save", t_save)?;
        Ok(self.o_save * self.t_total / t_save
            + (self.o_load + t_save / 2.0 + self.o_res) * self.t_total / self.t_fail)
    }

    /// Eq. 2 in seconds at checkpoint interval `t_save`.
    pub fn partial_overhead(&self, t_save: f64) -> Result<f64, CprError> {
        self.validate()?;
        positive("T_save", t_save)?;
        Ok(self.o_save * self.t_total / t_save
            + (self.o_load + self.o_res) * self.t_total / self.t_fail)
    }

    /// The interval that minimises Eq. 1: `sqrt(2·O_save·T_fail)`.
    pub fn full_optimal_interval(&self) -> Result<f64, CprError> {
        self.validate()?;
        Ok(full_optimal_interval(self.o_save, self.t_fail))
    }
}

/// `T_save,full = sqrt(2·O_save·T_fail)` (the minimiser of Eq. 1).
pub fn full_optimal_interval(o_save: f64, t_fail: f64) -> f64 {
    (2.0 * o_save * t_fail).sqrt()
}

/// Eq. 4 solved for the interval: `2·PLS·N_emb·T_fail / k`, `k` servers lost per failure.
pub fn partial_interval(
    target_pls: f64,
    n_emb: usize,
    servers_per_failure: usize,
    t_fail: f64,
) -> Result<f64, CprError> {
    positive("target PLS", target_pls)?;
    positive("T_fail", t_fail)?;
    let (n, k) = server_counts(n_emb, servers_per_failure)?;
    Ok(2.0 * target_pls * n * t_fail / k)
}

/// Eq. 4: the PLS a run expects at interval `t_save`.
pub fn expected_pls(
    t_save: f64,
    t_fail: f64,
    n_emb: usize,
    servers_per_failure: usize,
) -> Result<f64, CprError> {
    non_negative("T_save", t_save)?;
    positive("T_fail", t_fail)?;
    let (n, k) = server_counts(n_emb, servers_per_failure)?;
    Ok(0.5 * t_save * k / (t_fail * n))
}

fn server_counts(n_emb: usize, k: usize) -> Result<(f64, f64), CprError> {
    if n_emb == 0 || k == 0 || k > n_emb {
        return Err(CprError::Invalid(format!(
            "{k} failed servers of N_emb = {n_emb}: need 1 <= failed <= N_emb"
        )));
    }
    Ok((n_emb as f64, k as f64))
}

/// The running PLS of a job (Eq. 3).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Pls {
    pub value: f64,
    pub s_total: u64,
    pub n_emb: usize,
}

impl Pls {
    pub fn new(s_total: u64, n_emb: usize) -> Result<Self, CprError> {
        if s_total == 0 || n_emb == 0 {
            return Err(CprError::Invalid(format!(
                "PLS needs S_total > 0 and N_emb > 0, got {s_total} and {n_emb}"
            )));
        }
        Ok(Self {
            value: 0.0,
            s_total,
            n_emb,
        })
    }

    /// One embedding server failed at sample `s_i`; its last checkpoint holds the updates
    /// of the first `s_last_ckpt` samples. Returns the increment.
    pub fn on_server_failure(&mut self, s_i: u64, s_last_ckpt: u64) -> Result<f64, CprError> {
        if s_last_ckpt > s_i {
            return Err(CprError::Invalid(format!(
                "the last checkpoint (sample {s_last_ckpt}) is after the failure (sample {s_i})"
            )));
        }
        let inc = (s_i - s_last_ckpt) as f64 / (self.s_total as f64 * self.n_emb as f64);
        self.value += inc;
        Ok(inc)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recovery {
    Full,
    Partial,
}

/// The full-or-partial choice of §4.2 with every input it was made from, for the log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Set when partial recovery saves prioritised rows: what those saves cost, and Eq. 2
    /// was priced with them ([`prioritized::decide_prioritized`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prioritized: Option<PrioritizedCosts>,
    pub recovery: Recovery,
    pub inputs: CostInputs,
    pub target_pls: f64,
    pub n_emb: usize,
    pub servers_per_failure: usize,
    /// Partial recovery is chosen only when it saves at least this share of Eq. 1.
    pub min_benefit: f64,
    pub t_save_full: f64,
    pub t_save_partial: f64,
    /// Eq. 1 at `t_save_full`, seconds.
    pub overhead_full: f64,
    /// Eq. 2 at `t_save_partial`, seconds.
    pub overhead_partial: f64,
}

impl Decision {
    /// `1 − Eq.2 / Eq.1`: the share of full recovery's overhead partial recovery saves.
    pub fn benefit(&self) -> f64 {
        if self.overhead_full > 0.0 {
            1.0 - self.overhead_partial / self.overhead_full
        } else {
            0.0
        }
    }
}

impl std::fmt::Display for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = &self.inputs;
        write!(
            f,
            "{:?} recovery: Eq.1 {:.4}s at T_save,full {:.4}s vs Eq.2 {:.4}s at T_save,part {:.4}s \
             (benefit {:.1}%, needed {:.1}%; O_save {:.4}s O_load {:.4}s O_res {:.4}s T_fail {:.2}s \
             T_total {:.2}s, target PLS {}, {} of N_emb {} per failure)",
            self.recovery,
            self.overhead_full,
            self.t_save_full,
            self.overhead_partial,
            self.t_save_partial,
            100.0 * self.benefit(),
            100.0 * self.min_benefit,
            i.o_save,
            i.o_load,
            i.o_res,
            i.t_fail,
            i.t_total,
            self.target_pls,
            self.servers_per_failure,
            self.n_emb
        )?;
        if let Some(p) = &self.prioritized {
            write!(f, "; {p}")?;
        }
        Ok(())
    }
}

/// Compares Eq. 1 at the optimal full interval with Eq. 2 at the interval the target PLS
/// gives, and falls back to full recovery unless partial saves at least `min_benefit` of
/// the overhead (partial recovery costs accuracy, so a marginal gain is not worth it).
pub fn decide(
    inputs: CostInputs,
    target_pls: f64,
    n_emb: usize,
    servers_per_failure: usize,
    min_benefit: f64,
) -> Result<Decision, CprError> {
    decide_with(
        inputs,
        target_pls,
        n_emb,
        servers_per_failure,
        min_benefit,
        None,
    )
}

/// Eq. 1 at its optimum against Eq. 2 at the interval of the target PLS, plain or (with
/// `prioritized`) priced with prioritised saves.
fn decide_with(
    inputs: CostInputs,
    target_pls: f64,
    n_emb: usize,
    servers_per_failure: usize,
    min_benefit: f64,
    prioritized: Option<PrioritizedCosts>,
) -> Result<Decision, CprError> {
    inputs.validate()?;
    check_min_benefit(min_benefit)?;
    let (t_save_full, overhead_full) = full_overhead_at_optimum(&inputs)?;
    let t_save_partial = partial_interval(target_pls, n_emb, servers_per_failure, inputs.t_fail)?;
    let overhead_partial = match &prioritized {
        Some(costs) => inputs.prioritized_overhead(t_save_partial, costs)?,
        None => inputs.partial_overhead(t_save_partial)?,
    };
    Ok(choose(Decision {
        prioritized,
        recovery: Recovery::Full,
        inputs,
        target_pls,
        n_emb,
        servers_per_failure,
        min_benefit,
        t_save_full,
        t_save_partial,
        overhead_full,
        overhead_partial,
    }))
}

/// Partial recovery when it is cheaper and saves at least `min_benefit` of Eq. 1.
fn choose(mut d: Decision) -> Decision {
    d.recovery = if d.overhead_partial < d.overhead_full && d.benefit() >= d.min_benefit {
        Recovery::Partial
    } else {
        Recovery::Full
    };
    d
}

/// Eq. 1 at its optimal interval (continuous checkpointing when `O_save` is 0).
fn full_overhead_at_optimum(inputs: &CostInputs) -> Result<(f64, f64), CprError> {
    let t_save_full = inputs.full_optimal_interval()?;
    let overhead = if t_save_full > 0.0 {
        inputs.full_overhead(t_save_full)?
    } else {
        (inputs.o_load + inputs.o_res) * inputs.t_total / inputs.t_fail
    };
    Ok((t_save_full, overhead))
}

fn check_min_benefit(min_benefit: f64) -> Result<(), CprError> {
    if (0.0..1.0).contains(&min_benefit) {
        Ok(())
    } else {
        Err(CprError::Invalid(format!(
            "min_benefit = {min_benefit} must be in [0, 1)"
        )))
    }
}

#[cfg(test)]
mod tests;
