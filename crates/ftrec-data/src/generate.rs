//! A synthetic Criteo-shaped dataset with a planted teacher model, so that training has a
//! known ceiling: labels are drawn from `sigmoid(teacher logit)`, and the teacher's own AUC
//! on the held-out split is the best any model can expect.
//!
//! Ids of each table follow a Zipf law over the table's cardinality (hot rows, long tail).
//! Everything is a pure function of `(seed, sample index)`, computed in parallel chunks,
//! so the output is byte-identical for any thread count.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal, Zipf};
use rand_xoshiro::Xoshiro256PlusPlus;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::criteo::{KAGGLE_CARDINALITIES, NUM_DENSE};
use crate::hashing::{MISSING, raw};
use crate::record::log1p_clamped;
use crate::staging::Staging;
use crate::{DataError, DatasetWriter, META_FILE, Record, TEST_FILE, TRAIN_FILE};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenConfig {
    /// Total samples (train + test).
    pub rows: u64,
    pub seed: u64,
    /// Distinct ids per table.
    pub cardinalities: Vec<usize>,
    /// Zipf exponent of id popularity.
    pub zipf_exponent: f64,
    /// Fraction of samples (the last ones) held out as the test split.
    pub test_fraction: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OutputFormat {
    /// `train.ftrd` + `test.ftrd` (see FORMAT.md).
    Binary,
    /// `train.txt` + `test.txt` in the Criteo TSV format, for exercising converters.
    CriteoTsv,
}

impl OutputFormat {
    /// The train and test files a dataset of this format is made of.
    pub fn file_names(self) -> (&'static str, &'static str) {
        match self {
            Self::Binary => (TRAIN_FILE, TEST_FILE),
            Self::CriteoTsv => ("train.txt", "test.txt"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenReport {
    pub config: GenConfig,
    pub train_samples: u64,
    pub test_samples: u64,
    pub positive_rate: f64,
    /// The teacher's AUC on the test split: the ceiling for a trained model.
    pub teacher_auc: f64,
    pub teacher_logloss: f64,
}

impl GenConfig {
    /// The 26 Criteo Kaggle cardinalities multiplied by `scale` (at least 2 ids each).
    pub fn criteo(rows: u64, seed: u64, scale: f64) -> Self {
        Self {
            rows,
            seed,
            cardinalities: KAGGLE_CARDINALITIES
                .iter()
                .map(|&c| ((c as f64 * scale).round() as usize).max(2))
                .collect(),
            zipf_exponent: 1.1,
            test_fraction: 0.1,
        }
    }

    pub fn validate(&self) -> Result<(), DataError> {
        let bad = |m: String| Err(DataError::Invalid(m));
        if self.rows < 2 {
            return bad(format!("rows must be at least 2, got {}", self.rows));
        }
        if !(self.test_fraction > 0.0 && self.test_fraction < 1.0) {
            return bad(format!(
                "test_fraction must be in (0, 1), got {}",
                self.test_fraction
            ));
        }
        if !(self.zipf_exponent > 0.0 && self.zipf_exponent.is_finite()) {
            return bad(format!(
                "zipf exponent must be positive, got {}",
                self.zipf_exponent
            ));
        }
        if self.cardinalities.is_empty()
            || self
                .cardinalities
                .iter()
                .any(|&c| c < 1 || c > u32::MAX as usize)
        {
            return bad("every table needs a cardinality in 1..=2^32-1".into());
        }
        Ok(())
    }

    pub fn test_samples(&self) -> u64 {
        ((self.rows as f64 * self.test_fraction).round() as u64).clamp(1, self.rows - 1)
    }
}

/// splitmix64: a cheap, well-mixed hash of a 64-bit key.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A standard normal value that is a pure function of `key` (Box-Muller on two hashes).
fn gaussian(key: u64) -> f64 {
    let h = mix(key);
    let u1 = ((h >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let u2 = (mix(h) >> 11) as f64 / (1u64 << 53) as f64;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A bijection of u32 (Wang/lowbias32 style) so popular ranks get scattered raw ids.
fn scramble(rank: u32, salt: u32) -> u32 {
    let mut x = rank ^ salt;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

const INTERACTION_DIM: usize = 4;
/// Table pairs whose id vectors interact in the teacher (a dot product), so the DLRM's
/// interaction layer has something to learn.
const TEACHER_PAIRS: [(usize, usize); 6] = [(0, 1), (2, 3), (4, 9), (6, 12), (10, 13), (15, 23)];

/// The planted model: a linear + nonlinear function of the dense features, one effect per
/// categorical id (weaker in the tail), and dot products of id vectors for a few table pairs.
struct Teacher {
    seed: u64,
    dense_weight: [f64; NUM_DENSE],
    dense_mix: [f64; NUM_DENSE],
    dense_mu: [f64; NUM_DENSE],
    table_scale: Vec<f64>,
    bias: f64,
}

impl Teacher {
    fn new(seed: u64, tables: usize) -> Self {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x7EAC_4E12);
        let n = Normal::new(0.0, 1.0).unwrap_or_else(|_| unreachable!());
        let mut dense_weight = [0.0; NUM_DENSE];
        let mut dense_mix = [0.0; NUM_DENSE];
        let mut dense_mu = [0.0; NUM_DENSE];
        for f in 0..NUM_DENSE {
            dense_weight[f] = 0.25 * n.sample(&mut rng);
            dense_mix[f] = 0.4 * n.sample(&mut rng);
            dense_mu[f] = rng.gen_range(0.3..3.0);
        }
        let table_scale = (0..tables).map(|_| rng.gen_range(0.1..0.45)).collect();
        Self {
            seed,
            dense_weight,
            dense_mix,
            dense_mu,
            table_scale,
            bias: -1.3,
        }
    }

    fn id_effect(&self, table: usize, rank: u32, k: u64) -> f64 {
        gaussian(
            self.seed ^ ((table as u64) << 40) ^ ((rank as u64) << 3) ^ k.wrapping_mul(0x51_7CC1),
        )
    }

    /// `ranks[t]` is `None` for a missing value.
    fn logit(&self, dense: &[f32], ranks: &[Option<u32>]) -> f64 {
        let mut z = self.bias;
        let mut mixed = 0.0;
        for (f, &x) in dense.iter().enumerate().take(NUM_DENSE) {
            let centered = x as f64 - self.dense_mu[f];
            z += self.dense_weight[f] * centered;
            mixed += self.dense_mix[f] * centered;
        }
        z += 0.8 * mixed.tanh();
        for (t, rank) in ranks.iter().enumerate() {
            if let Some(r) = *rank {
                // Rare ids carry less signal, as in real logs: most of the learnable
                // signal sits in ids seen often enough to be learnt.
                let tail = if r < 2000 { 1.0 } else { 0.35 };
                z += self.table_scale[t] * tail * self.id_effect(t, r, 0);
            }
        }
        for &(a, b) in &TEACHER_PAIRS {
            if let (Some(Some(ra)), Some(Some(rb))) = (ranks.get(a), ranks.get(b)) {
                let dot: f64 = (0..INTERACTION_DIM as u64)
                    .map(|k| self.id_effect(a, *ra, 1 + k) * self.id_effect(b, *rb, 1 + k))
                    .sum();
                z += 0.15 * dot;
            }
        }
        z
    }
}

/// One generated sample: the raw dense integers (None = missing), ranks and raw ids.
struct Sample {
    label: bool,
    logit: f64,
    dense_raw: [Option<i64>; NUM_DENSE],
    ids: Vec<u32>,
}

struct Generator {
    config: GenConfig,
    teacher: Teacher,
    zipfs: Vec<Zipf<f64>>,
    salts: Vec<u32>,
    missing_rate: Vec<f64>,
}

const CHUNK: u64 = 16_384;

impl Generator {
    fn new(config: &GenConfig) -> Result<Self, DataError> {
        config.validate()?;
        let zipfs = config
            .cardinalities
            .iter()
            .map(|&c| {
                Zipf::new(c as u64, config.zipf_exponent)
                    .map_err(|e| DataError::Invalid(format!("zipf: {e}")))
            })
            .collect::<Result<_, _>>()?;
        let tables = config.cardinalities.len();
        Ok(Self {
            teacher: Teacher::new(config.seed, tables),
            zipfs,
            salts: (0..tables)
                .map(|t| mix(config.seed ^ t as u64) as u32)
                .collect(),
            // A few Criteo features are often empty; mimic that on every fifth table.
            missing_rate: (0..tables)
                .map(|t| if t % 5 == 2 { 0.15 } else { 0.0 })
                .collect(),
            config: config.clone(),
        })
    }

    fn chunk(&self, c: u64) -> Vec<Sample> {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(mix(self.config.seed ^ mix(c)));
        let n = CHUNK.min(self.config.rows - c * CHUNK);
        let normal = Normal::new(0.0, 1.3).unwrap_or_else(|_| unreachable!());
        let tables = self.config.cardinalities.len();
        let mut ranks = vec![None; tables];
        let mut dense = [0.0f32; NUM_DENSE];
        (0..n)
            .map(|_| {
                let mut dense_raw = [None; NUM_DENSE];
                for f in 0..NUM_DENSE {
                    let v = if rng.gen_bool(0.08) {
                        None
                    } else if f == 1 && rng.gen_bool(0.05) {
                        Some(-rng.gen_range(1..=3i64)) // Criteo's I2 has small negatives
                    } else {
                        let x = (self.teacher.dense_mu[f] + normal.sample(&mut rng)).exp();
                        Some((x.floor() as i64 - 1).max(0))
                    };
                    dense_raw[f] = v;
                    dense[f] = log1p_clamped(v.unwrap_or(0) as f64);
                }
                let mut ids = Vec::with_capacity(tables);
                for (t, slot) in ranks.iter_mut().enumerate() {
                    if self.missing_rate[t] > 0.0 && rng.gen_bool(self.missing_rate[t]) {
                        *slot = None;
                        ids.push(MISSING);
                    } else {
                        let rank = (self.zipfs[t].sample(&mut rng) as u32).saturating_sub(1);
                        *slot = Some(rank);
                        ids.push(raw(scramble(rank, self.salts[t])));
                    }
                }
                let logit = self.teacher.logit(&dense, &ranks);
                let p = 1.0 / (1.0 + (-logit).exp());
                Sample {
                    label: rng.gen_bool(p.clamp(0.0, 1.0)),
                    logit,
                    dense_raw,
                    ids,
                }
            })
            .collect()
    }
}

enum Sink {
    Binary(DatasetWriter),
    Tsv(BufWriter<File>, std::path::PathBuf),
}

impl Sink {
    fn open(
        dir: &Path,
        test: bool,
        format: OutputFormat,
        tables: usize,
    ) -> Result<Self, DataError> {
        let (train, test_name) = format.file_names();
        let path = dir.join(if test { test_name } else { train });
        Ok(match format {
            OutputFormat::Binary => {
                Sink::Binary(DatasetWriter::create(&path, NUM_DENSE, tables, false)?)
            }
            OutputFormat::CriteoTsv => {
                let f = File::create(&path).map_err(|e| DataError::io(&path, e))?;
                Sink::Tsv(BufWriter::with_capacity(1 << 20, f), path)
            }
        })
    }

    fn write(&mut self, s: &Sample, rec: &mut Record, line: &mut String) -> Result<(), DataError> {
        match self {
            Sink::Binary(w) => {
                rec.clear();
                rec.label = s.label as u8 as f32;
                rec.dense.extend(
                    s.dense_raw
                        .iter()
                        .map(|v| log1p_clamped(v.unwrap_or(0) as f64)),
                );
                for &id in &s.ids {
                    rec.ids.push(id);
                    rec.end_feature();
                }
                w.push(rec)
            }
            Sink::Tsv(w, path) => {
                use std::fmt::Write as _;
                line.clear();
                line.push(if s.label { '1' } else { '0' });
                for v in &s.dense_raw {
                    line.push('\t');
                    if let Some(v) = v {
                        let _ = write!(line, "{v}");
                    }
                }
                for &id in &s.ids {
                    line.push('\t');
                    if id != MISSING {
                        let _ = write!(line, "{id:08x}");
                    }
                }
                line.push('\n');
                w.write_all(line.as_bytes())
                    .map_err(|e| DataError::io(&*path, e))
            }
        }
    }

    fn finish(self) -> Result<(), DataError> {
        match self {
            Sink::Binary(w) => w.finish().map(|_| ()),
            Sink::Tsv(w, path) => {
                let f = w
                    .into_inner()
                    .map_err(|e| DataError::io(&path, e.into_error()))?;
                f.sync_all().map_err(|e| DataError::io(&path, e))
            }
        }
    }
}

/// Generates the dataset and its `meta.json` into `dir`, replacing an older dataset there
/// only when the whole of the new one was written. `progress` is called with the number
/// of samples written so far.
pub fn generate(
    config: &GenConfig,
    dir: &Path,
    format: OutputFormat,
    mut progress: impl FnMut(u64),
) -> Result<GenReport, DataError> {
    let generator = Generator::new(config)?;
    // Written aside and moved in whole, as `data convert` does: a failed run changes
    // nothing, a successful one leaves nothing of an older dataset to pair with meta.json.
    let staging = Staging::create(dir, "gen")?;
    let tables = config.cardinalities.len();
    let test_samples = config.test_samples();
    let train_samples = config.rows - test_samples;
    let mut train = Some(Sink::open(&staging.path, false, format, tables)?);
    let mut test = Some(Sink::open(&staging.path, true, format, tables)?);
    let chunks = config.rows.div_ceil(CHUNK);
    let window = (rayon::current_num_threads() as u64 * 2).max(2);
    let (mut rec, mut line) = (Record::default(), String::new());
    let (mut test_logits, mut test_labels) = (Vec::new(), Vec::new());
    let (mut positives, mut written) = (0u64, 0u64);
    let mut first = 0;
    while first < chunks {
        let last = (first + window).min(chunks);
        let batches: Vec<Vec<Sample>> = (first..last)
            .into_par_iter()
            .map(|c| generator.chunk(c))
            .collect();
        for sample in batches.iter().flatten() {
            positives += sample.label as u64;
            let sink = if written < train_samples {
                &mut train
            } else {
                test_logits.push(sample.logit as f32);
                test_labels.push(sample.label as u8 as f32);
                &mut test
            };
            if let Some(sink) = sink.as_mut() {
                sink.write(sample, &mut rec, &mut line)?;
            }
            written += 1;
        }
        progress(written);
        first = last;
    }
    for sink in [train.take(), test.take()].into_iter().flatten() {
        sink.finish()?;
    }
    let metrics = ftrec_model::metrics::evaluate(&test_logits, &test_labels);
    let report = GenReport {
        config: config.clone(),
        train_samples,
        test_samples,
        positive_rate: positives as f64 / config.rows as f64,
        teacher_auc: metrics.auc,
        teacher_logloss: metrics.logloss,
    };
    write_meta(&staging.path, &report)?;
    let (train_name, test_name) = format.file_names();
    // meta.json last: it describes the files before it. A binary dataset left beside new
    // text files is stale (`train --data DIR` would read it with the new meta.json), so it
    // goes; text files beside a new binary dataset are left alone, as they may be the
    // user's own input for `data convert`.
    let stale: &[&str] = match format {
        OutputFormat::Binary => &[META_FILE],
        OutputFormat::CriteoTsv => &[META_FILE, TRAIN_FILE, TEST_FILE],
    };
    staging.publish(dir, &[train_name, test_name, META_FILE], stale)?;
    Ok(report)
}

fn write_meta(dir: &Path, report: &GenReport) -> Result<(), DataError> {
    let text =
        serde_json::to_string_pretty(report).map_err(|e| DataError::Invalid(e.to_string()))?;
    Ok(ftrec_fsio::write_atomic(
        &dir.join(META_FILE),
        text.as_bytes(),
    )?)
}

/// Reads the generator report of a dataset directory, if it was generated.
pub fn read_meta(dir: &Path) -> Option<GenReport> {
    let text = std::fs::read_to_string(dir.join(META_FILE)).ok()?;
    serde_json::from_str(&text).ok()
}
