//! The slots of an erasure-coded replacement not yet rebuilt (ECRec §3.4 with a background
//! rebuild): which local data rows and parity rows still hold zeros rather than their
//! decoded bytes. A pending data row is never served or updated, and a pending parity row
//! never folds a difference; the rebuild installs each slot from a consistent snapshot of
//! its stripe, and from then on the slot is ordinary.

use ftrec_rpc::PsError;

/// A fixed-size bit set, one bit per local slot.
#[derive(Clone, Debug, Default)]
struct Bits {
    words: Vec<u64>,
    len: usize,
}

impl Bits {
    fn with_len(len: usize) -> Self {
        Self {
            words: vec![0; len.div_ceil(64)],
            len,
        }
    }

    fn get(&self, i: usize) -> bool {
        i < self.len
            && self
                .words
                .get(i / 64)
                .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    fn set(&mut self, i: usize) -> bool {
        let Some(w) = self.words.get_mut(i / 64).filter(|_| i < self.len) else {
            return false;
        };
        let was = *w & (1 << (i % 64)) != 0;
        *w |= 1 << (i % 64);
        !was
    }

    /// Sets every bit in `range` (clipped to the length), a word at a time; returns how
    /// many were not set before.
    fn set_range(&mut self, range: std::ops::Range<usize>) -> usize {
        let (start, end) = (range.start, range.end.min(self.len));
        let mut newly = 0;
        let mut i = start;
        while i < end {
            let (word, bit) = (i / 64, i % 64);
            let span = (64 - bit).min(end - i);
            let mask = if span == 64 {
                u64::MAX
            } else {
                ((1u64 << span) - 1) << bit
            };
            let w = &mut self.words[word];
            newly += (mask & !*w).count_ones() as usize;
            *w |= mask;
            i += span;
        }
        newly
    }

    fn clear(&mut self, i: usize) -> bool {
        let Some(w) = self.words.get_mut(i / 64).filter(|_| i < self.len) else {
            return false;
        };
        let was = *w & (1 << (i % 64)) != 0;
        *w &= !(1 << (i % 64));
        was
    }

    /// Whether any bit in `range` is set, a word at a time.
    fn any_in(&self, range: std::ops::Range<usize>) -> bool {
        let (start, end) = (range.start, range.end.min(self.len));
        let mut i = start;
        while i < end {
            let (word, bit) = (i / 64, i % 64);
            let span = (64 - bit).min(end - i);
            let mask = if span == 64 {
                u64::MAX
            } else {
                ((1u64 << span) - 1) << bit
            };
            if self.words[word] & mask != 0 {
                return true;
            }
            i += span;
        }
        false
    }

    /// Clears every bit in `range`, returning the maximal runs that were set, ascending:
    /// what a range install copies, one copy per run.
    fn take_runs(&mut self, range: std::ops::Range<usize>) -> Vec<std::ops::Range<usize>> {
        let (start, end) = (range.start, range.end.min(self.len));
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        let mut i = start;
        while i < end {
            let (word, bit) = (i / 64, i % 64);
            let w = self.words[word];
            let span = (64 - bit).min(end - i);
            // Whole words set or clear are the common cases: skip them in one step.
            let mask = if span == 64 {
                u64::MAX
            } else {
                ((1u64 << span) - 1) << bit
            };
            if w & mask == mask || w & mask == 0 {
                if w & mask != 0 {
                    match runs.last_mut() {
                        Some(last) if last.end == i => last.end = i + span,
                        _ => runs.push(i..i + span),
                    }
                    self.words[word] &= !mask;
                }
                i += span;
                continue;
            }
            if w & (1 << bit) != 0 {
                match runs.last_mut() {
                    Some(last) if last.end == i => last.end = i + 1,
                    _ => runs.push(i..i + 1),
                }
                self.words[word] &= !(1 << bit);
            }
            i += 1;
        }
        runs
    }

    /// The set bits in `range`, ascending.
    fn ones_in(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        range.filter(|&i| self.get(i)).map(|i| i as u32).collect()
    }
}

/// Per table: the pending data slots and parity slots.
#[derive(Clone, Debug, Default)]
pub struct Pending {
    data: Vec<Bits>,
    parity: Vec<Bits>,
    remaining: usize,
}

impl Pending {
    /// Nothing pending yet, shaped for `data_slots[t]` and `parity_slots[t]` per table.
    pub fn new(data_slots: &[usize], parity_slots: &[usize]) -> Self {
        Self {
            data: data_slots.iter().map(|&n| Bits::with_len(n)).collect(),
            parity: parity_slots.iter().map(|&n| Bits::with_len(n)).collect(),
            remaining: 0,
        }
    }

    pub fn mark_data(&mut self, table: usize, local: usize) {
        if self.data.get_mut(table).is_some_and(|b| b.set(local)) {
            self.remaining += 1;
        }
    }

    /// Marks data slots `range` of `table` at once (a word at a time).
    pub fn mark_data_range(&mut self, table: usize, range: std::ops::Range<usize>) {
        if let Some(b) = self.data.get_mut(table) {
            self.remaining += b.set_range(range);
        }
    }

    /// Marks parity slots `range` of `table` at once.
    pub fn mark_parity_range(&mut self, table: usize, range: std::ops::Range<usize>) {
        if let Some(b) = self.parity.get_mut(table) {
            self.remaining += b.set_range(range);
        }
    }

    pub fn mark_parity(&mut self, table: usize, local: usize) {
        if self.parity.get_mut(table).is_some_and(|b| b.set(local)) {
            self.remaining += 1;
        }
    }

    pub fn data(&self, table: usize, local: usize) -> bool {
        self.data.get(table).is_some_and(|b| b.get(local))
    }

    pub fn parity(&self, table: usize, local: usize) -> bool {
        self.parity.get(table).is_some_and(|b| b.get(local))
    }

    pub fn clear_data(&mut self, table: usize, local: usize) {
        if self.data.get_mut(table).is_some_and(|b| b.clear(local)) {
            self.remaining -= 1;
        }
    }

    pub fn clear_parity(&mut self, table: usize, local: usize) {
        if self.parity.get_mut(table).is_some_and(|b| b.clear(local)) {
            self.remaining -= 1;
        }
    }

    /// Pending data and parity slots of `table` with local index in `range`.
    pub fn in_range(&self, table: usize, range: std::ops::Range<usize>) -> (Vec<u32>, Vec<u32>) {
        let ones = |b: &[Bits]| {
            b.get(table)
                .map_or_else(Vec::new, |b| b.ones_in(range.clone()))
        };
        (ones(&self.data), ones(&self.parity))
    }

    /// Whether any data slot of `table` in `range` is pending.
    pub fn any_data_in(&self, table: usize, range: std::ops::Range<usize>) -> bool {
        self.data.get(table).is_some_and(|b| b.any_in(range))
    }

    /// Whether any parity slot of `table` in `range` is pending.
    pub fn any_parity_in(&self, table: usize, range: std::ops::Range<usize>) -> bool {
        self.parity.get(table).is_some_and(|b| b.any_in(range))
    }

    /// Slots still pending, over every table.
    pub fn remaining(&self) -> usize {
        self.remaining
    }
}

/// A shard's side of a background rebuild.
impl super::Shard {
    /// A row still being rebuilt is neither served nor updated: its slot holds zeros.
    pub(super) fn check_not_pending(
        &self,
        table: usize,
        row: u32,
        local: usize,
    ) -> Result<(), PsError> {
        if self.pending.as_ref().is_some_and(|p| p.data(table, local)) {
            return Err(PsError::Recovering {
                table: table as u32,
                first_row: row,
                end_row: row + 1,
            });
        }
        Ok(())
    }

    /// The slots a background rebuild has not decoded yet (`None`: none, or no rebuild).
    pub fn pending(&self) -> Option<&Pending> {
        self.pending.as_ref()
    }

    /// The local indices of `rows` of `table` (global, owned here) still pending.
    pub fn pending_locals(&self, table: usize, rows: &[u32]) -> Vec<u32> {
        let Some(pending) = &self.pending else {
            return Vec::new();
        };
        rows.iter()
            .filter_map(|&row| {
                let local = self.local(table, row).ok()?;
                pending.data(table, local).then_some(local as u32)
            })
            .collect()
    }

    /// Starts a background rebuild: every slot in `pending` holds zeros until installed.
    pub fn begin_background_rebuild(&mut self, pending: Pending) {
        self.pending = (pending.remaining() > 0).then_some(pending);
    }

    /// Installs decoded data rows into pending slots of `table`, skipping slots that are
    /// pending no more. Returns the bytes installed. (A pending parity slot is never
    /// needed on demand: it folds no difference until the background rebuild installs it.)
    pub fn install_decoded(&mut self, table: usize, data: &[(u32, &[u8])]) -> Result<u64, PsError> {
        let Some(pending) = self.pending.as_mut() else {
            return Ok(0);
        };
        let mut installed = 0u64;
        let stored = self
            .state
            .tables_mut()
            .get_mut(table)
            .ok_or_else(|| PsError::BadRequest(format!("table {table} does not exist")))?;
        for &(local, bytes) in data {
            let local = local as usize;
            if !pending.data(table, local) {
                continue;
            }
            let row = stored.row_mut(local);
            if bytes.len() != row.len() * 4 {
                return Err(PsError::BadRequest(format!(
                    "a decoded row of {} bytes for rows of {}",
                    bytes.len(),
                    row.len() * 4
                )));
            }
            bytemuck::cast_slice_mut::<f32, u8>(row).copy_from_slice(bytes);
            pending.clear_data(table, local);
            installed += bytes.len() as u64;
        }
        if pending.remaining() == 0 {
            self.pending = None;
        }
        Ok(installed)
    }

    /// Decodes a range's pending slots straight into the table and the parity: `decode`
    /// gets the data slots `data` and parity slots `parity` of `table` as bytes (whole rows
    /// from each range's first slot) and a test of whether a slot, counted from its range's
    /// start (`true`: parity), is still pending; it must write every pending slot and no
    /// other. Once it succeeds those slots are ordinary. No buffer and no second copy: the
    /// rebuild's install copy and its page faults were a quarter of the replacement's CPU
    /// (perf, issue 23). If `decode` fails, no slot is installed (a pending slot's bytes
    /// are never read). Returns the bytes installed.
    pub fn install_decoding_ranges(
        &mut self,
        table: usize,
        data: std::ops::Range<usize>,
        parity: std::ops::Range<usize>,
        decode: impl FnOnce(&mut [u8], &mut [u8], &dyn Fn(bool, usize) -> bool) -> Result<(), PsError>,
    ) -> Result<u64, PsError> {
        let Some(pending) = self.pending.as_mut() else {
            return Ok(0);
        };
        let stored = self
            .state
            .tables_mut()
            .get_mut(table)
            .ok_or_else(|| PsError::BadRequest(format!("table {table} does not exist")))?;
        let row_bytes = stored.stride() * 4;
        let outside = |what: &str, run: &std::ops::Range<usize>| {
            PsError::BadRequest(format!(
                "decoded {what} slots {}..{} are outside table {table}",
                run.start, run.end
            ))
        };
        let table_bytes = bytemuck::cast_slice_mut::<f32, u8>(stored.as_mut_slice());
        let data_out = table_bytes
            .get_mut(data.start * row_bytes..data.end * row_bytes)
            .ok_or_else(|| outside("data", &data))?;
        let mut no_parity: [u8; 0] = [];
        let parity_out = match self.redundancy.as_mut() {
            Some(red) => red
                .parity
                .get_mut(table)
                .and_then(|p| p.get_mut(parity.start * row_bytes..parity.end * row_bytes))
                .ok_or_else(|| outside("parity", &parity))?,
            None if parity.is_empty() => &mut no_parity[..],
            None => return Err(outside("parity", &parity)),
        };
        {
            let bits = &*pending;
            let is_pending = |is_parity: bool, slot: usize| {
                if is_parity {
                    bits.parity(table, parity.start + slot)
                } else {
                    bits.data(table, data.start + slot)
                }
            };
            decode(data_out, parity_out, &is_pending)?;
        }
        let mut installed = 0u64;
        for (bits, range) in [
            (pending.data.get_mut(table), data),
            (pending.parity.get_mut(table), parity),
        ] {
            let runs = bits.map(|b| b.take_runs(range)).unwrap_or_default();
            for run in runs {
                pending.remaining -= run.len();
                installed += (run.len() * row_bytes) as u64;
            }
        }
        if pending.remaining == 0 {
            self.pending = None;
        }
        Ok(installed)
    }

    /// Whether parity slot `local` of `table` is still being rebuilt (its differences are
    /// not folded: the rebuild encodes it from data rows that already hold them).
    pub fn parity_pending(&self, table: usize, local: usize) -> bool {
        self.pending
            .as_ref()
            .is_some_and(|p| p.parity(table, local))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Marking a range a word at a time equals marking it slot by slot, counts
        /// included, over slots already marked too.
        #[test]
        fn a_range_marks_what_its_slots_mark(
            len in 0usize..300,
            before in proptest::collection::vec(0usize..300, 0..20),
            start in 0usize..320,
            span in 0usize..320,
        ) {
            let (mut fast, mut slow) = (Pending::new(&[len], &[len]), Pending::new(&[len], &[len]));
            for &i in &before {
                fast.mark_data(0, i);
                slow.mark_data(0, i);
            }
            fast.mark_data_range(0, start..start + span);
            fast.mark_parity_range(0, start..start + span);
            for i in start..start + span {
                slow.mark_data(0, i);
                slow.mark_parity(0, i);
            }
            prop_assert_eq!(fast.remaining(), slow.remaining());
            for i in 0..len + 5 {
                prop_assert_eq!(fast.data(0, i), slow.data(0, i));
                prop_assert_eq!(fast.parity(0, i), slow.parity(0, i));
            }
        }
    }

    proptest! {
        /// Taking the runs of a range clears exactly the bits a slot-by-slot pass clears,
        /// and the runs are maximal, ascending and cover those bits; `any_in` agrees.
        #[test]
        fn runs_taken_are_the_set_bits_of_the_range(
            len in 0usize..300,
            set in proptest::collection::vec(0usize..300, 0..200),
            start in 0usize..320,
            span in 0usize..320,
        ) {
            let mut bits = Bits::with_len(len);
            for &i in &set {
                bits.set(i);
            }
            let before = bits.clone();
            let range = start..start + span;
            prop_assert_eq!(bits.any_in(range.clone()), !bits.ones_in(range.clone()).is_empty());
            let runs = bits.take_runs(range.clone());
            let mut covered = Vec::new();
            for (n, run) in runs.iter().enumerate() {
                prop_assert!(run.start < run.end);
                if n > 0 {
                    prop_assert!(runs[n - 1].end < run.start, "runs are maximal and ascending");
                }
                covered.extend(run.clone().map(|i| i as u32));
            }
            prop_assert_eq!(covered, before.ones_in(range.clone()));
            for i in 0..len + 5 {
                let expect = before.get(i) && !range.contains(&i);
                prop_assert_eq!(bits.get(i), expect);
            }
        }
    }

    #[test]
    fn marks_and_clears_count_each_slot_once() {
        let mut p = Pending::new(&[100, 10], &[70, 3]);
        p.mark_data(0, 99);
        p.mark_data(0, 99);
        p.mark_parity(1, 2);
        p.mark_data(0, 100); // outside: ignored
        assert_eq!(p.remaining(), 2);
        assert!(p.data(0, 99) && !p.data(0, 98) && p.parity(1, 2) && !p.parity(0, 2));
        assert_eq!(p.in_range(0, 64..100), (vec![99], vec![]));
        p.clear_data(0, 99);
        p.clear_data(0, 99);
        p.clear_parity(1, 2);
        assert_eq!(p.remaining(), 0);
    }
}
