//! Figures over repeated runs: medians and spreads. On a shared 2-core machine two runs of
//! one configuration differ by more than the gaps being judged, so every bench reports a
//! median with its spread rather than one run.

use serde_json::{Value, json};

/// A figure over the rounds: its median (the upper middle for an even count), its spread
/// and every value (null where a round had none).
pub fn over_rounds(values: Vec<Option<f64>>) -> Value {
    let mut present: Vec<f64> = values.iter().flatten().copied().collect();
    present.sort_by(f64::total_cmp);
    let median = (!present.is_empty()).then(|| present[present.len() / 2]);
    json!({
        "median": median,
        "min": present.first(),
        "max": present.last(),
        "rounds": values,
    })
}

/// The median, the mean of the middle two for an even count; `None` for no values.
pub fn median_mid(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (n > 0).then(|| {
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        }
    })
}

/// The upper median; NaN for no values (a JSON null).
pub fn median_upper(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_figure_over_rounds_is_the_median_of_the_rounds_that_had_it() {
        let v = over_rounds(vec![Some(3.0), None, Some(1.0), Some(2.0)]);
        assert_eq!(v["median"], 2.0);
        assert_eq!(
            (v["min"].clone(), v["max"].clone()),
            (json!(1.0), json!(3.0))
        );
        assert_eq!(v["rounds"][1], Value::Null);
        assert_eq!(over_rounds(vec![None])["median"], Value::Null);
        assert_eq!(over_rounds(Vec::new())["rounds"], json!([]));
    }

    #[test]
    fn medians_of_even_odd_and_empty_lists() {
        assert_eq!(median_mid(vec![4.0, 1.0]), Some(2.5));
        assert_eq!(median_mid(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median_mid(Vec::new()), None);
        assert_eq!(median_upper(vec![4.0, 1.0]), 4.0);
        assert!(median_upper(Vec::new()).is_nan());
    }
}
