//! Leases: granted with a TTL, renewed by keep-alives, and on expiry or revocation
//! deleting every key attached to them in one revision, as etcd's lessor does. Deadlines
//! are `tokio::time` instants, so under turmoil they follow the simulated clock.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;
use tonic::Status;

use crate::store::Store;

/// etcd's smallest TTL with its default election timeout (1 s, heartbeat 100 ms):
/// `ceil(1.5 × election timeout)`. A shorter TTL asked for is granted as this.
pub(crate) const MIN_TTL: i64 = 2;
/// etcd's `MaxLeaseTTL`.
const MAX_TTL: i64 = 9_000_000_000;

pub(crate) struct Lease {
    /// The TTL granted, in seconds.
    pub ttl: i64,
    pub deadline: Instant,
    pub keys: BTreeSet<Vec<u8>>,
}

#[derive(Default)]
pub(crate) struct Leases {
    leases: BTreeMap<i64, Lease>,
    /// Ids handed out by the server: etcd's are random 63-bit numbers; these only need
    /// to be unique and non-zero, and deterministic for a seeded simulation.
    next_id: i64,
}

impl Leases {
    pub fn contains(&self, id: i64) -> bool {
        self.leases.contains_key(&id)
    }

    pub fn get(&self, id: i64) -> Option<&Lease> {
        self.leases.get(&id)
    }

    pub fn ids(&self) -> Vec<i64> {
        self.leases.keys().copied().collect()
    }

    pub fn attach(&mut self, id: i64, key: &[u8]) {
        if let Some(l) = self.leases.get_mut(&id) {
            l.keys.insert(key.to_vec());
        }
    }

    pub fn detach(&mut self, id: i64, key: &[u8]) {
        if let Some(l) = self.leases.get_mut(&id) {
            l.keys.remove(key);
        }
    }

    /// Grants a lease of `ttl` seconds with `id`, or a new id when 0; returns the id and
    /// the TTL granted.
    pub fn grant(&mut self, id: i64, ttl: i64) -> Result<(i64, i64), Status> {
        if ttl > MAX_TTL {
            return Err(Status::out_of_range("etcdserver: too large lease TTL"));
        }
        let id = if id == 0 {
            loop {
                self.next_id += 1;
                // Shaped like etcd's (large, hex-printed), so that logs look alike.
                let candidate = 0x694d_0000_0000_0000 + self.next_id;
                if !self.leases.contains_key(&candidate) {
                    break candidate;
                }
            }
        } else if self.leases.contains_key(&id) {
            return Err(Status::failed_precondition(
                "etcdserver: lease already exists",
            ));
        } else {
            id
        };
        let ttl = ttl.max(MIN_TTL);
        self.leases.insert(
            id,
            Lease {
                ttl,
                deadline: Instant::now() + secs(ttl),
                keys: BTreeSet::new(),
            },
        );
        Ok((id, ttl))
    }

    /// Resets the lease's deadline to a full TTL from now; its TTL, or `None` when it is
    /// gone (or expired, and about to go).
    pub fn renew(&mut self, id: i64) -> Option<i64> {
        let now = Instant::now();
        let l = self.leases.get_mut(&id)?;
        if l.deadline <= now {
            return None;
        }
        l.deadline = now + secs(l.ttl);
        Some(l.ttl)
    }

    /// Every lease gets a full TTL from now, as when etcd elects a new raft leader.
    pub fn renew_all(&mut self) {
        let now = Instant::now();
        for l in self.leases.values_mut() {
            l.deadline = now + secs(l.ttl);
        }
    }

    pub fn expired(&self, now: Instant) -> Vec<i64> {
        self.leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect()
    }

    fn remove(&mut self, id: i64) -> Option<Lease> {
        self.leases.remove(&id)
    }
}

fn secs(s: i64) -> Duration {
    Duration::from_secs(s.max(0) as u64)
}

impl Store {
    /// Revokes a lease: its keys go in one write transaction. Returns false when there is
    /// no such lease.
    pub fn revoke(&mut self, id: i64) -> bool {
        let Some(lease) = self.leases.remove(id) else {
            return false;
        };
        let mut write = self.write();
        for key in &lease.keys {
            write.delete(key, &[]);
        }
        write.commit();
        true
    }

    /// Revokes every lease whose deadline has passed.
    pub fn expire(&mut self, now: Instant) {
        for id in self.leases.expired(now) {
            tracing::debug!("in-memory etcd: lease {id:x} expired");
            self.revoke(id);
        }
    }
}
