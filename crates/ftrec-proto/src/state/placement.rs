//! Where every parameter lives. Versioned: a replacement server takes over a slot and the
//! version goes up, so workers holding an older map fetch the new one.
//!
//! Scheme `row-modulo-v1`: row `r` of table `t` lives on server `(r + t) mod S` at local
//! index `r / S`. Ids are already hashed into each table, so rows spread evenly, and the
//! `+ t` offset keeps every table's row 0 (missing values, the hottest row) off a single
//! server. The dense parameters are split into `S` contiguous ranges, server `s` holding
//! `[s * n / S, (s + 1) * n / S)` with their optimizer state.

use serde::{Deserialize, Serialize};

use ftrec_ec::StripeLayout;

use crate::error::{BadPlacement, ProtoError};

pub const SCHEME: &str = "row-modulo-v1";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementMap {
    pub scheme: String,
    pub version: u64,
    /// Address of server `i` at index `i`; empty while the slot is vacant.
    pub servers: Vec<String>,
}

impl PlacementMap {
    pub fn new(layout: &Layout) -> Self {
        let servers = layout.servers();
        Self {
            scheme: layout.scheme(),
            version: 1,
            servers: vec![String::new(); servers],
        }
    }

    /// Puts `address` in slot `server` and bumps the version.
    pub fn assign(&mut self, server: usize, address: String) {
        self.servers[server] = address;
        self.version += 1;
    }
}

/// A row id within a whole table, as workers and the single-process model see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GlobalRow(pub u32);

/// A row's index within one server's part of a table: the index into the shard's storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LocalRow(pub u32);

impl LocalRow {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a server holds a parameter as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// The copy that is read, updated by pushes and checkpointed.
    Primary,
    /// Holds coded redundancy for a stripe of primaries (erasure coding).
    Parity,
    /// Holds a full copy, updated alongside the primary.
    Replica,
    /// Holds nothing yet: waits to take a failed server's slot.
    Spare,
}

/// One holder of a row: which server, as what, at which local index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    pub server: usize,
    pub role: Role,
    pub local: LocalRow,
}

/// The arithmetic of the placement scheme for a fixed server count: row-modulo, or
/// `stripe-rotate-v1` (`ftrec_ec`) when rows are erasure coded. Dense ranges are the same
/// in both; a striped layout also names each range's replica holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    servers: usize,
    stripes: Option<StripeLayout>,
    /// Erasure coding: dense ranges replicated (true) or coded in dense stripes.
    replicate_dense: bool,
}

impl Layout {
    pub fn new(servers: usize) -> Result<Self, ProtoError> {
        if servers == 0 {
            return Err(BadPlacement::NoServers.into());
        }
        Ok(Self {
            servers,
            stripes: None,
            replicate_dense: true,
        })
    }

    pub fn striped(stripes: StripeLayout) -> Self {
        Self {
            servers: stripes.servers,
            stripes: Some(stripes),
            replicate_dense: true,
        }
    }

    /// With `false`, dense ranges are erasure coded in dense stripes rather than
    /// replicated (`ec.replicate_dense`).
    pub fn with_replicated_dense(mut self, replicate: bool) -> Self {
        self.replicate_dense = replicate;
        self
    }

    /// The same scheme and parameters over `servers` servers: the layout after a move to
    /// another server count (`cluster scale`).
    pub fn resized(&self, servers: usize) -> Result<Self, ProtoError> {
        let resized = match &self.stripes {
            Some(s) => Self::striped(StripeLayout::new(s.params, servers).map_err(|e| {
                BadPlacement::Code {
                    servers,
                    why: e.to_string(),
                }
            })?),
            None => Self::new(servers)?,
        };
        Ok(resized.with_replicated_dense(self.replicate_dense))
    }

    /// Dense ranges travel as differences to dense-stripe parity holders.
    pub fn dense_coded(&self) -> bool {
        self.stripes.is_some() && !self.replicate_dense
    }

    pub fn servers(&self) -> usize {
        self.servers
    }

    /// The scheme's name and parameters, as the placement map carries them.
    pub fn scheme(&self) -> String {
        match &self.stripes {
            Some(s) => format!(
                "{} k={} r={} groups={}{}",
                ftrec_ec::SCHEME,
                s.params.k,
                s.params.r,
                s.params.groups,
                if self.replicate_dense {
                    ""
                } else {
                    " dense=striped-v1"
                }
            ),
            None => SCHEME.to_string(),
        }
    }

    /// The stripe layout, when rows are erasure coded.
    pub fn stripes(&self) -> Option<StripeLayout> {
        self.stripes
    }

    /// The server holding the primary copy of `row`, and the row's index there: one
    /// placement computation where a caller needs both.
    pub fn primary(&self, table: usize, row: GlobalRow) -> (usize, LocalRow) {
        match &self.stripes {
            Some(s) => {
                let slot = s.row_slot(table, row.0 as usize);
                (slot.server, LocalRow(slot.local as u32))
            }
            None => (
                (row.0 as usize + table) % self.servers,
                LocalRow(row.0 / self.servers as u32),
            ),
        }
    }

    /// The server holding the primary copy of `row`.
    pub fn server_of(&self, table: usize, row: GlobalRow) -> usize {
        match &self.stripes {
            Some(s) => s.row_slot(table, row.0 as usize).server,
            None => (row.0 as usize + table) % self.servers,
        }
    }

    /// `row`'s index within its primary server's part of the table.
    pub fn local_index(&self, table: usize, row: GlobalRow) -> LocalRow {
        match &self.stripes {
            Some(s) => LocalRow(s.row_slot(table, row.0 as usize).local as u32),
            None => LocalRow(row.0 / self.servers as u32),
        }
    }

    /// Every holder of `row`; the primary first, then (erasure coded) the holders of its
    /// stripe's parity rows, at their parity-slot indices.
    pub fn holders(&self, table: usize, row: GlobalRow) -> Vec<Holder> {
        let (server, local) = self.primary(table, row);
        let mut holders = vec![Holder {
            server,
            role: Role::Primary,
            local,
        }];
        if let Some(s) = &self.stripes {
            let (stripe, _) = s.stripe_of(row.0 as usize);
            holders.extend((0..s.params.r).map(|p| {
                let slot = s.parity_slot(table, stripe, p);
                Holder {
                    server: slot.server,
                    role: Role::Parity,
                    local: LocalRow(slot.local as u32),
                }
            }));
        }
        holders
    }

    /// The global row at local index `local` of `server`'s part of a `rows`-row table;
    /// `None` for a striped layout's padding slots.
    pub fn global_row(
        &self,
        table: usize,
        server: usize,
        local: LocalRow,
        rows: usize,
    ) -> Option<GlobalRow> {
        let row = match &self.stripes {
            Some(s) => s.row_at(table, server, local.index(), rows)?,
            None => {
                let first = (server + self.servers - table % self.servers) % self.servers;
                local.index() * self.servers + first
            }
        };
        (row < rows).then_some(GlobalRow(row as u32))
    }

    /// Row slots `server` stores for a `rows`-row table (a striped layout counts whole
    /// rotation cycles, padding included).
    pub fn local_rows(&self, table: usize, server: usize, rows: usize) -> usize {
        match &self.stripes {
            Some(s) => s.capacity(server, rows).0,
            None => {
                let first = (server + self.servers - table % self.servers) % self.servers;
                rows.saturating_sub(first).div_ceil(self.servers)
            }
        }
    }

    /// Parity row slots `server` stores for a `rows`-row table (0 without coding).
    pub fn parity_rows(&self, server: usize, rows: usize) -> usize {
        self.stripes.map_or(0, |s| s.capacity(server, rows).1)
    }

    /// The dense parameter range of `server` out of `total`.
    pub fn dense_range(&self, server: usize, total: usize) -> std::ops::Range<usize> {
        server * total / self.servers..(server + 1) * total / self.servers
    }

    /// The server whose dense range `server` keeps a replica of (erasure coded only).
    pub fn replicates(&self, server: usize) -> Option<usize> {
        self.stripes
            .filter(|_| self.replicate_dense)
            .map(|s| s.dense_replicated_by(server))
    }

    /// The server keeping the replica of `server`'s dense range (erasure coded only).
    pub fn replica_of(&self, server: usize) -> Option<usize> {
        self.stripes
            .filter(|_| self.replicate_dense)
            .map(|s| s.dense_replica(server))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn every_row_has_exactly_one_home_and_local_indices_are_dense(
            servers in 1usize..7, rows in 1usize..300, table in 0usize..30,
        ) {
            let layout = Layout::new(servers).unwrap();
            let mut seen = vec![0usize; servers];
            for r in (0..rows as u32).map(GlobalRow) {
                let s = layout.server_of(table, r);
                let local = layout.local_index(table, r);
                prop_assert_eq!(layout.global_row(table, s, local, rows), Some(r));
                prop_assert!(local.index() < layout.local_rows(table, s, rows));
                let holders = layout.holders(table, r);
                prop_assert_eq!(holders[0], Holder { server: s, role: Role::Primary, local });
                seen[s] += 1;
            }
            for (s, &n) in seen.iter().enumerate() {
                prop_assert_eq!(n, layout.local_rows(table, s, rows));
            }
        }

        #[test]
        fn striped_rows_have_one_primary_and_their_stripe_parity_elsewhere(
            k in 1usize..4, r in 1usize..3, spare in 0usize..3, rows in 1usize..200, table in 0usize..9,
        ) {
            let params = ftrec_ec::EcParams { k, r, groups: 1 };
            let layout = Layout::striped(StripeLayout::new(params, k + r + spare).unwrap());
            let mut seen = std::collections::HashSet::new();
            for g in (0..rows as u32).map(GlobalRow) {
                let holders = layout.holders(table, g);
                prop_assert_eq!(holders.len(), 1 + r);
                let primary = holders[0];
                prop_assert_eq!(primary.role, Role::Primary);
                prop_assert!(seen.insert((primary.server, primary.local)));
                prop_assert!(primary.local.index() < layout.local_rows(table, primary.server, rows));
                prop_assert_eq!(layout.global_row(table, primary.server, primary.local, rows), Some(g));
                for h in &holders[1..] {
                    prop_assert_eq!(h.role, Role::Parity);
                    prop_assert_ne!(h.server, primary.server);
                    prop_assert!(h.local.index() < layout.parity_rows(h.server, rows));
                }
            }
        }

        #[test]
        fn dense_ranges_tile_the_parameters(servers in 1usize..9, total in 0usize..5000) {
            let layout = Layout::new(servers).unwrap();
            let mut next = 0;
            for s in 0..servers {
                let r = layout.dense_range(s, total);
                prop_assert_eq!(r.start, next);
                next = r.end;
            }
            prop_assert_eq!(next, total);
        }
    }
}
