//! Per-batch de-duplication of one table's ids and the aggregation of pooled gradients into
//! one gradient per unique row. A worker of the parameter server does the same: it pulls
//! each unique row once and pushes one aggregated gradient per row, so single-process and
//! cluster training apply bit-identical updates.

use crate::{Bags, EmbeddingTable};

/// The unique rows of one table in a batch (ascending), and for each id occurrence the
/// index of its unique row. Buffers are reused across batches.
#[derive(Clone, Debug, Default)]
pub struct TableDedup {
    pub unique: Vec<u32>,
    pub occurrence_to_unique: Vec<u32>,
    sort_keys: Vec<u64>,
    radix_scratch: Vec<u64>,
}

/// Bits of the row id sorted per radix pass: a 2048-bucket histogram (8 KiB) stays in L1.
const RADIX_BITS: u32 = 11;
/// Below this many ids a comparison sort is cheaper. (A `u32` row needs at most three
/// passes.)
const RADIX_MIN_IDS: usize = 256;

impl TableDedup {
    pub fn build(&mut self, bags: &Bags) {
        let ids = &bags.rows;
        self.sort_keys.clear();
        self.sort_keys.extend(
            ids.iter()
                .enumerate()
                .map(|(pos, &row)| ((row as u64) << 32) | pos as u64),
        );
        let row_bits = u32::BITS - ids.iter().max().map_or(0, |m| m.leading_zeros());
        let passes = row_bits.div_ceil(RADIX_BITS);
        if ids.len() >= RADIX_MIN_IDS {
            radix_sort_by_row(&mut self.sort_keys, &mut self.radix_scratch, passes);
        } else {
            self.sort_keys.sort_unstable();
        }
        self.unique.clear();
        self.occurrence_to_unique.clear();
        self.occurrence_to_unique.resize(ids.len(), 0);
        for &key in &self.sort_keys {
            let row = (key >> 32) as u32;
            if self.unique.last() != Some(&row) {
                self.unique.push(row);
            }
            self.occurrence_to_unique[(key & 0xFFFF_FFFF) as usize] =
                (self.unique.len() - 1) as u32;
        }
    }
}

/// Sorts `(row << 32) | position` keys, built in position order, by row: least
/// significant digit first, `passes` stable passes over the row's bits. Positions are
/// unique and start ascending, and every pass is stable, so the result is the keys in
/// ascending order: what `sort_unstable` gives, at a quarter of its cost on a batch's
/// 2048 ids (the `prepare` phase).
fn radix_sort_by_row(keys: &mut Vec<u64>, scratch: &mut Vec<u64>, passes: u32) {
    const BUCKETS: usize = 1 << RADIX_BITS;
    scratch.clear();
    scratch.resize(keys.len(), 0);
    let mut counts = [0usize; BUCKETS];
    for pass in 0..passes {
        let shift = 32 + pass * RADIX_BITS;
        let digit = |key: u64| ((key >> shift) as usize) & (BUCKETS - 1);
        counts.fill(0);
        for &key in keys.iter() {
            counts[digit(key)] += 1;
        }
        let mut start = 0;
        for count in counts.iter_mut() {
            let n = *count;
            *count = start;
            start += n;
        }
        for &key in keys.iter() {
            let slot = &mut counts[digit(key)];
            scratch[*slot] = key;
            *slot += 1;
        }
        std::mem::swap(keys, scratch);
    }
}

/// Sum-pools one bag into `dst`: the first row copied, the others added in bag order; an
/// empty bag pools to zeros.
#[inline]
fn pool_rows<'a>(mut rows: impl Iterator<Item = &'a [f32]>, dst: &mut [f32]) {
    let Some(first) = rows.next() else {
        dst.fill(0.0);
        return;
    };
    dst.copy_from_slice(first);
    for row in rows {
        for (d, v) in dst.iter_mut().zip(row) {
            *d += v;
        }
    }
}

/// Sum-pools sample `b`'s bag of one table into `dst` (`dim` values) from `pulled` (the
/// table's unique embeddings, `[unique x dim]`).
#[inline]
pub(crate) fn pool_sample(
    bags: &Bags,
    dedup: &TableDedup,
    pulled: &[f32],
    b: usize,
    dst: &mut [f32],
) {
    let dim = dst.len();
    let (lo, hi) = (bags.offsets[b] as usize, bags.offsets[b + 1] as usize);
    let rows = dedup.occurrence_to_unique[lo..hi]
        .iter()
        .map(|&u| &pulled[u as usize * dim..(u as usize + 1) * dim]);
    pool_rows(rows, dst);
}

/// [`pool_sample`] from the table itself rather than from pulled copies of its rows:
/// the same rows added in the same order.
#[inline]
pub(crate) fn pool_sample_from(bags: &Bags, table: &EmbeddingTable, b: usize, dst: &mut [f32]) {
    let (lo, hi) = (bags.offsets[b] as usize, bags.offsets[b + 1] as usize);
    pool_rows(
        bags.rows[lo..hi]
            .iter()
            .map(|&r| table.embedding(r as usize)),
        dst,
    );
}

/// Asks the CPU to bring the rows of sample `b`'s bag into cache; does nothing off x86.
#[inline]
pub(crate) fn prefetch_bag(bags: &Bags, table: &EmbeddingTable, b: usize) {
    let (lo, hi) = (bags.offsets[b] as usize, bags.offsets[b + 1] as usize);
    for &row in &bags.rows[lo..hi] {
        crate::prefetch::prefetch_read(table.embedding(row as usize));
    }
}

/// Aggregates the pooled gradient of every sample into `grads [unique x dim]`: each unique
/// row receives the sum of its occurrences' gradients, added in occurrence order. Sample
/// `b`'s pooled gradient is `pooled[b * sample_stride + offset..][..dim]`.
#[multiversion::multiversion(targets = "simd")]
pub(crate) fn aggregate_gradients(
    bags: &Bags,
    dedup: &TableDedup,
    pooled: &[f32],
    sample_stride: usize,
    offset: usize,
    dim: usize,
    grads: &mut Vec<f32>,
) {
    grads.clear();
    grads.resize(dedup.unique.len() * dim, 0.0);
    for b in 0..bags.samples() {
        let g = &pooled[b * sample_stride + offset..b * sample_stride + offset + dim];
        for occ in bags.offsets[b] as usize..bags.offsets[b + 1] as usize {
            let u = dedup.occurrence_to_unique[occ] as usize;
            for (d, v) in grads[u * dim..(u + 1) * dim].iter_mut().zip(g) {
                *d += v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The radix path gives what a comparison sort gives, for tables of every size.
        #[test]
        fn radix_dedup_matches_a_comparison_sort(
            rows in prop::collection::vec(0u32..(1 << 20), 0..3000),
            row_limit in prop::sample::select(vec![1u32, 7, 2048, 100_000, 1 << 20]),
        ) {
            let mut bags = Bags::default();
            for chunk in rows.chunks(3) {
                bags.push_bag(chunk.iter().map(|r| r % row_limit));
            }
            let mut dedup = TableDedup::default();
            dedup.build(&bags);
            let mut keys: Vec<u64> = bags.rows.iter().enumerate()
                .map(|(pos, &row)| ((row as u64) << 32) | pos as u64).collect();
            keys.sort_unstable();
            let mut unique: Vec<u32> = keys.iter().map(|k| (k >> 32) as u32).collect();
            unique.dedup();
            prop_assert_eq!(&dedup.unique, &unique);
            for (occ, &row) in bags.rows.iter().enumerate() {
                prop_assert_eq!(dedup.unique[dedup.occurrence_to_unique[occ] as usize], row);
            }
        }
    }

    #[test]
    fn dedup_maps_every_occurrence_to_its_sorted_unique_row() {
        let mut bags = Bags::default();
        bags.push_bag([5, 3]);
        bags.push_bag([5]);
        bags.push_bag([]);
        bags.push_bag([9, 3, 3]);
        let mut d = TableDedup::default();
        d.build(&bags);
        assert_eq!(d.unique, vec![3, 5, 9]);
        assert_eq!(d.occurrence_to_unique, vec![1, 0, 1, 2, 0, 0]);
        let grads_in: Vec<f32> = vec![1.0, 10.0, 100.0, 1000.0]; // dim 1, one per sample
        let mut g = Vec::new();
        aggregate_gradients(&bags, &d, &grads_in, 1, 0, 1, &mut g);
        // row 3: sample0 + 2*sample3; row 5: sample0 + sample1; row 9: sample3
        assert_eq!(g, vec![2001.0, 11.0, 1000.0]);
    }
}
