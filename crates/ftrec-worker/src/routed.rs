//! A batch's rows routed to the servers that own them, and a pull's answers put back in
//! the batch's order.

use ftrec_proto::placement::{GlobalRow, Layout};

/// A batch's unique rows split by the server that owns them: `owned[server][table]`,
/// ascending within each.
pub struct Routed {
    pub(crate) owned: Vec<Vec<Vec<u32>>>,
}

impl Routed {
    pub fn new(layout: Layout, unique: &[&[u32]]) -> Self {
        let mut owned = vec![vec![Vec::new(); unique.len()]; layout.servers()];
        for (t, rows) in unique.iter().enumerate() {
            for &row in *rows {
                owned[layout.server_of(t, GlobalRow(row))][t].push(row);
            }
        }
        Self { owned }
    }
}

/// What a pull brought back: per server, per table, the embeddings of its rows in
/// [`Routed`] order; and the dense parameters, server ranges concatenated in order.
pub struct Pulled {
    pub(crate) per_server: Vec<Vec<Vec<f32>>>,
    pub dense: Vec<f32>,
}

impl Pulled {
    pub(crate) fn assemble(
        &self,
        layout: Layout,
        dim: usize,
        t: usize,
        unique: &[u32],
        out: &mut Vec<f32>,
    ) {
        let mut cursor = vec![0usize; layout.servers()];
        out.clear();
        for &row in unique {
            let s = layout.server_of(t, GlobalRow(row));
            let at = cursor[s];
            out.extend_from_slice(&self.per_server[s][t][at * dim..(at + 1) * dim]);
            cursor[s] += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_rows_come_back_in_the_batch_order() {
        let layout = Layout::new(3).unwrap();
        let dim = 2;
        let unique: Vec<Vec<u32>> = vec![vec![0, 1, 2, 5, 9, 10], vec![3, 4, 7]];
        let refs: Vec<&[u32]> = unique.iter().map(Vec::as_slice).collect();
        let routed = Routed::new(layout, &refs);
        for (s, per_table) in routed.owned.iter().enumerate() {
            for (t, rows) in per_table.iter().enumerate() {
                assert!(rows.iter().all(|&r| layout.server_of(t, GlobalRow(r)) == s));
                assert!(rows.windows(2).all(|w| w[0] < w[1]));
            }
        }
        // Each server answers its rows' embeddings: [row, table] per row.
        let pulled = Pulled {
            per_server: routed
                .owned
                .iter()
                .map(|per_table| {
                    per_table
                        .iter()
                        .enumerate()
                        .map(|(t, rows)| rows.iter().flat_map(|&r| [r as f32, t as f32]).collect())
                        .collect()
                })
                .collect(),
            dense: Vec::new(),
        };
        let mut out = Vec::new();
        for (t, rows) in unique.iter().enumerate() {
            pulled.assemble(layout, dim, t, rows, &mut out);
            let expected: Vec<f32> = rows.iter().flat_map(|&r| [r as f32, t as f32]).collect();
            assert_eq!(out, expected);
        }
    }
}
