use crate::CprPriority;
use ftrec_model::EmbeddingTable;

use super::{Prioritizer, top_k};

/// SCAR (Qiao et al. 2019): the rows whose embedding moved furthest (L2) from the value
/// they were last saved with. The change is measured against a copy of each row's
/// embedding as last saved rather than accumulated from the updates: a sum of per-step
/// update norms overstates rows that oscillate, and a running sum of update vectors costs
/// the same `dim` floats per row as the copy while needing a hook in every optimizer. The
/// copy is the 100% memory overhead of the paper's Table 1 (embedding part only; the
/// optimizer state is saved with the row but does not rank it).
#[derive(Clone, Debug)]
pub struct Scar {
    saved: Vec<f32>,
    dim: usize,
    budget: usize,
}

impl Scar {
    /// Baselines start at the table's current values: the state the caller last saved (or
    /// can regenerate, like the initial model).
    pub fn new(table: &EmbeddingTable, budget: usize) -> Self {
        let dim = table.dim();
        let mut saved = Vec::with_capacity(table.rows() * dim);
        for r in 0..table.rows() {
            saved.extend_from_slice(table.embedding(r));
        }
        Self { saved, dim, budget }
    }

    /// Squared L2 distance of row `r` from its saved embedding.
    pub fn change(&self, table: &EmbeddingTable, r: usize) -> f32 {
        let base = &self.saved[r * self.dim..(r + 1) * self.dim];
        table
            .embedding(r)
            .iter()
            .zip(base)
            .map(|(a, b)| (a - b) * (a - b))
            .sum()
    }
}

impl Prioritizer for Scar {
    fn kind(&self) -> CprPriority {
        CprPriority::Scar
    }

    fn record(&mut self, _rows: &[u32]) {}

    fn choose(&self, table: &EmbeddingTable) -> Vec<u32> {
        let scored: Vec<(f32, u32)> = (0..table.rows())
            .map(|r| (self.change(table, r), r as u32))
            .filter(|&(c, _)| c > 0.0)
            .collect();
        top_k(scored, self.budget, f32::total_cmp)
    }

    fn forget(&mut self, table: &EmbeddingTable, rows: &[u32]) {
        for &r in rows {
            let r = r as usize;
            self.saved[r * self.dim..(r + 1) * self.dim].copy_from_slice(table.embedding(r));
        }
    }

    fn memory_bytes(&self) -> usize {
        self.saved.len() * std::mem::size_of::<f32>()
    }
}
