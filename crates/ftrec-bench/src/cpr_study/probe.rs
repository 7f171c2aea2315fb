//! What one prioritised save costs, measured before the runs so CPR's decision can price
//! it ([`ftrec_cpr::formulas::decide_prioritized`]).
//!
//! The probe feeds the training data's ids, window by window, through the strategy's own
//! trackers, as a run would between two saves, and at each window's end chooses the rows
//! to save. It times recording and choosing, and counts the rows chosen: a prioritised
//! save writes those, plus every row of the tables that are not prioritised. No model is
//! trained: MFU and SSU choose from ids alone. SCAR chooses by how far rows moved, which
//! needs training; its rows are the touched rows up to the budget (what it would choose
//! given any movement), and its choice is timed on the unchanged table (its O(N·dim) scan
//! costs the same).

use std::time::Instant;

use ftrec_config::CprPriority;
use ftrec_cpr::{PrioritizedCosts, Prioritizer, build_prioritizer};
use ftrec_data::Dataset;
use ftrec_model::{Batch, ModelState};
use serde::Serialize;

use super::{CostFrame, Strategy, StudyConfig};
use ftrec_train::TrainError;

/// A prioritised table's own tracker, and (SCAR only) an MFU counting the rows it would save.
type Trackers = Vec<Option<(Box<dyn Prioritizer>, Option<Box<dyn Prioritizer>>)>>;

/// At most this many windows are probed (spread over the epoch).
const WINDOWS: u64 = 3;

#[derive(Clone, Debug, Serialize)]
pub struct ProbeResult {
    pub strategy: String,
    /// Steps between two prioritised saves.
    pub window_steps: u64,
    pub windows: u64,
    /// Mean bytes one save writes.
    pub save_bytes: f64,
    /// Mean wall seconds choosing one save's rows.
    pub select_seconds: f64,
    /// Mean wall seconds recording one step's accesses.
    pub tracking_seconds_per_step: f64,
    /// In the job frame, ready for the decision.
    pub costs: PrioritizedCosts,
}

/// Probes `strategy` (a prioritised one) with saves every `window_steps` steps.
pub fn probe(
    config: &StudyConfig,
    frame: &CostFrame,
    strategy: Strategy,
    window_steps: u64,
    train: &Dataset,
) -> Result<ProbeResult, TrainError> {
    let Some(kind) = strategy.priority() else {
        return Err(TrainError::Config(format!(
            "{} does not save prioritised rows",
            strategy.name()
        )));
    };
    let job = &config.job;
    let mc = job.model_config()?;
    let state = ModelState::new(&mc, job.seed)?;
    let table_rows: Vec<u32> = mc.table_rows.iter().map(|&r| r as u32).collect();
    let row_bytes = (mc.row_stride() * 4) as u64;
    let prioritized =
        ftrec_cpr::tables::prioritized_tables(job.cpr.tables.as_deref(), &mc.table_rows);
    let unprioritized_bytes: u64 = (0..mc.tables())
        .filter(|t| !prioritized.contains(t))
        .map(|t| state.tables()[t].as_bytes().len() as u64)
        .sum();
    let window = window_steps.clamp(1, frame.total_steps.max(1));
    let windows = (frame.total_steps / window).clamp(1, WINDOWS);
    // Windows spread over the epoch: ids early and late in the data differ.
    let stride = frame.total_steps / windows;
    let bs = job.train.batch_size as u64;
    let len = train.len() as u64;
    let mut batch = Batch::with_tables(mc.tables());
    let (mut bytes, mut select, mut tracking, mut steps) = (0u64, 0.0, 0.0, 0u64);
    for w in 0..windows {
        let mut trackers: Trackers = (0..mc.tables())
            .map(|t| {
                prioritized.contains(&t).then(|| {
                    let table = &state.tables()[t];
                    let seed = job.seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    let own = build_prioritizer(kind, table, job.cpr.r, job.cpr.ssu_period, seed);
                    // SCAR's rows are counted by an MFU of the same budget (see above).
                    let counter = (kind == CprPriority::Scar)
                        .then(|| build_prioritizer(CprPriority::Mfu, table, job.cpr.r, 1, seed));
                    (own, counter)
                })
            })
            .collect();
        let mut sample = (w * stride * bs) % len.max(1);
        for _ in 0..window {
            let n = (len - sample).min(bs);
            train.fill_batch(sample as usize, n as usize, &table_rows, &mut batch)?;
            sample = (sample + n) % len;
            let t = Instant::now();
            for (tr, bags) in trackers.iter_mut().zip(&batch.sparse) {
                if let Some((own, _)) = tr {
                    own.record(&bags.rows);
                }
            }
            tracking += t.elapsed().as_secs_f64();
            steps += 1;
            for (tr, bags) in trackers.iter_mut().zip(&batch.sparse) {
                if let Some((_, Some(counter))) = tr {
                    counter.record(&bags.rows);
                }
            }
        }
        let mut rows = 0u64;
        for (t, tr) in trackers.iter_mut().enumerate() {
            let Some((own, counter)) = tr else { continue };
            let table = &state.tables()[t];
            let start = Instant::now();
            let chosen = own.select(table).len();
            select += start.elapsed().as_secs_f64();
            rows += counter.as_ref().map_or(chosen, |c| c.choose(table).len()) as u64;
        }
        bytes += rows * row_bytes + unprioritized_bytes;
    }
    let save_bytes = bytes as f64 / windows as f64;
    let select_seconds = select / windows as f64;
    let tracking_seconds_per_step = tracking / steps.max(1) as f64;
    let costs = PrioritizedCosts {
        r: job.cpr.r,
        o_save: frame.save_cost(save_bytes.round() as u64) + select_seconds * frame.scale,
        tracking_share: tracking_seconds_per_step * frame.scale / frame.step_seconds.max(1e-12),
        min_save_interval: frame.step_seconds,
    };
    Ok(ProbeResult {
        strategy: strategy.name().into(),
        window_steps: window,
        windows,
        save_bytes,
        select_seconds,
        tracking_seconds_per_step,
        costs,
    })
}

/// CPR's decision for a prioritised strategy at a failure fraction: Eq. 1 against Eq. 2
/// priced with the probed saves, at the interval of the target PLS.
#[derive(Clone, Debug, Serialize)]
pub struct PrioritizedDecision {
    pub decision: ftrec_cpr::Decision,
    /// The prioritised Eq. 2 as a share of `T_total`: what the run is expected to cost.
    pub overhead_fraction_expected: f64,
    pub probe: ProbeResult,
}

pub fn prioritized_decision(
    config: &StudyConfig,
    frame: &CostFrame,
    fraction: f64,
    strategy: Strategy,
    train: &Dataset,
) -> Result<PrioritizedDecision, TrainError> {
    let cpr = |e: ftrec_cpr::CprError| TrainError::Config(e.to_string());
    let k = super::failures::servers_lost(fraction, config.servers);
    let target = config.job.cpr.target_pls;
    let t_save = ftrec_cpr::formulas::partial_interval(target, config.servers, k, frame.t_fail)
        .map_err(cpr)?;
    let window = frame.steps(config.job.cpr.r * t_save);
    let probe = probe(config, frame, strategy, window, train)?;
    let decision = ftrec_cpr::formulas::decide_prioritized(
        frame.inputs(frame.o_save, frame.o_load),
        target,
        config.servers,
        k,
        config.min_benefit,
        probe.costs,
    )
    .map_err(cpr)?;
    Ok(PrioritizedDecision {
        overhead_fraction_expected: decision.overhead_partial / frame.t_total,
        decision,
        probe,
    })
}
