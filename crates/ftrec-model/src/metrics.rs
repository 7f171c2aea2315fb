//! Held-out metrics computed from logits: log loss, exact ROC AUC, accuracy.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Metrics {
    pub samples: usize,
    pub logloss: f64,
    pub auc: f64,
    pub accuracy: f64,
}

/// Mean binary cross-entropy of `sigmoid(logit)` against `labels`, computed from logits so
/// it never takes `log(0)`.
pub fn logloss(logits: &[f32], labels: &[f32]) -> f64 {
    if logits.is_empty() {
        return f64::NAN;
    }
    let total: f64 = logits
        .iter()
        .zip(labels)
        .map(|(&z, &y)| {
            let z = z as f64;
            z.max(0.0) + (-z.abs()).exp().ln_1p() - y as f64 * z
        })
        .sum();
    total / logits.len() as f64
}

/// Exact ROC AUC (Mann-Whitney U with tied scores sharing their average rank). Any
/// monotone transform of the scores gives the same value, so logits can be passed as is.
/// NaN when one class is absent.
pub fn auc(scores: &[f32], labels: &[f32]) -> f64 {
    let mut order: Vec<u32> = (0..scores.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| scores[a as usize].total_cmp(&scores[b as usize]));
    let positives = labels.iter().filter(|&&y| y > 0.5).count() as f64;
    let negatives = labels.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return f64::NAN;
    }
    let mut rank_sum = 0.0f64;
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        let s = scores[order[i] as usize];
        while j < order.len() && scores[order[j] as usize] == s {
            j += 1;
        }
        // ranks i+1..=j share their mean
        let mean_rank = (i + 1 + j) as f64 / 2.0;
        let pos_in_tie = order[i..j]
            .iter()
            .filter(|&&k| labels[k as usize] > 0.5)
            .count();
        rank_sum += mean_rank * pos_in_tie as f64;
        i = j;
    }
    (rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives)
}

/// Fraction of samples where `logit > 0` agrees with the label.
pub fn accuracy(logits: &[f32], labels: &[f32]) -> f64 {
    if logits.is_empty() {
        return f64::NAN;
    }
    let right = logits
        .iter()
        .zip(labels)
        .filter(|&(&z, &y)| (z > 0.0) == (y > 0.5))
        .count();
    right as f64 / logits.len() as f64
}

pub fn evaluate(logits: &[f32], labels: &[f32]) -> Metrics {
    Metrics {
        samples: logits.len(),
        logloss: logloss(logits, labels),
        auc: auc(logits, labels),
        accuracy: accuracy(logits, labels),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn brute_auc(s: &[f32], y: &[f32]) -> f64 {
        let (mut num, mut den) = (0.0, 0.0);
        for i in 0..s.len() {
            for j in 0..s.len() {
                if y[i] > 0.5 && y[j] < 0.5 {
                    den += 1.0;
                    num += if s[i] > s[j] {
                        1.0
                    } else if s[i] == s[j] {
                        0.5
                    } else {
                        0.0
                    };
                }
            }
        }
        num / den
    }

    proptest! {
        #[test]
        fn auc_equals_pairwise_definition(
            data in proptest::collection::vec((0u8..6, any::<bool>()), 2..60)
        ) {
            let s: Vec<f32> = data.iter().map(|d| d.0 as f32).collect();
            let y: Vec<f32> = data.iter().map(|d| d.1 as u8 as f32).collect();
            let a = auc(&s, &y);
            let b = brute_auc(&s, &y);
            prop_assert!((a.is_nan() && b.is_nan()) || (a - b).abs() < 1e-12, "{a} vs {b}");
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(auc(&[0.1, 0.4, 0.35, 0.8], &[0.0, 0.0, 1.0, 1.0]), 0.75);
        assert!((logloss(&[0.0], &[1.0]) - std::f64::consts::LN_2).abs() < 1e-12);
        assert!((logloss(&[100.0], &[0.0]) - 100.0).abs() < 1e-9);
        assert_eq!(accuracy(&[1.0, -1.0, 2.0], &[1.0, 1.0, 0.0]), 1.0 / 3.0);
    }
}
