//! Prioritised partial checkpoints (cpr.txt §4.2): instead of all `N` rows of a table
//! every `T_save`, save the `r·N` rows that matter most every `r·T_save`. One tracker per
//! table, behind [`Prioritizer`]:
//!
//! | kind | tracks | memory | selection |
//! |------|--------|--------|-----------|
//! | [`Mfu`] | a 4-byte access counter per row | `4·N` bytes | top `r·N` counts, O(N) |
//! | [`Ssu`] | a list of at most `r·N` sub-sampled rows | `4·r·N + N/8` bytes | the list |
//! | [`Scar`] | a copy of each row's embedding as last saved | `4·dim·N` bytes | top `r·N` L2 changes, O(N·dim) |
//! | [`NoPriority`] | nothing | 0 | every row |
//!
//! Top-k uses `select_nth_unstable`, linear on average, where the paper assumes a sort.

mod mfu;
mod scar;
mod ssu;
#[cfg(test)]
mod tests;

mod kind;
pub use kind::CprPriority;

use ftrec_model::EmbeddingTable;

pub use mfu::Mfu;
pub use scar::Scar;
pub use ssu::Ssu;

/// Chooses which rows of one table a partial checkpoint saves.
pub trait Prioritizer: Send {
    fn kind(&self) -> CprPriority;
    /// Rows of the table a training step accessed, one entry per access, in sample order.
    fn record(&mut self, rows: &[u32]);
    /// The rows to save now, ascending, at most the budget, without marking them saved:
    /// a caller whose save can fail marks them with [`Prioritizer::forget`] once it is
    /// durable, so a failed write leaves them unsaved and chosen again.
    fn choose(&self, table: &EmbeddingTable) -> Vec<u32>;
    /// [`Prioritizer::choose`], the rows counting as saved from here on (their counters,
    /// list entries or baselines are reset): for a save that cannot fail.
    fn select(&mut self, table: &EmbeddingTable) -> Vec<u32> {
        let rows = self.choose(table);
        self.forget(table, &rows);
        rows
    }
    /// These rows of `table` were just restored (the table holds the restored values):
    /// nothing of theirs is unsaved. SCAR re-bases them on the restored values rather than
    /// assume those equal its copy: a restore to another checkpoint than its last
    /// selection (a rollback past prioritised saves, a replacement's first restore) breaks
    /// that.
    fn forget(&mut self, table: &EmbeddingTable, rows: &[u32]);
    /// The whole table was just restored (a rollback, a replacement's restore, the
    /// initial model): every row equals its saved value, nothing is unsaved, and accesses
    /// recorded before belong to steps that no longer exist.
    fn reset(&mut self, table: &EmbeddingTable) {
        let all: Vec<u32> = (0..table.rows() as u32).collect();
        self.forget(table, &all);
    }
    /// Bytes of tracking state held beside the table.
    fn memory_bytes(&self) -> usize;
}

/// `ceil(r·rows)`, at least one row.
pub fn budget(rows: usize, r: f64) -> usize {
    ((rows as f64 * r).ceil() as usize).clamp(1, rows.max(1))
}

/// A tracker of `kind` for `table`, saving `budget(rows, r)` rows per selection. `seed`
/// drives SSU's random discards.
pub fn build_prioritizer(
    kind: CprPriority,
    table: &EmbeddingTable,
    r: f64,
    ssu_period: u32,
    seed: u64,
) -> Box<dyn Prioritizer> {
    let b = budget(table.rows(), r);
    match kind {
        CprPriority::None => Box::new(NoPriority),
        CprPriority::Mfu => Box::new(Mfu::new(table.rows(), b)),
        CprPriority::Ssu => Box::new(Ssu::new(table.rows(), b, ssu_period, seed)),
        CprPriority::Scar => Box::new(Scar::new(table, b)),
    }
}

/// CPR-vanilla: every row, every time.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoPriority;

impl Prioritizer for NoPriority {
    fn kind(&self) -> CprPriority {
        CprPriority::None
    }
    fn record(&mut self, _rows: &[u32]) {}
    fn choose(&self, table: &EmbeddingTable) -> Vec<u32> {
        (0..table.rows() as u32).collect()
    }
    fn forget(&mut self, _table: &EmbeddingTable, _rows: &[u32]) {}
    fn reset(&mut self, _table: &EmbeddingTable) {}
    fn memory_bytes(&self) -> usize {
        0
    }
}

/// The `k` largest `(score, row)` by score, ties to the lower row, returned as rows
/// ascending.
pub(crate) fn top_k<S: Copy>(
    mut scored: Vec<(S, u32)>,
    k: usize,
    cmp: impl Fn(&S, &S) -> std::cmp::Ordering,
) -> Vec<u32> {
    let order = |a: &(S, u32), b: &(S, u32)| cmp(&b.0, &a.0).then(a.1.cmp(&b.1));
    if scored.len() > k {
        if k == 0 {
            return Vec::new();
        }
        scored.select_nth_unstable_by(k - 1, order);
        scored.truncate(k);
    }
    let mut rows: Vec<u32> = scored.into_iter().map(|(_, r)| r).collect();
    rows.sort_unstable();
    rows
}
