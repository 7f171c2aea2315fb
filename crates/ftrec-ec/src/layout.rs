//! Scheme `stripe-rotate-v1`: where every data row and parity row of a table lives.
//!
//! - Rows `j*k .. j*k + k` of a table form stripe `j`. A partial last stripe is padded with
//!   rows that stay zero (they are stored, never served, and encode as zero).
//! - The servers are split into `groups` contiguous groups that code within themselves
//!   (ECRec §4); stripe `j` goes to group `j mod G` as its `q = j / G`-th stripe.
//! - In a group of `n >= k + r` servers the stripe's rotation is `o = (q + t) mod n` (`t`
//!   the table, so that every table's stripe 0 is not on the same servers): data row `i`
//!   lives on member `(o + i) mod n`, parity row `p` on member `(o + k + p) mod n`. Over any
//!   `n` consecutive stripes every member holds `k` data rows and `r` parity rows, so
//!   parity load is even (ECRec Fig. 3).
//! - Member `m` stores the data row `i` of its `q`-th stripe at local index
//!   `(q / n) * k + i`, and parity row `p` at `(q / n) * r + p`: dense, and each cycle of
//!   `n` stripes fills exactly `k` data and `r` parity slots (the rotation gives every
//!   position `i` one distinct offset).

use serde::{Deserialize, Serialize};

use crate::EcError;

pub const SCHEME: &str = "stripe-rotate-v1";

/// `ec.*` settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EcParams {
    /// Data rows per stripe.
    pub k: usize,
    /// Parity rows per stripe: how many servers of a group may be lost at once.
    pub r: usize,
    /// Groups the servers are split into; each codes within itself.
    pub groups: usize,
}

impl EcParams {
    /// Checks the parameters against a cluster of `servers`, naming the keys.
    pub fn validate(&self, servers: usize) -> Result<(), EcError> {
        if self.k == 0 || self.r == 0 {
            return Err(EcError::Config(format!(
                "ec.k = {} and ec.r = {}: both must be at least 1",
                self.k, self.r
            )));
        }
        if self.k + self.r > 255 {
            return Err(EcError::Config(format!(
                "ec.k + ec.r = {}: GF(2^8) codes have at most 255 rows per stripe",
                self.k + self.r
            )));
        }
        if self.groups == 0 {
            return Err(EcError::Config("ec.groups must be at least 1".into()));
        }
        let smallest = servers / self.groups;
        if smallest < self.k + self.r {
            return Err(EcError::Config(format!(
                "cluster.servers = {servers} in ec.groups = {}: the smallest group has \
                 {smallest} servers, and a stripe needs ec.k + ec.r = {} distinct servers",
                self.groups,
                self.k + self.r
            )));
        }
        Ok(())
    }
}

/// A row slot on a server: a data row or a parity row of a stripe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StripeSlot {
    pub server: usize,
    /// Index into the server's data rows (data slot) or parity rows (parity slot).
    pub local: usize,
}

/// Row `n` of a stripe within a cycle: its holder, and its slot there as an offset into
/// the holder's cycle (data slot `cycle * k + offset`, or parity slot `cycle * r + offset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CycleRow {
    pub server: usize,
    pub parity: bool,
    pub offset: usize,
}

/// One stripe of a cycle in which a given server holds row `mine` (data rows first, then
/// parity rows), with all `k + r` rows of the stripe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CycleStripe {
    pub stripe_in_cycle: usize,
    pub mine: usize,
    pub rows: Vec<CycleRow>,
}

/// The arithmetic of `stripe-rotate-v1` for a fixed cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StripeLayout {
    pub params: EcParams,
    pub servers: usize,
}

impl StripeLayout {
    pub fn new(params: EcParams, servers: usize) -> Result<Self, EcError> {
        params.validate(servers)?;
        Ok(Self { params, servers })
    }

    fn k(&self) -> usize {
        self.params.k
    }

    fn r(&self) -> usize {
        self.params.r
    }

    /// First server and size of group `g`: contiguous, the remainder spread over the
    /// first groups.
    pub fn group(&self, g: usize) -> (usize, usize) {
        let groups = self.params.groups;
        let base = self.servers / groups;
        let extra = self.servers % groups;
        let start = g * base + g.min(extra);
        (start, base + usize::from(g < extra))
    }

    /// The group of `server` and its member index there.
    pub fn group_of_server(&self, server: usize) -> (usize, usize) {
        let groups = self.params.groups;
        let base = self.servers / groups;
        let extra = self.servers % groups;
        let big = extra * (base + 1);
        if server < big {
            (server / (base + 1), server % (base + 1))
        } else {
            let g = extra + (server - big) / base;
            (g, (server - big) % base)
        }
    }

    /// Stripes of a `rows`-row table.
    pub fn stripes(&self, rows: usize) -> usize {
        rows.div_ceil(self.k())
    }

    /// Stripe and position of `row`.
    pub fn stripe_of(&self, row: usize) -> (usize, usize) {
        (row / self.k(), row % self.k())
    }

    /// Group, stripe number within the group, and rotation offset of stripe `j`.
    fn place(&self, table: usize, stripe: usize) -> (usize, usize, usize) {
        let g = stripe % self.params.groups;
        let q = stripe / self.params.groups;
        let n = self.group(g).1;
        (g, q, (q + table) % n)
    }

    /// Where data row `position` of stripe `stripe` lives.
    pub fn data_slot(&self, table: usize, stripe: usize, position: usize) -> StripeSlot {
        let (g, q, o) = self.place(table, stripe);
        let (start, n) = self.group(g);
        StripeSlot {
            server: start + (o + position) % n,
            local: (q / n) * self.k() + position,
        }
    }

    /// Where parity row `p` of stripe `stripe` lives. Asked for every changed row of every
    /// step (the parity propagator), so one group, the common case, takes the
    /// subtraction-reduced path of [`StripeLayout::row_slot`].
    pub fn parity_slot(&self, table: usize, stripe: usize, p: usize) -> StripeSlot {
        if self.params.groups == 1 {
            let n = self.servers;
            let (cycle, in_cycle) = (stripe / n, stripe % n);
            let mut rotation = in_cycle + table % n;
            if rotation >= n {
                rotation -= n;
            }
            // k + p < k + r <= n.
            let mut server = rotation + self.k() + p;
            if server >= n {
                server -= n;
            }
            return StripeSlot {
                server,
                local: cycle * self.r() + p,
            };
        }
        let (g, q, o) = self.place(table, stripe);
        let (start, n) = self.group(g);
        StripeSlot {
            server: start + (o + self.k() + p) % n,
            local: (q / n) * self.r() + p,
        }
    }

    /// The server and local index of `row`'s data copy.
    ///
    /// Every pull and push asks this for each row it carries, several times over (worker
    /// routing, server ownership check, local index), and [`StripeLayout::data_slot`]
    /// takes six integer divisions. With one group (the common case) three do: the rest
    /// are sums of values below `n`, reduced by a subtraction.
    pub fn row_slot(&self, table: usize, row: usize) -> StripeSlot {
        let (j, i) = self.stripe_of(row);
        if self.params.groups != 1 {
            return self.data_slot(table, j, i);
        }
        let n = self.servers;
        let (cycle, in_cycle) = (j / n, j % n);
        let mut rotation = in_cycle + table % n;
        if rotation >= n {
            rotation -= n;
        }
        // i < k < n, so one subtraction reduces it.
        let mut server = rotation + i;
        if server >= n {
            server -= n;
        }
        StripeSlot {
            server,
            local: cycle * self.k() + i,
        }
    }

    /// Stripes of a `rows`-row table that fall to group `g`.
    fn group_stripes(&self, g: usize, rows: usize) -> usize {
        self.stripes(rows)
            .saturating_sub(g)
            .div_ceil(self.params.groups)
    }

    /// Whole cycles of `server`'s slots in which every slot holds a stripe: its data slots
    /// below `full_cycles * k` and parity slots below `full_cycles * r` are never padding.
    /// Lets a caller treat the bulk of a shard as one range and test slot by slot only the
    /// last, partly used cycle (a replacement marks every slot pending without a pass over
    /// the shard, so its resume does not grow with the shard).
    pub fn full_cycles(&self, server: usize, rows: usize) -> usize {
        let (g, _) = self.group_of_server(server);
        self.group_stripes(g, rows) / self.group(g).1
    }

    /// Data and parity slots `server` allocates for a `rows`-row table: whole cycles, so
    /// some trailing slots may be padding.
    pub fn capacity(&self, server: usize, rows: usize) -> (usize, usize) {
        let (g, _) = self.group_of_server(server);
        let n = self.group(g).1;
        let cycles = self.group_stripes(g, rows).div_ceil(n);
        (cycles * self.k(), cycles * self.r())
    }

    /// The stripe and position stored at data slot `local` of `server`, if that slot is
    /// a stripe of the table at all.
    pub fn data_at(
        &self,
        table: usize,
        server: usize,
        local: usize,
        rows: usize,
    ) -> Option<(usize, usize)> {
        let (g, m) = self.group_of_server(server);
        let n = self.group(g).1;
        let (c, i) = (local / self.k(), local % self.k());
        let o = (m + n - i % n) % n;
        let q = c * n + (o + n - table % n) % n;
        (q < self.group_stripes(g, rows)).then_some((q * self.params.groups + g, i))
    }

    /// The global row at data slot `local` of `server`, or `None` for a padding slot.
    pub fn row_at(&self, table: usize, server: usize, local: usize, rows: usize) -> Option<usize> {
        let (j, i) = self.data_at(table, server, local, rows)?;
        let row = j * self.k() + i;
        (row < rows).then_some(row)
    }

    /// The stripe and parity index stored at parity slot `local` of `server`.
    pub fn parity_at(
        &self,
        table: usize,
        server: usize,
        local: usize,
        rows: usize,
    ) -> Option<(usize, usize)> {
        let (g, m) = self.group_of_server(server);
        let n = self.group(g).1;
        let (c, p) = (local / self.r(), local % self.r());
        let o = (m + 2 * n - (self.k() + p) % n) % n;
        let q = c * n + (o + n - table % n) % n;
        (q < self.group_stripes(g, rows)).then_some((q * self.params.groups + g, p))
    }

    /// Every cycle of `server`'s slots has the same shape (the rotation of the group's
    /// `s`-th stripe of a cycle is `(s + table) mod n`, whatever the cycle): per stripe of
    /// a cycle in which `server` holds a row, that row and where the stripe's other rows
    /// are, each as an offset inside its holder's cycle. A rebuild fetches whole cycle
    /// ranges from every survivor and decodes with this, without per-row layout
    /// arithmetic. Whether a stripe exists at all (the last cycle may be partly padding)
    /// is not part of the shape: see [`StripeLayout::full_cycles`].
    pub fn cycle_shape(&self, table: usize, server: usize) -> Vec<CycleStripe> {
        let (g, m) = self.group_of_server(server);
        let (start, n) = self.group(g);
        let (k, r) = (self.k(), self.r());
        (0..n)
            .filter_map(|s| {
                let o = (s + table) % n;
                let mine = (m + n - o) % n;
                (mine < k + r).then(|| CycleStripe {
                    stripe_in_cycle: s,
                    mine,
                    rows: (0..k + r)
                        .map(|y| CycleRow {
                            server: start + (o + y) % n,
                            parity: y >= k,
                            offset: if y < k { y } else { y - k },
                        })
                        .collect(),
                })
            })
            .collect()
    }

    /// The server that keeps a replica of `server`'s dense parameters: the next member of
    /// its group.
    pub fn dense_replica(&self, server: usize) -> usize {
        let (g, m) = self.group_of_server(server);
        let (start, n) = self.group(g);
        start + (m + 1) % n
    }

    /// The server whose dense parameters `server` replicates.
    pub fn dense_replicated_by(&self, server: usize) -> usize {
        let (g, m) = self.group_of_server(server);
        let (start, n) = self.group(g);
        start + (m + n - 1) % n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params() -> impl Strategy<Value = (EcParams, usize)> {
        (1usize..4, 1usize..3, 1usize..3, 0usize..3)
            .prop_map(|(k, r, groups, spare)| (EcParams { k, r, groups }, groups * (k + r) + spare))
    }

    proptest! {
        #[test]
        fn row_slot_agrees_with_the_stripe_arithmetic(
            (params, servers) in params(), row in 0usize..100_000, table in 0usize..64,
        ) {
            let layout = StripeLayout::new(params, servers).unwrap();
            let (j, i) = layout.stripe_of(row);
            prop_assert_eq!(layout.row_slot(table, row), layout.data_slot(table, j, i));
            // The general arithmetic, as `place` gives it, for every parity row.
            let (g, q, o) = layout.place(table, j);
            let (start, n) = layout.group(g);
            for p in 0..params.r {
                prop_assert_eq!(layout.parity_slot(table, j, p), StripeSlot {
                    server: start + (o + params.k + p) % n,
                    local: (q / n) * params.r + p,
                });
            }
        }

        #[test]
        fn every_row_and_parity_has_one_slot_and_stripes_use_distinct_servers(
            (params, servers) in params(), rows in 1usize..200, table in 0usize..7,
        ) {
            let layout = StripeLayout::new(params, servers).unwrap();
            let mut data_used = std::collections::HashSet::new();
            let mut parity_used = std::collections::HashSet::new();
            for j in 0..layout.stripes(rows) {
                let mut servers_of_stripe = std::collections::HashSet::new();
                for i in 0..params.k {
                    let slot = layout.data_slot(table, j, i);
                    prop_assert!(servers_of_stripe.insert(slot.server));
                    prop_assert!(data_used.insert((slot.server, slot.local)));
                    prop_assert!(slot.local < layout.capacity(slot.server, rows).0);
                    prop_assert_eq!(layout.data_at(table, slot.server, slot.local, rows), Some((j, i)));
                    let row = j * params.k + i;
                    let expect = (row < rows).then_some(row);
                    prop_assert_eq!(layout.row_at(table, slot.server, slot.local, rows), expect);
                }
                for p in 0..params.r {
                    let slot = layout.parity_slot(table, j, p);
                    prop_assert!(servers_of_stripe.insert(slot.server));
                    prop_assert!(parity_used.insert((slot.server, slot.local)));
                    prop_assert!(slot.local < layout.capacity(slot.server, rows).1);
                    prop_assert_eq!(layout.parity_at(table, slot.server, slot.local, rows), Some((j, p)));
                }
                // A stripe stays inside one group.
                let groups: std::collections::HashSet<usize> = servers_of_stripe
                    .iter()
                    .map(|&s| layout.group_of_server(s).0)
                    .collect();
                prop_assert_eq!(groups.len(), 1);
            }
            // Every slot of the full cycles holds a stripe.
            for s in 0..servers {
                let full = layout.full_cycles(s, rows);
                for local in 0..full * params.k {
                    prop_assert!(layout.data_at(table, s, local, rows).is_some());
                }
                for local in 0..full * params.r {
                    prop_assert!(layout.parity_at(table, s, local, rows).is_some());
                }
            }
            // Slots that hold no stripe are reported as such.
            for s in 0..servers {
                let (data, parity) = layout.capacity(s, rows);
                for local in 0..data {
                    if !data_used.contains(&(s, local)) {
                        prop_assert_eq!(layout.data_at(table, s, local, rows), None);
                    }
                }
                for local in 0..parity {
                    if !parity_used.contains(&(s, local)) {
                        prop_assert_eq!(layout.parity_at(table, s, local, rows), None);
                    }
                }
            }
        }

        /// The shape of a cycle says what the per-slot arithmetic says, for every cycle:
        /// a rebuild that decodes by the shape installs each row where it belongs.
        #[test]
        fn a_cycle_shape_places_every_row_as_the_slots_do(
            (params, servers) in params(), rows in 1usize..200, table in 0usize..7,
        ) {
            let layout = StripeLayout::new(params, servers).unwrap();
            let (k, r) = (params.k, params.r);
            for server in 0..servers {
                let shape = layout.cycle_shape(table, server);
                let (data_slots, parity_slots) = layout.capacity(server, rows);
                let (g, _) = layout.group_of_server(server);
                let n = layout.group(g).1;
                // Each of the server's k + r slots of a cycle comes from one stripe.
                prop_assert_eq!(shape.len(), k + r);
                for c in 0..data_slots / k {
                    for stripe in &shape {
                        let q = c * n + stripe.stripe_in_cycle;
                        let j = q * params.groups + g;
                        let mine = stripe.rows[stripe.mine];
                        prop_assert_eq!(mine.server, server);
                        let at = |row: &CycleRow| if row.parity {
                            c * r + row.offset
                        } else {
                            c * k + row.offset
                        };
                        if mine.parity {
                            prop_assert!(at(&mine) < parity_slots);
                            let expect = layout.parity_at(table, server, at(&mine), rows);
                            if let Some((jj, p)) = expect {
                                prop_assert_eq!((jj, p + k), (j, stripe.mine));
                            }
                        } else {
                            let expect = layout.data_at(table, server, at(&mine), rows);
                            if let Some((jj, i)) = expect {
                                prop_assert_eq!((jj, i), (j, stripe.mine));
                            }
                        }
                        if j < layout.stripes(rows) {
                            for (y, row) in stripe.rows.iter().enumerate() {
                                let slot = if y < k {
                                    layout.data_slot(table, j, y)
                                } else {
                                    layout.parity_slot(table, j, y - k)
                                };
                                prop_assert_eq!((slot.server, slot.local), (row.server, at(row)));
                            }
                        }
                    }
                }
            }
        }

        #[test]
        fn groups_tile_the_servers_and_replicas_stay_in_the_group((params, servers) in params()) {
            let layout = StripeLayout::new(params, servers).unwrap();
            let mut next = 0;
            for g in 0..params.groups {
                let (start, n) = layout.group(g);
                prop_assert_eq!(start, next);
                prop_assert!(n >= params.k + params.r);
                for m in 0..n {
                    prop_assert_eq!(layout.group_of_server(start + m), (g, m));
                    let replica = layout.dense_replica(start + m);
                    prop_assert_ne!(replica, start + m);
                    prop_assert_eq!(layout.dense_replicated_by(replica), start + m);
                    prop_assert_eq!(layout.group_of_server(replica).0, g);
                }
                next += n;
            }
            prop_assert_eq!(next, servers);
        }
    }

    #[test]
    fn parity_load_is_even_over_whole_cycles() {
        let params = EcParams {
            k: 2,
            r: 1,
            groups: 1,
        };
        let layout = StripeLayout::new(params, 3).unwrap();
        let mut parity = [0usize; 3];
        for j in 0..300 {
            parity[layout.parity_slot(0, j, 0).server] += 1;
        }
        assert_eq!(parity, [100, 100, 100]);
    }

    #[test]
    fn bad_combinations_name_the_keys() {
        let e = EcParams {
            k: 2,
            r: 1,
            groups: 1,
        }
        .validate(2)
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("cluster.servers = 2") && e.contains("ec.k + ec.r = 3"),
            "{e}"
        );
        let e = EcParams {
            k: 2,
            r: 1,
            groups: 2,
        }
        .validate(5)
        .unwrap_err()
        .to_string();
        assert!(e.contains("ec.groups = 2"), "{e}");
        let e = EcParams {
            k: 0,
            r: 1,
            groups: 1,
        }
        .validate(5)
        .unwrap_err()
        .to_string();
        assert!(e.contains("ec.k = 0"), "{e}");
    }
}
