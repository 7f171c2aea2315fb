//! Where every parameter lives. Versioned: a replacement server takes over a slot and the
//! version goes up, so workers holding an older map fetch the new one.
//!
//! Scheme `row-modulo-v1`: row `r` of table `t` lives on server `(r + t) mod S` at local
//! index `r / S`. Ids are already hashed into each table, so rows spread evenly, and the
//! `+ t` offset keeps every table's row 0 (missing values, the hottest row) off a single
//! server. The dense parameters are split into `S` contiguous ranges, server `s` holding
//! `[s * n / S, (s + 1) * n / S)` with their optimizer state.

use serde::{Deserialize, Serialize};

use crate::PsError;

pub const SCHEME: &str = "row-modulo-v1";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementMap {
    pub scheme: String,
    pub version: u64,
    /// Address of server `i` at index `i`; empty while the slot is vacant.
    pub servers: Vec<String>,
}

impl PlacementMap {
    pub fn new(servers: usize) -> Self {
        Self {
            scheme: SCHEME.to_string(),
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

/// The arithmetic of the placement scheme for a fixed server count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub servers: usize,
}

impl Layout {
    pub fn new(servers: usize) -> Result<Self, PsError> {
        if servers == 0 {
            return Err(PsError::Config("cluster.servers must be at least 1".into()));
        }
        Ok(Self { servers })
    }

    /// The server holding the primary copy of `row`.
    pub fn server_of(&self, table: usize, row: GlobalRow) -> usize {
        (row.0 as usize + table) % self.servers
    }

    /// `row`'s index within its primary server's part of the table.
    pub fn local_index(&self, row: GlobalRow) -> LocalRow {
        LocalRow(row.0 / self.servers as u32)
    }

    /// Every holder of `row`; the primary first. Row-modulo keeps a single copy.
    pub fn holders(&self, table: usize, row: GlobalRow) -> Vec<Holder> {
        vec![Holder {
            server: self.server_of(table, row),
            role: Role::Primary,
            local: self.local_index(row),
        }]
    }

    /// The global row at local index `local` of `server`'s part of `table`.
    pub fn global_row(&self, table: usize, server: usize, local: LocalRow) -> GlobalRow {
        let first = (server + self.servers - table % self.servers) % self.servers;
        GlobalRow((local.index() * self.servers + first) as u32)
    }

    /// Rows of a `rows`-row table that `server` holds.
    pub fn local_rows(&self, table: usize, server: usize, rows: usize) -> usize {
        let first = (server + self.servers - table % self.servers) % self.servers;
        rows.saturating_sub(first).div_ceil(self.servers)
    }

    /// The dense parameter range of `server` out of `total`.
    pub fn dense_range(&self, server: usize, total: usize) -> std::ops::Range<usize> {
        server * total / self.servers..(server + 1) * total / self.servers
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
                let local = layout.local_index(r);
                prop_assert_eq!(layout.global_row(table, s, local), r);
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
