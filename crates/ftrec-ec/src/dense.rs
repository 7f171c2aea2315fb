//! Dense ranges erasure coded instead of replicated (`ec.replicate_dense = false`, ECRec
//! §3.3's alternative): each server's dense range (parameters, optimizer state and step,
//! as bytes) is a data row of a *dense stripe* of its group, and changes travel to the
//! stripe's parity holders as differences, like embedding rows.
//!
//! In a group of `n` members, dense stripe `j` holds the ranges of members `j·k ..
//! j·k + k` (positions past the last member are zero padding) and its parity rows live on
//! members `(j·k + k + p) mod n`, `p < r`. Those are never data members of the same stripe,
//! as `n >= k + r`.

use crate::layout::StripeLayout;

/// A parity row of a dense stripe: in group `group`, stripe `stripe`, parity index `p`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DenseParitySlot {
    pub group: usize,
    pub stripe: usize,
    pub p: usize,
}

impl StripeLayout {
    /// Dense stripes of group `g`.
    pub fn dense_stripes(&self, g: usize) -> usize {
        self.group(g).1.div_ceil(self.params.k)
    }

    /// The dense stripe of `server`'s range and its position there.
    pub fn dense_stripe_of(&self, server: usize) -> (usize, usize) {
        let (_, m) = self.group_of_server(server);
        (m / self.params.k, m % self.params.k)
    }

    /// The servers whose ranges are the data rows of dense stripe `j` of group `g`, by
    /// position (`None`: zero padding).
    pub fn dense_members(&self, g: usize, j: usize) -> Vec<Option<usize>> {
        let (start, n) = self.group(g);
        (0..self.params.k)
            .map(|i| {
                let m = j * self.params.k + i;
                (m < n).then_some(start + m)
            })
            .collect()
    }

    /// The server holding parity row `p` of dense stripe `j` of group `g`.
    pub fn dense_parity_holder(&self, g: usize, j: usize, p: usize) -> usize {
        let (start, n) = self.group(g);
        start + (j * self.params.k + self.params.k + p) % n
    }

    /// The dense parity rows `server` holds.
    pub fn dense_parity_held(&self, server: usize) -> Vec<DenseParitySlot> {
        let (g, _) = self.group_of_server(server);
        (0..self.dense_stripes(g))
            .flat_map(|stripe| {
                (0..self.params.r).map(move |p| DenseParitySlot {
                    group: g,
                    stripe,
                    p,
                })
            })
            .filter(|s| self.dense_parity_holder(s.group, s.stripe, s.p) == server)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use crate::EcParams;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn every_range_is_coded_once_and_parity_sits_apart(
            k in 1usize..4, r in 1usize..3, groups in 1usize..3, extra in 0usize..4
        ) {
            let servers = groups * (k + r) + extra;
            let layout = crate::StripeLayout::new(EcParams { k, r, groups }, servers).unwrap();
            let mut coded = vec![0; servers];
            let mut parity_rows = 0;
            for g in 0..groups {
                for j in 0..layout.dense_stripes(g) {
                    let members = layout.dense_members(g, j);
                    let holders: Vec<usize> =
                        (0..r).map(|p| layout.dense_parity_holder(g, j, p)).collect();
                    for (i, m) in members.iter().enumerate() {
                        if let Some(s) = *m {
                            coded[s] += 1;
                            prop_assert_eq!(layout.dense_stripe_of(s), (j, i));
                            prop_assert_eq!(layout.group_of_server(s).0, g);
                            prop_assert!(!holders.contains(&s), "a range's parity on its own server");
                        }
                    }
                    let mut distinct = holders.clone();
                    distinct.sort_unstable();
                    distinct.dedup();
                    prop_assert_eq!(distinct.len(), r);
                    for (p, &h) in holders.iter().enumerate() {
                        prop_assert_eq!(layout.group_of_server(h).0, g);
                        let slot = super::DenseParitySlot { group: g, stripe: j, p };
                        prop_assert!(layout.dense_parity_held(h).contains(&slot));
                    }
                    parity_rows += r;
                }
            }
            prop_assert!(coded.iter().all(|&c| c == 1));
            let held: usize = (0..servers).map(|s| layout.dense_parity_held(s).len()).sum();
            prop_assert_eq!(held, parity_rows);
        }
    }
}
