//! The cost frame: what a checkpoint, a reload and a reschedule cost in the emulated job,
//! and how emulated seconds map to training steps.
//!
//! §5.1 projects production overheads onto the emulation by scaling them linearly with
//! the job length. Here every time is in seconds of one frame whose job length `T_total`
//! is `--job-seconds` when given, else this process's measured failure-free epoch. When
//! `O_save`/`O_load` are not given, they are measured and scaled by `T_total / measured
//! epoch` into the frame:
//! - with a storage directory (`bench cpr`'s default): a real full checkpoint of the whole
//!   model written through the checkpoint engine (chunk files fsynced, manifest renamed
//!   into place), and its restore from a cold page cache, medians of 3;
//! - without one: an in-memory copy of the whole model into a preallocated snapshot, the
//!   cheapest checkpoint there is (no serialisation, no disk), which flatters every
//!   strategy that saves often.
//!
//! A checkpoint of `B` bytes costs a fixed part, whatever its size (its files opened,
//! fsynced and renamed, the manifest), plus `(O_save - fixed) · B / model bytes` (the
//! store's bandwidth); a reload likewise. The fixed part is measured with a checkpoint of
//! the same tables at two rows each, less that checkpoint's bytes at the full one's rate:
//! prioritised saves are many and small, and a cost linear in bytes alone priced 40 of
//! them below what they cost (issue 45). Each run also reports its overhead priced the
//! old way, by bytes alone, so the reduction can be read both ways.
//!
//! `O_res`, the reschedule of a failed process, is measured as a process of this binary
//! started and waited for, median of 5, unless given: a lower bound of a real restart
//! (no scheduler, no image pull), and no longer 0.

use std::path::{Path, PathBuf};
use std::time::Instant;

use ftrec_cpr::{CostInputs, Decision};
use ftrec_model::ModelState;
use serde::Serialize;

use super::{StudyConfig, failures};
use crate::ckpt::median;
use ftrec_train::TrainError;

/// Times the user gives instead of measured ones, in seconds of the job frame.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CostOverrides {
    pub o_save: Option<f64>,
    pub o_load: Option<f64>,
    /// A save's and a load's fixed part; unset: measured beside `O_save` and `O_load`
    /// where those are measured, else 0.
    pub o_save_fixed: Option<f64>,
    pub o_load_fixed: Option<f64>,
    /// Unset: measured (a process of this binary started).
    pub o_res: Option<f64>,
    /// Length of the emulated job; unset: the measured failure-free epoch.
    pub job_seconds: Option<f64>,
    /// Where real checkpoints are written to time `O_save` and `O_load` (removed after);
    /// unset: the in-memory copy stands in for both.
    pub storage_dir: Option<PathBuf>,
}

impl CostOverrides {
    pub fn validate(&self) -> Result<(), TrainError> {
        let check = |name: &str, v: Option<f64>, zero_ok: bool| match v {
            Some(v) if !(v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0))) => Err(
                TrainError::Config(format!("{name} = {v} must be a positive number of seconds")),
            ),
            _ => Ok(()),
        };
        check("--o-save", self.o_save, true)?;
        check("--o-load", self.o_load, true)?;
        check("--o-res", self.o_res, true)?;
        check("--o-save-fixed", self.o_save_fixed, true)?;
        check("--o-load-fixed", self.o_load_fixed, true)?;
        for (fixed, whole, name) in [
            (self.o_save_fixed, self.o_save, "--o-save"),
            (self.o_load_fixed, self.o_load, "--o-load"),
        ] {
            if let (Some(fixed), Some(whole)) = (fixed, whole)
                && fixed > whole
            {
                return Err(TrainError::Config(format!(
                    "{name}-fixed = {fixed} exceeds {name} = {whole}: the fixed part is part of a whole-model checkpoint's cost"
                )));
            }
        }
        check("--job-seconds", self.job_seconds, false)
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct CostFrame {
    /// Failure-free job length, T_total.
    pub t_total: f64,
    /// Mean time between failures, T_fail (`cpr.mtbf_seconds`, else T_total / failures).
    pub t_fail: f64,
    /// One checkpoint of the whole model.
    pub o_save: f64,
    /// One reload of the whole model.
    pub o_load: f64,
    /// The fixed part of every save and every load, whatever its size.
    pub o_save_fixed: f64,
    pub o_load_fixed: f64,
    pub o_res: f64,
    pub o_save_measured: bool,
    pub o_load_measured: bool,
    pub o_res_measured: bool,
    /// The measured restart (a process of this binary started and waited for), seconds of
    /// wall time, median of 5.
    pub measured_restart_seconds: Option<f64>,
    /// What the measured `O_save`/`O_load` time: `"local-disk checkpoint"` or
    /// `"in-memory copy"`.
    pub measured_by: String,
    /// Median real full-checkpoint write and cold restore, seconds of wall time (with a
    /// storage directory).
    pub measured_save_seconds: Option<f64>,
    pub measured_load_seconds: Option<f64>,
    pub model_bytes: u64,
    /// Embedding rows with their optimizer state (what partial recovery saves).
    pub table_bytes: u64,
    pub total_steps: u64,
    pub step_seconds: f64,
    /// The failure-free epoch as measured here, seconds of wall time.
    pub measured_train_seconds: f64,
    /// Median in-memory copy of the whole model, seconds of wall time.
    pub measured_copy_seconds: f64,
    /// Frame seconds per wall second (`T_total / measured epoch`).
    pub scale: f64,
}

impl CostFrame {
    pub fn measure(
        config: &StudyConfig,
        total_steps: u64,
        measured_train_seconds: f64,
    ) -> Result<Self, TrainError> {
        let mc = config.job.model_config()?;
        let src = ModelState::new(&mc, config.job.seed)?;
        let mut dst = ModelState::zeroed(&mc)?;
        let times: Vec<f64> = (0..5)
            .map(|_| {
                let t = Instant::now();
                copy_state(&mut dst, &src, true);
                t.elapsed().as_secs_f64()
            })
            .collect();
        let copy = median(&times);
        let o = &config.costs;
        let model_bytes = src.bytes() as u64;
        let measure_costs = o.o_save.is_none() || o.o_load.is_none();
        let real = match &o.storage_dir {
            Some(dir) if measure_costs => Some(time_real_checkpoints(&src, dir)?),
            _ => None,
        };
        let (save, load) = real.unwrap_or((copy, copy));
        let (save_fixed, load_fixed) = if measure_costs {
            // The same tables at two rows each: what a save costs beyond its bytes.
            let small_config = small_config(&mc);
            let small = ModelState::new(&small_config, config.job.seed)?;
            let small_share = small.bytes() as f64 / model_bytes.max(1) as f64;
            let fixed_part = |small: f64, whole: f64| (small - whole * small_share).max(0.0);
            match (&o.storage_dir, real) {
                (Some(dir), Some(_)) => {
                    let (s, l) = time_real_checkpoints(&small, dir)?;
                    (fixed_part(s, save), fixed_part(l, load))
                }
                _ => {
                    let mut into = ModelState::zeroed(&small_config)?;
                    let t = Instant::now();
                    copy_state(&mut into, &small, true);
                    let f = fixed_part(t.elapsed().as_secs_f64(), copy);
                    (f, f)
                }
            }
        } else {
            (0.0, 0.0)
        };
        let restart = match o.o_res {
            Some(_) => None,
            None => Some(time_restart()?),
        };
        let t_total = o.job_seconds.unwrap_or(measured_train_seconds).max(1e-9);
        let scale = t_total / measured_train_seconds.max(1e-9);
        let table_bytes: u64 = src.tables().iter().map(|t| t.as_bytes().len() as u64).sum();
        Ok(Self {
            t_total,
            t_fail: config
                .job
                .cpr
                .mtbf_seconds
                .unwrap_or(t_total / config.failures.max(1) as f64),
            o_save: o.o_save.unwrap_or(save * scale),
            o_load: o.o_load.unwrap_or(load * scale),
            o_save_fixed: o.o_save_fixed.unwrap_or(save_fixed * scale),
            o_load_fixed: o.o_load_fixed.unwrap_or(load_fixed * scale),
            o_res: o.o_res.unwrap_or(restart.unwrap_or(0.0) * scale),
            o_save_measured: o.o_save.is_none(),
            o_load_measured: o.o_load.is_none(),
            o_res_measured: o.o_res.is_none(),
            measured_restart_seconds: restart,
            measured_by: match real {
                Some(_) => "local-disk checkpoint",
                None => "in-memory copy",
            }
            .into(),
            measured_save_seconds: real.map(|r| r.0),
            measured_load_seconds: real.map(|r| r.1),
            model_bytes,
            table_bytes,
            total_steps,
            step_seconds: t_total / total_steps.max(1) as f64,
            measured_train_seconds,
            measured_copy_seconds: copy,
            scale,
        })
    }

    /// An interval of `seconds` in steps, at least 1.
    pub fn steps(&self, seconds: f64) -> u64 {
        ((seconds / self.step_seconds).round() as u64).max(1)
    }

    /// A save of `bytes`: its fixed part plus its bytes at the store's rate (nothing for
    /// nothing written).
    pub fn save_cost(&self, bytes: u64) -> f64 {
        sized(self.o_save, self.o_save_fixed, bytes, self.model_bytes)
    }

    pub fn load_cost(&self, bytes: u64) -> f64 {
        sized(self.o_load, self.o_load_fixed, bytes, self.model_bytes)
    }

    /// The same save priced by its bytes alone (the accounting before issue 45).
    pub fn save_cost_bytes_only(&self, bytes: u64) -> f64 {
        sized(self.o_save, 0.0, bytes, self.model_bytes)
    }

    pub fn load_cost_bytes_only(&self, bytes: u64) -> f64 {
        sized(self.o_load, 0.0, bytes, self.model_bytes)
    }

    /// Eq. 1 / Eq. 2 inputs with a checkpoint costing `o_save`.
    pub fn inputs(&self, o_save: f64, o_load: f64) -> CostInputs {
        CostInputs {
            o_save,
            o_load,
            o_res: self.o_res,
            t_fail: self.t_fail,
            t_total: self.t_total,
        }
    }

    /// The full-or-partial decision (§4.2) at a failure fraction, with whole-model save
    /// and load costs on both sides (the conservative reading for partial recovery).
    pub fn decision(&self, config: &StudyConfig, fraction: f64) -> Result<Decision, TrainError> {
        let k = failures::servers_lost(fraction, config.servers);
        ftrec_cpr::formulas::decide(
            self.inputs(self.o_save, self.o_load),
            config.job.cpr.target_pls,
            config.servers,
            k,
            config.min_benefit,
        )
        .map_err(|e| TrainError::Config(e.to_string()))
    }
}

/// `whole` for the whole model's `model_bytes`, of which `fixed` is paid by any nonempty
/// transfer.
fn sized(whole: f64, fixed: f64, bytes: u64, model_bytes: u64) -> f64 {
    if bytes == 0 {
        return 0.0;
    }
    let fixed = fixed.min(whole);
    fixed + (whole - fixed) * bytes as f64 / model_bytes.max(1) as f64
}

fn small_config(mc: &ftrec_model::ModelConfig) -> ftrec_model::ModelConfig {
    let mut c = mc.clone();
    // Two rows: the smallest table there is (row 0 is the missing id's).
    c.table_rows = vec![2; c.table_rows.len()];
    c
}

/// A process of this binary started and waited for (`--version`), median of 5, seconds.
fn time_restart() -> Result<f64, TrainError> {
    let exe = std::env::current_exe()
        .map_err(|e| TrainError::Config(format!("timing a restart: this binary: {e}")))?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let status = std::process::Command::new(&exe)
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .map_err(|e| TrainError::Config(format!("timing a restart: {}: {e}", exe.display())))?;
        times.push(t.elapsed().as_secs_f64());
        if !status.success() {
            // A test binary has no `--version`; it still started and exited.
            tracing::debug!("{} --version: {status}", exe.display());
        }
    }
    Ok(median(&times))
}

/// Median seconds of a real full checkpoint of `state` (write, then cold restore),
/// three times, in scratch under `dir`.
fn time_real_checkpoints(state: &ModelState, dir: &Path) -> Result<(f64, f64), TrainError> {
    let t = ftrec_ckpt::timing::time_full_checkpoint(state, dir, 3)?;
    Ok((t.save_seconds, t.load_seconds))
}

/// Copies every table (and, with `dense`, the dense parameters, their optimizer state and
/// step) of `src` into `dst` without allocating.
pub fn copy_state(dst: &mut ModelState, src: &ModelState, dense: bool) {
    for (d, s) in dst.tables_mut().iter_mut().zip(src.tables()) {
        d.as_mut_slice().copy_from_slice(s.as_slice());
    }
    if dense {
        dst.dense.params.copy_from_slice(&src.dense.params);
        dst.dense
            .optimizer_state
            .copy_from_slice(&src.dense.optimizer_state);
        dst.dense.step = src.dense.step;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transfer_pays_its_fixed_part_and_its_share_of_the_rest() {
        // 1 s for the whole 100-byte model, 0.1 s of it fixed.
        assert_eq!(
            sized(1.0, 0.1, 0, 100),
            0.0,
            "nothing written costs nothing"
        );
        assert!(
            (sized(1.0, 0.1, 100, 100) - 1.0).abs() < 1e-12,
            "the whole model: O_save"
        );
        assert!((sized(1.0, 0.1, 10, 100) - (0.1 + 0.09)).abs() < 1e-12);
        // Bytes alone: a tenth of the model, a tenth of the time.
        assert!((sized(1.0, 0.0, 10, 100) - 0.1).abs() < 1e-12);
        // A fixed part larger than the whole (given by hand) is capped at the whole.
        assert!((sized(1.0, 5.0, 10, 100) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn a_fixed_part_above_its_whole_is_refused_by_name() {
        let costs = CostOverrides {
            o_save: Some(0.5),
            o_save_fixed: Some(0.6),
            ..Default::default()
        };
        let e = costs.validate().unwrap_err().to_string();
        assert!(
            e.contains("--o-save-fixed = 0.6 exceeds --o-save = 0.5"),
            "{e}"
        );
        let negative = CostOverrides {
            o_res: Some(-1.0),
            ..Default::default()
        };
        assert!(
            negative
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--o-res")
        );
    }
}
