use crate::CprPriority;
use ftrec_model::EmbeddingTable;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use super::Prioritizer;

/// CPR-SSU: every `period`-th access is recorded into a list of at most `budget` distinct
/// rows. When a new row finds the list full, one of the `budget + 1` candidates (the list
/// and the newcomer) is discarded at random, so rows accessed often keep coming back and
/// are the likeliest to be in the list when it is saved: sub-sampling works as a filter
/// for hot rows (§4.2). Membership is a bitmap of `N` bits so no row enters twice.
#[derive(Clone, Debug)]
pub struct Ssu {
    list: Vec<u32>,
    member: Vec<u64>,
    budget: usize,
    period: u64,
    seen: u64,
    rng: Xoshiro256PlusPlus,
}

impl Ssu {
    pub fn new(rows: usize, budget: usize, period: u32, seed: u64) -> Self {
        Self {
            list: Vec::with_capacity(budget),
            member: vec![0; rows.div_ceil(64)],
            budget,
            period: u64::from(period.max(1)),
            seen: 0,
            rng: Xoshiro256PlusPlus::seed_from_u64(seed),
        }
    }

    fn contains(&self, row: u32) -> bool {
        self.member[row as usize / 64] & (1 << (row % 64)) != 0
    }

    fn mark(&mut self, row: u32, on: bool) {
        let (w, bit) = (row as usize / 64, 1u64 << (row % 64));
        if on {
            self.member[w] |= bit;
        } else {
            self.member[w] &= !bit;
        }
    }

    fn insert(&mut self, row: u32) {
        if self.contains(row) || self.budget == 0 {
            return;
        }
        if self.list.len() < self.budget {
            self.list.push(row);
            self.mark(row, true);
            return;
        }
        let victim = self.rng.gen_range(0..=self.budget);
        if victim < self.budget {
            let old = std::mem::replace(&mut self.list[victim], row);
            self.mark(old, false);
            self.mark(row, true);
        }
    }

    pub fn listed(&self) -> usize {
        self.list.len()
    }
}

impl Prioritizer for Ssu {
    fn kind(&self) -> CprPriority {
        CprPriority::Ssu
    }

    fn record(&mut self, rows: &[u32]) {
        for &r in rows {
            if self.seen.is_multiple_of(self.period) {
                self.insert(r);
            }
            self.seen += 1;
        }
    }

    fn choose(&self, _table: &EmbeddingTable) -> Vec<u32> {
        let mut rows = self.list.clone();
        rows.sort_unstable();
        rows
    }

    fn reset(&mut self, _table: &EmbeddingTable) {
        for r in std::mem::take(&mut self.list) {
            self.mark(r, false);
        }
        self.list.reserve(self.budget);
    }

    fn forget(&mut self, _table: &EmbeddingTable, rows: &[u32]) {
        let before = self.list.len();
        for &r in rows {
            self.mark(r, false);
        }
        let member = &self.member;
        self.list
            .retain(|&r| member[r as usize / 64] & (1 << (r % 64)) != 0);
        debug_assert!(self.list.len() <= before);
    }

    fn memory_bytes(&self) -> usize {
        self.budget * std::mem::size_of::<u32>() + self.member.len() * 8
    }
}
