//! Delta tracking (DECK §3.1, §4.2): which rows changed since a reader last asked.
//!
//! The trainer calls [`DeltaTracker::track`] with each step's touched rows (already unique
//! per step) and [`DeltaTracker::compact`] every few steps to de-duplicate across steps.
//! Several tenants (a checkpointer, a publisher) read at their own intervals. Tracked rows
//! live in *segments*: a read seals the open segment, so each tenant gets exactly the union
//! of the segments sealed since its previous read, and compaction only ever merges within a
//! segment. A segment is dropped once every tenant has read it, so the tracker holds at most
//! one copy of a row per tenant.

use std::collections::VecDeque;

/// Identifies a reader registered with [`DeltaTracker::register`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenantId(usize);

#[derive(Clone, Debug, Default)]
struct Segment {
    /// Sequence number, increasing; set when sealed.
    seq: u64,
    /// Per table, sorted unique rows (compacted part).
    rows: Vec<Vec<u32>>,
    /// Per table, rows tracked since the last compaction, in arrival order.
    pending: Vec<Vec<u32>>,
}

impl Segment {
    fn new(tables: usize) -> Self {
        Self {
            seq: 0,
            rows: vec![Vec::new(); tables],
            pending: vec![Vec::new(); tables],
        }
    }

    fn compact(&mut self, scratch: &mut Vec<u32>) {
        for (rows, pending) in self.rows.iter_mut().zip(&mut self.pending) {
            if pending.is_empty() {
                continue;
            }
            pending.sort_unstable();
            pending.dedup();
            merge_sorted_unique(rows, pending, scratch);
            std::mem::swap(rows, scratch);
            pending.clear();
        }
    }
}

/// `out = a ∪ b` for sorted, duplicate-free inputs.
fn merge_sorted_unique(a: &[u32], b: &[u32], out: &mut Vec<u32>) {
    out.clear();
    out.reserve(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        out.push(x.min(y));
        i += (x <= y) as usize;
        j += (y <= x) as usize;
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
}

#[derive(Clone, Debug)]
struct Tenant {
    name: String,
    /// First segment sequence number this tenant has not read.
    next_seq: u64,
}

#[derive(Clone, Debug)]
pub struct DeltaTracker {
    tables: usize,
    sealed: VecDeque<Segment>,
    open: Segment,
    next_seq: u64,
    tenants: Vec<Tenant>,
    scratch: Vec<u32>,
}

impl DeltaTracker {
    pub fn new(tables: usize) -> Self {
        Self {
            tables,
            sealed: VecDeque::new(),
            open: Segment::new(tables),
            next_seq: 0,
            tenants: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Adds a reader. Its first read returns rows tracked from now on.
    pub fn register(&mut self, name: &str) -> TenantId {
        self.tenants.push(Tenant {
            name: name.to_string(),
            next_seq: self.next_seq,
        });
        TenantId(self.tenants.len() - 1)
    }

    pub fn tenant_name(&self, id: TenantId) -> &str {
        &self.tenants[id.0].name
    }

    /// Records rows of `table` updated by a step.
    pub fn track(&mut self, table: usize, rows: &[u32]) {
        self.open.pending[table].extend_from_slice(rows);
    }

    /// De-duplicates everything tracked since the last compaction into the open segment.
    pub fn compact(&mut self) {
        self.open.compact(&mut self.scratch);
    }

    /// Rows changed since this tenant's previous read (sorted, unique, per table), sealing
    /// the open segment. The tenant's next read starts after this one.
    pub fn take(&mut self, tenant: TenantId) -> Vec<Vec<u32>> {
        let out = self.peek(tenant);
        self.tenants[tenant.0].next_seq = self.next_seq;
        let oldest_needed = self
            .tenants
            .iter()
            .map(|t| t.next_seq)
            .min()
            .unwrap_or(self.next_seq);
        while self.sealed.front().is_some_and(|s| s.seq < oldest_needed) {
            self.sealed.pop_front();
        }
        out
    }

    /// Like [`DeltaTracker::take`], but the tenant's next read still includes these rows
    /// (a differential checkpoint reads everything since its baseline each time).
    pub fn peek(&mut self, tenant: TenantId) -> Vec<Vec<u32>> {
        self.compact();
        let mut sealed = std::mem::replace(&mut self.open, Segment::new(self.tables));
        sealed.seq = self.next_seq;
        self.next_seq += 1;
        self.sealed.push_back(sealed);
        let from = self.tenants[tenant.0].next_seq;
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); self.tables];
        for seg in self.sealed.iter().filter(|s| s.seq >= from) {
            for (acc, rows) in out.iter_mut().zip(&seg.rows) {
                merge_sorted_unique(acc, rows, &mut self.scratch);
                std::mem::swap(acc, &mut self.scratch);
            }
        }
        out
    }

    /// Rows held (sealed and open, compacted or not), to bound memory in tests and stats.
    pub fn held_rows(&self) -> usize {
        let seg = |s: &Segment| s.rows.iter().chain(&s.pending).map(Vec::len).sum::<usize>();
        self.sealed.iter().map(seg).sum::<usize>() + seg(&self.open)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[derive(Clone, Debug)]
    enum Op {
        Track(usize, Vec<u32>),
        Compact,
        Take(usize),
        Peek(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0usize..3, proptest::collection::vec(0u32..50, 0..12)).prop_map(|(t, r)| Op::Track(t, r)),
            1 => Just(Op::Compact),
            2 => (0usize..2).prop_map(Op::Take),
            1 => (0usize..2).prop_map(Op::Peek),
        ]
    }

    #[test]
    fn segments_are_dropped_once_every_tenant_has_read_them() {
        let mut tracker = DeltaTracker::new(1);
        let a = tracker.register("a");
        let b = tracker.register("b");
        tracker.track(0, &[3, 1, 3]);
        assert_eq!(tracker.take(a), vec![vec![1, 3]]);
        tracker.track(0, &[2]);
        assert_eq!(tracker.held_rows(), 3, "b has not read the first segment");
        assert_eq!(tracker.take(b), vec![vec![1, 2, 3]]);
        assert_eq!(tracker.take(a), vec![vec![2]]);
        assert_eq!(tracker.held_rows(), 0);
    }

    proptest! {
        #[test]
        fn each_tenant_gets_exactly_the_rows_changed_since_its_last_read(
            ops in proptest::collection::vec(op(), 0..80)
        ) {
            let mut tracker = DeltaTracker::new(3);
            let tenants = [tracker.register("checkpointer"), tracker.register("publisher")];
            // The model: per tenant, the set of rows tracked since its last read.
            let mut model = vec![vec![BTreeSet::new(); 3]; 2];
            for op in ops {
                match op {
                    Op::Track(t, rows) => {
                        tracker.track(t, &rows);
                        for m in &mut model {
                            m[t].extend(rows.iter().copied());
                        }
                    }
                    Op::Compact => tracker.compact(),
                    Op::Peek(k) => {
                        let got = tracker.peek(tenants[k]);
                        for t in 0..3 {
                            let want: Vec<u32> = model[k][t].iter().copied().collect();
                            prop_assert_eq!(&got[t], &want);
                        }
                    }
                    Op::Take(k) => {
                        let got = tracker.take(tenants[k]);
                        for t in 0..3 {
                            let want: Vec<u32> = std::mem::take(&mut model[k][t]).into_iter().collect();
                            prop_assert_eq!(&got[t], &want);
                        }
                    }
                }
            }
        }
    }
}
