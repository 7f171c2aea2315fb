/// One parsed sample: label, transformed dense values, and one bag of raw categorical
/// values per sparse feature (CSR: feature `f` owns `ids[offsets[f]..offsets[f + 1]]`).
/// Reused across lines to avoid allocation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Record {
    pub label: f32,
    pub dense: Vec<f32>,
    pub offsets: Vec<u32>,
    pub ids: Vec<u32>,
}

impl Record {
    pub fn clear(&mut self) {
        self.label = 0.0;
        self.dense.clear();
        self.ids.clear();
        self.offsets.clear();
        self.offsets.push(0);
    }

    /// Closes the bag of the current sparse feature.
    pub fn end_feature(&mut self) {
        self.offsets.push(self.ids.len() as u32);
    }

    pub fn num_sparse(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    pub fn feature(&self, f: usize) -> &[u32] {
        &self.ids[self.offsets[f] as usize..self.offsets[f + 1] as usize]
    }

    /// Whether every feature has exactly one value.
    pub fn is_single_hot(&self) -> bool {
        self.ids.len() == self.num_sparse() && self.offsets.windows(2).all(|w| w[1] == w[0] + 1)
    }
}

/// Criteo's dense transform: `log(1 + max(x, 0))`.
pub fn log1p_clamped(x: f64) -> f32 {
    x.max(0.0).ln_1p() as f32
}
