//! One training run of the study: a strategy at a failure fraction, or the failure-free
//! baseline.

use std::time::Instant;

use ftrec_cpr::formulas::partial_interval;
use ftrec_cpr::priority::budget;
use ftrec_cpr::{Pls, Prioritizer, build_prioritizer};
use ftrec_data::Dataset;
use ftrec_model::{Batch, ModelState};

use super::costs::copy_state;
use super::failures::{Schedule, reset_servers, servers_lost};
use super::report::{OverheadSeconds, RunResult};
use super::{CostFrame, Strategy, StudyConfig};
use ftrec_train::{Progress, TrainError, Trainer};

pub(super) struct Run<'a> {
    config: &'a StudyConfig,
    frame: Option<&'a CostFrame>,
    strategy: Option<Strategy>,
    fraction: f64,
    /// `(executed step, lost servers)` of this run's failures.
    failures: Vec<(u64, Vec<usize>)>,
    total_steps: u64,
    /// Steps between checkpoints (between partial ones for the prioritised strategies).
    interval: u64,
    interval_seconds: f64,
}

pub(super) struct Outcome {
    pub result: RunResult,
    /// Wall time of the training steps alone.
    pub train_seconds: f64,
}

/// Where training is, as a checkpoint of full recovery records it.
#[derive(Clone, Copy, Default)]
struct Position {
    step: u64,
    sample: u64,
    /// Samples trained so far (S_i of Eq. 3).
    samples: u64,
}

impl<'a> Run<'a> {
    pub fn baseline(config: &'a StudyConfig, total_steps: u64) -> Self {
        Self {
            config,
            frame: None,
            strategy: None,
            fraction: 0.0,
            failures: Vec::new(),
            total_steps,
            interval: u64::MAX,
            interval_seconds: f64::INFINITY,
        }
    }

    pub fn new(
        config: &'a StudyConfig,
        frame: &'a CostFrame,
        schedule: &Schedule,
        fraction_index: usize,
        strategy: Strategy,
        total_steps: u64,
    ) -> Result<Self, TrainError> {
        let fraction = config.fractions[fraction_index];
        let k = servers_lost(fraction, config.servers);
        let t_save = if strategy.pls_interval() {
            partial_interval(config.job.cpr.target_pls, config.servers, k, frame.t_fail)
                .map_err(|e| TrainError::Config(e.to_string()))?
        } else {
            ftrec_cpr::formulas::full_optimal_interval(frame.o_save, frame.t_fail)
        };
        let interval_seconds = if strategy.priority().is_some() {
            config.job.cpr.r * t_save
        } else {
            t_save
        };
        Ok(Self {
            config,
            frame: Some(frame),
            strategy: Some(strategy),
            fraction,
            failures: schedule
                .failures
                .iter()
                .map(|f| (f.at_step, f.lost[fraction_index].clone()))
                .collect(),
            total_steps,
            interval: frame.steps(interval_seconds),
            interval_seconds,
        })
    }

    pub fn execute(self, train: &Dataset, test: &Dataset) -> Result<Outcome, TrainError> {
        let job = &self.config.job;
        let servers = self.config.servers;
        let (pool, mut state, mut model) = crate::train_step::fresh_model(job)?;
        let mc = state.config().clone();
        let table_rows: Vec<u32> = mc.table_rows.iter().map(|&r| r as u32).collect();
        let row_bytes = (mc.row_stride() * 4) as u64;
        let table_bytes: u64 = state
            .tables()
            .iter()
            .map(|t| t.as_bytes().len() as u64)
            .sum();
        // The initial model is the step-0 checkpoint: it is regenerated from the seed, so
        // it is not counted as a checkpoint written.
        let mut saved = state.clone();
        let mut saved_at = Position::default();
        let prioritized =
            ftrec_cpr::tables::prioritized_tables(job.cpr.tables.as_deref(), &mc.table_rows);
        let mut selectors: Vec<Option<Box<dyn Prioritizer>>> = (0..mc.tables())
            .map(|t| {
                let kind = self.strategy.and_then(Strategy::priority)?;
                prioritized.contains(&t).then(|| {
                    build_prioritizer(
                        kind,
                        &state.tables()[t],
                        job.cpr.r,
                        job.cpr.ssu_period,
                        job.seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    )
                })
            })
            .collect();
        let s_total = samples_in(self.total_steps, train.len() as u64, job.train.batch_size);
        let mut pls = Pls::new(s_total.max(1), servers).map_err(cpr_err)?;
        let mut batch = Batch::with_tables(mc.tables());
        let mut at = Position::default();
        let (mut executed, mut next_failure) = (0u64, 0usize);
        // S_last_ckpt of Eq. 3, per server: uncoordinated saves give each its own.
        let mut last_save_samples = vec![0u64; servers];
        let uncoordinated = self.strategy == Some(Strategy::CprUncoordinated);
        let (mut checkpoints, mut bytes, mut rolled_back) = (0u64, 0u64, 0u64);
        let mut cost = OverheadSeconds::default();
        let (mut train_seconds, mut tracking_seconds, mut select_seconds) = (0.0, 0.0, 0.0);
        let bs = job.train.batch_size as u64;
        while at.step < self.total_steps {
            let n = (train.len() as u64 - at.sample).min(bs);
            train.fill_batch(at.sample as usize, n as usize, &table_rows, &mut batch)?;
            let t = Instant::now();
            pool.install(|| model.train_step(&mut state, &batch))?;
            train_seconds += t.elapsed().as_secs_f64();
            at.step += 1;
            at.samples += n;
            at.sample = (at.sample + n) % train.len() as u64;
            executed += 1;
            let t = Instant::now();
            for (sel, bags) in selectors.iter_mut().zip(&batch.sparse) {
                if let Some(sel) = sel {
                    sel.record(&bags.rows);
                }
            }
            tracking_seconds += t.elapsed().as_secs_f64();

            while let Some((_, lost)) = self.failures.get(next_failure).filter(|f| f.0 == executed)
            {
                next_failure += 1;
                let (Some(frame), Some(strategy)) = (self.frame, self.strategy) else {
                    continue;
                };
                cost.reschedule += frame.o_res;
                if strategy == Strategy::Full {
                    copy_state(&mut state, &saved, true);
                    rolled_back += at.step - saved_at.step;
                    at = saved_at;
                    cost.load += frame.o_load;
                    cost.load_bytes_only += frame.o_load;
                    continue;
                }
                for &s in lost {
                    pls.on_server_failure(at.samples, last_save_samples[s])
                        .map_err(cpr_err)?;
                }
                let reset = reset_servers(&mut state, &saved, servers, lost);
                let rows: usize = reset.iter().map(Vec::len).sum();
                cost.load += frame.load_cost(rows as u64 * row_bytes);
                cost.load_bytes_only += frame.load_cost_bytes_only(rows as u64 * row_bytes);
                for (t, (sel, rows)) in selectors.iter_mut().zip(&reset).enumerate() {
                    if let Some(sel) = sel {
                        sel.forget(&state.tables()[t], rows);
                    }
                }
            }

            if uncoordinated && let Some(frame) = self.frame {
                // Server `s` saves when `executed + s·interval/N` is a multiple of the
                // interval: the servers' saves spread evenly over each interval.
                for (s, last_save) in last_save_samples.iter_mut().enumerate() {
                    let offset = s as u64 * self.interval / servers as u64;
                    if (executed + offset).is_multiple_of(self.interval)
                        && at.step < self.total_steps
                    {
                        // The reset in reverse: server `s`'s rows of `state` into `saved`.
                        let rows: usize = reset_servers(&mut saved, &state, servers, &[s])
                            .iter()
                            .map(Vec::len)
                            .sum();
                        let written = rows as u64 * row_bytes;
                        checkpoints += 1;
                        bytes += written;
                        cost.save += frame.save_cost(written);
                        cost.save_bytes_only += frame.save_cost_bytes_only(written);
                        *last_save = at.samples;
                    }
                }
                continue;
            }
            let due = executed.is_multiple_of(self.interval) && at.step < self.total_steps;
            let (Some(frame), Some(strategy), true) = (self.frame, self.strategy, due) else {
                continue;
            };
            let written = match strategy {
                Strategy::Full => {
                    copy_state(&mut saved, &state, true);
                    saved_at = at;
                    frame.model_bytes
                }
                Strategy::Partial | Strategy::CprVanilla | Strategy::CprUncoordinated => {
                    copy_state(&mut saved, &state, false);
                    table_bytes
                }
                _ => {
                    let (b, choosing) =
                        save_prioritized(&mut saved, &state, &mut selectors, row_bytes);
                    select_seconds += choosing;
                    b
                }
            };
            checkpoints += 1;
            bytes += written;
            cost.save += frame.save_cost(written);
            cost.save_bytes_only += frame.save_cost_bytes_only(written);
            last_save_samples.fill(at.samples);
        }
        if let Some(frame) = self.frame {
            cost.lost = rolled_back as f64 * frame.step_seconds;
            cost.tracking = tracking_seconds * frame.scale;
            cost.selection = select_seconds * frame.scale;
        }
        let digest = state.digest().to_string();
        let tracker_memory_bytes: usize =
            selectors.iter().flatten().map(|s| s.memory_bytes()).sum();
        let prioritized_bytes: u64 = prioritized
            .iter()
            .map(|&t| state.tables()[t].as_bytes().len() as u64)
            .sum();
        let metrics = Trainer::with_state(job, state, Progress::default())?
            .evaluate(test, job.train.eval_samples)?;
        let expected = match (self.frame, self.strategy) {
            (Some(frame), Some(strategy)) => self.expected_overhead(
                frame,
                strategy,
                &mc.table_rows,
                &prioritized,
                row_bytes,
                table_bytes,
            )?,
            _ => 0.0,
        };
        let t_total = self.frame.map_or(1.0, |f| f.t_total);
        Ok(Outcome {
            train_seconds,
            result: RunResult {
                strategy: self
                    .strategy
                    .map_or("no_failure", Strategy::name)
                    .to_string(),
                fraction: self.fraction,
                auc: metrics.auc,
                logloss: metrics.logloss,
                pls: pls.value,
                overhead_fraction: cost.total() / t_total,
                overhead_fraction_all_costs: cost.total_all() / t_total,
                overhead_fraction_all_costs_bytes_only: cost.total_all_bytes_only() / t_total,
                overhead_fraction_expected: expected,
                overhead_seconds: cost,
                checkpoints,
                bytes,
                interval_steps: (self.interval != u64::MAX).then_some(self.interval),
                interval_seconds: self.interval_seconds,
                failures: self.failures.len(),
                steps_executed: executed,
                steps_rolled_back: rolled_back,
                tracker_memory_bytes: tracker_memory_bytes as u64,
                tracker_memory_share: tracker_memory_bytes as f64 / prioritized_bytes.max(1) as f64,
                tracking_seconds,
                select_seconds,
                train_seconds,
                digest,
            },
        })
    }

    /// Eq. 1 (full) or Eq. 2 (the rest) over the job length, at this run's interval and
    /// per-checkpoint cost.
    fn expected_overhead(
        &self,
        frame: &CostFrame,
        strategy: Strategy,
        table_rows: &[usize],
        prioritized: &[usize],
        row_bytes: u64,
        table_bytes: u64,
    ) -> Result<f64, TrainError> {
        let k = servers_lost(self.fraction, self.config.servers);
        let load = frame.load_cost(table_bytes * k as u64 / self.config.servers as u64);
        let per_save_bytes = match strategy {
            Strategy::Full => frame.model_bytes,
            Strategy::Partial | Strategy::CprVanilla | Strategy::CprUncoordinated => table_bytes,
            _ => table_rows
                .iter()
                .enumerate()
                .map(|(t, &rows)| {
                    let saved_rows = if prioritized.contains(&t) {
                        budget(rows, self.config.job.cpr.r)
                    } else {
                        rows
                    };
                    saved_rows as u64 * row_bytes
                })
                .sum(),
        };
        let interval = self.interval as f64 * frame.step_seconds;
        let seconds = if strategy == Strategy::Full {
            frame
                .inputs(frame.o_save, frame.o_load)
                .full_overhead(interval)
        } else {
            frame
                .inputs(frame.save_cost(per_save_bytes), load)
                .partial_overhead(interval)
        }
        .map_err(cpr_err)?;
        Ok(seconds / frame.t_total)
    }
}

/// A prioritised save: each tracker chooses its rows, which are copied into `saved`.
/// Returns the bytes written and the seconds spent choosing. Only the choosing is timed:
/// the copy is this emulation's stand-in for the save itself, which every strategy pays
/// through `O_save` times its share of the model's bytes (the full and partial saves'
/// copies are not timed either), so timing it here would count it twice. The probe that
/// prices the prioritised decision times the same thing.
fn save_prioritized(
    saved: &mut ModelState,
    state: &ModelState,
    selectors: &mut [Option<Box<dyn Prioritizer>>],
    row_bytes: u64,
) -> (u64, f64) {
    let (mut written, mut choosing) = (0u64, 0.0f64);
    for ((dst, src), sel) in saved
        .tables_mut()
        .iter_mut()
        .zip(state.tables())
        .zip(selectors.iter_mut())
    {
        match sel {
            Some(sel) => {
                let t = Instant::now();
                let rows = sel.select(src);
                choosing += t.elapsed().as_secs_f64();
                for &r in &rows {
                    dst.row_mut(r as usize).copy_from_slice(src.row(r as usize));
                }
                written += rows.len() as u64 * row_bytes;
            }
            None => {
                dst.as_mut_slice().copy_from_slice(src.as_slice());
                written += src.as_bytes().len() as u64;
            }
        }
    }
    (written, choosing)
}

/// Samples a failure-free run of `steps` steps trains (S_total of Eq. 3).
fn samples_in(steps: u64, len: u64, batch: usize) -> u64 {
    let (mut pos, mut total) = (0u64, 0u64);
    for _ in 0..steps {
        let n = (len - pos).min(batch as u64);
        total += n;
        pos = (pos + n) % len.max(1);
    }
    total
}

fn cpr_err(e: ftrec_cpr::CprError) -> TrainError {
    TrainError::Config(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_in_counts_the_short_batch_at_the_end_of_each_pass() {
        // 10 samples in batches of 4: 4, 4, then the 2 left, and round again.
        assert_eq!(samples_in(3, 10, 4), 10);
        assert_eq!(samples_in(4, 10, 4), 14);
        // A dataset smaller than a batch: every step is the whole dataset.
        assert_eq!(samples_in(2, 3, 4), 6);
    }

    #[test]
    fn samples_in_of_nothing_is_zero() {
        assert_eq!(samples_in(0, 10, 4), 0);
        // An empty dataset trains no samples, and does not divide by zero.
        assert_eq!(samples_in(5, 0, 4), 0);
    }
}
