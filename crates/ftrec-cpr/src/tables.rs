//! Which tables prioritised saving applies to (cpr.txt §5.1: the 7 largest of 26 Kaggle
//! tables, 99.6% of the rows; the rest are small enough to save in full every time).

/// Share of all rows the default set of prioritised tables holds at least.
pub const DEFAULT_ROW_SHARE: f64 = 0.99;

/// The fewest largest tables that hold at least `share` of all rows, ascending. Ties in
/// size go to the lower index so the choice is deterministic.
pub fn largest_tables(table_rows: &[usize], share: f64) -> Vec<usize> {
    let total: usize = table_rows.iter().sum();
    let mut order: Vec<usize> = (0..table_rows.len()).collect();
    order.sort_by(|&a, &b| table_rows[b].cmp(&table_rows[a]).then(a.cmp(&b)));
    let mut held = 0usize;
    let mut chosen = Vec::new();
    for t in order {
        if held as f64 >= share * total as f64 {
            break;
        }
        held += table_rows[t];
        chosen.push(t);
    }
    chosen.sort_unstable();
    chosen
}

/// The configured tables (`cpr.tables`), or the default of [`largest_tables`] at
/// [`DEFAULT_ROW_SHARE`].
pub fn prioritized_tables(configured: Option<&[usize]>, table_rows: &[usize]) -> Vec<usize> {
    match configured {
        Some(list) => {
            let mut list = list.to_vec();
            list.sort_unstable();
            list
        }
        None => largest_tables(table_rows, DEFAULT_ROW_SHARE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_tables_holding_the_share() {
        // 1000 + 500 = 1500 of 1610 rows (93%); 1000 + 500 + 100 = 99.4%.
        let rows = [10, 1000, 100, 500];
        assert_eq!(largest_tables(&rows, 0.99), vec![1, 2, 3]);
        assert_eq!(largest_tables(&rows, 0.9), vec![1, 3]);
        assert_eq!(largest_tables(&rows, 0.5), vec![1]);
        assert_eq!(largest_tables(&rows, 1.0), vec![0, 1, 2, 3]);
        // Equal sizes: lower index first.
        assert_eq!(largest_tables(&[5, 5, 5, 5], 0.5), vec![0, 1]);
        assert_eq!(prioritized_tables(None, &rows), vec![1, 2, 3]);
        assert_eq!(prioritized_tables(Some(&[3, 0]), &rows), vec![0, 3]);
    }
}
