//! `ftrec bench train`: median step time of the training step on in-memory Zipf batches,
//! so the figure measures compute, not the disk.

use std::time::Instant;

use ftrec_model::{Batch, Dlrm, GemmMatMul, ModelState};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use rand_xoshiro::Xoshiro256PlusPlus;
use serde::Serialize;

use ftrec_config::JobConfig;
use ftrec_train::{TrainError, table_pages};

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub batch_size: usize,
    pub threads: usize,
    pub warmup_steps: usize,
    pub steps: usize,
    pub step_ms_median: f64,
    pub step_ms_p10: f64,
    pub step_ms_p90: f64,
    pub samples_per_sec: f64,
    pub model_bytes: usize,
    pub peak_rss_bytes: Option<u64>,
    /// Anonymous memory on transparent huge pages at the end of the run
    /// (`AnonHugePages` in `/proc/self/smaps_rollup`): the tables, with `train.huge_pages`
    /// where the system allows it.
    pub huge_page_bytes: Option<u64>,
    /// Mean milliseconds per step spent in each phase (after warm-up).
    pub phase_ms: std::collections::BTreeMap<String, f64>,
}

/// The `key:` line of a `/proc` file of `kB` fields, in bytes.
fn proc_kib_field(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| {
        l.strip_prefix(key)
            .is_some_and(|rest| rest.starts_with(':'))
    })?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Peak resident set size of this process (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    proc_kib_field("/proc/self/status", "VmHWM")
}

/// Anonymous memory of this process on transparent huge pages (`AnonHugePages`).
pub fn huge_page_bytes() -> Option<u64> {
    proc_kib_field("/proc/self/smaps_rollup", "AnonHugePages")
}

/// Batches with Zipf(1.1) ids per table, random dense values and labels.
pub fn synthetic_batches(
    config: &JobConfig,
    count: usize,
    seed: u64,
) -> Result<Vec<Batch>, TrainError> {
    let mc = config.model_config()?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let zipfs: Vec<Zipf<f64>> = mc
        .table_rows
        .iter()
        .map(|&r| Zipf::new(r as u64 - 1, 1.1).map_err(|e| TrainError::Config(e.to_string())))
        .collect::<Result<_, _>>()?;
    Ok((0..count)
        .map(|_| {
            let mut b = Batch::with_tables(mc.tables());
            for _ in 0..config.train.batch_size {
                b.labels.push(rng.gen_bool(0.25) as u8 as f32);
                for _ in 0..mc.num_dense {
                    b.dense.push(rng.gen_range(0.0..5.0));
                }
                for (t, z) in zipfs.iter().enumerate() {
                    b.sparse[t].push_bag([z.sample(&mut rng) as u32]);
                }
            }
            b.size = config.train.batch_size;
            b
        })
        .collect())
}

/// The pool, a freshly initialised state and the `Dlrm` workspace a benchmark trains with.
pub(crate) fn fresh_model(
    config: &JobConfig,
) -> Result<(rayon::ThreadPool, ModelState, Dlrm), TrainError> {
    let threads = config.threads();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| TrainError::Threads(e.to_string()))?;
    let mc = config.model_config()?;
    let state = pool.install(|| ModelState::new_on(&mc, config.seed, table_pages(config)))?;
    let model = Dlrm::new(&mc, config.train.batch_size, threads, Box::new(GemmMatMul))?;
    Ok((pool, state, model))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub fn bench_train(
    config: &JobConfig,
    warmup_steps: usize,
    steps: usize,
    mut on_step: impl FnMut(usize),
) -> Result<BenchReport, TrainError> {
    let threads = config.threads();
    let (pool, mut state, mut model) = fresh_model(config)?;
    let batches = synthetic_batches(config, 8, config.seed)?;
    let mut times = Vec::with_capacity(steps);
    for i in 0..warmup_steps + steps.max(1) {
        let batch = &batches[i % batches.len()];
        let t = Instant::now();
        pool.install(|| model.train_step(&mut state, batch))?;
        if i + 1 == warmup_steps {
            model.reset_phase_times();
        }
        if i >= warmup_steps {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        on_step(i + 1);
    }
    times.sort_by(f64::total_cmp);
    let median = percentile(&times, 0.5);
    let p = model.phase_times();
    let per_step = 1e3 / p.steps.max(1) as f64;
    let phase_ms = serde_json::to_value(p)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| k != "steps")
        .filter_map(|(k, v)| v.as_f64().map(|v| (k, v * per_step)))
        .collect();
    Ok(BenchReport {
        phase_ms,
        batch_size: config.train.batch_size,
        threads,
        warmup_steps,
        steps: times.len(),
        step_ms_median: median,
        step_ms_p10: percentile(&times, 0.1),
        step_ms_p90: percentile(&times, 0.9),
        samples_per_sec: config.train.batch_size as f64 / (median / 1e3),
        model_bytes: state.bytes(),
        peak_rss_bytes: peak_rss_bytes(),
        huge_page_bytes: huge_page_bytes(),
    })
}
