use crate::CprPriority;
use ftrec_model::EmbeddingTable;

use super::{Prioritizer, top_k};

/// CPR-MFU: the most frequently used rows since their last save. A row not accessed since
/// its last save has not changed, so it is never chosen even when the budget has room.
#[derive(Clone, Debug)]
pub struct Mfu {
    counts: Vec<u32>,
    budget: usize,
}

impl Mfu {
    pub fn new(rows: usize, budget: usize) -> Self {
        Self {
            counts: vec![0; rows],
            budget,
        }
    }

    pub fn count(&self, row: u32) -> u32 {
        self.counts[row as usize]
    }
}

impl Prioritizer for Mfu {
    fn kind(&self) -> CprPriority {
        CprPriority::Mfu
    }

    fn record(&mut self, rows: &[u32]) {
        for &r in rows {
            // Saturating: a counter that hits the ceiling still ranks first.
            let c = &mut self.counts[r as usize];
            *c = c.saturating_add(1);
        }
    }

    fn choose(&self, _table: &EmbeddingTable) -> Vec<u32> {
        let scored: Vec<(u32, u32)> = self
            .counts
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c > 0)
            .map(|(r, &c)| (c, r as u32))
            .collect();
        top_k(scored, self.budget, |a, b| a.cmp(b))
    }

    fn forget(&mut self, _table: &EmbeddingTable, rows: &[u32]) {
        for &r in rows {
            self.counts[r as usize] = 0;
        }
    }

    fn reset(&mut self, _table: &EmbeddingTable) {
        self.counts.fill(0);
    }

    fn memory_bytes(&self) -> usize {
        self.counts.len() * std::mem::size_of::<u32>()
    }
}
