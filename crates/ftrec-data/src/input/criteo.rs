//! The Criteo Kaggle / Terabyte TSV format: label, 13 integer features (I1..I13, empty
//! when missing, may be negative) transformed by `log(1 + max(x, 0))`, and 26 categorical
//! features (C1..C26) as 8-digit hex ids, empty when missing.

use crate::schema::{Column, ColumnKind, DenseTransform, Schema, SparseEncoding};

pub const NUM_DENSE: usize = 13;
pub const NUM_SPARSE: usize = 26;

/// Cardinalities of the 26 Criteo Kaggle categorical features (as published with the DLRM
/// reference implementation).
pub const KAGGLE_CARDINALITIES: [usize; NUM_SPARSE] = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
];

pub fn schema() -> Schema {
    let mut columns = vec![Column {
        name: "label".into(),
        kind: ColumnKind::Label,
    }];
    columns.extend((1..=NUM_DENSE).map(|i| Column {
        name: format!("I{i}"),
        kind: ColumnKind::Dense {
            transform: DenseTransform::Log1p,
        },
    }));
    columns.extend((1..=NUM_SPARSE).map(|i| Column {
        name: format!("C{i}"),
        kind: ColumnKind::Sparse {
            encoding: SparseEncoding::Hex,
        },
    }));
    Schema {
        delimiter: b'\t',
        header: false,
        multi_hot_separator: None,
        columns,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Record;
    use crate::hashing::MISSING;

    fn line(label: &str, dense: &[&str], sparse: &[&str]) -> String {
        let mut f = vec![label.to_string()];
        f.extend(dense.iter().map(|s| s.to_string()));
        f.extend(sparse.iter().map(|s| s.to_string()));
        f.join("\t")
    }

    #[test]
    fn kaggle_line_with_missing_and_negative_values() {
        let mut dense = vec!["1"; 13];
        dense[1] = "-3";
        dense[2] = "";
        let mut sparse = vec!["68fd1e64"; 26];
        sparse[5] = "";
        let l = line("1", &dense, &sparse);
        let mut r = Record::default();
        schema().parse_line(l.as_bytes(), &mut r).unwrap();
        assert_eq!(r.label, 1.0);
        assert_eq!(r.dense[0], (2.0f64).ln() as f32);
        assert_eq!(r.dense[1], 0.0, "negative clamps to 0 before log1p");
        assert_eq!(r.dense[2], 0.0, "missing is 0");
        assert_eq!(r.feature(0), &[0x68fd1e64]);
        assert_eq!(r.feature(5), &[MISSING]);
        assert!(r.is_single_hot());
    }

    #[test]
    fn truncated_line_is_an_error() {
        let l = line("0", &["1"; 13], &["a"; 25]);
        let e = schema()
            .parse_line(l.as_bytes(), &mut Record::default())
            .unwrap_err();
        assert!(e.contains("expected 40 fields, found 39"), "{e}");
    }
}
