//! Summary statistics of a binary dataset.

use std::collections::HashSet;

use serde::Serialize;

use crate::hashing::MISSING;
use crate::{Dataset, Record};

#[derive(Clone, Debug, Serialize)]
pub struct DenseStats {
    pub mean: f64,
    pub min: f32,
    pub max: f32,
}

#[derive(Clone, Debug, Serialize)]
pub struct SparseStats {
    pub distinct: usize,
    pub missing_fraction: f64,
    pub max_bag: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct DatasetStats {
    pub samples: usize,
    pub positive_rate: f64,
    pub multi_hot: bool,
    pub dense: Vec<DenseStats>,
    pub sparse: Vec<SparseStats>,
}

/// Exact statistics over the first `limit` samples (all when `None`).
pub fn compute(ds: &Dataset, limit: Option<usize>) -> DatasetStats {
    let n = limit.unwrap_or(usize::MAX).min(ds.len());
    let mut rec = Record::default();
    let mut positives = 0usize;
    let mut dense: Vec<(f64, f32, f32)> =
        vec![(0.0, f32::INFINITY, f32::NEG_INFINITY); ds.num_dense()];
    let mut distinct: Vec<HashSet<u32>> = vec![HashSet::new(); ds.num_sparse()];
    let mut missing = vec![0usize; ds.num_sparse()];
    let mut max_bag = vec![0usize; ds.num_sparse()];
    for i in 0..n {
        ds.record(i, &mut rec);
        positives += (rec.label > 0.5) as usize;
        for (s, &v) in dense.iter_mut().zip(&rec.dense) {
            s.0 += v as f64;
            s.1 = s.1.min(v);
            s.2 = s.2.max(v);
        }
        for f in 0..ds.num_sparse() {
            let bag = rec.feature(f);
            max_bag[f] = max_bag[f].max(bag.len());
            for &id in bag {
                if id == MISSING {
                    missing[f] += 1;
                } else {
                    distinct[f].insert(id);
                }
            }
        }
    }
    let nf = n.max(1) as f64;
    DatasetStats {
        samples: n,
        positive_rate: positives as f64 / nf,
        multi_hot: ds.multi_hot(),
        dense: dense
            .into_iter()
            .map(|(sum, min, max)| DenseStats {
                mean: sum / nf,
                min,
                max,
            })
            .collect(),
        sparse: distinct
            .iter()
            .zip(&missing)
            .zip(&max_bag)
            .map(|((d, &m), &b)| SparseStats {
                distinct: d.len(),
                missing_fraction: m as f64 / nf,
                max_bag: b,
            })
            .collect(),
    }
}
